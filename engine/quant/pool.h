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

/* Plain-C loops that -O3 vectorizes: an AVX2 clone beside the baseline one, picked at load by
 * the CPU (an ifunc; no -march flag). No FP exception is read anywhere, so the loops need not
 * keep them (floorf and float comparisons, as fast_exp.h's exp_approx has, stay scalar else). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default"), optimize("no-trapping-math")))
#else
#define VECTOR_CLONES
#endif

#include <stdatomic.h>
#include <stdint.h>

/* Rows of a job shared out in chunks: whichever thread runs takes the next one */
typedef struct {
    int64_t num_rows, chunk_rows;
    atomic_llong next_row;
} row_cursor;

static inline void row_cursor_init(row_cursor *rows, int64_t num_rows, int num_threads,
                                   int64_t min_chunk) {
    int64_t chunk = num_rows / ((int64_t)(num_threads > 0 ? num_threads : 1) * 4);
    rows->num_rows = num_rows;
    /* a few chunks per thread, each a multiple of min_chunk (so 8-row groups stay whole) */
    rows->chunk_rows = chunk < min_chunk ? min_chunk : chunk / min_chunk * min_chunk;
    atomic_init(&rows->next_row, 0);
}

/* 1 and the next chunk [*start, *start + *count), or 0 when every row is taken */
static inline int next_chunk(row_cursor *rows, int64_t *start, int64_t *count) {
    *start = atomic_fetch_add(&rows->next_row, rows->chunk_rows);
    if (*start >= rows->num_rows) return 0;
    *count = rows->num_rows - *start < rows->chunk_rows ? rows->num_rows - *start : rows->chunk_rows;
    return 1;
}

/* fn(ctx, start, count) over chunks of [0, num_rows) on up to nth threads: the row-splitting
 * job of pool_run, written once. Chunks start at multiples of min_chunk and are whole multiples
 * of it (the last one the rest); they shrink as the rows run out (pool.c). */
typedef void (*pool_rows_fn)(void *ctx, int64_t start, int64_t count);
void pool_run_rows(pool_rows_fn fn, void *ctx, int64_t num_rows, int64_t min_chunk, int nth);

#endif
