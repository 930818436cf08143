/* Causal attention of one request's new tokens over its paged context (prefill_attention.c):
 * the long-prompt counterpart of decode_attention.h, run on the kernels' thread pool. */
#ifndef PIE_QUANT_PREFILL_ATTENTION_H
#define PIE_QUANT_PREFILL_ATTENTION_H

#include <stdint.h>

/* One request: its num_tokens new tokens are the last of its kv_len context slots, and their K
 * and V are already in the pool. Token t (0 .. num_tokens - 1) sits at slot kv_len - num_tokens
 * + t and attends to slots 0 .. kv_len - num_tokens + t. Rows as in decode_batch: `slots` is one
 * layer's pool viewed as [num_rows, num_kv_heads, head_dim], float32 or (kv_half) float16. */
typedef struct {
    const float *q;              /* [num_tokens, num_q_heads, head_dim], token stride q_stride */
    int64_t q_stride;
    const void *slots;
    int kv_half;                 /* 1: slots hold float16, 0: float32 */
    const int64_t *kv_rows;      /* [kv_len] K rows of the context in order; V row: + page_size */
    int64_t num_tokens, kv_len, page_size;
    int num_q_heads, num_kv_heads, head_dim;   /* head_dim a multiple of 16 */
    float scale;                 /* softmax scale, 1 / sqrt(head_dim) */
    float *out;                  /* [num_tokens, num_q_heads, head_dim], token stride out_stride */
    int64_t out_stride;
} prefill_request;

/* out = softmax(q K^T * scale, causal) V, in float32 (exp: fast_exp.h's exp_approx), tiles of
 * (KV head, a few tokens) shared over up to num_threads threads. 0 on success, -1 when out of
 * memory (out then incomplete). level: matmul.h's LEVEL_* of the inner loops (one the CPU
 * supports); every level gives the same result up to the order of float additions. */
int prefill_attention(const prefill_request *request, int level, int num_threads);

/* The inner loops over one tile. K is a panel transposed to [head_dim][key_stride] float32, V
 * one of [keys][head_dim] float32; query row r is at q_rows[r] (head_dim values). */
typedef struct {
    /* scores[r * stride + j] = q_rows[r] . K[:, j], r < num_q, j < num_keys (a multiple of 16) */
    void (*scores)(const float *const *q_rows, int num_q, const float *k_panel, int64_t key_stride,
                   int64_t num_keys, int head_dim, float *scores, int64_t stride);
    /* out[r * head_dim + d] = sum_j weights[r * stride + j] V[j][d], j < num_keys */
    void (*weighted_sum)(const float *weights, int64_t stride, int num_q, const float *v_panel,
                         int64_t num_keys, int head_dim, float *out);
    /* row[j] = exp(row[j] * scale - max), j < n (fast_exp.h's exp_approx); returns their sum */
    float (*softmax)(float *row, int64_t n, float scale);
    /* dst[d] = src[d] as float32, d < n (a multiple of 16); src float16 (kv_half) or float32 */
    void (*widen)(const void *src, int kv_half, int n, float *dst);
} prefill_loops;

/* prefill_attention_avx2.c (call only when the CPU has AVX2 + FMA + F16C) */
prefill_loops prefill_loops_avx2(void);

/* prefill_attention_avx512.c (call only at matmul.h's LEVEL_AVX512) */
prefill_loops prefill_loops_avx512(void);

#endif
