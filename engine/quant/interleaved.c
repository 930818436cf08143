/* Q4_0 / Q4_1 rows interleaved 8 at a time (the _X8 types of formats.h): the repacking done at
 * load, and the portable kernel and dequantization of that layout (the reference the AVX2 kernel
 * in interleaved_avx2.c is tested against). The AVX2 kernel multiplies one unpacked vector of
 * 8 rows x 2 values by a broadcast pair of activations, so the per-block scale work is shared
 * by 8 output rows instead of done per row. */
#include "formats.h"

static int64_t tile_bytes(int is_q4_1) { return X8_ROWS * (is_q4_1 ? 20 : 18); }

/* byte and shift holding value k (0..31) of row j in a tile's qs: value pair p = k / 2 of the
 * 8 rows is nibble p % 4 of the 16 uint16 lanes of 32-byte chunk p / 4, lane 2 j + k % 2 */
static inline void x8_position(int j, int k, int *byte, int *shift) {
    int pair = k / 2, nibble = pair % 4, lane = 2 * j + k % 2;
    *byte = 32 * (pair / 4) + 2 * lane + nibble / 2;
    *shift = 4 * (nibble % 2);
}

int interleave_rows(int qtype, const uint8_t *src, int64_t num_rows, int64_t k, uint8_t *dst) {
    if ((qtype != QTYPE_Q4_0 && qtype != QTYPE_Q4_1) || num_rows % X8_ROWS || k % QK) return -1;
    int is_q4_1 = qtype == QTYPE_Q4_1;
    int64_t num_blocks = k / QK, block_bytes = is_q4_1 ? 20 : 18, row_bytes = num_blocks * block_bytes;
    int64_t scales_bytes = is_q4_1 ? 32 : 16;
    for (int64_t group = 0; group < num_rows / X8_ROWS; group++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            uint8_t *tile = dst + (group * num_blocks + b) * tile_bytes(is_q4_1);
            uint8_t *qs = tile + scales_bytes;
            memset(qs, 0, 128);
            for (int j = 0; j < X8_ROWS; j++) {
                const uint8_t *block = src + (group * X8_ROWS + j) * row_bytes + b * block_bytes;
                memcpy(tile + 2 * j, block, 2);                               /* d */
                if (is_q4_1) memcpy(tile + 16 + 2 * j, block + 2, 2);         /* m */
                const uint8_t *nibbles = block + block_bytes - QK / 2;
                for (int i = 0; i < QK; i++) {
                    int value = i < 16 ? nibbles[i] & 0xF : nibbles[i - 16] >> 4, byte, shift;
                    x8_position(j, i, &byte, &shift);
                    qs[byte] |= (uint8_t)(value << shift);
                }
            }
        }
    }
    return 0;
}

/* row j's scale d and offset m (w = d q + m) and its 32 quants in one tile */
static void x8_unpack(const uint8_t *tile, int is_q4_1, int j, float *d, float *m, int q[QK]) {
    uint16_t h;
    memcpy(&h, tile + 2 * j, 2);
    *d = fp16_to_fp32(h);
    if (is_q4_1) {
        memcpy(&h, tile + 16 + 2 * j, 2);
        *m = fp16_to_fp32(h);
    } else {
        *m = -8.0f * *d;
    }
    const uint8_t *qs = tile + (is_q4_1 ? 32 : 16);
    for (int i = 0; i < QK; i++) {
        int byte, shift;
        x8_position(j, i, &byte, &shift);
        q[i] = (qs[byte] >> shift) & 0xF;
    }
}

void dequantize_x8(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out) {
    int is_q4_1 = qtype == QTYPE_Q4_1_X8;
    int64_t num_blocks = k / QK;
    for (int64_t row = 0; row < num_rows; row++) {
        const uint8_t *group = w + (row / X8_ROWS) * num_blocks * tile_bytes(is_q4_1);
        for (int64_t b = 0; b < num_blocks; b++) {
            float d, m;
            int q[QK];
            x8_unpack(group + b * tile_bytes(is_q4_1), is_q4_1, (int)(row % X8_ROWS), &d, &m, q);
            for (int i = 0; i < QK; i++) out[row * k + b * QK + i] = q[i] * d + m;
        }
    }
}

/* rows [0, num_rows) of w (num_rows and w's first row a multiple of 8 rows in) */
static void dot_x8(int is_q4_1, const uint8_t *w, int64_t num_rows, const act_q16 *x, int64_t m,
                   float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t row = 0; row < num_rows; row++) {
        const uint8_t *group = w + (row / X8_ROWS) * num_blocks * tile_bytes(is_q4_1);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                float d, low;
                int q[QK], dot = 0;
                x8_unpack(group + b * tile_bytes(is_q4_1), is_q4_1, (int)(row % X8_ROWS), &d, &low, q);
                const int16_t *xq = x->qs + r * x->k + b * QK;
                for (int i = 0; i < QK; i++) dot += q[i] * xq[i];
                acc += d * x->d[r * num_blocks + b] * (float)dot + low * x->s[r * num_blocks + b];
            }
            y[r * ldy + row] = acc;
        }
    }
}

static void dot_q4_0_x8(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                        int64_t m, float *y, int64_t ldy) {
    dot_x8(0, w, num_rows, x, m, y, ldy);
}

static void dot_q4_1_x8(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,
                        int64_t m, float *y, int64_t ldy) {
    dot_x8(1, w, num_rows, x, m, y, ldy);
}

dot_rows_fn dot_rows_x8_scalar(int qtype) {
    return qtype == QTYPE_Q4_0_X8 ? dot_q4_0_x8 : qtype == QTYPE_Q4_1_X8 ? dot_q4_1_x8 : NULL;
}
