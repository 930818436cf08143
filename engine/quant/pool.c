/* See pool.h. One pool per process, started on first use with the threads it is asked for. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>

#define SPIN_ITERATIONS 20000      /* ~50-100 us of polling before a worker sleeps */

static pthread_mutex_t pool_mutex = PTHREAD_MUTEX_INITIALIZER;   /* serializes pool_run */
static pthread_mutex_t wake_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cond = PTHREAD_COND_INITIALIZER;
static int num_workers;                      /* started so far (threads 1..num_workers) */
static atomic_int generation;                /* bumped once per job */
static atomic_int num_pending;               /* workers still running the current job */
static pool_task_fn job_fn;
static void *job_ctx;
static int job_nth;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *worker_main(void *arg) {
    int ith = (int)(long)arg;
    int seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < SPIN_ITERATIONS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&wake_mutex);
            while (atomic_load_explicit(&generation, memory_order_acquire) == seen)
                pthread_cond_wait(&wake_cond, &wake_mutex);
            pthread_mutex_unlock(&wake_mutex);
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        if (ith < job_nth) job_fn(job_ctx, ith, job_nth);
        /* every worker acknowledges every job, so none can read the next job's fields early */
        atomic_fetch_sub_explicit(&num_pending, 1, memory_order_acq_rel);
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
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool_mutex);
    start_workers(nth);
    if (nth > num_workers + 1) nth = num_workers + 1;
    job_fn = fn;
    job_ctx = ctx;
    job_nth = nth;
    atomic_store_explicit(&num_pending, num_workers, memory_order_release);
    pthread_mutex_lock(&wake_mutex);
    atomic_fetch_add_explicit(&generation, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&wake_cond);
    pthread_mutex_unlock(&wake_mutex);
    fn(ctx, 0, nth);
    while (atomic_load_explicit(&num_pending, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&pool_mutex);
}
