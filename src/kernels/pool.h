/* Thread pool tuning for embedders that create models (and so pools)
 * indirectly: the pool itself is declared in kernels/kernels.h. */
#ifndef KVS_KERNELS_POOL_H
#define KVS_KERNELS_POOL_H

/* Relax iterations a pool's waiting threads spin before sleeping (workers)
 * or yielding (the caller), for pools created afterwards on the calling
 * thread (e.g. by kvs_model_load); spin < 0 restores the default, a long spin
 * (~0.1-1 ms) that suits a process with its cores to itself. KVASIR_SPIN
 * overrides both. Returns the previous setting (-1: default). Ring stages
 * that share cores use a short spin, so an idle stage gives its cores up as
 * soon as its forward ends. */
int kvs_pool_set_thread_spin(int spin);

#endif
