/* See matmul.h. */
#include "matmul.h"

#include <pthread.h>
#include <stdlib.h>

#include "pool.h"

#define MIN_CHUNK_ROWS 8
#define QUANTIZE_MIN_CHUNK_ROWS 32   /* activation rows a thread quantizes at least (~10 us) */

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* XCR0: which register states the OS saves (bit 1 SSE, 2 AVX, 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM) */
#define XCR0_YMM 0x06u
#define XCR0_ZMM 0xe0u

static uint32_t read_xcr0(void) {
    uint32_t low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    return low;
}

cpu_features detect_cpu(void) {
    cpu_features features = {0};
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return features;
    int osxsave = (ecx >> 27) & 1, fma = (ecx >> 12) & 1, f16c = (ecx >> 29) & 1;
    uint32_t xcr0 = osxsave ? read_xcr0() : 0;
    if (__get_cpuid_max(0, NULL) < 7) return features;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    int avx2 = (ebx >> 5) & 1;
    features.avx2 = avx2 && fma && f16c && (xcr0 & XCR0_YMM) == XCR0_YMM;
    features.avx512 = ((ebx >> 16) & 1) && ((ebx >> 17) & 1) && ((ebx >> 30) & 1)
                      && ((ebx >> 31) & 1);                           /* F, DQ, BW, VL */
    features.avx512_vnni = (ecx >> 11) & 1;
    features.amx = ((edx >> 24) & 1) && ((edx >> 25) & 1);          /* AMX-TILE, AMX-INT8 */
    features.os_zmm = (xcr0 & (XCR0_YMM | XCR0_ZMM)) == (XCR0_YMM | XCR0_ZMM);
    unsigned max_sub = eax;
    if (max_sub >= 1) {
        __cpuid_count(7, 1, eax, ebx, ecx, edx);
        features.avx512_bf16 = (eax >> 5) & 1;
    }
    return features;
}
#else
cpu_features detect_cpu(void) { return (cpu_features){0}; }
#endif

/* the levels this CPU runs, found once: CPUID traps to the hypervisor in a VM (microseconds),
 * and every Python-facing call checks its level */
static int supported_levels[NUM_LEVELS];
static pthread_once_t levels_once = PTHREAD_ONCE_INIT;

static void find_levels(void) {
    cpu_features cpu = detect_cpu();
    supported_levels[LEVEL_SCALAR] = 1;
    supported_levels[LEVEL_AVX2] = cpu.avx2;
    supported_levels[LEVEL_AVX512] = cpu.avx2 && cpu.avx512 && cpu.avx512_vnni && cpu.os_zmm;
}

int level_supported(int level) {
    if (level < 0 || level >= NUM_LEVELS) return 0;
    pthread_once(&levels_once, find_levels);
    return supported_levels[level];
}

int act_alloc(act_q16 *act, int64_t m, int64_t k) {
    size_t num_blocks = (size_t)(m * (k / QK));
    act->k = k;
    act->qs = malloc((size_t)(m * k) * sizeof(int16_t));
    act->d = malloc(num_blocks * sizeof(float));
    act->s = malloc(num_blocks * sizeof(float));
    if (act->qs && act->d && act->s) return 0;
    act_free(act);
    return -1;
}

void act_free(act_q16 *act) {
    free(act->qs);
    free(act->d);
    free(act->s);
    act->qs = NULL;
    act->d = act->s = NULL;
}

void quantize_act(int level, const float *x, int64_t m, act_q16 *act) {
    if (level == LEVEL_AVX2 || level == LEVEL_AVX512)       /* 256 bits are enough here */
        quantize_act_avx2(x, m, act);
    else
        quantize_act_scalar(x, m, act);
}

typedef struct {
    int level;
    const float *x;
    const act_q16 *act;
} quantize_job;

static void quantize_chunk(void *ctx, int64_t start, int64_t count) {
    const quantize_job *job = ctx;
    int64_t k = job->act->k, num_blocks = k / QK;
    act_q16 rows = {.qs = job->act->qs + start * k, .d = job->act->d + start * num_blocks,
                    .s = job->act->s + start * num_blocks, .k = k};
    quantize_act(job->level, job->x + start * k, count, &rows);
}

void quantize_act_rows(int level, const float *x, int64_t m, act_q16 *act, int num_threads) {
    if (m < QUANTIZE_MIN_CHUNK_ROWS * 2 || num_threads <= 1) {
        quantize_act(level, x, m, act);
        return;
    }
    quantize_job job = {.level = level, .x = x, .act = act};
    pool_run_rows(quantize_chunk, &job, m, QUANTIZE_MIN_CHUNK_ROWS, num_threads);
}

typedef struct {
    dot_rows_fn fn;
    const uint8_t *w;
    int64_t row_bytes, m, ldy;
    const act_q16 *x;
    float *y;
} matmul_job;

static void matmul_chunk(void *ctx, int64_t start, int64_t count) {
    const matmul_job *job = ctx;
    job->fn(job->w + start * job->row_bytes, job->row_bytes, count, job->x, job->m,
            job->y + start, job->ldy);
}

void matmul_rows(int qtype, int level, const uint8_t *w, int64_t n, const act_q16 *x, int64_t m,
                 float *y, int64_t ldy, int num_threads) {
    dot_rows_fn fn = level == LEVEL_AVX512 ? dot_rows_avx512(qtype)
                     : level == LEVEL_AVX2 ? dot_rows_avx2(qtype) : dot_rows_scalar(qtype);
    int paired = level == LEVEL_AVX512 && qtype >= QTYPE_Q4_0_X8;    /* two 8-row groups a step */
    matmul_job job = {.fn = fn, .w = w, .row_bytes = qtype_row_bytes(qtype, x->k), .m = m,
                      .ldy = ldy, .x = x, .y = y};
    pool_run_rows(matmul_chunk, &job, n, paired ? 2 * MIN_CHUNK_ROWS : MIN_CHUNK_ROWS, num_threads);
}

int act8_supported(int qtype, int level) {
    return act8_layout(qtype) >= 0 && (level == LEVEL_SCALAR || level == LEVEL_AVX512)
           && level_supported(level);
}

int act8_alloc(act_q8 *act, int64_t m, int64_t k, int layout) {
    size_t num_blocks = (size_t)(m * (k / QK));
    act->k = k;
    act->layout = layout;
    act->qs = malloc((size_t)(m * k));
    act->d = malloc(num_blocks * sizeof(float));
    act->s = malloc(num_blocks * sizeof(float));
    if (act->qs && act->d && act->s) return 0;
    act8_free(act);
    return -1;
}

void act8_free(act_q8 *act) {
    free(act->qs);
    free(act->d);
    free(act->s);
    act->qs = NULL;
    act->d = act->s = NULL;
}

typedef struct {
    int level;
    const float *x;
    const act_q8 *act;
} quantize8_job;

static void quantize8_chunk(void *ctx, int64_t start, int64_t count) {
    const quantize8_job *job = ctx;
    int64_t k = job->act->k, num_blocks = k / QK;
    act_q8 rows = {.qs = job->act->qs + start * k, .d = job->act->d + start * num_blocks,
                   .s = job->act->s + start * num_blocks, .k = k, .layout = job->act->layout};
    if (job->level == LEVEL_AVX512)
        quantize_act8_avx512(job->x + start * k, count, &rows);
    else
        quantize_act8_scalar(job->x + start * k, count, &rows);
}

void quantize_act8_rows(int level, const float *x, int64_t m, act_q8 *act, int num_threads) {
    quantize8_job job = {.level = level, .x = x, .act = act};
    if (m < QUANTIZE_MIN_CHUNK_ROWS * 2 || num_threads <= 1)
        quantize8_chunk(&job, 0, m);
    else
        pool_run_rows(quantize8_chunk, &job, m, QUANTIZE_MIN_CHUNK_ROWS, num_threads);
}

typedef struct {
    dot8_rows_fn fn;
    const uint8_t *w;
    int64_t row_bytes, m, ldy;
    const act_q8 *x;
    float *y;
} matmul8_job;

static void matmul8_chunk(void *ctx, int64_t start, int64_t count) {
    const matmul8_job *job = ctx;
    job->fn(job->w + start * job->row_bytes, job->row_bytes, count, job->x, job->m,
            job->y + start, job->ldy);
}

void matmul8_rows(int qtype, int level, const uint8_t *w, int64_t n, const act_q8 *x, int64_t m,
                  float *y, int64_t ldy, int num_threads) {
    int row_major = qtype == QTYPE_Q4_K || qtype == QTYPE_Q5_K || qtype == QTYPE_Q6_K;
    int vnni = level == LEVEL_AVX512;
    dot8_rows_fn fn = row_major ? (vnni ? dot8_rows_k_avx512(qtype) : dot8_rows_k_scalar(qtype))
                                : (vnni ? dot8_rows_x8_avx512(qtype) : dot8_rows_x8_scalar(qtype));
    matmul8_job job = {.fn = fn, .w = w, .row_bytes = qtype_row_bytes(qtype, x->k), .m = m,
                       .ldy = ldy, .x = x, .y = y};
    pool_run_rows(matmul8_chunk, &job, n, row_major ? MIN_CHUNK_ROWS : 2 * MIN_CHUNK_ROWS,
                  num_threads);
}
