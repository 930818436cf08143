/* See lora.h. A unit's delta (one part j of one group's projection): the group's rows ROW_BLOCK
 * at a time, shrink (t[r, j*rank + k] = dot(x[r], a[j*rank + k]) over the part's rank rows of
 * A), then expand (delta[r, start_j + c] = sum_k t[r, j*rank + k] * b_t[j][k, c]), through kernels at the kernel level (AVX-512 F, AVX2 + FMA,
 * plain C); a block of fewer rows repeats its last row's input and stores only its own rows.
 * A unit's A and B are read from memory once a pass (its later row blocks find them in cache). */
#include "lora.h"

#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "pool.h"

#define ROW_BLOCK 4
#define K_STEP 4           /* rows of A an AVX-512 shrink kernel multiplies at once */
/* A and B asked for this far ahead of the kernels (into L2 for A, L1 for B): the kernels walk a
 * few rows of A, or rank rows of B, side by side, and read each once a pass */
#define PREFETCH_A_FLOATS 1024
#define PREFETCH_FLOATS 64

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

/* tr[b][k] = dot(xr[b], a[k]) for k in [k0, k1), b < nr; xr has ROW_BLOCK rows. K_STEP rows
 * of a at once: each x load feeds K_STEP products, each a load ROW_BLOCK. (Loops over b and kk
 * have constant bounds, so that the accumulators stay in registers.) */
TARGET_AVX512 static void shrink_avx512(const float *const *xr, int nr, const float *a,
                                        int64_t in, int64_t k0, int64_t k1, float *const *tr) {
    int64_t full = in / 16 * 16;
    __mmask16 mask = (__mmask16)((1u << (in - full)) - 1);
    for (int64_t k = k0; k < k1; k += K_STEP) {
        const float *ak[K_STEP];
        for (int kk = 0; kk < K_STEP; kk++) ak[kk] = a + (k + kk < k1 ? k + kk : k) * in;
        __m512 s[ROW_BLOCK][K_STEP];
        for (int b = 0; b < ROW_BLOCK; b++)
            for (int kk = 0; kk < K_STEP; kk++) s[b][kk] = _mm512_setzero_ps();
        for (int64_t i = 0; i < full; i += 16) {
            __m512 w[K_STEP];
            for (int kk = 0; kk < K_STEP; kk++) {
                w[kk] = _mm512_loadu_ps(ak[kk] + i);
                _mm_prefetch((const char *)(ak[kk] + i + PREFETCH_A_FLOATS), _MM_HINT_T1);
            }
            for (int b = 0; b < ROW_BLOCK; b++) {
                __m512 xv = _mm512_loadu_ps(xr[b] + i);
                for (int kk = 0; kk < K_STEP; kk++) s[b][kk] = _mm512_fmadd_ps(xv, w[kk], s[b][kk]);
            }
        }
        if (mask) {
            __m512 w[K_STEP];
            for (int kk = 0; kk < K_STEP; kk++) w[kk] = _mm512_maskz_loadu_ps(mask, ak[kk] + full);
            for (int b = 0; b < ROW_BLOCK; b++) {
                __m512 xv = _mm512_maskz_loadu_ps(mask, xr[b] + full);
                for (int kk = 0; kk < K_STEP; kk++) s[b][kk] = _mm512_fmadd_ps(xv, w[kk], s[b][kk]);
            }
        }
        for (int b = 0; b < ROW_BLOCK; b++)
            for (int kk = 0; kk < K_STEP; kk++)
                if (b < nr && k + kk < k1) tr[b][k + kk] = _mm512_reduce_add_ps(s[b][kk]);
    }
}

/* yr[b][c] += sum_k tr[b][k] * b_t[k * ldb + c] for c in [c0, c1), b < nr */
TARGET_AVX512 static void expand_avx512(const float *const *tr, int nr, const float *b_t,
                                        int64_t rank, int64_t ldb, int64_t c0, int64_t c1,
                                        float *const *yr) {
    for (int64_t c = c0; c < c1; c += 32) {
        int64_t n = c1 - c < 32 ? c1 - c : 32;
        __mmask16 m0 = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
        __mmask16 m1 = (__mmask16)(n >= 32 ? 0xffff : n > 16 ? (1u << (n - 16)) - 1 : 0);
        __m512 acc[ROW_BLOCK][2];
        for (int b = 0; b < ROW_BLOCK; b++) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
        const float *row = b_t + c;
        for (int64_t k = 0; k < rank; k++, row += ldb) {
            __m512 w0 = _mm512_maskz_loadu_ps(m0, row), w1 = _mm512_maskz_loadu_ps(m1, row + 16);
            _mm_prefetch((const char *)(row + PREFETCH_FLOATS), _MM_HINT_T0);
            _mm_prefetch((const char *)(row + PREFETCH_FLOATS + 16), _MM_HINT_T0);
            for (int b = 0; b < ROW_BLOCK; b++) {
                __m512 tv = _mm512_set1_ps(tr[b][k]);
                acc[b][0] = _mm512_fmadd_ps(tv, w0, acc[b][0]);
                acc[b][1] = _mm512_fmadd_ps(tv, w1, acc[b][1]);
            }
        }
        for (int b = 0; b < ROW_BLOCK; b++) {
            if (b >= nr) continue;
            float *y = yr[b] + c;
            _mm512_mask_storeu_ps(y, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, y), acc[b][0]));
            _mm512_mask_storeu_ps(y + 16, m1,
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(m1, y + 16), acc[b][1]));
        }
    }
}

TARGET_AVX2 static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* shrink_avx512's contract, 8 values a step */
TARGET_AVX2 static void shrink_avx2(const float *const *xr, int nr, const float *a, int64_t in,
                                    int64_t k0, int64_t k1, float *const *tr) {
    int64_t full = in / 8 * 8;
    for (int64_t k = k0; k < k1; k += 2) {
        int two = k + 1 < k1;
        const float *a0 = a + k * in, *a1 = two ? a0 + in : a0;
        __m256 s0[ROW_BLOCK], s1[ROW_BLOCK];
        for (int b = 0; b < ROW_BLOCK; b++) s0[b] = s1[b] = _mm256_setzero_ps();
        for (int64_t i = 0; i < full; i += 8) {
            __m256 w0 = _mm256_loadu_ps(a0 + i), w1 = _mm256_loadu_ps(a1 + i);
            _mm_prefetch((const char *)(a0 + i + PREFETCH_A_FLOATS), _MM_HINT_T1);
            _mm_prefetch((const char *)(a1 + i + PREFETCH_A_FLOATS), _MM_HINT_T1);
            for (int b = 0; b < ROW_BLOCK; b++) {
                __m256 xv = _mm256_loadu_ps(xr[b] + i);
                s0[b] = _mm256_fmadd_ps(xv, w0, s0[b]);
                s1[b] = _mm256_fmadd_ps(xv, w1, s1[b]);
            }
        }
        for (int b = 0; b < ROW_BLOCK; b++) {
            if (b >= nr) continue;
            float t0 = sum8(s0[b]), t1 = sum8(s1[b]);
            for (int64_t i = full; i < in; i++) {
                t0 += xr[b][i] * a0[i];
                t1 += xr[b][i] * a1[i];
            }
            tr[b][k] = t0;
            if (two) tr[b][k + 1] = t1;
        }
    }
}

/* expand_avx512's contract, 16 columns a step */
TARGET_AVX2 static void expand_avx2(const float *const *tr, int nr, const float *b_t,
                                    int64_t rank, int64_t ldb, int64_t c0, int64_t c1,
                                    float *const *yr) {
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        __m256 acc0[ROW_BLOCK], acc1[ROW_BLOCK];
        for (int b = 0; b < ROW_BLOCK; b++) acc0[b] = acc1[b] = _mm256_setzero_ps();
        for (int64_t k = 0; k < rank; k++) {
            const float *row = b_t + k * ldb + c;
            __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8);
            _mm_prefetch((const char *)(row + PREFETCH_FLOATS), _MM_HINT_T0);
            for (int b = 0; b < ROW_BLOCK; b++) {
                __m256 tv = _mm256_broadcast_ss(tr[b] + k);
                acc0[b] = _mm256_fmadd_ps(tv, w0, acc0[b]);
                acc1[b] = _mm256_fmadd_ps(tv, w1, acc1[b]);
            }
        }
        for (int b = 0; b < ROW_BLOCK; b++) {
            if (b >= nr) continue;
            float *y = yr[b] + c;
            _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), acc0[b]));
            _mm256_storeu_ps(y + 8, _mm256_add_ps(_mm256_loadu_ps(y + 8), acc1[b]));
        }
    }
    for (; c < c1; c++)
        for (int b = 0; b < nr; b++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < rank; k++) sum += tr[b][k] * b_t[k * ldb + c];
            yr[b][c] += sum;
        }
}
#endif

static void shrink_scalar(const float *const *xr, int nr, const float *a, int64_t in, int64_t k0,
                          int64_t k1, float *const *tr) {
    for (int64_t k = k0; k < k1; k++)
        for (int b = 0; b < nr; b++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < in; i++) sum += xr[b][i] * a[k * in + i];
            tr[b][k] = sum;
        }
}

static void expand_scalar(const float *const *tr, int nr, const float *b_t, int64_t rank,
                          int64_t ldb, int64_t c0, int64_t c1, float *const *yr) {
    for (int b = 0; b < nr; b++)
        for (int64_t k = 0; k < rank; k++) {
            float w = tr[b][k];
            const float *row = b_t + k * ldb;
            for (int64_t c = c0; c < c1; c++) yr[b][c] += w * row[c];
        }
}

/* The rows rows[0..nr) of a group, as ROW_BLOCK row pointers into base (row stride ld, plus
 * offset), the last repeated */
static void row_block(float **out, const int64_t *rows, int nr, float *base, int64_t ld,
                      int64_t offset) {
    for (int b = 0; b < ROW_BLOCK; b++) out[b] = base + rows[b < nr ? b : nr - 1] * ld + offset;
}

int lora_job_init(lora_job *job, const lora_pass *pass, int layer, int projection,
                  const float *x, int64_t ldx, int64_t in, float *delta, int64_t out, float *t,
                  int level) {
    *job = (lora_job){.pass = pass, .stride = (int64_t)pass->num_layers * LORA_NUM_PROJECTIONS,
                      .first = pass->projections + (int64_t)layer * LORA_NUM_PROJECTIONS + projection,
                      .x = x, .ldx = ldx, .in = in, .delta = delta, .out = out, .t = t,
                      .shrink = shrink_scalar, .expand = expand_scalar};
#if defined(__x86_64__) || defined(__i386__)
    if (level == LEVEL_AVX512) {
        job->shrink = shrink_avx512;
        job->expand = expand_avx512;
    } else if (level == LEVEL_AVX2) {
        job->shrink = shrink_avx2;
        job->expand = expand_avx2;
    }
#endif
    for (int g = 0; g < pass->num_groups; g++)
        if (job->first[g * job->stride].num_parts > 0 && pass->indptr[g + 1] > pass->indptr[g])
            return 1;
    return 0;
}

void lora_unit_delta(const lora_job *job, int64_t unit) {
    int64_t g = unit / LORA_MAX_PARTS;
    int j = (int)(unit % LORA_MAX_PARTS);
    const lora_projection *proj = job->first + g * job->stride;
    if (j >= proj->num_parts) return;
    const int64_t *rows = job->pass->rows, end = job->pass->indptr[g + 1];
    int64_t rank = proj->rank, ldt = job->pass->max_width, num_cols = proj->ends[j] - proj->starts[j];
    for (int64_t r = job->pass->indptr[g]; r < end; r += ROW_BLOCK) {
        int nr = end - r < ROW_BLOCK ? (int)(end - r) : ROW_BLOCK;
        float *xr[ROW_BLOCK], *tr[ROW_BLOCK], *dr[ROW_BLOCK];
        row_block(xr, rows + r, nr, (float *)job->x, job->ldx, 0);
        row_block(tr, rows + r, nr, job->t, ldt, j * rank);
        row_block(dr, rows + r, nr, job->delta, job->out, proj->starts[j]);
        job->shrink((const float *const *)xr, nr, proj->a + j * rank * job->in, job->in, 0, rank,
                    tr);
        for (int b = 0; b < nr; b++) memset(dr[b], 0, (size_t)num_cols * sizeof(float));
        job->expand((const float *const *)tr, nr, proj->b_t[j], rank, num_cols, 0, num_cols, dr);
    }
}

VECTOR_CLONES void lora_add_deltas(const lora_job *job, float *y, int64_t ldy) {
    const lora_pass *pass = job->pass;
    for (int g = 0; g < pass->num_groups; g++) {
        const lora_projection *proj = job->first + g * job->stride;
        for (int64_t i = pass->indptr[g]; i < pass->indptr[g + 1]; i++)
            for (int j = 0; j < proj->num_parts; j++) {
                float *restrict out = y + pass->rows[i] * ldy;
                const float *restrict d = job->delta + pass->rows[i] * job->out;
                for (int64_t c = proj->starts[j]; c < proj->ends[j]; c++) out[c] += d[c];
            }
    }
}

static int read_projection(lora_projection *proj, const int64_t *fields, int64_t in_dim,
                           int64_t out_dim, const char **error) {
    *proj = (lora_projection){.num_parts = (int)fields[0], .rank = fields[1],
                              .a = (const float *)(uintptr_t)fields[2]};
    if (fields[0] == 0) return 0;
    if (fields[0] < 0 || fields[0] > LORA_MAX_PARTS || fields[1] <= 0 || fields[1] > 65536
            || fields[2] == 0 || in_dim <= 0) {
        *error = "a projection's parts, rank or A is out of range";
        return -1;
    }
    for (int j = 0; j < proj->num_parts; j++) {
        const int64_t *part = fields + 3 + 3 * j;
        proj->starts[j] = part[0];
        proj->ends[j] = part[1];
        proj->b_t[j] = (const float *)(uintptr_t)part[2];
        if (part[0] < 0 || part[1] <= part[0] || part[1] > out_dim || part[2] == 0) {
            *error = "a part's columns lie outside its projection's output, or its B is missing";
            return -1;
        }
    }
    return 0;
}

static int read_rows(const lora_pass *pass, int64_t m, const char **error) {
    if (pass->indptr[0] != 0 || pass->indptr[pass->num_groups] > m) {
        *error = "the groups' rows offsets do not start at 0 or run past the pass's rows";
        return -1;
    }
    char *seen = calloc((size_t)m, 1);
    if (!seen) {
        *error = "out of memory";
        return -1;
    }
    int status = 0;
    for (int g = 0; g < pass->num_groups && status == 0; g++) {
        if (pass->indptr[g + 1] < pass->indptr[g]) status = -1;
        for (int64_t i = pass->indptr[g]; i < pass->indptr[g + 1] && status == 0; i++) {
            int64_t row = pass->rows[i];
            if (row < 0 || row >= m || seen[row]) status = -1;
            else seen[row] = 1;
        }
    }
    free(seen);
    if (status != 0) *error = "a group's rows lie outside the pass or in two groups";
    return status;
}

int lora_read_table(lora_pass *pass, lora_projection *projections, const int64_t *table,
                    const int64_t in_dims[LORA_NUM_PROJECTIONS],
                    const int64_t out_dims[LORA_NUM_PROJECTIONS], int64_t m,
                    const char **error) {
    int64_t count = (int64_t)pass->num_groups * pass->num_layers * LORA_NUM_PROJECTIONS;
    pass->projections = projections;
    pass->max_width = 1;
    for (int64_t e = 0; e < count; e++) {
        int p = (int)(e % LORA_NUM_PROJECTIONS);
        if (read_projection(&projections[e], table + e * LORA_FIELDS, in_dims[p], out_dims[p],
                            error) != 0)
            return -1;
        int64_t width = projections[e].num_parts * projections[e].rank;
        if (width > pass->max_width) pass->max_width = width;
    }
    return read_rows(pass, m, error);
}
