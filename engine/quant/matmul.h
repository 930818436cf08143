/* y = x @ W^T from GGUF blocks on the thread pool (matmul.c): the one place a matmul is run, for
 * the Python-facing call (module.c) and the fused decode step (decoder.c). */
#ifndef PIE_QUANT_MATMUL_H
#define PIE_QUANT_MATMUL_H

#include "formats.h"

enum { LEVEL_SCALAR = 0, LEVEL_AVX2 = 1 };

/* 1 when this CPU runs kernels of `level`; 0 for any other value too */
int level_supported(int level);

/* Activation blocks for up to m rows of k values (k a multiple of 32); 0 on success, -1 when out
 * of memory (nothing to free then). */
int act_alloc(act_q16 *act, int64_t m, int64_t k);
void act_free(act_q16 *act);

/* act = the 16-bit blocks of x [m, act->k] float32 */
void quantize_act(int level, const float *x, int64_t m, act_q16 *act);

/* y[r * ldy + j] = dot(row j of w, activation row r), j < n, r < m, rows shared out over
 * num_threads threads. w: n rows of qtype (row_bytes each); level supported, qtype known. */
void matmul_rows(int qtype, int level, const uint8_t *w, int64_t n, const act_q16 *x, int64_t m,
                 float *y, int64_t ldy, int num_threads);

#endif
