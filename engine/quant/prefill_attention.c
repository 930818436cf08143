/* Causal attention of one long prompt straight from the paged KV pool, on the kernels' thread
 * pool (prefill_attention.h). Each KV head's context is first widened to float32 panels (K
 * transposed, so that 16 keys of one dimension are one vector); a unit of work is then one KV
 * head and a tile of a few tokens, whose query rows (tokens x the heads of the KV head's group)
 * share every K and V value they read: the scores of the tile are a small matrix product, the
 * softmax runs per row (two passes, as decode_attention.c), and the weighted sum of V is a
 * second product. Tiles are taken last first, the longest rows first, so that the threads end
 * together. The plain-C loops here are the portable level (vectorized by -O3, an AVX2 clone
 * beside the baseline); prefill_attention_avx2.c and _avx512.c hold register-blocked ones. */
#define _DEFAULT_SOURCE      /* MAP_ANONYMOUS under -std=c11 */
#include "prefill_attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "fast_exp.h"
#include "formats.h"
#include "matmul.h"
#include "pool.h"

#define TILE_ROWS 24          /* query rows (tokens x group heads) of a unit, at least a group */
#define KEY_CHUNK 64          /* keys whose partial scores the portable loop keeps at once */
#define PANEL_MIN_ROWS 32     /* context rows a panel-building chunk takes at least */
/* below this many q.k products a request runs on the calling thread (a pool job costs ~5-20 us) */
#define PARALLEL_MIN_SCORES 16384

static inline int64_t round_up_16(int64_t n) { return (n + 15) / 16 * 16; }

VECTOR_CLONES static void scores_portable(const float *const *q_rows, int num_q,
                                          const float *k_panel, int64_t key_stride,
                                          int64_t num_keys, int head_dim, float *scores,
                                          int64_t stride) {
    for (int r = 0; r < num_q; r++) {
        const float *q = q_rows[r];
        for (int64_t j0 = 0; j0 < num_keys; j0 += KEY_CHUNK) {
            int64_t n = num_keys - j0 < KEY_CHUNK ? num_keys - j0 : KEY_CHUNK;
            float acc[KEY_CHUNK] = {0.0f};
            for (int d = 0; d < head_dim; d++) {
                const float *k = k_panel + d * key_stride + j0;
                float qd = q[d];
                for (int64_t j = 0; j < n; j++) acc[j] += qd * k[j];
            }
            memcpy(scores + r * stride + j0, acc, (size_t)n * sizeof(float));
        }
    }
}

VECTOR_CLONES static void weighted_sum_portable(const float *weights, int64_t stride, int num_q,
                                                const float *v_panel, int64_t num_keys,
                                                int head_dim, float *out) {
    for (int r = 0; r < num_q; r++) {
        float *o = out + r * head_dim;
        for (int d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < num_keys; j++) {
            float w = weights[r * stride + j];
            const float *v = v_panel + j * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] += w * v[d];
        }
    }
}

/* row[j] = exp(row[j] * scale - max), j < n; returns their sum */
VECTOR_CLONES static float softmax_portable(float *row, int64_t n, float scale) {
    float max_score = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        row[j] *= scale;
        max_score = row[j] > max_score ? row[j] : max_score;
    }
    for (int64_t j = 0; j < n; j++) row[j] = exp_approx(row[j] - max_score);
    for (int64_t j = 0; j < n; j++) total += row[j];
    return total;
}

typedef struct {
    const prefill_request *request;
    prefill_loops loops;
    float *k_panels;          /* [num_kv_heads][head_dim][key_stride] */
    float *v_panels;          /* [num_kv_heads][kv_len][head_dim] */
    int64_t key_stride;       /* kv_len rounded up to 16 (zero keys past kv_len) */
    int group, tile_tokens;   /* query heads per KV head; tokens per tile */
    int64_t num_tiles;
    char *scratch;            /* one slot a thread, scratch_bytes each (thread_scratch) */
    size_t scratch_bytes;
    int num_slots;
    atomic_int next_slot;
    row_cursor units;         /* unit u: tile num_tiles - 1 - u / num_kv_heads, KV head u % ... */
} prefill_job;

static void widen_portable(const void *src, int kv_half, int n, float *dst) {
    if (!kv_half) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *halves = src;
    for (int d = 0; d < n; d++) dst[d] = fp16_to_fp32(halves[d]);
}

/* the panels of context rows [start, start + count), every KV head */
static void panel_chunk(void *ctx, int64_t start, int64_t count) {
    const prefill_job *job = ctx;
    const prefill_request *request = job->request;
    int hd = request->head_dim, num_kv_heads = request->num_kv_heads;
    size_t value_bytes = request->kv_half ? sizeof(uint16_t) : sizeof(float);
    size_t row_bytes = (size_t)num_kv_heads * hd * value_bytes;
    const char *slots = request->slots;
    float k_values[hd];
    for (int64_t j = start; j < start + count; j++) {
        const char *k_row = slots + request->kv_rows[j] * row_bytes;
        const char *v_row = k_row + request->page_size * row_bytes;
        for (int h = 0; h < num_kv_heads; h++) {
            job->loops.widen(k_row + h * hd * value_bytes, request->kv_half, hd, k_values);
            float *k_panel = job->k_panels + (int64_t)h * hd * job->key_stride;
            for (int d = 0; d < hd; d++) k_panel[d * job->key_stride + j] = k_values[d];
            job->loops.widen(v_row + h * hd * value_bytes, request->kv_half, hd,
                      job->v_panels + ((int64_t)h * request->kv_len + j) * hd);
        }
    }
}

/* one tile of tokens against one KV head; scratch: TILE_ROWS-or-group rows of scores, rows of
 * results, row pointers */
static void run_unit(const prefill_job *job, int64_t u, float *scores, float *results,
                     float *totals, const float **q_rows) {
    const prefill_request *request = job->request;
    int hd = request->head_dim, group = job->group;
    int64_t tile = job->num_tiles - 1 - u / request->num_kv_heads;
    int kv_head = (int)(u % request->num_kv_heads);
    int64_t first = tile * job->tile_tokens;
    int64_t num_tokens = request->num_tokens - first < job->tile_tokens
                         ? request->num_tokens - first : job->tile_tokens;
    int64_t first_slot = request->kv_len - request->num_tokens + first;    /* token `first` */
    int64_t num_keys = first_slot + num_tokens;                            /* the tile's last */
    int num_rows = (int)num_tokens * group;
    for (int r = 0; r < num_rows; r++)
        q_rows[r] = request->q + (first + r / group) * request->q_stride
                    + ((int64_t)kv_head * group + r % group) * hd;
    const float *k_panel = job->k_panels + (int64_t)kv_head * hd * job->key_stride;
    job->loops.scores(q_rows, num_rows, k_panel, job->key_stride, round_up_16(num_keys), hd,
                      scores, job->key_stride);
    for (int r = 0; r < num_rows; r++) {
        int64_t visible = first_slot + r / group + 1;
        float *row = scores + r * job->key_stride;
        totals[r] = job->loops.softmax(row, visible, request->scale);
        for (int64_t j = visible; j < num_keys; j++) row[j] = 0.0f;
    }
    job->loops.weighted_sum(scores, job->key_stride, num_rows,
                            job->v_panels + (int64_t)kv_head * request->kv_len * hd, num_keys, hd,
                            results);
    for (int r = 0; r < num_rows; r++) {
        float inverse = 1.0f / totals[r];
        float *out = request->out + (first + r / group) * request->out_stride
                     + ((int64_t)kv_head * group + r % group) * hd;
        for (int d = 0; d < hd; d++) out[d] = results[r * hd + d] * inverse;
    }
}

static size_t round_up_64(size_t n) { return (n + 63) / 64 * 64; }

/* one thread's scratch: row pointers, then rows of scores, results and totals */
static size_t thread_scratch_bytes(int rows, int64_t key_stride, int head_dim) {
    return round_up_64((size_t)rows * sizeof(float *))
           + round_up_64((size_t)rows * (key_stride + head_dim + 1) * sizeof(float));
}

static void attention_task(void *ctx) {
    prefill_job *job = ctx;
    int rows = job->tile_tokens * job->group, hd = job->request->head_dim;
    int slot = atomic_fetch_add(&job->next_slot, 1);
    if (slot >= job->num_slots) return;    /* never: pool_run makes at most num_threads calls */
    char *base = job->scratch + (size_t)slot * job->scratch_bytes;
    const float **q_rows = (const float **)base;
    float *scores = (float *)(base + round_up_64((size_t)rows * sizeof(float *)));
    float *results = scores + (size_t)rows * job->key_stride, *totals = results + rows * hd;
    int64_t start, count;
    while (next_chunk(&job->units, &start, &count))
        for (int64_t u = start; u < start + count; u++)
            run_unit(job, u, scores, results, totals, q_rows);
}

int prefill_attention(const prefill_request *request, int level, int num_threads) {
    if (request->num_tokens <= 0) return 0;
    int hd = request->head_dim, group = request->num_q_heads / request->num_kv_heads;
    if ((int64_t)request->num_tokens * request->kv_len * request->num_q_heads < PARALLEL_MIN_SCORES)
        num_threads = 1;
    prefill_job job = {.request = request, .group = group,
                       .key_stride = round_up_16(request->kv_len),
                       .tile_tokens = group >= TILE_ROWS ? 1 : TILE_ROWS / group};
    job.loops = level == LEVEL_AVX512 ? prefill_loops_avx512()
                : level == LEVEL_AVX2     ? prefill_loops_avx2()
                                          : (prefill_loops){scores_portable, weighted_sum_portable,
                                                            softmax_portable, widen_portable};
    job.num_tiles = (request->num_tokens + job.tile_tokens - 1) / job.tile_tokens;
    /* The panels and every thread's scratch in one mapping, not malloc'ed: its pages go back
     * to the OS at once (heap chunks between the caller's other allocations, or a worker
     * thread's own arena, stay resident); zeroed, so the K columns past kv_len, which the last
     * tile's rounded-up key count meets, are 0. */
    size_t k_bytes = round_up_64((size_t)request->num_kv_heads * hd * job.key_stride
                                 * sizeof(float));
    size_t v_bytes = round_up_64((size_t)request->num_kv_heads * request->kv_len * hd
                                 * sizeof(float));
    job.num_slots = num_threads < 1 ? 1 : num_threads > POOL_MAX_THREADS ? POOL_MAX_THREADS
                                                                            : num_threads;
    job.scratch_bytes = thread_scratch_bytes(job.tile_tokens * group, job.key_stride, hd);
    atomic_init(&job.next_slot, 0);
    size_t map_bytes = k_bytes + v_bytes + (size_t)job.num_slots * job.scratch_bytes;
    char *panels = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                        -1, 0);
    int status = -1;
    if (panels != MAP_FAILED) {
        job.k_panels = (float *)panels;
        job.v_panels = (float *)(panels + k_bytes);
        job.scratch = panels + k_bytes + v_bytes;
        pool_run_rows(panel_chunk, &job, request->kv_len, PANEL_MIN_ROWS, num_threads);
        int64_t num_units = job.num_tiles * request->num_kv_heads;
        row_cursor_init(&job.units, num_units, num_threads, 1);
        job.units.chunk_rows = 1;       /* one unit at a time: a thread preempted mid-chunk
                                           holds back no others' units */
        pool_run(attention_task, &job, num_threads);
        status = 0;                       /* the caller alone takes every unit left */
        munmap(panels, map_bytes);
    }
    return status;
}
