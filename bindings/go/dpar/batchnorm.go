package dpar

import (
	"runtime"
	"unsafe"

	"dpar.dev/go/raw"
)

// BatchNorm1d appends BatchNorm1d over numFeatures channels of (B, C) or (B, C, L) inputs (PyTorch's defaults:
// eps 1e-5, momentum 0.1, affine).
func (m *Model) BatchNorm1d(numFeatures int64, eps, momentum float32, affine bool) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_batchnorm1d(m.raw, numFeatures, eps, momentum, b2i(affine)) })
}

// BatchNorm2d appends BatchNorm2d over the channels of (B, C, H, W) inputs.
func (m *Model) BatchNorm2d(numFeatures int64, eps, momentum float32, affine bool) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_batchnorm2d(m.raw, numFeatures, eps, momentum, b2i(affine)) })
}

// SyncBatchNorm appends SyncBatchNorm: statistics over every replica of every process.
func (m *Model) SyncBatchNorm(numFeatures int64, eps, momentum float32, affine bool) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_add_sync_batchnorm(m.raw, numFeatures, eps, momentum, b2i(affine))
	})
}

// LayerNorm appends LayerNorm over the last dim (normalizedSize) of (B, ..., D) inputs, as torch.nn.LayerNorm
// (PyTorch's defaults: eps 1e-5, elementwise affine).
func (m *Model) LayerNorm(normalizedSize int64, eps float32, elementwiseAffine bool) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_layernorm(m.raw, normalizedSize, eps, b2i(elementwiseAffine)) })
}

// Embedding appends an Embedding: int32 indices (B) or (B, T) give rows of its (numEmbeddings, embeddingDim)
// weight. A model whose input it reads takes int32 input tensors.
func (m *Model) Embedding(numEmbeddings, embeddingDim int64) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_embedding(m.raw, numEmbeddings, embeddingDim) })
}

// EmbeddingPadded appends an Embedding whose row paddingIdx (negative: from the end) starts at zero and gets no
// gradient, as torch.nn.Embedding's padding_idx.
func (m *Model) EmbeddingPadded(numEmbeddings, embeddingDim, paddingIdx int64) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_add_embedding_padded(m.raw, numEmbeddings, embeddingDim, paddingIdx)
	})
}

// PositionEmbedding appends GPT-2's learned position embedding (nanoGPT's wpe): a (B, T, C) input gives input +
// weight[t] at position t, its "weight" (maxPositions, embeddingDim) drawn from N(0, 1). A sequence longer than
// maxPositions is refused.
func (m *Model) PositionEmbedding(maxPositions, embeddingDim int64) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_position_embedding(m.raw, maxPositions, embeddingDim) })
}

// Attention appends F.scaled_dot_product_attention(q, k, v, dropoutP, isCausal, scale) over numHeads heads, the
// output (B, L, C) with the heads merged. inputs are the nodes q, k and v; or one node, a packed (B, T, 3C) q|k|v
// projection; or none, for the next input as a packed projection. A scale of 0 is 1/sqrt(head size). No
// parameters.
func (m *Model) Attention(numHeads int64, isCausal bool, dropoutP, scale float32, inputs ...int32) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_add_attention(m.raw, int32s(inputs), int64(len(inputs)), numHeads, b2i(isCausal),
			dropoutP, scale)
	})
}

// MultiheadAttention appends self-attention as torch.nn.MultiheadAttention(embedDim, numHeads, dropout, bias,
// batch_first=True)(x, x, x, need_weights=False, is_causal=isCausal)[0] on (B, T, embedDim) inputs, with the
// module's parameter names ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias") and
// initialisation.
func (m *Model) MultiheadAttention(embedDim, numHeads int64, dropout float32, bias, isCausal bool) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_add_multihead_attention(m.raw, embedDim, numHeads, dropout, b2i(bias), b2i(isCausal))
	})
}

// CausalSelfAttention appends nanoGPT's CausalSelfAttention on (B, T, nEmbd) inputs: c_attn, causal attention of
// nHead heads, c_proj and resid_dropout. With a name ("transformer.h.0.attn"; "" for the default names) the linear
// nodes are "<name>.c_attn" and "<name>.c_proj", so that their parameters have nanoGPT's state_dict keys. A refusal
// leaves the model as it was.
func (m *Model) CausalSelfAttention(nEmbd, nHead int64, dropout float32, bias bool, name string) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_add_causal_self_attention(m.raw, nEmbd, nHead, dropout, b2i(bias), name)
	})
}

// ConvertSyncBatchNorm turns every BatchNorm layer into SyncBatchNorm.
func (m *Model) ConvertSyncBatchNorm() error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_convert_sync_batchnorm(m.raw) })
}

// NumBuffers is the number of buffers (BatchNorm's running statistics: state that is not a parameter).
func (m *Model) NumBuffers() (int, error) { return m.count(raw.Dpar_model_num_buffers) }

// Buffer holds a buffer's values: F32 for a float buffer, I64 for an int64 one (the other is nil).
type Buffer struct {
	F32 []float32
	I64 []int64
}

// BufferInfo is buffer index's name ("1.running_mean"), dtype (F32 or I64) and shape (empty for a scalar).
func (m *Model) BufferInfo(index int) (string, DType, []int64, error) {
	defer runtime.KeepAlive(m)
	var s [4]int64
	var n uint64
	var dtype int32
	name := ""
	err := call(func() int {
		st := raw.Dpar_model_buffer_info(unsafe.Pointer(&dtype), unsafe.Pointer(&s[0]), unsafe.Pointer(&n), m.raw,
			int64(index))
		if st == int(OK) {
			name = raw.Dpar_model_buffer_name(m.raw, int64(index))
		}
		return st
	})
	return name, DType(dtype), append([]int64(nil), s[:n]...), err
}

// newBuffer makes room for a buffer of that dtype and shape, and gives its address and element count.
func newBuffer(dtype DType, shape []int64) (Buffer, unsafe.Pointer, int64) {
	n := int64(1)
	for _, e := range shape {
		n *= e
	}
	if dtype == I64 {
		b := Buffer{I64: make([]int64, n)}
		return b, address(b.I64), n
	}
	b := Buffer{F32: make([]float32, n)}
	return b, address(b.F32), n
}

// GetBuffer copies buffer index out of the model.
func (m *Model) GetBuffer(index int) (Buffer, error) {
	_, dtype, shape, err := m.BufferInfo(index)
	if err != nil {
		return Buffer{}, err
	}
	b, p, n := newBuffer(dtype, shape)
	err = call(func() int { return raw.Dpar_model_get_buffer(p, m.raw, int64(index), n) })
	runtime.KeepAlive(m)
	runtime.KeepAlive(b)
	return b, err
}

// SetBuffer overwrites buffer index; values must be of the buffer's dtype.
func (m *Model) SetBuffer(index int, values Buffer) error {
	_, dtype, _, err := m.BufferInfo(index)
	if err != nil {
		return err
	}
	p, n := address(values.F32), int64(len(values.F32))
	if dtype == I64 {
		p, n = address(values.I64), int64(len(values.I64))
	}
	if p == nil {
		return invalid("values: no values of buffer %d's dtype", index)
	}
	err = call(func() int { return raw.Dpar_model_set_buffer(m.raw, int64(index), p, n) })
	runtime.KeepAlive(m)
	runtime.KeepAlive(values)
	return err
}

// Buffer copies a replica's buffer index; m is the model the engine was built from (for the dtype and shape).
func (e *Engine) Buffer(m *Model, replica, index int) (Buffer, error) {
	_, dtype, shape, err := m.BufferInfo(index)
	if err != nil {
		return Buffer{}, err
	}
	b, p, n := newBuffer(dtype, shape)
	err = e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_get_buffer(p, x, int64(replica), int64(index), n)
	})
	runtime.KeepAlive(b)
	return b, err
}
