package dpar

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// The reduce dtype: f32 by default, another dtype refused by name, and bf16 rounding the reduction for real (the
// parameters differ from f32's) while the replicas stay identical.
func TestReduceDtype(t *testing.T) {
	m := smallMLP(t)
	defer m.Close()
	const elements = 6*8 + 8 + 8*3 + 3
	engines := make([]*Engine, 2)
	for i := range engines {
		e, err := NewEngine(m, Options{Optimizer: SGD, LR: 0.1, Devices: 2, Processes: ProcessesSingle})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		engines[i] = e
	}
	plain, e := engines[0], engines[1]
	if d, err := e.ReduceDtype(); err != nil || d != ReduceF32 {
		t.Fatalf("reduce dtype %v, %v; want f32", d, err)
	}
	if err := e.SetReduceDtype(ReduceDtype(7)); !errors.Is(err, ErrInvalidArg) || !strings.Contains(err.Error(), "reduce_dtype") {
		t.Fatalf("7: %v", err)
	}
	if err := e.SetReduceDtype(ReduceBF16); err != nil {
		t.Fatal(err)
	}
	if d, err := e.ReduceDtype(); err != nil || d != ReduceBF16 {
		t.Fatalf("reduce dtype %v, %v; want bf16", d, err)
	}
	for s := 0; s < 3; s++ {
		x, y := reductionBatch(t, s)
		loss, err := e.TrainStep(x, y)
		if err != nil || math.IsNaN(float64(loss)) {
			t.Fatalf("bf16 step: %v, %v", loss, err)
		}
		if _, err := plain.TrainStep(x, y); err != nil {
			t.Fatal(err)
		}
	}
	p0, _ := e.Params(0, elements)
	p1, _ := e.Params(1, elements)
	f, _ := plain.Params(0, elements)
	same, differ := true, false
	for i := range p0 {
		same = same && math.Float32bits(p0[i]) == math.Float32bits(p1[i])
		differ = differ || p0[i] != f[i]
	}
	if !same || !differ {
		t.Fatalf("replicas identical %v, differs from f32 %v", same, differ)
	}
}
