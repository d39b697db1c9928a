package dpar

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// paramsAfter is replica 0's parameters after three reference steps with the given options.
func paramsAfter(t *testing.T, o Options) []float32 {
	t.Helper()
	m := referenceModel(t)
	defer m.Close()
	o.Devices, o.Processes = 2, ProcessesSingle
	e, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	x, y := referenceBatch(t)
	for i := 0; i < 3; i++ {
		if _, err := e.TrainStep(x, y); err != nil {
			t.Fatal(err)
		}
	}
	n, _ := m.NumParamElements()
	p, err := e.Params(0, n)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func equal(a, b []float32) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return len(a) == len(b)
}

// Each option changes the parameters after a few steps: one dropped on the way to dpar would not.
func TestEveryOptimizerOptionReachesDpar(t *testing.T) {
	adam := Options{Optimizer: Adam, LR: 0.01}
	base := paramsAfter(t, adam)
	for name, change := range map[string]func(*Options){
		"Beta1": func(o *Options) { o.Beta1 = 0.5 }, "Beta2": func(o *Options) { o.Beta2 = 0.9 },
		"Eps": func(o *Options) { o.Eps = 0.1 }, "WeightDecay": func(o *Options) { o.WeightDecay = 0.5 },
	} {
		o := adam
		change(&o)
		if equal(paramsAfter(t, o), base) {
			t.Errorf("Adam with %s set: the same parameters as without", name)
		}
	}
	sgd := Options{LR: 0.1, Momentum: 0.9}
	base = paramsAfter(t, sgd)
	for name, change := range map[string]func(*Options){
		"Dampening": func(o *Options) { o.Dampening = 0.5 }, "Nesterov": func(o *Options) { o.Nesterov = true },
	} {
		o := sgd
		change(&o)
		if equal(paramsAfter(t, o), base) {
			t.Errorf("SGD with %s set: the same parameters as without", name)
		}
	}
}

func TestEngineOptionsReachDpar(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	one, no := int32(1), false
	e, err := NewEngine(m, Options{Devices: 3, OutputDevice: &one, BLASThreads: 1, PinWorkers: &no,
		TimeoutSeconds: 30, FirstBucketBytes: 64, BucketCapBytes: 64, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if n, err := e.NumBuckets(); err != nil || n < 2 {
		t.Fatalf("64-byte buckets: %d buckets (%v), want several", n, err)
	}
	five := int32(5)
	if _, err := NewEngine(m, Options{Devices: 2, OutputDevice: &five, Processes: ProcessesSingle}); err == nil {
		t.Fatal("an output device that is not one of the devices was accepted")
	}
}

// CreateTimeoutSeconds reaches dpar: a negative or NaN one is refused by name, and a finite or infinite one
// creates an engine that trains.
func TestCreateTimeoutSecondsReachesDpar(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	for _, bad := range []float64{-1, math.NaN()} {
		_, err := NewEngine(m, Options{Devices: 2, Processes: ProcessesSingle, CreateTimeoutSeconds: bad})
		var de *Error
		if !errors.As(err, &de) || de.Status != ErrInvalidArg || !strings.Contains(de.Message, "create_timeout_seconds") {
			t.Fatalf("CreateTimeoutSeconds %v gave %v, want ErrInvalidArg naming create_timeout_seconds", bad, err)
		}
	}
	x, y := referenceBatch(t)
	for _, good := range []float64{30, math.Inf(1)} {
		e, err := NewEngine(m, Options{Devices: 2, Processes: ProcessesSingle, CreateTimeoutSeconds: good})
		if err != nil {
			t.Fatalf("CreateTimeoutSeconds %v: %v", good, err)
		}
		if loss, err := e.TrainStep(x, y); err != nil || !(loss > 0) {
			t.Fatalf("CreateTimeoutSeconds %v: TrainStep gave %v, %v", good, loss, err)
		}
		e.Close()
	}
}
