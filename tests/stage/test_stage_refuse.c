/* Rings that cannot close, and one-stage rings (aidreams260K, 4 blocks):
 *  - a successor that refuses the head (window [2,4) after [0,1)):
 *    kvs_stage_wait_ready returns the refusal code at once, kvs_stage_ring_error
 *    says why from the head's side, and a submitted request fails with it;
 *    after kvs_stage_stop, wait_ready answers KVS_ERR_CANCELLED;
 *  - a wrong node key on either end of a link (TLS, PROTOCOL.md §4.1): the
 *    head's wait_ready returns MISMATCH at once and its ring error names the
 *    expected and the presented fingerprints, from whichever side refused;
 *  - a stage with links but neither a key nor insecure does not start;
 *  - a stage of the whole model is a one-stage ring: ready without links, its
 *    greedy tokens equal those of a two-stage ring with F32 boundaries, and
 *    each token is counted once. */
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "link/link.h"
#include "stage/stage.h"

struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t toks[64];
    int n_tokens;
    bool done;
    kvs_err err;
    char msg[1024];
};

static void on_event(void *user, const struct kvs_stage_event *ev)
{
    struct waiter *w = user;
    pthread_mutex_lock(&w->mu);
    if (ev->kind == KVS_STAGE_EVENT_TOKEN) {
        if (w->n_tokens < 64) w->toks[w->n_tokens] = ev->token;
        w->n_tokens++;
    } else {
        w->done = true;
        w->err = ev->kind == KVS_STAGE_EVENT_ERROR ? ev->err : KVS_OK;
        snprintf(w->msg, sizeof w->msg, "%s", ev->message ? ev->message : "");
    }
    pthread_mutex_unlock(&w->mu);
    pthread_cond_broadcast(&w->cv);
}

static void *run_thread(void *arg)
{
    kvs_stage_run(arg);
    return NULL;
}

static bool model_path(char *out, size_t cap)
{
    const char *shared = getenv("KVASIR_SHARED");
    snprintf(out, cap, "%s/models/aidreams260K.gguf", shared ? shared : "../shared");
    return access(out, R_OK) == 0;
}

/* Keys for a two-stage ring a <-> b: each one's neighbours are the other. */
static void ring2_keys(struct kvs_stage_params *a, struct kvs_stage_params *b, struct kvs_key **ka, struct kvs_key **kb)
{
    assert_int_equal(kvs_key_generate(ka), KVS_OK);
    assert_int_equal(kvs_key_generate(kb), KVS_OK);
    a->key = *ka;
    b->key = *kb;
    kvs_key_public(*kb, a->prev_key);
    kvs_key_public(*kb, a->next_key);
    kvs_key_public(*ka, b->prev_key);
    kvs_key_public(*ka, b->next_key);
    a->has_prev_key = a->has_next_key = b->has_prev_key = b->has_next_key = true;
}

static void free_port(char *addr, size_t cap)
{
    struct kvs_listener *l;
    char err[256];
    assert_int_equal(kvs_tcp_listen("127.0.0.1:0", &l, err, sizeof err), KVS_OK);
    snprintf(addr, cap, "127.0.0.1:%u", (unsigned)kvs_listener_port(l));
    kvs_listener_close(l);
}

/* Submits a greedy 8-token request and waits for its end. */
static void request(struct kvs_stage *head, struct waiter *w)
{
    memset(w, 0, sizeof *w);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    const int32_t prompt[3] = { 1, 400, 401 };
    struct kvs_stage_request rq = { .prompt = prompt, .n_prompt = 3, .max_tokens = 8, .ignore_eos = true,
                                    .on_event = on_event, .user = w };
    rq.sampling = kvs_sampler_default_params();
    rq.sampling.temp = 0;
    uint32_t id;
    assert_int_equal(kvs_stage_submit(head, &rq, &id), KVS_OK);
    pthread_mutex_lock(&w->mu);
    while (!w->done) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

static void waiter_free(struct waiter *w)
{
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
}

static void test_refused(void **state)
{
    (void)state;
    char model[4096], head_addr[64], succ_addr[64], err[512], why[2048];
    if (!model_path(model, sizeof model)) skip();
    free_port(head_addr, sizeof head_addr);

    struct kvs_stage_params sp = kvs_stage_default_params();
    sp.model_path = model;
    sp.block_begin = 2;
    sp.block_end = 4;
    sp.listen = "127.0.0.1:0";
    sp.next = head_addr;
    sp.n_threads = 1;
    struct kvs_stage *succ = NULL, *head = NULL;
    struct kvs_stage_params hp = sp;
    struct kvs_key *ks, *kh;
    ring2_keys(&sp, &hp, &ks, &kh); /* the refusal below happens inside TLS */
    assert_int_equal(kvs_stage_create(&sp, &succ, err, sizeof err), KVS_OK);
    snprintf(succ_addr, sizeof succ_addr, "127.0.0.1:%u", (unsigned)kvs_stage_listen_port(succ));
    hp.block_begin = 0;
    hp.block_end = 1; /* not adjacent to [2,4): the successor refuses the head */
    hp.listen = head_addr;
    hp.next = succ_addr;
    assert_int_equal(kvs_stage_create(&hp, &head, err, sizeof err), KVS_OK);
    assert_int_equal(kvs_stage_ring_error(head, why, sizeof why), KVS_OK);
    assert_string_equal(why, "");

    pthread_t th, ts;
    assert_int_equal(pthread_create(&ts, NULL, run_thread, succ), 0);
    assert_int_equal(pthread_create(&th, NULL, run_thread, head), 0);
    /* at once, not after the 20 s timeout */
    int64_t t0 = kvs_link_now_ms();
    assert_int_equal(kvs_stage_wait_ready(head, 20000), KVS_ERR_MISMATCH);
    assert_true(kvs_link_now_ms() - t0 < 5000);
    assert_int_equal(kvs_stage_ring_error(head, why, sizeof why), KVS_ERR_MISMATCH);
    char want[512];
    snprintf(want, sizeof want,
             "successor %s refused this stage: its window [2,4) does not begin where this stage's [0,1) ends",
             succ_addr);
    assert_string_equal(why, want);

    struct waiter w;
    request(head, &w);
    assert_int_equal(w.err, KVS_ERR_MISMATCH);
    assert_int_equal(w.n_tokens, 0);
    char want2[600];
    snprintf(want2, sizeof want2, "the ring is not complete: %s", want);
    assert_string_equal(w.msg, want2);
    waiter_free(&w);
    struct kvs_stage_metrics m;
    kvs_stage_metrics(head, &m);
    assert_int_equal(m.requests_failed, 1);
    assert_false(m.ring_ready);

    kvs_stage_stop(head);
    pthread_join(th, NULL);
    assert_int_equal(kvs_stage_wait_ready(head, 20000), KVS_ERR_CANCELLED);
    assert_int_equal(kvs_stage_ring_error(head, why, sizeof why), KVS_ERR_CANCELLED);
    kvs_stage_stop(succ);
    pthread_join(ts, NULL);
    kvs_stage_free(head);
    kvs_stage_free(succ);
    kvs_key_free(ks);
    kvs_key_free(kh);
}

/* A two-stage ring where one stage expects another key for one neighbour:
 * which = 0: the tail expects another predecessor key (it refuses the head's
 * dial); 1: the head expects another successor key (it refuses the tail). */
static void wrong_key(int which)
{
    char model[4096], head_addr[64], tail_addr[64], err[512], why[2048], want[512];
    if (!model_path(model, sizeof model)) skip();
    free_port(head_addr, sizeof head_addr);
    struct kvs_stage_params tp = kvs_stage_default_params();
    tp.model_path = model;
    tp.block_begin = 2;
    tp.listen = "127.0.0.1:0";
    tp.next = head_addr;
    tp.n_threads = 1;
    struct kvs_stage_params hp = tp;
    hp.block_begin = 0;
    hp.block_end = 2;
    hp.listen = head_addr;
    struct kvs_key *kt, *kh, *kx;
    ring2_keys(&tp, &hp, &kt, &kh);
    assert_int_equal(kvs_key_generate(&kx), KVS_OK);
    uint8_t px[32], ph[32], pt[32];
    kvs_key_public(kx, px);
    kvs_key_public(kh, ph);
    kvs_key_public(kt, pt);
    char fx[17], fh[17], ft[17];
    kvs_key_fingerprint(px, fx);
    kvs_key_fingerprint(ph, fh);
    kvs_key_fingerprint(pt, ft);
    if (which == 0) memcpy(tp.prev_key, px, 32);
    else memcpy(hp.next_key, px, 32);
    struct kvs_stage *tail = NULL, *head = NULL;
    assert_int_equal(kvs_stage_create(&tp, &tail, err, sizeof err), KVS_OK);
    snprintf(tail_addr, sizeof tail_addr, "127.0.0.1:%u", (unsigned)kvs_stage_listen_port(tail));
    hp.next = tail_addr;
    assert_int_equal(kvs_stage_create(&hp, &head, err, sizeof err), KVS_OK);
    pthread_t th, tt;
    assert_int_equal(pthread_create(&tt, NULL, run_thread, tail), 0);
    assert_int_equal(pthread_create(&th, NULL, run_thread, head), 0);
    int64_t t0 = kvs_link_now_ms();
    assert_int_equal(kvs_stage_wait_ready(head, 20000), KVS_ERR_MISMATCH);
    assert_true(kvs_link_now_ms() - t0 < 5000);
    assert_int_equal(kvs_stage_ring_error(head, why, sizeof why), KVS_ERR_MISMATCH);
    if (which == 0) /* the refused side reads the refuser's ERROR */
        snprintf(want, sizeof want, "successor %s refused this stage: it expects key %s, this stage presented key %s",
                 tail_addr, fx, fh);
    else /* the refusing side */
        snprintf(want, sizeof want, "refusing successor %s: %s presented key %s, this stage expects key %s", tail_addr,
                 tail_addr, ft, fx);
    assert_string_equal(why, want);
    struct kvs_stage_metrics m;
    kvs_stage_metrics(tail, &m);
    /* The tail sends its ERROR before it counts the refusal: the head may read
     * the refusal first, so the counter gets a bounded wait. */
    for (int64_t t1 = kvs_link_now_ms(); which == 0 && m.frames_rejected < 1 && kvs_link_now_ms() - t1 < 2000;) {
        usleep(10000);
        kvs_stage_metrics(tail, &m);
    }
    assert_false(m.in_up); /* no HELLO of the head's was ever read */
    if (which == 0) assert_true(m.frames_rejected >= 1);
    kvs_stage_stop(head);
    kvs_stage_stop(tail);
    pthread_join(th, NULL);
    pthread_join(tt, NULL);
    kvs_stage_free(head);
    kvs_stage_free(tail);
    kvs_key_free(kt);
    kvs_key_free(kh);
    kvs_key_free(kx);
}

static void test_wrong_pred_key(void **state)
{
    (void)state;
    wrong_key(0);
}

static void test_wrong_succ_key(void **state)
{
    (void)state;
    wrong_key(1);
}

/* Links need a key with both neighbours' keys, or insecure. */
static void test_keys_required(void **state)
{
    (void)state;
    char model[4096], err[1024];
    if (!model_path(model, sizeof model)) skip();
    struct kvs_stage_params p = kvs_stage_default_params();
    p.model_path = model;
    p.block_begin = 0;
    p.block_end = 2;
    p.listen = "127.0.0.1:0";
    p.next = "127.0.0.1:9";
    p.n_threads = 1;
    struct kvs_stage *s = NULL;
    assert_int_equal(kvs_stage_create(&p, &s, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "no node key"));
    assert_non_null(strstr(err, "--insecure"));
    struct kvs_key *k;
    assert_int_equal(kvs_key_generate(&k), KVS_OK);
    p.key = k;
    p.has_next_key = true;
    assert_int_equal(kvs_stage_create(&p, &s, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "a neighbour's key is missing"));
    p.has_prev_key = true;
    p.insecure = true;
    assert_int_equal(kvs_stage_create(&p, &s, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "exclude each other"));
    p.insecure = false;
    assert_int_equal(kvs_stage_create(&p, &s, err, sizeof err), KVS_OK);
    kvs_stage_free(s);
    p.key = NULL;
    p.insecure = true;
    assert_int_equal(kvs_stage_create(&p, &s, err, sizeof err), KVS_OK);
    kvs_stage_free(s);
    kvs_key_free(k);
}

static void test_one_stage(void **state)
{
    (void)state;
    char model[4096], head_addr[64], tail_addr[64], err[512];
    if (!model_path(model, sizeof model)) skip();

    /* reference: a two-stage ring, F32 boundaries (= a single process) */
    free_port(head_addr, sizeof head_addr);
    struct kvs_stage_params tp = kvs_stage_default_params();
    tp.model_path = model;
    tp.block_begin = 2;
    tp.listen = "127.0.0.1:0";
    tp.next = head_addr;
    tp.n_threads = 1;
    tp.boundary_f32 = true;
    struct kvs_stage *tail = NULL, *head = NULL;
    struct kvs_stage_params hp = tp;
    struct kvs_key *kt, *kh;
    ring2_keys(&tp, &hp, &kt, &kh);
    assert_int_equal(kvs_stage_create(&tp, &tail, err, sizeof err), KVS_OK);
    snprintf(tail_addr, sizeof tail_addr, "127.0.0.1:%u", (unsigned)kvs_stage_listen_port(tail));
    hp.block_begin = 0;
    hp.block_end = 2;
    hp.listen = head_addr;
    hp.next = tail_addr;
    assert_int_equal(kvs_stage_create(&hp, &head, err, sizeof err), KVS_OK);
    pthread_t th, tt;
    assert_int_equal(pthread_create(&tt, NULL, run_thread, tail), 0);
    assert_int_equal(pthread_create(&th, NULL, run_thread, head), 0);
    assert_int_equal(kvs_stage_wait_ready(head, 10000), KVS_OK);
    struct waiter ref;
    request(head, &ref);
    assert_int_equal(ref.err, KVS_OK);
    assert_int_equal(ref.n_tokens, 8);
    kvs_stage_stop(head);
    kvs_stage_stop(tail);
    pthread_join(th, NULL);
    pthread_join(tt, NULL);
    kvs_stage_free(head);
    kvs_stage_free(tail);
    kvs_key_free(kt);
    kvs_key_free(kh);

    /* the whole model in one stage: no next address and no key needed */
    struct kvs_stage_params op = kvs_stage_default_params();
    op.model_path = model;
    op.listen = "127.0.0.1:0";
    op.next = NULL;
    op.n_threads = 1;
    struct kvs_stage *one = NULL;
    assert_int_equal(kvs_stage_create(&op, &one, err, sizeof err), KVS_OK);
    assert_true(kvs_stage_is_head(one));
    assert_non_null(kvs_stage_tokenizer(one));
    assert_int_equal(pthread_create(&th, NULL, run_thread, one), 0);
    assert_int_equal(kvs_stage_wait_ready(one, 1000), KVS_OK);
    struct waiter w;
    request(one, &w);
    assert_int_equal(w.err, KVS_OK);
    assert_int_equal(w.n_tokens, 8);
    assert_memory_equal(w.toks, ref.toks, 8 * sizeof(int32_t));
    struct kvs_stage_metrics m;
    kvs_stage_metrics(one, &m);
    assert_int_equal(m.requests_done, 1);
    assert_int_equal(m.tokens_generated, 8);
    assert_int_equal(m.forward_calls, 8); /* the prompt, then 7 decode steps */
    assert_int_equal(m.prefill_tokens, 3);
    assert_int_equal(m.decode_rows, 7);
    assert_int_equal(m.bytes_out, 0);
    kvs_stage_stop(one);
    pthread_join(th, NULL);
    kvs_stage_free(one);
    waiter_free(&w);
    waiter_free(&ref);

    /* a stage that is not the whole model still needs its successor */
    op.block_end = 2;
    assert_int_equal(kvs_stage_create(&op, &one, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "needs a next address"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_wrong_pred_key),
        cmocka_unit_test(test_wrong_succ_key),
        cmocka_unit_test(test_keys_required),
        cmocka_unit_test(test_one_stage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
