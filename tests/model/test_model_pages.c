/* A window touches only its own tensors.
 *
 * Copies llama-f32.gguf (4 blocks, ~1 MiB per block, 16 MiB embedding and
 * 16 MiB output) to a file of our own, drops it from the page cache
 * (fdatasync + POSIX_FADV_DONTNEED), loads the middle window [1,3) (no
 * embedding, no head), runs a forward pass on a boundary, and then asks the
 * kernel which pages of the file are resident (mincore on a fresh mapping).
 * Pages of the window's tensors must have been read; pages of every other
 * tensor must not (kvs_gguf_open disables read-around and the window asks
 * for exactly its tensors with kvs_gguf_willneed), except a page shared with
 * the window's first or last tensor. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "model/model.h"

#define MARGIN 4096u /* a tensor sharing the window's first/last page, bytes */

static int copy_file(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb");
    if (!in) return -1;
    FILE *out = fopen(to, "wb");
    if (!out) {
        fclose(in);
        return -1;
    }
    char buf[1 << 16];
    size_t n;
    int rc = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) rc = -1;
    fclose(in);
    if (fflush(out) || fdatasync(fileno(out))) rc = -1;
    if (fclose(out)) rc = -1;
    return rc;
}

static int block_of(const char *name)
{
    if (strncmp(name, "blk.", 4)) return -1;
    return (int)strtol(name + 4, NULL, 10);
}

static void test_window_pages(void **state)
{
    (void)state;
    const char *shared = getenv("KVASIR_SHARED");
    if (!shared) skip();
    char src[4096], path[256];
    snprintf(src, sizeof src, "%s/models/llama-f32.gguf", shared);
    snprintf(path, sizeof path, "kvs_pages_%d.gguf", (int)getpid());
    assert_int_equal(copy_file(src, path), 0);

    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);

    struct kvs_gguf *g = NULL;
    char err[256];
    assert_int_equal(kvs_gguf_open(path, &g, err, sizeof err), KVS_OK);
    struct kvs_model_params mp = kvs_model_default_params();
    mp.block_begin = 1;
    mp.block_end = 3;
    mp.n_ctx = 16;
    mp.n_threads = 1;
    struct kvs_model *m = NULL;
    assert_int_equal(kvs_model_load(g, &mp, &m, err, sizeof err), KVS_OK);
    assert_false(kvs_model_has_embd(m));
    assert_false(kvs_model_has_head(m));
    const uint32_t n_embd = kvs_model_hparams(m)->n_embd;
    assert_int_equal(n_embd, 128);

    float *in = calloc(2 * n_embd, sizeof *in), *out = calloc(2 * n_embd, sizeof *out);
    for (uint32_t i = 0; i < 2 * n_embd; i++) in[i] = (float)((int)(i % 7) - 3) * 0.25f;
    int32_t seq[2] = { 0, 0 }, pos[2] = { 0, 1 };
    struct kvs_batch b = { .n_tokens = 2, .embd = in, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_OK);

    /* Residency of every page of the file. */
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE), size = (size_t)st.st_size;
    const size_t n_pages = (size + pg - 1) / pg;
    void *map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    assert_true(map != MAP_FAILED);
    unsigned char *vec = malloc(n_pages);
    assert_int_equal(mincore(map, size, vec), 0);

    /* The window's byte range [lo, hi). */
    const uint64_t data = kvs_gguf_data_offset(g);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        int blk = block_of(t->name);
        if (blk < 1 || blk >= 3) continue;
        if (data + t->offset < lo) lo = data + t->offset;
        if (data + t->offset + t->bytes > hi) hi = data + t->offset + t->bytes;
    }
    assert_true(lo < hi);

    size_t in_pages = 0, in_res = 0, out_pages = 0, out_res = 0;
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        const uint64_t a = data + t->offset, z = a + t->bytes;
        int blk = block_of(t->name);
        const int mine = blk >= 1 && blk < 3;
        for (uint64_t p = (a + pg - 1) / pg; (p + 1) * pg <= z; p++) { /* whole pages only */
            const uint64_t pa = p * pg;
            if (mine) {
                in_pages++;
                in_res += vec[p] & 1;
            } else if (pa + pg + MARGIN <= lo || pa >= hi + MARGIN) {
                out_pages++;
                if (vec[p] & 1) {
                    out_res++;
                    if (out_res <= 5) print_message("resident page %zu of foreign tensor %s\n", (size_t)p, t->name);
                }
            }
        }
    }
    print_message("window [1,3): %zu/%zu pages resident; other tensors: %zu/%zu resident (outside the margin)\n",
                  in_res, in_pages, out_res, out_pages);
    assert_true(out_pages > 8000);      /* embedding + output + blocks 0 and 3: ~34 MiB */
    assert_int_equal(out_res, 0);
    assert_true(in_res * 10 >= in_pages * 9);

    munmap(map, size);
    free(vec);
    free(in);
    free(out);
    kvs_model_free(m);
    kvs_gguf_close(g);
    close(fd);
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = { cmocka_unit_test(test_window_pages) };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
