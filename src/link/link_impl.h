/* Internal to src/link: helpers the transports share. */
#ifndef KVS_LINK_IMPL_H
#define KVS_LINK_IMPL_H

#include <stddef.h>

#include "common/error.h"

/* read / write of struct kvs_link_ops on a non-blocking stream socket fd
 * (TCP or AF_UNIX), with the contract given there. */
kvs_err kvs_link_fd_read(int fd, void *buf, size_t cap, size_t *got);
kvs_err kvs_link_fd_write(int fd, const void *buf, size_t len, int timeout_ms);

#endif
