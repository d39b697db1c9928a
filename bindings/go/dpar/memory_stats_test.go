package dpar

import (
	"errors"
	"strings"
	"testing"
)

// What each replica's device holds after a step: at least its parameters and gradients, a peak no lower, a reset
// peak at what is held; a replica out of range refused by value.
func TestMemoryStats(t *testing.T) {
	m := smallMLP(t)
	defer m.Close()
	const elements = 6*8 + 8 + 8*3 + 3
	e, err := NewEngine(m, Options{Optimizer: SGD, LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	x, y := reductionBatch(t, 0)
	if _, err := e.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < 2; r++ {
		s, err := e.MemoryStats(r)
		if err != nil {
			t.Fatal(err)
		}
		if s.AllocatedBytes < 2*4*elements || s.PeakBytes < s.AllocatedBytes {
			t.Fatalf("replica %d: %+v; want at least %d bytes held and a peak no lower", r, s, 2*4*elements)
		}
		if err := e.ResetPeakMemory(r); err != nil {
			t.Fatal(err)
		}
		if s, err = e.MemoryStats(r); err != nil || s.PeakBytes != s.AllocatedBytes {
			t.Fatalf("replica %d after the reset: %+v, %v; want the peak at what is held", r, s, err)
		}
	}
	if _, err := e.MemoryStats(2); !errors.Is(err, ErrInvalidArg) || !strings.Contains(err.Error(), "replica: 2") {
		t.Fatalf("replica 2: %v", err)
	}
	if err := e.ResetPeakMemory(2); !errors.Is(err, ErrInvalidArg) || !strings.Contains(err.Error(), "replica: 2") {
		t.Fatalf("reset replica 2: %v", err)
	}
}
