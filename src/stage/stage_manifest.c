/* Stage parameters from a manifest (docs/MANIFEST.md). */
#include "stage/stage_impl.h"

#include "plan/plan.h"

kvs_err kvs_stage_params_from_manifest(const struct kvs_manifest *mf, int32_t rank, struct kvs_stage_params *p)
{
    if (rank < 0 || (size_t)rank >= mf->n_ranks) return KVS_ERR_NOT_FOUND;
    if (!mf->model_path[0]) return KVS_ERR_ARG;
    const struct kvs_manifest_rank *k = &mf->ranks[rank];
    p->model_path = mf->model_path;
    p->fingerprint = mf->fingerprint[0] ? mf->fingerprint : NULL;
    p->content_id = mf->content_id[0] ? mf->content_id : NULL;
    p->block_begin = (int32_t)k->begin;
    p->block_end = (int32_t)k->end;
    p->listen = k->listen;
    p->next = k->next;
    if (k->threads > 0) p->n_threads = (int32_t)k->threads;
    /* the device's backend from the inventory (kvasir bench --probe --backend opencl); the
     * others have no implementation here: such a rank computes on the CPU */
    p->backend = k->backend == KVS_PLAN_BACKEND_OPENCL ? 1 : 0;
    /* the serving targets the plan was made for (docs/MANIFEST.md) */
    if (mf->ctx > 0) p->n_ctx = (int32_t)mf->ctx;
    if (mf->seqs > 0) p->n_seq = (int32_t)mf->seqs;
    /* the precision of this rank's out link: its own field, else the targets', else f32 */
    uint32_t bb = k->boundary_bytes ? k->boundary_bytes : mf->boundary_bytes;
    p->boundary_f32 = bb != 2;
    /* a keyed manifest (every rank has one, docs/MANIFEST.md): the neighbours' keys */
    const char *pk = mf->ranks[(rank + mf->n_ranks - 1) % mf->n_ranks].key;
    const char *nk = mf->ranks[(rank + 1) % mf->n_ranks].key;
    if (pk[0] && nk[0]) {
        p->has_prev_key = kvs_key_parse_public(pk, p->prev_key) == KVS_OK;
        p->has_next_key = kvs_key_parse_public(nk, p->next_key) == KVS_OK;
    }
    return KVS_OK;
}
