package dpar

/*
#include <stdint.h>
#include <stdlib.h>
#include "dpar.h"

extern dpar_status goDparCustomShape(uintptr_t handle, int64_t *out, size_t *out_ndim, int64_t *in, size_t in_ndim);
extern dpar_status goDparCustomRun(uintptr_t handle, dpar_custom_call *call, int backward);
extern void goDparRelease(uintptr_t handle);

// C function pointers cannot be made in Go: these trampolines carry a cgo.Handle of the layer as dpar's payload.
static dpar_status dpar_go_custom_shape(void *payload, int64_t *out, size_t *out_ndim, const int64_t *in,
                                        size_t in_ndim) {
  return goDparCustomShape((uintptr_t)payload, out, out_ndim, (int64_t *)in, in_ndim);
}
static dpar_status dpar_go_custom_forward(void *payload, const dpar_custom_call *call) {
  return goDparCustomRun((uintptr_t)payload, (dpar_custom_call *)call, 0);
}
static dpar_status dpar_go_custom_backward(void *payload, const dpar_custom_call *call) {
  return goDparCustomRun((uintptr_t)payload, (dpar_custom_call *)call, 1);
}
static void dpar_go_custom_release(void *payload) { goDparRelease((uintptr_t)payload); }

static void dpar_go_custom_bind(dpar_custom_layer *layer, uintptr_t handle) {
  layer->output_shape = dpar_go_custom_shape;
  layer->forward = dpar_go_custom_forward;
  layer->backward = dpar_go_custom_backward;
  layer->payload = (void *)handle;
  layer->destroy = dpar_go_custom_release;
}
static dpar_model *dpar_go_model(uintptr_t model) { return (dpar_model *)model; }

// A tensor's host memory and shape, for a Go slice over it.
static dpar_status dpar_go_view(const dpar_tensor *t, void **data, int64_t *shape, size_t *ndim) {
  dpar_status s = dpar_tensor_data(data, (dpar_tensor *)t);
  return s != DPAR_OK ? s : dpar_tensor_shape(shape, ndim, t, DPAR_MAX_DIMS);
}
static dpar_tensor *dpar_go_at(dpar_tensor *const *ts, size_t i) { return ts[i]; }
*/
import "C"

import (
	"fmt"
	"runtime"
	"runtime/cgo"
	"unsafe"
)

// InitKind is how a custom layer's parameter is initialised (a dpar_init).
type InitKind int32

const (
	InitZeros   InitKind = 0 // all zeros
	InitUniform InitKind = 1 // uniform in [-Bound, Bound], from the model's seed
)

// ParamSpec is one parameter of a custom layer.
type ParamSpec struct {
	Name  string // "weight"; the model names it "<layer>.weight"
	Shape []int64
	Init  InitKind
	Bound float32 // for InitUniform
}

// CustomCall is what a custom layer's Forward or Backward receives: slices over the replica's memory, valid during
// the call only. Input, Params and (in Backward) Output and GradOutput are read-only.
type CustomCall struct {
	Replica     int
	DeviceKind  DeviceKind
	DeviceIndex int
	Training    bool
	InputShape  []int64
	Input       []float32
	OutputShape []int64
	Output      []float32 // Forward: to be written; Backward: what Forward wrote
	GradOutput  []float32 // Backward: dL/d output
	GradInput   []float32 // Backward: to be written with dL/d input; nil when dpar does not need it (first layer)
	Params      [][]float32
	Grads       [][]float32 // Backward: to be written (not added to) with dL/d param, in Params' order
}

// CustomLayer is a layer whose math is written in Go. Replicas call Forward and Backward concurrently, each from
// its own worker thread with its own tensors. A returned error fails the engine call with its message (an *Error
// keeps its status); a panic is recovered at the boundary and fails the call the same way.
type CustomLayer interface {
	// OutputShape is the output's shape for an input's (the batch extent first, kept).
	OutputShape(input []int64) ([]int64, error)
	Forward(c *CustomCall) error
	Backward(c *CustomCall) error
}

// Custom appends a layer written in Go, with its parameters (allocated, initialised, synchronised and optimised
// by dpar). dpar holds layer until the model and every engine built from it are closed.
func (m *Model) Custom(name string, params []ParamSpec, layer CustomLayer) error {
	if layer == nil {
		return &Error{Status: ErrInvalidArg, Message: "Custom: layer is nil"}
	}
	for _, p := range params {
		if len(p.Shape) < 1 || len(p.Shape) > 4 {
			return &Error{Status: ErrInvalidArg, Message: fmt.Sprintf("Custom: parameter %q: shape %v (1 to 4 extents)", p.Name, p.Shape)}
		}
	}
	// The description lives in C memory: dpar copies it, and cgo forbids C memory holding Go pointers.
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var specs *C.dpar_param_spec
	if len(params) > 0 {
		specs = (*C.dpar_param_spec)(C.calloc(C.size_t(len(params)), C.size_t(unsafe.Sizeof(C.dpar_param_spec{}))))
		defer C.free(unsafe.Pointer(specs))
		slots := unsafe.Slice(specs, len(params))
		for i := range slots {
			s := &slots[i]
			s.name = C.CString(params[i].Name)
			defer C.free(unsafe.Pointer(s.name))
			s.ndim = C.size_t(len(params[i].Shape))
			for d, e := range params[i].Shape {
				s.shape[d] = C.int64_t(e)
			}
			s.init = C.int32_t(params[i].Init)
			s.bound = C.float(params[i].Bound)
		}
	}
	var desc C.dpar_custom_layer
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := errorOf(int(C.dpar_custom_layer_init_sized(&desc, C.size_t(C.sizeof_dpar_custom_layer)))); err != nil {
		return err
	}
	desc.name = cname
	desc.params = specs
	desc.num_params = C.size_t(len(params))
	// From here dpar owns the handle, even when it refuses the layer (it calls destroy then).
	C.dpar_go_custom_bind(&desc, C.uintptr_t(cgo.NewHandle(layer)))
	s := C.dpar_model_add_custom(C.dpar_go_model(C.uintptr_t(m.raw.Swigcptr())), &desc)
	runtime.KeepAlive(m)
	return errorOf(int(s))
}

// views is the memory of n tensors (a layer's parameters or their gradients).
func views(ts **C.dpar_tensor, n int) ([][]float32, error) {
	var out [][]float32 // nil when there are none, as before
	for i := 0; i < n; i++ {
		v, _, err := view(C.dpar_go_at(ts, C.size_t(i)))
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// view is a tensor's memory as a []float32 and its shape (nil for a NULL tensor).
func view(t *C.dpar_tensor) ([]float32, []int64, error) {
	if t == nil {
		return nil, nil, nil
	}
	var data unsafe.Pointer
	var shape [4]C.int64_t
	var ndim C.size_t
	if s := C.dpar_go_view(t, &data, &shape[0], &ndim); s != 0 {
		return nil, nil, &Error{Status: Status(s), Message: "a custom layer's tensor: " + C.GoString(C.dpar_last_error())}
	}
	dims := make([]int64, int(ndim))
	n := int64(1)
	for i := range dims {
		dims[i] = int64(shape[i])
		n *= dims[i]
	}
	if n == 0 || data == nil {
		return []float32{}, dims, nil
	}
	return unsafe.Slice((*float32)(data), n), dims, nil
}

func customCall(c *C.dpar_custom_call, backward bool) (*CustomCall, error) {
	cc := &CustomCall{Replica: int(c.replica), DeviceKind: DeviceKind(c.device.kind), DeviceIndex: int(c.device.index),
		Training: c.training != 0}
	var err error
	if cc.Input, cc.InputShape, err = view(c.input); err != nil {
		return nil, err
	}
	if cc.Output, cc.OutputShape, err = view(c.output); err != nil {
		return nil, err
	}
	if cc.Params, err = views(c.params, int(c.num_params)); err != nil {
		return nil, err
	}
	if !backward {
		return cc, nil
	}
	if cc.GradOutput, _, err = view(c.grad_output); err != nil {
		return nil, err
	}
	if cc.GradInput, _, err = view(c.grad_input); err != nil {
		return nil, err
	}
	if cc.Grads, err = views(c.grads, int(c.num_params)); err != nil {
		return nil, err
	}
	return cc, nil
}
