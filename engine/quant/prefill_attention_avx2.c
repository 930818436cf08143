/* AVX2 + FMA (+ F16C) inner loops of prefill attention (prefill_attention.c picks them at the
 * avx2 level): prefill_attention_avx512.c's register blocking cut to the 16 ymm registers.
 * Scores: 6 query rows x 16 keys of partial sums, one broadcast query value and two K vectors
 * per dimension. The weighted sum of V: 5 query rows x 16 dimensions, one broadcast weight and
 * two V vectors per key. Head dims and key counts are multiples of 16 (prefill_attention.h). */
#include "prefill_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#include "avx2_math.h"

#define SCORE_ROWS 6         /* 12 sums + 2 K vectors + 1 broadcast */
#define SUM_ROWS 5           /* 10 sums + 2 V vectors + 1 broadcast */

/* scores[r][0 .. 16) for R rows against keys [0, 16) of the panel */
INLINE void scores_block(const float *const *q, const int R, const float *k, int64_t key_stride,
                         int head_dim, float *scores, int64_t stride) {
    __m256 acc[SCORE_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const float *kd = k + d * key_stride;
        __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
        for (int r = 0; r < R; r++) {
            __m256 qd = _mm256_broadcast_ss(q[r] + d);
            acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(scores + r * stride, acc[r][0]);
        _mm256_storeu_ps(scores + r * stride + 8, acc[r][1]);
    }
}

INLINE void score_rows(const float *const *q, const int R, const float *k_panel,
                       int64_t key_stride, int64_t num_keys, int head_dim, float *scores,
                       int64_t stride) {
    for (int64_t j = 0; j < num_keys; j += 16)
        scores_block(q, R, k_panel + j, key_stride, head_dim, scores + j, stride);
}

TARGET static void scores_avx2(const float *const *q_rows, int num_q, const float *k_panel,
                               int64_t key_stride, int64_t num_keys, int head_dim,
                               float *scores, int64_t stride) {
    for (int r0 = 0; r0 < num_q; r0 += SCORE_ROWS) {
        const float *const *q = q_rows + r0;
        float *s = scores + r0 * stride;
        switch (num_q - r0 < SCORE_ROWS ? num_q - r0 : SCORE_ROWS) {
        case 6: score_rows(q, 6, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 5: score_rows(q, 5, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 4: score_rows(q, 4, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 3: score_rows(q, 3, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 2: score_rows(q, 2, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        default: score_rows(q, 1, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        }
    }
}

/* out[r][d0 .. d0 + 16) = sum_j w[r][j] V[j][d0 ..] for R rows */
INLINE void sum_block(const float *weights, int64_t stride, const int R, const float *v_panel,
                      int64_t num_keys, int head_dim, int d0, float *out) {
    __m256 acc[SUM_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < num_keys; j++) {
        const float *row = v_panel + j * head_dim + d0;
        __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
        for (int r = 0; r < R; r++) {
            __m256 w = _mm256_broadcast_ss(weights + r * stride + j);
            acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * head_dim + d0, acc[r][0]);
        _mm256_storeu_ps(out + r * head_dim + d0 + 8, acc[r][1]);
    }
}

INLINE void sum_rows(const float *weights, int64_t stride, const int R, const float *v_panel,
                     int64_t num_keys, int head_dim, float *out) {
    for (int d0 = 0; d0 < head_dim; d0 += 16)
        sum_block(weights, stride, R, v_panel, num_keys, head_dim, d0, out);
}

TARGET static void weighted_sum_avx2(const float *weights, int64_t stride, int num_q,
                                     const float *v_panel, int64_t num_keys, int head_dim,
                                     float *out) {
    for (int r0 = 0; r0 < num_q; r0 += SUM_ROWS) {
        const float *w = weights + r0 * stride;
        float *o = out + r0 * head_dim;
        switch (num_q - r0 < SUM_ROWS ? num_q - r0 : SUM_ROWS) {
        case 5: sum_rows(w, stride, 5, v_panel, num_keys, head_dim, o); break;
        case 4: sum_rows(w, stride, 4, v_panel, num_keys, head_dim, o); break;
        case 3: sum_rows(w, stride, 3, v_panel, num_keys, head_dim, o); break;
        case 2: sum_rows(w, stride, 2, v_panel, num_keys, head_dim, o); break;
        default: sum_rows(w, stride, 1, v_panel, num_keys, head_dim, o); break;
        }
    }
}

INLINE float horizontal_max(__m256 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

/* the portable softmax's values, 8 at a time (a scalar tail); the sum in another order */
TARGET static float softmax_avx2(float *row, int64_t n, float scale) {
    __m256 scale8 = _mm256_set1_ps(scale), max8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), scale8);
        _mm256_storeu_ps(row + j, s);
        max8 = _mm256_max_ps(max8, s);
    }
    float max_score = horizontal_max(max8);
    for (int64_t t = j; t < n; t++) {
        row[t] *= scale;
        max_score = row[t] > max_score ? row[t] : max_score;
    }
    __m256 shift = _mm256_set1_ps(max_score), total8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
        _mm256_storeu_ps(row + j, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = horizontal_sum(total8);
    for (; j < n; j++) {
        __m256 e = exp8(_mm256_set1_ps(row[j] - max_score));    /* exp_approx, one lane */
        row[j] = _mm256_cvtss_f32(e);
        total += row[j];
    }
    return total;
}

TARGET static void widen_avx2(const void *src, int kv_half, int n, float *dst) {
    for (int d = 0; d < n; d += 8)
        _mm256_storeu_ps(dst + d, kv_half ? _mm256_cvtph_ps(_mm_loadu_si128(
                                                (const __m128i *)((const uint16_t *)src + d)))
                                          : _mm256_loadu_ps((const float *)src + d));
}

prefill_loops prefill_loops_avx2(void) {
    return (prefill_loops){scores_avx2, weighted_sum_avx2, softmax_avx2, widen_avx2};
}

#else  /* not x86: never called */
prefill_loops prefill_loops_avx2(void) { return (prefill_loops){0, 0, 0, 0}; }
#endif
