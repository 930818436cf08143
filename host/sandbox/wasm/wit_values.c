/* host.sandbox.wasm._wit_values: component-model values <-> Python objects in one C call.
 *
 * A host call's arguments arrive as an array of wasmtime_component_val_t (the C API of
 * libwasmtime, loaded by wasmtime-py); its result goes back as one. wasmtime-py converts them
 * with a few ctypes objects and FFI calls per value; here the same conversions run in C, driven
 * by a descriptor built once per function type (host/sandbox/wasm/wit_codec.py):
 *
 *   (kind,)                                  bool, integers, floats, char, string, enum
 *   (LIST, element) / (TUPLE, (elements..))  Python list / tuple
 *   (RECORD, (names..), (fields..))          wasmtime.component.Record, one attribute per field
 *   (VARIANT, (names..), (cases..), tagged, (classes per case..))   option/result/variant
 *   (RESOURCE,)                              an argument: the host resource's rep (int); a
 *                                            result: a (rep, type id) tuple, owned by the guest
 *
 * A case is a descriptor or None (no payload). `tagged` variants are Variant(tag, payload)
 * objects; untagged ones are the payload itself (None for a case without one), and lowering
 * picks the first case whose classes match the value (what wasmtime-py does).
 *
 * Ownership (wasmtime's linker, add_func): the arguments are read only (libwasmtime drops them
 * after the callback); results are built with libwasmtime's own allocators (function pointers
 * handed to `init`), and libwasmtime drops them after reading. A lowering that fails part-way
 * leaves the result a `false` bool with everything it allocated freed.
 *
 * Layout: the structs of wit_values.h must match wasmtime-py's ctypes definitions; `layout()`
 * returns their sizes and offsets so that the Python side checks them before using this module.
 */
#include <string.h>

#include "wit_values.h"

typedef struct { api_t api; bool ready; } module_state;

static module_state *state_of(PyObject *module) {
    return (module_state *)PyModule_GetState(module);
}


/* ------------------------------------------------------------------------------- module */
static const api_t *ready_api(PyObject *module) {
    module_state *state = state_of(module);
    if (!state->ready) {
        PyErr_SetString(PyExc_RuntimeError, "_wit_values.init() was not called");
        return NULL;
    }
    return &state->api;
}

/* An address given as an int, or as a ctypes pointer object (its buffer holds the pointer: read
 * here without the cost of ctypes.cast). NULL stays NULL. */
static int address_of(PyObject *object, void **out) {
    if (PyLong_Check(object)) {
        *out = PyLong_AsVoidPtr(object);
        return PyErr_Occurred() ? 0 : 1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_SIMPLE) < 0) return 0;
    int ok = view.len == (Py_ssize_t)sizeof(void *);
    if (ok) memcpy(out, view.buf, sizeof(void *));
    else PyErr_SetString(PyExc_TypeError, "expected an address or a ctypes pointer");
    PyBuffer_Release(&view);
    return ok;
}

static PyObject *py_init(PyObject *module, PyObject *args) {
    module_state *state = state_of(module);
    unsigned long long fns[11];
    PyObject *record_class, *variant_class;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKKKOO", &fns[0], &fns[1], &fns[2], &fns[3], &fns[4],
                          &fns[5], &fns[6], &fns[7], &fns[8], &fns[9], &fns[10],
                          &record_class, &variant_class))
        return NULL;
    for (int i = 0; i < 11; i++)
        if (fns[i] == 0) return PyErr_Format(PyExc_ValueError, "function pointer %d is NULL", i);
    state->api.byte_vec_new = (void (*)(byte_vec *, size_t, const char *))(uintptr_t)fns[0];
    state->api.vallist_new_uninit = (void (*)(val_vec *, size_t))(uintptr_t)fns[1];
    state->api.valrecord_new_uninit = (void (*)(record_vec *, size_t))(uintptr_t)fns[2];
    state->api.val_new = (val *(*)(val *))(uintptr_t)fns[3];
    state->api.val_delete = (void (*)(val *))(uintptr_t)fns[4];
    state->api.any_to_host = (wasmtime_error *(*)(void *, const resource_any *, resource_host **))
        (uintptr_t)fns[5];
    state->api.host_rep = (uint32_t (*)(const resource_host *))(uintptr_t)fns[6];
    state->api.host_delete = (void (*)(resource_host *))(uintptr_t)fns[7];
    state->api.host_new = (resource_host *(*)(bool, uint32_t, uint32_t))(uintptr_t)fns[8];
    state->api.host_to_any = (wasmtime_error *(*)(void *, const resource_host *, resource_any **))
        (uintptr_t)fns[9];
    state->api.error_delete = (void (*)(wasmtime_error *))(uintptr_t)fns[10];
    Py_XSETREF(state->api.record_class, Py_NewRef(record_class));
    Py_XSETREF(state->api.variant_class, Py_NewRef(variant_class));
    state->ready = true;
    Py_RETURN_NONE;
}

static PyObject *py_lift(PyObject *module, PyObject *args) {
    void *address, *context = NULL;
    PyObject *desc;
    if (!PyArg_ParseTuple(args, "O&O!|O&", address_of, &address, &PyTuple_Type, &desc,
                          address_of, &context))
        return NULL;
    const api_t *api = ready_api(module);
    return api == NULL ? NULL : wit_lift(api, context, (const val *)address, desc);
}

static PyObject *py_lift_args(PyObject *module, PyObject *args) {
    void *address, *context;
    PyObject *descs;
    if (!PyArg_ParseTuple(args, "O&O!O&", address_of, &address, &PyTuple_Type, &descs,
                          address_of, &context))
        return NULL;
    const api_t *api = ready_api(module);
    if (api == NULL) return NULL;
    const val *values = (const val *)address;
    Py_ssize_t count = PyTuple_GET_SIZE(descs);
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *desc = PyTuple_GET_ITEM(descs, i);
        PyObject *item = desc == Py_None ? Py_NewRef(Py_None)
                                         : wit_lift(api, context, &values[i], desc);
        if (item == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *py_lower(PyObject *module, PyObject *args) {
    void *address, *context = NULL;
    PyObject *value, *desc;
    if (!PyArg_ParseTuple(args, "OO!O&|O&", &value, &PyTuple_Type, &desc, address_of, &address,
                          address_of, &context))
        return NULL;
    const api_t *api = ready_api(module);
    if (api == NULL || wit_lower(api, context, value, desc, (val *)address) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_layout(PyObject *module, PyObject *unused) {
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}",
                         "val", (Py_ssize_t)sizeof(val), "of", (Py_ssize_t)offsetof(val, of),
                         "record_entry", (Py_ssize_t)sizeof(record_entry),
                         "entry_value", (Py_ssize_t)offsetof(record_entry, value),
                         "variant_val", (Py_ssize_t)offsetof(variant_val, val),
                         "result_val", (Py_ssize_t)offsetof(result_val, val),
                         "list_data", (Py_ssize_t)offsetof(val_vec, data),
                         "bytes_data", (Py_ssize_t)offsetof(byte_vec, data));
}

static PyMethodDef methods[] = {
    {"init", py_init, METH_VARARGS, "init(byte_vec_new, vallist_new_uninit, valrecord_new_uninit,"
     " val_new, val_delete, resource_any_to_host, resource_host_rep, resource_host_delete,"
     " resource_host_new, resource_host_to_any, error_delete, Record, Variant): libwasmtime's"
     " functions (addresses) and wasmtime-py's classes."},
    {"lift", py_lift, METH_VARARGS,
     "lift(address, desc, context=0) -> the value at address (read only)."},
    {"lift_args", py_lift_args, METH_VARARGS, "lift_args(address, descs, context) -> list: "
     "argument i lifted by descs[i] (None: left None). context: the store's wasmtime_context_t. "
     "Addresses are ints or ctypes pointers."},
    {"lower", py_lower, METH_VARARGS,
     "lower(value, desc, address, context=0): write the value there."},
    {"layout", py_layout, METH_NOARGS, "sizes and offsets of the structs, as compiled."},
    {NULL, NULL, 0, NULL}};

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    Py_VISIT(state_of(module)->api.record_class);
    Py_VISIT(state_of(module)->api.variant_class);
    return 0;
}

static int module_clear(PyObject *module) {
    Py_CLEAR(state_of(module)->api.record_class);
    Py_CLEAR(state_of(module)->api.variant_class);
    return 0;
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_wit_values",
    "Component-model values <-> Python objects in C (see host/sandbox/wasm/wit_codec.py).",
    sizeof(module_state), methods, NULL, module_traverse, module_clear, NULL};

PyMODINIT_FUNC PyInit__wit_values(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL) memset(state_of(module), 0, sizeof(module_state));
    return module;
}
