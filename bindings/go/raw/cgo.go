// Package raw is dpar's C ABI one to one, as SWIG generates it from bindings/swig/dpar.i (with unsafe.Pointer for
// every buffer and output, so that cgo's pointer checks apply). Use package dpar.dev/go/dpar instead.
//
// raw.go and raw_wrap.c are SWIG's output, committed (scripts/gen_go_raw.sh regenerates them): building needs Go,
// a C compiler and dpar, found by pkg-config (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig for a prefix of its own).
package raw

// #cgo pkg-config: dpar
import "C"
