/* AVX-512 F inner loops of prefill attention (prefill_attention.c picks them at the avx512-vnni
 * level): register-blocked products over the float32 panels. Scores: 8 query rows x 32 keys of
 * partial sums in registers, one broadcast query value and two K vectors per dimension. The
 * weighted sum of V: 6 query rows x 64 dimensions, one broadcast weight and four V vectors per
 * key. Each sum is the same products as the portable loops', in the same order per value. */
#include "prefill_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>

#define TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define SCORE_ROWS 8         /* query rows per block of scores: 16 sums + 2 K vectors */
#define SUM_ROWS 6           /* query rows per block of the weighted sum: 24 sums + 4 V vectors */
#define SUM_VECTORS 4        /* 16-value vectors of head_dim per block of the weighted sum */

/* scores[r][0 .. 16 V) for R rows against keys [0, 16 V) of the panel (V = 1 or 2) */
INLINE void scores_block(const float *const *q, const int R, const float *k, int64_t key_stride,
                         const int V, int head_dim, float *scores, int64_t stride) {
    __m512 acc[SCORE_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const float *kd = k + d * key_stride;
        __m512 k0 = _mm512_loadu_ps(kd), k1 = V == 2 ? _mm512_loadu_ps(kd + 16) : k0;
        for (int r = 0; r < R; r++) {
            __m512 qd = _mm512_set1_ps(q[r][d]);
            acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
            if (V == 2) acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(scores + r * stride + 16 * v, acc[r][v]);
}

INLINE void score_rows(const float *const *q, const int R, const float *k_panel,
                       int64_t key_stride, int64_t num_keys, int head_dim, float *scores,
                       int64_t stride) {
    int64_t j = 0;
    for (; j + 32 <= num_keys; j += 32)
        scores_block(q, R, k_panel + j, key_stride, 2, head_dim, scores + j, stride);
    if (j < num_keys)                                          /* 16 keys left */
        scores_block(q, R, k_panel + j, key_stride, 1, head_dim, scores + j, stride);
}

TARGET static void scores_avx512(const float *const *q_rows, int num_q, const float *k_panel,
                                 int64_t key_stride, int64_t num_keys, int head_dim,
                                 float *scores, int64_t stride) {
    for (int r0 = 0; r0 < num_q; r0 += SCORE_ROWS) {
        const float *const *q = q_rows + r0;
        float *s = scores + r0 * stride;
        switch (num_q - r0 < SCORE_ROWS ? num_q - r0 : SCORE_ROWS) {
        case 8: score_rows(q, 8, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 7: score_rows(q, 7, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 6: score_rows(q, 6, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 5: score_rows(q, 5, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 4: score_rows(q, 4, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 3: score_rows(q, 3, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        case 2: score_rows(q, 2, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        default: score_rows(q, 1, k_panel, key_stride, num_keys, head_dim, s, stride); break;
        }
    }
}

/* out[r][d0 .. d0 + 16 V) = sum_j w[r][j] V[j][d0 ..] for R rows */
INLINE void sum_block(const float *weights, int64_t stride, const int R, const float *v_panel,
                      int64_t num_keys, int head_dim, int d0, const int V, float *out) {
    __m512 acc[SUM_ROWS][SUM_VECTORS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_keys; j++) {
        const float *row = v_panel + j * head_dim + d0;
        __m512 values[SUM_VECTORS];
        for (int v = 0; v < V; v++) values[v] = _mm512_loadu_ps(row + 16 * v);
        for (int r = 0; r < R; r++) {
            __m512 w = _mm512_set1_ps(weights[r * stride + j]);
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(w, values[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(out + r * head_dim + d0 + 16 * v, acc[r][v]);
}

INLINE void sum_rows(const float *weights, int64_t stride, const int R, const float *v_panel,
                     int64_t num_keys, int head_dim, float *out) {
    int d0 = 0;
    for (; d0 + 16 * SUM_VECTORS <= head_dim; d0 += 16 * SUM_VECTORS)
        sum_block(weights, stride, R, v_panel, num_keys, head_dim, d0, SUM_VECTORS, out);
    switch ((head_dim - d0) / 16) {
    case 3: sum_block(weights, stride, R, v_panel, num_keys, head_dim, d0, 3, out); break;
    case 2: sum_block(weights, stride, R, v_panel, num_keys, head_dim, d0, 2, out); break;
    case 1: sum_block(weights, stride, R, v_panel, num_keys, head_dim, d0, 1, out); break;
    default: break;
    }
}

TARGET static void weighted_sum_avx512(const float *weights, int64_t stride, int num_q,
                                       const float *v_panel, int64_t num_keys, int head_dim,
                                       float *out) {
    for (int r0 = 0; r0 < num_q; r0 += SUM_ROWS) {
        const float *w = weights + r0 * stride;
        float *o = out + r0 * head_dim;
        switch (num_q - r0 < SUM_ROWS ? num_q - r0 : SUM_ROWS) {
        case 6: sum_rows(w, stride, 6, v_panel, num_keys, head_dim, o); break;
        case 5: sum_rows(w, stride, 5, v_panel, num_keys, head_dim, o); break;
        case 4: sum_rows(w, stride, 4, v_panel, num_keys, head_dim, o); break;
        case 3: sum_rows(w, stride, 3, v_panel, num_keys, head_dim, o); break;
        case 2: sum_rows(w, stride, 2, v_panel, num_keys, head_dim, o); break;
        default: sum_rows(w, stride, 1, v_panel, num_keys, head_dim, o); break;
        }
    }
}

/* fast_exp.h's exp_approx, 16 at a time with the same operations (mul and add, no fused
 * multiply-add), so each value is the scalar one bit for bit; min(88, x) keeps a NaN a NaN */
INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_add_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_add_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    static const float coefficients[] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f,
                                         1.0f};
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    for (int i = 0; i < 6; i++)
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(coefficients[i]));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);   /* 2^n */
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* the portable softmax's values, 16 at a time (a masked last step); the sum in another order */
TARGET static float softmax_avx512(float *row, int64_t n, float scale) {
    __m512 scale16 = _mm512_set1_ps(scale), max16 = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 mask = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + j), scale16);
        _mm512_mask_storeu_ps(row + j, mask, s);
        max16 = _mm512_mask_max_ps(max16, mask, max16, s);
    }
    __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(max16)), total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 mask = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), shift));
        _mm512_mask_storeu_ps(row + j, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(total);
}

TARGET static void widen_avx512(const void *src, int kv_half, int n, float *dst) {
    for (int d = 0; d < n; d += 16)
        _mm512_storeu_ps(dst + d, kv_half ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                                (const __m256i *)((const uint16_t *)src + d)))
                                          : _mm512_loadu_ps((const float *)src + d));
}

prefill_loops prefill_loops_avx512(void) {
    return (prefill_loops){scores_avx512, weighted_sum_avx512, softmax_avx512, widen_avx512};
}

#else  /* not x86: never called */
prefill_loops prefill_loops_avx512(void) { return (prefill_loops){0, 0, 0, 0}; }
#endif
