package dpar

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
)

// goLinear is y = x W^T + b written in Go, with a per-replica call count and a switch that makes one replica fail.
type goLinear struct {
	in, out     int
	mu          sync.Mutex
	forwards    map[int]int
	failReplica int // -1: none
	failWith    error
}

func newGoLinear(in, out int) *goLinear {
	return &goLinear{in: in, out: out, forwards: map[int]int{}, failReplica: -1}
}

func (l *goLinear) params() []ParamSpec {
	return []ParamSpec{
		{Name: "weight", Shape: []int64{int64(l.out), int64(l.in)}, Init: InitUniform, Bound: 0.5},
		{Name: "bias", Shape: []int64{int64(l.out)}, Init: InitZeros},
	}
}

func (l *goLinear) OutputShape(in []int64) ([]int64, error) {
	if len(in) != 2 || in[1] != int64(l.in) {
		return nil, &Error{Status: ErrMismatch, Message: fmt.Sprintf("go_linear takes %d features, not %v", l.in, in[1:])}
	}
	return []int64{in[0], int64(l.out)}, nil
}

func (l *goLinear) Forward(c *CustomCall) error {
	l.mu.Lock()
	l.forwards[c.Replica]++
	fail := l.failReplica == c.Replica
	l.mu.Unlock()
	if fail {
		return l.failWith
	}
	w, b := c.Params[0], c.Params[1]
	rows := int(c.InputShape[0])
	for i := 0; i < rows; i++ {
		for o := 0; o < l.out; o++ {
			acc := b[o]
			for k := 0; k < l.in; k++ {
				acc += c.Input[i*l.in+k] * w[o*l.in+k]
			}
			c.Output[i*l.out+o] = acc
		}
	}
	return nil
}

func (l *goLinear) Backward(c *CustomCall) error {
	w, dw, db := c.Params[0], c.Grads[0], c.Grads[1]
	rows := int(c.InputShape[0])
	for i := range dw { // written, not added to: dpar accumulates
		dw[i] = 0
	}
	for i := range db {
		db[i] = 0
	}
	for i := 0; i < rows; i++ {
		for o := 0; o < l.out; o++ {
			dy := c.GradOutput[i*l.out+o]
			db[o] += dy
			for k := 0; k < l.in; k++ {
				dw[o*l.in+k] += dy * c.Input[i*l.in+k]
			}
		}
	}
	if c.GradInput != nil {
		for i := 0; i < rows; i++ {
			for k := 0; k < l.in; k++ {
				var acc float32
				for o := 0; o < l.out; o++ {
					acc += c.GradOutput[i*l.out+o] * w[o*l.in+k]
				}
				c.GradInput[i*l.in+k] = acc
			}
		}
	}
	return nil
}

func must(t *testing.T, errs ...error) {
	t.Helper()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// customAndBuiltin: linear 6-8, tanh, then the Go layer, or a built-in linear 8-4 with the Go layer's parameters.
func customAndBuiltin(t *testing.T, l *goLinear) (*Model, *Model) {
	custom, err := NewModel(3)
	must(t, err)
	builtin, err := NewModel(5)
	must(t, err)
	must(t, custom.Linear(6, 8, true), custom.Activation(Tanh), custom.Custom("go_linear", l.params(), l))
	must(t, builtin.Linear(6, 8, true), builtin.Activation(Tanh), builtin.Linear(8, 4, true))
	n, err := custom.NumParams()
	must(t, err)
	for i := 0; i < n; i++ {
		v, err := custom.GetParam(i)
		must(t, err, builtin.SetParam(i, v))
	}
	return custom, builtin
}

func customBatch(t *testing.T) (*Tensor, *Tensor) {
	x := make([]float32, 60)
	for i := range x {
		x[i] = float32((i*29)%53)/53.0 - 0.5
	}
	y := make([]int32, 10)
	for r := range y {
		y[r] = int32((r * 7) % 4)
	}
	xt, err := FromFloat32([]int64{10, 6}, x)
	must(t, err)
	yt, err := FromInt32([]int64{10}, y)
	must(t, err)
	return xt, yt
}

func TestAGoLayerTrainsAsTheBuiltInLinearOverTwoDevices(t *testing.T) {
	l := newGoLinear(8, 4)
	custom, builtin := customAndBuiltin(t, l)
	defer custom.Close()
	defer builtin.Close()
	if name, shape, err := custom.ParamInfo(2); err != nil || name != "2.weight" || fmt.Sprint(shape) != "[4 8]" {
		t.Fatalf("param 2: %q %v %v", name, shape, err)
	}
	ec, eb := referenceEngine(t, custom), referenceEngine(t, builtin)
	defer ec.Close()
	defer eb.Close()
	x, y := customBatch(t)
	n, err := custom.NumParamElements()
	must(t, err)
	initial, err := ec.Params(0, n)
	must(t, err)
	for step := 0; step < 8; step++ {
		lc, err := ec.TrainStep(x, y)
		must(t, err)
		lb, err := eb.TrainStep(x, y)
		must(t, err)
		// The Go loops and dpar's matrix products may sum in another order: equal within float rounding.
		if math.Abs(float64(lc-lb)) > 1e-5*math.Abs(float64(lb)) {
			t.Fatalf("step %d: loss %v with the Go layer, %v with the built-in one", step, lc, lb)
		}
	}
	pc, err := ec.Params(0, n)
	must(t, err)
	pb, err := eb.Params(0, n)
	must(t, err)
	p1, err := ec.Params(1, n)
	must(t, err)
	moved := 0.0
	for i := range pc {
		if d := math.Abs(float64(pc[i] - pb[i])); d > 1e-5*math.Max(math.Abs(float64(pb[i])), 0.1) {
			t.Fatalf("parameter %d: %v with the Go layer, %v with the built-in one", i, pc[i], pb[i])
		}
		if pc[i] != p1[i] {
			t.Fatalf("parameter %d differs between replicas: %v, %v", i, pc[i], p1[i])
		}
		moved = math.Max(moved, math.Abs(float64(pc[i]-initial[i])))
	}
	if moved < 1e-2 {
		t.Fatalf("the parameters did not move (%v)", moved)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if fmt.Sprint(l.forwards) != "map[0:8 1:8]" {
		t.Fatalf("forwards per replica: %v", l.forwards)
	}
}

func TestAGoLayersErrorComesBackWithItsOwnMessage(t *testing.T) {
	x, y := customBatch(t)
	l := newGoLinear(8, 4)
	custom, builtin := customAndBuiltin(t, l)
	defer custom.Close()
	builtin.Close()
	e := referenceEngine(t, custom)
	defer e.Close()
	l.failReplica, l.failWith = 1, &Error{Status: ErrDevice, Message: "the Go layer lost replica 1"}
	_, err := e.TrainStep(x, y)
	var de *Error
	if !errors.As(err, &de) || de.Status != ErrDevice || !strings.Contains(de.Message, "the Go layer lost replica 1") ||
		!strings.Contains(de.Message, "go_linear") {
		t.Fatalf("got %v", err)
	}
	l.failWith = errors.New("a plain Go error")
	if _, err = e.TrainStep(x, y); !errors.As(err, &de) || de.Status != ErrInternal || !strings.Contains(de.Message, "a plain Go error") {
		t.Fatalf("got %v", err)
	}
	l.failWith = nil
	l.failReplica = -1
	// A panic is recovered at the boundary.
	p := &panicky{goLinear: newGoLinear(8, 4)}
	m, err := NewModel(3)
	must(t, err)
	defer m.Close()
	must(t, m.Linear(6, 8, true), m.Custom("panicky", p.params(), p))
	ep := referenceEngine(t, m)
	defer ep.Close()
	if _, err = ep.TrainStep(x, y); err == nil || !strings.Contains(err.Error(), "backward exploded") {
		t.Fatalf("got %v", err)
	}
	// A rejected input shape fails the call with the layer's message.
	bad, err := NewModel(3)
	must(t, err)
	defer bad.Close()
	must(t, bad.Linear(6, 5, true), bad.Custom("go_linear", l.params(), newGoLinear(8, 4)))
	eBad, err := NewEngine(bad, Options{Devices: 2, Processes: ProcessesSingle})
	if err == nil {
		defer eBad.Close()
		_, err = eBad.TrainStep(x, y)
	}
	if err == nil || !strings.Contains(err.Error(), "go_linear takes 8 features") {
		t.Fatalf("got %v", err)
	}
}

type panicky struct{ *goLinear }

func (p *panicky) Backward(*CustomCall) error { panic("backward exploded") }
