/* A tiny persistent thread pool: pool_run(fn, ctx, nth) calls fn(ctx) on the calling thread and
 * on up to nth - 1 workers that join in time, and returns when every call has returned. fn must
 * take its work from a shared atomic cursor (a worker may join late or not at all), so that the
 * caller alone would finish it. Workers poll briefly for the next job, then sleep. */
#ifndef PIE_QUANT_POOL_H
#define PIE_QUANT_POOL_H

typedef void (*pool_task_fn)(void *ctx);

/* Runs the task on at most min(nth, POOL_MAX_THREADS) threads; nth <= 1 runs it inline. */
void pool_run(pool_task_fn fn, void *ctx, int nth);

#define POOL_MAX_THREADS 64

#endif
