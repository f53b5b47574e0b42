/* The OpenCL kernels against the CPU scalar reference (src/kernels): random
 * weight blocks of every type with a kernel, odd row counts and rows whose
 * block count is not a multiple of the work-group size, several activation
 * rows (11: a full tile of 8 rows and a partial one), the MoE expert product, RMSNorm and SwiGLU,
 * the qwen35 kernels (Gated DeltaNet chain, gated attention, shared-expert gate); plus the start-up
 * errors (bad device index, kernel build failure with the compiler's log,
 * a buffer larger than the device allows). Runs on PoCL in CI. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "ocl/ocl.h"

static struct kvs_ocl *C;

static int setup(void **st)
{
    (void)st;
    char err[4096] = "";
    kvs_err e = kvs_ocl_open(0, &C, err, sizeof err);
    if (e) fprintf(stderr, "kvs_ocl_open: %s (%s)\n", kvs_strerror(e), err);
    return e ? -1 : 0;
}

static int teardown(void **st)
{
    (void)st;
    kvs_ocl_close(C);
    return 0;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rndf(void) { return (float)(rnd() % 20001) / 10000.0f - 1.0f; } /* [-1, 1] */

static void put_f16(uint8_t *p, float v)
{
    uint16_t h = kvs_f32_to_f16(v);
    memcpy(p, &h, 2);
}

/* N rows of K values of `type`: random bytes, with every block's F16 scale
 * fields set to small positive values (random bytes there could be NaN). */
static void *random_weights(enum kvs_type type, int64_t K, int64_t N, size_t *row_bytes)
{
    const size_t rb = kvs_type_row_bytes(type, K);
    uint8_t *w = malloc(rb * (size_t)N);
    assert_non_null(w);
    *row_bytes = rb;
    if (type == KVS_TYPE_F32) {
        for (int64_t i = 0; i < K * N; i++) ((float *)w)[i] = rndf();
        return w;
    }
    if (type == KVS_TYPE_F16 || type == KVS_TYPE_BF16) {
        for (int64_t i = 0; i < K * N; i++) {
            const uint16_t h = type == KVS_TYPE_F16 ? kvs_f32_to_f16(rndf()) : kvs_f32_to_bf16(rndf());
            memcpy(w + 2 * i, &h, 2);
        }
        return w;
    }
    for (size_t i = 0; i < rb * (size_t)N; i++) w[i] = (uint8_t)rnd();
    size_t bsz;
    switch (type) {
    case KVS_TYPE_Q8_0: bsz = 34; break;
    case KVS_TYPE_Q4_0: bsz = 18; break;
    case KVS_TYPE_Q4_1: bsz = 20; break;
    case KVS_TYPE_Q5_0: bsz = 22; break;
    case KVS_TYPE_Q5_1: bsz = 24; break;
    case KVS_TYPE_Q2_K: bsz = 84; break;
    case KVS_TYPE_Q3_K: bsz = 110; break;
    case KVS_TYPE_Q4_K: bsz = 144; break;
    case KVS_TYPE_Q5_K: bsz = 176; break;
    case KVS_TYPE_Q6_K: bsz = 210; break;
    default: fail_msg("type"); return NULL;
    }
    for (size_t b = 0; b < rb * (size_t)N / bsz; b++) {
        uint8_t *blk = w + b * bsz;
        const float d = 0.001f + (float)(rnd() % 1000) * 1e-5f;
        /* offsets of d (and of the min scale dmin / m) in each layout (gguf-facts §2.3/§2.4) */
        if (type == KVS_TYPE_Q6_K) {
            put_f16(blk + 208, d);
        } else if (type == KVS_TYPE_Q3_K) {
            put_f16(blk + 108, d);
        } else if (type == KVS_TYPE_Q2_K) {
            put_f16(blk + 80, d);
            put_f16(blk + 82, d * 0.5f);
        } else {
            put_f16(blk, d);
            if (type == KVS_TYPE_Q4_K || type == KVS_TYPE_Q5_K || type == KVS_TYPE_Q4_1 || type == KVS_TYPE_Q5_1)
                put_f16(blk + 2, d * 0.5f);
        }
    }
    return w;
}

static struct kvs_ocl_buf *upload(const void *src, size_t bytes)
{
    struct kvs_ocl_buf *b = NULL;
    char err[256];
    assert_int_equal(kvs_ocl_alloc(C, bytes, &b, err, sizeof err), KVS_OK);
    if (src) assert_int_equal(kvs_ocl_write(C, b, 0, src, bytes), KVS_OK);
    return b;
}

static double max_abs(const float *y, size_t n)
{
    double m = 1e-6;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)y[i]));
    return m;
}

/* CPU reference of y[r][n] = W_{ids[r]}[n] · x[r / div] via the scalar table. */
static void ref_matmul(enum kvs_type type, const uint8_t *w, size_t rb, size_t stride, const int32_t *ids,
                       int64_t K, int64_t N, const float *x, int64_t div, int64_t R, float *y)
{
    const struct kvs_kernels *k = kvs_kernels_get(KVS_ISA_SCALAR);
    const enum kvs_type at = kvs_vec_dot_type(type);
    uint8_t *act = malloc(kvs_type_row_bytes(at, K));
    assert_non_null(act);
    for (int64_t r = 0; r < R; r++) {
        kvs_quantize_act(k, at, x + (size_t)(r / div) * (size_t)K, act, K);
        const uint8_t *we = w + (ids ? (size_t)ids[r] * stride : 0);
        for (int64_t n = 0; n < N; n++) y[r * N + n] = kvs_vec_dot(k, type, K, we + (size_t)n * rb, act);
    }
    free(act);
}

static void check_matmul(enum kvs_type type, int64_t K, int64_t N, int64_t R, int64_t n_exp)
{
    size_t rb;
    uint8_t *w = random_weights(type, K, N * n_exp, &rb);
    const size_t stride = rb * (size_t)N;
    float *x = malloc((size_t)(R * K) * sizeof(float)), *y = malloc((size_t)(R * N * 4) * sizeof(float));
    float *ref = malloc((size_t)(R * N * 4) * sizeof(float));
    int32_t ids[64]; /* R = 11 rows: a tile of 8 and a partial one */
    assert_true(x && y && ref && R * 4 <= 64);
    for (int64_t i = 0; i < R * K; i++) x[i] = rndf() * 2.0f;
    struct kvs_ocl_buf *bw = upload(w, stride * (size_t)n_exp), *bx = upload(x, (size_t)(R * K) * sizeof(float));
    struct kvs_ocl_buf *by = upload(NULL, (size_t)(R * N * 4) * sizeof(float));
    struct kvs_ocl_buf *ba = upload(NULL, kvs_ocl_act_row_bytes(type, K) * (size_t)R + 16);
    struct kvs_ocl_weight W = { .buf = bw, .type = type, .K = K, .N = N, .row_bytes = rb, .expert_stride = stride };
    double d = 0.0;
    if (n_exp == 1) {
        kvs_ocl_matmul(C, &W, bx, R, by, ba);
        assert_int_equal(kvs_ocl_read(C, by, 0, y, (size_t)(R * N) * sizeof(float)), KVS_OK);
        ref_matmul(type, w, rb, 0, NULL, K, N, x, 1, R, ref);
        const double s = max_abs(ref, (size_t)(R * N));
        for (int64_t i = 0; i < R * N; i++) d = fmax(d, fabs((double)y[i] - ref[i]) / s);
    } else { /* 4 expert rows per activation row, experts chosen at random */
        const int64_t RR = R * 4;
        for (int64_t r = 0; r < RR; r++) ids[r] = (int32_t)(rnd() % (uint32_t)n_exp);
        struct kvs_ocl_buf *bi = upload(ids, (size_t)RR * sizeof(int32_t));
        kvs_ocl_matmul_id(C, &W, bi, bx, 4, RR, by, ba);
        assert_int_equal(kvs_ocl_read(C, by, 0, y, (size_t)(RR * N) * sizeof(float)), KVS_OK);
        ref_matmul(type, w, rb, stride, ids, K, N, x, 4, RR, ref);
        const double s = max_abs(ref, (size_t)(RR * N));
        for (int64_t i = 0; i < RR * N; i++) d = fmax(d, fabs((double)y[i] - ref[i]) / s);
        kvs_ocl_free(bi);
    }
    assert_int_equal(kvs_ocl_finish(C), KVS_OK);
    printf("%-5s K %4lld N %3lld rows %lld experts %lld: max rel diff %.3g\n", kvs_type_name(type), (long long)K,
           (long long)N, (long long)R, (long long)n_exp, d);
    assert_true(d <= 2e-5);
    kvs_ocl_free(bw);
    kvs_ocl_free(bx);
    kvs_ocl_free(by);
    kvs_ocl_free(ba);
    free(w);
    free(x);
    free(y);
    free(ref);
}

static const enum kvs_type types[] = { KVS_TYPE_F32,  KVS_TYPE_F16,  KVS_TYPE_BF16, KVS_TYPE_Q8_0, KVS_TYPE_Q4_0,
                                       KVS_TYPE_Q4_1, KVS_TYPE_Q5_0, KVS_TYPE_Q5_1, KVS_TYPE_Q2_K, KVS_TYPE_Q3_K,
                                       KVS_TYPE_Q4_K, KVS_TYPE_Q5_K, KVS_TYPE_Q6_K };
static bool is_k(enum kvs_type t)
{
    return t == KVS_TYPE_Q2_K || t == KVS_TYPE_Q3_K || t == KVS_TYPE_Q4_K || t == KVS_TYPE_Q5_K || t == KVS_TYPE_Q6_K;
}
static bool is_float(enum kvs_type t) { return t == KVS_TYPE_F32 || t == KVS_TYPE_F16 || t == KVS_TYPE_BF16; }

static void test_matmul_types(void **st)
{
    (void)st;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const enum kvs_type ty = types[t];
        const int64_t qk = is_k(ty) ? 256 : 32;
        /* F32/F16/BF16 rows of 172 (as aidreams260K's FFN): not a multiple of anything */
        const int64_t Ks[3] = { is_float(ty) ? 172 : qk, qk * 3, qk * 67 };
        const int64_t Ns[3] = { 1, 7, 67 };
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) check_matmul(ty, Ks[i], Ns[j], j == 1 ? 3 : j == 2 ? 11 : 1, 1);
    }
}

static void test_matmul_experts(void **st)
{
    (void)st;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const int64_t qk = is_k(types[t]) ? 256 : 32;
        check_matmul(types[t], qk * 3, 5, 3, 8);
    }
}

static void test_rmsnorm_swiglu(void **st)
{
    (void)st;
    enum { R = 5, N = 100 };
    float x[R * N], w[N], y[R * N], a[R * N], b[R * N];
    for (int i = 0; i < R * N; i++) x[i] = rndf() * 3.0f, a[i] = rndf() * 4.0f, b[i] = rndf();
    for (int i = 0; i < N; i++) w[i] = rndf();
    struct kvs_ocl_buf *bx = upload(x, sizeof x), *bw = upload(w, sizeof w), *by = upload(NULL, sizeof y);
    struct kvs_ocl_buf *ba = upload(a, sizeof a), *bb = upload(b, sizeof b);
    kvs_ocl_rmsnorm(C, bx, bw, by, R, N, 1e-5f, NULL);
    kvs_ocl_swiglu(C, ba, bb, R * N);
    assert_int_equal(kvs_ocl_read(C, by, 0, y, sizeof y), KVS_OK);
    float a2[R * N];
    assert_int_equal(kvs_ocl_read(C, ba, 0, a2, sizeof a2), KVS_OK);
    double d = 0.0, ds = 0.0;
    for (int r = 0; r < R; r++) {
        double sum = 0.0;
        for (int i = 0; i < N; i++) sum += (double)x[r * N + i] * x[r * N + i];
        const float scale = 1.0f / sqrtf((float)(sum / N) + 1e-5f);
        for (int i = 0; i < N; i++) d = fmax(d, fabs(y[r * N + i] - (x[r * N + i] * scale) * w[i]));
    }
    for (int i = 0; i < R * N; i++) ds = fmax(ds, fabs(a2[i] - a[i] / (1.0f + expf(-a[i])) * b[i]));
    printf("rmsnorm max diff %.3g, swiglu max diff %.3g\n", d, ds);
    assert_true(d <= 1e-5);
    assert_true(ds <= 1e-5);
    kvs_ocl_free(bx);
    kvs_ocl_free(bw);
    kvs_ocl_free(by);
    kvs_ocl_free(ba);
    kvs_ocl_free(bb);
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double d = 0.0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d;
}

/* A Gated DeltaNet step chain (qwen35-facts §3.2 steps 3-8) on two
 * interleaved sequences against the scalar references kvs_ref_ssm_conv_step,
 * kvs_ref_ssm_delta_step and kvs_ref_ssm_gated_norm (the L2 norm and the
 * gates as model_gdn.c computes them): outputs and both final states. */
static void test_gdn(void **st)
{
    (void)st;
    enum { Hk = 2, Hv = 4, D = 16, K = 4, T = 7, NS = 2, CC = 2 * Hk * D + Hv * D, VD = Hv * D };
    static const int32_t seq[T] = { 0, 1, 0, 0, 1, 1, 0 };
    const float eps = 1e-6f, scale = 1.0f / sqrtf((float)D);
    static float x[T * CC], wt[K * CC], cst[NS * (K - 1) * CC], sst[NS * Hv * D * D];
    static float b[T * Hv], a[T * Hv], dt[Hv], sa[Hv], z[T * VD], nw[D];
    for (int i = 0; i < T * CC; i++) x[i] = rndf() * 2.0f;
    for (int i = 0; i < K * CC; i++) wt[i] = rndf();
    for (int i = 0; i < NS * (K - 1) * CC; i++) cst[i] = rndf();
    for (int i = 0; i < NS * Hv * D * D; i++) sst[i] = rndf() * 0.1f;
    for (int i = 0; i < T * Hv; i++) b[i] = rndf() * 3.0f, a[i] = rndf() * 3.0f;
    for (int i = 0; i < Hv; i++) dt[i] = rndf(), sa[i] = -(0.1f + fabsf(rndf()));
    dt[0] = 25.0f; /* softplus past 20 */
    for (int i = 0; i < T * VD; i++) z[i] = rndf() * 3.0f;
    for (int i = 0; i < D; i++) nw[i] = rndf();
    struct kvs_ocl_buf *bx = upload(x, sizeof x), *bwt = upload(wt, sizeof wt), *bcs = upload(cst, sizeof cst);
    struct kvs_ocl_buf *bss = upload(sst, sizeof sst), *bu = upload(NULL, sizeof x), *bb = upload(b, sizeof b);
    struct kvs_ocl_buf *ba = upload(a, sizeof a), *bdt = upload(dt, sizeof dt), *bsa = upload(sa, sizeof sa);
    struct kvs_ocl_buf *bz = upload(z, sizeof z), *bnw = upload(nw, sizeof nw), *bo = upload(NULL, sizeof z);
    struct kvs_ocl_buf *bseq = upload(seq, sizeof seq);
    kvs_ocl_gdn_conv(C, bcs, bwt, bx, bu, bseq, T, CC, K);
    kvs_ocl_l2norm(C, bu, T, 2 * Hk, D, CC, eps);
    kvs_ocl_gdn_gates(C, bb, ba, bdt, bsa, T, Hv);
    kvs_ocl_gdn_delta(C, bss, bu, ba, bb, bo, bseq, T, D, Hk, Hv, scale);
    kvs_ocl_rmsnorm(C, bo, bnw, bo, T * Hv, D, eps, NULL);
    kvs_ocl_gate_mul(C, bo, bz, true, T * VD);
    static float o_dev[T * VD], cst_dev[NS * (K - 1) * CC], sst_dev[NS * Hv * D * D], u[T * CC], o[T * VD];
    assert_int_equal(kvs_ocl_read(C, bo, 0, o_dev, sizeof o_dev), KVS_OK);
    assert_int_equal(kvs_ocl_read(C, bcs, 0, cst_dev, sizeof cst_dev), KVS_OK);
    assert_int_equal(kvs_ocl_read(C, bss, 0, sst_dev, sizeof sst_dev), KVS_OK);
    for (int t = 0; t < T; t++) {
        float *ut = u + t * CC;
        kvs_ref_ssm_conv_step(cst + seq[t] * (K - 1) * CC, wt, x + t * CC, ut, 0, CC, CC, K);
        for (int g = 0; g < 2 * Hk; g++) {
            double sum = 0.0;
            for (int i = 0; i < D; i++) sum += (double)(ut[g * D + i] * ut[g * D + i]);
            const float nrm = sqrtf((float)sum), inv = 1.0f / (nrm > eps ? nrm : eps);
            for (int i = 0; i < D; i++) ut[g * D + i] *= inv;
        }
        for (int j = 0; j < Hv; j++) {
            const float beta = 1.0f / (1.0f + expf(-b[t * Hv + j]));
            const float xa = a[t * Hv + j] + dt[j], sp = xa > 20.0f ? xa : logf(1.0f + expf(xa));
            const int g = j % Hk;
            float *oj = o + t * VD + j * D;
            kvs_ref_ssm_delta_step(sst + (seq[t] * Hv + j) * D * D, ut + g * D, ut + (Hk + g) * D,
                                   ut + 2 * Hk * D + j * D, expf(sp * sa[j]), beta, scale, oj, D);
            kvs_ref_ssm_gated_norm(oj, z + t * VD + j * D, nw, D, eps);
        }
    }
    const double d_o = max_abs_diff(o, o_dev, T * VD), d_c = max_abs_diff(cst, cst_dev, NS * (K - 1) * CC);
    const double d_s = max_abs_diff(sst, sst_dev, NS * Hv * D * D);
    printf("gdn: output max diff %.3g, conv state %.3g, delta state %.3g\n", d_o, d_c, d_s);
    assert_true(d_o <= 1e-4);
    assert_true(d_c == 0.0); /* the conv state holds inputs: copied exactly */
    assert_true(d_s <= 1e-5);
    struct kvs_ocl_buf *all[] = { bx, bwt, bcs, bss, bu, bb, ba, bdt, bsa, bz, bnw, bo, bseq };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kvs_ocl_free(all[i]);
}

/* Gated attention's split of the query projection, the sigmoid gate and
 * the shared expert's gated add, against model_attn.c / model_moe.c. */
static void test_gated_ops(void **st)
{
    (void)st;
    enum { T = 3, H = 4, D = 8, E = 20 };
    static float qg[T * H * 2 * D], q[T * H * D], g[T * H * D], y[T * E], s[T * E], sg[T];
    for (int i = 0; i < T * H * 2 * D; i++) qg[i] = rndf() * 4.0f;
    for (int i = 0; i < T * E; i++) y[i] = rndf(), s[i] = rndf();
    for (int i = 0; i < T; i++) sg[i] = rndf() * 5.0f;
    struct kvs_ocl_buf *bqg = upload(qg, sizeof qg), *bq = upload(NULL, sizeof q), *bg = upload(NULL, sizeof g);
    struct kvs_ocl_buf *by = upload(y, sizeof y), *bs = upload(s, sizeof s), *bsg = upload(sg, sizeof sg);
    kvs_ocl_split_qg(C, bqg, bq, bg, T, H, D);
    assert_int_equal(kvs_ocl_read(C, bg, 0, g, sizeof g), KVS_OK);
    kvs_ocl_gate_mul(C, bq, bg, false, T * H * D);
    kvs_ocl_add_gated(C, by, bs, bsg, T, E);
    static float q_dev[T * H * D], y_dev[T * E];
    assert_int_equal(kvs_ocl_read(C, bq, 0, q_dev, sizeof q_dev), KVS_OK);
    assert_int_equal(kvs_ocl_read(C, by, 0, y_dev, sizeof y_dev), KVS_OK);
    double dg = 0.0, dq = 0.0, dy = 0.0;
    for (int th = 0; th < T * H; th++)
        for (int e = 0; e < D; e++) {
            const float qv = qg[th * 2 * D + e], gv = qg[th * 2 * D + D + e];
            dg = fmax(dg, fabs(g[th * D + e] - gv));
            dq = fmax(dq, fabs(q_dev[th * D + e] - qv * (1.0f / (1.0f + expf(-gv)))));
        }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < E; i++) {
            const float want = y[t * E + i] + (1.0f / (1.0f + expf(-sg[t]))) * s[t * E + i];
            dy = fmax(dy, fabs(y_dev[t * E + i] - want));
        }
    printf("split_qg gate max diff %.3g, sigmoid gate %.3g, add_gated %.3g\n", dg, dq, dy);
    assert_true(dg == 0.0);
    assert_true(dq <= 1e-5);
    assert_true(dy <= 1e-5);
    struct kvs_ocl_buf *all[] = { bqg, bq, bg, by, bs, bsg };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kvs_ocl_free(all[i]);
}

static void test_errors(void **st)
{
    (void)st;
    char err[4096] = "";
    struct kvs_ocl *c = NULL;
    assert_int_equal(kvs_ocl_open(63, &c, err, sizeof err), KVS_ERR_NOT_FOUND);
    assert_null(c);
    assert_non_null(strstr(err, "OpenCL device 63 does not exist"));
    /* a kernel build failure returns the device compiler's log */
    assert_int_equal(kvs_ocl_open_source(0, "__kernel void broken(__global float *x) { x[0] = undeclared_name; }",
                                         &c, err, sizeof err),
                     KVS_ERR_UNSUPPORTED);
    assert_null(c);
    assert_non_null(strstr(err, "the kernels failed to build"));
    assert_non_null(strstr(err, "undeclared_name"));
    /* a buffer past the device's largest allocation */
    struct kvs_ocl_buf *b = NULL;
    assert_int_equal(kvs_ocl_alloc(C, (size_t)kvs_ocl_info(C)->max_alloc + 1, &b, err, sizeof err), KVS_ERR_NOMEM);
    assert_null(b);
    assert_non_null(strstr(err, "exceeds its largest allocation"));
    /* the device list names device 0 */
    struct kvs_ocl_device_info di[4];
    int n = 0;
    assert_int_equal(kvs_ocl_devices(di, 4, &n, err, sizeof err), KVS_OK);
    assert_true(n >= 1);
    assert_string_equal(di[0].name, kvs_ocl_info(C)->name);
    assert_true(di[0].global_mem > 0);
    assert_false(kvs_ocl_type_supported(KVS_TYPE_IQ4_NL));
    assert_false(kvs_ocl_type_supported(KVS_TYPE_Q8_K));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_types),
        cmocka_unit_test(test_matmul_experts),
        cmocka_unit_test(test_rmsnorm_swiglu),
        cmocka_unit_test(test_gdn),
        cmocka_unit_test(test_gated_ops),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
