/* engine.quant._kernels: y = x @ W^T straight from GGUF blocks, and block dequantization.
 *
 * Arguments are raw addresses (torch's data_ptr()) and sizes; the Python wrapper
 * (engine/quant/kernels.py) checks dtypes, shapes and contiguity before calling. The GIL is
 * released while kernels run; work is split over output rows on a small thread pool. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "formats.h"
#include "matmul.h"
#include "decode_attention.h"
#include "prefill_attention.h"
#include "norm.h"
#include "pool.h"

/* matmul.h's LEVEL_* in order (engine/quant/kernels.py LEVELS) */
static const char *LEVEL_NAMES[NUM_LEVELS] = {"scalar", "avx2", "avx512-vnni"};

/* decoder_py.c */
PyObject *py_decoder_new(PyObject *self, PyObject *args);
PyObject *py_decoder_run(PyObject *self, PyObject *args);

/* y = x @ W^T with 8-bit activation blocks (act8_supported(qtype, level) checked) */
static PyObject *matmul8(int qtype, int level, const uint8_t *w, int64_t n, int64_t k,
                         const float *x, int64_t m, float *y, int num_threads) {
    act_q8 act;
    if (act8_alloc(&act, m, k, act8_layout(qtype)) != 0) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    quantize_act8_rows(level, x, m, &act, num_threads);
    matmul8_rows(qtype, level, w, n, &act, m, y, n, num_threads);
    Py_END_ALLOW_THREADS
    act8_free(&act);
    Py_RETURN_NONE;
}

/* matmul(qtype, level, w, n, k, x, m, y, num_threads[, act_bits]): y[m, n] = x[m, k] @ W[n, k]^T,
 * the activations quantized to act_bits (16, or 8 where act8_supported) bits per block */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int qtype, level, num_threads, act_bits = 16;
    unsigned long long w_addr, x_addr, y_addr;
    long long n, k, m;
    if (!PyArg_ParseTuple(args, "iiKLLKLKi|i", &qtype, &level, &w_addr, &n, &k, &x_addr, &m, &y_addr,
                          &num_threads, &act_bits))
        return NULL;
    int64_t row_bytes = qtype_row_bytes(qtype, k);
    if (row_bytes == 0 || n <= 0 || m <= 0)
        return PyErr_Format(PyExc_ValueError, "matmul: bad qtype %d or shape n=%lld k=%lld m=%lld",
                            qtype, n, k, m);
    if (!level_supported(level))
        return PyErr_Format(PyExc_ValueError, "matmul: kernel level %d is not supported here", level);
    if (act_bits == 8) {
        if (!act8_supported(qtype, level))
            return PyErr_Format(PyExc_ValueError, "matmul: 8-bit activations need an interleaved "
                                "Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 or a Q4_K / Q5_K / Q6_K weight "
                                "at the scalar or avx512-vnni level "
                                "(got qtype %d, level %d)", qtype, level);
        return matmul8(qtype, level, (const uint8_t *)(uintptr_t)w_addr, n, k,
                       (const float *)(uintptr_t)x_addr, m, (float *)(uintptr_t)y_addr, num_threads);
    }
    if (act_bits != 16)
        return PyErr_Format(PyExc_ValueError, "matmul: act_bits %d (8 or 16)", act_bits);
    act_q16 act;
    if (act_alloc(&act, m, k) != 0) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    quantize_act_rows(level, (const float *)(uintptr_t)x_addr, m, &act, num_threads);
    matmul_rows(qtype, level, (const uint8_t *)(uintptr_t)w_addr, n, &act, m,
                (float *)(uintptr_t)y_addr, n, num_threads);
    Py_END_ALLOW_THREADS
    act_free(&act);
    Py_RETURN_NONE;
}

typedef struct {
    int qtype, level;
    const uint8_t *w;
    int64_t row_bytes, k;
    float *out;
} dequantize_job;

static void dequantize_chunk(void *ctx, int64_t start, int64_t count) {
    const dequantize_job *job = ctx;
    const uint8_t *w = job->w + start * job->row_bytes;
    float *out = job->out + start * job->k;
    if (job->level == LEVEL_AVX512 && dequantize_x8_avx512(job->qtype, w, count, job->k, out) == 0)
        return;                  /* an _X8 type (chunks are whole 8-row groups) */
    dequantize_rows(job->qtype, w, count, job->k, out);
}

/* dequantize(qtype, w, n, k, out, num_threads[, level]): out[n, k] float32 = the blocks' values
 * (level: the kernels of an _X8 type, scalar by default; the same values at every level) */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    int qtype, num_threads, level = LEVEL_SCALAR;
    unsigned long long w_addr, out_addr;
    long long n, k;
    if (!PyArg_ParseTuple(args, "iKLLKi|i", &qtype, &w_addr, &n, &k, &out_addr, &num_threads,
                          &level))
        return NULL;
    if (!level_supported(level))
        return PyErr_Format(PyExc_ValueError, "dequantize: kernel level %d is not supported here",
                            level);
    int64_t row_bytes = qtype_row_bytes(qtype, k);
    if (row_bytes == 0 || n < 0)
        return PyErr_Format(PyExc_ValueError, "dequantize: bad qtype %d or shape n=%lld k=%lld",
                            qtype, n, k);
    dequantize_job job = {.qtype = qtype, .level = level, .w = (const uint8_t *)(uintptr_t)w_addr,
                          .row_bytes = row_bytes, .k = k,
                          .out = (float *)(uintptr_t)out_addr};
    Py_BEGIN_ALLOW_THREADS
    pool_run_rows(dequantize_chunk, &job, n, 8, n < 64 ? 1 : num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* interleave(qtype, src, num_rows, k, dst, num_threads): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows
 * -> the _X8 layout (formats.h) */
static PyObject *py_interleave(PyObject *self, PyObject *args) {
    int qtype, num_threads;
    unsigned long long src, dst;
    long long num_rows, k;
    if (!PyArg_ParseTuple(args, "iKLLKi", &qtype, &src, &num_rows, &k, &dst, &num_threads))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = interleave_rows(qtype, (const uint8_t *)(uintptr_t)src, num_rows, k,
                             (uint8_t *)(uintptr_t)dst, num_threads);
    Py_END_ALLOW_THREADS
    if (status != 0)
        return PyErr_Format(PyExc_ValueError, "interleave: qtype %d with %lld rows of %lld "
                            "(Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, rows a multiple of 8)", qtype,
                            num_rows, k);
    Py_RETURN_NONE;
}

/* levels() -> the kernel levels this CPU runs, slowest first, e.g. ("scalar", "avx2") */
static PyObject *py_levels(PyObject *self, PyObject *unused) {
    PyObject *names = PyList_New(0);
    for (int level = LEVEL_SCALAR; level < NUM_LEVELS && names; level++) {
        if (level_supported(level)) {
            PyObject *name = PyUnicode_FromString(LEVEL_NAMES[level]);
            if (!name || PyList_Append(names, name) < 0) Py_CLEAR(names);
            Py_XDECREF(name);
        }
    }
    if (!names) return NULL;
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

/* cpu_features() -> {feature: bool}: what CPUID and XGETBV report (matmul.h cpu_features), so
 * the engine can say why it runs the level it does */
static PyObject *py_cpu_features(PyObject *self, PyObject *unused) {
    cpu_features cpu = detect_cpu();
    return Py_BuildValue("{sNsNsNsNsNsN}", "avx2", PyBool_FromLong(cpu.avx2),
                         "avx512", PyBool_FromLong(cpu.avx512),
                         "avx512_vnni", PyBool_FromLong(cpu.avx512_vnni),
                         "avx512_bf16", PyBool_FromLong(cpu.avx512_bf16),
                         "amx", PyBool_FromLong(cpu.amx), "os_zmm", PyBool_FromLong(cpu.os_zmm));
}

/* rms_norm(x, delta, weight, eps, m, k, out): x[r] += delta[r] (delta 0: none), then
 * out[r] = rms_norm(x[r]) * weight; float32 [m, k] rows, weight [k]. Tiny: the GIL stays held. */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x_addr, delta_addr, weight_addr, out_addr;
    float eps;
    long long m, k;
    if (!PyArg_ParseTuple(args, "KKKfLLK", &x_addr, &delta_addr, &weight_addr, &eps, &m, &k,
                          &out_addr))
        return NULL;
    if (m < 0 || k <= 0)
        return PyErr_Format(PyExc_ValueError, "rms_norm: bad shape m=%lld k=%lld", m, k);
    rms_norm_rows((float *)(uintptr_t)x_addr, (const float *)(uintptr_t)delta_addr,
                  (const float *)(uintptr_t)weight_addr, eps, m, k, (float *)(uintptr_t)out_addr);
    Py_RETURN_NONE;
}

/* decode_attention(q, q_stride, k_new, k_stride, v_new, v_stride, slots, kv_half, append_rows,
 * kv_rows, kv_lens, num_requests, max_kv, page_size, num_q_heads, num_kv_heads, head_dim, scale,
 * out, level, num_threads):
 * see decode_attention.h (engine/quant/kernels.py's DecodeAttention checks the tensors) */
static PyObject *py_decode_attention(PyObject *self, PyObject *args) {
    unsigned long long q, k_new, v_new, slots, append_rows, kv_rows, kv_lens, out;
    long long q_stride, k_stride, v_stride, num_requests, max_kv, page_size;
    int num_q_heads, num_kv_heads, head_dim, level, num_threads, kv_half;
    float scale;
    if (!PyArg_ParseTuple(args, "KLKLKLKpKKKLLLiiifKii", &q, &q_stride, &k_new, &k_stride, &v_new,
                          &v_stride, &slots, &kv_half, &append_rows, &kv_rows, &kv_lens,
                          &num_requests,
                          &max_kv, &page_size, &num_q_heads, &num_kv_heads, &head_dim, &scale,
                          &out, &level, &num_threads))
        return NULL;
    if (num_requests < 0 || max_kv < 0 || page_size <= 0 || num_kv_heads <= 0 || head_dim <= 0
            || head_dim % 8 || head_dim > 1024 || num_q_heads % num_kv_heads)
        return PyErr_Format(PyExc_ValueError, "decode_attention: bad shape (requests %lld, "
                            "max_kv %lld, heads %d/%d, head_dim %d)", num_requests, max_kv,
                            num_q_heads, num_kv_heads, head_dim);
    if (!level_supported(level))
        return PyErr_Format(PyExc_ValueError, "decode_attention: level %d not supported", level);
    decode_batch batch = {
        .q = (const float *)(uintptr_t)q, .k_new = (const float *)(uintptr_t)k_new,
        .v_new = (const float *)(uintptr_t)v_new, .q_stride = q_stride, .k_stride = k_stride,
        .v_stride = v_stride, .slots = (void *)(uintptr_t)slots, .kv_half = kv_half,
        .append_rows = (const int64_t *)(uintptr_t)append_rows,
        .kv_rows = (const int64_t *)(uintptr_t)kv_rows,
        .kv_lens = (const int64_t *)(uintptr_t)kv_lens, .num_requests = num_requests,
        .max_kv = max_kv, .page_size = page_size, .num_q_heads = num_q_heads,
        .num_kv_heads = num_kv_heads, .head_dim = head_dim, .scale = scale,
        .out = (float *)(uintptr_t)out};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_attention(&batch, level, num_threads);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* prefill_attention(q, q_stride, slots, kv_half, kv_rows, num_tokens, kv_len, page_size,
 * num_q_heads, num_kv_heads, head_dim, scale, out, out_stride, level, num_threads):
 * see prefill_attention.h (engine/quant/kernels.py's PrefillAttention checks the tensors) */
static PyObject *py_prefill_attention(PyObject *self, PyObject *args) {
    unsigned long long q, slots, kv_rows, out;
    long long q_stride, num_tokens, kv_len, page_size, out_stride;
    int kv_half, num_q_heads, num_kv_heads, head_dim, level, num_threads;
    float scale;
    if (!PyArg_ParseTuple(args, "KLKpKLLLiiifKLii", &q, &q_stride, &slots, &kv_half, &kv_rows,
                          &num_tokens, &kv_len, &page_size, &num_q_heads, &num_kv_heads,
                          &head_dim, &scale, &out, &out_stride, &level, &num_threads))
        return NULL;
    if (num_tokens < 0 || kv_len < num_tokens || page_size <= 0 || num_kv_heads <= 0
            || head_dim <= 0 || head_dim % 16 || head_dim > 1024 || num_q_heads % num_kv_heads)
        return PyErr_Format(PyExc_ValueError, "prefill_attention: bad shape (tokens %lld, "
                            "kv_len %lld, heads %d/%d, head_dim %d)", num_tokens, kv_len,
                            num_q_heads, num_kv_heads, head_dim);
    if (!level_supported(level))
        return PyErr_Format(PyExc_ValueError, "prefill_attention: level %d not supported", level);
    prefill_request request = {
        .q = (const float *)(uintptr_t)q, .q_stride = q_stride,
        .slots = (const void *)(uintptr_t)slots, .kv_half = kv_half,
        .kv_rows = (const int64_t *)(uintptr_t)kv_rows, .num_tokens = num_tokens,
        .kv_len = kv_len, .page_size = page_size, .num_q_heads = num_q_heads,
        .num_kv_heads = num_kv_heads, .head_dim = head_dim, .scale = scale,
        .out = (float *)(uintptr_t)out, .out_stride = out_stride};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = prefill_attention(&request, level, num_threads);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* row_bytes(qtype, k) -> bytes of one row of k values, 0 when unsupported */
static PyObject *py_row_bytes(PyObject *self, PyObject *args) {
    int qtype;
    long long k;
    if (!PyArg_ParseTuple(args, "iL", &qtype, &k)) return NULL;
    return PyLong_FromLongLong(qtype_row_bytes(qtype, k));
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "y[m, n] = x[m, k] @ W[n, k]^T from GGUF blocks"},
    {"dequantize", py_dequantize, METH_VARARGS, "out[n, k] float32 from GGUF blocks"},
    {"interleave", py_interleave, METH_VARARGS,
     "Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows interleaved 8 at a time"},
    {"levels", py_levels, METH_NOARGS, "kernel levels this CPU supports, slowest first"},
    {"cpu_features", py_cpu_features, METH_NOARGS, "what CPUID / XGETBV report for the levels"},
    {"decode_attention", py_decode_attention, METH_VARARGS, "paged attention of decode steps"},
    {"prefill_attention", py_prefill_attention, METH_VARARGS,
     "causal attention of one long prompt"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "out = rms_norm(x (+= delta)) * weight, float32 rows"},
    {"decoder_new", py_decoder_new, METH_VARARGS, "a fused decoder from a table of weights"},
    {"decoder_run", py_decoder_run, METH_VARARGS, "every decoder layer of a decode pass"},
    {"row_bytes", py_row_bytes, METH_VARARGS, "bytes per row of k values of a qtype"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
