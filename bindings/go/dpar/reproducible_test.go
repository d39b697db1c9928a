package dpar

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// The reproducible mode: off by default, a negative count refused by value, and the same bits from one device and
// from three.
func TestReproducible(t *testing.T) {
	m := smallMLP(t)
	defer m.Close()
	const elements = 6*8 + 8 + 8*3 + 3
	engines := make([]*Engine, 2)
	for i, devices := range []int{1, 3} {
		e, err := NewEngine(m, Options{Optimizer: SGD, LR: 0.1, Devices: devices, Processes: ProcessesSingle})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		engines[i] = e
	}
	one, three := engines[0], engines[1]
	if rows, err := three.Reproducible(); err != nil || rows != 0 {
		t.Fatalf("reproducible %v, %v; want 0", rows, err)
	}
	if err := three.SetReproducible(-2); !errors.Is(err, ErrInvalidArg) || !strings.Contains(err.Error(), "-2") {
		t.Fatalf("-2: %v", err)
	}
	for _, e := range engines {
		if err := e.SetReproducible(2); err != nil {
			t.Fatal(err)
		}
	}
	if rows, err := three.Reproducible(); err != nil || rows != 2 {
		t.Fatalf("reproducible %v, %v; want 2", rows, err)
	}
	for s := 0; s < 3; s++ {
		x, y := reductionBatch(t, s)
		a, err := one.TrainStep(x, y)
		if err != nil || math.IsNaN(float64(a)) {
			t.Fatalf("one device: %v, %v", a, err)
		}
		b, err := three.TrainStep(x, y)
		if err != nil || math.Float64bits(float64(a)) != math.Float64bits(float64(b)) {
			t.Fatalf("three devices: %v (one: %v), %v", b, a, err)
		}
	}
	p1, _ := one.Params(0, elements)
	p3, _ := three.Params(2, elements)
	for i := range p1 {
		if math.Float32bits(p1[i]) != math.Float32bits(p3[i]) {
			t.Fatalf("parameter %d: %v on one device, %v on three", i, p1[i], p3[i])
		}
	}
}
