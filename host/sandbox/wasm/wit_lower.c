/* Lowering: Python objects -> libwasmtime's component values, built with its allocators (see
 * wit_values.c). */
#include <string.h>

#include "wit_values.h"

static int set_bytes(const api_t *api, PyObject *text, byte_vec *out) {
    Py_ssize_t size;
    const char *data = PyUnicode_AsUTF8AndSize(text, &size);
    if (data == NULL) return -1;
    api->byte_vec_new(out, (size_t)size, data);
    return 0;
}

static int lower_int(PyObject *value, long kind, val *out) {
    if (kind < K_S8 || kind > K_U64) {
        PyErr_Format(PyExc_ValueError, "no integer kind %ld", kind);
        return -1;
    }
    if (!PyLong_Check(value)) { PyErr_SetString(PyExc_TypeError, "expected int"); return -1; }
    if (kind == K_U64) {
        unsigned long long u = PyLong_AsUnsignedLongLong(value);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        out->of.u64 = u;
        return 0;
    }
    long long x = PyLong_AsLongLong(value);
    if (x == -1 && PyErr_Occurred()) return -1;
    static const long long low[] = {[K_S8] = INT8_MIN, [K_U8] = 0, [K_S16] = INT16_MIN,
        [K_U16] = 0, [K_S32] = INT32_MIN, [K_U32] = 0, [K_S64] = INT64_MIN};
    static const long long high[] = {[K_S8] = INT8_MAX, [K_U8] = UINT8_MAX, [K_S16] = INT16_MAX,
        [K_U16] = UINT16_MAX, [K_S32] = INT32_MAX, [K_U32] = UINT32_MAX, [K_S64] = INT64_MAX};
    if (x < low[kind] || x > high[kind]) {
        PyErr_Format(PyExc_OverflowError, "%lld out of range for kind %ld", x, kind);
        return -1;
    }
    switch (kind) {
    case K_S8: out->of.s8 = (int8_t)x; break;
    case K_U8: out->of.u8 = (uint8_t)x; break;
    case K_S16: out->of.s16 = (int16_t)x; break;
    case K_U16: out->of.u16 = (uint16_t)x; break;
    case K_S32: out->of.s32 = (int32_t)x; break;
    case K_U32: out->of.u32 = (uint32_t)x; break;
    default: out->of.s64 = (int64_t)x; break;
    }
    return 0;
}

static int lower_scalar(const api_t *api, PyObject *value, long kind, val *out) {
    switch (kind) {
    case K_BOOL:
        if (!PyBool_Check(value)) { PyErr_SetString(PyExc_TypeError, "expected bool"); return -1; }
        out->of.boolean = value == Py_True;
        return 0;
    case K_F32: case K_F64:
        if (!PyFloat_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "expected float");
            return -1;
        }
        if (kind == K_F32) out->of.f32 = (float)PyFloat_AS_DOUBLE(value);
        else out->of.f64 = PyFloat_AS_DOUBLE(value);
        return 0;
    case K_CHAR:
        if (!PyUnicode_Check(value) || PyUnicode_GET_LENGTH(value) != 1) {
            PyErr_SetString(PyExc_TypeError, "expected a one-character string");
            return -1;
        }
        out->of.character = PyUnicode_READ_CHAR(value, 0);
        return 0;
    case K_STRING: case K_ENUM:
        if (!PyUnicode_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "expected str");
            return -1;
        }
        return set_bytes(api, value, &out->of.string);
    default:
        return lower_int(value, kind, out);
    }
}

static int lower_sequence(const api_t *api, void *context, PyObject *value, PyObject *desc,
                          long kind, val *out) {
    bool is_list = kind == K_LIST;
    if (is_list ? !PyList_Check(value) : !PyTuple_Check(value)) {
        PyErr_SetString(PyExc_TypeError, is_list ? "expected list" : "expected tuple");
        return -1;
    }
    PyObject *element = PyTuple_GET_ITEM(desc, 1);
    Py_ssize_t size = is_list ? PyList_GET_SIZE(value) : PyTuple_GET_SIZE(value);
    if (!is_list && PyTuple_GET_SIZE(element) != size) {
        PyErr_SetString(PyExc_TypeError, "tuple of the wrong length");
        return -1;
    }
    val holder = {.kind = (uint8_t)kind};
    api->vallist_new_uninit(&holder.of.list, (size_t)size);
    if (size) memset(holder.of.list.data, 0, sizeof(val) * (size_t)size);   /* all `false` */
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *item = is_list ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i);
        if (wit_lower(api, context, item, is_list ? element : PyTuple_GET_ITEM(element, i),
                  &holder.of.list.data[i]) < 0) {
            api->val_delete(&holder);
            return -1;
        }
    }
    *out = holder;
    return 0;
}

static int lower_record(const api_t *api, void *context, PyObject *value, PyObject *desc,
                        val *out) {
    PyObject *names = PyTuple_GET_ITEM(desc, 1), *fields = PyTuple_GET_ITEM(desc, 2);
    Py_ssize_t size = PyTuple_GET_SIZE(names);
    val holder = {.kind = K_RECORD};
    api->valrecord_new_uninit(&holder.of.record, (size_t)size);
    if (size) memset(holder.of.record.data, 0, sizeof(record_entry) * (size_t)size);
    for (Py_ssize_t i = 0; i < size; i++) {     /* every name first: a delete sees whole names */
        if (set_bytes(api, PyTuple_GET_ITEM(names, i), &holder.of.record.data[i].name) < 0) {
            for (Py_ssize_t j = i; j < size; j++)
                api->byte_vec_new(&holder.of.record.data[j].name, 0, "");
            api->val_delete(&holder);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *field = PyObject_GetAttr(value, PyTuple_GET_ITEM(names, i));
        int failed = field == NULL || wit_lower(api, context, field, PyTuple_GET_ITEM(fields, i),
                                                &holder.of.record.data[i].value) < 0;
        Py_XDECREF(field);
        if (failed) { api->val_delete(&holder); return -1; }
    }
    *out = holder;
    return 0;
}

/* The case a Python value takes: by its tag (tagged) or by its class (untagged). */
static Py_ssize_t choose_case(const api_t *api, PyObject *value, PyObject *desc, int tagged) {
    PyObject *names = PyTuple_GET_ITEM(desc, 1), *classes = PyTuple_GET_ITEM(desc, 4);
    PyObject *tag = NULL;
    if (tagged) {
        int is_variant = PyObject_IsInstance(value, api->variant_class);
        if (is_variant <= 0) {
            if (is_variant == 0) PyErr_SetString(PyExc_TypeError, "expected Variant type");
            return -1;
        }
        tag = PyObject_GetAttrString(value, "tag");
        if (tag == NULL) return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        int match;
        PyObject *case_classes = PyTuple_GET_ITEM(classes, i);
        if (tagged) match = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, i), tag, Py_EQ);
        else if (PyTuple_GET_ITEM(PyTuple_GET_ITEM(desc, 2), i) == Py_None)
            match = value == Py_None;
        else match = PyObject_IsInstance(value, case_classes);
        if (match < 0) { Py_XDECREF(tag); return -1; }
        if (match) { Py_XDECREF(tag); return i; }
    }
    Py_XDECREF(tag);
    PyErr_SetString(PyExc_ValueError, "value not valid for this variant");
    return -1;
}

static int lower_variant(const api_t *api, void *context, PyObject *value, PyObject *desc,
                         long kind, val *out) {
    int tagged = PyObject_IsTrue(PyTuple_GET_ITEM(desc, 3));
    Py_ssize_t index = choose_case(api, value, desc, tagged);
    if (index < 0) return -1;
    PyObject *case_desc = PyTuple_GET_ITEM(PyTuple_GET_ITEM(desc, 2), index);
    val inner = {.kind = K_BOOL};
    if (case_desc != Py_None) {
        PyObject *payload = tagged ? PyObject_GetAttrString(value, "payload") : Py_NewRef(value);
        if (payload == NULL) return -1;
        int failed = wit_lower(api, context, payload, case_desc, &inner);
        Py_DECREF(payload);
        if (failed < 0) return -1;
    }
    val holder = {.kind = (uint8_t)kind};
    if (kind == K_VARIANT && set_bytes(api, PyTuple_GET_ITEM(PyTuple_GET_ITEM(desc, 1), index),
                                       &holder.of.variant.discriminant) < 0) {
        api->val_delete(&inner);                 /* the payload's contents (nothing is boxed) */
        return -1;
    }
    val *boxed = case_desc == Py_None ? NULL : api->val_new(&inner);
    if (kind == K_OPTION) {
        holder.of.option = boxed;
    } else if (kind == K_RESULT) {
        holder.of.result.is_ok = index == 0;
        holder.of.result.val = boxed;
    } else {
        holder.of.variant.val = boxed;
    }
    *out = holder;
    return 0;
}

/* An owned host resource from a (rep, type id) tuple (host/sandbox/wasm/wit_codec.py HostResource). */
static int lower_resource(const api_t *api, void *context, PyObject *value, val *out) {
    if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2) {
        PyErr_SetString(PyExc_TypeError, "expected a HostResource (rep, type id)");
        return -1;
    }
    unsigned long rep = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(value, 0));
    unsigned long type = rep == (unsigned long)-1 && PyErr_Occurred()
        ? 0 : PyLong_AsUnsignedLong(PyTuple_GET_ITEM(value, 1));
    if (PyErr_Occurred()) return -1;
    if (rep > UINT32_MAX || type > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "resource rep or type id above 2**32 - 1");
        return -1;
    }
    if (context == NULL) {
        PyErr_SetString(PyExc_ValueError, "lowering a resource needs the store's context");
        return -1;
    }
    resource_host *host = api->host_new(true, (uint32_t)rep, (uint32_t)type);
    resource_any *any = NULL;
    wasmtime_error *error = api->host_to_any(context, host, &any);
    api->host_delete(host);
    if (error != NULL) {
        api->error_delete(error);
        PyErr_SetString(PyExc_RuntimeError, "a host resource could not be handed to the guest");
        return -1;
    }
    out->kind = K_RESOURCE;
    out->of.resource = any;
    return 0;
}

/* Lower `value` into `out` (its kind set only once complete; on failure it is left untouched). */
int wit_lower(const api_t *api, void *context, PyObject *value, PyObject *desc, val *out) {
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(desc, 0));
    switch (kind) {
    case K_LIST: case K_TUPLE: return lower_sequence(api, context, value, desc, kind, out);
    case K_RECORD: return lower_record(api, context, value, desc, out);
    case K_VARIANT: case K_OPTION: case K_RESULT:
        return lower_variant(api, context, value, desc, kind, out);
    case K_RESOURCE: return lower_resource(api, context, value, out);
    default: {
        val holder = {.kind = (uint8_t)kind};
        if (lower_scalar(api, value, kind, &holder) < 0) return -1;
        *out = holder;
        return 0;
    }
    }
}
