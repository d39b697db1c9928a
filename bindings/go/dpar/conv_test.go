package dpar

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// convModel is a small CNN over (B, 1, 8, 8) inputs ending in (B, 4, 1, 1).
func convModel(t *testing.T) *Model {
	m, err := NewModel(5)
	if err != nil {
		t.Fatal(err)
	}
	first := DefaultConv2d(1, 4, [2]int64{3, 3})
	first.Padding = [2]int64{1, 1}
	second := DefaultConv2d(4, 4, [2]int64{3, 3})
	second.Stride, second.Padding, second.Dilation, second.Groups, second.Bias = [2]int64{2, 2}, [2]int64{2, 2},
		[2]int64{2, 2}, 2, false
	one := [2]int64{1, 1}
	for _, e := range []error{m.Conv2d(first), m.Activation(ReLU), m.MaxPool2d([2]int64{2, 2}, nil, [2]int64{}),
		m.Conv2d(second), m.AvgPool2d([2]int64{2, 2}, &one, one), m.AdaptiveAvgPool2d(1, 1)} {
		if e != nil {
			t.Fatal(e)
		}
	}
	return m
}

func TestConv2dAndPoolingLayersArePyTorchs(t *testing.T) {
	m := convModel(t)
	defer m.Close()
	if n, _ := m.NumLayers(); n != 6 {
		t.Fatalf("%d layers", n)
	}
	name, shape, err := m.ParamInfo(2)
	if err != nil || name != "3.weight" || len(shape) != 4 || shape[0] != 4 || shape[1] != 2 || shape[2] != 3 {
		t.Fatalf("%q %v %v", name, shape, err)
	}
	bad := DefaultConv2d(4, 6, [2]int64{3, 3})
	bad.Groups = 4
	if err := m.Conv2d(bad); !errors.Is(err, ErrInvalidArg) || !strings.Contains(err.Error(), "divisible by groups") {
		t.Fatalf("groups 4 of 6 channels: %v", err)
	}
	if err := m.MaxPool2d([2]int64{2, 2}, &[2]int64{0, 1}, [2]int64{}); !errors.Is(err, ErrInvalidArg) ||
		!strings.Contains(err.Error(), "stride[0]") {
		t.Fatalf("stride 0: %v", err)
	}
	if err := m.AdaptiveAvgPool2d(2, 2); !errors.Is(err, ErrNotSupported) || !strings.Contains(err.Error(), "only 1x1") {
		t.Fatalf("adaptive 2x2: %v", err)
	}
	if n, _ := m.NumLayers(); n != 6 {
		t.Fatalf("a refused layer was added: %d layers", n)
	}
}

func TestCnnOnTwoDevicesTrainsAsOnOne(t *testing.T) {
	m := convModel(t)
	defer m.Close()
	n, _ := m.NumParamElements()
	xs, ys := make([]float32, 5*64), make([]float32, 5*4)
	for i := range xs {
		xs[i] = float32((i*37)%101)/101.0 - 0.5
	}
	for i := range ys {
		ys[i] = float32((i*13)%7)/7.0 - 0.5
	}
	x, err := FromFloat32([]int64{5, 1, 8, 8}, xs)
	if err != nil {
		t.Fatal(err)
	}
	y, err := FromFloat32([]int64{5, 4, 1, 1}, ys)
	if err != nil {
		t.Fatal(err)
	}
	var finals [][]float32
	for _, devices := range []int{1, 2} {
		e, err := NewEngine(m, Options{LR: 0.5, Devices: devices, Loss: MSE, Processes: ProcessesSingle})
		if err != nil {
			t.Fatal(err)
		}
		first, err := e.TrainStep(x, y)
		if err != nil {
			t.Fatal(err)
		}
		last := first
		for s := 0; s < 10; s++ {
			if last, err = e.TrainStep(x, y); err != nil {
				t.Fatal(err)
			}
		}
		if !(last < first) {
			t.Fatalf("%d devices: loss %v -> %v", devices, first, last)
		}
		p, err := e.Params(0, n)
		if err != nil {
			t.Fatal(err)
		}
		finals = append(finals, p)
		e.Close()
	}
	for i := range finals[0] {
		a, b := float64(finals[0][i]), float64(finals[1][i])
		if math.Abs(a-b) > 1e-5*math.Max(math.Abs(a), 1e-2) {
			t.Fatalf("parameter %d: %v on one device, %v on two", i, a, b)
		}
	}
}
