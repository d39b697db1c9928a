package dpar

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// Linear(6, 8), ReLU, Linear(8, 3), seeded 3: the model of the precision, reduce-dtype, reproducible and memory tests.
func smallMLP(t *testing.T) *Model {
	m, err := NewModel(3)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Linear(6, 8, true); err != nil {
		m.Close()
		t.Fatal(err)
	}
	if err := m.Activation(ReLU); err != nil {
		m.Close()
		t.Fatal(err)
	}
	if err := m.Linear(8, 3, true); err != nil {
		m.Close()
		t.Fatal(err)
	}
	return m
}

// The precision policy's settings: f32 by default, fp16 refused, TF32 absent on CPU devices, and bf16 either
// training or refused as a whole (a CPU without bf16 arithmetic), never half set.
func TestPrecisionPolicy(t *testing.T) {
	m := smallMLP(t)
	defer m.Close()
	e, err := NewEngine(m, Options{Optimizer: SGD, LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if p, err := e.Precision(); err != nil || p != PrecisionF32 {
		t.Fatalf("precision %v, %v; want f32", p, err)
	}
	// f16: accepted, or refused whole with the reason (CPU devices: oneDNN has no f16 GEMM for them).
	if err := e.SetPrecision(PrecisionF16); err == nil {
		if p, _ := e.Precision(); p != PrecisionF16 {
			t.Fatalf("f16 accepted, precision %v", p)
		}
		if err := e.SetPrecision(PrecisionF32); err != nil {
			t.Fatal(err)
		}
	} else if !errors.Is(err, ErrNotSupported) || !strings.Contains(err.Error(), "f16") {
		t.Fatalf("f16: %v", err)
	} else if p, _ := e.Precision(); p != PrecisionF32 {
		t.Fatalf("a refused f16 changed the precision to %v", p)
	}
	if err := e.SetPrecision(Precision(7)); err == nil || !strings.Contains(err.Error(), "compute_dtype") {
		t.Fatalf("7: %v", err)
	}
	if has, err := e.SetAllowTF32(true); err != nil || has {
		t.Fatalf("TF32 on CPU devices: %v, %v", has, err)
	}
	x, y := reductionBatch(t, 0)
	if err := e.SetPrecision(PrecisionBF16); err != nil {
		if !errors.Is(err, ErrNotSupported) {
			t.Fatal(err)
		}
		if p, _ := e.Precision(); p != PrecisionF32 {
			t.Fatalf("a refused precision changed it to %v", p)
		}
		return
	}
	if p, err := e.Precision(); err != nil || p != PrecisionBF16 {
		t.Fatalf("precision %v, %v; want bf16", p, err)
	}
	loss, err := e.TrainStep(x, y)
	if err != nil || math.IsNaN(float64(loss)) {
		t.Fatalf("bf16 step: %v, %v", loss, err)
	}
}
