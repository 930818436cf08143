/* AVX2 + FMA (+ F16C for a float16 pool) inner loops of decode attention (decode_attention.c
 * picks them when the CPU has them): a q.k product and an axpy over head_dim values, head_dim a
 * multiple of 8. -O3 does not vectorize the plain-C versions (a float sum may not be reordered). */
#include "decode_attention.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))

INLINE __m256 load8_f32(const void *row, int d) { return _mm256_loadu_ps((const float *)row + d); }

INLINE __m256 load8_f16(const void *row, int d) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
}

INLINE float horizontal_sum(__m256 sum) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

#define ATTENTION_LOOPS(suffix, load8)                                                          \
    TARGET static float dot_##suffix(const float *q, const void *k, int d_len) {                \
        __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();                          \
        int d = 0;                                                                              \
        for (; d + 16 <= d_len; d += 16) {                                                      \
            sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k, d), sum0);                  \
            sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k, d + 8), sum1);          \
        }                                                                                       \
        if (d < d_len) sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k, d), sum0);       \
        return horizontal_sum(_mm256_add_ps(sum0, sum1));                                       \
    }                                                                                           \
    TARGET static void axpy_##suffix(float *acc, float weight, const void *v, int d_len) {      \
        __m256 w = _mm256_set1_ps(weight);                                                      \
        for (int d = 0; d < d_len; d += 8)                                                      \
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, load8(v, d), _mm256_loadu_ps(acc + d))); \
    }

ATTENTION_LOOPS(f32, load8_f32)
ATTENTION_LOOPS(f16, load8_f16)

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
    return kv_half ? (attention_loops){dot_f16, axpy_f16, store_f16}
                   : (attention_loops){dot_f32, axpy_f32, store_f32};
}

#else  /* not x86: never called */
attention_loops attention_loops_avx2(int kv_half) { return (attention_loops){0, 0, 0}; }
#endif
