/* A tiny persistent thread pool: run(fn, ctx, nth) calls fn(ctx, i, nth) for i in 0..nth-1,
 * i = 0 on the calling thread, and returns when all are done. Workers spin briefly after a
 * job (decode calls come every ~100 us) and then sleep on a condition variable. */
#ifndef PIE_QUANT_POOL_H
#define PIE_QUANT_POOL_H

typedef void (*pool_task_fn)(void *ctx, int ith, int nth);

/* Runs the task on min(nth, POOL_MAX_THREADS) threads; nth <= 1 runs it inline. */
void pool_run(pool_task_fn fn, void *ctx, int nth);

#define POOL_MAX_THREADS 64

#endif
