/* Decode-step attention straight from the paged KV pool: one call per layer instead of torch's
 * index_copy + index_select + SDPA (+ views), ~60 us of op dispatch per layer for a 1-token query.
 * Plain C, with AVX2 + FMA (or AVX-512) inner loops where the CPU has them. Scores are kept per
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

/* q . k over head_dim values (a multiple of 8): eight partial sums; acc += weight v; each for
 * a group of query heads sharing the K / V row (attention_loops) */
#define SCALAR_LOOPS(suffix, load)                                                              \
    static float dot_##suffix(const float *q, const void *k, int d_len) {                       \
        float partial[8] = {0.0f};                                                              \
        for (int d = 0; d < d_len; d += 8)                                                      \
            for (int i = 0; i < 8; i++) partial[i] += q[d + i] * load(k, d + i);                \
        return ((partial[0] + partial[4]) + (partial[1] + partial[5]))                          \
               + ((partial[2] + partial[6]) + (partial[3] + partial[7]));                       \
    }                                                                                           \
    static void dot_rows_##suffix(const float *q, int group, const char *base,                \
                                  const int64_t *rows, size_t row_bytes, int64_t num_rows,      \
                                  int d_len, float *scores) {                                   \
        for (int64_t j = 0; j < num_rows; j++)                                                  \
            for (int g = 0; g < group; g++)                                                     \
                scores[g * num_rows + j] = dot_##suffix(q + (int64_t)g * d_len,                 \
                                                        base + rows[j] * row_bytes, d_len);     \
    }                                                                                           \
    static void axpy_rows_##suffix(float *acc, const float *weights, int group,                 \
                                   const char *base, const int64_t *rows, size_t row_bytes,     \
                                   int64_t num_rows, int d_len) {                               \
        for (int64_t j = 0; j < num_rows; j++) {                                                \
            const void *v = base + rows[j] * row_bytes;                                         \
            for (int g = 0; g < group; g++) {                                                   \
                float weight = weights[g * num_rows + j], *acc_g = acc + (int64_t)g * d_len;    \
                for (int d = 0; d < d_len; d++) acc_g[d] += weight * load(v, d);                \
            }                                                                                   \
        }                                                                                       \
    }

SCALAR_LOOPS(f32, load_f32)
SCALAR_LOOPS(f16, load_f16)

NO_FP_TRAPS static void softmax_weights(float *scores, int64_t n, float scale) {
    float max_score = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        scores[j] *= scale;
        if (scores[j] > max_score) max_score = scores[j];
    }
    for (int64_t j = 0; j < n; j++) scores[j] = exp_approx(scores[j] - max_score);
}

static void store_f32(void *row, const float *values, int64_t n) {
    memcpy(row, values, (size_t)n * sizeof(float));
}

static void store_f16(void *row, const float *values, int64_t n) {
    uint16_t *halves = row;
    for (int64_t i = 0; i < n; i++) halves[i] = fp32_to_fp16(values[i]);
}

/* Query heads first_head .. first_head + num_heads - 1 of one request, all reading KV head
 * kv_head: out[g][d] = sum_j p_gj V[j][d]. scores: [num_heads, max_kv] scratch. */
static void attend_heads(const decode_batch *batch, const attention_loops *loops, int64_t b,
                         int kv_head, int64_t first_head, int num_heads, float *scores) {
    int d_len = batch->head_dim;
    size_t value_bytes = kv_value_bytes(batch->kv_half);
    size_t row_bytes = (size_t)batch->num_kv_heads * d_len * value_bytes;
    const char *slots = (const char *)batch->slots + (size_t)kv_head * d_len * value_bytes;
    int64_t kv_len = batch->kv_lens[b];
    const int64_t *rows = batch->kv_rows + b * batch->max_kv;
    const float *q = batch->q + b * batch->q_stride + first_head * d_len;
    float *out = batch->out + (b * batch->num_q_heads + first_head) * (int64_t)d_len;
    loops->dot_rows(q, num_heads, slots, rows, row_bytes, kv_len, d_len, scores);
    float totals[num_heads], acc[num_heads * d_len];   /* local: no aliasing with the pool */
    for (int g = 0; g < num_heads; g++) {
        loops->softmax_weights(scores + g * kv_len, kv_len, batch->scale);
        totals[g] = 0.0f;
        for (int64_t j = 0; j < kv_len; j++) totals[g] += scores[g * kv_len + j];
    }
    for (int i = 0; i < num_heads * d_len; i++) acc[i] = 0.0f;
    loops->axpy_rows(acc, scores, num_heads, slots + batch->page_size * row_bytes, rows,
                     row_bytes, kv_len, d_len);
    for (int g = 0; g < num_heads; g++) {
        float inverse = kv_len > 0 ? 1.0f / totals[g] : 0.0f;
        for (int d = 0; d < d_len; d++) out[g * d_len + d] = acc[g * d_len + d] * inverse;
    }
}

/* A unit of work: one request's query heads of one KV head, or a part of them (heads_per_unit)
 * when the batch has too few (request, KV head) pairs to keep every thread busy. */
typedef struct {
    const decode_batch *batch;
    attention_loops loops;
    int heads_per_unit, units_per_kv_head;
    row_cursor units;        /* unit u: request u / (num_kv_heads * units_per_kv_head), ... */
} attention_job;

static void run_unit(const attention_job *job, int64_t u, float *scores) {
    const decode_batch *batch = job->batch;
    int64_t per_request = (int64_t)batch->num_kv_heads * job->units_per_kv_head;
    int64_t rest = u % per_request;
    int kv_head = (int)(rest / job->units_per_kv_head);
    int group = batch->num_q_heads / batch->num_kv_heads;
    int first = (int)(rest % job->units_per_kv_head) * job->heads_per_unit;
    int num_heads = group - first < job->heads_per_unit ? group - first : job->heads_per_unit;
    attend_heads(batch, &job->loops, u / per_request, kv_head, (int64_t)kv_head * group + first,
                 num_heads, scores);
}

static void attention_task(void *ctx) {
    attention_job *job = ctx;
    int64_t max_kv = job->batch->max_kv > 0 ? job->batch->max_kv : 1;
    float *scores = malloc((size_t)max_kv * job->heads_per_unit * sizeof(float));
    if (!scores) return;       /* the other threads take the units */
    int64_t start, count;
    while (next_chunk(&job->units, &start, &count))
        for (int64_t u = start; u < start + count; u++) run_unit(job, u, scores);
    free(scores);
}

int decode_attention(const decode_batch *batch, int level, int num_threads) {
    int64_t total_kv = 0, num_pairs = batch->num_requests * batch->num_kv_heads;
    for (int64_t b = 0; b < batch->num_requests; b++) total_kv += batch->kv_lens[b];
    if (total_kv * batch->num_q_heads < PARALLEL_MIN_SCORES) num_threads = 1;
    int group = batch->num_q_heads / batch->num_kv_heads, heads_per_unit = group;
    /* fewer pairs than two per thread: split the groups (a head reads its rows either way) */
    while (heads_per_unit > 1 && num_pairs * ((group + heads_per_unit - 1) / heads_per_unit)
                                     < 2 * (int64_t)num_threads)
        heads_per_unit = (heads_per_unit + 1) / 2;
    attention_job job = {.batch = batch, .heads_per_unit = heads_per_unit,
                         .units_per_kv_head = (group + heads_per_unit - 1) / heads_per_unit};
    int64_t num_units = num_pairs * job.units_per_kv_head;
    if (level == LEVEL_AVX512 && batch->head_dim % 16 == 0)
        job.loops = attention_loops_avx512(batch->kv_half);
    else if (level == LEVEL_AVX2 || level == LEVEL_AVX512)    /* head_dim 8 mod 16: 256 bits */
        job.loops = attention_loops_avx2(batch->kv_half);
    else
        job.loops = batch->kv_half ? (attention_loops){dot_rows_f16, axpy_rows_f16,
                                                      softmax_weights, store_f16}
                                   : (attention_loops){dot_rows_f32, axpy_rows_f32,
                                                      softmax_weights, store_f32};
    append_new_tokens(batch, &job.loops);
    row_cursor_init(&job.units, num_units, num_threads, 1);
    pool_run(attention_task, &job, num_threads);
    /* every unit was taken unless the caller's own scratch allocation failed */
    return atomic_load(&job.units.next_row) >= num_units ? 0 : -1;
}
