/* 8-bit activations for the interleaved (_X8) layout: the portable quantizer and the reference
 * kernels that the AVX512-VNNI ones (interleaved_act8_avx512.c) must equal bit for bit. Per
 * block of 32, the integer dot product of the weight quants and the activation quants is exact;
 * the float steps are the vector kernels' own, in their order, with fused multiply-adds:
 * acc = fma(dot, d_w d_x, acc), then for Q4 / Q5 acc = fma(low_w, s_x, acc) (low_w: Q4_1's and
 * Q5_1's m, Q4_0's -8 d_w, Q5_0's -16 d_w). */
#include <math.h>

#include "formats.h"

/* position in an 8-value run of the ACT8_Q4 layout where value i (0..7) is stored */
static const int Q4_POSITION[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* the stored byte of value i (0..31) of an activation block, in `layout` */
static inline int act8_position(int layout, int i) {
    return layout == ACT8_Q4 ? (i & ~7) + Q4_POSITION[i & 7] : i;
}

void quantize_act8_scalar(const float *x, int64_t m, act_q8 *out) {
    int64_t k = out->k, num_blocks = k / QK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *v = x + r * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / ACT8_MAX, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            uint8_t *q = out->qs + r * k + b * QK;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                int value = (int)nearbyintf(fminf(fmaxf(v[i] * inverse, -ACT8_MAX), ACT8_MAX));
                sum += value;
                q[act8_position(out->layout, i)] =
                    (uint8_t)(out->layout == ACT8_Q8 ? value + ACT8_Q8_OFFSET : value);
            }
            out->d[r * num_blocks + b] = d;
            out->s[r * num_blocks + b] = d * (float)sum;
        }
    }
}

/* activation quant i (0..31) of row r, block b, as a signed value */
static inline int act8_value(const act_q8 *x, int64_t r, int64_t b, int i) {
    uint8_t stored = x->qs[r * x->k + b * QK + act8_position(x->layout, i)];
    return x->layout == ACT8_Q8 ? (int)stored - ACT8_Q8_OFFSET : (int)(int8_t)stored;
}

/* rows [0, num_rows) of w (w's first row the first of a group) */
static void dot8_x8(int qtype, const uint8_t *w, int64_t row_bytes, int64_t num_rows,
                    const act_q8 *x, int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, tile_bytes = X8_ROWS * row_bytes / num_blocks;
    for (int64_t row = 0; row < num_rows; row++) {
        const uint8_t *group = w + row / X8_ROWS * X8_ROWS * row_bytes;
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                float d, low;
                int q[QK], dot = 0;
                x8_unpack(qtype, group + b * tile_bytes, (int)(row % X8_ROWS), &d, &low, q);
                for (int i = 0; i < QK; i++) dot += q[i] * act8_value(x, r, b, i);
                int64_t i = r * num_blocks + b;
                acc = fmaf((float)dot, d * x->d[i], acc);
                if (qtype != QTYPE_Q8_0_X8) acc = fmaf(low, x->s[i], acc);
            }
            y[r * ldy + row] = acc;
        }
    }
}

#define X8_SCALAR8(name, qtype)                                                                \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q8 *x,   \
                     int64_t m, float *y, int64_t ldy) {                                       \
        dot8_x8(qtype, w, row_bytes, num_rows, x, m, y, ldy);                                  \
    }
X8_SCALAR8(dot8_q4_0_x8, QTYPE_Q4_0_X8)
X8_SCALAR8(dot8_q4_1_x8, QTYPE_Q4_1_X8)
X8_SCALAR8(dot8_q8_0_x8, QTYPE_Q8_0_X8)
X8_SCALAR8(dot8_q5_0_x8, QTYPE_Q5_0_X8)
X8_SCALAR8(dot8_q5_1_x8, QTYPE_Q5_1_X8)

dot8_rows_fn dot8_rows_x8_scalar(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0_X8: return dot8_q4_0_x8;
    case QTYPE_Q4_1_X8: return dot8_q4_1_x8;
    case QTYPE_Q8_0_X8: return dot8_q8_0_x8;
    case QTYPE_Q5_0_X8: return dot8_q5_0_x8;
    case QTYPE_Q5_1_X8: return dot8_q5_1_x8;
    default: return NULL;
    }
}
