/* See decoder.h. Each step is the function the torch path runs, in the same order: RMSNorm
 * (norm.c), block matmuls (matmul.c), RoPE, paged attention (decode_attention.c), SiLU * up. */
#include "decoder.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "decode_attention.h"
#include "fast_exp.h"
#include "matmul.h"
#include "norm.h"
#include "pool.h"

#define SILU_CHUNK 1024      /* elements per chunk of the SiLU job (~4 us) */
/* weight rows of a base matmul task beside adapters' deltas: a multiple of every kernel's row
 * group (matmul_rows splits at multiples of 8 or 16 rows) */
#define SLICE_ROWS 64

/* Per-pass buffers, all [m, width] float32 rows */
typedef struct {
    float *normed, *qkv, *attn, *delta, *gate_up, *act;
    float *lora_t;               /* [m, lora->max_width] the adapters' shrunk rows, or NULL */
    float *lora_delta;           /* [m, widest output] the adapters' deltas, or NULL */
    act_q16 x_blocks;            /* the activation blocks of the widest matmul input */
    act_q8 x8_blocks;            /* the same in 8 bits (projections' act8_min_rows) */
} scratch;

static void scratch_free(scratch *s) {
    free(s->normed); free(s->qkv); free(s->attn); free(s->delta); free(s->gate_up); free(s->act);
    free(s->lora_t); free(s->lora_delta);
    act_free(&s->x_blocks);
    act8_free(&s->x8_blocks);
}

static int scratch_alloc(scratch *s, const decoder *model, int64_t m, const lora_pass *lora) {
    const decoder_layer *layer = &model->layers[0];
    int64_t q_dim = (int64_t)model->num_q_heads * model->head_dim;
    int64_t widest = model->hidden > model->intermediate ? model->hidden : model->intermediate;
    if (q_dim > widest) widest = q_dim;
    *s = (scratch){0};
    s->normed = malloc((size_t)(m * model->hidden) * sizeof(float));
    s->qkv = malloc((size_t)(m * layer->qkv.num_out) * sizeof(float));
    s->attn = malloc((size_t)(m * q_dim) * sizeof(float));
    s->delta = malloc((size_t)(m * model->hidden) * sizeof(float));
    s->gate_up = malloc((size_t)(m * 2 * model->intermediate) * sizeof(float));
    s->act = malloc((size_t)(m * model->intermediate) * sizeof(float));
    int64_t widest_out = layer->qkv.num_out > 2 * model->intermediate ? layer->qkv.num_out
                                                                       : 2 * model->intermediate;
    if (model->hidden > widest_out) widest_out = model->hidden;
    if (lora) {
        s->lora_t = malloc((size_t)(m * lora->max_width) * sizeof(float));
        s->lora_delta = malloc((size_t)(m * widest_out) * sizeof(float));
    }
    int blocks_failed = act_alloc(&s->x_blocks, m, widest) || act8_alloc(&s->x8_blocks, m, widest,
                                                                         ACT8_Q4);
    if (s->normed && s->qkv && s->attn && s->delta && s->gate_up && s->act && !blocks_failed
            && ((s->lora_t && s->lora_delta) || !lora))
        return 0;
    scratch_free(s);
    return -1;
}

/* Projection `which` of a layer, in lora.h's order: qkv, o, gate_up, down */
static const projection *layer_projection(const decoder_layer *layer, int which) {
    switch (which) {
    case 0: return &layer->qkv;
    case 1: return &layer->o;
    case 2: return &layer->gate_up;
    default: return &layer->down;
    }
}

/* A projection's base matmul in SLICE_ROWS-row tasks beside its adapters' units (lora.h): the
 * first thread in takes matmul slices first, the next the units first (reading the adapters from
 * memory while the other computes), each then helps with what is left */
typedef struct {
    const decoder *model;
    const projection *proj;
    const act_q16 *blocks;
    const act_q8 *blocks8;       /* the 8-bit blocks instead, or NULL */
    int64_t m;
    float *y;
    int64_t num_slices[MAX_PROJECTION_PARTS], total_slices;
    const lora_job *lora;
    int64_t num_units;
    atomic_llong next_slice, next_unit;
    atomic_int num_joined;
} project_job;

static int run_slice(project_job *job) {
    int64_t slice = atomic_fetch_add(&job->next_slice, 1), offset = 0;
    if (slice >= job->total_slices) return 0;
    const projection *proj = job->proj;
    int p = 0;
    for (; slice >= job->num_slices[p]; p++) {
        slice -= job->num_slices[p];
        offset += proj->num_rows[p];
    }
    int64_t start = slice * SLICE_ROWS;
    int64_t count = proj->num_rows[p] - start < SLICE_ROWS ? proj->num_rows[p] - start : SLICE_ROWS;
    const uint8_t *w = proj->blocks[p] + start * qtype_row_bytes(proj->qtypes[p], proj->num_cols);
    if (job->blocks8)
        matmul8_rows(proj->qtypes[p], job->model->level, w, count, job->blocks8, job->m,
                     job->y + offset + start, proj->num_out, 1);
    else
        matmul_rows(proj->qtypes[p], job->model->level, w, count, job->blocks, job->m,
                    job->y + offset + start, proj->num_out, 1);
    return 1;
}

static int run_unit(project_job *job) {
    int64_t unit = atomic_fetch_add(&job->next_unit, 1);
    if (unit >= job->num_units) return 0;
    lora_unit_delta(job->lora, unit);
    return 1;
}

static void project_task(void *ctx) {
    project_job *job = ctx;
    if (atomic_fetch_add(&job->num_joined, 1) % 2) {
        while (run_unit(job)) {}
        while (run_slice(job)) {}
    } else {
        while (run_slice(job)) {}
        while (run_unit(job)) {}
    }
}

/* y = x @ W^T beside the adapters' deltas of `lora` (prepared for this projection), then y +=
 * the deltas */
static void project_with_lora(const decoder *model, const projection *proj, const act_q16 *blocks,
                              const act_q8 *blocks8, int64_t m, float *y, const lora_job *lora,
                              int num_threads) {
    project_job job = {.model = model, .proj = proj, .blocks = blocks, .blocks8 = blocks8, .m = m, .y = y,
                       .lora = lora, .num_units = lora_num_units(lora)};
    for (int p = 0; p < proj->num_parts; p++) {
        job.num_slices[p] = (proj->num_rows[p] + SLICE_ROWS - 1) / SLICE_ROWS;
        job.total_slices += job.num_slices[p];
    }
    atomic_init(&job.next_slice, 0);
    atomic_init(&job.next_unit, 0);
    atomic_init(&job.num_joined, 0);
    pool_run(project_task, &job, num_threads);
    lora_add_deltas(lora, y, proj->num_out);
}

/* y[m, proj->num_out] = x[m, proj->num_cols] @ W^T, part after part, plus the adapters' deltas
 * of projection `which` (lora.h's order) of layer `index` when the pass has adapters */
static void project(const decoder *model, const decode_pass *pass, int index, int which,
                    const float *x, scratch *s, float *y) {
    const projection *proj = layer_projection(&model->layers[index], which);
    const act_q8 *blocks8 = NULL;
    if (proj->act8_min_rows && pass->m >= proj->act8_min_rows) {
        s->x8_blocks.k = proj->num_cols;
        s->x8_blocks.layout = act8_layout(proj->qtypes[0]);
        quantize_act8_rows(model->level, x, pass->m, &s->x8_blocks, 1);
        blocks8 = &s->x8_blocks;
    } else {
        s->x_blocks.k = proj->num_cols;
        quantize_act(model->level, x, pass->m, &s->x_blocks);
    }
    lora_job lora;
    if (pass->lora && lora_job_init(&lora, pass->lora, index, which, x, proj->num_cols,
                                    proj->num_cols, s->lora_delta, proj->num_out, s->lora_t,
                                    model->level)) {
        project_with_lora(model, proj, &s->x_blocks, blocks8, pass->m, y, &lora,
                          pass->num_threads);
        return;
    }
    int64_t offset = 0;
    for (int p = 0; p < proj->num_parts; p++) {
        if (blocks8)
            matmul8_rows(proj->qtypes[p], model->level, proj->blocks[p], proj->num_rows[p],
                         blocks8, pass->m, y + offset, proj->num_out, pass->num_threads);
        else
            matmul_rows(proj->qtypes[p], model->level, proj->blocks[p], proj->num_rows[p],
                        &s->x_blocks, pass->m, y + offset, proj->num_out, pass->num_threads);
        offset += proj->num_rows[p];
    }
}

/* HF rotate_half RoPE on the first num_heads heads of each row of qkv, in place:
 * x[i] = x[i] cos[i] + x[(i + D/2) % D] signed_sin[i] */
static void apply_rope(float *qkv, int64_t m, int64_t row_floats, int num_heads, int head_dim,
                       const float *cos, const float *signed_sin) {
    int half = head_dim / 2;
    float rotated[head_dim];
    for (int64_t r = 0; r < m; r++) {
        const float *c = cos + r * head_dim, *s = signed_sin + r * head_dim;
        for (int h = 0; h < num_heads; h++) {
            float *x = qkv + r * row_floats + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; i++) rotated[i] = x[i < half ? i + half : i - half];
            for (int i = 0; i < head_dim; i++) x[i] = x[i] * c[i] + rotated[i] * s[i];
        }
    }
}

typedef struct {
    const float *gate_up;
    int64_t width;
    float *act;
} silu_job;

/* act[r][i] = silu(gate[r][i]) * up[r][i] for the flat elements [start, start + count) */
VECTOR_CLONES static void silu_chunk(void *ctx, int64_t start, int64_t count) {
    const silu_job *job = ctx;
    int64_t width = job->width;
    for (int64_t e = start; e < start + count;) {      /* the part of one row in the chunk */
        int64_t r = e / width, i = e % width, n = width - i;
        if (n > start + count - e) n = start + count - e;
        const float *restrict gate = job->gate_up + r * 2 * width + i, *restrict up = gate + width;
        float *restrict act = job->act + e;
        for (int64_t t = 0; t < n; t++) act[t] = gate[t] / (1.0f + exp_approx(-gate[t])) * up[t];
        e += n;
    }
}

/* act[r] = silu(gate[r]) * up[r]; gate_up rows are [gate | up], each `width` wide */
static void silu_mul(const float *gate_up, int64_t m, int64_t width, float *act, int num_threads) {
    silu_job job = {.gate_up = gate_up, .width = width, .act = act};
    pool_run_rows(silu_chunk, &job, m * width, SILU_CHUNK, m * width >= 2 * SILU_CHUNK ? num_threads : 1);
}

static int run_layer(const decoder *model, int index, const decode_pass *pass, scratch *s,
                     int first) {
    const decoder_layer *layer = &model->layers[index];
    int64_t m = pass->m, d = model->head_dim;
    int64_t q_dim = model->num_q_heads * d, kv_dim = model->num_kv_heads * d;
    int64_t layer_bytes = pass->layer_values * (int64_t)kv_value_bytes(pass->kv_half);
    rms_norm_rows(pass->x, first ? NULL : s->delta, layer->input_norm, model->eps, m,
                  model->hidden, s->normed);
    project(model, pass, index, 0, s->normed, s, s->qkv);
    apply_rope(s->qkv, m, layer->qkv.num_out, model->num_q_heads + model->num_kv_heads,
               model->head_dim, pass->cos, pass->signed_sin);
    decode_batch batch = {
        .q = s->qkv, .k_new = s->qkv + q_dim, .v_new = s->qkv + q_dim + kv_dim,
        .q_stride = layer->qkv.num_out, .k_stride = layer->qkv.num_out,
        .v_stride = layer->qkv.num_out, .slots = (char *)pass->pool + index * layer_bytes,
        .kv_half = pass->kv_half,
        .append_rows = pass->append_rows, .kv_rows = pass->kv_rows, .kv_lens = pass->kv_lens,
        .num_requests = m, .max_kv = pass->max_kv, .page_size = pass->page_size,
        .num_q_heads = model->num_q_heads, .num_kv_heads = model->num_kv_heads,
        .head_dim = model->head_dim, .scale = 1.0f / sqrtf((float)d), .out = s->attn};
    if (decode_attention(&batch, model->level, pass->num_threads) != 0) return -1;
    project(model, pass, index, 1, s->attn, s, s->delta);
    rms_norm_rows(pass->x, s->delta, layer->post_norm, model->eps, m, model->hidden, s->normed);
    project(model, pass, index, 2, s->normed, s, s->gate_up);
    silu_mul(s->gate_up, m, model->intermediate, s->act, pass->num_threads);
    project(model, pass, index, 3, s->act, s, s->delta);
    return 0;
}

int decoder_run(const decoder *model, const decode_pass *pass) {
    scratch s;
    if (scratch_alloc(&s, model, pass->m, pass->lora) != 0) return -1;
    int status = 0;
    for (int i = 0; i < model->num_layers && status == 0; i++)
        status = run_layer(model, i, pass, &s, i == 0);
    if (status == 0) {
        int64_t count = pass->m * model->hidden;
        for (int64_t i = 0; i < count; i++) pass->x[i] += s.delta[i];
    }
    scratch_free(&s);
    return status;
}
