package dpar

import (
	"math"
	"runtime"
	"testing"
)

// DataParallel's own path with Go slices: Forward's output as a []float32, the gradient of the mean squared error
// computed in Go, Backward and Step train over 2 CPU devices as TrainStep with the MSE loss does on an identical
// engine, whether the slices go through ForwardFloat32/BackwardFloat32 or through tensors made by FromFloat32.

const mseRows, mseIn, mseOut, mseSteps = 9, 4, 3, 3 // 9 rows: 5 and 4 per replica

func mseModel(t *testing.T) *Model {
	m, err := NewModel(5)
	if err != nil {
		t.Fatal(err)
	}
	must(t, m.Linear(mseIn, 8, true), m.Activation(Tanh), m.Linear(8, mseOut, true))
	return m
}

func mseEngine(t *testing.T, m *Model) *Engine {
	e, err := NewEngine(m, Options{LR: 0.1, Momentum: 0.9, Devices: 2, Loss: MSE, Seed: 3, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// mseBatch is the inputs (mseRows x mseIn) and targets (mseRows x mseOut), row-major.
func mseBatch() (x, y []float32) {
	x = make([]float32, mseRows*mseIn)
	for i := range x {
		x[i] = float32((i*37)%101)/101 - 0.5
	}
	y = make([]float32, mseRows*mseOut)
	for i := range y {
		y[i] = float32((i*53)%89)/89 - 0.5
	}
	return x, y
}

// mseGrad is d/d(out) of the mean of (out - y)^2 over every element, as PyTorch's mse_loss backward: 2 (out - y) / n.
func mseGrad(out, y []float32) []float32 {
	coef := float32(2 / float64(len(out)))
	g := make([]float32, len(out))
	for i := range out {
		g[i] = (out[i] - y[i]) * coef
	}
	return g
}

func mseOf(out, y []float32) float64 {
	s := 0.0
	for i := range out {
		d := float64(out[i]) - float64(y[i])
		s += d * d
	}
	return s / float64(len(out))
}

// forwardBackward runs one Forward, Backward and Step on e with slices, either through ForwardFloat32 and
// BackwardFloat32 or through tensors of FromFloat32 (closed before Backward: the engine holds the input's
// memory), and returns the loss computed from the output.
func forwardBackward(t *testing.T, e *Engine, x, y []float32, slices bool) float64 {
	var out *Tensor
	var err error
	if slices {
		out, err = e.ForwardFloat32([]int64{mseRows, mseIn}, x)
	} else {
		var in *Tensor
		if in, err = FromFloat32([]int64{mseRows, mseIn}, x); err != nil {
			t.Fatal(err)
		}
		out, err = e.Forward(in)
		in.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	shape, err := out.Shape()
	if err != nil || len(shape) != 2 || shape[0] != mseRows || shape[1] != mseOut {
		t.Fatalf("output shape %v (%v), want [%d %d]", shape, err, mseRows, mseOut)
	}
	values, err := out.Float32s()
	out.Close()
	if err != nil {
		t.Fatal(err)
	}
	// Memory freed too early would be handed out again here, with other values.
	keep := collectAndReuse(t, mseRows*mseIn, mseRows*mseOut)
	grad := mseGrad(values, y)
	given := append([]float32(nil), grad...)
	if slices {
		err = e.BackwardFloat32(shape, given)
	} else {
		var g *Tensor
		if g, err = FromFloat32(shape, given); err != nil {
			t.Fatal(err)
		}
		err = e.Backward(g)
		g.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	for i := range grad {
		if given[i] != grad[i] {
			t.Fatalf("Backward wrote the caller's gradient: [%d] = %v, was %v", i, given[i], grad[i])
		}
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(keep)
	return mseOf(values, y)
}

func TestForwardBackwardStepOnSlicesTrainsAsTrainStepWithMSE(t *testing.T) {
	xs, ys := mseBatch()
	for _, slices := range []bool{true, false} {
		name := map[bool]string{true: "ForwardFloat32 and BackwardFloat32", false: "FromFloat32 tensors"}[slices]
		t.Run(name, func(t *testing.T) {
			m := mseModel(t)
			defer m.Close()
			e, reference := mseEngine(t, m), mseEngine(t, m)
			defer e.Close()
			defer reference.Close()
			x, err := FromFloat32([]int64{mseRows, mseIn}, xs)
			if err != nil {
				t.Fatal(err)
			}
			defer x.Close()
			y, err := FromFloat32([]int64{mseRows, mseOut}, ys)
			if err != nil {
				t.Fatal(err)
			}
			defer y.Close()
			n, err := m.NumParamElements()
			if err != nil {
				t.Fatal(err)
			}
			initial, err := e.Params(0, n)
			if err != nil {
				t.Fatal(err)
			}
			for step := 0; step < mseSteps; step++ {
				want, err := reference.TrainStep(x, y)
				if err != nil {
					t.Fatal(err)
				}
				if got := forwardBackward(t, e, xs, ys, slices); math.Abs(got-float64(want)) > 1e-5*float64(want) {
					t.Fatalf("step %d: the loss of Forward's output is %v, TrainStep's %v", step, got, want)
				}
			}
			if steps, err := e.StepCount(); err != nil || steps != mseSteps {
				t.Fatalf("step count %d (%v), want %d", steps, err, mseSteps)
			}
			got, err := e.Params(0, n)
			if err != nil {
				t.Fatal(err)
			}
			want, err := reference.Params(0, n)
			if err != nil {
				t.Fatal(err)
			}
			// Go's 2/n and dpar's may differ in the last bit: the parameters agree within float rounding.
			moved := 0.0
			for i := range got {
				if d := math.Abs(float64(got[i] - want[i])); d > 1e-6+1e-5*math.Abs(float64(want[i])) {
					t.Fatalf("parameter %d: %v after Backward and Step, %v after TrainStep", i, got[i], want[i])
				}
				moved = math.Max(moved, math.Abs(float64(got[i]-initial[i])))
			}
			if moved < 1e-2 {
				t.Fatalf("the parameters moved by %v at most: nothing trained", moved)
			}
			other, err := e.Params(1, n)
			if err != nil || !equal(other, got) {
				t.Fatalf("replica 1's parameters differ from replica 0's (%v)", err)
			}
		})
	}
}

func TestBackwardFloat32RefusesAGradientOfTheWrongShape(t *testing.T) {
	m := mseModel(t)
	defer m.Close()
	e := mseEngine(t, m)
	defer e.Close()
	xs, ys := mseBatch()
	out, err := e.ForwardFloat32([]int64{mseRows, mseIn}, xs)
	if err != nil {
		t.Fatal(err)
	}
	values, err := out.Float32s()
	out.Close()
	if err != nil {
		t.Fatal(err)
	}
	if err := e.BackwardFloat32([]int64{mseRows, 2}, make([]float32, mseRows*2)); !isDparError(err, ErrInvalidArg,
		"must be shaped as forward's output") {
		t.Fatalf("a (9, 2) gradient gave %v", err)
	}
	if err := e.BackwardFloat32([]int64{mseRows, mseOut}, make([]float32, 5)); !isDparError(err, ErrInvalidArg,
		"bytes") {
		t.Fatalf("5 values for a (9, 3) gradient gave %v", err)
	}
	if _, err := e.ForwardFloat32([]int64{mseRows, 5}, make([]float32, mseRows*5)); !isDparError(err, ErrInvalidArg,
		"does not fit the model") {
		t.Fatalf("5 features gave %v", err)
	}
	// The refusals kept the forward: its backward and step still run.
	if err := e.BackwardFloat32([]int64{mseRows, mseOut}, mseGrad(values, ys)); err != nil {
		t.Fatal(err)
	}
	if err := e.Step(); err != nil {
		t.Fatal(err)
	}
}

// ForwardInt32 gives an Embedding's rows of the indices: the model's own weight, row by row.
func TestForwardInt32GivesTheEmbeddingsRowsOfTheIndices(t *testing.T) {
	m, err := NewModel(4)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	must(t, m.Embedding(6, 2))
	weight, err := m.GetParam(0) // 6 x 2
	if err != nil {
		t.Fatal(err)
	}
	e, err := NewEngine(m, Options{LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	indices := []int32{5, 0, 3, 3, 1}
	out, err := e.ForwardInt32([]int64{int64(len(indices))}, indices)
	if err != nil {
		t.Fatal(err)
	}
	got, err := out.Float32s()
	out.Close()
	if err != nil {
		t.Fatal(err)
	}
	for r, i := range indices {
		if got[2*r] != weight[2*i] || got[2*r+1] != weight[2*i+1] {
			t.Fatalf("row %d: %v, want the weight's row %d %v", r, got[2*r:2*r+2], i, weight[2*i:2*i+2])
		}
	}
	if _, err := e.ForwardFloat32([]int64{2}, []float32{1, 2}); !isDparError(err, ErrInvalidArg, "i32") {
		t.Fatalf("f32 indices gave %v", err)
	}
}
