/* AVX2 vector math the AVX2 attention loops share (decode_attention_avx2.c,
 * prefill_attention_avx2.c). Include it after defining INLINE with the avx2 target. */
#ifndef PIE_AVX2_MATH_H
#define PIE_AVX2_MATH_H

#include <immintrin.h>

INLINE float horizontal_sum(__m256 sum) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

/* fast_exp.h's exp_approx, eight at a time with the same operations (mul and add, no fused
 * multiply-add), so each value is the scalar one bit for bit; min(88, x) keeps a NaN a NaN */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    static const float coefficients[] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f,
                                         1.0f};
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    for (int i = 0; i < 6; i++)
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(coefficients[i]));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);   /* 2^n */
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#endif
