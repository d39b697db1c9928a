package dpar

// #include <stdint.h>
// #include <stddef.h>
import "C"

import (
	"fmt"
	"runtime/cgo"
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
