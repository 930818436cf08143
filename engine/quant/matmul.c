/* See matmul.h. */
#include "matmul.h"

#include <stdlib.h>

#include "pool.h"

#define MIN_CHUNK_ROWS 8

static int cpu_has_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

int level_supported(int level) {
    return level == LEVEL_SCALAR || (level == LEVEL_AVX2 && cpu_has_avx2());
}

int act_alloc(act_q16 *act, int64_t m, int64_t k) {
    size_t num_blocks = (size_t)(m * (k / QK));
    act->k = k;
    act->qs = malloc((size_t)(m * k) * sizeof(int16_t));
    act->d = malloc(num_blocks * sizeof(float));
    act->s = malloc(num_blocks * sizeof(float));
    if (act->qs && act->d && act->s) return 0;
    act_free(act);
    return -1;
}

void act_free(act_q16 *act) {
    free(act->qs);
    free(act->d);
    free(act->s);
    act->qs = NULL;
    act->d = act->s = NULL;
}

void quantize_act(int level, const float *x, int64_t m, act_q16 *act) {
    if (level == LEVEL_AVX2)
        quantize_act_avx2(x, m, act);
    else
        quantize_act_scalar(x, m, act);
}

typedef struct {
    dot_rows_fn fn;
    const uint8_t *w;
    int64_t row_bytes, m, ldy;
    const act_q16 *x;
    float *y;
} matmul_job;

static void matmul_chunk(void *ctx, int64_t start, int64_t count) {
    const matmul_job *job = ctx;
    job->fn(job->w + start * job->row_bytes, job->row_bytes, count, job->x, job->m,
            job->y + start, job->ldy);
}

void matmul_rows(int qtype, int level, const uint8_t *w, int64_t n, const act_q16 *x, int64_t m,
                 float *y, int64_t ldy, int num_threads) {
    matmul_job job = {.fn = level == LEVEL_AVX2 ? dot_rows_avx2(qtype) : dot_rows_scalar(qtype),
                      .w = w, .row_bytes = qtype_row_bytes(qtype, x->k), .m = m, .ldy = ldy,
                      .x = x, .y = y};
    pool_run_rows(matmul_chunk, &job, n, MIN_CHUNK_ROWS, num_threads);
}
