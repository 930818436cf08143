/* GGUF block formats (the same bytes as llama.cpp's ggml) and the 16-bit activation blocks. */
#ifndef PIE_QUANT_FORMATS_H
#define PIE_QUANT_FORMATS_H

#include <stdint.h>
#include <string.h>

/* GGML type ids, as stored in a GGUF file */
enum { QTYPE_Q4_0 = 2, QTYPE_Q4_1 = 3, QTYPE_Q5_0 = 6, QTYPE_Q5_1 = 7, QTYPE_Q8_0 = 8,
       QTYPE_Q4_K = 12, QTYPE_Q5_K = 13, QTYPE_Q6_K = 14 };

/* Not GGML types: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrices whose rows are interleaved 8 at a
 * time (interleaved.c), made at load for the SIMD kernels, the same bytes per row as their source
 * type. A tile is 8 rows x one block of 32 values: d[8] (Q4_1 / Q5_1: then m[8]) as fp16, then the
 * quants. Q4: qs[128] as 4 chunks of 16 uint16 lanes: nibble v of lane 2 j + e of chunk c is row
 * j's value k = 8 c + 2 v + e, so a shift and a mask give the 16 int16 (row, k) of a pair of
 * values of the 8 rows. Q5_0 / Q5_1: the low nibbles as Q4's qs[128], then the high bits qh[32]
 * as 16 uint16 lanes: bit 8 (v / 2) + 2 c + v % 2 of lane 2 j + e is bit 4 of the same value
 * (row j's 32-bit mask, in the order that one shift per nibble, or per byte set of the 8-bit
 * kernels, brings to bit 4). Q8_0: qs[256] int8, byte 16 p + 2 j + e is row j's value
 * k = 2 p + e. */
enum { QTYPE_Q4_0_X8 = 256, QTYPE_Q4_1_X8 = 257, QTYPE_Q8_0_X8 = 258, QTYPE_Q5_0_X8 = 259,
       QTYPE_Q5_1_X8 = 260 };
#define X5_HIGH_AT (16 + 128)   /* a Q5_0 tile's qh: after d[8] and the low nibbles */
#define X5_1_HIGH_AT (32 + 128) /* a Q5_1 tile's qh: after d[8], m[8] and the low nibbles */
#define X8_ROWS 8

#define QK 32        /* values per Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block, and activation block */
#define QK_K 256     /* values per K-quant super-block */

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;             /* 18 bytes */
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;          /* 20 bytes */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0; /* 22 bytes */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1; /* 24 bytes */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;                  /* 34 bytes */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_k; /* 144 */
/* Q5_K: Q4_K's scales and minimums, then value l of sub-block s has its bit 4 at bit s of qh[l] */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2];
               } block_q5_k;                                               /* 176 bytes */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16];
                 uint16_t d; } block_q6_k;                                 /* 210 bytes */

/* One matrix of activation rows quantized to 16 bits per block of 32 (d = max |x| / 32767, a
 * relative rounding of ~1e-5: the products match float32 to its own rounding, unlike 8 bits):
 * x[r, b*32 + i] ~= d[r, b] * qs[r, b*32 + i]; s[r, b] = d[r, b] * sum_i qs[r, b*32 + i]. */
typedef struct {
    int16_t *qs;     /* [m, k] */
    float *d;        /* [m, k / 32] */
    float *s;        /* [m, k / 32] */
    int64_t k;
} act_q16;

#define ACT_MAX 32767.0f

/* The same rows quantized to 8 bits per block of 32 (d = max |x| / 127), for the AVX512-VNNI
 * vpdpbusd kernels of the _X8 types (interleaved_act8*.c), in the order and sign their weights
 * want (act8_layout): ACT8_Q4 (Q4_0 / Q4_1 / Q5_0 / Q5_1 weights, unsigned 4 or 5 bits): int8
 * quants, each run of 8 values stored as values 0 4 1 5 2 6 3 7 (the order a tile's 32-bit
 * lane holds its nibbles, low then high); ACT8_Q8 (Q8_0 weights, signed): the quants + 128 as
 * uint8, in value order.
 * x[r, b*32 + i] ~= d[r, b] * q[r, b*32 + i]; s[r, b] = d[r, b] * sum_i q[r, b*32 + i]. */
enum { ACT8_Q4 = 0, ACT8_Q8 = 1 };
typedef struct {
    uint8_t *qs;     /* [m, k] */
    float *d;        /* [m, k / 32] */
    float *s;        /* [m, k / 32] */
    int64_t k;
    int layout;      /* ACT8_Q4 or ACT8_Q8 */
} act_q8;

#define ACT8_MAX 127.0f
#define ACT8_Q8_OFFSET 128

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {                                   /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float32 -> IEEE float16, rounded to nearest even (as F16C and torch round): overflow to inf,
 * NaN kept NaN, subnormal halves for magnitudes below 2^-14 */
static inline uint16_t fp32_to_fp16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00);            /* NaN */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);           /* >= 65520: inf */
    if (magnitude < 0x38800000u) {                                           /* below 2^-14 */
        float scaled;
        memcpy(&scaled, &magnitude, sizeof scaled);
        scaled *= 16777216.0f;                    /* in units of 2^-24, exact (a power of two) */
        uint32_t units = (uint32_t)scaled, rest_up = scaled - (float)units > 0.5f;
        if (scaled - (float)units == 0.5f) rest_up = units & 1;               /* ties to even */
        return (uint16_t)(sign | (units + rest_up));
    }
    uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1);         /* ties to even */
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

/* Q4_K's (and Q5_K's) 6-bit scale and minimum of sub-block j (0..7) */
static inline void q4k_scale_min(int j, const uint8_t *q, uint8_t *scale, uint8_t *minimum) {
    if (j < 4) {
        *scale = q[j] & 63;
        *minimum = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *minimum = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q6_K value i (0..255) of one super-block, in -32..31 */
static inline int q6k_value(const block_q6_k *block, int i) {
    int half = i / 128, l = i % 32, quarter = (i % 128) / 32;
    const uint8_t *ql = block->ql + half * 64, *qh = block->qh + half * 32;
    int low = quarter % 2 ? ql[l + 32] : ql[l];
    low = quarter < 2 ? low & 0xF : low >> 4;
    int high = (qh[l] >> (2 * quarter)) & 3;
    return (low | (high << 4)) - 32;
}

/* Q5_K value i (0..255) of one super-block, in 0..31 (w = d sc q - dmin m of its sub-block) */
static inline int q5k_value(const block_q5_k *block, int i) {
    int sub = i / QK, l = i % QK;
    int low = (block->qs[(sub / 2) * QK + l] >> (4 * (sub % 2))) & 0xF;
    return low | ((block->qh[l] >> sub) & 1) << 4;
}

/* bytes per row of k values, 0 for an unknown type or a k that is not whole blocks */
static inline int64_t qtype_row_bytes(int qtype, int64_t k) {
    switch (qtype) {
    case QTYPE_Q4_0: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q4_0);
    case QTYPE_Q4_1: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q4_1);
    case QTYPE_Q4_0_X8: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q4_0);
    case QTYPE_Q4_1_X8: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q4_1);
    case QTYPE_Q5_0: case QTYPE_Q5_0_X8: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q5_0);
    case QTYPE_Q5_1: case QTYPE_Q5_1_X8: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q5_1);
    case QTYPE_Q8_0_X8: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q8_0);
    case QTYPE_Q8_0: return k % QK ? 0 : k / QK * (int64_t)sizeof(block_q8_0);
    case QTYPE_Q4_K: return k % QK_K ? 0 : k / QK_K * (int64_t)sizeof(block_q4_k);
    case QTYPE_Q5_K: return k % QK_K ? 0 : k / QK_K * (int64_t)sizeof(block_q5_k);
    case QTYPE_Q6_K: return k % QK_K ? 0 : k / QK_K * (int64_t)sizeof(block_q6_k);
    default: return 0;
    }
}

/* The SIMD kernels stream their weights once per pass, each row group or row in address order.
 * One thread's hardware prefetcher does not run far enough ahead to overlap the stream with the
 * arithmetic, so each step asks for the bytes PREFETCH_BYTES ahead of what it reads: at least
 * DRAM latency x one thread's read rate, with room for a loaded machine's longer latency (the
 * distances measured: docs/performance/2026-11-29-avx512-decode.md). A hint only: past the end
 * of the weight it reads nothing and cannot fault. */
#define PREFETCH_BYTES 4096
#define CACHE_LINE_BYTES 64
static inline void prefetch_ahead(const uint8_t *next, int64_t num_bytes) {
    for (int64_t line = 0; line < num_bytes; line += CACHE_LINE_BYTES)
        __builtin_prefetch(next + PREFETCH_BYTES + line, 0, 3);
}

/* A kernel: y[r * ldy + j] = dot(row j of w, activation row r) for j in [0, num_rows), r < m */
typedef void (*dot_rows_fn)(const uint8_t *w, int64_t row_bytes, int64_t num_rows,
                            const act_q16 *x, int64_t m, float *y, int64_t ldy);

/* scalar kernels (every CPU) */
void quantize_act_scalar(const float *x, int64_t m, act_q16 *out);
dot_rows_fn dot_rows_scalar(int qtype);
void dequantize_rows(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out);

/* interleaved.c: src rows of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (num_rows a multiple of 8) -> the _X8
 * layout in dst (as many bytes), groups shared over num_threads threads; 0, or -1 for another
 * type or row count. Scalar kernels and dequantization of the _X8 types (dot_rows_scalar /
 * dequantize_rows dispatch to them). */
int interleave_rows(int qtype, const uint8_t *src, int64_t num_rows, int64_t k, uint8_t *dst,
                    int num_threads);
dot_rows_fn dot_rows_x8_scalar(int qtype);
void dequantize_x8(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out);

/* AVX2 + FMA + F16C kernels (x86-64 only; call only when the CPU has them) */
void quantize_act_avx2(const float *x, int64_t m, act_q16 *out);
dot_rows_fn dot_rows_avx2(int qtype);
dot_rows_fn dot_rows_x8_avx2(int qtype);      /* interleaved_avx2.c */

/* AVX-512 F/BW/VL/DQ + AVX512-VNNI kernels of every type, _X8 ones included (kernels_avx512.c;
 * call only when matmul.h's level_supported(LEVEL_AVX512)) */
dot_rows_fn dot_rows_avx512(int qtype);
/* interleaved_avx512.c: the _X8 types' kernels (NULL for another type), and dequantize_x8's
 * values for an _X8 type (0), -1 (nothing written) for any other type */
dot_rows_fn dot_rows_x8_avx512(int qtype);
int dequantize_x8_avx512(int qtype, const uint8_t *w, int64_t num_rows, int64_t k, float *out);

/* 8-bit activation kernels of the _X8 types and Q4_K / Q5_K / Q6_K: y[r * ldy + j] = dot(row j
 * of w, activation row r), j < num_rows (_X8: whole 8-row groups), r < m; x in act8_layout(qtype)'s
 * layout */
typedef void (*dot8_rows_fn)(const uint8_t *w, int64_t row_bytes, int64_t num_rows,
                             const act_q8 *x, int64_t m, float *y, int64_t ldy);
/* the layout a type's 8-bit kernels read: the _X8 types' and the row-major K-quants' (both
 * ACT8_Q8: the weight quants are the signed operand of vpdpbusd); -1 for any other type */
static inline int act8_layout(int qtype) {
    return qtype == QTYPE_Q8_0_X8 || qtype == QTYPE_Q4_K || qtype == QTYPE_Q5_K
           || qtype == QTYPE_Q6_K ? ACT8_Q8
           : qtype == QTYPE_Q4_0_X8 || qtype == QTYPE_Q4_1_X8 || qtype == QTYPE_Q5_0_X8
             || qtype == QTYPE_Q5_1_X8 ? ACT8_Q4
           : -1;
}
/* interleaved.c: row j's scale d, offset m (w = d q + m) and 32 quants in one _X8 tile */
void x8_unpack(int qtype, const uint8_t *tile, int j, float *d, float *m, int q[QK]);
/* interleaved_act8.c: the portable 8-bit quantizer (out->layout chosen by the caller) and the
 * reference kernels (NULL for a type that is not _X8); interleaved_act8_avx512.c: the same
 * quants and, bit for bit, the same products with vpdpbusd (call only at LEVEL_AVX512) */
void quantize_act8_scalar(const float *x, int64_t m, act_q8 *out);
dot8_rows_fn dot8_rows_x8_scalar(int qtype);
void quantize_act8_avx512(const float *x, int64_t m, act_q8 *out);
dot8_rows_fn dot8_rows_x8_avx512(int qtype);
/* kquant_act8.c: the reference 8-bit kernels of the row-major Q4_K / Q5_K / Q6_K (NULL for
 * another type), rows [0, num_rows) of GGUF's own bytes; kquant_act8_avx512.c: the same, bit for
 * bit, with vpdpbusd (call only at LEVEL_AVX512) */
dot8_rows_fn dot8_rows_k_scalar(int qtype);
dot8_rows_fn dot8_rows_k_avx512(int qtype);

#endif
