/* AVX2 + FMA (+ F16C for a float16 pool) inner loops of decode attention (decode_attention.c
 * picks them when the CPU has them): q.k products and axpys over head_dim values (a multiple of
 * 8) for a group of query heads sharing one K / V row. -O3 does not vectorize the plain-C
 * versions (a float sum may not be reordered). */
#include "decode_attention.h"

#include <math.h>
#include <string.h>

#include "fast_exp.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#include "avx2_math.h"

#define MAX_GROUP 8        /* query heads whose partial sums stay in registers at once */

/* The rows are scattered over the pool's pages (and the pool over DRAM): each loop asks for the
 * head's values of the row PREFETCH_ROWS ahead of the one it computes (one request's decode step
 * at 1,024-1,424 slots: 19-21 ms without, 13-15 at 8 rows ahead, 12-16 at 16 or 32, 17-18 at 4;
 * AVX2 Zen 3, two threads). */
#define PREFETCH_ROWS 16
/* the num_bytes at row j + PREFETCH_ROWS, when there is one */
INLINE void prefetch_ahead(const char *base, const int64_t *rows, int64_t j, int64_t num_rows,
                           size_t row_bytes, int num_bytes) {
    if (j + PREFETCH_ROWS >= num_rows) return;
    const char *start = base + rows[j + PREFETCH_ROWS] * row_bytes;
    for (int offset = 0; offset < num_bytes; offset += 64)
        _mm_prefetch(start + offset, _MM_HINT_T0);
}

INLINE __m256 load8_f32(const void *row, int d) { return _mm256_loadu_ps((const float *)row + d); }

INLINE __m256 load8_f16(const void *row, int d) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
}

/* Per head as one 8-wide dot would do it: sum0 takes d % 16 < 8, sum1 the rest (a last 8 in
 * sum0), then one horizontal sum; the K values of a 16-value step are loaded once for the whole
 * group. The V row likewise: each head's acc += weight v over the same loaded values. `n` heads
 * at once (a constant where inlined, so the sums stay in registers). */
#define ATTENTION_LOOPS(suffix, load8, VALUE_BYTES)                                             \
    INLINE void dot_heads_##suffix(const float *q, int n, const void *k, int d_len,             \
                                   float *scores, int64_t score_stride) {                       \
        __m256 sum0[MAX_GROUP], sum1[MAX_GROUP];                                                \
        for (int g = 0; g < n; g++) sum0[g] = sum1[g] = _mm256_setzero_ps();                    \
        int d = 0;                                                                              \
        for (; d + 16 <= d_len; d += 16) {                                                      \
            __m256 k0 = load8(k, d), k1 = load8(k, d + 8);                                      \
            for (int g = 0; g < n; g++) {                                                       \
                const float *qh = q + (int64_t)g * d_len + d;                                   \
                sum0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), k0, sum0[g]);                    \
                sum1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), k1, sum1[g]);                \
            }                                                                                   \
        }                                                                                       \
        if (d < d_len) {                                                                        \
            __m256 k0 = load8(k, d);                                                            \
            for (int g = 0; g < n; g++)                                                         \
                sum0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (int64_t)g * d_len + d), k0,      \
                                          sum0[g]);                                             \
        }                                                                                       \
        for (int g = 0; g < n; g++)                                                             \
            scores[g * score_stride] = horizontal_sum(_mm256_add_ps(sum0[g], sum1[g]));         \
    }                                                                                           \
    INLINE void axpy_heads_##suffix(float *acc, const float *weights, int64_t weight_stride,     \
                                    int n, const void *v, int d_len) {                          \
        __m256 w[MAX_GROUP];                                                                    \
        for (int g = 0; g < n; g++) w[g] = _mm256_set1_ps(weights[g * weight_stride]);          \
        for (int d = 0; d < d_len; d += 8) {                                                    \
            __m256 v8 = load8(v, d);                                                            \
            for (int g = 0; g < n; g++) {                                                       \
                float *a = acc + (int64_t)g * d_len + d;                                        \
                _mm256_storeu_ps(a, _mm256_fmadd_ps(w[g], v8, _mm256_loadu_ps(a)));             \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    TARGET static void dot_rows_##suffix(const float *q, int group, const char *base,         \
                                         const int64_t *rows, size_t row_bytes,                 \
                                         int64_t num_rows, int d_len, float *scores) {          \
        for (int g0 = 0; g0 < group; g0 += MAX_GROUP) {                                         \
            const float *qg = q + (int64_t)g0 * d_len;                                          \
            float *sg = scores + g0 * num_rows;                                                 \
            int n = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;                            \
            for (int64_t j = 0; j < num_rows; j++) {                                            \
                const void *k = base + rows[j] * row_bytes;                                     \
                prefetch_ahead(base, rows, j, num_rows, row_bytes, VALUE_BYTES * d_len);        \
                switch (n) {                                                                    \
                case 1: dot_heads_##suffix(qg, 1, k, d_len, sg + j, num_rows); break;           \
                case 2: dot_heads_##suffix(qg, 2, k, d_len, sg + j, num_rows); break;           \
                case 3: dot_heads_##suffix(qg, 3, k, d_len, sg + j, num_rows); break;           \
                case 4: dot_heads_##suffix(qg, 4, k, d_len, sg + j, num_rows); break;           \
                default: dot_heads_##suffix(qg, n, k, d_len, sg + j, num_rows);                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    TARGET static void axpy_rows_##suffix(float *acc, const float *weights, int group,          \
                                          const char *base, const int64_t *rows,                \
                                          size_t row_bytes, int64_t num_rows, int d_len) {      \
        for (int g0 = 0; g0 < group; g0 += MAX_GROUP) {                                         \
            float *ag = acc + (int64_t)g0 * d_len;                                              \
            const float *wg = weights + g0 * num_rows;                                          \
            int n = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;                            \
            for (int64_t j = 0; j < num_rows; j++) {                                            \
                const void *v = base + rows[j] * row_bytes;                                     \
                prefetch_ahead(base, rows, j, num_rows, row_bytes, VALUE_BYTES * d_len);        \
                switch (n) {                                                                    \
                case 1: axpy_heads_##suffix(ag, wg + j, num_rows, 1, v, d_len); break;          \
                case 2: axpy_heads_##suffix(ag, wg + j, num_rows, 2, v, d_len); break;          \
                case 3: axpy_heads_##suffix(ag, wg + j, num_rows, 3, v, d_len); break;          \
                case 4: axpy_heads_##suffix(ag, wg + j, num_rows, 4, v, d_len); break;          \
                default: axpy_heads_##suffix(ag, wg + j, num_rows, n, v, d_len);                \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

ATTENTION_LOOPS(f32, load8_f32, 4)
ATTENTION_LOOPS(f16, load8_f16, 2)

/* scores = exp(scores * scale - max(scores * scale)) in place (softmax's weights, unnormalized) */
NO_FP_TRAPS TARGET static void softmax_weights(float *scores, int64_t n, float scale) {
    __m256 scale8 = _mm256_set1_ps(scale), max8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scores + j), scale8);
        _mm256_storeu_ps(scores + j, s);
        max8 = _mm256_max_ps(max8, s);
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(max8), _mm256_extractf128_ps(max8, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float max_score = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    for (int64_t t = j; t < n; t++) {
        scores[t] *= scale;
        if (scores[t] > max_score) max_score = scores[t];
    }
    __m256 shift = _mm256_set1_ps(max_score);
    for (j = 0; j + 8 <= n; j += 8)
        _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift)));
    for (; j < n; j++) scores[j] = exp_approx(scores[j] - max_score);
}

TARGET static void store_f32(void *row, const float *values, int64_t n) {
    memcpy(row, values, (size_t)n * sizeof(float));
}

/* rounded to nearest even, as formats.h's fp32_to_fp16 */
TARGET static void store_f16(void *row, const float *values, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)row + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(values + i), _MM_FROUND_TO_NEAREST_INT));
}

attention_loops attention_loops_avx2(int kv_half) {
    return kv_half ? (attention_loops){dot_rows_f16, axpy_rows_f16, softmax_weights, store_f16}
                   : (attention_loops){dot_rows_f32, axpy_rows_f32, softmax_weights, store_f32};
}

#else  /* not x86: never called */
attention_loops attention_loops_avx2(int kv_half) { return (attention_loops){0, 0, 0, 0}; }
#endif
