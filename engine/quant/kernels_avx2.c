/* AVX2 + FMA + F16C kernels, compiled for those features only (function target attributes), called
 * only after the CPU was seen to have them. Integer dot products per block of 32 (vpmaddwd on
 * 16-bit activation quants and weight quants widened to 16 bits), one float scale per block
 * (llama.cpp's scheme, with 16-bit instead of 8-bit activations: float32-close results). Each
 * weight block is unpacked once and used for up to 4 activation rows. */
#include "formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define MAX_ROWS 4

INLINE float hsum(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

INLINE float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* int32 sums of pairs of int16 products: [8] */
INLINE __m256i dot_i16(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }

/* activation values 16 * half .. 16 * half + 15 of block `block` of row `row`, int16 [16] */
INLINE __m256i load_x(const act_q16 *x, int64_t row, int64_t block, int half) {
    return _mm256_loadu_si256((const __m256i *)(x->qs + row * x->k + block * QK + half * 16));
}

/* int32 [8] partial sums of one block of 32: weights as two int16 [16] halves */
INLINE __m256i dot_block(__m256i w_lo, __m256i w_hi, const act_q16 *x, int64_t row, int64_t block) {
    return _mm256_add_epi32(dot_i16(w_lo, load_x(x, row, block, 0)),
                            dot_i16(w_hi, load_x(x, row, block, 1)));
}

TARGET void quantize_act_avx2(const float *x, int64_t m, act_q16 *out) {
    int64_t k = out->k, num_blocks = k / QK;
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *v = x + r * k + b * QK;
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
            __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign_mask, v0),
                                                      _mm256_andnot_ps(sign_mask, v1)),
                                        _mm256_max_ps(_mm256_andnot_ps(sign_mask, v2),
                                                      _mm256_andnot_ps(sign_mask, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float d = _mm_cvtss_f32(m4) / ACT_MAX, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            __m256 scale = _mm256_set1_ps(inverse);
            const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, scale), mode));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, scale), mode));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, scale), mode));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, scale), mode));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            /* packs works per 128-bit lane: [0-3, 8-11 | 4-7, 12-15] -> reorder the 64-bit quarters */
            __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
            __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
            _mm256_storeu_si256((__m256i *)(out->qs + r * k + b * QK), lo);
            _mm256_storeu_si256((__m256i *)(out->qs + r * k + b * QK + 16), hi);
            out->d[r * num_blocks + b] = d;
            out->s[r * num_blocks + b] = d * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* Q4_0 (is_q4_1 = 0: w = d * (q - 8)) and Q4_1 (w = d * q + m) rows against R activation rows */
INLINE void q4_row(const uint8_t *row, int is_q4_1, const act_q16 *x, int64_t r0, int R,
                   float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, block_bytes = is_q4_1 ? 20 : 18;
    __m256 acc[MAX_ROWS];
    float low_sum[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); low_sum[r] = 0.0f; }
    const __m128i low_mask = _mm_set1_epi8(0xF);
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * block_bytes;
        float d = half_at(block), low = is_q4_1 ? half_at(block + 2) : -8.0f * d;
        __m128i raw = _mm_loadu_si128((const __m128i *)(block + block_bytes - QK / 2));
        __m256i w_lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low_mask));
        __m256i w_hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low_mask));
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m256 p = _mm256_cvtepi32_ps(dot_block(w_lo, w_hi, x, r0 + r, b));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d[i]), p, acc[r]);
            low_sum[r] += low * x->s[i];
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]) + low_sum[r];
}

/* 16 int16 lanes: bit i of `bits` as 0x10 in lane i (a Q5 block's high bits of 16 values) */
INLINE __m256i high_bits_16(uint32_t bits) {
    const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                             4096, 8192, 16384, (short)0x8000);
    __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), select),
                                     select);
    return _mm256_and_si256(set, _mm256_set1_epi16(0x10));
}

/* Q5_0 (is_q5_1 = 0: w = d * (q - 16)) and Q5_1 (w = d * q + m) rows: Q4's nibbles, bit i of
 * qh as bit 4 of value i */
INLINE void q5_row(const uint8_t *row, int is_q5_1, const act_q16 *x, int64_t r0, int R, float *y,
                   int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    int64_t block_bytes = is_q5_1 ? (int64_t)sizeof(block_q5_1) : (int64_t)sizeof(block_q5_0);
    int qh_at = is_q5_1 ? 4 : 2;
    __m256 acc[MAX_ROWS];
    float low_sum[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); low_sum[r] = 0.0f; }
    const __m128i low_mask = _mm_set1_epi8(0xF);
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * block_bytes;
        float d = half_at(block), low = is_q5_1 ? half_at(block + 2) : -16.0f * d;
        uint32_t qh;
        memcpy(&qh, block + qh_at, sizeof qh);
        __m128i raw = _mm_loadu_si128((const __m128i *)(block + qh_at + 4));
        __m256i w_lo = _mm256_or_si256(_mm256_cvtepu8_epi16(_mm_and_si128(raw, low_mask)),
                                       high_bits_16(qh & 0xFFFF));
        __m256i w_hi = _mm256_or_si256(
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low_mask)),
            high_bits_16(qh >> 16));
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m256 p = _mm256_cvtepi32_ps(dot_block(w_lo, w_hi, x, r0 + r, b));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d[i]), p, acc[r]);
            low_sum[r] += low * x->s[i];
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]) + low_sum[r];
}

INLINE void q8_0_row(const uint8_t *row, const act_q16 *x, int64_t r0, int R, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 34;
        float d = half_at(block);
        __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
        __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m256 p = _mm256_cvtepi32_ps(dot_block(w_lo, w_hi, x, r0 + r, b));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d[i]), p, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]);
}

/* Q4_K (is_q5 = 0) and Q5_K rows: the same d, dmin and 6-bit scales at the same offsets; Q5_K's
 * qh[32] before its nibbles, bit s of byte l the bit 4 of value l of sub-block s */
INLINE void q4_k_row(const uint8_t *row, int is_q5, const act_q16 *x, int64_t r0, int R, float *y,
                     int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    int64_t super_bytes = is_q5 ? (int64_t)sizeof(block_q5_k) : (int64_t)sizeof(block_q4_k);
    __m256 acc[MAX_ROWS];
    float low_sum[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); low_sum[r] = 0.0f; }
    const __m256i low_mask = _mm256_set1_epi8(0xF), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t sb = 0; sb < num_super; sb++) {
        const block_q4_k *block = (const block_q4_k *)(row + sb * super_bytes);
        const uint8_t *qs = is_q5 ? ((const block_q5_k *)block)->qs : block->qs;
        __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)((const block_q5_k *)block)->qh)
                           : _mm256_setzero_si256();
        float d = half_at((const uint8_t *)&block->d), dmin = half_at((const uint8_t *)&block->dmin);
        uint8_t scales[8], mins[8];
        for (int sub = 0; sub < 8; sub++) q4k_scale_min(sub, block->scales, scales + sub, mins + sub);
        for (int sub = 0; sub < 8; sub++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + (sub / 2) * 32));
            __m256i q = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(raw, 4) : raw, low_mask);
            if (is_q5) {
                __m256i bit = _mm256_set1_epi8((char)(1 << sub));
                __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                q = _mm256_or_si256(q, _mm256_and_si256(set, bit4));
            }
            __m256i w_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
            __m256i w_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
            int64_t b = sb * 8 + sub;
            float scale = d * scales[sub], minimum = dmin * mins[sub];
            for (int r = 0; r < R; r++) {
                int64_t i = (r0 + r) * num_blocks + b;
                __m256 p = _mm256_cvtepi32_ps(dot_block(w_lo, w_hi, x, r0 + r, b));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale * x->d[i]), p, acc[r]);
                low_sum[r] -= minimum * x->s[i];
            }
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]) + low_sum[r];
}

INLINE void q6_k_row(const uint8_t *row, const act_q16 *x, int64_t r0, int R, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low_mask = _mm256_set1_epi8(0xF), two_bits = _mm256_set1_epi8(3);
    const __m256i offset = _mm256_set1_epi8(32);
    for (int64_t sb = 0; sb < num_super; sb++) {
        const block_q6_k *block = (const block_q6_k *)(row + sb * sizeof(block_q6_k));
        float d = half_at((const uint8_t *)&block->d);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = block->ql + half * 64, *qh = block->qh + half * 32;
            const int8_t *sc = block->scales + half * 8;
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)ql);
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];                                   /* 0..63, value = q - 32 */
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low_mask),
                                   _mm256_slli_epi16(_mm256_and_si256(h, two_bits), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low_mask),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two_bits), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low_mask),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two_bits), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low_mask),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two_bits), 4));
            for (int quarter = 0; quarter < 4; quarter++) {
                __m256i centered = _mm256_sub_epi8(q[quarter], offset);          /* -32..31 */
                __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(centered));
                __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(centered, 1));
                float scale_lo = d * sc[quarter * 2], scale_hi = d * sc[quarter * 2 + 1];
                int64_t b = sb * 8 + half * 4 + quarter;
                for (int r = 0; r < R; r++) {
                    float dx = x->d[(r0 + r) * num_blocks + b];
                    __m256 p_lo = _mm256_cvtepi32_ps(dot_i16(w_lo, load_x(x, r0 + r, b, 0)));
                    __m256 p_hi = _mm256_cvtepi32_ps(dot_i16(w_hi, load_x(x, r0 + r, b, 1)));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale_lo * dx), p_lo, acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale_hi * dx), p_hi, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]);
}

/* One kernel per type: rows of w, activation rows in groups of MAX_ROWS (R a constant per call
 * so each q*_row is specialized). */
#define ROWS_KERNEL(name, row_call)                                                          \
    TARGET static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows,           \
                            const act_q16 *x, int64_t m, float *y, int64_t ldy) {             \
        for (int64_t j = 0; j < num_rows; j++) {                                             \
            const uint8_t *row = w + j * row_bytes;                                          \
            prefetch_ahead(row, row_bytes);                                                  \
            float *out = y + j;                                                              \
            int64_t r0 = 0;                                                                  \
            for (; r0 + 4 <= m; r0 += 4) row_call(4);                                        \
            switch (m - r0) {                                                                \
            case 3: row_call(3); break;                                                      \
            case 2: row_call(2); break;                                                      \
            case 1: row_call(1); break;                                                      \
            default: break;                                                                  \
            }                                                                                \
        }                                                                                    \
    }

#define CALL_Q4_0(R) q4_row(row, 0, x, r0, R, out, ldy)
#define CALL_Q4_1(R) q4_row(row, 1, x, r0, R, out, ldy)
#define CALL_Q5_0(R) q5_row(row, 0, x, r0, R, out, ldy)
#define CALL_Q5_1(R) q5_row(row, 1, x, r0, R, out, ldy)
#define CALL_Q8_0(R) q8_0_row(row, x, r0, R, out, ldy)
#define CALL_Q4_K(R) q4_k_row(row, 0, x, r0, R, out, ldy)
#define CALL_Q5_K(R) q4_k_row(row, 1, x, r0, R, out, ldy)
#define CALL_Q6_K(R) q6_k_row(row, x, r0, R, out, ldy)
ROWS_KERNEL(dot_q4_0_avx2, CALL_Q4_0)
ROWS_KERNEL(dot_q5_0_avx2, CALL_Q5_0)
ROWS_KERNEL(dot_q5_1_avx2, CALL_Q5_1)
ROWS_KERNEL(dot_q4_1_avx2, CALL_Q4_1)
ROWS_KERNEL(dot_q8_0_avx2, CALL_Q8_0)
ROWS_KERNEL(dot_q4_k_avx2, CALL_Q4_K)
ROWS_KERNEL(dot_q5_k_avx2, CALL_Q5_K)
ROWS_KERNEL(dot_q6_k_avx2, CALL_Q6_K)

dot_rows_fn dot_rows_avx2(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0: return dot_q4_0_avx2;
    case QTYPE_Q4_1: return dot_q4_1_avx2;
    case QTYPE_Q5_0: return dot_q5_0_avx2;
    case QTYPE_Q5_1: return dot_q5_1_avx2;
    case QTYPE_Q8_0: return dot_q8_0_avx2;
    case QTYPE_Q4_K: return dot_q4_k_avx2;
    case QTYPE_Q5_K: return dot_q5_k_avx2;
    case QTYPE_Q6_K: return dot_q6_k_avx2;
    case QTYPE_Q4_0_X8: case QTYPE_Q4_1_X8: case QTYPE_Q8_0_X8: case QTYPE_Q5_0_X8:
    case QTYPE_Q5_1_X8:
        return dot_rows_x8_avx2(qtype);
    default: return NULL;
    }
}

#else  /* not x86: never called (the module reports no avx2 level) */
void quantize_act_avx2(const float *x, int64_t m, act_q16 *out) { quantize_act_scalar(x, m, out); }
dot_rows_fn dot_rows_avx2(int qtype) { return dot_rows_scalar(qtype); }
#endif
