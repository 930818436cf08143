/* AVX2 + FMA inner loops of decode attention (decode_attention.c picks them when the CPU has
 * them): a q.k product and an axpy over head_dim floats, head_dim a multiple of 8. -O3 does not
 * vectorize the plain-C versions (a float sum may not be reordered). */
#include "decode_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))

TARGET float attention_dot_avx2(const float *q, const float *k, int d_len) {
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= d_len; d += 16) {
        sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), sum0);
        sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), sum1);
    }
    if (d < d_len) sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), sum0);
    __m256 sum = _mm256_add_ps(sum0, sum1);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

TARGET void attention_axpy_avx2(float *acc, float weight, const float *v, int d_len) {
    __m256 w = _mm256_set1_ps(weight);
    for (int d = 0; d < d_len; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d),
                                                  _mm256_loadu_ps(acc + d)));
}

#else  /* not x86: never called */
float attention_dot_avx2(const float *q, const float *k, int d_len) { return 0.0f; }
void attention_axpy_avx2(float *acc, float weight, const float *v, int d_len) {}
#endif
