/* AVX2 kernel of the _X8 layout (formats.h): per tile of 8 rows x 32 values, 16 vectors of
 * (8 rows x a pair of values) as int16, each multiplied (vpmaddwd) by a broadcast pair of 16-bit
 * activations: the int32 sums of the 8 rows stay in lanes, so a block's float scaling is one
 * vector op for 8 output rows (the row-major kernels pay it per row). Up to 4 activation rows
 * share each unpacked tile. */
#include "formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define MAX_ROWS 4

/* the pair of activations (k, k + 1) of row r, block b, broadcast to the 8 lanes */
INLINE __m256i pair_at(const act_q16 *x, int64_t r, int64_t b, int k) {
    int32_t pair;
    memcpy(&pair, x->qs + r * x->k + b * QK + k, sizeof pair);
    return _mm256_set1_epi32(pair);
}

enum { KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, KIND_Q5_0, KIND_Q5_1 };

/* whether a kind stores its own offset m (w = d q + m), and whether it has qh high bits */
INLINE int kind_has_m(int kind) { return kind == KIND_Q4_1 || kind == KIND_Q5_1; }
INLINE int kind_is_q5(int kind) { return kind == KIND_Q5_0 || kind == KIND_Q5_1; }

/* the high bits of nibble v of chunk c of a Q5_0 / Q5_1 tile (its qh lanes, formats.h) at bit 4 */
INLINE __m256i q5_high(__m256i qh, int chunk, int nibble) {
    int bit = 8 * (nibble / 2) + 2 * chunk + nibble % 2;
    __m256i at4 = bit < 4 ? _mm256_slli_epi16(qh, 4 - bit) : _mm256_srli_epi16(qh, bit - 4);
    return _mm256_and_si256(at4, _mm256_set1_epi16(0x10));
}

/* sums[r] += the int32 dot products of the tile's quants (8 rows in lanes) with row r0 + r;
 * is_q5: a Q5_0 / Q5_1 tile, its high bits at qs + 128 */
INLINE void q4_tile_sums(const uint8_t *qs, int is_q5, const act_q16 *x, int64_t r0, int R,
                         int64_t b, __m256i *sums) {
    const __m256i low_mask = _mm256_set1_epi16(0xF);
    __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)(qs + 128)) : _mm256_setzero_si256();
    for (int chunk = 0; chunk < 4; chunk++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * chunk));
        for (int nibble = 0; nibble < 4; nibble++) {       /* pair 4 chunk + nibble, as int16 */
            __m256i w = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * nibble), low_mask);
            if (is_q5) w = _mm256_or_si256(w, q5_high(qh, chunk, nibble));
            int k = 2 * (4 * chunk + nibble);
            for (int r = 0; r < R; r++)
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(w, pair_at(x, r0 + r, b, k)));
        }
    }
}

INLINE void q8_tile_sums(const uint8_t *qs, const act_q16 *x, int64_t r0, int R, int64_t b,
                         __m256i *sums) {
    for (int pair = 0; pair < 16; pair++) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * pair)));
        for (int r = 0; r < R; r++)
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(w, pair_at(x, r0 + r, b, 2 * pair)));
    }
}

/* y[r0 + r][0..7] for one group of 8 rows against R activation rows; the first visit of the
 * group (r0 == 0) prefetches the weight stream ahead, the later ones find the group cached */
INLINE void x8_group(const uint8_t *group, int kind, const act_q16 *x, int64_t r0, int R,
                     float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    int64_t tile_bytes = X8_ROWS * (kind == KIND_Q4_1 ? 20 : kind == KIND_Q4_0 ? 18
                                    : kind == KIND_Q5_0 ? 22 : kind == KIND_Q5_1 ? 24 : 34);
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *tile = group + b * tile_bytes;
        if (r0 == 0) prefetch_ahead(tile, tile_bytes);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
        __m256 low = kind_has_m(kind) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16)))
                   : _mm256_mul_ps(d, _mm256_set1_ps(kind == KIND_Q5_0 ? -16.0f : -8.0f));
        __m256i sums[MAX_ROWS];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        if (kind == KIND_Q8_0)
            q8_tile_sums(tile + 16, x, r0, R, b, sums);
        else
            q4_tile_sums(tile + (kind_has_m(kind) ? 32 : 16), kind_is_q5(kind), x, r0, R, b,
                         sums);
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->d[i]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
            if (kind != KIND_Q8_0) acc[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(x->s[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ldy, acc[r]);
}

#define X8_KERNEL(name, kind)                                                                \
    TARGET static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows,           \
                            const act_q16 *x, int64_t m, float *y, int64_t ldy) {             \
        for (int64_t g = 0; g < num_rows / X8_ROWS; g++) {                                   \
            const uint8_t *group = w + g * X8_ROWS * row_bytes;                              \
            float *out = y + g * X8_ROWS;                                                    \
            int64_t r0 = 0;                                                                  \
            for (; r0 + 4 <= m; r0 += 4) x8_group(group, kind, x, r0, 4, out, ldy);       \
            switch (m - r0) {                                                                \
            case 3: x8_group(group, kind, x, r0, 3, out, ldy); break;                     \
            case 2: x8_group(group, kind, x, r0, 2, out, ldy); break;                     \
            case 1: x8_group(group, kind, x, r0, 1, out, ldy); break;                     \
            default: break;                                                                  \
            }                                                                                \
        }                                                                                    \
    }

X8_KERNEL(dot_q4_0_x8_avx2, KIND_Q4_0)
X8_KERNEL(dot_q4_1_x8_avx2, KIND_Q4_1)
X8_KERNEL(dot_q8_0_x8_avx2, KIND_Q8_0)
X8_KERNEL(dot_q5_0_x8_avx2, KIND_Q5_0)
X8_KERNEL(dot_q5_1_x8_avx2, KIND_Q5_1)

dot_rows_fn dot_rows_x8_avx2(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0_X8: return dot_q4_0_x8_avx2;
    case QTYPE_Q4_1_X8: return dot_q4_1_x8_avx2;
    case QTYPE_Q8_0_X8: return dot_q8_0_x8_avx2;
    case QTYPE_Q5_0_X8: return dot_q5_0_x8_avx2;
    case QTYPE_Q5_1_X8: return dot_q5_1_x8_avx2;
    default: return NULL;
    }
}

#else  /* not x86: never called (the module reports no avx2 level) */
dot_rows_fn dot_rows_x8_avx2(int qtype) { return dot_rows_x8_scalar(qtype); }
#endif
