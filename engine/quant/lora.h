/* LoRA deltas inside the fused decode step (lora.c): beside the base block matmul of a projection
 * for the whole pass, each adapter's rows get scale * (x @ A^T) @ B^T made, the rows of one
 * adapter together (its A and B read once a pass for all of them), then added to their outputs.
 * Rows without an adapter are not touched. */
#ifndef PIE_QUANT_LORA_H
#define PIE_QUANT_LORA_H

#include <stdint.h>

#define LORA_MAX_PARTS 3          /* parts of a fused projection (q, k, v) */
#define LORA_NUM_PROJECTIONS 4    /* qkv, o, gate_up, down: decoder_layer's order */
/* int64 fields of one projection in a pass's table: num_parts, rank, a, then per part
 * (start, end, b_t) */
#define LORA_FIELDS (3 + 3 * LORA_MAX_PARTS)

/* One adapter's share of one fused projection: part j (of num_parts) adds
 * (x @ a[j*rank:(j+1)*rank]^T) @ b_t[j] to the output columns [starts[j], ends[j]). */
typedef struct {
    int num_parts;                      /* 0: the adapter does not target this projection */
    int64_t rank;
    const float *a;                     /* [num_parts * rank, in], rows contiguous */
    int64_t starts[LORA_MAX_PARTS], ends[LORA_MAX_PARTS];
    const float *b_t[LORA_MAX_PARTS];   /* [rank, ends[j] - starts[j]], scale included */
} lora_projection;

/* The adapters of one pass: group g (one adapter) owns the rows rows[indptr[g]..indptr[g+1]),
 * each row in at most one group. */
typedef struct {
    int num_groups, num_layers;
    const int64_t *indptr;              /* [num_groups + 1] */
    const int64_t *rows;                /* [indptr[num_groups]] */
    const lora_projection *projections; /* [num_groups][num_layers][LORA_NUM_PROJECTIONS] */
    int64_t max_width;                  /* the largest num_parts * rank: t's row width */
} lora_pass;

typedef void (*lora_shrink_fn)(const float *const *xr, int nr, const float *a, int64_t in,
                               int64_t k0, int64_t k1, float *const *tr);
typedef void (*lora_expand_fn)(const float *const *tr, int nr, const float *b_t, int64_t rank,
                               int64_t ldb, int64_t c0, int64_t c1, float *const *yr);

/* One projection of one layer for a pass: its groups' deltas from x, made unit by unit (one
 * part of one group's share: lora_unit_delta, from any thread), then added to the projection's
 * output (lora_add_deltas) */
typedef struct {
    const lora_pass *pass;
    const lora_projection *first;      /* group 0's share of the projection */
    int64_t stride;                    /* projections from one group's share to the next's */
    const float *x;                    /* [m, ldx] the projection's input */
    int64_t ldx, in;
    float *delta;                      /* [m, out] the deltas of the groups' rows */
    float *t;                          /* [m, pass->max_width] scratch */
    int64_t out;
    lora_shrink_fn shrink;
    lora_expand_fn expand;
} lora_job;

/* Prepares projection `projection` (decoder_layer's order) of `layer` over x [m, ldx] (in
 * values a row) for the deltas [m, out]; level: matmul.h's LEVEL_*, supported here. 1 when some
 * group's adapter targets the projection, else 0 (nothing to do). */
int lora_job_init(lora_job *job, const lora_pass *pass, int layer, int projection,
                  const float *x, int64_t ldx, int64_t in, float *delta, int64_t out, float *t,
                  int level);

/* Units of a pass: LORA_MAX_PARTS a group, unit u part u % LORA_MAX_PARTS of group
 * u / LORA_MAX_PARTS (nothing to do when that group's adapter has fewer parts here) */
static inline int64_t lora_num_units(const lora_job *job) {
    return (int64_t)job->pass->num_groups * LORA_MAX_PARTS;
}

/* delta[r, start_j:end_j] = the delta of part j of group g's adapter for each row r of g (unit
 * u = g * LORA_MAX_PARTS + j). Units may run concurrently. */
void lora_unit_delta(const lora_job *job, int64_t unit);

/* y[r, start_j:end_j] += delta[r, start_j:end_j] for every part j of each group's share and
 * each of its rows r (row stride ldy), once every unit's delta is made */
void lora_add_deltas(const lora_job *job, float *y, int64_t ldy);

/* Fills pass->projections[g][l][p] from the int64 table [num_groups][num_layers][4][LORA_FIELDS]
 * and pass->max_width, checking every field against the decoder's projections (in_dims[p],
 * out_dims[p]) and the rows against m. 0, or -1 with *error naming what is wrong. */
int lora_read_table(lora_pass *pass, lora_projection *projections, const int64_t *table,
                    const int64_t in_dims[LORA_NUM_PROJECTIONS],
                    const int64_t out_dims[LORA_NUM_PROJECTIONS], int64_t m,
                    const char **error);

#endif
