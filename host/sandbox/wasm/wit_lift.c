/* Lifting: libwasmtime's component values -> Python objects (see wit_values.c). */
#include <string.h>

#include "wit_values.h"

static PyObject *kind_error(long expected, int got) {
    return PyErr_Format(PyExc_TypeError, "expected a value of kind %ld, got kind %d", expected,
                        got);
}

static PyObject *lift_scalar(const val *v, long kind) {
    switch (kind) {
    case K_BOOL: return PyBool_FromLong(v->of.boolean);
    case K_S8: return PyLong_FromLong(v->of.s8);
    case K_U8: return PyLong_FromLong(v->of.u8);
    case K_S16: return PyLong_FromLong(v->of.s16);
    case K_U16: return PyLong_FromLong(v->of.u16);
    case K_S32: return PyLong_FromLong(v->of.s32);
    case K_U32: return PyLong_FromUnsignedLong(v->of.u32);
    case K_S64: return PyLong_FromLongLong(v->of.s64);
    case K_U64: return PyLong_FromUnsignedLongLong(v->of.u64);
    case K_F32: return PyFloat_FromDouble((double)v->of.f32);
    case K_F64: return PyFloat_FromDouble(v->of.f64);
    case K_CHAR: return PyUnicode_FromOrdinal((int)v->of.character);
    case K_STRING: case K_ENUM:
        return PyUnicode_DecodeUTF8(v->of.string.data, (Py_ssize_t)v->of.string.size, "strict");
    default: return PyErr_Format(PyExc_ValueError, "no scalar kind %ld", kind);
    }
}

static PyObject *lift_sequence(const api_t *api, void *context, const val_vec *items,
                               PyObject *desc, long kind) {
    bool is_list = kind == K_LIST;
    PyObject *element = PyTuple_GET_ITEM(desc, 1);
    if (!is_list && PyTuple_GET_SIZE(element) != (Py_ssize_t)items->size)
        return PyErr_Format(PyExc_TypeError, "tuple of %zu values for %zd types", items->size,
                            PyTuple_GET_SIZE(element));
    PyObject *out = is_list ? PyList_New((Py_ssize_t)items->size)
                            : PyTuple_New((Py_ssize_t)items->size);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < items->size; i++) {
        PyObject *item = wit_lift(api, context, &items->data[i],
                              is_list ? element : PyTuple_GET_ITEM(element, (Py_ssize_t)i));
        if (item == NULL) { Py_DECREF(out); return NULL; }
        if (is_list) PyList_SET_ITEM(out, (Py_ssize_t)i, item);
        else PyTuple_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    return out;
}

static PyObject *lift_record(const api_t *api, void *context, const val *v, PyObject *desc) {
    PyObject *names = PyTuple_GET_ITEM(desc, 1), *fields = PyTuple_GET_ITEM(desc, 2);
    if ((Py_ssize_t)v->of.record.size != PyTuple_GET_SIZE(names))
        return PyErr_Format(PyExc_TypeError, "record of %zu fields, expected %zd",
                            v->of.record.size, PyTuple_GET_SIZE(names));
    PyObject *record = PyObject_CallNoArgs(api->record_class);
    if (record == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *field = wit_lift(api, context, &v->of.record.data[i].value,
                                   PyTuple_GET_ITEM(fields, i));
        int failed = field == NULL || PyObject_SetAttr(record, PyTuple_GET_ITEM(names, i), field);
        Py_XDECREF(field);
        if (failed) { Py_DECREF(record); return NULL; }
    }
    return record;
}

/* The case index of a variant-like value and its payload pointer (NULL: none). */
static Py_ssize_t variant_case(const val *v, long kind, PyObject *names, const val **payload) {
    if (kind == K_OPTION) { *payload = v->of.option; return v->of.option != NULL; }
    if (kind == K_RESULT) { *payload = v->of.result.val; return v->of.result.is_ok ? 0 : 1; }
    *payload = v->of.variant.val;
    const byte_vec *tag = &v->of.variant.discriminant;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        Py_ssize_t size;
        const char *name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(names, i), &size);
        if (name != NULL && (size_t)size == tag->size && memcmp(name, tag->data, tag->size) == 0)
            return i;
    }
    PyErr_Format(PyExc_ValueError, "variant case %.*s not in its type", (int)tag->size, tag->data);
    return -1;
}

static PyObject *lift_variant(const api_t *api, void *context, const val *v, PyObject *desc,
                              long kind) {
    PyObject *names = PyTuple_GET_ITEM(desc, 1), *cases = PyTuple_GET_ITEM(desc, 2);
    int tagged = PyObject_IsTrue(PyTuple_GET_ITEM(desc, 3));
    const val *payload_val;
    Py_ssize_t index = variant_case(v, kind, names, &payload_val);
    if (index < 0) return NULL;
    PyObject *case_desc = PyTuple_GET_ITEM(cases, index), *payload;
    if (case_desc == Py_None) {
        payload = Py_NewRef(Py_None);
    } else {
        if (payload_val == NULL)
            return PyErr_Format(PyExc_TypeError, "variant case %zd without its payload", index);
        payload = wit_lift(api, context, payload_val, case_desc);
        if (payload == NULL) return NULL;
    }
    if (!tagged) return payload;
    PyObject *tag = PyTuple_GET_ITEM(names, index);
    PyObject *out = case_desc == Py_None
        ? PyObject_CallOneArg(api->variant_class, tag)
        : PyObject_CallFunctionObjArgs(api->variant_class, tag, payload, NULL);
    Py_DECREF(payload);
    return out;
}

/* A resource argument (own or borrow of a host resource): its rep, as an int. */
static PyObject *lift_resource(const api_t *api, void *context, const val *v) {
    if (context == NULL)
        return PyErr_Format(PyExc_ValueError, "lifting a resource needs the store's context");
    resource_host *host = NULL;
    wasmtime_error *error = api->any_to_host(context, v->of.resource, &host);
    if (error != NULL) {
        api->error_delete(error);
        return PyErr_Format(PyExc_TypeError, "a resource argument that is not a host resource");
    }
    uint32_t rep = api->host_rep(host);
    api->host_delete(host);
    return PyLong_FromUnsignedLong(rep);
}

PyObject *wit_lift(const api_t *api, void *context, const val *v, PyObject *desc) {
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(desc, 0));
    if (v->kind != kind) return kind_error(kind, v->kind);
    switch (kind) {
    case K_RESOURCE: return lift_resource(api, context, v);
    case K_LIST: case K_TUPLE: return lift_sequence(api, context, &v->of.list, desc, kind);
    case K_RECORD: return lift_record(api, context, v, desc);
    case K_VARIANT: case K_OPTION: case K_RESULT: return lift_variant(api, context, v, desc, kind);
    default: return lift_scalar(v, kind);
    }
}
