package dpar

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// reductionBatch is batch step of 11 rows of 6 features (6 and 5 per replica).
func reductionBatch(t *testing.T, step int) (*Tensor, *Tensor) {
	x := make([]float32, 66)
	for i := range x {
		x[i] = float32(((i+7*step)*37)%101)/101.0 - 0.5
	}
	y := make([]int32, 11)
	for r := range y {
		y[r] = int32((r + step) % 3)
	}
	xt, err := FromFloat32([]int64{11, 6}, x)
	if err != nil {
		t.Fatal(err)
	}
	yt, err := FromInt32([]int64{11}, y)
	if err != nil {
		t.Fatal(err)
	}
	return xt, yt
}

func paramBits(t *testing.T, e *Engine, replica, count int) []uint32 {
	params, err := e.Params(replica, count)
	if err != nil {
		t.Fatal(err)
	}
	bits := make([]uint32, len(params))
	for i, p := range params {
		bits[i] = math.Float32bits(p)
	}
	return bits
}

func equalBits(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// tracedStep is one training step, traced: its loss and the trace's text.
func tracedStep(t *testing.T, e *Engine, x, y *Tensor) (float32, string) {
	if err := e.TraceStart(); err != nil {
		t.Fatal(err)
	}
	loss, err := e.TrainStep(x, y)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "trace.json")
	if err := e.TraceStop(path); err != nil {
		t.Fatal(err)
	}
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return loss, string(text)
}

// The engine's trace shows its buckets reduce-scattered (ZeRO-2), and without clipping it trains to the bits of the
// all-reduce, over several buckets split unevenly between 2 CPU devices; switching between steps keeps them equal.
func TestReduceScatterTrainsToTheBitsOfTheAllReduce(t *testing.T) {
	m, err := NewModel(11)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, e := range []error{m.Linear(6, 16, true), m.Activation(ReLU), m.Linear(16, 8, true), m.Activation(ReLU),
		m.Linear(8, 3, true)} {
		if e != nil {
			t.Fatal(e)
		}
	}
	n, err := m.NumParamElements()
	if err != nil {
		t.Fatal(err)
	}
	// 128-byte buckets: 32 gradients each, several buckets, most of them not a multiple of 2.
	o := Options{Optimizer: Adam, LR: 0.01, Devices: 2, Processes: ProcessesSingle, FirstBucketBytes: 128,
		BucketCapBytes: 128}
	all, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer all.Close()
	scatter, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer scatter.Close()
	if err := scatter.SetGradientReduction(ReductionReduceScatter); err != nil {
		t.Fatal(err)
	}
	if err := all.SetGradientReduction(ReductionAllReduce); err != nil { // the default, set again
		t.Fatal(err)
	}
	if b, err := scatter.NumBuckets(); err != nil || b <= 2 {
		t.Fatalf("%d buckets (%v), want more than 2", b, err)
	}
	initial := paramBits(t, all, 0, n)
	for step := 0; step < 6; step++ {
		switch step { // switching between steps
		case 3:
			err = scatter.SetGradientReduction(ReductionAllReduceSharded) // one process: the same shards
		case 4:
			err = scatter.SetGradientReduction(ReductionAllReduce)
		case 5:
			err = scatter.SetGradientReduction(ReductionReduceScatter)
		}
		if err != nil {
			t.Fatal(err)
		}
		x, y := reductionBatch(t, step)
		var la, ls float32
		var errA, errS error
		if step == 0 {
			// The setting reached dpar: its buckets are reduce-scattered, the other engine's all-reduced.
			var traceA, traceS string
			la, traceA = tracedStep(t, all, x, y)
			ls, traceS = tracedStep(t, scatter, x, y)
			if !strings.Contains(traceS, `"bucket reduce-scatter"`) || strings.Contains(traceS, `"bucket all-reduce"`) {
				t.Error("the reduce-scatter engine's trace has no reduce-scatter of its buckets, or an all-reduce")
			}
			if !strings.Contains(traceA, `"bucket all-reduce"`) || strings.Contains(traceA, `"bucket reduce-scatter"`) {
				t.Error("the all-reduce engine's trace has no all-reduce of its buckets, or a reduce-scatter")
			}
		} else {
			la, errA = all.TrainStep(x, y)
			ls, errS = scatter.TrainStep(x, y)
		}
		x.Close()
		y.Close()
		if errA != nil || errS != nil {
			t.Fatal(errA, errS)
		}
		if math.Float32bits(la) != math.Float32bits(ls) {
			t.Fatalf("step %d: loss %v with the reduce-scatter, %v with the all-reduce", step, ls, la)
		}
	}
	first := paramBits(t, all, 0, n)
	if equalBits(first, initial) {
		t.Fatal("training moved nothing")
	}
	for replica := 0; replica < 2; replica++ {
		if !equalBits(paramBits(t, scatter, replica, n), first) || !equalBits(paramBits(t, all, replica, n), first) {
			t.Fatalf("replica %d: the parameters differ from the all-reduce's replica 0", replica)
		}
	}
}

func TestAnUnknownGradientReductionIsRefused(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	var de *Error
	for _, bad := range []Reduction{3, -1} {
		if err := e.SetGradientReduction(bad); !errors.As(err, &de) || de.Status != ErrInvalidArg ||
			!strings.Contains(de.Message, "reduction") {
			t.Fatalf("reduction %d: %v, want an invalid-argument error that names the reduction", bad, err)
		}
	}
	if err := e.SetGradientReduction(ReductionReduceScatter); err != nil {
		t.Fatal(err)
	}
}

// SetWeightDecayExclusion steps the bias without weight decay and leaves the weights' step as it was.
func TestWeightDecayExclusionChangesTheBiasStepAlone(t *testing.T) {
	bn, err := NewModel(7)
	if err != nil {
		t.Fatal(err)
	}
	defer bn.Close()
	if err := bn.Linear(6, 3, true); err != nil {
		t.Fatal(err)
	}
	if err := bn.BatchNorm1d(3, 1e-5, 0.1, true); err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{true, false, false, false} {
		if got, err := bn.ParamDecays(i); err != nil || got != want {
			t.Fatalf("parameter %d decays: %v, %v; want %v", i, got, err, want)
		}
	}
	if _, err := bn.ParamDecays(4); err == nil || !strings.Contains(err.Error(), "index") {
		t.Fatalf("index 4: %v", err)
	}
	m, err := NewModel(7)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Linear(6, 3, true); err != nil {
		t.Fatal(err)
	}
	o := Options{Optimizer: AdamW, LR: 0.1, WeightDecay: 0.5, Devices: 2, Processes: ProcessesSingle}
	plain, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	excluding, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer excluding.Close()
	if err := excluding.SetWeightDecayExclusion(true); err != nil {
		t.Fatal(err)
	}
	x, y := reductionBatch(t, 0)
	for _, e := range []*Engine{plain, excluding} {
		if _, err := e.TrainStep(x, y); err != nil {
			t.Fatal(err)
		}
	}
	a, b := paramBits(t, plain, 0, 21), paramBits(t, excluding, 0, 21)
	for i := 0; i < 18; i++ {
		if a[i] != b[i] {
			t.Fatalf("weight element %d: %x against %x", i, a[i], b[i])
		}
	}
	for i := 18; i < 21; i++ {
		if a[i] == b[i] {
			t.Fatalf("bias element %d stepped as with decay", i-18)
		}
	}
}

// SetLossScaling by a power of two trains as no scaling, bit for bit; a NaN in a batch skips its step and backs the
// scale off; a bad factor is refused naming it.
func TestLossScalingSkipsAnOverflowedStep(t *testing.T) {
	m, err := NewModel(7)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Linear(6, 3, true); err != nil {
		t.Fatal(err)
	}
	o := Options{Optimizer: Adam, LR: 0.01, Devices: 2, Processes: ProcessesSingle}
	plain, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	scaled, err := NewEngine(m, o)
	if err != nil {
		t.Fatal(err)
	}
	defer scaled.Close()
	if s, err := scaled.LossScale(); err != nil || s != 1 {
		t.Fatalf("the scale of an engine without scaling: %v, %v", s, err)
	}
	if err := scaled.SetLossScaling(1024, 2, 1.5, 2); err == nil || !strings.Contains(err.Error(), "backoff_factor") {
		t.Fatalf("backoff_factor 1.5: %v", err)
	}
	if err := scaled.SetLossScaling(1024, 2, 0.5, 2); err != nil {
		t.Fatal(err)
	}
	for step := 0; step < 2; step++ {
		x, y := reductionBatch(t, step)
		for _, e := range []*Engine{plain, scaled} {
			if _, err := e.TrainStep(x, y); err != nil {
				t.Fatal(err)
			}
		}
	}
	if !equalBits(paramBits(t, plain, 0, 21), paramBits(t, scaled, 0, 21)) {
		t.Fatal("scaling by 1024 changed the training")
	}
	if s, err := scaled.LossScale(); err != nil || s != 2048 {
		t.Fatalf("the scale after 2 clean steps: %v, %v", s, err)
	}
	xs := make([]float32, 66)
	xs[0] = float32(math.NaN())
	x, err := FromFloat32([]int64{11, 6}, xs)
	if err != nil {
		t.Fatal(err)
	}
	_, y := reductionBatch(t, 0)
	before := paramBits(t, scaled, 0, 21)
	if _, err := scaled.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
	if skipped, err := scaled.LastStepSkipped(); err != nil || !skipped {
		t.Fatalf("the NaN step was not skipped: %v, %v", skipped, err)
	}
	if s, err := scaled.LossScale(); err != nil || s != 1024 {
		t.Fatalf("the scale after a skipped step: %v, %v", s, err)
	}
	if n, err := scaled.StepCount(); err != nil || n != 2 {
		t.Fatalf("step count after a skipped step: %v, %v", n, err)
	}
	if !equalBits(before, paramBits(t, scaled, 0, 21)) {
		t.Fatal("the skipped step changed the parameters")
	}
}
