/* Decode-step attention straight from the paged KV pool: one call per layer instead of torch's
 * index_copy + index_select + SDPA (+ views), ~60 us of op dispatch per layer for a 1-token query.
 * Plain C, with AVX2 + FMA inner loops where the CPU has them. Scores are kept per
 * query head (two passes: max, then exp-sum and the weighted sum of V), in float32 like SDPA. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "fast_exp.h"
#include "matmul.h"
#include "pool.h"

/* below this many q.k products a batch runs on the calling thread (a pool job costs ~5-20 us;
 * a q.k product and its share of the weighted V sum ~30 ns) */
#define PARALLEL_MIN_SCORES 2048

static void append_new_tokens(const decode_batch *batch) {
    int64_t row_floats = (int64_t)batch->num_kv_heads * batch->head_dim;
    for (int64_t b = 0; b < batch->num_requests; b++) {
        float *k_row = batch->slots + batch->append_rows[b] * row_floats;
        float *v_row = batch->slots + (batch->append_rows[b] + batch->page_size) * row_floats;
        memcpy(k_row, batch->k_new + b * batch->k_stride, (size_t)row_floats * sizeof(float));
        memcpy(v_row, batch->v_new + b * batch->v_stride, (size_t)row_floats * sizeof(float));
    }
}

/* q . k over head_dim values (a multiple of 8): eight partial sums */
static float attention_dot(const float *q, const float *k, int d_len) {
    float partial[8] = {0.0f};
    for (int d = 0; d < d_len; d += 8)
        for (int i = 0; i < 8; i++) partial[i] += q[d + i] * k[d + i];
    return ((partial[0] + partial[4]) + (partial[1] + partial[5]))
           + ((partial[2] + partial[6]) + (partial[3] + partial[7]));
}

static void attention_axpy(float *acc, float weight, const float *v, int d_len) {
    for (int d = 0; d < d_len; d++) acc[d] += weight * v[d];
}

typedef struct {
    float (*dot)(const float *q, const float *k, int d_len);
    void (*axpy)(float *acc, float weight, const float *v, int d_len);
} attention_loops;

/* One query head of one request: out[d] = sum_j p_j V[j][d] */
static void attend_head(const decode_batch *batch, const attention_loops *loops, int64_t b,
                        int head, float *scores) {
    int d_len = batch->head_dim;
    int kv_head = head / (batch->num_q_heads / batch->num_kv_heads);
    int64_t row_floats = (int64_t)batch->num_kv_heads * d_len, kv_len = batch->kv_lens[b];
    const int64_t *rows = batch->kv_rows + b * batch->max_kv;
    const float *q = batch->q + b * batch->q_stride + (int64_t)head * d_len;
    float *out = batch->out + (b * batch->num_q_heads + head) * (int64_t)d_len;
    float max_score = -INFINITY;
    for (int64_t j = 0; j < kv_len; j++) {
        const float *k = batch->slots + rows[j] * row_floats + (int64_t)kv_head * d_len;
        scores[j] = loops->dot(q, k, d_len) * batch->scale;
        if (scores[j] > max_score) max_score = scores[j];
    }
    float acc[d_len], total = 0.0f;          /* local: no aliasing with the pool's rows */
    for (int d = 0; d < d_len; d++) acc[d] = 0.0f;
    for (int64_t j = 0; j < kv_len; j++) scores[j] = exp_approx(scores[j] - max_score);
    for (int64_t j = 0; j < kv_len; j++) {
        float weight = scores[j];
        const float *v = batch->slots + (rows[j] + batch->page_size) * row_floats
                         + (int64_t)kv_head * d_len;
        total += weight;
        loops->axpy(acc, weight, v, d_len);
    }
    float inverse = kv_len > 0 ? 1.0f / total : 0.0f;
    for (int d = 0; d < d_len; d++) out[d] = acc[d] * inverse;
}

typedef struct {
    const decode_batch *batch;
    attention_loops loops;
    row_cursor units;            /* unit u: request u / num_q_heads, head u % num_q_heads */
} attention_job;

static void attention_task(void *ctx) {
    attention_job *job = ctx;
    const decode_batch *batch = job->batch;
    float *scores = malloc((size_t)(batch->max_kv > 0 ? batch->max_kv : 1) * sizeof(float));
    if (!scores) return;       /* the other threads take the units */
    int64_t start, count;
    while (next_chunk(&job->units, &start, &count))
        for (int64_t u = start; u < start + count; u++)
            attend_head(batch, &job->loops, u / batch->num_q_heads, (int)(u % batch->num_q_heads), scores);
    free(scores);
}

int decode_attention(const decode_batch *batch, int num_threads) {
    append_new_tokens(batch);
    int64_t num_units = batch->num_requests * batch->num_q_heads, total_kv = 0;
    for (int64_t b = 0; b < batch->num_requests; b++) total_kv += batch->kv_lens[b];
    if (total_kv * batch->num_q_heads < PARALLEL_MIN_SCORES) num_threads = 1;
    attention_job job = {.batch = batch, .loops = {attention_dot, attention_axpy}};
    if (level_supported(LEVEL_AVX2))
        job.loops = (attention_loops){attention_dot_avx2, attention_axpy_avx2};
    row_cursor_init(&job.units, num_units, num_threads, 1);
    pool_run(attention_task, &job, num_threads);
    /* every unit was taken unless the caller's own scratch allocation failed */
    return atomic_load(&job.units.next_row) >= num_units ? 0 : -1;
}
