/* y = x @ W^T from GGUF blocks on the thread pool (matmul.c): the one place a matmul is run, for
 * the Python-facing call (module.c) and the fused decode step (decoder.c). */
#ifndef PIE_QUANT_MATMUL_H
#define PIE_QUANT_MATMUL_H

#include "formats.h"

/* Kernel levels, slowest first (module.c names them): AVX2 + FMA + F16C; AVX-512 F/BW/VL/DQ +
 * AVX512-VNNI (kernels_avx512.c, the AVX2 activation quantizer and decode attention) */
enum { LEVEL_SCALAR = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2, NUM_LEVELS = 3 };

/* What the CPU reports (CPUID) and what the OS saves on a context switch (XGETBV): the AVX-512
 * level needs both, so a CPU with AVX-512 under an OS (or hypervisor) that does not save the
 * zmm / opmask state runs the AVX2 level. Every field 0 off x86. */
typedef struct {
    int avx2;            /* AVX2 + FMA + F16C, and the OS saves the ymm state */
    int avx512;          /* AVX-512 F, BW, VL and DQ (CPUID only) */
    int avx512_vnni;     /* AVX512-VNNI (CPUID only) */
    int avx512_bf16;     /* AVX512-BF16 (CPUID only; no kernel uses it) */
    int amx;             /* AMX tiles (CPUID only; no kernel uses them) */
    int os_zmm;          /* XCR0 has the opmask, ZMM_Hi256 and Hi16_ZMM states */
} cpu_features;

cpu_features detect_cpu(void);

/* 1 when this CPU runs kernels of `level`; 0 for any other value too */
int level_supported(int level);

/* Activation blocks for up to m rows of k values (k a multiple of 32); 0 on success, -1 when out
 * of memory (nothing to free then). */
int act_alloc(act_q16 *act, int64_t m, int64_t k);
void act_free(act_q16 *act);

/* act = the 16-bit blocks of x [m, act->k] float32 */
void quantize_act(int level, const float *x, int64_t m, act_q16 *act);
/* the same, rows shared over up to num_threads threads when there are many */
void quantize_act_rows(int level, const float *x, int64_t m, act_q16 *act, int num_threads);

/* y[r * ldy + j] = dot(row j of w, activation row r), j < n, r < m, rows shared out over
 * num_threads threads. w: n rows of qtype (row_bytes each); level supported, qtype known.
 * (An AVX-512 kernel of an _X8 type takes 16 rows at a time: chunks are multiples of 16.) */
void matmul_rows(int qtype, int level, const uint8_t *w, int64_t n, const act_q16 *x, int64_t m,
                 float *y, int64_t ldy, int num_threads);

/* 8-bit activations (formats.h act_q8) for the _X8 types and Q4_K / Q6_K, at LEVEL_AVX512 (vpdpbusd) and
 * LEVEL_SCALAR (the reference): act8_supported says whether (qtype, level) has them. */
int act8_supported(int qtype, int level);
/* act_alloc's contract for act_q8 blocks of `layout` */
int act8_alloc(act_q8 *act, int64_t m, int64_t k, int layout);
void act8_free(act_q8 *act);
/* act = the 8-bit blocks of x [m, act->k] in act->layout, rows shared over up to num_threads
 * threads when there are many; level LEVEL_AVX512 or LEVEL_SCALAR (the same quants) */
void quantize_act8_rows(int level, const float *x, int64_t m, act_q8 *act, int num_threads);
/* matmul_rows with 8-bit activations: act8_supported(qtype, level) and x->layout ==
 * act8_layout(qtype) hold */
void matmul8_rows(int qtype, int level, const uint8_t *w, int64_t n, const act_q8 *x, int64_t m,
                  float *y, int64_t ldy, int num_threads);

#endif
