package dpar

// #include <stdint.h>
// #include <stddef.h>
// #include "dpar.h"
import "C"

import (
	"fmt"
	"runtime/cgo"
	"unsafe"
)

//export goDparForwardHook
func goDparForwardHook(handle C.uintptr_t, replica C.size_t, in *C.int64_t, inNdim C.size_t, out *C.int64_t,
	outNdim C.size_t) (status int32) {
	hook := cgo.Handle(handle).Value().(func(int, []int64, []int64) error)
	defer func() {
		// A panic must not unwind into dpar's worker thread.
		if p := recover(); p != nil {
			status = int32(setCallbackError(fmt.Errorf("panic: %v", p)))
		}
	}()
	if err := hook(int(replica), shapeOf(in, inNdim), shapeOf(out, outNdim)); err != nil {
		return int32(setCallbackError(err))
	}
	return 0
}

//export goDparRelease
func goDparRelease(handle C.uintptr_t) {
	cgo.Handle(handle).Delete()
}

//export goDparCustomShape
func goDparCustomShape(handle C.uintptr_t, out *C.int64_t, outNdim *C.size_t, in *C.int64_t,
	inNdim C.size_t) (status int32) {
	layer := cgo.Handle(handle).Value().(CustomLayer)
	defer func() {
		if p := recover(); p != nil {
			status = int32(setCallbackError(fmt.Errorf("panic: %v", p)))
		}
	}()
	shape, err := layer.OutputShape(shapeOf(in, inNdim))
	if err == nil && (len(shape) < 1 || len(shape) > 4) {
		err = fmt.Errorf("OutputShape returned %v (1 to 4 extents)", shape)
	}
	if err != nil {
		return int32(setCallbackError(err))
	}
	dst := unsafe.Slice((*int64)(unsafe.Pointer(out)), len(shape))
	copy(dst, shape)
	*outNdim = C.size_t(len(shape))
	return 0
}

//export goDparCustomRun
func goDparCustomRun(handle C.uintptr_t, c *C.dpar_custom_call, backward C.int) (status int32) {
	layer := cgo.Handle(handle).Value().(CustomLayer)
	defer func() {
		if p := recover(); p != nil {
			status = int32(setCallbackError(fmt.Errorf("panic: %v", p)))
		}
	}()
	cc, err := customCall(c, backward != 0)
	if err == nil {
		if backward != 0 {
			err = layer.Backward(cc)
		} else {
			err = layer.Forward(cc)
		}
	}
	if err != nil {
		return int32(setCallbackError(err))
	}
	return 0
}
