package dpar

/*
#include <stdint.h>
#include "dpar.h"

// Stops an engine's trace without writing it: SWIG's strings cannot be NULL.
static dpar_status dpar_go_trace_stop_only(uintptr_t engine) {
  return dpar_engine_trace_stop((dpar_engine *)engine, NULL);
}
*/
import "C"

import "dpar.dev/go/raw"

// TraceStart starts recording a timeline of the engine's calls (each replica's worker and communication thread,
// span by span), forgetting one recorded before.
func (e *Engine) TraceStart() error { return e.simple(raw.Dpar_engine_trace_start) }

// TraceStop stops recording and writes the timeline to path in Chrome's trace event format (ui.perfetto.dev,
// chrome://tracing), atomically; an empty path only stops. The timeline stays until the next TraceStart, so a
// failed write may be tried again with another path.
func (e *Engine) TraceStop(path string) error {
	if path == "" {
		return e.simple(func(x raw.Struct_SS_dpar_engine) int {
			return int(C.dpar_go_trace_stop_only(C.uintptr_t(x.Swigcptr())))
		})
	}
	return e.simple(func(x raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_trace_stop(x, path) })
}
