/* Paged attention of decode steps (decode_attention.c). */
#ifndef PIE_QUANT_DECODE_ATTENTION_H
#define PIE_QUANT_DECODE_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* Where one decode batch's tensors are. Rows: `slots` is the KV pool of one layer viewed as
 * [num_rows, num_kv_heads, head_dim] (a page is 2 * page_size rows: K then V), float32 or, with
 * kv_half, IEEE float16 (written rounded to nearest even, read exactly; math in float32). */
typedef struct {
    const float *q;              /* [B, num_q_heads, head_dim], token stride q_stride floats */
    const float *k_new;          /* [B, num_kv_heads, head_dim], token stride k_stride */
    const float *v_new;          /* [B, num_kv_heads, head_dim], token stride v_stride */
    int64_t q_stride, k_stride, v_stride;
    void *slots;                 /* the pool's rows */
    int kv_half;                 /* 1: slots hold float16, 0: float32 */
    const int64_t *append_rows;  /* [B] K row of each new token (its V row: + page_size) */
    const int64_t *kv_rows;      /* [B, max_kv] K rows of each request's context, in order */
    const int64_t *kv_lens;      /* [B] context length (<= max_kv), the new token included */
    int64_t num_requests, max_kv, page_size;
    int num_q_heads, num_kv_heads, head_dim;   /* head_dim a multiple of 8 */
    float scale;                 /* softmax scale, 1 / sqrt(head_dim) */
    float *out;                  /* [B, num_q_heads, head_dim] contiguous */
} decode_batch;

/* bytes of one stored K/V value */
static inline size_t kv_value_bytes(int kv_half) {
    return kv_half ? sizeof(uint16_t) : sizeof(float);
}

/* Writes each new token's K and V into the pool, then out = softmax(q K^T * scale) V over each
 * request's context (query head h reads KV head h / (num_q_heads / num_kv_heads)); the (request,
 * KV head) pairs, each with its group of query heads, are shared over up to num_threads threads
 * when the batch is big enough. 0 on success, -1 when no thread could allocate its scratch rows
 * of scores. level: matmul.h's LEVEL_* of the inner loops (one the CPU supports). */
int decode_attention(const decode_batch *batch, int level, int num_threads);

/* The inner loops over K or V rows of d_len values (a multiple of 8), float32 or float16, for
 * a group of query heads that share the rows (GQA): each row is read (and widened) once. Row j
 * is at base + rows[j] * row_bytes. Head g's query is q + g * d_len, its accumulator acc + g *
 * d_len, its scores or weights [g * num_rows, (g + 1) * num_rows); each head's result is what
 * it would be alone (same products, same order of sums). */
typedef struct {
    /* scores[g * num_rows + j] = q_g . row j */
    void (*dot_rows)(const float *q, int group, const char *base, const int64_t *rows,
                     size_t row_bytes, int64_t num_rows, int d_len, float *scores);
    /* acc_g += weights[g * num_rows + j] row j, for j = 0, 1, ... in turn */
    void (*axpy_rows)(float *acc, const float *weights, int group, const char *base,
                      const int64_t *rows, size_t row_bytes, int64_t num_rows, int d_len);
    /* scores = exp(scores * scale - max(scores * scale)), in place (fast_exp.h's exp_approx) */
    void (*softmax_weights)(float *scores, int64_t n, float scale);
    void (*store)(void *row, const float *values, int64_t n);        /* row = values, n % 8 == 0 */
} attention_loops;

/* decode_attention_avx2.c (call only when the CPU has AVX2 + FMA + F16C) */
attention_loops attention_loops_avx2(int kv_half);

/* decode_attention_avx512.c: dot_rows / axpy_rows 16 values a step (d_len a multiple of 16),
 * the rest attention_loops_avx2's (call only at matmul.h's LEVEL_AVX512) */
attention_loops attention_loops_avx512(int kv_half);

#endif
