/* AVX512-VNNI kernels of the interleaved (_X8) layout with 8-bit activations (formats.h's
 * act_q8): vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes per 32-bit lane, 64 products
 * an instruction (vpdpwssd of the 16-bit path: 32). Compiled for those features only and called
 * only at matmul.c's LEVEL_AVX512; the same quants and products, bit for bit, as the reference
 * in interleaved_act8.c.
 *
 * Two 8-row groups side by side fill one 512-bit vector, 16 rows in its 32-bit lanes, so one
 * broadcast run of 4 activations serves both (PAIR_MIN_ROWS activation rows and more; up to
 * X8_MAX_ROWS rows share each unpacked tile pair). Fewer rows stream the weight one group at a
 * time on 256-bit vectors, as the 16-bit kernels do (interleaved_avx512.c: there the pass is
 * bound by the weight stream, and two groups' streams side by side ran it slower). Q4 tiles need no repacking: 32-bit lane j of a 32-byte chunk holds row
 * j's 8 nibbles of that chunk, and a mask (low nibbles) or a shift and mask (high) gives 4
 * unsigned bytes per row in the ACT8_Q4 order of the activations; a Q5 tile's high bits,
 * one 32-bit mask per row in the same lane, come to bit 4 of those bytes with one shift per
 * byte set and are OR'd in with one vpternlog. Q8_0 tiles hold pairs of
 * values per row; one word permute per 4 values brings each row's 4 signed bytes into its lane,
 * and the activations come offset to unsigned (+128), the sum taken off again with the weights'
 * own sum, counted by the same instruction against bytes of ones. */
#include "formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define INLINE TARGET static inline __attribute__((always_inline))
#define X8_MAX_ROWS 8       /* activation rows per pass over a tile pair */
#define PAIR_MIN_ROWS 5     /* fewer activation rows stream one 8-row group at a time */
#define MAX_CHAINS 2        /* int32 sum chains per activation row (few rows: latency) */
#define CHAINS(R) ((R) <= 4 ? MAX_CHAINS : 1)

enum { KIND_Q4_0, KIND_Q4_1, KIND_Q8_0, KIND_Q5_0, KIND_Q5_1 };

/* whether a kind stores its own offset m (w = d q + m), and whether it has qh high bits */
INLINE int kind_has_m(int kind) { return kind == KIND_Q4_1 || kind == KIND_Q5_1; }
INLINE int kind_is_q5(int kind) { return kind == KIND_Q5_0 || kind == KIND_Q5_1; }
#define OR_AND_IMM 0xF8     /* vpternlog: a | (b & c) */

TARGET void quantize_act8_avx512(const float *x, int64_t m, act_q8 *out) {
    int64_t k = out->k, num_blocks = k / QK;
    const __m512 limit = _mm512_set1_ps(ACT8_MAX), negative_limit = _mm512_set1_ps(-ACT8_MAX);
    /* per 128-bit lane: stored byte p of each run of 8 is value (0 4 1 5 2 6 3 7)[p] */
    const __m256i q4_order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                              0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m256i offset = _mm256_set1_epi8((char)0x80);
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *v = x + r * k + b * QK;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float d = amax / ACT8_MAX, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            __m512 scale = _mm512_set1_ps(inverse);
            __m512i i0 = _mm512_cvtps_epi32(_mm512_min_ps(
                _mm512_max_ps(_mm512_mul_ps(v0, scale), negative_limit), limit));
            __m512i i1 = _mm512_cvtps_epi32(_mm512_min_ps(
                _mm512_max_ps(_mm512_mul_ps(v1, scale), negative_limit), limit));
            int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(i0)),
                                                    _mm512_cvtepi32_epi8(i1), 1);
            bytes = out->layout == ACT8_Q4 ? _mm256_shuffle_epi8(bytes, q4_order)
                                           : _mm256_xor_si256(bytes, offset);
            _mm256_storeu_si256((__m256i *)(out->qs + r * k + b * QK), bytes);
            out->d[r * num_blocks + b] = d;
            out->s[r * num_blocks + b] = d * (float)sum;
        }
    }
}

/* the 4 stored activation bytes at byte `at` of row r, block b, as one int32 */
INLINE int32_t act_word(const act_q8 *x, int64_t r, int64_t b, int at) {
    int32_t word;
    memcpy(&word, x->qs + r * x->k + b * QK + at, sizeof word);
    return word;
}

/* 32 bytes at `low` and 32 at `high` as one vector (low first) */
INLINE __m512i join_256(const uint8_t *low, const uint8_t *high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)low)),
                              _mm256_loadu_si256((const __m256i *)high), 1);
}

/* 8 float16 at `low` and 8 at `high` as 16 float32 */
INLINE __m512 halves_16(const uint8_t *low, const uint8_t *high) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)low)),
        _mm_loadu_si128((const __m128i *)high), 1));
}

/* A Q5 tile's high bits (formats.h) shifted so that bit 4 of each byte of 32-bit lane j is the
 * high bit of row j's byte in chunk c's low nibbles (set 0) or high nibbles (set 1): that byte's
 * bit 2 c + set. The other bits are not cleared (the vpternlog that ORs them in masks them). */
INLINE __m512i q5_high_512(__m512i qh, int chunk, int set) {
    int bit = 2 * chunk + set;
    return bit < 4 ? _mm512_slli_epi32(qh, 4 - bit) : _mm512_srli_epi32(qh, bit - 4);
}

INLINE __m256i q5_high_256(__m256i qh, int chunk, int set) {
    int bit = 2 * chunk + set;
    return bit < 4 ? _mm256_slli_epi32(qh, 4 - bit) : _mm256_srli_epi32(qh, bit - 4);
}

/* sums[r][c] += the int32 dot products of two Q4 tiles' quants (group a's rows in lanes 0-7,
 * b's in 8-15) with activation row r0 + r: chunk c's low nibbles are its stored bytes 8 c..8 c+3,
 * its high nibbles 8 c + 4..8 c + 7 (is_q5: Q5 tiles, their high bits at qs + 128 OR'd in as
 * bit 4 of each byte) */
INLINE void q4_tile_pair_sums(const uint8_t *qs_a, const uint8_t *qs_b, int is_q5,
                              const act_q8 *x, int64_t r0, int R, int64_t b,
                              __m512i sums[][MAX_CHAINS]) {
    const int chains = CHAINS(R);
    const __m512i low_mask = _mm512_set1_epi8(0xF), bit4 = _mm512_set1_epi8(0x10);
    __m512i qh = is_q5 ? join_256(qs_a + 128, qs_b + 128) : _mm512_setzero_si512();
    for (int chunk = 0; chunk < 4; chunk++) {
        __m512i raw = join_256(qs_a + 32 * chunk, qs_b + 32 * chunk);
        __m512i low = _mm512_and_si512(raw, low_mask);
        __m512i high = _mm512_and_si512(_mm512_srli_epi32(raw, 4), low_mask);
        if (is_q5) {
            low = _mm512_ternarylogic_epi32(low, q5_high_512(qh, chunk, 0), bit4, OR_AND_IMM);
            high = _mm512_ternarylogic_epi32(high, q5_high_512(qh, chunk, 1), bit4, OR_AND_IMM);
        }
        for (int r = 0; r < R; r++) {
            sums[r][0] = _mm512_dpbusd_epi32(
                sums[r][0], low, _mm512_set1_epi32(act_word(x, r0 + r, b, 8 * chunk)));
            sums[r][chains - 1] = _mm512_dpbusd_epi32(
                sums[r][chains - 1], high, _mm512_set1_epi32(act_word(x, r0 + r, b, 8 * chunk + 4)));
        }
    }
}

/* the same for Q8_0 tiles: each run of 4 values, its rows' pairs of words side by side (one word
 * permute), times the offset activations; weight_sums += each row's sum of quants */
INLINE void q8_tile_pair_sums(const uint8_t *qs_a, const uint8_t *qs_b, const act_q8 *x,
                              int64_t r0, int R, int64_t b, __m512i sums[][MAX_CHAINS],
                              __m512i *weight_sums) {
    const int chains = CHAINS(R);
    /* word 2 j + e of each half: word j of pair 2 q (e = 0) or of pair 2 q + 1 (e = 1) */
    const __m512i order = _mm512_set_epi16(31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17,
                                           24, 16, 15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1,
                                           8, 0);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int quad = 0; quad < 8; quad++) {
        __m512i w = _mm512_permutexvar_epi16(order, join_256(qs_a + 32 * quad, qs_b + 32 * quad));
        *weight_sums = _mm512_dpbusd_epi32(*weight_sums, ones, w);
        for (int r = 0; r < R; r++)
            sums[r][quad % chains] = _mm512_dpbusd_epi32(
                sums[r][quad % chains], _mm512_set1_epi32(act_word(x, r0 + r, b, 4 * quad)), w);
    }
}

INLINE int64_t x8_tile_bytes(int kind) {
    return X8_ROWS * (kind == KIND_Q4_1 ? 20 : kind == KIND_Q4_0 ? 18
                      : kind == KIND_Q5_0 ? 22 : kind == KIND_Q5_1 ? 24 : 34);
}

/* the offset term's factor of d: w = d q + low (Q4_1's and Q5_1's low is their own m) */
INLINE float low_factor(int kind) { return kind == KIND_Q5_0 ? -16.0f : -8.0f; }

/* y[r0 + r][0..15] for two consecutive groups of 8 rows (group_b = group_a's successor) against
 * R activation rows; the first visit (r0 == 0) prefetches both weight streams ahead (as the
 * 16-bit kernels do; asking for the next pair's tiles instead measured the same) */
INLINE void x8_group_pair(const uint8_t *group_a, const uint8_t *group_b, int kind,
                          const act_q8 *x, int64_t r0, int R, float *y, int64_t ldy) {
    const int chains = CHAINS(R);
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
        __m512i sums[X8_MAX_ROWS][MAX_CHAINS], weight_sums = _mm512_setzero_si512();
        for (int r = 0; r < R; r++)
            for (int c = 0; c < chains; c++) sums[r][c] = _mm512_setzero_si512();
        if (kind == KIND_Q8_0)
            q8_tile_pair_sums(tile_a + quants_at, tile_b + quants_at, x, r0, R, b, sums,
                              &weight_sums);
        else
            q4_tile_pair_sums(tile_a + quants_at, tile_b + quants_at, kind_is_q5(kind), x, r0,
                              R, b, sums);
        __m512i offset_sums = _mm512_slli_epi32(weight_sums, 7);     /* 128 sum(w): Q8_0 only */
        for (int r = 0; r < R; r++) {
            __m512i total = chains == 2 ? _mm512_add_epi32(sums[r][0], sums[r][1]) : sums[r][0];
            if (kind == KIND_Q8_0) total = _mm512_sub_epi32(total, offset_sums);
            int64_t i = (r0 + r) * num_blocks + b;
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x->d[i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[r]);
            if (kind != KIND_Q8_0) acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x->s[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (r0 + r) * ldy, acc[r]);
}

/* sums[r][c] += one Q4 (is_q5: Q5_0 / Q5_1) tile's products (8 rows in the 32-bit lanes) with
 * activation row r0 + r */
INLINE void q4_tile_single_sums(const uint8_t *qs, int is_q5, const act_q8 *x, int64_t r0, int R,
                                int64_t b, __m256i sums[][MAX_CHAINS]) {
    const int chains = CHAINS(R);
    const __m256i low_mask = _mm256_set1_epi8(0xF), bit4 = _mm256_set1_epi8(0x10);
    __m256i qh = is_q5 ? _mm256_loadu_si256((const __m256i *)(qs + 128)) : _mm256_setzero_si256();
    for (int chunk = 0; chunk < 4; chunk++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * chunk));
        __m256i low = _mm256_and_si256(raw, low_mask);
        __m256i high = _mm256_and_si256(_mm256_srli_epi32(raw, 4), low_mask);
        if (is_q5) {
            low = _mm256_ternarylogic_epi32(low, q5_high_256(qh, chunk, 0), bit4, OR_AND_IMM);
            high = _mm256_ternarylogic_epi32(high, q5_high_256(qh, chunk, 1), bit4, OR_AND_IMM);
        }
        for (int r = 0; r < R; r++) {
            sums[r][0] = _mm256_dpbusd_epi32(
                sums[r][0], low, _mm256_set1_epi32(act_word(x, r0 + r, b, 8 * chunk)));
            sums[r][chains - 1] = _mm256_dpbusd_epi32(
                sums[r][chains - 1], high, _mm256_set1_epi32(act_word(x, r0 + r, b, 8 * chunk + 4)));
        }
    }
}

/* the same for one Q8_0 tile (weight_sums: each row's sum of quants) */
INLINE void q8_tile_single_sums(const uint8_t *qs, const act_q8 *x, int64_t r0, int R, int64_t b,
                                __m256i sums[][MAX_CHAINS], __m256i *weight_sums) {
    const int chains = CHAINS(R);
    const __m256i order = _mm256_set_epi16(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int quad = 0; quad < 8; quad++) {
        __m256i w = _mm256_permutexvar_epi16(order,
                                             _mm256_loadu_si256((const __m256i *)(qs + 32 * quad)));
        *weight_sums = _mm256_dpbusd_epi32(*weight_sums, ones, w);
        for (int r = 0; r < R; r++)
            sums[r][quad % chains] = _mm256_dpbusd_epi32(
                sums[r][quad % chains], _mm256_set1_epi32(act_word(x, r0 + r, b, 4 * quad)), w);
    }
}

/* y[r0 + r][0..7] for one group of 8 rows against R activation rows (fewer than PAIR_MIN_ROWS,
 * or a chunk's odd last group); the first visit (r0 == 0) prefetches the weight stream ahead */
INLINE void x8_group_single(const uint8_t *group, int kind, const act_q8 *x, int64_t r0, int R,
                            float *y, int64_t ldy) {
    const int chains = CHAINS(R);
    int64_t num_blocks = x->k / QK, tile_bytes = x8_tile_bytes(kind);
    int quants_at = kind_has_m(kind) ? 32 : 16;
    __m256 acc[X8_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *tile = group + b * tile_bytes;
        if (r0 == 0) prefetch_ahead(tile, tile_bytes);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
        __m256 low = kind_has_m(kind) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16)))
                                       : _mm256_mul_ps(d, _mm256_set1_ps(low_factor(kind)));
        __m256i sums[X8_MAX_ROWS][MAX_CHAINS], weight_sums = _mm256_setzero_si256();
        for (int r = 0; r < R; r++)
            for (int c = 0; c < chains; c++) sums[r][c] = _mm256_setzero_si256();
        if (kind == KIND_Q8_0)
            q8_tile_single_sums(tile + quants_at, x, r0, R, b, sums, &weight_sums);
        else
            q4_tile_single_sums(tile + quants_at, kind_is_q5(kind), x, r0, R, b, sums);
        __m256i offset_sums = _mm256_slli_epi32(weight_sums, 7);
        for (int r = 0; r < R; r++) {
            __m256i total = chains == 2 ? _mm256_add_epi32(sums[r][0], sums[r][1]) : sums[r][0];
            if (kind == KIND_Q8_0) total = _mm256_sub_epi32(total, offset_sums);
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

#define X8_KERNEL8(name, kind_value)                                                         \
    TARGET static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows,           \
                            const act_q8 *x, int64_t m, float *y, int64_t ldy) {              \
        const int kind = kind_value;                                                         \
        int64_t num_groups = num_rows / X8_ROWS, group_bytes = X8_ROWS * row_bytes, g = 0;   \
        for (; m >= PAIR_MIN_ROWS && g + 2 <= num_groups; g += 2) {                          \
            const uint8_t *group = w + g * group_bytes;                                      \
            float *out = y + g * X8_ROWS;                                                    \
            FOR_X8_ROW_GROUPS(PAIR_CALL);                                                    \
        }                                                                                    \
        for (; g < num_groups; g++) {      /* few rows: every group; else an odd last one */ \
            const uint8_t *group = w + g * group_bytes;                                      \
            float *out = y + g * X8_ROWS;                                                    \
            FOR_X8_ROW_GROUPS(SINGLE_CALL);                                                  \
        }                                                                                    \
    }
#define PAIR_CALL(R) x8_group_pair(group, group + group_bytes, kind, x, r0, R, out, ldy)
#define SINGLE_CALL(R) x8_group_single(group, kind, x, r0, R, out, ldy)

X8_KERNEL8(dot8_q4_0_x8_avx512, KIND_Q4_0)
X8_KERNEL8(dot8_q4_1_x8_avx512, KIND_Q4_1)
X8_KERNEL8(dot8_q8_0_x8_avx512, KIND_Q8_0)
X8_KERNEL8(dot8_q5_0_x8_avx512, KIND_Q5_0)
X8_KERNEL8(dot8_q5_1_x8_avx512, KIND_Q5_1)

dot8_rows_fn dot8_rows_x8_avx512(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0_X8: return dot8_q4_0_x8_avx512;
    case QTYPE_Q4_1_X8: return dot8_q4_1_x8_avx512;
    case QTYPE_Q8_0_X8: return dot8_q8_0_x8_avx512;
    case QTYPE_Q5_0_X8: return dot8_q5_0_x8_avx512;
    case QTYPE_Q5_1_X8: return dot8_q5_1_x8_avx512;
    default: return NULL;
    }
}

#else  /* not x86: never called (the module reports no avx512-vnni level) */
void quantize_act8_avx512(const float *x, int64_t m, act_q8 *out) { quantize_act8_scalar(x, m, out); }
dot8_rows_fn dot8_rows_x8_avx512(int qtype) { return dot8_rows_x8_scalar(qtype); }
#endif
