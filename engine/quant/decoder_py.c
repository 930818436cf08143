/* Python face of decoder.c: decoder_new builds a capsule from a table of weight addresses,
 * decoder_run runs a pass. engine/quant/decoder.py checks tensors before calling. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "decoder.h"
#include "formats.h"
#include "matmul.h"

#define CAPSULE_NAME "engine.quant.decoder"
#define NUM_PROJECTIONS 4
/* num_parts, num_cols, parts, act8_min_rows */
#define PROJECTION_FIELDS (3 + 3 * MAX_PROJECTION_PARTS)
#define LAYER_FIELDS (2 + NUM_PROJECTIONS * PROJECTION_FIELDS)

static void decoder_destroy(PyObject *capsule) {
    decoder *model = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (model) {
        free(model->layers);
        free(model);
    }
}

/* Fills proj from fields (num_parts, num_cols, then (qtype, address, num_rows) per part, then
 * act8_min_rows); 0, or -1 with a Python error set */
static int read_projection(const int64_t *fields, projection *proj, int64_t num_cols,
                           int64_t num_out, int level) {
    proj->num_parts = (int)fields[0];
    proj->num_cols = fields[1];
    proj->num_out = 0;
    if (proj->num_parts < 1 || proj->num_parts > MAX_PROJECTION_PARTS || proj->num_cols != num_cols) {
        PyErr_Format(PyExc_ValueError, "decoder_new: a projection has %d parts of width %lld, "
                     "expected 1..%d of width %lld", proj->num_parts, (long long)proj->num_cols,
                     MAX_PROJECTION_PARTS, (long long)num_cols);
        return -1;
    }
    for (int p = 0; p < proj->num_parts; p++) {
        const int64_t *part = fields + 2 + 3 * p;
        proj->qtypes[p] = (int)part[0];
        proj->blocks[p] = (const uint8_t *)(uintptr_t)part[1];
        proj->num_rows[p] = part[2];
        if (qtype_row_bytes(proj->qtypes[p], num_cols) == 0 || part[2] <= 0 || part[1] == 0) {
            PyErr_Format(PyExc_ValueError, "decoder_new: bad part (qtype %d, %lld rows)",
                         proj->qtypes[p], (long long)part[2]);
            return -1;
        }
        proj->num_out += part[2];
    }
    proj->act8_min_rows = fields[2 + 3 * MAX_PROJECTION_PARTS];
    for (int p = 0; p < proj->num_parts && proj->act8_min_rows != 0; p++) {
        if (proj->act8_min_rows < 0 || !act8_supported(proj->qtypes[p], level)
                || act8_layout(proj->qtypes[p]) != act8_layout(proj->qtypes[0])) {
            PyErr_Format(PyExc_ValueError, "decoder_new: 8-bit activations from %lld rows need "
                         "parts of one 8-bit layout (interleaved or K-quant) at the scalar or "
                         "avx512-vnni level (part %d: qtype %d, level %d)", (long long)proj->act8_min_rows, p,
                         proj->qtypes[p], level);
            return -1;
        }
    }
    if (num_out >= 0 && proj->num_out != num_out) {
        PyErr_Format(PyExc_ValueError, "decoder_new: a projection has %lld rows, expected %lld",
                     (long long)proj->num_out, (long long)num_out);
        return -1;
    }
    return 0;
}

static int read_layer(const int64_t *fields, const decoder *model, decoder_layer *layer) {
    int64_t q_dim = (int64_t)model->num_q_heads * model->head_dim;
    int64_t kv_dim = (int64_t)model->num_kv_heads * model->head_dim;
    const int64_t *proj = fields + 2;
    layer->input_norm = (const float *)(uintptr_t)fields[0];
    layer->post_norm = (const float *)(uintptr_t)fields[1];
    int level = model->level;
    return read_projection(proj, &layer->qkv, model->hidden, q_dim + 2 * kv_dim, level)
        || read_projection(proj + PROJECTION_FIELDS, &layer->o, q_dim, model->hidden, level)
        || read_projection(proj + 2 * PROJECTION_FIELDS, &layer->gate_up, model->hidden,
                           2 * model->intermediate, level)
        || read_projection(proj + 3 * PROJECTION_FIELDS, &layer->down, model->intermediate,
                           model->hidden, level) ? -1 : 0;
}

/* decoder_new(num_layers, hidden, intermediate, num_q_heads, num_kv_heads, head_dim, eps, level,
 * table): table = the address of int64 [num_layers, LAYER_FIELDS] (read now, not kept) */
PyObject *py_decoder_new(PyObject *self, PyObject *args) {
    int num_layers, num_q_heads, num_kv_heads, head_dim, level;
    long long hidden, intermediate;
    float eps;
    unsigned long long table_addr;
    if (!PyArg_ParseTuple(args, "iLLiiifiK", &num_layers, &hidden, &intermediate, &num_q_heads,
                          &num_kv_heads, &head_dim, &eps, &level, &table_addr))
        return NULL;
    if (num_layers <= 0 || hidden <= 0 || intermediate <= 0 || num_kv_heads <= 0
            || num_q_heads % num_kv_heads || head_dim <= 0 || head_dim % 8 || head_dim > 1024
            || !level_supported(level))
        return PyErr_Format(PyExc_ValueError, "decoder_new: bad dimensions or kernel level");
    decoder *model = calloc(1, sizeof *model);
    if (model) model->layers = calloc((size_t)num_layers, sizeof *model->layers);
    if (!model || !model->layers) {
        free(model);
        return PyErr_NoMemory();
    }
    *model = (decoder){.num_layers = num_layers, .num_q_heads = num_q_heads,
                       .num_kv_heads = num_kv_heads, .head_dim = head_dim, .level = level,
                       .hidden = hidden, .intermediate = intermediate, .eps = eps,
                       .layers = model->layers};
    const int64_t *table = (const int64_t *)(uintptr_t)table_addr;
    for (int i = 0; i < num_layers; i++) {
        if (read_layer(table + (int64_t)i * LAYER_FIELDS, model, &model->layers[i]) != 0) {
            free(model->layers);
            free(model);
            return NULL;
        }
    }
    PyObject *capsule = PyCapsule_New(model, CAPSULE_NAME, decoder_destroy);
    if (!capsule) {
        free(model->layers);
        free(model);
    }
    return capsule;
}

/* The pass's adapters from the table at table_addr (lora.h): 0, or -1 with a Python error set.
 * *projections is malloc'ed for the caller to free. */
static int read_lora(const decoder *model, lora_pass *lora, lora_projection **projections,
                     unsigned long long table_addr, int num_groups, unsigned long long indptr,
                     unsigned long long rows, int64_t m) {
    int64_t q_dim = (int64_t)model->num_q_heads * model->head_dim;
    int64_t kv_dim = (int64_t)model->num_kv_heads * model->head_dim;
    const int64_t in_dims[LORA_NUM_PROJECTIONS] = {model->hidden, q_dim, model->hidden,
                                                   model->intermediate};
    const int64_t out_dims[LORA_NUM_PROJECTIONS] = {q_dim + 2 * kv_dim, model->hidden,
                                                    2 * model->intermediate, model->hidden};
    if (num_groups <= 0 || table_addr == 0 || indptr == 0 || rows == 0) {
        PyErr_Format(PyExc_ValueError, "decoder_run: %d adapter groups, or a missing table",
                     num_groups);
        return -1;
    }
    *lora = (lora_pass){.num_groups = num_groups, .num_layers = model->num_layers,
                        .indptr = (const int64_t *)(uintptr_t)indptr,
                        .rows = (const int64_t *)(uintptr_t)rows};
    *projections = malloc((size_t)num_groups * (size_t)model->num_layers
                          * LORA_NUM_PROJECTIONS * sizeof **projections);
    if (!*projections) {
        PyErr_NoMemory();
        return -1;
    }
    const char *error = NULL;
    if (lora_read_table(lora, *projections, (const int64_t *)(uintptr_t)table_addr, in_dims,
                        out_dims, m, &error) != 0) {
        PyErr_Format(PyExc_ValueError, "decoder_run: adapter table: %s", error);
        return -1;
    }
    return 0;
}

/* decoder_run(capsule, x, m, cos, signed_sin, pool, layer_values, kv_half, append_rows, kv_rows,
 * kv_lens, max_kv, page_size, num_threads, lora_table, num_groups, lora_indptr, lora_rows): see
 * decode_pass in decoder.h; num_groups 0: no adapters (the three addresses unread), else the
 * int64 table [num_groups, num_layers, 4, LORA_FIELDS] and the groups' rows (lora.h). */
PyObject *py_decoder_run(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long x, cos, signed_sin, pool, append_rows, kv_rows, kv_lens;
    unsigned long long lora_table, lora_indptr, lora_rows;
    long long m, layer_values, max_kv, page_size;
    int kv_half, num_threads, num_groups;
    if (!PyArg_ParseTuple(args, "OKLKKKLpKKKLLiKiKK", &capsule, &x, &m, &cos, &signed_sin, &pool,
                          &layer_values, &kv_half, &append_rows, &kv_rows, &kv_lens, &max_kv,
                          &page_size, &num_threads, &lora_table, &num_groups, &lora_indptr,
                          &lora_rows))
        return NULL;
    const decoder *model = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (!model) return NULL;
    if (m <= 0 || max_kv < 0 || page_size <= 0 || layer_values <= 0)
        return PyErr_Format(PyExc_ValueError, "decoder_run: bad pass (m %lld, max_kv %lld)", m,
                            max_kv);
    lora_pass lora;
    lora_projection *projections = NULL;
    if (num_groups != 0 && read_lora(model, &lora, &projections, lora_table, num_groups,
                                     lora_indptr, lora_rows, m) != 0) {
        free(projections);
        return NULL;
    }
    decode_pass pass = {
        .x = (float *)(uintptr_t)x, .m = m, .cos = (const float *)(uintptr_t)cos,
        .signed_sin = (const float *)(uintptr_t)signed_sin, .pool = (void *)(uintptr_t)pool,
        .layer_values = layer_values, .kv_half = kv_half,
        .append_rows = (const int64_t *)(uintptr_t)append_rows,
        .kv_rows = (const int64_t *)(uintptr_t)kv_rows,
        .kv_lens = (const int64_t *)(uintptr_t)kv_lens, .max_kv = max_kv,
        .page_size = page_size, .num_threads = num_threads,
        .lora = num_groups != 0 ? &lora : NULL};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decoder_run(model, &pass);
    Py_END_ALLOW_THREADS
    free(projections);
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
