/* kvasir key: a node's identity key (src/trust/trust.h). */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "trust/trust.h"

static void key_usage(FILE *f)
{
    fprintf(f, "usage: kvasir key gen -o FILE        make a node key (Ed25519), file mode 0600, never overwritten\n"
               "       kvasir key show [--public] FILE  print its public key and fingerprint\n"
               "  The public key (64 hex digits) is what a manifest's ranks[].key, an inventory's \"key\",\n"
               "  --next-key and --prev-key name; the fingerprint (16 hex digits) is what logs and\n"
               "  refusals print. --public prints the public key alone.\n");
}

static int show(const struct kvs_key *k, bool only_public)
{
    uint8_t pub[KVS_KEY_PUB_BYTES];
    char hex[KVS_KEY_PUB_HEX + 1], fp[KVS_KEY_FP_HEX + 1];
    kvs_key_public(k, pub);
    kvs_key_public_hex(pub, hex);
    kvs_key_fingerprint(pub, fp);
    if (only_public) printf("%s\n", hex);
    else printf("public_key: %s\nfingerprint: %s\n", hex, fp);
    return 0;
}

int kvs_cli_key(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        key_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    char err[512];
    if (!strcmp(argv[1], "gen")) {
        const char *out = NULL;
        for (int i = 2; i < argc; i++) {
            if ((!strcmp(argv[i], "-o") || !strcmp(argv[i], "--output")) && i + 1 < argc) out = argv[++i];
            else {
                fprintf(stderr, "kvasir key gen: unknown option %s\n", argv[i]);
                key_usage(stderr);
                return 2;
            }
        }
        if (!out) {
            fprintf(stderr, "kvasir key gen: -o FILE is required\n");
            return 2;
        }
        struct kvs_key *k;
        kvs_err e = kvs_key_generate(&k);
        if (!e) e = kvs_key_save(k, out, err, sizeof err);
        else snprintf(err, sizeof err, "cannot make a key");
        if (e) {
            fprintf(stderr, "kvasir key gen: %s (%s)\n", err, kvs_strerror(e));
            kvs_key_free(k);
            return 1;
        }
        show(k, false);
        kvs_key_free(k);
        return 0;
    }
    if (!strcmp(argv[1], "show")) {
        bool only_public = false;
        const char *path = NULL;
        for (int i = 2; i < argc; i++) {
            if (!strcmp(argv[i], "--public")) only_public = true;
            else if (!path && argv[i][0] != '-') path = argv[i];
            else {
                fprintf(stderr, "kvasir key show: unknown option %s\n", argv[i]);
                return 2;
            }
        }
        if (!path) {
            fprintf(stderr, "kvasir key show: FILE is required\n");
            return 2;
        }
        struct kvs_key *k;
        kvs_err e = kvs_key_load(path, &k, err, sizeof err);
        if (e) {
            fprintf(stderr, "kvasir key show: %s (%s)\n", err, kvs_strerror(e));
            return 1;
        }
        show(k, only_public);
        kvs_key_free(k);
        return 0;
    }
    fprintf(stderr, "kvasir key: unknown subcommand %s\n", argv[1]);
    key_usage(stderr);
    return 2;
}
