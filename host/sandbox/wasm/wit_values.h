/* Shared by wit_values.c (the module), wit_lift.c and wit_lower.c: libwasmtime's component
 * value structs as wasmtime-py's ctypes lays them out, and the functions the module gets from
 * libwasmtime at init. See wit_values.c for the whole contract. */
#ifndef PIE_WIT_VALUES_H
#define PIE_WIT_VALUES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { K_BOOL = 0, K_S8, K_U8, K_S16, K_U16, K_S32, K_U32, K_S64, K_U64, K_F32, K_F64, K_CHAR,
       K_STRING, K_LIST, K_RECORD, K_TUPLE, K_VARIANT, K_ENUM, K_OPTION, K_RESULT, K_FLAGS,
       K_RESOURCE };

typedef struct { size_t size; char *data; } byte_vec;
struct val;
typedef struct { size_t size; struct val *data; } val_vec;
typedef struct record_entry record_entry;
typedef struct { size_t size; record_entry *data; } record_vec;
typedef struct { byte_vec discriminant; struct val *val; } variant_val;
typedef struct { bool is_ok; struct val *val; } result_val;
typedef struct resource_any resource_any;     /* libwasmtime's opaque handles */
typedef struct resource_host resource_host;
typedef struct wasmtime_error wasmtime_error;
typedef struct val {
    uint8_t kind;
    union {
        bool boolean; int8_t s8; uint8_t u8; int16_t s16; uint16_t u16; int32_t s32;
        uint32_t u32; int64_t s64; uint64_t u64; float f32; double f64; uint32_t character;
        byte_vec string; val_vec list; record_vec record; variant_val variant;
        struct val *option; result_val result; resource_any *resource;
    } of;
} val;
struct record_entry { byte_vec name; val value; };

typedef struct {
    void (*byte_vec_new)(byte_vec *out, size_t size, const char *data);
    void (*vallist_new_uninit)(val_vec *out, size_t size);
    void (*valrecord_new_uninit)(record_vec *out, size_t size);
    val *(*val_new)(val *value);
    void (*val_delete)(val *value);
    wasmtime_error *(*any_to_host)(void *context, const resource_any *any, resource_host **out);
    uint32_t (*host_rep)(const resource_host *host);
    void (*host_delete)(resource_host *host);
    resource_host *(*host_new)(bool owned, uint32_t rep, uint32_t type);
    wasmtime_error *(*host_to_any)(void *context, const resource_host *host, resource_any **out);
    void (*error_delete)(wasmtime_error *error);
    PyObject *record_class;
    PyObject *variant_class;
} api_t;


/* The value at `v` as a Python object (read only), per descriptor `desc`. */
PyObject *wit_lift(const api_t *api, void *context, const val *v, PyObject *desc);

/* Write `value` into `out` per `desc`; -1 with a Python exception (and `out` untouched). */
int wit_lower(const api_t *api, void *context, PyObject *value, PyObject *desc, val *out);

#endif
