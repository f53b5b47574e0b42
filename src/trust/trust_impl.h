/* Internals shared by the trust module's files (not a public header). */
#ifndef KVS_TRUST_IMPL_H
#define KVS_TRUST_IMPL_H

#include <openssl/evp.h>

#include "trust/trust.h"

struct kvs_key {
    EVP_PKEY *pk; /* Ed25519 private key */
};

#endif
