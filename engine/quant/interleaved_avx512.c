/* AVX-512 (F, BW, VL, DQ) + AVX512-VNNI kernels of the interleaved (_X8) layout (formats.h),
 * compiled for those features only and called only where matmul.c's level_supported(LEVEL_AVX512)
 * holds; the same integer arithmetic as interleaved.c's portable kernel (16-bit activation quants
 * times weight quants widened to 16 bits, one float scale per block of 32), so the products equal
 * its own up to the order of float additions.
 *
 * Two 8-row groups side by side fill one 512-bit vector, 16 rows x a pair of values, so one
 * broadcast activation pair serves both (PAIR_MIN_ROWS activation rows and more; up to
 * X8_MAX_ROWS rows share each unpacked pair of tiles). Fewer rows stream one group at a time on
 * 256-bit vpdpwssd, their int32 sums split over independent chains (single_chains): one row's
 * 16 vpdpwssd of a tile would otherwise each wait for the last. Also the dequantization of the
 * tiles for the GEMM path of long batches. */
#include "formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define X8_MAX_ROWS 8       /* per pass over two tiles: 2 R + 7 of the 32 vector registers */
/* Fewer activation rows than this stream the weight one group at a time (256-bit VNNI): there
 * the pass is bound by the weight stream from DRAM, and two groups' streams side by side ran it
 * slower (measurements: docs/performance/2026-11-29-avx512-decode.md) */
#define PAIR_MIN_ROWS 5
#define MAX_CHAINS 4        /* int32 sum chains per activation row in the single-group loop */

enum { KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, KIND_Q5_0, KIND_Q5_1 };

/* whether a kind stores its own offset m (w = d q + m), and whether it has qh high bits */
INLINE int kind_has_m(int kind) { return kind == KIND_Q4_1 || kind == KIND_Q5_1; }
INLINE int kind_is_q5(int kind) { return kind == KIND_Q5_0 || kind == KIND_Q5_1; }

/* A Q5_0 tile's high bits (formats.h) for nibble v of chunk c, shifted to bit 4 of each uint16
 * lane (the other bits not cleared: `a | (b & 0x10)` is one vpternlog with the nibbles) */
#define Q5_BIT(chunk, nibble) (8 * ((nibble) / 2) + 2 * (chunk) + (nibble) % 2)
#define OR_AND_IMM 0xF8     /* vpternlog: a | (b & c) */

/* the pair of activations (k, k + 1) of row r, block b, as one int32 */
INLINE int32_t pair_bits(const act_q16 *x, int64_t r, int64_t b, int k) {
    int32_t pair;
    memcpy(&pair, x->qs + r * x->k + b * QK + k, sizeof pair);
    return pair;
}

/* 32 bytes at `low` and 32 at `high` as one vector (low first) */
INLINE __m512i join_256(const uint8_t *low, const uint8_t *high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)low)),
                              _mm256_loadu_si256((const __m256i *)high), 1);
}

/* 16 bytes at `low` and 16 at `high` as one 256-bit vector (low first) */
INLINE __m256i join_128(const uint8_t *low, const uint8_t *high) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)low)),
                                   _mm_loadu_si128((const __m128i *)high), 1);
}

/* 8 float16 at `low` and 8 at `high` as 16 float32 */
INLINE __m512 halves_16(const uint8_t *low, const uint8_t *high) {
    return _mm512_cvtph_ps(join_128(low, high));
}

INLINE __m512i q5_high_512(__m512i qh, int chunk, int nibble) {
    int bit = Q5_BIT(chunk, nibble);
    return bit < 4 ? _mm512_slli_epi16(qh, 4 - bit) : _mm512_srli_epi16(qh, bit - 4);
}

INLINE __m256i q5_high_256(__m256i qh, int chunk, int nibble) {
    int bit = Q5_BIT(chunk, nibble);
    return bit < 4 ? _mm256_slli_epi16(qh, 4 - bit) : _mm256_srli_epi16(qh, bit - 4);
}

/* sums[r] += the int32 dot products of two tiles' quants (group a's 8 rows in lanes 0-7, group
 * b's in 8-15) with activation row r0 + r: chunk c of each tile side by side, nibble v of every
 * uint16 lane is pair 4 c + v of the 16 rows (is_q5: Q5_0 / Q5_1 tiles, their high bits at qs + 128
 * OR'd in as bit 4) */
INLINE void q4_tile_pair_sums(const uint8_t *qs_a, const uint8_t *qs_b, int is_q5,
                              const act_q16 *x, int64_t r0, int R, int64_t b, __m512i *sums) {
    const __m512i low_mask = _mm512_set1_epi16(0xF), bit4 = _mm512_set1_epi16(0x10);
    __m512i qh = is_q5 ? join_256(qs_a + 128, qs_b + 128) : _mm512_setzero_si512();
    for (int chunk = 0; chunk < 4; chunk++) {
        __m512i raw = join_256(qs_a + 32 * chunk, qs_b + 32 * chunk);
        for (int nibble = 0; nibble < 4; nibble++) {
            __m512i w = nibble == 0 ? _mm512_and_si512(raw, low_mask)
                        : nibble == 3 ? _mm512_srli_epi16(raw, 12)     /* the top 4 bits */
                        : _mm512_and_si512(_mm512_srli_epi16(raw, 4 * nibble), low_mask);
            if (is_q5)
                w = _mm512_ternarylogic_epi32(w, q5_high_512(qh, chunk, nibble), bit4, OR_AND_IMM);
            int k = 2 * (4 * chunk + nibble);
            for (int r = 0; r < R; r++)
                sums[r] = _mm512_dpwssd_epi32(sums[r], w,
                                              _mm512_set1_epi32(pair_bits(x, r0 + r, b, k)));
        }
    }
}

/* the same for Q8_0 tiles: pair p is 16 int8 of each tile, widened to 32 int16 */
INLINE void q8_tile_pair_sums(const uint8_t *qs_a, const uint8_t *qs_b, const act_q16 *x,
                              int64_t r0, int R, int64_t b, __m512i *sums) {
    for (int pair = 0; pair < 16; pair++) {
        __m512i w = _mm512_cvtepi8_epi16(join_128(qs_a + 16 * pair, qs_b + 16 * pair));
        for (int r = 0; r < R; r++)
            sums[r] = _mm512_dpwssd_epi32(sums[r], w,
                                          _mm512_set1_epi32(pair_bits(x, r0 + r, b, 2 * pair)));
    }
}

INLINE int64_t x8_tile_bytes(int kind) {
    return X8_ROWS * (kind == KIND_Q4_1 ? 20 : kind == KIND_Q4_0 ? 18
                      : kind == KIND_Q5_0 ? 22 : kind == KIND_Q5_1 ? 24 : 34);
}

/* the offset term's factor of d: w = d q + low (Q4_1's and Q5_1's low is their own m) */
INLINE float low_factor(int kind) { return kind == KIND_Q5_0 ? -16.0f : -8.0f; }

/* y[r0 + r][0..15] for two consecutive groups of 8 rows (group_b = group_a's successor) against
 * R activation rows; the first visit (r0 == 0) prefetches both weight streams ahead, the later
 * ones find the groups cached */
INLINE void x8_group_pair(const uint8_t *group_a, const uint8_t *group_b, int kind,
                          const act_q16 *x, int64_t r0, int R, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, tile_bytes = x8_tile_bytes(kind);
    int quants_at = kind_has_m(kind) ? 32 : 16;
    __m512 acc[X8_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *tile_a = group_a + b * tile_bytes, *tile_b = group_b + b * tile_bytes;
        if (r0 == 0) {
            prefetch_ahead(tile_a, tile_bytes);
            prefetch_ahead(tile_b, tile_bytes);
        }
        __m512 d = halves_16(tile_a, tile_b);
        __m512 low = kind_has_m(kind) ? halves_16(tile_a + 16, tile_b + 16)
                                       : _mm512_mul_ps(d, _mm512_set1_ps(low_factor(kind)));
        __m512i sums[X8_MAX_ROWS];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
        if (kind == KIND_Q8_0)
            q8_tile_pair_sums(tile_a + quants_at, tile_b + quants_at, x, r0, R, b, sums);
        else
            q4_tile_pair_sums(tile_a + quants_at, tile_b + quants_at, kind_is_q5(kind), x, r0,
                              R, b, sums);
        for (int r = 0; r < R; r++) {
            int64_t i = (r0 + r) * num_blocks + b;
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x->d[i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
            if (kind != KIND_Q8_0) acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x->s[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy, acc[r]);
}

/* Independent int32 sum chains per activation row in the single-group loop: R rows give R
 * chains already; one or two rows split theirs so that about four are in flight. */
#define SINGLE_CHAINS(R) ((R) == 1 ? MAX_CHAINS : (R) == 2 ? 2 : 1)

/* sums[r][c] += the int32 dot products of one tile's quants (8 rows in lanes) with activation
 * row r0 + r, pair p of the tile going to chain p % chains */
INLINE void q4_tile_single_sums(const uint8_t *qs, int is_q5, const act_q16 *x, int64_t r0,
                                int R, int64_t b, __m256i sums[][MAX_CHAINS]) {
    const int chains = SINGLE_CHAINS(R);
    const __m256i low_mask = _mm256_set1_epi16(0xF), bit4 = _mm256_set1_epi16(0x10);
    __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)(qs + 128)) : _mm256_setzero_si256();
    for (int chunk = 0; chunk < 4; chunk++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * chunk));
        for (int nibble = 0; nibble < 4; nibble++) {
            __m256i w = nibble == 0 ? _mm256_and_si256(raw, low_mask)
                        : nibble == 3 ? _mm256_srli_epi16(raw, 12)
                        : _mm256_and_si256(_mm256_srli_epi16(raw, 4 * nibble), low_mask);
            if (is_q5)
                w = _mm256_ternarylogic_epi32(w, q5_high_256(qh, chunk, nibble), bit4, OR_AND_IMM);
            int pair = 4 * chunk + nibble;
            for (int r = 0; r < R; r++)
                sums[r][pair % chains] = _mm256_dpwssd_epi32(
                    sums[r][pair % chains], w, _mm256_set1_epi32(pair_bits(x, r0 + r, b, 2 * pair)));
        }
    }
}

INLINE void q8_tile_single_sums(const uint8_t *qs, const act_q16 *x, int64_t r0, int R,
                                int64_t b, __m256i sums[][MAX_CHAINS]) {
    const int chains = SINGLE_CHAINS(R);
    for (int pair = 0; pair < 16; pair++) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16 * pair)));
        for (int r = 0; r < R; r++)
            sums[r][pair % chains] = _mm256_dpwssd_epi32(
                sums[r][pair % chains], w, _mm256_set1_epi32(pair_bits(x, r0 + r, b, 2 * pair)));
    }
}

/* y[r0 + r][0..7] for one group of 8 rows against R activation rows (fewer than PAIR_MIN_ROWS,
 * or a chunk's odd last group); the first visit (r0 == 0) prefetches the weight stream ahead */
INLINE void x8_group_single(const uint8_t *group, int kind, const act_q16 *x, int64_t r0, int R,
                            float *y, int64_t ldy) {
    const int chains = SINGLE_CHAINS(R);
    int64_t num_blocks = x->k / QK, tile_bytes = x8_tile_bytes(kind);
    __m256 acc[X8_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *tile = group + b * tile_bytes;
        if (r0 == 0) prefetch_ahead(tile, tile_bytes);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
        __m256 low = kind_has_m(kind) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16)))
                                       : _mm256_mul_ps(d, _mm256_set1_ps(low_factor(kind)));
        __m256i sums[X8_MAX_ROWS][MAX_CHAINS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < chains; c++) sums[r][c] = _mm256_setzero_si256();
        if (kind == KIND_Q8_0)
            q8_tile_single_sums(tile + 16, x, r0, R, b, sums);
        else
            q4_tile_single_sums(tile + (kind_has_m(kind) ? 32 : 16), kind_is_q5(kind), x, r0, R,
                                b, sums);
        for (int r = 0; r < R; r++) {
            __m256i total = sums[r][0];
            for (int c = 1; c < chains; c++) total = _mm256_add_epi32(total, sums[r][c]);
            int64_t i = (r0 + r) * num_blocks + b;
            __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->d[i]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[r]);
            if (kind != KIND_Q8_0) acc[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(x->s[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (r0 + r) * ldy, acc[r]);
}

/* activation rows in groups of X8_MAX_ROWS, R a constant per call so each body is specialized */
#define FOR_X8_ROW_GROUPS(call)                                                              \
    do {                                                                                     \
        int64_t r0 = 0;                                                                      \
        for (; r0 + X8_MAX_ROWS <= m; r0 += X8_MAX_ROWS) call(X8_MAX_ROWS);                  \
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

#define X8_KERNEL(name, kind_value)                                                          \
    TARGET static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows,           \
                            const act_q16 *x, int64_t m, float *y, int64_t ldy) {             \
        const int kind = kind_value;                                                         \
        int64_t num_groups = num_rows / X8_ROWS, group_bytes = X8_ROWS * row_bytes, g = 0;   \
        for (; m >= PAIR_MIN_ROWS && g + 2 <= num_groups; g += 2) {                          \
            const uint8_t *group = w + g * group_bytes;                                      \
            float *out = y + g * X8_ROWS;                                                    \
            FOR_X8_ROW_GROUPS(PAIR_CALL);                                                    \
        }                                                                                    \
        for (; g < num_groups; g++) {      /* one row: every group; else an odd last one */  \
            const uint8_t *group = w + g * group_bytes;                                      \
            float *out = y + g * X8_ROWS;                                                    \
            FOR_X8_ROW_GROUPS(SINGLE_CALL);                                                  \
        }                                                                                    \
    }
#define PAIR_CALL(R) x8_group_pair(group, group + group_bytes, kind, x, r0, R, out, ldy)
#define SINGLE_CALL(R) x8_group_single(group, kind, x, r0, R, out, ldy)

X8_KERNEL(dot_q4_0_x8_avx512, KIND_Q4_0)
X8_KERNEL(dot_q4_1_x8_avx512, KIND_Q4_1)
X8_KERNEL(dot_q8_0_x8_avx512, KIND_Q8_0)
X8_KERNEL(dot_q5_0_x8_avx512, KIND_Q5_0)
X8_KERNEL(dot_q5_1_x8_avx512, KIND_Q5_1)

/* ---- dequantization of interleaved tiles (the GEMM path of long batches) ------------------- */

/* lane i (value i of a row): the bit of its high bit in its uint16 word of a Q5_0 / Q5_1 tile's qh
 * (formats.h: bit 8 (v / 2) + 2 c + v % 2, c = i / 8, v = i % 8 / 2) */
static const uint16_t Q5_LANE_BITS[32] = {
    1, 1, 2, 2, 256, 256, 512, 512, 4, 4, 8, 8, 1024, 1024, 2048, 2048,
    16, 16, 32, 32, 4096, 4096, 8192, 8192, 64, 64, 128, 128, 16384, 16384, 32768, 32768};

/* out[j * k + b * 32 + i] for the 8 rows j of one Q4 (or Q5) tile. The quants are 64 uint16
 * words: value i of row j is nibble (i % 8) / 2 of word 16 (i / 8) + 2 j + i % 2 (formats.h), so
 * one two-source word permute puts the word of each of row j's 32 values in its lane and a
 * variable shift its nibble at the bottom; a Q5 tile's high bit of value i is in qh word
 * 2 j + i % 2, one more permute and a bit test. q d + m as a product, then a sum (no fused
 * multiply-add): the portable dequantizer's values bit for bit. */
INLINE void dequantize_q4_tile(const uint8_t *tile, int kind, int64_t b, int64_t k, float *out) {
    int is_q4_1 = kind_has_m(kind), is_q5 = kind_is_q5(kind);
    const uint8_t *qs = tile + (is_q4_1 ? 32 : 16);
    __m512i words_low = _mm512_loadu_si512((const void *)qs);
    __m512i words_high = _mm512_loadu_si512((const void *)(qs + 64));
    const __m512i base = _mm512_set_epi16(49, 48, 49, 48, 49, 48, 49, 48, 33, 32, 33, 32, 33, 32,
                                          33, 32, 17, 16, 17, 16, 17, 16, 17, 16, 1, 0, 1, 0, 1, 0,
                                          1, 0);      /* lane i: 16 (i / 8) + i % 2 */
    const __m512i shifts = _mm512_set_epi16(12, 12, 8, 8, 4, 4, 0, 0, 12, 12, 8, 8, 4, 4, 0, 0,
                                            12, 12, 8, 8, 4, 4, 0, 0, 12, 12, 8, 8, 4, 4, 0, 0);
    const __m512i low_mask = _mm512_set1_epi16(0xF), bit4 = _mm512_set1_epi16(0x10);
    const __m512i high_base = _mm512_set1_epi32(0x00010000);        /* lane i: i % 2 */
    const __m512i lane_bits = _mm512_loadu_si512((const void *)Q5_LANE_BITS);
    __m512i qh = is_q5 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(qs + 128)))
                       : _mm512_setzero_si512();
    __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
    __m256 m8 = is_q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16)))
                        : _mm256_mul_ps(d8, _mm256_set1_ps(low_factor(kind)));
    float d[X8_ROWS], m[X8_ROWS];
    _mm256_storeu_ps(d, d8);
    _mm256_storeu_ps(m, m8);
    for (int j = 0; j < X8_ROWS; j++) {
        __m512i index = _mm512_add_epi16(base, _mm512_set1_epi16((short)(2 * j)));
        __m512i q = _mm512_and_si512(
            _mm512_srlv_epi16(_mm512_permutex2var_epi16(words_low, index, words_high), shifts),
            low_mask);
        if (is_q5) {
            __m512i high_index = _mm512_add_epi16(high_base, _mm512_set1_epi16((short)(2 * j)));
            __mmask32 set = _mm512_test_epi16_mask(_mm512_permutexvar_epi16(high_index, qh),
                                                   lane_bits);
            q = _mm512_or_si512(q, _mm512_maskz_mov_epi16(set, bit4));
        }
        __m512 scale = _mm512_set1_ps(d[j]), low = _mm512_set1_ps(m[j]);
        float *row = out + j * k + b * QK;
        _mm512_storeu_ps(row, _mm512_add_ps(_mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q))), scale), low));
        _mm512_storeu_ps(row + 16, _mm512_add_ps(_mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1))), scale), low));
    }
}

/* The same for a Q8_0 tile: 128 words, values 2 p and 2 p + 1 of row j in word 8 p + j; two
 * permutes over the four vectors of words gather row j's 16 words (pairs 0-7, then 8-15). */
INLINE void dequantize_q8_tile(const uint8_t *tile, int64_t b, int64_t k, float *out) {
    const uint8_t *qs = tile + 16;
    __m512i words[4];
    for (int i = 0; i < 4; i++) words[i] = _mm512_loadu_si512((const void *)(qs + 64 * i));
    const __m512i base = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                          56, 48, 40, 32, 24, 16, 8, 0, 56, 48, 40, 32, 24, 16, 8, 0);
    float d[X8_ROWS];
    _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile)));
    for (int j = 0; j < X8_ROWS; j++) {
        __m512i index = _mm512_add_epi16(base, _mm512_set1_epi16((short)j));
        __m512i first = _mm512_permutex2var_epi16(words[0], index, words[1]);   /* pairs 0-7 */
        __m512i second = _mm512_permutex2var_epi16(words[2], index, words[3]);  /* pairs 8-15 */
        __m256i bytes = _mm512_castsi512_si256(_mm512_mask_blend_epi16(0xFF00, first, second));
        __m512 scale = _mm512_set1_ps(d[j]);
        float *row = out + j * k + b * QK;
        _mm512_storeu_ps(row, _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes))), scale));
        _mm512_storeu_ps(row + 16, _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1))), scale));
    }
}

TARGET int dequantize_x8_avx512(int qtype, const uint8_t *w, int64_t num_rows, int64_t k,
                                float *out) {
    if (qtype != QTYPE_Q4_0_X8 && qtype != QTYPE_Q4_1_X8 && qtype != QTYPE_Q8_0_X8
            && qtype != QTYPE_Q5_0_X8 && qtype != QTYPE_Q5_1_X8)
        return -1;
    int kind = qtype == QTYPE_Q4_0_X8 ? KIND_Q4_0 : qtype == QTYPE_Q4_1_X8 ? KIND_Q4_1
               : qtype == QTYPE_Q5_0_X8 ? KIND_Q5_0 : qtype == QTYPE_Q5_1_X8 ? KIND_Q5_1
               : KIND_Q8_0;
    int64_t num_blocks = k / QK, tile_bytes = x8_tile_bytes(kind);
    for (int64_t group = 0; group < num_rows / X8_ROWS; group++) {
        const uint8_t *tiles = w + group * num_blocks * tile_bytes;
        float *rows = out + group * X8_ROWS * k;
        for (int64_t b = 0; b < num_blocks; b++) {
            if (kind == KIND_Q8_0)
                dequantize_q8_tile(tiles + b * tile_bytes, b, k, rows);
            else
                dequantize_q4_tile(tiles + b * tile_bytes, kind, b, k, rows);
        }
    }
    return 0;
}

dot_rows_fn dot_rows_x8_avx512(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0_X8: return dot_q4_0_x8_avx512;
    case QTYPE_Q4_1_X8: return dot_q4_1_x8_avx512;
    case QTYPE_Q8_0_X8: return dot_q8_0_x8_avx512;
    case QTYPE_Q5_0_X8: return dot_q5_0_x8_avx512;
    case QTYPE_Q5_1_X8: return dot_q5_1_x8_avx512;
    default: return NULL;
    }
}

#else  /* not x86: never called (the module reports no avx512-vnni level) */
dot_rows_fn dot_rows_x8_avx512(int qtype) { return dot_rows_x8_scalar(qtype); }
int dequantize_x8_avx512(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out) {
    return -1;
}
#endif
