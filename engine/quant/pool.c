/* See pool.h. One pool per process, started on first use with the threads it is asked for.
 *
 * Built for a busy machine (more runnable threads than cores): a worker that was not scheduled in
 * time simply misses the job. Jobs split their work dynamically (an atomic cursor), so whoever
 * runs does all of it; the caller, done with the work, closes the job and waits only for workers
 * that had joined it, yielding the CPU while it waits. */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define WORKER_SPINS 4000          /* polls for the next job before a worker sleeps (~10 us) */
#define CALLER_SPINS 200           /* polls for joined workers before the caller yields */
#define CLOSED 0x40000000          /* job_state bit: no worker may join any more */

static pthread_mutex_t pool_mutex = PTHREAD_MUTEX_INITIALIZER;   /* serializes pool_run */
static pthread_mutex_t wake_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cond = PTHREAD_COND_INITIALIZER;
static int num_workers;                      /* started so far (threads 1..num_workers) */
static atomic_int generation;                /* bumped once per job */
static atomic_int job_state = CLOSED;        /* workers inside the job, | CLOSED once closed */
static pool_task_fn job_fn;
static int job_nth;                          /* threads asked for, the caller included */
static void *job_ctx;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Enter the open job (1) or find it closed (0); never touches a closed job's state. */
static int join_job(void) {
    int state = atomic_load_explicit(&job_state, memory_order_acquire);
    while (!(state & CLOSED)) {
        if (atomic_compare_exchange_weak_explicit(&job_state, &state, state + 1,
                                                  memory_order_acq_rel, memory_order_acquire))
            return 1;
    }
    return 0;
}

static void wait_for_job(int seen) {
    for (int spins = 0; spins < WORKER_SPINS; spins++) {
        if (atomic_load_explicit(&generation, memory_order_acquire) != seen) return;
        cpu_relax();
    }
    pthread_mutex_lock(&wake_mutex);
    while (atomic_load_explicit(&generation, memory_order_acquire) == seen)
        pthread_cond_wait(&wake_cond, &wake_mutex);
    pthread_mutex_unlock(&wake_mutex);
}

static void *worker_main(void *arg) {
    int ith = (int)(long)arg;                /* 1..num_workers */
    int seen = 0;
    for (;;) {
        wait_for_job(seen);
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        if (!join_job()) continue;
        if (ith < job_nth) job_fn(job_ctx);
        atomic_fetch_sub_explicit(&job_state, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void start_workers(int nth) {
    while (num_workers < nth - 1) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker_main, (void *)(long)(num_workers + 1)) != 0)
            break;
        pthread_detach(thread);
        num_workers++;
    }
}

void pool_run(pool_task_fn fn, void *ctx, int nth) {
    if (nth > POOL_MAX_THREADS) nth = POOL_MAX_THREADS;
    if (nth <= 1) {
        fn(ctx);
        return;
    }
    pthread_mutex_lock(&pool_mutex);
    start_workers(nth);
    job_fn = fn;                     /* the previous job is closed and empty: nobody reads these */
    job_ctx = ctx;
    job_nth = nth;
    atomic_store_explicit(&job_state, 0, memory_order_release);            /* open */
    pthread_mutex_lock(&wake_mutex);
    atomic_fetch_add_explicit(&generation, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&wake_cond);
    pthread_mutex_unlock(&wake_mutex);
    fn(ctx);
    atomic_fetch_or_explicit(&job_state, CLOSED, memory_order_acq_rel);
    for (int spins = 0; atomic_load_explicit(&job_state, memory_order_acquire) != CLOSED; spins++) {
        if (spins < CALLER_SPINS) cpu_relax(); else sched_yield();
    }
    pthread_mutex_unlock(&pool_mutex);
}

/* pool_run_rows' job: rows handed out guided, each grab a share of what is left (half of it
 * split over the threads, whole multiples of min_chunk, at least min_chunk), so the chunks shrink
 * towards the end and the threads finish together: a fixed chunk left the last thread working
 * up to one chunk after the others, every job, while they waited. */
typedef struct {
    pool_rows_fn fn;
    void *ctx;
    int64_t num_rows, min_chunk, share_divisor;
    atomic_llong next_row;
} rows_job;

/* 1 and the next chunk [*start, *start + *count), or 0 when every row is taken */
static int next_guided_chunk(rows_job *job, int64_t *start, int64_t *count) {
    long long begin = atomic_load_explicit(&job->next_row, memory_order_relaxed);
    for (;;) {
        int64_t left = job->num_rows - begin;
        if (left <= 0) return 0;
        int64_t size = left / job->share_divisor / job->min_chunk * job->min_chunk;
        if (size < job->min_chunk) size = job->min_chunk;
        if (size > left) size = left;
        if (atomic_compare_exchange_weak_explicit(&job->next_row, &begin, begin + size,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *start = begin;
            *count = size;
            return 1;
        }
    }
}

static void rows_task(void *ctx) {
    rows_job *job = ctx;
    int64_t start, count;
    while (next_guided_chunk(job, &start, &count)) job->fn(job->ctx, start, count);
}

void pool_run_rows(pool_rows_fn fn, void *ctx, int64_t num_rows, int64_t min_chunk, int nth) {
    if (nth > POOL_MAX_THREADS) nth = POOL_MAX_THREADS;
    rows_job job = {.fn = fn, .ctx = ctx, .num_rows = num_rows,
                    .min_chunk = min_chunk > 0 ? min_chunk : 1,
                    .share_divisor = 2 * (int64_t)(nth > 1 ? nth : 1)};
    atomic_init(&job.next_row, 0);
    pool_run(rows_task, &job, nth);
}
