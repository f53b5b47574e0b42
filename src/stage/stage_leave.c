/* A planned leave (docs/PROTOCOL.md §5.2): a stage told to stop (SIGTERM)
 * under a local supervisor asks for a replacement, keeps serving while it
 * loads, then drains through the ring (LEAVE ASK round to the head, the head's
 * LEAVE DRAIN back to it), hands its sequences' state (KV cache and recurrent
 * state of its window) to the replacement in a file and stops. The neighbours
 * take the link changes that follow as planned: no slot is freed, no ERROR
 * goes round, nothing is replayed. */
#include "stage/stage_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"

#define HANDOVER_MAGIC "KVSHAND1" /* the state file: this magic, then the fields of write_state */
#define TAKEOVER_POLL_MS 2

static bool ctl_say(struct kvs_stage *s, const char *word)
{
    if (s->p.control_fd < 0 || s->ctl_eof) return false;
    size_t n = strlen(word);
    ssize_t w = send(s->p.control_fd, word, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    return w == (ssize_t)n;
}

bool kvs_st_leave_begin(struct kvs_stage *s)
{
    /* the event is left unread when the stage stops: whoever else watches stop_fd sees it too */
    if (s->leave_state != LEAVE_NONE) return false; /* a second stop: now */
    if (s->is_head || s->solo || !s->handover_path[0] || s->p.control_fd < 0 || s->ctl_eof ||
        s->p.backend == KVS_BACKEND_OPENCL || !s->in || s->out_state != OUT_UP)
        return false;
    if (!ctl_say(s, "leave\n")) return false;
    { /* consume the event (a signalfd record is 128 bytes), so that only a second one stops at once */
        uint8_t buf[512];
        ssize_t r = read(s->p.stop_fd, buf, sizeof buf);
        (void)r;
    }
    s->leave_state = LEAVE_WAIT_GO;
    s->leave_since = kvs_link_now_ms();
    KVS_LOGI("stage [%d,%d) leaving: serving until its replacement is ready (%d request%s in flight)", (int)s->begin,
             (int)s->end, (int)kvs_st_n_active(s), kvs_st_n_active(s) == 1 ? "" : "s");
    return true;
}

static void send_leave(struct kvs_stage *s, uint32_t begin, uint32_t end, uint32_t phase)
{
    struct kvs_leave lv = { .block_begin = begin, .block_end = end, .phase = phase };
    kvs_proto_put_leave(s->sbuf + KVS_PROTO_HEADER_BYTES, &lv);
    struct kvs_frame_header h = { .kind = KVS_FRAME_LEAVE, .payload_len = KVS_PROTO_LEAVE_BYTES };
    kvs_st_send_built(s, &h);
}

void kvs_st_leave_control(struct kvs_stage *s)
{
    char buf[64];
    ssize_t n = recv(s->p.control_fd, buf, sizeof buf - 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
        s->ctl_eof = true;
        if (s->leave_state == LEAVE_WAIT_GO || s->leave_state == LEAVE_WAIT_DRAIN) {
            KVS_LOGW("stage [%d,%d): the supervisor is gone: stopping now", (int)s->begin, (int)s->end);
            s->leave_stop = true;
        }
        return;
    }
    buf[n] = '\0';
    if (strstr(buf, "no")) { /* no replacement (any more): stop as before */
        if (s->leave_state == LEAVE_WAIT_GO || s->leave_state == LEAVE_WAIT_DRAIN) s->leave_stop = true;
        return;
    }
    if (strstr(buf, "go") && s->leave_state == LEAVE_WAIT_GO) {
        if (!s->in || s->out_state != OUT_UP) {
            s->leave_stop = true;
            return;
        }
        KVS_LOGI("stage [%d,%d): replacement ready after %lld ms: draining", (int)s->begin, (int)s->end,
                 (long long)(kvs_link_now_ms() - s->leave_since));
        send_leave(s, (uint32_t)s->begin, (uint32_t)s->end, KVS_LEAVE_ASK);
        s->leave_state = LEAVE_WAIT_DRAIN;
        s->leave_since = kvs_link_now_ms();
    }
}

void kvs_st_on_leave(struct kvs_stage *s, const struct kvs_frame *f)
{
    struct kvs_leave lv;
    kvs_proto_get_leave(f, &lv);
    if (s->is_head) {
        if (lv.phase != KVS_LEAVE_ASK) return;
        if (s->hold_since || s->drain_since) { /* a fault is being healed, or a drain runs: the leaver times out */
            KVS_LOGI("stage [%u,%u) asks to leave while the ring %s: not now", lv.block_begin, lv.block_end,
                     s->hold_since ? "is broken" : "drains another stage");
            return;
        }
        s->drain_since = kvs_link_now_ms();
        s->drain_probe = s->probe_no;
        s->drain_begin = lv.block_begin;
        s->drain_end = lv.block_end;
        if (lv.block_begin == (uint32_t)s->end) s->out_leaving = true;
        if (lv.block_end == s->hp.n_block) s->in_leaving = true; /* the tail leaves: the head is its successor */
        KVS_LOGI("stage [%u,%u) leaves on purpose: holding new steps until its replacement is in (%d request%s in "
                 "flight, nothing replayed)", lv.block_begin, lv.block_end, (int)kvs_st_head_n_live(s),
                 kvs_st_head_n_live(s) == 1 ? "" : "s");
        send_leave(s, lv.block_begin, lv.block_end, KVS_LEAVE_DRAIN);
        return;
    }
    if (lv.phase == KVS_LEAVE_DRAIN && lv.block_begin == (uint32_t)s->begin && lv.block_end == (uint32_t)s->end) {
        if (s->leave_state == LEAVE_WAIT_DRAIN) s->leave_state = LEAVE_DONE; /* nothing more will come */
        return; /* addressed to this window: not forwarded */
    }
    if (lv.phase == KVS_LEAVE_ASK && lv.block_end == (uint32_t)s->begin) s->in_leaving = true;
    if (lv.phase == KVS_LEAVE_DRAIN && lv.block_begin == (uint32_t)s->end) s->out_leaving = true;
    send_leave(s, lv.block_begin, lv.block_end, lv.phase);
}

void kvs_st_leave_timers(struct kvs_stage *s)
{
    int64_t now = kvs_link_now_ms();
    if (s->leave_state == LEAVE_WAIT_GO && now - s->leave_since > KVS_STAGE_LEAVE_GO_MS) {
        KVS_LOGW("stage [%d,%d): no replacement within %d ms: stopping now", (int)s->begin, (int)s->end,
                 KVS_STAGE_LEAVE_GO_MS);
        s->leave_stop = true;
    }
    if (s->leave_state == LEAVE_WAIT_DRAIN && now - s->leave_since > LEAVE_DRAIN_MS) {
        KVS_LOGW("stage [%d,%d): the head did not drain within %d ms: stopping now", (int)s->begin, (int)s->end,
                 LEAVE_DRAIN_MS);
        s->leave_stop = true;
    }
    if (s->is_head && s->drain_since && now - s->drain_since > LEAVE_DRAIN_MS) {
        char msg[160];
        snprintf(msg, sizeof msg, "stage [%u,%u) left and its replacement was not in within %d ms", s->drain_begin,
                 s->drain_end, LEAVE_DRAIN_MS);
        s->drain_since = 0;
        s->out_leaving = false;
        kvs_st_drop_all(s, KVS_ERR_PEER, msg); /* a fault: hold and replay (§5.1) */
    }
}

void kvs_st_head_drain_back(struct kvs_stage *s, uint32_t probe_no)
{
    if (!s->drain_since || (int32_t)(probe_no - s->drain_probe) <= 0) return;
    KVS_LOGI("stage [%u,%u) replaced: the ring is whole again after %lld ms of drain (no request replayed)",
             s->drain_begin, s->drain_end, (long long)(kvs_link_now_ms() - s->drain_since));
    s->drain_since = 0;
    s->admit_more = true;
}

/* --- the state file ----------------------------------------------------------- */

static bool put(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n; }
static bool get(FILE *f, void *p, size_t n) { return fread(p, 1, n, f) == n; }

/* The tail's part of a sequence (after its model state): what its sampler
 * and limits need, and the ids the repetition penalty remembers. */
struct tail_rec {
    struct kvs_req_params rp;
    uint32_t max_tokens, generated;
    uint32_t finished;
    int32_t n_recent; /* ids that follow, <= KVS_SAMPLER_MAX_LAST_N */
};

/* The header both sides check: the same model, window, context and slots. */
struct hand_hdr {
    char magic[8];
    uint8_t fp[32];
    int32_t begin, end, n_ctx, n_seq;
    uint32_t n_embd, n_used;
};

bool kvs_st_leave_write(struct kvs_stage *s)
{
    kvs_listener_close(s->lst); /* the replacement binds this address once it has the state */
    s->lst = NULL;
    char tmp[sizeof s->handover_path + 8];
    snprintf(tmp, sizeof tmp, "%s.part", s->handover_path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        KVS_LOGE("stage [%d,%d): cannot write its state to %s: %s", (int)s->begin, (int)s->end, tmp, strerror(errno));
        return false;
    }
    struct hand_hdr h = { .begin = s->begin, .end = s->end, .n_ctx = s->n_ctx, .n_seq = s->n_seq,
                          .n_embd = s->n_embd };
    memcpy(h.magic, HANDOVER_MAGIC, 8);
    memcpy(h.fp, s->fp, 32);
    for (int32_t i = 0; i < s->n_seq; i++) h.n_used += s->seqs[i].used;
    bool ok = put(f, &h, sizeof h);
    uint8_t *blob = NULL;
    size_t cap = 0, total = 0;
    for (int32_t i = 0; i < s->n_seq && ok; i++) {
        const struct seq *q = &s->seqs[i];
        if (!q->used) continue;
        size_t n = kvs_model_seq_state_bytes(s->m, i);
        if (n > cap) {
            uint8_t *nb = realloc(blob, n);
            if (!nb) {
                ok = false;
                break;
            }
            blob = nb;
            cap = n;
        }
        int32_t np = kvs_model_seq_len(s->m, i);
        uint64_t n64 = n;
        ok = (n == 0 || kvs_model_seq_state_get(s->m, i, blob, cap) == KVS_OK) && put(f, &i, 4) &&
             put(f, &q->req, 4) && put(f, &np, 4) && put(f, &n64, 8) && put(f, blob, n);
        total += n;
        if (ok && s->is_tail) {
            struct tail_rec t = { .rp = q->rp, .max_tokens = q->max_tokens, .generated = q->generated,
                                  .finished = q->finished };
            t.n_recent = kvs_sampler_recent(q->smp, NULL, 0);
            int32_t *recent = malloc((size_t)t.n_recent * sizeof *recent + 1);
            ok = recent && kvs_sampler_recent(q->smp, recent, t.n_recent) == t.n_recent && put(f, &t, sizeof t) &&
                 put(f, recent, (size_t)t.n_recent * sizeof *recent);
            free(recent);
            total += sizeof t + (size_t)t.n_recent * sizeof *recent;
        }
    }
    free(blob);
    ok = fflush(f) == 0 && ok;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, s->handover_path)) {
        KVS_LOGE("stage [%d,%d): cannot write its state to %s", (int)s->begin, (int)s->end, s->handover_path);
        unlink(tmp);
        return false;
    }
    KVS_LOGI("stage [%d,%d) handed over %u sequence%s (%zu bytes of state) in %lld ms of drain", (int)s->begin,
             (int)s->end, h.n_used, h.n_used == 1 ? "" : "s", total,
             (long long)(kvs_link_now_ms() - s->leave_since));
    return true;
}

static bool take_file(struct kvs_stage *s, FILE *f, char *why, size_t cap)
{
    struct hand_hdr h;
    if (!get(f, &h, sizeof h) || memcmp(h.magic, HANDOVER_MAGIC, 8)) {
        snprintf(why, cap, "not a state file");
        return false;
    }
    if (memcmp(h.fp, s->fp, 32) || h.begin != s->begin || h.end != s->end || h.n_ctx != s->n_ctx ||
        h.n_seq != s->n_seq || h.n_embd != s->n_embd || h.n_used > (uint32_t)s->n_seq) {
        snprintf(why, cap, "it holds window [%d,%d) of another model or shape (ctx %d, %d seqs)", (int)h.begin,
                 (int)h.end, (int)h.n_ctx, (int)h.n_seq);
        return false;
    }
    uint8_t *blob = NULL;
    bool ok = true;
    for (uint32_t k = 0; k < h.n_used && ok; k++) {
        int32_t slot, np;
        uint32_t req;
        uint64_t n;
        ok = get(f, &slot, 4) && get(f, &req, 4) && get(f, &np, 4) && get(f, &n, 8) && slot >= 0 &&
             slot < s->n_seq && !s->seqs[slot].used && req != 0 && n <= ((uint64_t)1 << 40);
        uint8_t *nb = ok ? realloc(blob, n ? (size_t)n : 1) : NULL;
        ok = ok && nb;
        if (nb) blob = nb;
        ok = ok && get(f, blob, (size_t)n) && kvs_model_seq_state_set(s->m, slot, np, blob, (size_t)n) == KVS_OK;
        if (ok) {
            struct seq *q = &s->seqs[slot];
            memset(q, 0, sizeof *q);
            q->used = true;
            q->req = req;
            s->n_taken++;
            if (s->is_tail) { /* the sampler anew with the same parameters and remembered ids */
                struct tail_rec t;
                int32_t *recent = NULL;
                ok = get(f, &t, sizeof t) && t.n_recent >= 0 && t.n_recent <= KVS_SAMPLER_MAX_LAST_N &&
                     t.rp.n_stop <= KVS_PROTO_MAX_STOP &&
                     (recent = malloc((size_t)t.n_recent * sizeof *recent + 1)) != NULL &&
                     get(f, recent, (size_t)t.n_recent * sizeof *recent);
                if (ok) kvs_st_tail_begin(s, q, &t.rp, 0, NULL);
                ok = ok && q->used && q->smp;
                if (ok) {
                    for (int32_t j = 0; j < t.n_recent; j++) kvs_sampler_accept(q->smp, recent[j]);
                    q->max_tokens = t.max_tokens;
                    q->generated = t.generated;
                    q->finished = t.finished != 0;
                }
                free(recent);
            }
        }
    }
    free(blob);
    if (!ok) snprintf(why, cap, "a sequence record is short or does not fit");
    return ok;
}

void kvs_st_takeover(struct kvs_stage *s)
{
    int64_t t0 = kvs_link_now_ms();
    if (!ctl_say(s, "ready\n")) KVS_LOGW("stage [%d,%d): cannot tell the supervisor it is ready", (int)s->begin, (int)s->end);
    FILE *f = NULL;
    while (!(f = fopen(s->takeover_path, "rb")) && kvs_link_now_ms() - t0 < KVS_STAGE_LEAVE_GO_MS) {
        if (s->p.control_fd >= 0 && !s->ctl_eof) { /* the supervisor's "no": the leaving stage stopped instead */
            struct pollfd pf = { .fd = s->p.control_fd, .events = POLLIN };
            if (poll(&pf, 1, TAKEOVER_POLL_MS) > 0) {
                char buf[16];
                ssize_t n = recv(s->p.control_fd, buf, sizeof buf, MSG_DONTWAIT);
                if (n <= 0 || memchr(buf, 'n', (size_t)n)) {
                    s->ctl_eof = n <= 0;
                    break;
                }
            }
        } else {
            poll(NULL, 0, TAKEOVER_POLL_MS);
        }
    }
    char why[256] = "no state came";
    bool ok = f && take_file(s, f, why, sizeof why);
    if (f) {
        fclose(f);
        unlink(s->takeover_path);
    }
    if (ok) {
        KVS_LOGI("stage [%d,%d) took over %d sequence%s from its predecessor process after %lld ms", (int)s->begin,
                 (int)s->end, (int)s->n_taken, s->n_taken == 1 ? "" : "s", (long long)(kvs_link_now_ms() - t0));
        return;
    }
    for (int32_t i = 0; i < s->n_seq; i++)
        if (s->seqs[i].used) kvs_st_seq_free(s, &s->seqs[i]);
    s->n_taken = 0;
    s->out_ever_up = true; /* its first link to the successor is a re-join: the head replays (§5.1) */
    KVS_LOGW("stage [%d,%d): taking over %s failed (%s): starting empty (the head replays its requests)",
             (int)s->begin, (int)s->end, s->takeover_path, why);
}
