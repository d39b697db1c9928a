package dpar

/*
#cgo pkg-config: dpar
#include <stdint.h>
#include <stdlib.h>
#include "dpar.h"

extern dpar_status goDparForwardHook(uintptr_t handle, size_t replica, int64_t *in, size_t in_ndim, int64_t *out,
                                     size_t out_ndim);
extern void goDparRelease(uintptr_t handle);

// C function pointers cannot be made in Go: these trampolines carry a cgo.Handle as dpar's payload.
static dpar_status dpar_go_hook(void *payload, size_t replica, const int64_t *in, size_t in_ndim,
                                const int64_t *out, size_t out_ndim) {
  return goDparForwardHook((uintptr_t)payload, replica, (int64_t *)in, in_ndim, (int64_t *)out, out_ndim);
}
static void dpar_go_release(void *payload) { goDparRelease((uintptr_t)payload); }
static dpar_status dpar_go_set_forward_hook(uintptr_t engine, uintptr_t handle) {
  if (!handle) return dpar_engine_set_forward_hook((dpar_engine *)engine, NULL, NULL, NULL);
  return dpar_engine_set_forward_hook((dpar_engine *)engine, dpar_go_hook, (void *)handle, dpar_go_release);
}
*/
import "C"

import (
	"errors"
	"runtime"
	"runtime/cgo"
	"unsafe"
)

// SetForwardHook installs hook, called by every replica on its worker thread after its forward with its chunk's
// input and output shapes (concurrently across replicas); nil removes it. A returned error fails the engine call
// with its message (an *Error keeps its status). dpar releases the hook's handle when it no longer needs it.
func (e *Engine) SetForwardHook(hook func(replica int, input, output []int64) error) error {
	var h cgo.Handle
	if hook != nil {
		h = cgo.NewHandle(hook)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// dpar_engine_set_forward_hook is reached through cgo: the raw layer cannot pass C function pointers.
	s := int(C.dpar_go_set_forward_hook(C.uintptr_t(e.raw.Swigcptr()), C.uintptr_t(h)))
	runtime.KeepAlive(e)
	return errorOf(s)
}

func shapeOf(p *C.int64_t, n C.size_t) []int64 {
	return append([]int64(nil), unsafe.Slice((*int64)(unsafe.Pointer(p)), int(n))...)
}

// setCallbackError reports a callback's failure through dpar_set_error, on the worker thread that runs it.
func setCallbackError(err error) C.dpar_status {
	status := ErrInternal // the status of an error that carries none
	var de *Error
	var st Status // a bare status returned as an error
	if errors.As(err, &de) && de.Status < 0 {
		status = de.Status
	} else if errors.As(err, &st) && st < 0 {
		status = st
	}
	msg := C.CString(err.Error())
	defer C.free(unsafe.Pointer(msg))
	return C.dpar_set_error(C.dpar_status(status), msg)
}
