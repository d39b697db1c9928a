package dpar

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// The recipe of tests/binding_reference.c: same model, data and seed on 2 CPU devices.
func referenceModel(t *testing.T) *Model {
	m, err := NewModel(7)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range []error{m.Linear(4, 8, true), m.Activation(ReLU), m.Linear(8, 3, true)} {
		if e != nil {
			t.Fatal(e)
		}
	}
	return m
}

func referenceBatch(t *testing.T) (*Tensor, *Tensor) {
	x := make([]float32, 40)
	for i := range x {
		x[i] = float32((i*37)%101)/101.0 - 0.5
	}
	y := make([]int32, 10)
	for r := range y {
		y[r] = int32(r % 3)
	}
	xt, err := FromFloat32([]int64{10, 4}, x)
	if err != nil {
		t.Fatal(err)
	}
	yt, err := FromInt32([]int64{10}, y)
	if err != nil {
		t.Fatal(err)
	}
	return xt, yt
}

func referenceEngine(t *testing.T, m *Model) *Engine {
	e, err := NewEngine(m, Options{LR: 0.1, Momentum: 0.9, Devices: 2, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// referenceLosses is the file of the C program's losses that tests/binding_reference writes: $DPAR_REFERENCE_LOSSES
// (ctest sets it), else the one in this checkout's build tree (build/tests), else the test skips.
func referenceLosses(t *testing.T) string {
	if path := os.Getenv("DPAR_REFERENCE_LOSSES"); path != "" {
		return path
	}
	path, err := filepath.Abs(filepath.Join("..", "..", "..", "build", "tests", "reference_losses.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Skipf("no C reference to compare with: DPAR_REFERENCE_LOSSES is not set and %s is missing "+
			"(ctest -R binding_reference writes it in a dpar checkout's build tree)", path)
	}
	return path
}

func TestLossesHaveTheCReferenceBits(t *testing.T) {
	path := referenceLosses(t)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	expected := strings.Fields(string(data))
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	x, y := referenceBatch(t)
	defer x.Close()
	defer y.Close()
	var got []string
	for i := 0; i < 5; i++ {
		loss, err := e.TrainStep(x, y)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%08x", math.Float32bits(loss)))
	}
	if strings.Join(got, " ") != strings.Join(expected, " ") || len(expected) != 5 {
		t.Fatalf("loss bits %v, the C reference %v", got, expected)
	}
	if n, _ := e.StepCount(); n != 5 {
		t.Fatalf("step count %d", n)
	}
	if rank, size, err := e.Processes(); err != nil || rank != 0 || size != 1 {
		t.Fatalf("processes %d of %d (%v), want 0 of 1", rank, size, err)
	}
	// One process: nothing travels between processes.
	if transport, err := e.ProcessTransport(); err != nil || transport != "" {
		t.Fatalf("process transport %q (%v), want \"\"", transport, err)
	}
	if err := e.SetGradientCompression(CompressionBF16); err != nil { // one process: changes nothing
		t.Fatal(err)
	}
	var de *Error
	for _, bad := range []Compression{7, -1} {
		if err := e.SetGradientCompression(bad); !errors.As(err, &de) || de.Status != ErrInvalidArg {
			t.Fatalf("compression %d: %v, want an invalid-argument error", bad, err)
		}
	}
}

func TestEmptyOrMismatchedSlicesAreErrorsNotPanics(t *testing.T) {
	expectInvalid := func(what string, err error) {
		t.Helper()
		var de *Error
		if !errors.As(err, &de) || de.Status != ErrInvalidArg || de.Message == "" {
			t.Errorf("%s: %v, want an invalid-argument error with dpar's message", what, err)
		}
	}
	x, err := FromFloat32([]int64{2}, nil)
	expectInvalid("FromFloat32 without values", err)
	if x != nil {
		t.Error("FromFloat32 returned a tensor with its error")
	}
	_, err = FromInt32([]int64{3}, []int32{1, 2})
	expectInvalid("FromInt32 with too few values", err)
	_, err = Zeros(F32, nil, CPU, 0)
	expectInvalid("Zeros without a shape", err)
	m := referenceModel(t)
	defer m.Close()
	expectInvalid("SetParam without values", m.SetParam(0, nil))
}

func TestATraceIsWrittenAsChromesJSON(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	var de *Error
	if err := e.TraceStop(""); !errors.As(err, &de) || de.Status != ErrInvalidState {
		t.Fatalf("a stop without a start: %v", err)
	}
	x, y := referenceBatch(t)
	defer x.Close()
	defer y.Close()
	if err := e.TraceStart(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "trace.json")
	if err := e.TraceStop(path); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var trace struct {
		TraceEvents []struct {
			Name, Ph string
			Tid      int
		}
	}
	if err := json.Unmarshal(data, &trace); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, ev := range trace.TraceEvents {
		if ev.Ph == "X" {
			seen[fmt.Sprint(ev.Tid, " ", ev.Name)] = true
		}
	}
	for _, want := range []string{"0 train_step", "1 forward", "1 backward", "3 forward", "3 optimizer"} {
		if !seen[want] {
			t.Errorf("no span %q in the trace", want)
		}
	}
	if err := e.TraceStop(""); err != nil { // only stops, again: allowed
		t.Fatal(err)
	}
}

func TestGradientClippingAndTheReportedNorm(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	plain, clipping := referenceEngine(t, m), referenceEngine(t, m)
	defer plain.Close()
	defer clipping.Close()
	x, y := referenceBatch(t)
	defer x.Close()
	defer y.Close()
	step := func() (float32, float32) {
		a, err := plain.TrainStep(x, y)
		if err != nil {
			t.Fatal(err)
		}
		b, err := clipping.TrainStep(x, y)
		if err != nil {
			t.Fatal(err)
		}
		return a, b
	}
	if norm, err := clipping.GradNorm(); err != nil || !math.IsNaN(float64(norm)) {
		t.Fatalf("before any clipped step: %v, %v; want NaN", norm, err)
	}
	if err := clipping.SetMaxGradNorm(1e6); err != nil { // far above the norm: the same step
		t.Fatal(err)
	}
	step() // a step's loss is taken before its update
	if a, b := step(); a != b {
		t.Fatalf("an unclipped step differs: %v vs %v", a, b)
	}
	norm, err := clipping.GradNorm()
	if err != nil || !(norm > 0 && norm < 1e6) {
		t.Fatalf("norm %v, %v", norm, err)
	}
	if err := clipping.SetMaxGradNorm(norm / 10); err != nil {
		t.Fatal(err)
	}
	step() // a step's loss is taken before its update
	if a, b := step(); a == b {
		t.Fatalf("clipping changed nothing: %v", a)
	}
	err = clipping.SetMaxGradNorm(-1)
	var de *Error
	if !errors.As(err, &de) || de.Status != ErrInvalidArg || !strings.Contains(de.Message, "max_grad_norm") {
		t.Fatalf("a negative norm: %v", err)
	}
}

// Plain SGD with lr 1 moves the parameters by the (clipped) gradient itself, up to the rounding of p - g: below the
// gradient's norm the move's L2 norm is maxNorm and it points where the unclipped move does; above it nothing is
// scaled. GradNorm is the norm before clipping.
func TestTheClippedStepHasTheNormItWasClippedTo(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	n, err := m.NumParamElements()
	if err != nil {
		t.Fatal(err)
	}
	x, y := referenceBatch(t)
	defer x.Close()
	defer y.Close()
	step := func(maxNorm float32) ([]float64, float32) {
		e, err := NewEngine(m, Options{LR: 1, Devices: 2, Processes: ProcessesSingle})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		before, err := e.Params(0, n)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.SetMaxGradNorm(maxNorm); err != nil {
			t.Fatal(err)
		}
		if _, err := e.TrainStep(x, y); err != nil {
			t.Fatal(err)
		}
		after, err := e.Params(0, n)
		if err != nil {
			t.Fatal(err)
		}
		norm, err := e.GradNorm()
		if err != nil {
			t.Fatal(err)
		}
		move := make([]float64, n)
		for i := range move {
			move[i] = float64(before[i]) - float64(after[i])
		}
		return move, norm
	}
	l2 := func(v []float64) float64 {
		sum := 0.0
		for _, x := range v {
			sum += x * x
		}
		return math.Sqrt(sum)
	}
	plain, _ := step(0)
	norm := l2(plain)
	if norm <= 1e-2 {
		t.Fatalf("the step is too small to measure: %v", norm)
	}
	same, reported := step(1e6)
	for i := range same {
		if same[i] != plain[i] {
			t.Fatalf("an unclipped step differs at %d: %v vs %v", i, same[i], plain[i])
		}
	}
	if math.Abs(float64(reported)-norm) > 1e-4*norm {
		t.Fatalf("reported %v for a norm of %v", reported, norm)
	}
	for _, fraction := range []float64{0.5, 0.1} {
		maxNorm := float32(norm * fraction)
		clipped, reported := step(maxNorm)
		want := float64(maxNorm)
		if got := l2(clipped); math.Abs(got-want) > 1e-4*want {
			t.Fatalf("clipped to %v, the step's norm is %v", want, got)
		}
		if math.Abs(float64(reported)-norm) > 1e-4*norm {
			t.Fatalf("reported %v for a norm of %v", reported, norm)
		}
		for i := range clipped {
			if math.Abs(clipped[i]-plain[i]*want/norm) > 1e-4*want {
				t.Fatalf("element %d moved by %v, not %v", i, clipped[i], plain[i]*want/norm)
			}
		}
	}
}

func TestABadCallIsAnErrorWithDparsMessage(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	x, _ := FromFloat32([]int64{2, 5}, make([]float32, 10))
	y, _ := FromInt32([]int64{2}, []int32{0, 1})
	_, err := e.TrainStep(x, y)
	var de *Error
	if !errors.As(err, &de) || de.Status != ErrInvalidArg || !strings.Contains(de.Message, "4") {
		t.Fatalf("got %v", err)
	}
	if !strings.HasPrefix(err.Error(), "DPAR_ERR_INVALID_ARGUMENT: ") {
		t.Fatalf("got %q", err.Error())
	}
	if _, err := y.Float32s(); err == nil || !strings.Contains(err.Error(), "not f32") {
		t.Fatalf("Float32s of an i32 tensor: got %v", err)
	}
	if v, err := x.Float32s(); err != nil || len(v) != 10 {
		t.Fatalf("Float32s: got %v, %v", v, err)
	}
	if _, err := x.Int32s(); err == nil || !strings.Contains(err.Error(), "not i32") {
		t.Fatalf("Int32s of an f32 tensor: got %v", err)
	}
	if _, _, err := ParseDevice("tpu:1"); err == nil || !strings.Contains(err.Error(), "tpu:1") {
		t.Fatalf("got %v", err)
	}
	if k, i, err := ParseDevice("cpu:1"); err != nil || k != CPU || i != 1 {
		t.Fatalf("got %v %v %v", k, i, err)
	}
}

func TestAHooksErrorComesBackWithItsOwnMessage(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	x, y := referenceBatch(t)
	var mu sync.Mutex
	var seen []string
	err := e.SetForwardHook(func(replica int, in, out []int64) error {
		mu.Lock()
		seen = append(seen, fmt.Sprint(replica, in, out))
		mu.Unlock()
		if replica == 1 {
			return &Error{Status: ErrDevice, Message: "the Go probe failed on replica 1"}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.TrainStep(x, y)
	var de *Error
	if !errors.As(err, &de) || de.Status != ErrDevice || !strings.Contains(de.Message, "the Go probe failed on replica 1") {
		t.Fatalf("got %v", err)
	}
	if len(seen) != 2 {
		t.Fatalf("hook calls %v", seen)
	}
	if err := e.SetForwardHook(func(int, []int64, []int64) error { panic("hook exploded") }); err != nil {
		t.Fatal(err)
	}
	if _, err = e.TrainStep(x, y); err == nil || !strings.Contains(err.Error(), "hook exploded") {
		t.Fatalf("got %v", err)
	}
	if err := e.SetForwardHook(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
}

func TestCollectivesAndAbortOverAThreadGroup(t *testing.T) {
	g, err := NewCommGroup(3, 30)
	if err != nil {
		t.Fatal(err)
	}
	comms := make([]*Comm, 3)
	for r := range comms {
		if comms[r], err = g.Member(r); err != nil {
			t.Fatal(err)
		}
	}
	g.Close()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for r := range comms {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			c := comms[r]
			buf := []float32{float32(r + 1), 1}
			if err := c.AllReduceFloat32(buf, Sum); err != nil || buf[0] != 6 || buf[1] != 3 {
				errs[r] = fmt.Errorf("all-reduce: %v %v", buf, err)
				return
			}
			errs[r] = c.Barrier()
		}(r)
	}
	wg.Wait() // every participant has left the collectives
	if err := comms[2].Abort("rank 2 is done"); err != nil {
		t.Fatal(err)
	}
	for r := range comms {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			err := comms[r].AsyncError()
			var de *Error
			if !errors.As(err, &de) || de.Status != ErrRemote || !strings.Contains(de.Message, "rank 2 is done") {
				errs[r] = fmt.Errorf("async error %v", err)
			}
		}(r)
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Errorf("participant %d: %v", r, err)
		}
		comms[r].Close()
	}
}

// Accumulate then Step is one TrainStep over the same batch; every handle's Close may be called again.
func TestAccumulateAndCloseTwice(t *testing.T) {
	m := referenceModel(t)
	a, b := referenceEngine(t, m), referenceEngine(t, m)
	x, y := referenceBatch(t)
	la, errA := a.TrainStep(x, y)
	lb, errB := b.Accumulate(x, y)
	if errA != nil || errB != nil || la != lb || b.Step() != nil {
		t.Fatalf("TrainStep %v %v, Accumulate %v %v", la, errA, lb, errB)
	}
	if pa, pb := mustParams(t, a), mustParams(t, b); fmt.Sprint(pa) != fmt.Sprint(pb) {
		t.Fatalf("parameters after TrainStep %v, after Accumulate and Step %v", pa, pb)
	}
	g, err := NewCommGroup(1, 30)
	if err != nil {
		t.Fatal(err)
	}
	c, err := g.Member(0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewCommGroup(1, -1); err == nil || !strings.Contains(err.Error(), "timeout_seconds") {
		t.Fatalf("a negative timeout gave %v", err)
	}
	onDevices, err := NewCommGroupOnDevices([][2]int{{int(CPU), 1}}, nil, 30)
	if err != nil {
		t.Fatal(err)
	}
	member, err := onDevices.Member(0)
	if err != nil {
		t.Fatal(err)
	}
	if kind, index, err := member.Device(); err != nil || kind != CPU || index != 1 {
		t.Fatalf("Device() = %d:%d, %v; want cpu:1", kind, index, err)
	}
	if kind, index, err := c.Device(); err != nil || kind != CPU || index != 0 {
		t.Fatalf("a plain group's Device() = %d:%d, %v; want cpu:0", kind, index, err)
	}
	member.Close()
	onDevices.Close()
	if _, err := NewCommGroupOnDevices([][2]int{{int(CPU), 0}}, []uintptr{1234}, 30); err == nil ||
		!strings.Contains(err.Error(), "streams[0]") {
		t.Fatalf("a stream for a CPU device gave %v", err)
	}
	if _, err := NewCommGroupOnDevices([][2]int{{int(CPU), 0}, {int(CPU), 1}}, []uintptr{0}, 30); err == nil {
		t.Fatal("one stream for two devices was accepted")
	}
	for i := 0; i < 2; i++ {
		x.Close()
		y.Close()
		a.Close()
		b.Close()
		m.Close()
		c.Close()
		g.Close()
	}
	if x.raw != nil || a.raw != nil || m.raw != nil || c.raw != nil || g.raw != nil {
		t.Fatal("a closed handle still holds its pointer")
	}
}

func mustParams(t *testing.T, e *Engine) []float32 {
	p, err := e.Params(0, 67)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAResidualGraphIsBuiltNamedAndChecked(t *testing.T) {
	m, err := NewModel(3)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if n, err := m.LastNode(); err != nil || n != ModelInput {
		t.Fatalf("empty model's last node: %d, %v", n, err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(m.Linear(4, 8, true))
	must(m.Activation(ReLU))
	must(m.Linear(8, 4, true))
	fc2, err := m.LastNode()
	must(err)
	if fc2 != 2 {
		t.Fatalf("fc2 is node %d", fc2)
	}
	must(m.AddSum(fc2, ModelInput))
	must(m.SetNodeName(0, "block.fc1"))
	must(m.BranchFrom(3))
	must(m.AddReshape(2, 2))
	must(m.AddConcat(4, 4))
	must(m.AddFlatten())
	must(m.Linear(8, 3, true))
	if n, _ := m.NumLayers(); n != 8 {
		t.Fatalf("%d nodes", n)
	}
	if name, _, err := m.ParamInfo(0); err != nil || name != "block.fc1.weight" {
		t.Fatalf("%q, %v", name, err)
	}
	if name, _, _ := m.ParamInfo(4); name != "7.weight" {
		t.Fatalf("%q", name)
	}
	err = m.AddSum(0, 42)
	if err == nil || !strings.Contains(err.Error(), "node 42") {
		t.Fatalf("a sum of a node not yet added: %v", err)
	}
	err = m.SetNodeName(1, "block.fc1")
	if err == nil || !strings.Contains(err.Error(), "already node 0") {
		t.Fatalf("a duplicate name: %v", err)
	}
}

func TestBatchNormBuffersAreNamedTypedAndEqualOnEveryReplica(t *testing.T) {
	m, err := NewModel(3)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Linear(4, 6, false); err != nil {
		t.Fatal(err)
	}
	if err := m.BatchNorm1d(6, 1e-5, 0.1, true); err != nil {
		t.Fatal(err)
	}
	if err := m.Linear(6, 3, true); err != nil {
		t.Fatal(err)
	}
	if err := m.ConvertSyncBatchNorm(); err != nil {
		t.Fatal(err)
	}
	if n, err := m.NumBuffers(); err != nil || n != 3 {
		t.Fatalf("NumBuffers: %d, %v", n, err)
	}
	name, dtype, shape, err := m.BufferInfo(2)
	if err != nil || name != "1.num_batches_tracked" || dtype != I64 || len(shape) != 0 {
		t.Fatalf("BufferInfo(2): %q %v %v %v", name, dtype, shape, err)
	}
	if err := m.SetBuffer(2, Buffer{I64: []int64{4}}); err != nil {
		t.Fatal(err)
	}
	if b, err := m.GetBuffer(2); err != nil || len(b.I64) != 1 || b.I64[0] != 4 {
		t.Fatalf("GetBuffer(2): %v %v", b, err)
	}
	if err := m.SetBuffer(2, Buffer{F32: []float32{4}}); err == nil {
		t.Fatal("a float value for an int64 buffer was accepted")
	}
	if _, _, _, err := m.BufferInfo(3); err == nil {
		t.Fatal("BufferInfo(3) of 3 buffers succeeded")
	}
	e, err := NewEngine(m, Options{LR: 0.1, Devices: 3, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	x, y := referenceBatch(t)
	if _, err := e.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
	b0, err := e.Buffer(m, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := e.Buffer(m, 2, 0)
	if err != nil || fmt.Sprint(b0.F32) != fmt.Sprint(b2.F32) || b0.F32[0] == 0 {
		t.Fatalf("replica 2's running_mean %v differs from replica 0's %v (%v)", b2.F32, b0.F32, err)
	}
	if c, err := e.Buffer(m, 1, 2); err != nil || c.I64[0] != 5 {
		t.Fatalf("num_batches_tracked: %v %v", c, err)
	}
	if _, err := e.Buffer(m, 3, 0); err == nil {
		t.Fatal("replica 3 of 3 was accepted")
	}
}

// The GPT pattern: the output projection reads the token embedding's weight (lm_head.weight = wte.weight).
func TestATiedWeightIsOneParameterReadByTwoNodes(t *testing.T) {
	m, err := NewModel(4)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Embedding(7, 5); err != nil {
		t.Fatal(err)
	}
	if err := m.Linear(5, 7, false); err != nil {
		t.Fatal(err)
	}
	if err := m.TieParam(1, "weight", 0, "bias"); err == nil || !strings.Contains(err.Error(), `has no parameter "bias"`) {
		t.Fatalf("an unknown source parameter: %v", err)
	}
	if err := m.TieParam(1, "weight", 0, "weight"); err != nil {
		t.Fatal(err)
	}
	if n, err := m.NumParams(); err != nil || n != 1 {
		t.Fatalf("%d parameters, %v", n, err)
	}
	if n, err := m.NumParamElements(); err != nil || n != 35 {
		t.Fatalf("%d parameter elements, %v", n, err)
	}
	if name, shape, err := m.ParamInfo(0); err != nil || name != "0.weight" || len(shape) != 2 || shape[0] != 7 {
		t.Fatalf("parameter 0: %s %v %v", name, shape, err)
	}
	if err := m.TieParam(1, "weight", 0, "weight"); err == nil || !strings.Contains(err.Error(), "tied already") {
		t.Fatalf("a second tie: %v", err)
	}
	e, err := NewEngine(m, Options{LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	x, err := FromInt32([]int64{5}, []int32{0, 3, 6, 2, 3})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	y, err := FromInt32([]int64{5}, []int32{3, 6, 2, 3, 1})
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	first, err := e.TrainStep(x, y)
	if err != nil {
		t.Fatal(err)
	}
	second, err := e.TrainStep(x, y)
	if err != nil || !(second < first) {
		t.Fatalf("losses %v then %v: %v", first, second, err)
	}
}

func TestLayerNormEmbeddingTrainOnInt32TokensAndRefuseABadIndex(t *testing.T) {
	m, err := NewModel(5)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Embedding(9, 4); err != nil {
		t.Fatal(err)
	}
	if err := m.LayerNorm(4, 1e-5, true); err != nil {
		t.Fatal(err)
	}
	if err := m.AddFlatten(); err != nil {
		t.Fatal(err)
	}
	if err := m.Linear(12, 3, true); err != nil {
		t.Fatal(err)
	}
	if err := m.Embedding(0, 4); err == nil {
		t.Fatal("an embedding of no rows was accepted")
	}
	if err := m.LayerNorm(4, 0, true); err == nil {
		t.Fatal("eps 0 was accepted")
	}
	if err := m.EmbeddingPadded(4, 2, 4); err == nil || !strings.Contains(err.Error(), "padding_idx") {
		t.Fatalf("padding_idx 4 of 4 rows: %v", err)
	}
	e, err := NewEngine(m, Options{LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	tokens := make([]int32, 15)
	for i := range tokens {
		tokens[i] = int32(i * 5 % 9)
	}
	x, err := FromInt32([]int64{5, 3}, tokens)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	y, err := FromInt32([]int64{5}, []int32{0, 1, 2, 1, 0})
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	if _, err := e.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
	tokens[4] = 9
	bad, err := FromInt32([]int64{5, 3}, tokens)
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	if _, err := e.TrainStep(bad, y); err == nil || !strings.Contains(err.Error(), "index 9 at position (1, 1)") {
		t.Fatalf("a bad index: %v", err)
	}
	if _, err := e.TrainStep(x, y); err != nil {
		t.Fatal(err)
	}
}
