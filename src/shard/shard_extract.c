/* Shard extraction from a mapped model, and the shard index. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "shard/shard_impl.h"

kvs_err kvs_shard_extract(const struct kvs_gguf *src, uint32_t begin, uint32_t end, const char *out_path,
                          char *errbuf, size_t errlen)
{
    kvs_err err = kvs_shard_check(src, begin, end, errbuf, errlen);
    if (err)
        return err;
    size_t *idx = NULL, n = 0;
    uint8_t (*sha)[32] = NULL;
    struct kvs_gguf_writer *w = NULL;
    err = kvs_shard_window_tensors(src, begin, end, &idx, &n, errbuf, errlen);
    if (err)
        goto fail;
    sha = calloc(n ? n : 1, sizeof *sha);
    if (!sha) {
        err = KVS_ERR_NOMEM;
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(src, idx[i]);
        if (!t->data && t->bytes) {
            err = kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "tensor '%s' has no data in the source", t->name);
            goto fail;
        }
        err = kvs_shard_sha256(t->data, t->bytes, sha[i]);
        if (err)
            goto fail;
    }
    /* The source's content id: a full model's costs one read of its data section. */
    uint8_t cid[32];
    char cmsg[256];
    bool has_cid = kvs_shard_content_id(src, cid, cmsg, sizeof cmsg) == KVS_OK;
    err = kvs_shard__writer(src, begin, end, idx, n, (const uint8_t(*)[32])sha, has_cid ? cid : NULL, true, &w,
                            errbuf, errlen);
    if (err)
        goto fail;
    err = kvs_gguf_writer_write_file(w, out_path);
    if (err)
        kvs_shard__err(err, errbuf, errlen, "cannot write %s: %s", out_path, kvs_strerror(err));
fail:
    kvs_gguf_writer_free(w);
    free(sha);
    free(idx);
    return err;
}

/* --- index ------------------------------------------------------------------ */

void kvs_shard_index_free(struct kvs_shard_index *ix)
{
    if (!ix)
        return;
    free(ix->tensors);
    memset(ix, 0, sizeof *ix);
}

kvs_err kvs_shard_index_build(const struct kvs_gguf *g, struct kvs_shard_index *ix, char *errbuf, size_t errlen)
{
    memset(ix, 0, sizeof *ix);
    uint8_t fp[32];
    kvs_err err = kvs_gguf_fingerprint(g, fp);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "cannot fingerprint the model: %s", kvs_strerror(err));
    kvs_gguf_fingerprint_hex(fp, ix->fingerprint);
    ix->file_size = kvs_gguf_file_size(g);
    ix->data_offset = kvs_gguf_data_offset(g);
    ix->alignment = kvs_gguf_alignment(g);
    err = kvs_shard_metadata_digest(g, ix->metadata_sha256);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "cannot digest the model's metadata: %s", kvs_strerror(err));
    size_t n = kvs_gguf_n_tensors(g);
    ix->tensors = calloc(n ? n : 1, sizeof *ix->tensors);
    if (!ix->tensors)
        return KVS_ERR_NOMEM;
    ix->n_tensors = n;
    for (size_t i = 0; i < n; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        struct kvs_shard_index_entry *e = &ix->tensors[i];
        if (!t->data && t->bytes) {
            kvs_shard_index_free(ix);
            return kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "tensor '%s' has no data", t->name);
        }
        snprintf(e->name, sizeof e->name, "%s", t->name);
        e->type = t->type;
        e->n_dims = t->n_dims;
        memcpy(e->ne, t->ne, sizeof e->ne);
        e->offset = ix->data_offset + t->offset;
        e->size = t->bytes;
        err = kvs_shard_sha256(t->data, t->bytes, e->sha256);
        if (err) {
            kvs_shard_index_free(ix);
            return err;
        }
    }
    return KVS_OK;
}

kvs_err kvs_shard_index_save(const struct kvs_shard_index *ix, const char *path, char *errbuf, size_t errlen)
{
    json_t *root = json_object(), *arr = json_array();
    if (!root || !arr) {
        json_decref(root);
        json_decref(arr);
        return KVS_ERR_NOMEM;
    }
    json_object_set_new(root, "format", json_string("kvasir-shard-index"));
    json_object_set_new(root, "version", json_integer(2));
    json_object_set_new(root, "fingerprint", json_string(ix->fingerprint));
    json_object_set_new(root, "file_size", json_integer((json_int_t)ix->file_size));
    json_object_set_new(root, "data_offset", json_integer((json_int_t)ix->data_offset));
    json_object_set_new(root, "alignment", json_integer((json_int_t)ix->alignment));
    char metahex[65];
    kvs_shard_hex(ix->metadata_sha256, metahex);
    json_object_set_new(root, "metadata_sha256", json_string(metahex));
    uint8_t cid[32];
    char cidhex[65];
    if (kvs_shard_index_content_id(ix, cid) != KVS_OK) {
        json_decref(root);
        json_decref(arr);
        return kvs_shard__err(KVS_ERR_FORMAT, errbuf, errlen, "the index has no single content id (duplicate names?)");
    }
    kvs_shard_hex(cid, cidhex);
    json_object_set_new(root, "content_id", json_string(cidhex));
    for (size_t i = 0; i < ix->n_tensors; i++) {
        const struct kvs_shard_index_entry *e = &ix->tensors[i];
        json_t *shape = json_array();
        for (uint32_t d = 0; d < e->n_dims; d++)
            json_array_append_new(shape, json_integer((json_int_t)e->ne[d]));
        char hex[65];
        kvs_shard_hex(e->sha256, hex);
        json_t *o = json_pack("{s:s, s:s, s:i, s:o, s:I, s:I, s:s}", "name", e->name, "type",
                              kvs_type_name(e->type), "type_id", (int)e->type, "shape", shape, "offset",
                              (json_int_t)e->offset, "size", (json_int_t)e->size, "sha256", hex);
        if (!o) {
            json_decref(root);
            json_decref(arr);
            return KVS_ERR_NOMEM;
        }
        json_array_append_new(arr, o);
    }
    json_object_set_new(root, "tensors", arr);
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) {
        json_decref(root);
        return kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "path too long");
    }
    int rc = json_dump_file(root, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (rc != 0 || rename(tmp, path) != 0) {
        remove(tmp);
        return kvs_shard__err(KVS_ERR_IO, errbuf, errlen, "cannot write %s", path);
    }
    return KVS_OK;
}

static bool get_u64(json_t *o, const char *key, uint64_t *v)
{
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x) || json_integer_value(x) < 0)
        return false;
    *v = (uint64_t)json_integer_value(x);
    return true;
}

kvs_err kvs_shard_index_parse(const char *text, size_t len, struct kvs_shard_index *ix, char *errbuf,
                              size_t errlen)
{
    memset(ix, 0, sizeof *ix);
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    if (!root)
        return kvs_shard__err(KVS_ERR_FORMAT, errbuf, errlen, "index is not JSON: %s (line %d)", je.text,
                              je.line);
    kvs_err err = KVS_ERR_FORMAT;
    const char *what = "root";
    json_t *fp = json_object_get(root, "fingerprint"), *arr = json_object_get(root, "tensors");
    uint64_t align = 0;
    if (!json_is_object(root))
        goto fail;
    what = "fingerprint";
    if (!json_is_string(fp) || json_string_length(fp) != 64)
        goto fail;
    snprintf(ix->fingerprint, sizeof ix->fingerprint, "%s", json_string_value(fp));
    what = "file_size/data_offset/alignment";
    if (!get_u64(root, "file_size", &ix->file_size) || !get_u64(root, "data_offset", &ix->data_offset) ||
        !get_u64(root, "alignment", &align) || align == 0 || align > (1u << 30))
        goto fail;
    ix->alignment = (uint32_t)align;
    /* required since content recipe v2 (index version 2): an older index cannot name a content id */
    json_t *meta = json_object_get(root, "metadata_sha256");
    what = "metadata_sha256 (missing in an index made before index version 2: rebuild it with kvasir shard index)";
    if (!json_is_string(meta) || !kvs_shard_unhex(json_string_value(meta), json_string_length(meta), ix->metadata_sha256))
        goto fail;
    what = "tensors";
    if (!json_is_array(arr))
        goto fail;
    size_t n = json_array_size(arr);
    if (n > KVS_SHARD_INDEX_MAX_TENSORS) {
        err = KVS_ERR_RANGE;
        goto fail;
    }
    ix->tensors = calloc(n ? n : 1, sizeof *ix->tensors);
    if (!ix->tensors) {
        err = KVS_ERR_NOMEM;
        goto fail;
    }
    ix->n_tensors = n;
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(arr, i);
        struct kvs_shard_index_entry *e = &ix->tensors[i];
        json_t *name = json_object_get(o, "name"), *sha = json_object_get(o, "sha256");
        json_t *shape = json_object_get(o, "shape");
        uint64_t type = 0;
        what = "tensors[].name";
        if (!json_is_string(name) || json_string_length(name) >= KVS_GGUF_MAX_NAME)
            goto fail;
        snprintf(e->name, sizeof e->name, "%s", json_string_value(name));
        what = "tensors[].type_id/offset/size";
        if (!get_u64(o, "type_id", &type) || type >= KVS_TYPE_COUNT || !get_u64(o, "offset", &e->offset) ||
            !get_u64(o, "size", &e->size) || e->offset > ix->file_size || e->size > ix->file_size - e->offset)
            goto fail;
        e->type = (enum kvs_type)type;
        what = "tensors[].shape";
        if (!json_is_array(shape) || json_array_size(shape) < 1 || json_array_size(shape) > KVS_GGUF_MAX_DIMS)
            goto fail;
        e->n_dims = (uint32_t)json_array_size(shape);
        for (uint32_t d = 0; d < KVS_GGUF_MAX_DIMS; d++) {
            e->ne[d] = 1;
            if (d < e->n_dims) {
                json_t *x = json_array_get(shape, d);
                if (!json_is_integer(x) || json_integer_value(x) < 0)
                    goto fail;
                e->ne[d] = json_integer_value(x);
            }
        }
        what = "tensors[].sha256";
        if (!json_is_string(sha) || !kvs_shard_unhex(json_string_value(sha), json_string_length(sha), e->sha256))
            goto fail;
    }
    /* content_id (optional, derived): when present it must be that of the entries */
    json_t *cj = json_object_get(root, "content_id");
    what = "content_id";
    if (cj) {
        uint8_t want[32], got[32];
        if (!json_is_string(cj) || !kvs_shard_unhex(json_string_value(cj), json_string_length(cj), want) ||
            kvs_shard_index_content_id(ix, got) != KVS_OK || memcmp(want, got, 32) != 0)
            goto fail;
    }
    json_decref(root);
    return KVS_OK;
fail:
    json_decref(root);
    kvs_shard_index_free(ix);
    return kvs_shard__err(err, errbuf, errlen, "bad shard index: field '%s'", what);
}

kvs_err kvs_shard_index_load(const char *path, struct kvs_shard_index *ix, char *errbuf, size_t errlen)
{
    memset(ix, 0, sizeof *ix);
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvs_shard__err(KVS_ERR_IO, errbuf, errlen, "cannot open %s", path);
    /* Bounded read: an index has ~200 bytes per tensor. */
    const size_t cap = (size_t)KVS_SHARD_INDEX_MAX_TENSORS * 512;
    size_t n = 0, size = 65536;
    char *buf = malloc(size);
    kvs_err err = KVS_OK;
    while (buf) {
        size_t got = fread(buf + n, 1, size - n, f);
        n += got;
        if (n < size)
            break;
        if (size >= cap) {
            err = kvs_shard__err(KVS_ERR_RANGE, errbuf, errlen, "%s is larger than %zu bytes", path, cap);
            break;
        }
        char *nb = realloc(buf, size * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        size *= 2;
    }
    bool ioerr = ferror(f);
    fclose(f);
    if (!buf)
        return KVS_ERR_NOMEM;
    if (!err && ioerr)
        err = kvs_shard__err(KVS_ERR_IO, errbuf, errlen, "cannot read %s", path);
    if (!err)
        err = kvs_shard_index_parse(buf, n, ix, errbuf, errlen);
    free(buf);
    return err;
}

const struct kvs_shard_index_entry *kvs_shard_index_find(const struct kvs_shard_index *ix, const char *name)
{
    for (size_t i = 0; i < ix->n_tensors; i++)
        if (!strcmp(ix->tensors[i].name, name))
            return &ix->tensors[i];
    return NULL;
}
