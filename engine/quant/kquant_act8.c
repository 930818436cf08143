/* 8-bit activations for the row-major K-quant types Q4_K, Q5_K and Q6_K: the reference kernels
 * that the AVX512-VNNI ones (kquant_act8_avx512.c) must equal bit for bit. The activations are act_q8 in
 * the ACT8_Q8 layout (value order, quant + 128 as uint8), the weights GGUF's own bytes.
 *
 * The vector kernels keep 16 int32 lanes per span of 64 values of a super-block (lane l: the 4
 * values 4 l .. 4 l + 3 of the span), so no integer sum is reduced across lanes; each lane's
 * exact integer dot is scaled by its lane's weight scale times its block's activation scale and
 * added into that lane's float sum with a fused multiply-add, span after span. This file does
 * the same lanes in the same order:
 *   Q4_K / Q5_K: lane scale (d sc[s]) d_x[b] of sub-block s = b's 32 values; the minimums' term
 *         fma((-dmin) m[s], s_x[b], low[s]) per sub-block, added into lanes 0-7 at the end;
 *   Q6_K: lane scale (d sc[t]) d_x[b] of the 16 values of scale t, value q - 32 (the offset
 *         inside the integer dot);
 * then the 16 lanes are summed as a tree (lanes l and l + 8, then l + 4, l + 2, l + 1). */
#include <math.h>

#include "formats.h"

#define SPAN 64                       /* values per vector of weight quants */
#define LANES 16                      /* int32 / float32 lanes per span */
#define LANE_VALUES (SPAN / LANES)    /* 4: one vpdpbusd lane */

/* activation quant i (0..k-1) of row r, signed (the ACT8_Q8 layout stores it + 128) */
static inline int act8_q8_value(const act_q8 *x, int64_t r, int64_t i) {
    return (int)x->qs[r * x->k + i] - ACT8_Q8_OFFSET;
}

/* whether a type has Q4_K's scales and minimums per sub-block of 32 (Q4_K, Q5_K) */
static inline int has_minimums(int qtype) { return qtype == QTYPE_Q4_K || qtype == QTYPE_Q5_K; }

/* one super-block's 256 weight quants (Q4_K 0..15, Q5_K 0..31, Q6_K -32..31), its per-lane-group
 * scales (Q4_K / Q5_K: d sc[s] per 32 values; Q6_K: d sc[t] per 16) and Q4_K / Q5_K's
 * (-dmin) m[s] */
static void unpack_super(int qtype, const uint8_t *super, int w[QK_K], float scales[QK_K / 16],
                         float minimums[QK_K / QK]) {
    if (has_minimums(qtype)) {
        const block_q4_k *block = (const block_q4_k *)super;     /* Q5_K's first fields too */
        float d = fp16_to_fp32(block->d), negative_dmin = -fp16_to_fp32(block->dmin);
        for (int s = 0; s < QK_K / QK; s++) {
            uint8_t scale, minimum;
            q4k_scale_min(s, block->scales, &scale, &minimum);
            scales[s] = d * (float)scale;
            minimums[s] = negative_dmin * (float)minimum;
            const uint8_t *qs = block->qs + (s / 2) * QK;
            for (int i = 0; i < QK; i++)
                w[s * QK + i] = qtype == QTYPE_Q5_K
                                    ? q5k_value((const block_q5_k *)super, s * QK + i)
                                    : (qs[i] >> (4 * (s % 2))) & 0xF;
        }
    } else {
        const block_q6_k *block = (const block_q6_k *)super;
        float d = fp16_to_fp32(block->d);
        for (int t = 0; t < QK_K / 16; t++) scales[t] = d * (float)block->scales[t];
        for (int i = 0; i < QK_K; i++) w[i] = q6k_value(block, i);
    }
}

/* the lanes' tree sum (the vector kernels' final reduction) */
static float lanes_sum(const float lanes[LANES]) {
    float half[8], quarter[4], eighth[2];
    for (int l = 0; l < 8; l++) half[l] = lanes[l] + lanes[l + 8];
    for (int l = 0; l < 4; l++) quarter[l] = half[l] + half[l + 4];
    for (int l = 0; l < 2; l++) eighth[l] = quarter[l] + quarter[l + 2];
    return eighth[0] + eighth[1];
}

/* dot(row of w, activation row r) */
static float dot8_k_row(int qtype, const uint8_t *row, int64_t super_bytes, const act_q8 *x,
                        int64_t r) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    int per_scale = has_minimums(qtype) ? QK : 16;
    float acc[LANES] = {0}, low[QK_K / QK] = {0};
    for (int64_t sb = 0; sb < num_super; sb++) {
        int w[QK_K];
        float scales[QK_K / 16], minimums[QK_K / QK];
        unpack_super(qtype, row + sb * super_bytes, w, scales, minimums);
        const float *dx = x->d + r * num_blocks + sb * (QK_K / QK);
        const float *sx = x->s + r * num_blocks + sb * (QK_K / QK);
        if (has_minimums(qtype))
            for (int s = 0; s < QK_K / QK; s++) low[s] = fmaf(minimums[s], sx[s], low[s]);
        for (int span = 0; span < QK_K / SPAN; span++) {
            for (int l = 0; l < LANES; l++) {
                int first = span * SPAN + l * LANE_VALUES, dot = 0;
                for (int i = first; i < first + LANE_VALUES; i++)
                    dot += w[i] * act8_q8_value(x, r, sb * QK_K + i);
                float scale = scales[first / per_scale] * dx[first / QK];
                acc[l] = fmaf((float)dot, scale, acc[l]);
            }
        }
    }
    if (has_minimums(qtype))
        for (int l = 0; l < LANES; l++) acc[l] = acc[l] + (l < QK_K / QK ? low[l] : 0.0f);
    return lanes_sum(acc);
}

static void dot8_k(int qtype, const uint8_t *w, int64_t row_bytes, int64_t num_rows,
                   const act_q8 *x, int64_t m, float *y, int64_t ldy) {
    int64_t super_bytes = qtype_row_bytes(qtype, QK_K);
    for (int64_t j = 0; j < num_rows; j++)
        for (int64_t r = 0; r < m; r++)
            y[r * ldy + j] = dot8_k_row(qtype, w + j * row_bytes, super_bytes, x, r);
}

static void dot8_q4_k(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q8 *x,
                      int64_t m, float *y, int64_t ldy) {
    dot8_k(QTYPE_Q4_K, w, row_bytes, num_rows, x, m, y, ldy);
}

static void dot8_q5_k(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q8 *x,
                      int64_t m, float *y, int64_t ldy) {
    dot8_k(QTYPE_Q5_K, w, row_bytes, num_rows, x, m, y, ldy);
}

static void dot8_q6_k(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q8 *x,
                      int64_t m, float *y, int64_t ldy) {
    dot8_k(QTYPE_Q6_K, w, row_bytes, num_rows, x, m, y, ldy);
}

dot8_rows_fn dot8_rows_k_scalar(int qtype) {
    return qtype == QTYPE_Q4_K ? dot8_q4_k : qtype == QTYPE_Q5_K ? dot8_q5_k
           : qtype == QTYPE_Q6_K ? dot8_q6_k : NULL;
}
