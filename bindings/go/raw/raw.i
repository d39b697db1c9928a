/* The Go raw layer: bindings/swig/dpar.i for SWIG's Go module. raw.go and raw_wrap.c beside it are SWIG's output,
 * committed so that the module builds with Go and a C compiler alone: scripts/gen_go_raw.sh regenerates them (run
 * it after changing dpar.h or dpar.i), and the CTest test go_raw_current fails while they are stale. This file is
 * not named .swig, or go build would run SWIG on it again. */
%include "../../swig/dpar.i"
