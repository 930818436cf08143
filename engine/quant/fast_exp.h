/* exp over arrays of float32 in plain C that -O3 vectorizes (libm's expf is a call per value,
 * ~10-15 ns: a decode step of 8 requests takes ~500,000 of them in softmax and SiLU). Cody-Waite
 * range reduction, x = n ln2 + r with |r| <= ln2 / 2, and a degree-6 polynomial for exp(r):
 * within 2 ulp of expf over [-87, 88]; inputs are clamped there (exp(-87) ~ 1.6e-38, where a
 * softmax weight or a SiLU's exp(-x) no longer matters; exp(88) ~ 1.6e38). */
#ifndef PIE_QUANT_FAST_EXP_H
#define PIE_QUANT_FAST_EXP_H

#include <stdint.h>
#include <string.h>

/* No FP exception is ever read, so none needs keeping: without this, GCC keeps floorf and the
 * clamp's comparisons scalar (they may raise one) and no loop calling exp_approx vectorizes.
 * Callers' loops carry the same option (pool.h VECTOR_CLONES), so that it inlines there. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FP_TRAPS __attribute__((optimize("no-trapping-math")))
#else
#define NO_FP_TRAPS
#endif

NO_FP_TRAPS static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;                 /* ln2, high part (exact product) */
    r = r + n * 2.12194440e-4f;                     /* ln2, low part: r = x - n ln2 */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;        /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
