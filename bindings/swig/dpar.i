/* dpar's C ABI for SWIG: the raw layers of the Python binding (bindings/python) and of the Go binding
 * (bindings/go/raw), one to one with dpar.h.
 * Python is built with -threads: every call releases Python's lock, so that dpar's worker threads can call back
 * into Python (a forward hook) while the caller waits in a training step.
 *
 * Go: every pointer that is not a handle (buffers, scalar outputs, shapes, and `T **out`) is an unsafe.Pointer, so
 * that cgo's pointer checks see it (SWIG's default uintptr would hide a Go pointer from them, and its default
 * for `T **out` is the same Go type as `T *`). The idiomatic package (bindings/go/dpar) passes the address of a
 * Go variable or slice element, which cgo allows for the duration of the call.
 *
 * Conventions of the Python raw layer:
 *  - a handle returned through `T **out` is returned (after the status) as a SWIG pointer, owned by the caller;
 *  - option structs and dpar_device are SWIG proxy classes;
 *  - every other pointer (buffers, scalar outputs, shapes) is passed as an integer address, so that the
 *    package on top points dpar at NumPy arrays without a copy (arr.ctypes.data) and keeps them alive;
 *  - functions that take C function pointers (custom layers, the forward hook) and DLPack's struct are reached
 *    through the dpar_py_* helpers below, which bridge Python callables and capsules. */
#ifdef SWIGPYTHON
%module(package="dpar", threads="1") raw
#else
%module raw
#endif

%{
#include "dpar.h"
%}

#ifdef SWIGGO
/* LP64 (64-bit Linux, which the Go binding targets): int64_t is long, as in the C headers. */
#define SWIGWORDSIZE64
#endif
%include <stdint.i>

#ifdef SWIGGO
%define DPAR_GO_POINTER(TYPES...)
%typemap(gotype) TYPES "unsafe.Pointer"
%typemap(imtype) TYPES "unsafe.Pointer"
%typemap(ctype) TYPES "void *"
%typemap(in) TYPES %{ $1 = ($1_ltype)$input; %}
%enddef
DPAR_GO_POINTER(void *, const void *, float *, const float *, int32_t *, const int32_t *, int64_t *,
                const int64_t *, size_t *, const size_t *, float *const *, dpar_status *, void **,
                dpar_tensor **, dpar_model **, dpar_engine **, dpar_dataset **, dpar_loader **,
                dpar_comm_group **, dpar_comm **, dpar_work **, dpar_reducer **)
%ignore dpar_engine_set_forward_hook;   /* C function pointers: the idiomatic package bridges them with cgo */
%ignore dpar_model_add_custom;
%ignore dpar_custom_layer_init;
%ignore dpar_custom_layer;
%ignore dpar_custom_call;
%ignore dpar_param_spec;
%ignore dpar_tensor_from_dlpack;        /* DLPack's structs: through cgo in the idiomatic package */
%ignore dpar_tensor_to_dlpack;
%include "dpar.h"
#endif

#ifdef SWIGPYTHON
%{
#include <Python.h>
#include <dlpack/dlpack.h>
%}

/* Handles returned through **out. */
%define DPAR_OUT_HANDLE(T)
%typemap(in, numinputs=0) T **out (T *tmp = NULL) { $1 = &tmp; }
%typemap(argout) T **out {
  $result = SWIG_Python_AppendOutput($result, SWIG_NewPointerObj(SWIG_as_voidptr(*$1), $*1_descriptor, 0));
}
%enddef
DPAR_OUT_HANDLE(dpar_tensor)
DPAR_OUT_HANDLE(dpar_model)
DPAR_OUT_HANDLE(dpar_engine)
DPAR_OUT_HANDLE(dpar_dataset)
DPAR_OUT_HANDLE(dpar_loader)
DPAR_OUT_HANDLE(dpar_comm_group)
DPAR_OUT_HANDLE(dpar_comm)
DPAR_OUT_HANDLE(dpar_work)
DPAR_OUT_HANDLE(dpar_reducer)

/* Buffers and scalar outputs: integer addresses. */
%typemap(in) void *, const void *, float *, const float *, int32_t *, const int32_t *, int64_t *, const int64_t *,
             size_t *, const size_t *, float *const *, dpar_status *, void ** {
  $1 = ($1_ltype)PyLong_AsVoidPtr($input);
  if (PyErr_Occurred()) SWIG_fail;
}
%typemap(typecheck, precedence=SWIG_TYPECHECK_POINTER) void *, const void *, float *, const float *, int32_t *,
    const int32_t *, int64_t *, const int64_t *, size_t *, const size_t *, float *const *, dpar_status *, void ** {
  $1 = PyLong_Check($input) ? 1 : 0;
}

/* Reached through the helpers (C function pointers, DLPack structs). */
%ignore dpar_engine_set_forward_hook;
%ignore dpar_model_add_custom;
%ignore dpar_custom_layer_init;
%ignore dpar_tensor_from_dlpack;
%ignore dpar_tensor_to_dlpack;
%ignore dpar_custom_layer;
%ignore dpar_custom_call;
%ignore dpar_param_spec;

%include "dpar.h"

/* ---- Helpers: Python callables as dpar callbacks, DLPack capsules ---------------------------------------- */
%nothread dpar_py_set_forward_hook;
%nothread dpar_py_tensor_from_dlpack;
%nothread dpar_py_tensor_to_dlpack;

%{
/* The message of the Python exception being raised, consumed. */
static void dpar_py_exception_message(char *buf, size_t size) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject *s = value ? PyObject_Str(value) : NULL;
  const char *text = s ? PyUnicode_AsUTF8(s) : NULL;
  const char *name = type ? ((PyTypeObject *)type)->tp_name : "exception";
  snprintf(buf, size, "%s: %s", name, text ? text : "");
  Py_XDECREF(s);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_Clear();
}

static PyObject *dpar_py_shape(const int64_t *shape, size_t ndim) {
  PyObject *t = PyTuple_New((Py_ssize_t)ndim);
  for (size_t i = 0; i < ndim; ++i) PyTuple_SET_ITEM(t, (Py_ssize_t)i, PyLong_FromLongLong(shape[i]));
  return t;
}

/* Runs on a worker thread: takes the GIL, calls hook(replica, input_shape, output_shape). An exception becomes
 * DPAR_ERR_INTERNAL (or the status of a DparError, read from its `status` attribute) with its text. */
static dpar_status dpar_py_hook(void *payload, size_t replica, const int64_t *in, size_t in_ndim,
                                const int64_t *out, size_t out_ndim) {
  PyGILState_STATE g = PyGILState_Ensure();
  dpar_status status = DPAR_OK;
  PyObject *r = PyObject_CallFunction((PyObject *)payload, "nNN", (Py_ssize_t)replica, dpar_py_shape(in, in_ndim),
                                      dpar_py_shape(out, out_ndim));
  if (!r) {
    status = DPAR_ERR_INTERNAL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && PyObject_HasAttrString(value, "status")) {
      PyObject *s = PyObject_GetAttrString(value, "status");
      long code = s ? PyLong_AsLong(s) : DPAR_ERR_INTERNAL;
      if (code < 0) status = (dpar_status)code;
      Py_XDECREF(s);
    }
    PyErr_Restore(type, value, tb);
    char buf[1024];
    dpar_py_exception_message(buf, sizeof buf);
    dpar_set_error(status, buf);
  }
  Py_XDECREF(r);
  PyGILState_Release(g);
  return status;
}

static void dpar_py_release(void *payload) {
  PyGILState_STATE g = PyGILState_Ensure();
  Py_DECREF((PyObject *)payload);
  PyGILState_Release(g);
}

/* Installs (callable) or removes (None) the forward hook. Holds a reference to the callable until dpar lets go. */
static dpar_status dpar_py_set_forward_hook(dpar_engine *engine, PyObject *hook) {
  dpar_status s;
  if (hook == Py_None) return dpar_engine_set_forward_hook(engine, NULL, NULL, NULL);
  Py_INCREF(hook);
  /* dpar may take the engine's lock and call dpar_py_release: without the GIL while it waits. */
  Py_BEGIN_ALLOW_THREADS
  s = dpar_engine_set_forward_hook(engine, dpar_py_hook, hook, dpar_py_release);
  Py_END_ALLOW_THREADS
  return s;
}

/* DLPack: a capsule named "dltensor" in, dpar owns it then (renamed "used_dltensor", as the protocol says). */
static PyObject *dpar_py_tensor_from_dlpack(PyObject *capsule) {
  DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
  if (!m) return NULL;
  dpar_tensor *t = NULL;
  dpar_status s = dpar_tensor_from_dlpack(&t, m);
  if (s == DPAR_OK) PyCapsule_SetName(capsule, "used_dltensor");
  return Py_BuildValue("iN", (int)s, SWIG_NewPointerObj(SWIG_as_voidptr(t), SWIGTYPE_p_dpar_tensor, 0));
}

static void dpar_py_capsule_deleter(PyObject *capsule) {
  if (PyCapsule_IsValid(capsule, "used_dltensor")) return; /* a consumer took it */
  DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
  if (m && m->deleter) m->deleter(m);
}

static PyObject *dpar_py_tensor_to_dlpack(dpar_tensor *tensor) {
  DLManagedTensor *m = NULL;
  dpar_status s = dpar_tensor_to_dlpack(&m, tensor);
  if (s != DPAR_OK) return Py_BuildValue("iO", (int)s, Py_None);
  return Py_BuildValue("iN", (int)s, PyCapsule_New(m, "dltensor", dpar_py_capsule_deleter));
}
%}

dpar_status dpar_py_set_forward_hook(dpar_engine *engine, PyObject *hook);
PyObject *dpar_py_tensor_from_dlpack(PyObject *capsule);
PyObject *dpar_py_tensor_to_dlpack(dpar_tensor *tensor);
#endif /* SWIGPYTHON */
