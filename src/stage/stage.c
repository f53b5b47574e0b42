/* The stage: create / free and the public API of stage.h (the loop is in
 * stage_loop.c; see stage_impl.h for the files). */
#include "stage/stage_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "gguf/gguf.h"
#include "kernels/pool.h"
#include "shard/shard.h"

struct kvs_stage_params kvs_stage_default_params(void)
{
    return (struct kvs_stage_params){ .block_begin = 0, .block_end = -1, .n_threads = 2, .n_seq = 4,
                                      .n_batch = 512, .boundary_f32 = true, .timeout_ms = 4000, .keepalive_ms = 1000,
                                      .stop_fd = -1, .control_fd = -1 };
}

static void wake(struct kvs_stage *s)
{
    char c = 1;
    ssize_t r = write(s->wake[1], &c, 1);
    (void)r; /* a full pipe already wakes the loop */
}

kvs_err kvs_stage_create(const struct kvs_stage_params *p, struct kvs_stage **out, char *errbuf, size_t errlen)
{
    char err[512] = "";
    kvs_err e = KVS_OK;
    struct kvs_stage *s = calloc(1, sizeof *s);
    if (!s) return KVS_ERR_NOMEM;
    s->wake[0] = s->wake[1] = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->p = *p;
    if (s->p.n_threads <= 0) s->p.n_threads = 2;
    if (s->p.n_seq <= 0) s->p.n_seq = 4;
    if (s->p.n_batch <= 0) s->p.n_batch = 512;
    if (s->p.timeout_ms <= 0) s->p.timeout_ms = 4000;
    if (s->p.keepalive_ms <= 0) s->p.keepalive_ms = 1000;
    s->next_req = 1;
    if (!p->model_path || !p->listen) {
        snprintf(err, sizeof err, "a stage needs a model and a listen address");
        e = KVS_ERR_ARG;
        goto fail;
    }
    if (strlen(p->listen) >= sizeof s->listen_addr || (p->next && strlen(p->next) >= sizeof s->next_addr) ||
        (p->relay_ca && strlen(p->relay_ca) >= sizeof s->relay_ca)) {
        snprintf(err, sizeof err, "listen/next address or relay CA path too long");
        e = KVS_ERR_ARG;
        goto fail;
    }
    if (p->relay_pin && !kvs_relay_hex64(p->relay_pin)) {
        snprintf(err, sizeof err, "relay certificate pin must be 64 lowercase hex digits (SHA-256 of the DER)");
        e = KVS_ERR_ARG;
        goto fail;
    }
    snprintf(s->listen_addr, sizeof s->listen_addr, "%s", p->listen);
    snprintf(s->next_addr, sizeof s->next_addr, "%s", p->next ? p->next : "");
    snprintf(s->relay_ca, sizeof s->relay_ca, "%s", p->relay_ca ? p->relay_ca : "");
    snprintf(s->relay_pin, sizeof s->relay_pin, "%s", p->relay_pin ? p->relay_pin : "");
    s->p.relay_ca = s->p.relay_pin = NULL;
    if ((p->handover_path && strlen(p->handover_path) >= sizeof s->handover_path) ||
        (p->takeover_path && strlen(p->takeover_path) >= sizeof s->takeover_path)) {
        snprintf(err, sizeof err, "handover or takeover path too long");
        e = KVS_ERR_ARG;
        goto fail;
    }
    snprintf(s->handover_path, sizeof s->handover_path, "%s", p->handover_path ? p->handover_path : "");
    snprintf(s->takeover_path, sizeof s->takeover_path, "%s", p->takeover_path ? p->takeover_path : "");
    s->p.handover_path = s->p.takeover_path = NULL;
    s->in_relay = kvs_ws_is_url(s->listen_addr);
    s->p.listen = s->listen_addr;
    s->p.next = s->next_addr;
    s->p.model_path = NULL;
    s->p.fingerprint = NULL;
    s->p.content_id = NULL;

    if ((e = kvs_gguf_open(p->model_path, &s->g, err, sizeof err))) goto fail;
    if ((e = kvs_gguf_fingerprint(s->g, s->fp))) {
        snprintf(err, sizeof err, "cannot fingerprint %s", p->model_path);
        goto fail;
    }
    kvs_gguf_fingerprint_hex(s->fp, s->fp_hex);
    if (p->fingerprint && p->fingerprint[0] && strcmp(p->fingerprint, s->fp_hex)) {
        snprintf(err, sizeof err, "%s has fingerprint %s, the manifest expects %s", p->model_path, s->fp_hex,
                 p->fingerprint);
        e = KVS_ERR_MISMATCH;
        goto fail;
    }
    {
        /* The weights' identity, for HELLO: a full model hashes its data section (a shard
         * records the id its fetch verified, or none). */
        char cmsg[256] = "";
        kvs_err ce = kvs_shard_content_id(s->g, s->cid, cmsg, sizeof cmsg);
        if (ce == KVS_OK) {
            kvs_shard_hex(s->cid, s->cid_hex);
        } else if (ce == KVS_ERR_NOT_FOUND) {
            memset(s->cid, 0, sizeof s->cid);
            KVS_LOGW("stage: %s: %s: neighbours cannot tell its weights from others of the same shapes",
                     p->model_path, cmsg);
        } else {
            snprintf(err, sizeof err, "%s: %s", p->model_path, cmsg);
            e = ce;
            goto fail;
        }
        if (p->content_id && p->content_id[0] && s->cid_hex[0] && strcmp(p->content_id, s->cid_hex)) {
            snprintf(err, sizeof err, "%s holds other weights (content id %.16s...) than the manifest expects "
                     "(%.16s...)", p->model_path, s->cid_hex, p->content_id);
            e = KVS_ERR_MISMATCH;
            goto fail;
        }
    }
    {
        /* A stage shard (kvasir.shard.* keys) must cover the assigned window:
         * say so plainly instead of failing on the first missing tensor. */
        uint32_t sb, se;
        if (kvs_shard_window(s->g, &sb, &se)) {
            struct kvs_hparams hp0;
            if ((e = kvs_hparams_read(s->g, &hp0, err, sizeof err))) goto fail;
            uint32_t want_end = p->block_end < 0 ? hp0.n_block : (uint32_t)p->block_end;
            if ((e = kvs_shard_check(s->g, (uint32_t)p->block_begin, want_end, err, sizeof err))) goto fail;
        }
    }
    struct kvs_model_params mp = kvs_model_default_params();
    mp.block_begin = p->block_begin;
    mp.block_end = p->block_end;
    mp.n_ctx = p->n_ctx;
    mp.n_seq = s->p.n_seq;
    mp.n_batch = s->p.n_batch;
    mp.n_threads = s->p.n_threads;
    mp.backend = p->backend == KVS_BACKEND_OPENCL ? KVS_BACKEND_OPENCL : KVS_BACKEND_CPU;
    mp.device = p->device;
    /* The pool is created by kvs_model_load, on this thread. */
    int spin_prev = kvs_pool_set_thread_spin(p->pool_spin == 0 ? KVS_STAGE_POOL_SPIN : p->pool_spin);
    e = kvs_model_load(s->g, &mp, &s->m, err, sizeof err);
    kvs_pool_set_thread_spin(spin_prev);
    if (e) goto fail;
    s->hp = *kvs_model_hparams(s->m);
    s->begin = kvs_model_block_begin(s->m);
    s->end = kvs_model_block_end(s->m);
    s->n_ctx = kvs_model_n_ctx(s->m);
    s->n_seq = kvs_model_n_seq(s->m);
    s->n_batch = s->p.n_batch;
    s->n_embd = s->hp.n_embd;
    s->n_vocab = s->hp.n_vocab;
    s->is_head = kvs_model_has_embd(s->m);
    s->is_tail = kvs_model_has_head(s->m);
    /* The whole model: a one-stage ring. The head is its own tail and
     * samples locally; no link is dialed and predecessors are refused. */
    s->solo = s->is_head && s->is_tail;
    if (!s->solo && !s->next_addr[0]) {
        snprintf(err, sizeof err, "stage [%d,%d) of %u blocks needs a next address (its successor)", (int)s->begin,
                 (int)s->end, s->hp.n_block);
        e = KVS_ERR_ARG;
        goto fail;
    }
    if (!s->solo) { /* a malformed next is a start-up error, not 20 silent retries */
        char why[300] = "";
        if (kvs_st_check_addr(s->next_addr, false, why, sizeof why)) {
            snprintf(err, sizeof err, "next address '%.200s': %.250s", s->next_addr, why);
            e = KVS_ERR_ARG;
            goto fail;
        }
    }
    if (s->in_relay) { /* the in link dials out (RELAY.md §2): its URL must be usable */
        char why[300] = "";
        if (kvs_st_check_addr(s->listen_addr, true, why, sizeof why)) {
            snprintf(err, sizeof err, "listen address '%.200s': %.250s", s->listen_addr, why);
            e = KVS_ERR_ARG;
            goto fail;
        }
    }
    if (!s->solo && p->key && p->insecure) {
        snprintf(err, sizeof err, "a node key and --insecure exclude each other");
        e = KVS_ERR_ARG;
        goto fail;
    }
    if (!s->solo && !p->insecure && (!p->key || !p->has_prev_key || !p->has_next_key)) {
        snprintf(err, sizeof err,
                 "%s: every link is TLS between node keys: give this node's key (--key FILE, kvasir key gen) and "
                 "both neighbours' public keys (--prev-key, --next-key, or a manifest with keys); --insecure "
                 "runs plaintext links (debugging on one machine)",
                 !p->key ? "no node key" : "a neighbour's key is missing");
        e = KVS_ERR_ARG;
        goto fail;
    }
    if (!s->solo && p->key) {
        if ((e = kvs_tls_create(p->key, &s->tls, err, sizeof err))) goto fail;
        uint8_t pub[KVS_KEY_PUB_BYTES];
        char f0[KVS_KEY_FP_HEX + 1], f1[KVS_KEY_FP_HEX + 1], f2[KVS_KEY_FP_HEX + 1];
        kvs_key_public(p->key, pub);
        kvs_key_fingerprint(pub, f0);
        kvs_key_fingerprint(p->prev_key, f1);
        kvs_key_fingerprint(p->next_key, f2);
        KVS_LOGI("links: TLS 1.3, this node's key %s, predecessor's %s, successor's %s", f0, f1, f2);
    } else if (!s->solo) {
        KVS_LOGW("links: plaintext and unauthenticated (--insecure): anyone who can reach this stage can feed or "
                 "read it; for debugging on one machine only");
    }
    s->p.key = NULL; /* borrowed: kept in s->tls */
    if (s->is_head) {
        if ((e = kvs_tokenizer_load(s->g, &s->tok, err, sizeof err))) goto fail;
        int32_t nv = kvs_tokenizer_n_vocab(s->tok);
        for (int32_t id = 0; id < nv && s->n_eog < KVS_PROTO_MAX_STOP; id++)
            if (kvs_tokenizer_is_eog(s->tok, id)) s->eog[s->n_eog++] = id;
    }
    size_t rows_out = (size_t)s->n_batch * s->n_embd;
    if (s->is_tail && (size_t)s->n_seq * s->n_vocab > rows_out) rows_out = (size_t)s->n_seq * s->n_vocab;
    uint64_t max_payload = kvs_proto_decode_bytes((uint32_t)s->n_batch, s->n_embd, true) + 4096;
    uint64_t req_max = kvs_proto_req_bytes(KVS_PROTO_MAX_STOP, (uint32_t)s->n_ctx);
    if (req_max + 4096 > max_payload) max_payload = req_max + 4096;
    if (4ull * (uint64_t)s->n_seq + 4096 > max_payload) max_payload = 4ull * (uint64_t)s->n_seq + 4096; /* LIVE */
    if (max_payload > KVS_PROTO_MAX_PAYLOAD) {
        snprintf(err, sizeof err, "n_batch %d x n_embd %u exceeds the frame cap", (int)s->n_batch, s->n_embd);
        e = KVS_ERR_RANGE;
        goto fail;
    }
    s->sbuf_cap = KVS_PROTO_HEADER_BYTES + (size_t)max_payload;
    s->sbuf = malloc(s->sbuf_cap);
    s->rbuf = malloc(READ_CHUNK);
    s->x = malloc((size_t)s->n_batch * s->n_embd * sizeof(float));
    s->y = malloc(rows_out * sizeof(float));
    s->b_tok = malloc((size_t)s->n_batch * sizeof(int32_t));
    s->b_seq = malloc((size_t)s->n_batch * sizeof(int32_t));
    s->b_pos = malloc((size_t)s->n_batch * sizeof(int32_t));
    s->b_req = malloc((size_t)s->n_batch * sizeof(uint32_t));
    s->b_logits = malloc((size_t)s->n_batch);
    s->seqs = calloc((size_t)s->n_seq, sizeof *s->seqs);
    s->replay_deadline_ms = p->replay_deadline_ms == 0 ? KVS_STAGE_REPLAY_DEADLINE_MS : p->replay_deadline_ms;
    if (s->is_head && !s->solo && !(s->hist = calloc((size_t)s->n_seq, sizeof *s->hist))) {
        snprintf(err, sizeof err, "out of memory for stage buffers");
        e = KVS_ERR_NOMEM;
        goto fail;
    }
    s->in_dec = kvs_proto_decoder_create((uint32_t)max_payload, s->n_embd);
    s->out_dec = kvs_proto_decoder_create(KVS_PROTO_HELLO_BYTES + 4 + KVS_PROTO_MAX_ERRMSG, s->n_embd);
    if (!s->sbuf || !s->rbuf || !s->x || !s->y || !s->b_tok || !s->b_seq || !s->b_pos || !s->b_req ||
        !s->b_logits || !s->seqs || !s->in_dec || !s->out_dec) {
        snprintf(err, sizeof err, "out of memory for stage buffers");
        e = KVS_ERR_NOMEM;
        goto fail;
    }
    if (pipe2(s->wake, O_NONBLOCK | O_CLOEXEC)) {
        snprintf(err, sizeof err, "pipe: %s", strerror(errno));
        e = KVS_ERR_IO;
        goto fail;
    }
    kvs_st_cut_token(s->listen_addr, s->in_token);
    kvs_st_cut_token(s->next_addr, s->next_token);
    /* a replacement in a planned leave (§5.2): the leaving stage's sequences first, then its address */
    if (s->takeover_path[0] && !s->is_head && !s->solo) kvs_st_takeover(s);
    /* a relay URL: no listening socket at all (a stage behind NAT opens no port) */
    if (!s->in_relay) {
        /* after a takeover the leaving stage has just closed this address: a moment may pass
         * before the port is free (it closes its listener before it writes the state) */
        int64_t t_listen = kvs_link_now_ms();
        while ((e = kvs_tcp_listen(s->listen_addr, &s->lst, err, sizeof err)) && s->takeover_path[0] &&
               kvs_link_now_ms() - t_listen < 2000)
            poll(NULL, 0, 5);
        if (e) goto fail;
    }
    kvs_st_met_update(s);
    *out = s;
    return KVS_OK;
fail:
    if (errbuf && errlen) snprintf(errbuf, errlen, "%s", err[0] ? err : kvs_strerror(e));
    kvs_stage_free(s);
    return e ? e : KVS_ERR_INTERNAL;
}

void kvs_stage_free(struct kvs_stage *s)
{
    if (!s) return;
    if (s->seqs)
        for (int32_t i = 0; i < s->n_seq; i++)
            if (s->seqs[i].used) {
                if (s->is_head) kvs_st_head_end(s, &s->seqs[i], KVS_ERR_CANCELLED, 0, "stage shut down");
                else kvs_st_seq_free(s, &s->seqs[i]);
            }
    for (int i = 0; i < s->n_queue; i++) kvs_st_free_queued(s->queue[i]);
    for (int i = 0; i < MAX_PENDING_LINKS; i++) kvs_st_pend_close(&s->pend[i]);
    kvs_link_close(s->in);
    kvs_link_close(s->out);
    kvs_listener_close(s->lst);
    kvs_tls_free(s->tls);
    kvs_proto_decoder_free(s->in_dec);
    kvs_proto_decoder_free(s->out_dec);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    free(s->sbuf);
    free(s->rbuf);
    free(s->x);
    free(s->y);
    free(s->b_tok);
    free(s->b_seq);
    free(s->b_pos);
    free(s->b_req);
    free(s->b_logits);
    free(s->seqs);
    if (s->hist)
        for (int32_t i = 0; i < s->n_seq; i++) free(s->hist[i].ids);
    free(s->hist);
    kvs_tokenizer_free(s->tok);
    kvs_model_free(s->m);
    kvs_gguf_close(s->g);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

kvs_err kvs_stage_set_next(struct kvs_stage *s, const char *next, char *errbuf, size_t errlen)
{
    if (!next) {
        snprintf(errbuf, errlen, "next address '(null)'");
        return KVS_ERR_ARG;
    }
    return kvs_stage_set_neighbours(s, next, NULL, NULL, errbuf, errlen);
}

kvs_err kvs_stage_set_neighbours(struct kvs_stage *s, const char *next, const uint8_t next_key[KVS_KEY_PUB_BYTES],
                                 const uint8_t prev_key[KVS_KEY_PUB_BYTES], char *errbuf, size_t errlen)
{
    char why[300] = "";
    if (s->solo) {
        snprintf(errbuf, errlen, "stage [%d,%d) holds the whole model: it has no successor", (int)s->begin, (int)s->end);
        return KVS_ERR_ARG;
    }
    if ((next_key || prev_key) && !s->tls) {
        snprintf(errbuf, errlen, "stage [%d,%d) has no node key: its links are plaintext (--insecure)", (int)s->begin,
                 (int)s->end);
        return KVS_ERR_ARG;
    }
    bool too_long = next && strlen(next) >= sizeof s->new_next;
    if (next && (too_long || kvs_st_check_addr(next, false, why, sizeof why) != KVS_OK)) {
        snprintf(errbuf, errlen, "next address '%.200s': %s", next, too_long ? "too long" : why);
        return KVS_ERR_ARG;
    }
    pthread_mutex_lock(&s->mu);
    if (next) {
        snprintf(s->new_next, sizeof s->new_next, "%s", next);
        s->next_changed = true;
    }
    if (next_key) {
        memcpy(s->new_next_key, next_key, KVS_KEY_PUB_BYTES);
        s->next_key_changed = true;
    }
    if (prev_key) {
        memcpy(s->new_prev_key, prev_key, KVS_KEY_PUB_BYTES);
        s->prev_key_changed = true;
    }
    pthread_mutex_unlock(&s->mu);
    wake(s);
    return KVS_OK;
}

uint16_t kvs_stage_listen_port(const struct kvs_stage *s)
{
    return kvs_listener_port(s->lst);
}

bool kvs_stage_is_head(const struct kvs_stage *s)
{
    return s->is_head;
}

int32_t kvs_stage_n_ctx(const struct kvs_stage *s)
{
    return s->n_ctx;
}

const struct kvs_tokenizer *kvs_stage_tokenizer(const struct kvs_stage *s)
{
    return s->tok;
}

kvs_err kvs_stage_submit(struct kvs_stage *s, const struct kvs_stage_request *r, uint32_t *req)
{
    if (!s->is_head || !r || !r->on_event || !r->prompt || r->n_prompt < 1 || r->max_tokens < 1 ||
        r->n_stop_ids < 0 || r->n_stop_ids > (int32_t)KVS_PROTO_MAX_STOP)
        return KVS_ERR_ARG;
    if (r->n_prompt >= s->n_ctx) return KVS_ERR_RANGE;
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || (uint32_t)r->prompt[i] >= s->n_vocab) return KVS_ERR_RANGE;
    struct queued *w = calloc(1, sizeof *w);
    if (!w) return KVS_ERR_NOMEM;
    w->prompt = malloc((size_t)r->n_prompt * sizeof(int32_t));
    if (!w->prompt) {
        free(w);
        return KVS_ERR_NOMEM;
    }
    memcpy(w->prompt, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
    w->r = *r;
    w->r.prompt = w->prompt;
    if (r->stop_ids && r->n_stop_ids > 0) {
        memcpy(w->stop, r->stop_ids, (size_t)r->n_stop_ids * sizeof(int32_t));
    } else {
        memcpy(w->stop, s->eog, sizeof w->stop);
        w->r.n_stop_ids = (int32_t)s->n_eog;
    }
    w->r.stop_ids = w->stop;
    pthread_mutex_lock(&s->mu);
    if (s->n_queue >= MAX_QUEUE || s->stopped) {
        kvs_err e = s->stopped ? KVS_ERR_CANCELLED : KVS_ERR_FULL;
        pthread_mutex_unlock(&s->mu);
        kvs_st_free_queued(w);
        return e;
    }
    w->req = s->next_req++;
    if (s->next_req == 0) s->next_req = 1;
    s->queue[s->n_queue++] = w;
    if (req) *req = w->req;
    pthread_mutex_unlock(&s->mu);
    wake(s);
    return KVS_OK;
}

kvs_err kvs_stage_cancel(struct kvs_stage *s, uint32_t req)
{
    pthread_mutex_lock(&s->mu);
    if (s->n_cancels >= MAX_CANCELS) {
        pthread_mutex_unlock(&s->mu);
        return KVS_ERR_FULL;
    }
    s->cancels[s->n_cancels++] = req;
    pthread_mutex_unlock(&s->mu);
    wake(s);
    return KVS_OK;
}

bool kvs_stage_ring_ready(struct kvs_stage *s)
{
    pthread_mutex_lock(&s->mu);
    bool r = s->met.ring_ready;
    pthread_mutex_unlock(&s->mu);
    return r;
}

bool kvs_stage_ring_holding(struct kvs_stage *s)
{
    pthread_mutex_lock(&s->mu);
    bool r = s->met.ring_holding;
    pthread_mutex_unlock(&s->mu);
    return r;
}

kvs_err kvs_stage_wait_ready(struct kvs_stage *s, int timeout_ms)
{
    int64_t deadline = kvs_link_now_ms() + timeout_ms;
    pthread_mutex_lock(&s->mu);
    while (!s->met.ring_ready) {
        if (s->stopped || s->out_refusal_code || s->in_refusal_code) {
            kvs_err e = s->stopped ? KVS_ERR_CANCELLED : s->out_refusal_code ? s->out_refusal_code
                                                                              : s->in_refusal_code;
            pthread_mutex_unlock(&s->mu);
            return e;
        }
        int64_t left = deadline - kvs_link_now_ms();
        if (left <= 0) {
            pthread_mutex_unlock(&s->mu);
            return KVS_ERR_TIMEOUT;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t step = left < 100 ? left : 100;
        ts.tv_nsec += (long)(step * 1000000);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

bool kvs_stage_link_error(struct kvs_stage *s, char *buf, size_t cap)
{
    pthread_mutex_lock(&s->mu);
    bool any = s->out_dial_err[0] != '\0';
    if (buf && cap) snprintf(buf, cap, "%s", s->out_dial_err);
    pthread_mutex_unlock(&s->mu);
    return any;
}

kvs_err kvs_stage_ring_error(struct kvs_stage *s, char *buf, size_t cap)
{
    pthread_mutex_lock(&s->mu);
    kvs_err e = KVS_OK;
    const char *m = "";
    if (s->stopped) {
        e = KVS_ERR_CANCELLED;
        m = "the stage stopped";
    } else if (s->out_refusal_code) {
        e = s->out_refusal_code;
        m = s->out_refusal;
    } else if (s->in_refusal_code) {
        e = s->in_refusal_code;
        m = s->in_refusal;
    }
    if (buf && cap) snprintf(buf, cap, "%s", m);
    pthread_mutex_unlock(&s->mu);
    return e;
}

void kvs_stage_metrics(struct kvs_stage *s, struct kvs_stage_metrics *m)
{
    pthread_mutex_lock(&s->mu);
    *m = s->met;
    pthread_mutex_unlock(&s->mu);
}

int kvs_stage_ring_stats(struct kvs_stage *s, struct kvs_stage_hop *out, int cap, double *rtt_ms)
{
    pthread_mutex_lock(&s->mu);
    int n = s->is_head ? s->n_hops : 0;
    for (int i = 0; i < n && i < cap; i++) out[i] = s->hops[i];
    if (rtt_ms) *rtt_ms = n ? s->probe_rtt_ms : 0.0;
    pthread_mutex_unlock(&s->mu);
    return n;
}
