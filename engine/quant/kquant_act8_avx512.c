/* AVX512-VNNI kernels of the row-major Q4_K, Q5_K and Q6_K with 8-bit activations (formats.h
 * act_q8, ACT8_Q8 layout): GGUF's own bytes, no repacking. Compiled for those features only and called
 * only at matmul.c's LEVEL_AVX512; the same quants and products, bit for bit, as the reference
 * in kquant_act8.c, whose comment gives the lanes and the float order.
 *
 * A super-block's 256 weight quants unpack into four vectors of 64 signed bytes in value order
 * (Q4_K: a pair of sub-blocks is one run of 32 bytes, low nibbles then high, Q5_K's qh bits 2 p
 * and 2 p + 1 of the 32 bytes OR'd in as bit 4 under a mask; Q6_K: two quarters'
 * low and high bits, minus 32). vpdpbusd multiplies them by the activations (unsigned: quant +
 * 128), its accumulator starting at -128 x the lane's weight sum (one vpdpbusd against bytes of
 * 128 per weight vector, shared by every activation row), so each of the 16 lanes ends with its
 * exact signed dot of 4 values. One permute spreads the span's scales (weight scale x activation
 * block scale, one product per scale per super-block) over the lanes; one fused multiply-add per
 * span adds the lanes into the row's float sums. Up to MAX_ROWS activation rows share each
 * unpacked super-block. */
#include "formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define MAX_ROWS 8          /* activation rows per pass over a weight row */
#define SPANS 4             /* vectors of 64 weight quants per super-block */

INLINE float half_at(const uint16_t *p) { return _cvtsh_ss(*p); }

/* kquant_act8.c's lanes_sum: lanes l + 8, then l + 4, l + 2, l + 1 */
INLINE float lanes_sum(__m512 v) {
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    __m128 eighth = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(eighth, _mm_shuffle_ps(eighth, eighth, 1)));
}

/* -128 x each lane's sum of 4 weight quants: the start of the lanes' dot with the offset
 * activations */
INLINE __m512i offset_start(__m512i w) {
    return _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                _mm512_set1_epi8((char)0x80), w));
}

/* acc += the lanes' dots of span `span` (64 activations at xq) times their scales */
INLINE __m512 span_fma(__m512 acc, __m512i w, __m512i start, const uint8_t *xq, __m512 scales) {
    __m512i dot = _mm512_dpbusd_epi32(start, _mm512_loadu_si512((const void *)xq), w);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scales, acc);
}

/* permute index: lane l of span p takes scale (p * 64 + 4 l) / per_scale of a super-block */
INLINE __m512i span_index(int span, int per_scale) {
    int lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = (span * 64 + 4 * l) / per_scale;
    return _mm512_loadu_si512((const void *)lanes);
}

/* formats.h's q4k_scale_min of sub-blocks 0-7 at once: bytes 0-7 the scales, 8-15 the minimums
 * (4 sub-blocks per 32-bit word: j < 4 the low 6 bits of bytes j / j + 4; j >= 4 the nibbles of
 * byte j + 4 under the top 2 bits of bytes j - 4 / j) */
INLINE __m128i q4k_scales_mins(const uint8_t packed[12]) {
    uint32_t word[3];
    memcpy(word, packed, sizeof word);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    uint32_t scales_low = word[0] & low6, mins_low = word[1] & low6;
    uint32_t scales_high = (word[2] & low4) | (((word[0] >> 6) & top2) << 4);
    uint32_t mins_high = ((word[2] >> 4) & low4) | (((word[1] >> 6) & top2) << 4);
    return _mm_setr_epi32((int)scales_low, (int)scales_high, (int)mins_low, (int)mins_high);
}

/* Q4_K (is_q5 = 0) and Q5_K rows */
INLINE void q4_k_row8(const uint8_t *row, int is_q5, const act_q8 *x, int64_t r0, int R, float *y,
                      int64_t ldy) {
    int64_t super_bytes = is_q5 ? (int64_t)sizeof(block_q5_k) : (int64_t)sizeof(block_q4_k);
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    __m512 acc[MAX_ROWS];
    __m256 low[MAX_ROWS];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); low[r] = _mm256_setzero_ps(); }
    const __m512i mask = _mm512_set1_epi8(0xF);
    __m512i index[SPANS];
    for (int p = 0; p < SPANS; p++) index[p] = span_index(p, QK);
    for (int64_t sb = 0; sb < num_super; sb++) {
        const block_q4_k *block = (const block_q4_k *)(row + sb * super_bytes);
        const uint8_t *qs = is_q5 ? ((const block_q5_k *)block)->qs : block->qs;
        const uint8_t *qh_bytes = ((const block_q5_k *)block)->qh;
        __m512i qh = is_q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh_bytes))
                           : _mm512_setzero_si512();
        __m128i six_bit = q4k_scales_mins(block->scales);
        __m256 scales = _mm256_mul_ps(_mm256_set1_ps(half_at(&block->d)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six_bit)));
        __m256 minimums = _mm256_mul_ps(
            _mm256_set1_ps(-half_at(&block->dmin)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(six_bit, six_bit))));
        __m512i w[SPANS], start[SPANS];
        for (int p = 0; p < SPANS; p++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            w[p] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw),
                                                       _mm256_srli_epi16(raw, 4), 1), mask);
            if (is_q5) {
                __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * p))),
                                                  _mm256_set1_epi8((char)(2 << (2 * p))), 1);
                w[p] = _mm512_or_si512(
                    w[p], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits), bit4));
            }
            start[p] = offset_start(w[p]);
        }
        for (int r = 0; r < R; r++) {
            int64_t first = (r0 + r) * num_blocks + sb * (QK_K / QK);
            low[r] = _mm256_fmadd_ps(minimums, _mm256_loadu_ps(x->s + first), low[r]);
            __m512 block_scales = _mm512_castps256_ps512(
                _mm256_mul_ps(scales, _mm256_loadu_ps(x->d + first)));
            const uint8_t *xq = x->qs + (r0 + r) * x->k + sb * QK_K;
            for (int p = 0; p < SPANS; p++)
                acc[r] = span_fma(acc[r], w[p], start[p], xq + 64 * p,
                                  _mm512_permutexvar_ps(index[p], block_scales));
        }
    }
    for (int r = 0; r < R; r++)
        y[(r0 + r) * ldy] = lanes_sum(_mm512_add_ps(acc[r], _mm512_zextps256_ps512(low[r])));
}

/* 64 bytes: 32 at low, 32 at high */
INLINE __m512i join(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

INLINE void q6_k_row8(const uint8_t *row, const act_q8 *x, int64_t r0, int R, float *y,
                      int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m256i low_mask = _mm256_set1_epi8(0xF), two_bits = _mm256_set1_epi8(3);
    const __m512i offset = _mm512_set1_epi8(32);
    __m512i index[SPANS];
    for (int p = 0; p < SPANS; p++) index[p] = span_index(p, 16);
    const __m512i block_of_scale = span_index(0, 8);   /* lane t: t / 2 (scale t's block) */
    for (int64_t sb = 0; sb < num_super; sb++) {
        const block_q6_k *block = (const block_q6_k *)(row + sb * sizeof(block_q6_k));
        __m128i sixteen = _mm_loadu_si128((const __m128i *)block->scales);
        __m512 scales = _mm512_mul_ps(_mm512_set1_ps(half_at(&block->d)),
                                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen)));
        __m512i w[SPANS], start[SPANS];
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = block->ql + half * 64, *qh = block->qh + half * 32;
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)ql);
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];                                      /* 0..63, value = q - 32 */
            for (int quarter = 0; quarter < 4; quarter++) {
                __m256i bits = quarter % 2 ? ql1 : ql0;
                bits = quarter < 2 ? bits : _mm256_srli_epi16(bits, 4);
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(h, 2 * quarter), two_bits);
                q[quarter] = _mm256_or_si256(_mm256_and_si256(bits, low_mask),
                                             _mm256_slli_epi16(high, 4));
            }
            w[2 * half] = _mm512_sub_epi8(join(q[0], q[1]), offset);
            w[2 * half + 1] = _mm512_sub_epi8(join(q[2], q[3]), offset);
            start[2 * half] = offset_start(w[2 * half]);
            start[2 * half + 1] = offset_start(w[2 * half + 1]);
        }
        for (int r = 0; r < R; r++) {
            int64_t first = (r0 + r) * num_blocks + sb * (QK_K / QK);
            __m512 dx = _mm512_permutexvar_ps(
                block_of_scale, _mm512_castps256_ps512(_mm256_loadu_ps(x->d + first)));
            __m512 block_scales = _mm512_mul_ps(scales, dx);
            const uint8_t *xq = x->qs + (r0 + r) * x->k + sb * QK_K;
            for (int p = 0; p < SPANS; p++)
                acc[r] = span_fma(acc[r], w[p], start[p], xq + 64 * p,
                                  _mm512_permutexvar_ps(index[p], block_scales));
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * ldy] = lanes_sum(acc[r]);
}

/* activation rows in groups of MAX_ROWS, R a constant per call so each body is specialized */
#define FOR_ROW_GROUPS(call)                                                                 \
    do {                                                                                     \
        int64_t r0 = 0;                                                                      \
        for (; r0 + MAX_ROWS <= m; r0 += MAX_ROWS) call(MAX_ROWS);                           \
        switch (m - r0) {                                                                    \
        case 7: call(7); break;                                                              \
        case 6: call(6); break;                                                              \
        case 5: call(5); break;                                                              \
        case 4: call(4); break;                                                              \
        case 3: call(3); break;                                                              \
        case 2: call(2); break;                                                              \
        case 1: call(1); break;                                                              \
        default: break;                                                                      \
        }                                                                                    \
    } while (0)

#define ROWS_KERNEL8(name, row_call)                                                         \
    TARGET static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows,           \
                            const act_q8 *x, int64_t m, float *y, int64_t ldy) {              \
        for (int64_t j = 0; j < num_rows; j++) {                                             \
            const uint8_t *row = w + j * row_bytes;                                          \
            prefetch_ahead(row, row_bytes);                                                  \
            float *out = y + j;                                                              \
            FOR_ROW_GROUPS(row_call);                                                        \
        }                                                                                    \
    }

#define CALL_Q4_K(R) q4_k_row8(row, 0, x, r0, R, out, ldy)
#define CALL_Q5_K(R) q4_k_row8(row, 1, x, r0, R, out, ldy)
#define CALL_Q6_K(R) q6_k_row8(row, x, r0, R, out, ldy)
ROWS_KERNEL8(dot8_q4_k_avx512, CALL_Q4_K)
ROWS_KERNEL8(dot8_q5_k_avx512, CALL_Q5_K)
ROWS_KERNEL8(dot8_q6_k_avx512, CALL_Q6_K)

dot8_rows_fn dot8_rows_k_avx512(int qtype) {
    return qtype == QTYPE_Q4_K ? dot8_q4_k_avx512 : qtype == QTYPE_Q5_K ? dot8_q5_k_avx512
           : qtype == QTYPE_Q6_K ? dot8_q6_k_avx512 : NULL;
}

#else  /* not x86: never called (the module reports no avx512-vnni level) */
dot8_rows_fn dot8_rows_k_avx512(int qtype) { return dot8_rows_k_scalar(qtype); }
#endif
