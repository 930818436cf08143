/* AVX-512 (F, BW, VL, DQ) + AVX512-VNNI kernels of the row-major GGUF types, compiled for those
 * features only (function target attributes), called only after matmul.c saw the CPU has them
 * and the OS saves the zmm state; the interleaved (_X8) types' kernels are interleaved_avx512.c's,
 * reached through the same dot_rows_avx512. The same integer arithmetic as the AVX2 kernels
 * (16-bit activation quants times weight quants widened to 16 bits, one float scale per block of
 * 32): the products equal the portable kernels' up to the order of float additions, so the
 * engine's outputs keep their tolerances. What changes is the width and the instruction count:
 * vpdpwssd multiplies 32 int16 pairs and adds them into 16 int32 sums in one instruction (AVX2:
 * vpmaddwd, then vpaddd, 16 pairs). 8-bit activations (vpdpbusd) double the products per
 * instruction again but round each activation to 1/127 of its block's largest: Q4_K / Q6_K's are
 * kquant_act8_avx512.c's, where the planner measured them faster. One block of 32 values is one
 * vector, up to 4 activation rows per unpacked block. */
#include "formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define MAX_ROWS 4          /* activation rows per pass over a row-major weight row */
/* ---- row-major blocks: one block of 32 values per vector ----------------------------------- */

INLINE float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

INLINE float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the 32 activation quants of block b of row r */
INLINE __m512i load_x(const act_q16 *x, int64_t r, int64_t b) {
    return _mm512_loadu_si512((const void *)(x->qs + r * x->k + b * QK));
}

/* Q4_0 (is_q4_1 = 0: w = d * (q - 8)) and Q4_1 (w = d * q + m) rows against R activation rows:
 * the 16 bytes' low nibbles are values 0-15, the high ones 16-31 */
INLINE void q4_row(const uint8_t *row, int is_q4_1, const act_q16 *x, int64_t r0, int R,
                   float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, block_bytes = is_q4_1 ? 20 : 18;
    __m512 acc[MAX_ROWS];
    float low_sum[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); low_sum[r] = 0.0f; }
    const __m128i low_mask = _mm_set1_epi8(0xF);
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * block_bytes;
        float d = half_at(block), low = is_q4_1 ? half_at(block + 2) : -8.0f * d;
        __m128i raw = _mm_loadu_si128((const __m128i *)(block + block_bytes - QK / 2));
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low_mask),
                                     _mm_and_si128(raw, low_mask));
        __m512i w = _mm512_cvtepu8_epi16(q);
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, load_x(x, r0 + r, b)));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * x->d[i]), p, acc[r]);
            low_sum[r] += low * x->s[i];
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]) + low_sum[r];
}

/* Q5_0 (is_q5_1 = 0: w = d * (q - 16)) and Q5_1 (w = d * q + m) rows: Q4's nibbles, values
 * 0-31 in the 32 int16 lanes, with bit i of qh set in lane i as bit 4 under a mask */
INLINE void q5_row(const uint8_t *row, int is_q5_1, const act_q16 *x, int64_t r0, int R, float *y,
                   int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    int64_t block_bytes = is_q5_1 ? (int64_t)sizeof(block_q5_1) : (int64_t)sizeof(block_q5_0);
    int qh_at = is_q5_1 ? 4 : 2;
    __m512 acc[MAX_ROWS];
    float low_sum[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); low_sum[r] = 0.0f; }
    const __m128i low_mask = _mm_set1_epi8(0xF);
    const __m512i bit4 = _mm512_set1_epi16(0x10);
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * block_bytes;
        float d = half_at(block), low = is_q5_1 ? half_at(block + 2) : -16.0f * d;
        uint32_t qh;
        memcpy(&qh, block + qh_at, sizeof qh);
        __m128i raw = _mm_loadu_si128((const __m128i *)(block + qh_at + 4));
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low_mask),
                                     _mm_and_si128(raw, low_mask));
        __m512i w = _mm512_cvtepu8_epi16(q);
        w = _mm512_or_si512(w, _mm512_maskz_mov_epi16(qh, bit4));
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, load_x(x, r0 + r, b)));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * x->d[i]), p, acc[r]);
            low_sum[r] += low * x->s[i];
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]) + low_sum[r];
}

INLINE void q8_0_row(const uint8_t *row, const act_q16 *x, int64_t r0, int R, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 34;
        float d = half_at(block);
        __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + 2)));
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, load_x(x, r0 + r, b)));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * x->d[i]), p, acc[r]);
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
    __m512 acc[MAX_ROWS];
    float low_sum[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); low_sum[r] = 0.0f; }
    const __m256i low_mask = _mm256_set1_epi8(0xF), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t sb = 0; sb < num_super; sb++) {
        const block_q4_k *block = (const block_q4_k *)(row + sb * super_bytes);
        const uint8_t *qs = is_q5 ? ((const block_q5_k *)block)->qs : block->qs;
        __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)((const block_q5_k *)block)->qh)
                           : _mm256_setzero_si256();
        float d = half_at((const uint8_t *)&block->d), dmin = half_at((const uint8_t *)&block->dmin);
        uint8_t scales[8], mins[8];
        for (int sub = 0; sub < 8; sub++) q4k_scale_min(sub, block->scales, scales + sub, mins + sub);
        for (int sub = 0; sub < 8; sub++) {        /* sub-block 2 s: low nibbles, 2 s + 1: high */
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + (sub / 2) * 32));
            __m256i q = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(raw, 4) : raw, low_mask);
            if (is_q5)
                q = _mm256_mask_mov_epi8(q, _mm256_test_epi8_mask(
                    qh, _mm256_set1_epi8((char)(1 << sub))), _mm256_or_si256(q, bit4));
            __m512i w = _mm512_cvtepu8_epi16(q);
            int64_t b = sb * 8 + sub;
            float scale = d * scales[sub], minimum = dmin * mins[sub];
            for (int r = 0; r < R; r++) {
                int64_t i = (r0 + r) * num_blocks + b;
                __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, load_x(x, r0 + r, b)));
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(scale * x->d[i]), p, acc[r]);
                low_sum[r] -= minimum * x->s[i];
            }
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]) + low_sum[r];
}

/* Q6_K: a block of 32 activations spans two weight scales (one per 16 values); vpmaddwd's
 * int32 lanes 0-7 hold values 0-15, lanes 8-15 values 16-31, so one vector of the two scales
 * (8 lanes each) scales the block */
INLINE void q6_k_row(const uint8_t *row, const act_q16 *x, int64_t r0, int R, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
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
                __m512i w = _mm512_cvtepi8_epi16(_mm256_sub_epi8(q[quarter], offset)); /* -32..31 */
                __m512 scales = _mm512_insertf32x8(_mm512_set1_ps(d * sc[quarter * 2]),
                                                   _mm256_set1_ps(d * sc[quarter * 2 + 1]), 1);
                int64_t b = sb * 8 + half * 4 + quarter;
                for (int r = 0; r < R; r++) {
                    float dx = x->d[(r0 + r) * num_blocks + b];
                    __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(w, load_x(x, r0 + r, b)));
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(dx)), p, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = hsum(acc[r]);
}

/* activation rows in groups of MAX_ROWS, R a constant per call so each body is specialized */
#define FOR_ROW_GROUPS(call)                                                                 \
    do {                                                                                     \
        int64_t r0 = 0;                                                                      \
        for (; r0 + MAX_ROWS <= m; r0 += MAX_ROWS) call(MAX_ROWS);                           \
        switch (m - r0) {                                                                    \
        case 3: call(3); break;                                                              \
        case 2: call(2); break;                                                              \
        case 1: call(1); break;                                                              \
        default: break;                                                                      \
        }                                                                                    \
    } while (0)

/* One kernel per type: rows of w, activation rows in groups of MAX_ROWS */
#define ROWS_KERNEL(name, row_call)                                                          \
    TARGET static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows,           \
                            const act_q16 *x, int64_t m, float *y, int64_t ldy) {             \
        for (int64_t j = 0; j < num_rows; j++) {                                             \
            const uint8_t *row = w + j * row_bytes;                                          \
            prefetch_ahead(row, row_bytes);                                                  \
            float *out = y + j;                                                              \
            FOR_ROW_GROUPS(row_call);                                                        \
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
ROWS_KERNEL(dot_q4_0_avx512, CALL_Q4_0)
ROWS_KERNEL(dot_q5_0_avx512, CALL_Q5_0)
ROWS_KERNEL(dot_q5_1_avx512, CALL_Q5_1)
ROWS_KERNEL(dot_q4_1_avx512, CALL_Q4_1)
ROWS_KERNEL(dot_q8_0_avx512, CALL_Q8_0)
ROWS_KERNEL(dot_q4_k_avx512, CALL_Q4_K)
ROWS_KERNEL(dot_q5_k_avx512, CALL_Q5_K)
ROWS_KERNEL(dot_q6_k_avx512, CALL_Q6_K)

dot_rows_fn dot_rows_avx512(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0: return dot_q4_0_avx512;
    case QTYPE_Q4_1: return dot_q4_1_avx512;
    case QTYPE_Q5_0: return dot_q5_0_avx512;
    case QTYPE_Q5_1: return dot_q5_1_avx512;
    case QTYPE_Q8_0: return dot_q8_0_avx512;
    case QTYPE_Q4_K: return dot_q4_k_avx512;
    case QTYPE_Q5_K: return dot_q5_k_avx512;
    case QTYPE_Q6_K: return dot_q6_k_avx512;
    default: return dot_rows_x8_avx512(qtype);      /* an _X8 type, or NULL */
    }
}

#else  /* not x86: never called (the module reports no avx512-vnni level) */
dot_rows_fn dot_rows_avx512(int qtype) { return dot_rows_scalar(qtype); }
#endif
