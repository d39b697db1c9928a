package dpar

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// tinyGPT is nanoGPT's first layers, small: wte (11 tokens, 8 channels), wpe (4 positions), one attention block of
// 2 heads with its residual, then (B, T x C) to 3 classes for the cross-entropy over (B, classes).
func tinyGPT(t *testing.T) *Model {
	t.Helper()
	m, err := NewModel(7)
	must(t, err)
	must(t, m.Embedding(11, 8), m.SetNodeName(0, "transformer.wte"))
	must(t, m.PositionEmbedding(4, 8), m.SetNodeName(1, "transformer.wpe"))
	x, err := m.LastNode()
	must(t, err, m.CausalSelfAttention(8, 2, 0, true, "transformer.h.0.attn"))
	attn, err := m.LastNode()
	must(t, err, m.AddSum(attn, x), m.AddFlatten(), m.Linear(4*8, 3, true))
	return m
}

// params is every parameter's name and shape, as "name [d0 d1]".
func params(t *testing.T, m *Model, from, to int) []string {
	t.Helper()
	var out []string
	for i := from; i < to; i++ {
		name, shape, err := m.ParamInfo(i)
		must(t, err)
		out = append(out, fmt.Sprint(name, " ", shape))
	}
	return out
}

func TestAttentionLayersHavePyTorchsNamesAndRefuseBadValues(t *testing.T) {
	m := tinyGPT(t)
	defer m.Close()
	if n, _ := m.NumLayers(); n != 8 { // wte, wpe, c_attn, attention, c_proj, sum, flatten, linear
		t.Fatalf("%d nodes", n)
	}
	want := []string{"transformer.wte.weight [11 8]", "transformer.wpe.weight [4 8]",
		"transformer.h.0.attn.c_attn.weight [24 8]", "transformer.h.0.attn.c_attn.bias [24]",
		"transformer.h.0.attn.c_proj.weight [8 8]", "transformer.h.0.attn.c_proj.bias [8]", "7.weight [3 32]",
		"7.bias [3]"}
	if got := params(t, m, 0, 8); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("parameters %q, want %q", got, want)
	}
	// A bad value is refused, named, and leaves the model as it was.
	for _, c := range []struct {
		err  error
		what string
	}{
		{m.MultiheadAttention(8, 0, 0, true, false), "num_heads: 0"},
		{m.MultiheadAttention(8, 3, 0, true, false), "num_heads: 3"},
		{m.CausalSelfAttention(8, 2, 1, true, ""), "dropout_p: 1"},
		{m.CausalSelfAttention(8, 3, 0, true, ""), "n_head: 3"},
		{m.CausalSelfAttention(8, 2, 0, true, "transformer.h.0.attn"), "transformer.h.0.attn.c_attn"},
		{m.Attention(2, true, 0, 0, 0, 1), "n: 2"},
		{m.Attention(0, true, 0, 0), "num_heads: 0"},
		{m.Attention(2, true, 0, -1), "scale: -1"},
		{m.PositionEmbedding(0, 8), "max_positions: 0"},
	} {
		if !errors.Is(c.err, ErrInvalidArg) || !strings.Contains(c.err.Error(), c.what) {
			t.Errorf("want a refusal naming %q, got %v", c.what, c.err)
		}
	}
	if l, _ := m.NumLayers(); l != 8 {
		t.Fatalf("%d nodes after refusals", l)
	}
	if p, _ := m.NumParams(); p != 8 {
		t.Fatalf("%d parameters after refusals", p)
	}
	e, err := NewEngine(m, Options{LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	must(t, err)
	defer e.Close()
	long := make([]int32, 20)
	for i := range long {
		long[i] = int32(i % 11)
	}
	x, err := FromInt32([]int64{4, 5}, long)
	must(t, err)
	defer x.Close()
	y, err := FromInt32([]int64{4}, make([]int32, 4))
	must(t, err)
	defer y.Close()
	_, err = e.TrainStep(x, y)
	if !errors.Is(err, ErrInvalidArg) || !strings.Contains(err.Error(), "a sequence of 5 positions is longer than the 4") {
		t.Fatalf("a sequence of 5 positions in a table of 4: %v", err)
	}

	mha, err := NewModel(1)
	must(t, err)
	defer mha.Close()
	must(t, mha.Embedding(11, 8), mha.MultiheadAttention(8, 2, 0, true, true))
	want = []string{"1.in_proj_weight [24 8]", "1.in_proj_bias [24]", "1.out_proj.weight [8 8]",
		"1.out_proj.bias [8]"}
	if got := params(t, mha, 1, 5); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("parameters %q, want %q", got, want)
	}
	bias, err := mha.GetParam(2)
	must(t, err)
	if fmt.Sprint(bias) != fmt.Sprint(make([]float32, 24)) { // zero biases, as the module's
		t.Fatalf("in_proj_bias %v", bias)
	}
	must(t, mha.MultiheadAttention(8, 1, 0, false, false))
	if p, _ := mha.NumParams(); p != 7 {
		t.Fatalf("%d parameters: a multihead attention without biases has 2", p)
	}

	// Attention over q, k and v of explicit nodes, over one packed projection, and over the next input.
	sdpa, err := NewModel(1)
	must(t, err)
	defer sdpa.Close()
	must(t, sdpa.Embedding(11, 8), sdpa.Attention(2, true, 0.1, 0.5, 0, 0, 0), sdpa.Linear(8, 24, false),
		sdpa.Attention(4, true, 0, 0, 2), sdpa.BranchFrom(2), sdpa.Attention(4, false, 0, 0))
	l, _ := sdpa.NumLayers()
	p, _ := sdpa.NumParams()
	if l != 5 || p != 2 {
		t.Fatalf("%d nodes, %d parameters", l, p)
	}
}

func TestATinyGPTTrainsOnTokens(t *testing.T) {
	m := tinyGPT(t)
	defer m.Close()
	e, err := NewEngine(m, Options{LR: 0.1, Devices: 2, Processes: ProcessesSingle})
	must(t, err)
	defer e.Close()
	tokens := make([]int32, 16)
	for i := range tokens {
		tokens[i] = int32(i * 7 % 11)
	}
	x, err := FromInt32([]int64{4, 4}, tokens)
	must(t, err)
	defer x.Close()
	y, err := FromInt32([]int64{4}, []int32{0, 1, 2, 1})
	must(t, err)
	defer y.Close()
	first, err := e.TrainStep(x, y)
	must(t, err)
	second, err := e.TrainStep(x, y)
	must(t, err)
	if !(second < first) {
		t.Fatalf("loss %v then %v", first, second)
	}
}
