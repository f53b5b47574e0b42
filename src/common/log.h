/* Logging to stderr. The level is read once from the environment variable
 * KVASIR_LOG (error|warn|info|debug; default info) on first use; there is no
 * other process-wide state. Thread-safe: each message is one fprintf. */
#ifndef KVS_COMMON_LOG_H
#define KVS_COMMON_LOG_H

enum kvs_log_level { KVS_LOG_ERROR = 0, KVS_LOG_WARN, KVS_LOG_INFO, KVS_LOG_DEBUG };

/* printf-style message at a level, prefixed with the UTC time to the
 * millisecond and "kvasir[pid] LEVEL: " (e.g. "2026-12-02T07:55:01.123Z
 * kvasir[4242] info: ...") and terminated with a newline (do not include one).
 * `kvasir -v` / `--log-level L` set KVASIR_LOG for the process and its
 * children (src/cli/main.c). */
void kvs_log(enum kvs_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define KVS_LOGE(...) kvs_log(KVS_LOG_ERROR, __VA_ARGS__)
#define KVS_LOGW(...) kvs_log(KVS_LOG_WARN, __VA_ARGS__)
#define KVS_LOGI(...) kvs_log(KVS_LOG_INFO, __VA_ARGS__)
#define KVS_LOGD(...) kvs_log(KVS_LOG_DEBUG, __VA_ARGS__)

#endif
