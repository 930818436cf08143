/* Row-wise float32 helpers of the decode step (norm.c). */
#ifndef PIE_QUANT_NORM_H
#define PIE_QUANT_NORM_H

#include <stdint.h>

/* x[r] += delta[r] (when delta is not NULL), then out[r] = rms_norm(x[r]) * weight; x, delta,
 * out [m, k] float32, weight [k] */
void rms_norm_rows(float *x, const float *delta, const float *weight, float eps, int64_t m,
                   int64_t k, float *out);

#endif
