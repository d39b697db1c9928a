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
 *  - option structs and dpar_device are SWIG proxy classes, except an array of devices (an integer address);
 *  - every other pointer (buffers, scalar outputs, shapes) is passed as an integer address, so that the
 *    package on top points dpar at NumPy arrays without a copy (arr.ctypes.data) and keeps them alive;
 *  - functions that take C function pointers (custom layers, the forward hook) and DLPack's struct are reached
 *    through the dpar_py_* helpers below, which bridge Python callables and capsules. */
#ifdef SWIGPYTHON
%module(package="dpar", threads="1") raw
/* Each function's docstring starts with its parameters' names, "dpar_x(out, engine, input)": the package names
 * the argument SWIG refused with it, instead of passing on SWIG's "in method 'dpar_x', argument 2 of type ...". */
%feature("autodoc", "0");
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
                const int64_t *, const int64_t [ANY], size_t *, const size_t *, float *const *, dpar_status *, void **,
                void *const *, const dpar_device *devices, dpar_tensor **, dpar_model **, dpar_engine **, dpar_dataset **, dpar_loader **,
                dpar_comm_group **, dpar_comm **, dpar_work **, dpar_reducer **)
%ignore dpar_engine_set_forward_hook;   /* C function pointers: the idiomatic package bridges them with cgo */
%ignore dpar_model_add_custom;
%ignore dpar_custom_layer_init;
%ignore dpar_custom_layer_init_sized;
%ignore dpar_custom_layer;
%ignore dpar_custom_call;
%ignore dpar_param_spec;
%ignore dpar_tensor_from_dlpack;        /* DLPack's structs: through cgo in the idiomatic package */
%ignore dpar_tensor_to_dlpack;
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
             const int64_t [ANY], size_t *, const size_t *, float *const *, dpar_status *, void **, void *const *,
             const dpar_device *devices {
  $1 = ($1_ltype)PyLong_AsVoidPtr($input);
  if (PyErr_Occurred()) SWIG_fail;
}
%typemap(typecheck, precedence=SWIG_TYPECHECK_POINTER) void *, const void *, float *, const float *, int32_t *,
    const int32_t *, int64_t *, const int64_t *, const int64_t [ANY], size_t *, const size_t *, float *const *, dpar_status *, void **,
    void *const *, const dpar_device *devices {
  $1 = PyLong_Check($input) ? 1 : 0;
}

/* Reached through the helpers (C function pointers, DLPack structs). */
%ignore dpar_engine_set_forward_hook;
%ignore dpar_model_add_custom;
%ignore dpar_custom_layer_init;
%ignore dpar_custom_layer_init_sized;
%ignore dpar_tensor_from_dlpack;
%ignore dpar_tensor_to_dlpack;
%ignore dpar_custom_layer;
%ignore dpar_custom_call;
%ignore dpar_param_spec;

#endif /* SWIGPYTHON */

/* The declarations, for both languages: SWIG does not follow #include, so each per-topic header that dpar.h
 * includes is read here, in dpar.h's order (scripts/check_binding_parity.py compares the two lists). */
%include "dpar/common.h"
%include "dpar/tensor.h"
%include "dpar/dlpack.h"
%include "dpar/model.h"
%include "dpar/custom_layer.h"
%include "dpar/optimizer.h"
%include "dpar/engine.h"
%include "dpar/comm.h"
%include "dpar/reducer.h"
%include "dpar/data.h"

#ifdef SWIGPYTHON
/* ---- Helpers: Python callables as dpar callbacks, DLPack capsules ---------------------------------------- */
%nothread dpar_py_set_forward_hook;
%nothread dpar_py_model_add_custom;
%nothread dpar_py_tensor_from_dlpack;
%nothread dpar_py_tensor_to_dlpack;
%nothread dpar_py_tensor_to_dlpack_versioned;

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

/* The Python exception being raised as dpar's error: DPAR_ERR_INTERNAL, or the status of a DparError (read from
 * its `status` attribute), with the exception's text given to dpar_set_error. Consumes the exception. */
static dpar_status dpar_py_fail(void) {
  dpar_status status = DPAR_ERR_INTERNAL;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (value && PyObject_HasAttrString(value, "status")) {
    PyObject *s = PyObject_GetAttrString(value, "status");
    long code = s ? PyLong_AsLong(s) : DPAR_ERR_INTERNAL;
    if (code < 0) status = (dpar_status)code;
    Py_XDECREF(s);
    PyErr_Clear();
  }
  PyErr_Restore(type, value, tb);
  char buf[1024];
  dpar_py_exception_message(buf, sizeof buf);
  return dpar_set_error(status, buf);
}

/* Runs on a worker thread: takes the GIL, calls hook(replica, input_shape, output_shape). An exception becomes
 * DPAR_ERR_INTERNAL (or the status of a DparError, read from its `status` attribute) with its text. */
static dpar_status dpar_py_hook(void *payload, size_t replica, const int64_t *in, size_t in_ndim,
                                const int64_t *out, size_t out_ndim) {
  PyGILState_STATE g = PyGILState_Ensure();
  dpar_status status = DPAR_OK;
  PyObject *r = PyObject_CallFunction((PyObject *)payload, "nNN", (Py_ssize_t)replica, dpar_py_shape(in, in_ndim),
                                      dpar_py_shape(out, out_ndim));
  if (!r) status = dpar_py_fail();
  Py_XDECREF(r);
  PyGILState_Release(g);
  return status;
}

/* ---- Custom layers: the payload is the package's bridge object (dpar._CustomBridge), whose _output_shape,
 * _forward and _backward methods run on dpar's worker threads under the GIL. Tensors reach Python as
 * (address, shape) pairs, of which the package makes NumPy views. */
static PyObject *dpar_py_view(const dpar_tensor *t) {
  if (!t) Py_RETURN_NONE;
  void *data = NULL;
  int64_t shape[DPAR_MAX_DIMS];
  size_t ndim = 0;
  if (dpar_tensor_data(&data, (dpar_tensor *)t) != DPAR_OK || dpar_tensor_shape(shape, &ndim, t, DPAR_MAX_DIMS) != DPAR_OK) {
    PyErr_Format(PyExc_RuntimeError, "a custom layer's tensor: %s", dpar_last_error());
    return NULL;
  }
  return Py_BuildValue("(NN)", PyLong_FromVoidPtr(data), dpar_py_shape(shape, ndim));
}

static PyObject *dpar_py_views(dpar_tensor *const *ts, size_t n) {
  PyObject *t = PyTuple_New((Py_ssize_t)(ts ? n : 0));
  for (size_t i = 0; t && ts && i < n; ++i) {
    PyObject *v = dpar_py_view(ts[i]);
    if (!v) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, (Py_ssize_t)i, v);
  }
  return t;
}

static dpar_status dpar_py_custom_shape(void *payload, int64_t *out_shape, size_t *out_ndim, const int64_t *in_shape,
                                        size_t in_ndim) {
  PyGILState_STATE g = PyGILState_Ensure();
  dpar_status status = DPAR_OK;
  PyObject *r = PyObject_CallMethod((PyObject *)payload, "_output_shape", "(N)", dpar_py_shape(in_shape, in_ndim));
  PyObject *seq = r ? PySequence_Fast(r, "output_shape must return a sequence of extents") : NULL;
  if (seq) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > DPAR_MAX_DIMS) {
      PyErr_Format(PyExc_ValueError, "output_shape returned %zd extents (1 to %d)", n, DPAR_MAX_DIMS);
    } else {
      for (Py_ssize_t i = 0; i < n && !PyErr_Occurred(); ++i)
        out_shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
      *out_ndim = (size_t)n;
    }
  }
  if (PyErr_Occurred()) status = dpar_py_fail();
  Py_XDECREF(seq);
  Py_XDECREF(r);
  PyGILState_Release(g);
  return status;
}

static dpar_status dpar_py_custom_run(void *payload, const dpar_custom_call *c, const char *method) {
  PyGILState_STATE g = PyGILState_Ensure();
  dpar_status status = DPAR_OK;
  PyObject *args = Py_BuildValue("(niiiNNNNNN)", (Py_ssize_t)c->replica, (int)c->device.kind, (int)c->device.index,
                                 (int)c->training, dpar_py_view(c->input), dpar_py_view(c->output),
                                 dpar_py_view(c->grad_output), dpar_py_view(c->grad_input),
                                 dpar_py_views(c->params, c->num_params), dpar_py_views(c->grads, c->num_params));
  PyObject *r = args ? PyObject_CallMethod((PyObject *)payload, method, "(O)", args) : NULL;
  if (!r) status = dpar_py_fail();
  Py_XDECREF(r);
  Py_XDECREF(args);
  PyGILState_Release(g);
  return status;
}

static dpar_status dpar_py_custom_forward(void *payload, const dpar_custom_call *call) {
  return dpar_py_custom_run(payload, call, "_forward");
}

static dpar_status dpar_py_custom_backward(void *payload, const dpar_custom_call *call) {
  return dpar_py_custom_run(payload, call, "_backward");
}

static void dpar_py_release(void *payload) {
  if (!Py_IsInitialized()) return; /* freed after the interpreter: nothing left to release */
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

/* Appends a custom layer: name, specs (a sequence of (name, shape, init, bound)) and the bridge, which dpar holds
 * (a reference) until the model and every engine built from it are freed. Malformed specs raise TypeError or
 * ValueError here, before dpar sees the layer. */
static dpar_status dpar_py_model_add_custom(dpar_model *model, const char *name, PyObject *specs, PyObject *bridge) {
  PyObject *seq = PySequence_Fast(specs, "params must be a sequence of (name, shape, init, bound)");
  if (!seq) return dpar_py_fail();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  dpar_param_spec *ps = (dpar_param_spec *)calloc(n > 0 ? (size_t)n : 1, sizeof *ps);
  for (Py_ssize_t i = 0; ps && i < n && !PyErr_Occurred(); ++i) {
    PyObject *shape = NULL;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sOif", &ps[i].name, &shape, &ps[i].init, &ps[i].bound))
      break;
    PyObject *dims = PySequence_Fast(shape, "a parameter's shape must be a sequence of extents");
    if (!dims) break;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(dims);
    if (nd < 1 || nd > DPAR_MAX_DIMS)
      PyErr_Format(PyExc_ValueError, "parameter %s: %zd extents (1 to %d)", ps[i].name, nd, DPAR_MAX_DIMS);
    for (Py_ssize_t d = 0; d < nd && d < DPAR_MAX_DIMS && !PyErr_Occurred(); ++d)
      ps[i].shape[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(dims, d));
    ps[i].ndim = (size_t)nd;
    Py_DECREF(dims);
  }
  dpar_status s;
  if (!ps) {
    s = dpar_set_error(DPAR_ERR_OUT_OF_MEMORY, "custom layer: no memory for its parameter specs");
  } else if (PyErr_Occurred()) {
    s = dpar_py_fail();
  } else {
    dpar_custom_layer layer;
    dpar_custom_layer_init(&layer);
    layer.name = name;
    layer.params = ps;
    layer.num_params = (size_t)n;
    layer.output_shape = dpar_py_custom_shape;
    layer.forward = dpar_py_custom_forward;
    layer.backward = dpar_py_custom_backward;
    layer.payload = bridge;
    layer.destroy = dpar_py_release;
    Py_INCREF(bridge); /* dpar owns this reference from here, even when it refuses the layer */
    Py_BEGIN_ALLOW_THREADS
    s = dpar_model_add_custom(model, &layer);
    Py_END_ALLOW_THREADS
  }
  free(ps);
  Py_DECREF(seq);
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

/* DLPack 1.x's versioned tensor, as its dlpack.h lays it out. The C ABI exports DLPack 0.x's DLManagedTensor (the
 * dlpack.h installed here predates 1.0), so the versioned capsule a consumer asks for with max_version >= (1, 0)
 * wraps it: its manager_ctx is the unversioned tensor, whose deleter its own deleter calls. */
typedef struct {
  uint32_t major, minor;
} dpar_py_dlpack_version;
typedef struct dpar_py_managed_versioned {
  dpar_py_dlpack_version version;
  void *manager_ctx;
  void (*deleter)(struct dpar_py_managed_versioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} dpar_py_managed_versioned;
#define DPAR_PY_DLPACK_FLAG_IS_COPIED (1ULL << 1)

static void dpar_py_versioned_deleter(dpar_py_managed_versioned *v) {
  DLManagedTensor *m = (DLManagedTensor *)v->manager_ctx;
  if (m && m->deleter) m->deleter(m);
  free(v);
}

static void dpar_py_versioned_capsule_deleter(PyObject *capsule) {
  if (PyCapsule_IsValid(capsule, "used_dltensor_versioned")) return; /* a consumer took it */
  dpar_py_managed_versioned *v =
      (dpar_py_managed_versioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
  if (v && v->deleter) v->deleter(v);
}

/* A "dltensor_versioned" capsule (DLPack 1.0) of the tensor; `copied`: the tensor is a copy made for the consumer. */
static PyObject *dpar_py_tensor_to_dlpack_versioned(dpar_tensor *tensor, int copied) {
  DLManagedTensor *m = NULL;
  dpar_status s = dpar_tensor_to_dlpack(&m, tensor);
  if (s != DPAR_OK) return Py_BuildValue("iO", (int)s, Py_None);
  dpar_py_managed_versioned *v = (dpar_py_managed_versioned *)calloc(1, sizeof *v);
  if (!v) {
    m->deleter(m);
    return PyErr_NoMemory();
  }
  v->version.major = 1;
  v->version.minor = 0;
  v->manager_ctx = m;
  v->deleter = dpar_py_versioned_deleter;
  v->flags = copied ? DPAR_PY_DLPACK_FLAG_IS_COPIED : 0; /* not read-only: dpar's memory is writable */
  v->dl_tensor = m->dl_tensor; /* its shape and strides stay m's, alive until the deleter */
  PyObject *capsule = PyCapsule_New(v, "dltensor_versioned", dpar_py_versioned_capsule_deleter);
  if (!capsule) {
    dpar_py_versioned_deleter(v);
    return NULL;
  }
  return Py_BuildValue("iN", (int)s, capsule);
}
%}

dpar_status dpar_py_set_forward_hook(dpar_engine *engine, PyObject *hook);
dpar_status dpar_py_model_add_custom(dpar_model *model, const char *name, PyObject *specs, PyObject *bridge);
PyObject *dpar_py_tensor_from_dlpack(PyObject *capsule);
PyObject *dpar_py_tensor_to_dlpack(dpar_tensor *tensor);
PyObject *dpar_py_tensor_to_dlpack_versioned(dpar_tensor *tensor, int copied);
#endif /* SWIGPYTHON */
