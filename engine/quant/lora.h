/* LoRA deltas inside the fused decode step (lora.c): after the base block matmul of a projection
 * for the whole pass, each adapter's rows get scale * (x @ A^T) @ B^T added to their outputs, the
 * rows of one adapter together (A and B read once a step for all of them), on the decoder's
 * thread pool. Rows without an adapter are not touched. */
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

/* y[r, :out] += the delta of projection `projection` of `layer` for every row r of every group,
 * from x[r, :in] (row strides ldx, ldy); t: scratch of [m, pass->max_width] floats (m: the pass's
 * rows). level: matmul.h's LEVEL_*, supported here. */
void lora_add(const lora_pass *pass, int layer, int projection, const float *x, int64_t ldx,
              int64_t in, float *y, int64_t ldy, int64_t out, float *t, int level,
              int num_threads);

/* Fills pass->projections[g][l][p] from the int64 table [num_groups][num_layers][4][LORA_FIELDS]
 * and pass->max_width, checking every field against the decoder's projections (in_dims[p],
 * out_dims[p]) and the rows against m. 0, or -1 with *error naming what is wrong. */
int lora_read_table(lora_pass *pass, lora_projection *projections, const int64_t *table,
                    const int64_t in_dims[LORA_NUM_PROJECTIONS],
                    const int64_t out_dims[LORA_NUM_PROJECTIONS], int64_t m,
                    const char **error);

#endif
