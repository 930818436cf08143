/* Decode-step attention straight from the paged KV pool: one call per layer instead of torch's
 * index_copy + index_select + SDPA (+ views), ~60 us of op dispatch per layer for a 1-token query.
 * Plain C, with AVX2 + FMA inner loops where the CPU has them. Scores are kept per
 * query head (two passes: max, then exp-sum and the weighted sum of V), in float32 like SDPA. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "fast_exp.h"
#include "formats.h"
#include "matmul.h"
#include "pool.h"

/* below this many q.k products a batch runs on the calling thread (a pool job costs ~5-20 us;
 * a q.k product and its share of the weighted V sum ~30 ns) */
#define PARALLEL_MIN_SCORES 2048

/* the new token's K and V of each request into its slot rows (float16: rounded) */
static void append_new_tokens(const decode_batch *batch, const attention_loops *loops) {
    int64_t row_values = (int64_t)batch->num_kv_heads * batch->head_dim;
    size_t row_bytes = (size_t)row_values * kv_value_bytes(batch->kv_half);
    char *slots = batch->slots;
    for (int64_t b = 0; b < batch->num_requests; b++) {
        int64_t k_row = batch->append_rows[b], v_row = k_row + batch->page_size;
        loops->store(slots + k_row * row_bytes, batch->k_new + b * batch->k_stride, row_values);
        loops->store(slots + v_row * row_bytes, batch->v_new + b * batch->v_stride, row_values);
    }
}

static inline float load_f32(const void *row, int d) { return ((const float *)row)[d]; }
static inline float load_f16(const void *row, int d) {
    return fp16_to_fp32(((const uint16_t *)row)[d]);
}

/* q . k over head_dim values (a multiple of 8): eight partial sums; acc += weight v */
#define SCALAR_LOOPS(suffix, load)                                                              \
    static float dot_##suffix(const float *q, const void *k, int d_len) {                       \
        float partial[8] = {0.0f};                                                              \
        for (int d = 0; d < d_len; d += 8)                                                      \
            for (int i = 0; i < 8; i++) partial[i] += q[d + i] * load(k, d + i);                \
        return ((partial[0] + partial[4]) + (partial[1] + partial[5]))                          \
               + ((partial[2] + partial[6]) + (partial[3] + partial[7]));                       \
    }                                                                                           \
    static void axpy_##suffix(float *acc, float weight, const void *v, int d_len) {             \
        for (int d = 0; d < d_len; d++) acc[d] += weight * load(v, d);                          \
    }

SCALAR_LOOPS(f32, load_f32)
SCALAR_LOOPS(f16, load_f16)

static void store_f32(void *row, const float *values, int64_t n) {
    memcpy(row, values, (size_t)n * sizeof(float));
}

static void store_f16(void *row, const float *values, int64_t n) {
    uint16_t *halves = row;
    for (int64_t i = 0; i < n; i++) halves[i] = fp32_to_fp16(values[i]);
}

/* One query head of one request: out[d] = sum_j p_j V[j][d] */
static void attend_head(const decode_batch *batch, const attention_loops *loops, int64_t b,
                        int head, float *scores) {
    int d_len = batch->head_dim;
    int kv_head = head / (batch->num_q_heads / batch->num_kv_heads);
    size_t value_bytes = kv_value_bytes(batch->kv_half);
    size_t row_bytes = (size_t)batch->num_kv_heads * d_len * value_bytes;
    const char *slots = (const char *)batch->slots + (size_t)kv_head * d_len * value_bytes;
    int64_t kv_len = batch->kv_lens[b];
    const int64_t *rows = batch->kv_rows + b * batch->max_kv;
    const float *q = batch->q + b * batch->q_stride + (int64_t)head * d_len;
    float *out = batch->out + (b * batch->num_q_heads + head) * (int64_t)d_len;
    float max_score = -INFINITY;
    for (int64_t j = 0; j < kv_len; j++) {
        scores[j] = loops->dot(q, slots + rows[j] * row_bytes, d_len) * batch->scale;
        if (scores[j] > max_score) max_score = scores[j];
    }
    float acc[d_len], total = 0.0f;          /* local: no aliasing with the pool's rows */
    for (int d = 0; d < d_len; d++) acc[d] = 0.0f;
    for (int64_t j = 0; j < kv_len; j++) scores[j] = exp_approx(scores[j] - max_score);
    for (int64_t j = 0; j < kv_len; j++) {
        float weight = scores[j];
        total += weight;
        loops->axpy(acc, weight, slots + (rows[j] + batch->page_size) * row_bytes, d_len);
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

int decode_attention(const decode_batch *batch, int level, int num_threads) {
    int64_t num_units = batch->num_requests * batch->num_q_heads, total_kv = 0;
    for (int64_t b = 0; b < batch->num_requests; b++) total_kv += batch->kv_lens[b];
    if (total_kv * batch->num_q_heads < PARALLEL_MIN_SCORES) num_threads = 1;
    attention_job job = {.batch = batch};
    if (level == LEVEL_AVX2)
        job.loops = attention_loops_avx2(batch->kv_half);
    else
        job.loops = batch->kv_half ? (attention_loops){dot_f16, axpy_f16, store_f16}
                                   : (attention_loops){dot_f32, axpy_f32, store_f32};
    append_new_tokens(batch, &job.loops);
    row_cursor_init(&job.units, num_units, num_threads, 1);
    pool_run(attention_task, &job, num_threads);
    /* every unit was taken unless the caller's own scratch allocation failed */
    return atomic_load(&job.units.next_row) >= num_units ? 0 : -1;
}
