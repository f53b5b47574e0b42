/* Real blocks: every 2-D tensor of a supported type in the shared test models
 * (../shared/models, see models/README.md: they cover F16, BF16, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). For a few rows of each:
 * the dequantized values are finite, vec_dot equals the float dot of the
 * dequantized operands, and every SIMD table matches the scalar one. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "gguf/gguf.h"
#include "kernels/kernels.h"

#define TOL_FLOAT_DOT 1e-5 /* relative to sum |w*a|, as in test_kernels_dot.c */
#define TOL_REORDER 2e-5

static const char *const models[] = {"llama-mixed.gguf", "llama-q4_k_m.gguf", "llama-q5_k_m.gguf",
                                     "llama-q2_k.gguf", "qwen2-mixed.gguf", "qwen3-q8_0.gguf"};

static void check_model(const char *dir, const char *name, int *n_checked)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/models/%s", dir, name);
    struct kvs_gguf *g = NULL;
    char err[256] = "";
    if (kvs_gguf_open(path, &g, err, sizeof err) != KVS_OK) {
        print_message("skipping %s: %s\n", path, err);
        return;
    }
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    const struct kvs_kernels *simd[] = {kvs_kernels_get(KVS_ISA_AVX2), kvs_kernels_get(KVS_ISA_AVX512),
                                        kvs_kernels_get(KVS_ISA_NEON)};
    for (size_t ti = 0; ti < kvs_gguf_n_tensors(g); ti++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, ti);
        if (t->n_dims != 2 || !kvs_type_supported(t->type) || t->type == KVS_TYPE_F32 || !t->data)
            continue;
        int64_t K = t->ne[0];
        enum kvs_type vt = kvs_vec_dot_type(t->type);
        size_t rb = kvs_type_row_bytes(t->type, K);
        assert_true(rb > 0);
        float *wf = malloc(sizeof(float) * (size_t)K), *x = malloc(sizeof(float) * (size_t)K);
        float *af = malloc(sizeof(float) * (size_t)K);
        void *a = malloc(kvs_type_row_bytes(vt, K));
        for (int64_t i = 0; i < K; i++)
            x[i] = sinf((float)i * 0.37f) * 1.5f;
        kvs_quantize_act(ref, vt, x, a, K);
        kvs_dequantize_row(ref, vt, a, af, K);
        int64_t rows = t->ne[1] < 8 ? t->ne[1] : 8;
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *w = (const uint8_t *)t->data + (size_t)r * rb;
            kvs_dequantize_row(ref, t->type, w, wf, K);
            double dot = 0.0, mag = 0.0;
            for (int64_t i = 0; i < K; i++) {
                assert_true(isfinite(wf[i]));
                dot += (double)wf[i] * af[i];
                mag += fabs((double)wf[i] * af[i]);
            }
            float s = kvs_vec_dot(ref, t->type, K, w, a);
            /* Q8_1's f16 block sum s adds up to 2^-11 relative on the min term */
            double tol = (vt == KVS_TYPE_Q8_1 ? 1e-3 : TOL_FLOAT_DOT) * mag + 1e-30;
            if (fabs(s - dot) > tol) {
                print_error("%s %s row %lld: vec_dot %.9g float %.9g\n", name, t->name, (long long)r, s, dot);
                fail();
            }
            for (size_t k = 0; k < 3; k++) {
                if (!simd[k])
                    continue;
                float s2 = kvs_vec_dot(simd[k], t->type, K, w, a);
                if (fabs((double)s2 - s) > TOL_REORDER * mag + 1e-30) {
                    print_error("%s %s row %lld: %s %.9g scalar %.9g\n", name, t->name, (long long)r,
                                kvs_isa_name(kvs_kernels_isa(simd[k])), s2, s);
                    fail();
                }
            }
        }
        (*n_checked)++;
        free(wf), free(x), free(af), free(a);
    }
    kvs_gguf_close(g);
}

static void test_model_tensors(void **state)
{
    (void)state;
    const char *dir = getenv("KVASIR_SHARED");
    if (!dir || !*dir)
        skip();
    int n = 0;
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++)
        check_model(dir, models[i], &n);
    print_message("checked %d tensors\n", n);
    if (n == 0)
        skip();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_tensors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
