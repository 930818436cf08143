/* Portable kernels: correct on every CPU, and the reference the SIMD kernels are tested against.
 * Every dot product is an integer sum per block of 32 (or 16) of weight quants times 16-bit
 * activation quants, times float scales: the same arithmetic as the SIMD kernels up to the order
 * of float additions. */
#include <math.h>

#include "formats.h"

void quantize_act_scalar(const float *x, int64_t m, act_q16 *out) {
    int64_t k = out->k, num_blocks = k / QK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const float *v = x + r * k + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / ACT_MAX, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            int16_t *q = out->qs + r * k + b * QK;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                q[i] = (int16_t)nearbyintf(v[i] * inverse);
                sum += q[i];
            }
            out->d[r * num_blocks + b] = d;
            out->s[r * num_blocks + b] = d * (float)sum;
        }
    }
}

/* sum over one block of 32 of unsigned 4-bit weights (low nibbles then high) times x */
static inline int dot_nibbles(const uint8_t *qs, const int16_t *x) {
    int sum = 0;
    for (int i = 0; i < QK / 2; i++)
        sum += (qs[i] & 0xF) * x[i] + (qs[i] >> 4) * x[i + QK / 2];
    return sum;
}

static void dot_q4_0(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q4_0 *blocks = (const block_q4_0 *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                float d = fp16_to_fp32(blocks[b].d);
                int dot = dot_nibbles(blocks[b].qs, x->qs + r * x->k + b * QK);
                acc += d * x->d[r * num_blocks + b] * (float)dot - 8.0f * d * x->s[r * num_blocks + b];
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void dot_q4_1(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q4_1 *blocks = (const block_q4_1 *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                int dot = dot_nibbles(blocks[b].qs, x->qs + r * x->k + b * QK);
                acc += fp16_to_fp32(blocks[b].d) * x->d[r * num_blocks + b] * (float)dot
                       + fp16_to_fp32(blocks[b].m) * x->s[r * num_blocks + b];
            }
            y[r * ldy + j] = acc;
        }
    }
}

/* Q5_0 / Q5_1 quant i (0..31) of one block: its nibble of qs and bit i of qh as bit 4
 * (Q5_0: w = d * (q - 16); Q5_1: w = d * q + m) */
static inline int q5_quant(const uint8_t *qs, const uint8_t *qh, int i) {
    int low = i < QK / 2 ? qs[i] & 0xF : qs[i - QK / 2] >> 4;
    return low | ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

static void dot_q5_0(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q5_0 *blocks = (const block_q5_0 *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                float d = fp16_to_fp32(blocks[b].d);
                const int16_t *xq = x->qs + r * x->k + b * QK;
                int dot = 0;
                for (int i = 0; i < QK; i++) dot += q5_quant(blocks[b].qs, blocks[b].qh, i) * xq[i];
                acc += d * x->d[r * num_blocks + b] * (float)dot
                       - 16.0f * d * x->s[r * num_blocks + b];
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void dot_q5_1(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q5_1 *blocks = (const block_q5_1 *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                const int16_t *xq = x->qs + r * x->k + b * QK;
                int dot = 0;
                for (int i = 0; i < QK; i++) dot += q5_quant(blocks[b].qs, blocks[b].qh, i) * xq[i];
                acc += fp16_to_fp32(blocks[b].d) * x->d[r * num_blocks + b] * (float)dot
                       + fp16_to_fp32(blocks[b].m) * x->s[r * num_blocks + b];
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void dot_q8_0(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q8_0 *blocks = (const block_q8_0 *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                const int16_t *xq = x->qs + r * x->k + b * QK;
                int dot = 0;
                for (int i = 0; i < QK; i++) dot += blocks[b].qs[i] * xq[i];
                acc += fp16_to_fp32(blocks[b].d) * x->d[r * num_blocks + b] * (float)dot;
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void dot_q4_k(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q4_k *blocks = (const block_q4_k *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < num_super; sb++) {
                const block_q4_k *block = blocks + sb;
                float d = fp16_to_fp32(block->d), dmin = fp16_to_fp32(block->dmin);
                for (int sub = 0; sub < 8; sub++) {        /* sub-blocks of 32 */
                    uint8_t scale, minimum;
                    q4k_scale_min(sub, block->scales, &scale, &minimum);
                    const uint8_t *qs = block->qs + (sub / 2) * 32;
                    int shift = (sub % 2) * 4;
                    int64_t b = sb * 8 + sub;
                    const int16_t *xq = x->qs + r * x->k + b * QK;
                    int dot = 0;
                    for (int i = 0; i < QK; i++) dot += ((qs[i] >> shift) & 0xF) * xq[i];
                    acc += d * scale * x->d[r * num_blocks + b] * (float)dot
                           - dmin * minimum * x->s[r * num_blocks + b];
                }
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void dot_q5_k(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q5_k *blocks = (const block_q5_k *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < num_super; sb++) {
                const block_q5_k *block = blocks + sb;
                float d = fp16_to_fp32(block->d), dmin = fp16_to_fp32(block->dmin);
                for (int sub = 0; sub < 8; sub++) {        /* sub-blocks of 32 */
                    uint8_t scale, minimum;
                    q4k_scale_min(sub, block->scales, &scale, &minimum);
                    int64_t b = sb * 8 + sub;
                    const int16_t *xq = x->qs + r * x->k + b * QK;
                    int dot = 0;
                    for (int i = 0; i < QK; i++) dot += q5k_value(block, sub * QK + i) * xq[i];
                    acc += d * scale * x->d[r * num_blocks + b] * (float)dot
                           - dmin * minimum * x->s[r * num_blocks + b];
                }
            }
            y[r * ldy + j] = acc;
        }
    }
}

static void dot_q6_k(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                     int64_t m, float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK, num_super = x->k / QK_K;
    for (int64_t j = 0; j < num_rows; j++) {
        const block_q6_k *blocks = (const block_q6_k *)(w + j * row_bytes);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t sb = 0; sb < num_super; sb++) {
                const block_q6_k *block = blocks + sb;
                float d = fp16_to_fp32(block->d);
                for (int sub = 0; sub < 8; sub++) {        /* activation blocks of 32 */
                    int64_t b = sb * 8 + sub;
                    const int16_t *xq = x->qs + r * x->k + b * QK;
                    for (int half = 0; half < 2; half++) { /* weight scales per 16 */
                        int partial = 0;
                        for (int i = 0; i < 16; i++)
                            partial += q6k_value(block, sub * 32 + half * 16 + i) * xq[half * 16 + i];
                        acc += d * block->scales[sub * 2 + half] * x->d[r * num_blocks + b] * (float)partial;
                    }
                }
            }
            y[r * ldy + j] = acc;
        }
    }
}

dot_rows_fn dot_rows_scalar(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0: return dot_q4_0;
    case QTYPE_Q4_1: return dot_q4_1;
    case QTYPE_Q5_0: return dot_q5_0;
    case QTYPE_Q5_1: return dot_q5_1;
    case QTYPE_Q8_0: return dot_q8_0;
    case QTYPE_Q4_K: return dot_q4_k;
    case QTYPE_Q5_K: return dot_q5_k;
    case QTYPE_Q6_K: return dot_q6_k;
    case QTYPE_Q4_0_X8: case QTYPE_Q4_1_X8: case QTYPE_Q8_0_X8: case QTYPE_Q5_0_X8:
    case QTYPE_Q5_1_X8:
        return dot_rows_x8_scalar(qtype);
    default: return NULL;
    }
}

void dequantize_rows(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out) {
    if (qtype == QTYPE_Q4_0_X8 || qtype == QTYPE_Q4_1_X8 || qtype == QTYPE_Q8_0_X8
            || qtype == QTYPE_Q5_0_X8 || qtype == QTYPE_Q5_1_X8) {
        dequantize_x8(qtype, w, num_rows, k, out);
        return;
    }
    int64_t row_bytes = qtype_row_bytes(qtype, k);
    for (int64_t j = 0; j < num_rows; j++) {
        const uint8_t *row = w + j * row_bytes;
        float *o = out + j * k;
        if (qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1) {
            int64_t block_bytes = qtype == QTYPE_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q4_1);
            for (int64_t b = 0; b < k / QK; b++) {
                const uint8_t *block = row + b * block_bytes;
                uint16_t dh, mh;
                memcpy(&dh, block, 2);
                float d = fp16_to_fp32(dh), low = -8.0f * d;
                if (qtype == QTYPE_Q4_1) { memcpy(&mh, block + 2, 2); low = fp16_to_fp32(mh); }
                const uint8_t *qs = block + block_bytes - QK / 2;
                for (int i = 0; i < QK / 2; i++) {
                    o[b * QK + i] = (qs[i] & 0xF) * d + low;
                    o[b * QK + i + QK / 2] = (qs[i] >> 4) * d + low;
                }
            }
        } else if (qtype == QTYPE_Q5_0) {
            const block_q5_0 *blocks = (const block_q5_0 *)row;
            for (int64_t b = 0; b < k / QK; b++) {
                float d = fp16_to_fp32(blocks[b].d), low = -16.0f * d;
                for (int i = 0; i < QK; i++)
                    o[b * QK + i] = q5_quant(blocks[b].qs, blocks[b].qh, i) * d + low;
            }
        } else if (qtype == QTYPE_Q5_1) {
            const block_q5_1 *blocks = (const block_q5_1 *)row;
            for (int64_t b = 0; b < k / QK; b++) {
                float d = fp16_to_fp32(blocks[b].d), low = fp16_to_fp32(blocks[b].m);
                for (int i = 0; i < QK; i++)
                    o[b * QK + i] = q5_quant(blocks[b].qs, blocks[b].qh, i) * d + low;
            }
        } else if (qtype == QTYPE_Q8_0) {
            const block_q8_0 *blocks = (const block_q8_0 *)row;
            for (int64_t b = 0; b < k / QK; b++) {
                float d = fp16_to_fp32(blocks[b].d);
                for (int i = 0; i < QK; i++) o[b * QK + i] = blocks[b].qs[i] * d;
            }
        } else if (qtype == QTYPE_Q4_K) {
            const block_q4_k *blocks = (const block_q4_k *)row;
            for (int64_t sb = 0; sb < k / QK_K; sb++) {
                float d = fp16_to_fp32(blocks[sb].d), dmin = fp16_to_fp32(blocks[sb].dmin);
                for (int sub = 0; sub < 8; sub++) {
                    uint8_t scale, minimum;
                    q4k_scale_min(sub, blocks[sb].scales, &scale, &minimum);
                    const uint8_t *qs = blocks[sb].qs + (sub / 2) * 32;
                    int shift = (sub % 2) * 4;
                    for (int i = 0; i < QK; i++)
                        o[sb * QK_K + sub * QK + i] = d * scale * ((qs[i] >> shift) & 0xF) - dmin * minimum;
                }
            }
        } else if (qtype == QTYPE_Q5_K) {
            const block_q5_k *blocks = (const block_q5_k *)row;
            for (int64_t sb = 0; sb < k / QK_K; sb++) {
                float d = fp16_to_fp32(blocks[sb].d), dmin = fp16_to_fp32(blocks[sb].dmin);
                for (int sub = 0; sub < 8; sub++) {
                    uint8_t scale, minimum;
                    q4k_scale_min(sub, blocks[sb].scales, &scale, &minimum);
                    for (int i = 0; i < QK; i++)
                        o[sb * QK_K + sub * QK + i] =
                            d * scale * q5k_value(blocks + sb, sub * QK + i) - dmin * minimum;
                }
            }
        } else if (qtype == QTYPE_Q6_K) {
            const block_q6_k *blocks = (const block_q6_k *)row;
            for (int64_t sb = 0; sb < k / QK_K; sb++) {
                float d = fp16_to_fp32(blocks[sb].d);
                for (int i = 0; i < QK_K; i++)
                    o[sb * QK_K + i] = d * blocks[sb].scales[i / 16] * q6k_value(blocks + sb, i);
            }
        }
    }
}
