/* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows interleaved 8 at a time (the _X8 types of formats.h): the
 * repacking done at load, and the portable kernel and dequantization of that layout (the
 * reference the AVX2 kernels in interleaved_avx2.c are tested against). The AVX2 kernels
 * multiply one unpacked vector of 8 rows x 2 values by a broadcast pair of activations, so the
 * per-block scale work is shared by 8 output rows instead of done per row. */
#include "formats.h"
#include "pool.h"

/* the source GGML type of an _X8 type (or of itself) */
static int source_qtype(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0_X8: return QTYPE_Q4_0;
    case QTYPE_Q4_1_X8: return QTYPE_Q4_1;
    case QTYPE_Q8_0_X8: return QTYPE_Q8_0;
    case QTYPE_Q5_0_X8: return QTYPE_Q5_0;
    case QTYPE_Q5_1_X8: return QTYPE_Q5_1;
    default: return qtype;
    }
}

static int64_t block_bytes(int qtype) { return qtype_row_bytes(source_qtype(qtype), QK); }

/* whether a source type stores its own offset m (w = d q + m) */
static int has_offset(int source) { return source == QTYPE_Q4_1 || source == QTYPE_Q5_1; }

/* whether a source type has a fifth (high) bit per quant in qh */
static int has_high_bit(int source) { return source == QTYPE_Q5_0 || source == QTYPE_Q5_1; }

/* bytes before a tile's quants: d[8], and m[8] for Q4_1 / Q5_1 */
static int scales_bytes(int qtype) { return has_offset(source_qtype(qtype)) ? 32 : 16; }

/* offset of a Q5_0 / Q5_1 tile's qh (formats.h) */
static int high_at(int qtype) { return scales_bytes(qtype) + 128; }

/* byte and shift of value k (0..31) of row j in a tile's quants */
static inline void x8_position(int qtype, int j, int k, int *byte, int *shift) {
    if (source_qtype(qtype) == QTYPE_Q8_0) {
        *byte = 16 * (k / 2) + 2 * j + k % 2;
        *shift = 0;
        return;
    }
    int pair = k / 2, nibble = pair % 4, lane = 2 * j + k % 2;
    *byte = 32 * (pair / 4) + 2 * lane + nibble / 2;
    *shift = 4 * (nibble % 2);
}

/* byte and bit of value k (0..31) of row j's high bit in a Q5_0 / Q5_1 tile's qh (formats.h) */
static inline void x5_high_position(int j, int k, int *byte, int *bit) {
    int chunk = k / 8, nibble = (k % 8) / 2, lane = 2 * j + k % 2;
    *byte = 2 * lane + nibble / 2;
    *bit = 2 * chunk + nibble % 2;
}

/* quant i (0..31) of one source block (Q5_0 / Q5_1: its 5 bits, high bit from qh) */
static int source_quant(int qtype, const uint8_t *block, int i) {
    if (qtype == QTYPE_Q8_0) return (int8_t)block[2 + i];
    const uint8_t *nibbles = block + block_bytes(qtype) - QK / 2;
    int low = i < 16 ? nibbles[i] & 0xF : nibbles[i - 16] >> 4;
    const uint8_t *qh = nibbles - 4;
    return has_high_bit(qtype) ? low | ((qh[i / 8] >> (i % 8)) & 1) << 4 : low;
}

typedef struct {
    int qtype;
    const uint8_t *src;
    int64_t num_blocks;
    uint8_t *dst;
} interleave_job;

/* the tiles of 8-row groups [start, start + count) */
static void interleave_groups(void *ctx, int64_t start, int64_t count) {
    const interleave_job *job = ctx;
    int qtype = job->qtype;
    int64_t num_blocks = job->num_blocks, row_bytes = num_blocks * block_bytes(qtype);
    int64_t tile_bytes = X8_ROWS * block_bytes(qtype), quant_bytes = tile_bytes - scales_bytes(qtype);
    for (int64_t group = start; group < start + count; group++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            uint8_t *tile = job->dst + (group * num_blocks + b) * tile_bytes;
            uint8_t *qs = tile + scales_bytes(qtype);
            memset(qs, 0, (size_t)quant_bytes);
            for (int j = 0; j < X8_ROWS; j++) {
                const uint8_t *block = job->src + (group * X8_ROWS + j) * row_bytes
                                       + b * block_bytes(qtype);
                memcpy(tile + 2 * j, block, 2);                               /* d */
                if (has_offset(qtype)) memcpy(tile + 16 + 2 * j, block + 2, 2);     /* m */
                for (int i = 0; i < QK; i++) {
                    int byte, shift, quant = source_quant(qtype, block, i);
                    x8_position(qtype, j, i, &byte, &shift);
                    qs[byte] |= (uint8_t)((has_high_bit(qtype) ? quant & 0xF : quant) << shift);
                    if (has_high_bit(qtype)) {
                        int high_byte, bit;
                        x5_high_position(j, i, &high_byte, &bit);
                        tile[high_at(qtype) + high_byte] |= (uint8_t)((quant >> 4) << bit);
                    }
                }
            }
        }
    }
}

int interleave_rows(int qtype, const uint8_t *src, int64_t num_rows, int64_t k, uint8_t *dst,
                    int num_threads) {
    if ((qtype != QTYPE_Q4_0 && qtype != QTYPE_Q4_1 && qtype != QTYPE_Q5_0 && qtype != QTYPE_Q5_1
         && qtype != QTYPE_Q8_0) || num_rows % X8_ROWS || k % QK)
        return -1;
    interleave_job job = {.qtype = qtype, .src = src, .num_blocks = k / QK, .dst = dst};
    pool_run_rows(interleave_groups, &job, num_rows / X8_ROWS, 1, num_threads);
    return 0;
}

/* row j's scale d and offset m (w = d q + m) in one tile of an _X8 type */
static void x8_scale(int qtype, const uint8_t *tile, int j, float *d, float *m) {
    uint16_t h;
    memcpy(&h, tile + 2 * j, 2);
    *d = fp16_to_fp32(h);
    int source = source_qtype(qtype);
    *m = source == QTYPE_Q4_0 ? -8.0f * *d : source == QTYPE_Q5_0 ? -16.0f * *d : 0.0f;
    if (has_offset(source)) {
        memcpy(&h, tile + 16 + 2 * j, 2);
        *m = fp16_to_fp32(h);
    }
}

/* row j's scale, offset and 32 quants in one tile of an _X8 type */
void x8_unpack(int qtype, const uint8_t *tile, int j, float *d, float *m, int q[QK]) {
    x8_scale(qtype, tile, j, d, m);
    int source = source_qtype(qtype);
    const uint8_t *qs = tile + scales_bytes(qtype);
    for (int i = 0; i < QK; i++) {
        int byte, shift;
        x8_position(qtype, j, i, &byte, &shift);
        q[i] = source == QTYPE_Q8_0 ? (int8_t)qs[byte] : (qs[byte] >> shift) & 0xF;
        if (has_high_bit(source)) {
            x5_high_position(j, i, &byte, &shift);
            q[i] |= ((tile[high_at(qtype) + byte] >> shift) & 1) << 4;
        }
    }
}

/* the tile of block b of the group holding row `row` */
static const uint8_t *x8_tile(int qtype, const uint8_t *w, int64_t num_blocks, int64_t row,
                              int64_t b) {
    return w + ((row / X8_ROWS) * num_blocks + b) * X8_ROWS * block_bytes(qtype);
}

/* out[j][b * 32 + i] for the 8 rows j of one tile (row stride k floats) */
static void dequantize_tile(int qtype, const uint8_t *tile, int64_t b, int64_t k, float *out) {
    float d[X8_ROWS], m[X8_ROWS];
    int source = source_qtype(qtype);
    if (has_high_bit(source)) {
        for (int j = 0; j < X8_ROWS; j++) {
            int q[QK];
            x8_unpack(qtype, tile, j, d + j, m + j, q);
            for (int i = 0; i < QK; i++) out[j * k + b * QK + i] = q[i] * d[j] + m[j];
        }
        return;
    }
    for (int j = 0; j < X8_ROWS; j++) x8_scale(qtype, tile, j, d + j, m + j);
    const uint8_t *qs = tile + scales_bytes(qtype);
    for (int pair = 0; pair < QK / 2; pair++) {
        for (int lane = 0; lane < 2 * X8_ROWS; lane++) {     /* lane 2 j + e: row j, k = 2 pair + e */
            int j = lane / 2, q;
            if (source == QTYPE_Q8_0) {
                q = (int8_t)qs[16 * pair + lane];
            } else {
                const uint8_t *lane_bytes = qs + 32 * (pair / 4) + 2 * lane;
                uint16_t bits = (uint16_t)(lane_bytes[0] | lane_bytes[1] << 8);
                q = (bits >> (4 * (pair % 4))) & 0xF;
            }
            out[j * k + b * QK + 2 * pair + lane % 2] = q * d[j] + m[j];
        }
    }
}

void dequantize_x8(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out) {
    int64_t num_blocks = k / QK;
    for (int64_t group = 0; group < num_rows / X8_ROWS; group++)
        for (int64_t b = 0; b < num_blocks; b++)
            dequantize_tile(qtype, x8_tile(qtype, w, num_blocks, group * X8_ROWS, b), b, k,
                            out + group * X8_ROWS * k);
}

/* rows [0, num_rows) of w (w's first row the first of a group) */
static void dot_x8(int qtype, const uint8_t *w, int64_t num_rows, const act_q16 *x, int64_t m,
                   float *y, int64_t ldy) {
    int64_t num_blocks = x->k / QK;
    for (int64_t row = 0; row < num_rows; row++) {
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < num_blocks; b++) {
                float d, low;
                int q[QK], dot = 0;
                x8_unpack(qtype, x8_tile(qtype, w, num_blocks, row, b), (int)(row % X8_ROWS), &d,
                          &low, q);
                const int16_t *xq = x->qs + r * x->k + b * QK;
                for (int i = 0; i < QK; i++) dot += q[i] * xq[i];
                acc += d * x->d[r * num_blocks + b] * (float)dot + low * x->s[r * num_blocks + b];
            }
            y[r * ldy + row] = acc;
        }
    }
}

#define X8_SCALAR(name, qtype)                                                                 \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t num_rows, const act_q16 *x,  \
                     int64_t m, float *y, int64_t ldy) {                                       \
        dot_x8(qtype, w, num_rows, x, m, y, ldy);                                              \
    }
X8_SCALAR(dot_q4_0_x8, QTYPE_Q4_0_X8)
X8_SCALAR(dot_q4_1_x8, QTYPE_Q4_1_X8)
X8_SCALAR(dot_q8_0_x8, QTYPE_Q8_0_X8)
X8_SCALAR(dot_q5_0_x8, QTYPE_Q5_0_X8)
X8_SCALAR(dot_q5_1_x8, QTYPE_Q5_1_X8)

dot_rows_fn dot_rows_x8_scalar(int qtype) {
    switch (qtype) {
    case QTYPE_Q4_0_X8: return dot_q4_0_x8;
    case QTYPE_Q4_1_X8: return dot_q4_1_x8;
    case QTYPE_Q8_0_X8: return dot_q8_0_x8;
    case QTYPE_Q5_0_X8: return dot_q5_0_x8;
    case QTYPE_Q5_1_X8: return dot_q5_1_x8;
    default: return NULL;
    }
}
