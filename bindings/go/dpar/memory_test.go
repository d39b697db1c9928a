package dpar

import (
	"math"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// forwardOutput is the helper of the bug report: it returns a forward pass's output as a slice and lets the
// tensor go. Before Float32s copied, the slice pointed into the tensor's memory, which the finalizer freed.
func forwardOutput(t *testing.T, e *Engine, x *Tensor) []float32 {
	out, err := e.Forward(x)
	if err != nil {
		t.Fatal(err)
	}
	v, err := out.Float32s()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func labelsOf(t *testing.T, values []int32) []int32 {
	y, err := FromInt32([]int64{int64(len(values))}, values)
	if err != nil {
		t.Fatal(err)
	}
	v, err := y.Int32s()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// collectAndReuse runs the collector and the finalizers it queues, then allocates tensors of the same sizes
// filled with other values, so that memory freed by a finalizer is reused and a stale slice reads them.
func collectAndReuse(t *testing.T, floats, ints int) []*Tensor {
	for i := 0; i < 10; i++ {
		runtime.GC()
		time.Sleep(2 * time.Millisecond) // finalizers run on their own goroutine
	}
	var keep []*Tensor
	for i := 0; i < 16; i++ {
		f := make([]float32, floats)
		for j := range f {
			f[j] = -12345
		}
		ft, err := FromFloat32([]int64{int64(floats)}, f)
		if err != nil {
			t.Fatal(err)
		}
		n := make([]int32, ints)
		for j := range n {
			n[j] = -777
		}
		it, err := FromInt32([]int64{int64(ints)}, n)
		if err != nil {
			t.Fatal(err)
		}
		keep = append(keep, ft, it)
	}
	return keep
}

func TestSlicesOutliveTheirTensor(t *testing.T) {
	m := referenceModel(t)
	defer m.Close()
	e := referenceEngine(t, m)
	defer e.Close()
	x, _ := referenceBatch(t)
	defer x.Close()
	if err := e.SetTraining(false); err != nil {
		t.Fatal(err)
	}
	want, err := e.Forward(x)
	if err != nil {
		t.Fatal(err)
	}
	wantOut, err := want.ToFloat32()
	want.Close()
	if err != nil {
		t.Fatal(err)
	}
	wantLabels := []int32{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8}

	got := forwardOutput(t, e, x)
	gotLabels := labelsOf(t, wantLabels)
	keep := collectAndReuse(t, len(wantOut), len(wantLabels))
	for i := range wantOut {
		if got[i] != wantOut[i] {
			t.Fatalf("output[%d] = %v after the collector ran, want %v", i, got[i], wantOut[i])
		}
	}
	for i := range wantLabels {
		if gotLabels[i] != wantLabels[i] {
			t.Fatalf("labels[%d] = %v after the collector ran, want %v", i, gotLabels[i], wantLabels[i])
		}
	}
	runtime.KeepAlive(keep)
}

// gradOfAnUnreachableReducer returns gradient 0 of a reducer that it lets go without Close, holding 1..n.
func gradOfAnUnreachableReducer(t *testing.T, c *Comm, n int) []float32 {
	red, err := NewReducer(c, []int{n}, Sum, ReducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	grad, err := red.Grad(0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range grad {
		grad[i] = float32(i + 1)
	}
	return grad
}

// A gradient slice outlives a reducer that the collector finalizes: before, the finalizer freed the memory under
// it, and reducers made after reused it.
func TestGradSlicesOutliveAnUnreachableReducer(t *testing.T) {
	g, c := soloGroup(t)
	defer g.Close()
	defer c.Close()
	const n = 4096
	grad := gradOfAnUnreachableReducer(t, c, n)
	for i := 0; i < 10; i++ {
		runtime.GC()
		time.Sleep(2 * time.Millisecond) // finalizers run on their own goroutine
	}
	var others []*Reducer
	defer func() {
		for _, r := range others {
			r.Close()
		}
	}()
	for i := 0; i < 16; i++ { // same-sized blocks written with other values: they reuse freed memory
		r, err := NewReducer(c, []int{n}, Sum, ReducerOptions{})
		if err != nil {
			t.Fatal(err)
		}
		other, _ := r.Grad(0)
		for j := range other {
			other[j] = -12345
		}
		others = append(others, r)
	}
	for i, v := range grad {
		if v != float32(i+1) {
			t.Fatalf("grad[%d] = %v after its reducer was finalized, want %v", i, v, i+1)
		}
	}
}

// loaderBatch returns the first batch of a loader that it lets go without Close.
func loaderBatch(t *testing.T, images, labels string) (*Tensor, *Tensor) {
	d, err := LoadIDX(images, labels)
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLoader(d, 4, false, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	x, y, ok, err := l.Next()
	if err != nil || !ok {
		t.Fatalf("Next: %v, %v", ok, err)
	}
	return x, y
}

// A loader's batch holds its loader: before, a caller that kept only the batch saw the loader finalized and the
// batch freed under it ("not a live handle", or freed memory read).
func TestALoadersBatchOutlivesTheLoadersLastReference(t *testing.T) {
	dir := t.TempDir()
	images, labels := filepath.Join(dir, "images.idx"), filepath.Join(dir, "labels.idx")
	const samples = 6
	img := []byte{0, 0, 8, 3, 0, 0, 0, samples, 0, 0, 0, 2, 0, 0, 0, 3} // u8 images of 2 x 3
	for i := 0; i < samples*6; i++ {
		img = append(img, byte(16*(i/6)+i%6))
	}
	lab := []byte{0, 0, 8, 1, 0, 0, 0, samples}
	for i := 0; i < samples; i++ {
		lab = append(lab, byte(i%4))
	}
	if os.WriteFile(images, img, 0o644) != nil || os.WriteFile(labels, lab, 0o644) != nil {
		t.Fatal("cannot write the IDX files")
	}
	x, y := loaderBatch(t, images, labels)
	keep := collectAndReuse(t, 4*6, 4)
	got, err := x.Float32s()
	if err != nil {
		t.Fatalf("the batch after the collector ran: %v", err)
	}
	for i, v := range got {
		if want := float32(16*(i/6)+i%6) / 255; math.Abs(float64(v-want)) > 1e-6 {
			t.Fatalf("inputs[%d] = %v after the collector ran, want %v", i, v, want)
		}
	}
	labelsGot, err := y.Int32s()
	if err != nil || len(labelsGot) != 4 || labelsGot[3] != 3 {
		t.Fatalf("labels %v (%v) after the collector ran, want [0 1 2 3]", labelsGot, err)
	}
	runtime.KeepAlive(keep)
}
