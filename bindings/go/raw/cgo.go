// Package raw is dpar's C ABI one to one, as SWIG generates it from bindings/swig/dpar.i (with unsafe.Pointer for
// every buffer and output, so that cgo's pointer checks apply). Use package dpar.dev/go/dpar instead.
//
// libdpar is found in the CMake build tree of this checkout (build/); elsewhere set CGO_CFLAGS=-I<include dir>
// and CGO_LDFLAGS="-L<lib dir> -Wl,-rpath,<lib dir>".
package raw

// #cgo CFLAGS: -I${SRCDIR}/../../../include
// #cgo LDFLAGS: -L${SRCDIR}/../../../build -Wl,-rpath,${SRCDIR}/../../../build -ldpar
import "C"
