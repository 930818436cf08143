/* A Llama decode step's decoder layers in one C call (decoder.c): for passes of a few tokens
 * whose every token is a plain decode step, the ~15 Python/torch calls per layer between the
 * block matmuls (~5 ms of a 10 ms step on the default model) become none. */
#ifndef PIE_QUANT_DECODER_H
#define PIE_QUANT_DECODER_H

#include <stdint.h>

#include "lora.h"

#define MAX_PROJECTION_PARTS 3

/* One projection y = x @ W^T whose rows may come in parts of different GGUF types (a fused Q/K/V
 * of a Q4_K_M file is Q4_K, Q4_K, Q6_K): part p fills output columns [offset_p, offset_p + n_p). */
typedef struct {
    int num_parts;
    int qtypes[MAX_PROJECTION_PARTS];
    const uint8_t *blocks[MAX_PROJECTION_PARTS];
    int64_t num_rows[MAX_PROJECTION_PARTS];
    int64_t num_cols;            /* k, the same for every part */
    int64_t num_out;             /* the parts' rows together */
    int64_t act8_min_rows;       /* passes of this many rows and more quantize the input to 8
                                  * bits (matmul8_rows; every part act8_supported, one layout);
                                  * 0: always 16 */
} projection;

typedef struct {
    const float *input_norm;     /* [hidden] */
    const float *post_norm;      /* [hidden] */
    projection qkv;              /* [(Hq + 2 Hkv) D, hidden] */
    projection o;                /* [hidden, Hq D] */
    projection gate_up;          /* [2 intermediate, hidden] */
    projection down;             /* [hidden, intermediate] */
} decoder_layer;

typedef struct {
    int num_layers, num_q_heads, num_kv_heads, head_dim, level;
    int64_t hidden, intermediate;
    float eps;
    decoder_layer *layers;       /* [num_layers], owned */
} decoder;

/* One pass of m tokens, token r the next token of request r (decode_batch's conventions). */
typedef struct {
    float *x;                    /* [m, hidden] the embeddings in; the residual stream out */
    int64_t m;
    const float *cos;            /* [m, head_dim] RoPE rows at each token's position */
    const float *signed_sin;     /* [m, head_dim], first half negated (engine/model/rope.py) */
    void *pool;                  /* layer 0's slot rows; layer i layer_values values on */
    int64_t layer_values;
    int kv_half;                 /* the pool holds float16 (1) or float32 (0) */
    const int64_t *append_rows;  /* [m] */
    const int64_t *kv_rows;      /* [m, max_kv] */
    const int64_t *kv_lens;      /* [m] */
    int64_t max_kv, page_size;
    int num_threads;
    const lora_pass *lora;       /* the rows' adapters (lora.h), or NULL for none */
} decode_pass;

/* Runs every layer: x += attention and MLP outputs, layer after layer (x ends as the residual
 * stream before the final norm); with `lora`, each projection's output gets its rows' adapter
 * deltas before it is used. 0 on success, -1 when out of memory (x then undefined). */
int decoder_run(const decoder *model, const decode_pass *pass);

#endif
