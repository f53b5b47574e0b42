/* kvasir tokenize -m MODEL -p TEXT [--bos] [--special] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir tokenize -m MODEL -p TEXT [--bos] [--special]\n"
               "Prints the token ids of TEXT under MODEL's tokenizer, separated by single spaces.\n"
               "  --bos      prepend the BOS token (if the vocabulary has one)\n"
               "  --special  match special-token texts such as <|im_start|> as tokens\n");
}

int kvs_cli_tokenize(int argc, char **argv)
{
    const char *model = NULL, *text = NULL;
    bool bos = false, special = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && v) {
            model = v;
            i++;
        } else if ((!strcmp(a, "-p") || !strcmp(a, "--prompt")) && v) {
            text = v;
            i++;
        } else if (!strcmp(a, "--bos")) {
            bos = true;
        } else if (!strcmp(a, "--special")) {
            special = true;
        } else {
            fprintf(stderr, "kvasir tokenize: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!model || !text) {
        usage(stderr);
        return 2;
    }
    char msg[512] = "";
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_open(model, &g, msg, sizeof msg);
    if (e != KVS_OK) {
        fprintf(stderr, "kvasir tokenize: %s: %s: %s\n", model, kvs_strerror(e), msg);
        return 1;
    }
    struct kvs_tokenizer *t = NULL;
    e = kvs_tokenizer_load(g, &t, msg, sizeof msg);
    kvs_gguf_close(g);
    if (e != KVS_OK) {
        fprintf(stderr, "kvasir tokenize: %s: tokenizer: %s: %s\n", model, kvs_strerror(e), msg);
        return 1;
    }
    size_t len = strlen(text);
    int64_t n = kvs_tokenize(t, text, len, bos, special, NULL, 0);
    int32_t *ids = n > 0 ? malloc((size_t)n * sizeof *ids) : NULL;
    if (n < 0 || (n > 0 && !ids) || (n > 0 && kvs_tokenize(t, text, len, bos, special, ids, n) != n)) {
        fprintf(stderr, "kvasir tokenize: %s\n", kvs_strerror(n < 0 ? (kvs_err)-n : KVS_ERR_NOMEM));
        free(ids);
        kvs_tokenizer_free(t);
        return 1;
    }
    for (int64_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    kvs_tokenizer_free(t);
    return fflush(stdout) == 0 ? 0 : 1;
}
