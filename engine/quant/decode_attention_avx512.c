/* AVX-512 F inner loops of decode attention (decode_attention.c picks them at the avx512-vnni
 * level when head_dim is a multiple of 16): q.k products and axpys 16 values a step, for a group
 * of query heads sharing one K / V row, each row read (and, from a float16 pool, widened) once
 * for the group. Per head: one 16-wide partial sum over the row, then one horizontal sum; the
 * softmax weights and the append of new K / V are the 256-bit loops' (attention_loops_avx2). */
#include "decode_attention.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define MAX_GROUP 8        /* query heads whose partial sums stay in registers at once */
#define PREFETCH_ROWS 16   /* as decode_attention_avx2.c: rows ahead of the one computed */

/* the num_bytes at row j + PREFETCH_ROWS, when there is one */
INLINE void prefetch_ahead(const char *base, const int64_t *rows, int64_t j, int64_t num_rows,
                           size_t row_bytes, int num_bytes) {
    if (j + PREFETCH_ROWS >= num_rows) return;
    const char *start = base + rows[j + PREFETCH_ROWS] * row_bytes;
    for (int offset = 0; offset < num_bytes; offset += 64)
        _mm_prefetch(start + offset, _MM_HINT_T0);
}

INLINE __m512 load16_f32(const void *row, int d) { return _mm512_loadu_ps((const float *)row + d); }

INLINE __m512 load16_f16(const void *row, int d) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d)));
}

#define ATTENTION_LOOPS(suffix, load16, VALUE_BYTES)                                            \
    INLINE void dot_heads_##suffix(const float *q, int n, const void *k, int d_len,             \
                                   float *scores, int64_t score_stride) {                       \
        __m512 sum[MAX_GROUP];                                                                  \
        for (int g = 0; g < n; g++) sum[g] = _mm512_setzero_ps();                               \
        for (int d = 0; d < d_len; d += 16) {                                                   \
            __m512 k16 = load16(k, d);                                                          \
            for (int g = 0; g < n; g++)                                                         \
                sum[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (int64_t)g * d_len + d), k16,      \
                                         sum[g]);                                               \
        }                                                                                       \
        for (int g = 0; g < n; g++) scores[g * score_stride] = _mm512_reduce_add_ps(sum[g]);    \
    }                                                                                           \
    INLINE void axpy_heads_##suffix(float *acc, const float *weights, int64_t weight_stride,     \
                                    int n, const void *v, int d_len) {                          \
        __m512 w[MAX_GROUP];                                                                    \
        for (int g = 0; g < n; g++) w[g] = _mm512_set1_ps(weights[g * weight_stride]);          \
        for (int d = 0; d < d_len; d += 16) {                                                   \
            __m512 v16 = load16(v, d);                                                          \
            for (int g = 0; g < n; g++) {                                                       \
                float *a = acc + (int64_t)g * d_len + d;                                        \
                _mm512_storeu_ps(a, _mm512_fmadd_ps(w[g], v16, _mm512_loadu_ps(a)));            \
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

ATTENTION_LOOPS(f32, load16_f32, 4)
ATTENTION_LOOPS(f16, load16_f16, 2)

attention_loops attention_loops_avx512(int kv_half) {
    attention_loops loops = attention_loops_avx2(kv_half);     /* softmax weights, store */
    loops.dot_rows = kv_half ? dot_rows_f16 : dot_rows_f32;
    loops.axpy_rows = kv_half ? axpy_rows_f16 : axpy_rows_f32;
    return loops;
}

#else  /* not x86: never called */
attention_loops attention_loops_avx512(int kv_half) { return (attention_loops){0, 0, 0, 0}; }
#endif
