// Package dpar is dpar's Go binding: data-parallel training over several devices through dpar's C ABI.
//
// Every handle is a Go value with Close() (a finalizer frees it too, as a safety net only); every failed call
// returns an *Error with dpar's status and message. Each call and the read of its thread-local error run with the
// goroutine locked to its OS thread. Buffers are Go slices, copied in and out (cgo does not let C keep a Go
// pointer after a call returns), except Tensor.UnsafeFloat32s and UnsafeInt32s, and a custom layer's CustomCall,
// slices over dpar's own memory valid while their owner is (Float32s and Int32s copy). The synchronous collectives
// use a Go slice in place for the call's span; the asynchronous ones copy it into C memory and back at Work.Wait;
// a Reducer's gradients are slices over C memory it owns. Memory that is not a Go slice (a GPU's) goes to the
// collectives as addresses, through the *Unsafe methods of Comm.
//
// The raw layer, dpar.dev/go/raw, is SWIG's one-to-one output for bindings/swig/dpar.i.
package dpar

// #include <stdlib.h>
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"

	"dpar.dev/go/raw"
)

// Status is a dpar_status: OK, or a negative error. A newer library may return others: any negative status is an
// error. Each is an error value too, for errors.Is: errors.Is(err, dpar.ErrTimeout) holds for an *Error whose Status
// is ErrTimeout (an *Error unwraps to its Status).
type Status int32

// Error is the status's name ("DPAR_ERR_TIMEOUT").
func (s Status) Error() string { return StatusName(s) }

// Status codes of dpar.h.
const (
	OK               Status = 0
	ErrInvalidArg    Status = -1
	ErrOutOfMemory   Status = -2
	ErrDevice        Status = -3
	ErrCommunication Status = -4
	ErrRemote        Status = -5
	ErrTimeout       Status = -6
	ErrMismatch      Status = -7
	ErrIO            Status = -8
	ErrCorrupt       Status = -9
	ErrNotSupported  Status = -10
	ErrInvalidState  Status = -11
	ErrInternal      Status = -12
)

// Error is a failed dpar call: its status and dpar's message. Return one from a callback to fail the engine call
// with that status and message.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return StatusName(e.Status) + ": " + e.Message }

// Unwrap is the error's Status, so that errors.Is(err, dpar.ErrTimeout) tests the status.
func (e *Error) Unwrap() error { return e.Status }

// StatusName is a status's name, such as "DPAR_ERR_TIMEOUT".
func StatusName(status Status) string { return raw.Dpar_status_str(int(status)) }

// errorOf reads, then clears, the calling thread's error: the caller holds runtime.LockOSThread.
func errorOf(status int) error {
	if status == int(OK) {
		return nil
	}
	msg := raw.Dpar_last_error()
	raw.Dpar_clear_error()
	return &Error{Status: Status(status), Message: msg}
}

// call runs one dpar call and reads its error on the same OS thread.
func call(f func() int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return errorOf(f())
}

// release is every handle's Close: it frees *h once, then clears it and owner's finalizer, so that a second Close,
// or the finalizer after Close, finds nothing to free. h is owner's raw field, a SWIG pointer (nil once closed).
func release[H interface{ Swigcptr() uintptr }](owner any, h *H, free func(H)) {
	if any(*h) == nil {
		return
	}
	free(*h)
	var closed H
	*h = closed
	runtime.SetFinalizer(owner, nil)
}

// Version is the loaded library's version, MAJOR*10000 + MINOR*100 + PATCH; VersionString "0.6.0".
func Version() int          { return raw.Dpar_version() }
func VersionString() string { return raw.Dpar_version_string() }

// CPUGemmBackend says what runs the CPU matrix multiplies: the GEMM library, its version and the kernels it chose
// for this CPU, such as "oneDNN 2.6.3 (OpenMP), avx512_core f32 kernels (CPU ISA avx512_core_amx)".
func CPUGemmBackend() string { return raw.Dpar_cpu_gemm_backend() }

// DeviceKind is a dpar_device_kind.
type DeviceKind int32

// Device kinds.
const (
	CPU  DeviceKind = 0
	CUDA DeviceKind = 1
)

// DeviceCount is the number of devices of a kind an engine uses by default.
func DeviceCount(kind DeviceKind) (int, error) {
	var n uint64
	err := call(func() int { return raw.Dpar_device_count(unsafe.Pointer(&n), int(kind)) })
	return int(n), err
}

// ParseDevice parses "cpu:3", "cpu" or "cuda:1" into (kind, index).
func ParseDevice(text string) (kind DeviceKind, index int, err error) {
	d := raw.NewDpar_device()
	defer raw.DeleteDpar_device(d)
	err = call(func() int { return raw.Dpar_device_parse(d, text) })
	return DeviceKind(d.GetKind()), d.GetIndex(), err
}

// DType is a dpar_dtype, an element type: tensors hold F32 and I32; the collectives move all four.
type DType int32

const (
	F32 DType = 0
	I32 DType = 1
	F64 DType = 5
	I64 DType = 6
)

// Tensor is a dpar tensor in dpar's memory.
type Tensor struct {
	raw      raw.Struct_SS_dpar_tensor
	borrowed bool // a loader's batch: its parent frees it
	// The loader a borrowed batch belongs to, reachable while the batch is: the loader's finalizer frees the
	// batch, and must not run while a call still uses it.
	parent *Loader
}

func newTensor(p uintptr) *Tensor {
	t := &Tensor{raw: raw.SwigcptrStruct_SS_dpar_tensor(p)}
	runtime.SetFinalizer(t, (*Tensor).Close)
	return t
}

// Close frees the tensor (idempotent; nothing for a tensor borrowed from a loader).
func (t *Tensor) Close() {
	if t.borrowed {
		t.raw, t.parent = nil, nil // its parent frees it
		return
	}
	release(t, &t.raw, raw.Dpar_tensor_free)
}

// Zeros makes a zero-filled tensor on cpu:index (kind CPU) or cuda:index.
func Zeros(dtype DType, shape []int64, kind DeviceKind, index int) (*Tensor, error) {
	d := raw.NewDpar_device()
	defer raw.DeleteDpar_device(d)
	d.SetKind(int(kind))
	d.SetIndex(index)
	var p uintptr
	err := call(func() int {
		return raw.Dpar_tensor_create(unsafe.Pointer(&p), int(dtype), address(shape), int64(len(shape)), d)
	})
	if err != nil {
		return nil, err
	}
	return newTensor(p), nil
}

// FromFloat32 copies values into a new cpu:0 f32 tensor of the given shape.
func FromFloat32(shape []int64, values []float32) (*Tensor, error) {
	return fromHost(F32, shape, address(values), 4*len(values))
}

// FromInt32 copies values into a new cpu:0 i32 tensor.
func FromInt32(shape []int64, values []int32) (*Tensor, error) {
	return fromHost(I32, shape, address(values), 4*len(values))
}

// fromHost is a new cpu:0 tensor holding bytes copied from p; nil and dpar's error when they do not fit the shape.
func fromHost(dtype DType, shape []int64, p unsafe.Pointer, bytes int) (*Tensor, error) {
	t, err := Zeros(dtype, shape, CPU, 0)
	if err != nil {
		return nil, err
	}
	if err := t.copyFrom(p, bytes); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

func (t *Tensor) copyFrom(p unsafe.Pointer, bytes int) error {
	err := call(func() int { return raw.Dpar_tensor_copy_from_host(t.raw, p, int64(bytes)) })
	runtime.KeepAlive(t)
	return err
}

// Shape is the tensor's extents.
func (t *Tensor) Shape() ([]int64, error) {
	var s [4]int64
	var n uint64
	err := call(func() int { return raw.Dpar_tensor_shape(unsafe.Pointer(&s[0]), unsafe.Pointer(&n), t.raw, 4) })
	runtime.KeepAlive(t)
	return append([]int64(nil), s[:n]...), err
}

// Info is the tensor's dtype, element count and device (kind, index).
func (t *Tensor) Info() (dtype DType, numel int, kind DeviceKind, index int, err error) {
	var dt int32
	var n uint64
	d := raw.NewDpar_device()
	defer raw.DeleteDpar_device(d)
	err = call(func() int { return raw.Dpar_tensor_info(unsafe.Pointer(&dt), unsafe.Pointer(&n), d, t.raw) })
	runtime.KeepAlive(t)
	return DType(dt), int(n), DeviceKind(d.GetKind()), d.GetIndex(), err
}

// ToFloat32 copies an f32 tensor out.
func (t *Tensor) ToFloat32() ([]float32, error) {
	_, n, _, _, err := t.Info()
	if err != nil {
		return nil, err
	}
	out := make([]float32, n)
	if n == 0 {
		return out, nil
	}
	err = call(func() int { return raw.Dpar_tensor_copy_to_host(address(out), t.raw, int64(4*n)) })
	runtime.KeepAlive(t)
	return out, err
}

// Float32s is a copy of an f32 tensor's values (host or device memory). It stays valid whatever becomes of the
// tensor: a slice over dpar's memory would not survive the finalizer that frees the tensor once it is unreachable.
func (t *Tensor) Float32s() ([]float32, error) {
	return copyOut[float32](t, F32, "Float32s: the tensor is not f32")
}

// Int32s is a copy of an i32 tensor's values (a loader's labels), as Float32s.
func (t *Tensor) Int32s() ([]int32, error) {
	return copyOut[int32](t, I32, "Int32s: the tensor is not i32")
}

// UnsafeFloat32s is a host f32 tensor's memory, without a copy. The slice is valid only while the tensor is open
// and reachable: the caller must Close the tensor, or call runtime.KeepAlive(t), after its last use of the
// slice, or the finalizer may free the memory under it (and a loader's batch changes at its next Next).
func (t *Tensor) UnsafeFloat32s() ([]float32, error) {
	return hostView[float32](t, F32, "UnsafeFloat32s: the tensor is not f32")
}

// UnsafeInt32s is a host i32 tensor's memory, without a copy, valid as UnsafeFloat32s says.
func (t *Tensor) UnsafeInt32s() ([]int32, error) {
	return hostView[int32](t, I32, "UnsafeInt32s: the tensor is not i32")
}

// elementsOf is the number of elements of a tensor that must hold dtype (an error saying wrongType if not).
func elementsOf(t *Tensor, dtype DType, wrongType string) (int, error) {
	has, n, _, _, err := t.Info()
	if err != nil {
		return 0, err
	}
	if has != dtype {
		return 0, &Error{Status: ErrInvalidArg, Message: wrongType}
	}
	return n, nil
}

// copyOut is a copy of a tensor's values as a []T, after checking that it holds dtype.
func copyOut[T float32 | int32](t *Tensor, dtype DType, wrongType string) ([]T, error) {
	n, err := elementsOf(t, dtype, wrongType)
	if err != nil {
		return nil, err
	}
	out := make([]T, n)
	if n == 0 {
		return out, nil
	}
	err = call(func() int { return raw.Dpar_tensor_copy_to_host(address(out), t.raw, int64(4*n)) })
	runtime.KeepAlive(t)
	return out, err
}

// hostView is a host tensor's memory as a []T, after checking that it holds dtype.
func hostView[T float32 | int32](t *Tensor, dtype DType, wrongType string) ([]T, error) {
	n, err := elementsOf(t, dtype, wrongType)
	if err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	if err = call(func() int { return raw.Dpar_tensor_data(unsafe.Pointer(&p), t.raw) }); err != nil {
		return nil, err
	}
	runtime.KeepAlive(t)
	return unsafe.Slice((*T)(p), n), nil
}

// ActivationKind is a dpar_activation, a layer of Model.Activation.
type ActivationKind int32

const (
	ReLU    ActivationKind = 0
	GELU    ActivationKind = 1
	Tanh    ActivationKind = 2
	Sigmoid ActivationKind = 3
	SiLU    ActivationKind = 4
)

// Model is a sequential model: the template an Engine copies to every device.
type Model struct {
	raw raw.Struct_SS_dpar_model
}

// NewModel makes an empty model whose parameters are initialised from seed.
func NewModel(seed uint64) (*Model, error) {
	o := raw.NewDpar_model_options()
	defer raw.DeleteDpar_model_options(o)
	var p uintptr
	err := call(func() int {
		if s := raw.Dpar_model_options_init(o); s != int(OK) {
			return s
		}
		o.SetSeed(seed)
		return raw.Dpar_model_create(unsafe.Pointer(&p), o)
	})
	if err != nil {
		return nil, err
	}
	m := &Model{raw: raw.SwigcptrStruct_SS_dpar_model(p)}
	runtime.SetFinalizer(m, (*Model).Close)
	return m, nil
}

// Close frees the model; engines built from it are not affected.
func (m *Model) Close() { release(m, &m.raw, raw.Dpar_model_free) }

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (m *Model) Linear(in, out int64, bias bool) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_linear(m.raw, in, out, b2i(bias)) })
}
func (m *Model) Activation(kind ActivationKind) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_activation(m.raw, int(kind)) })
}
func (m *Model) Dropout(p float32) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_dropout(m.raw, p) })
}

// ModelInput is the model's input where a node id is expected (BranchFrom, AddSum, AddConcat).
const ModelInput int32 = -1

// LastNode is the id of the last node added (nodes are numbered 0, 1, ... as added); ModelInput when empty.
func (m *Model) LastNode() (int32, error) {
	defer runtime.KeepAlive(m)
	var n int32
	err := call(func() int { return raw.Dpar_model_last_node(unsafe.Pointer(&n), m.raw) })
	return n, err
}

// BranchFrom makes the next node added without explicit inputs read node (ModelInput for the model's input).
func (m *Model) BranchFrom(node int32) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_branch_from(m.raw, int(node)) })
}

// SetNodeName names a node as a PyTorch module path ("layer1.0.conv1"): its parameters become
// "layer1.0.conv1.weight".
func (m *Model) SetNodeName(node int32, name string) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_set_node_name(m.raw, int(node), name) })
}

// TieParam ties node's parameter param to sourceNode's sourceParam, as PyTorch's lm_head.weight = wte.weight: both
// nodes read the source's parameter (its values and name), held, counted, reduced and stepped once, its gradient
// the sum of both; checkpoints hold it under both keys.
func (m *Model) TieParam(node int32, param string, sourceNode int32, sourceParam string) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_tie_param(m.raw, int(node), param, int(sourceNode), sourceParam)
	})
}

func int32s(v []int32) unsafe.Pointer {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Pointer(&v[0])
}

// AddSum appends the elementwise sum of nodes of equal shape (a residual connection).
func (m *Model) AddSum(inputs ...int32) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_sum(m.raw, int32s(inputs), int64(len(inputs))) })
}

// AddConcat appends the concatenation of nodes along dim 1.
func (m *Model) AddConcat(inputs ...int32) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_concat(m.raw, int32s(inputs), int64(len(inputs))) })
}

// AddFlatten appends (B, ...) -> (B, prod(...)): a view, no copy.
func (m *Model) AddFlatten() error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_flatten(m.raw) })
}

// AddReshape appends (B, ...) -> (B, rowShape...), as nn.Unflatten(1, rowShape): a view, no copy.
func (m *Model) AddReshape(rowShape ...int64) error {
	defer runtime.KeepAlive(m)
	var p unsafe.Pointer
	if len(rowShape) > 0 {
		p = unsafe.Pointer(&rowShape[0])
	}
	return call(func() int { return raw.Dpar_model_add_reshape(m.raw, p, int64(len(rowShape))) })
}

// Conv2d holds nn.Conv2d's arguments; pairs are (height, width). DefaultConv2d fills in PyTorch's defaults.
type Conv2d struct {
	InChannels, OutChannels int64
	KernelSize              [2]int64
	Stride                  [2]int64 // (1, 1) by default
	Padding                 [2]int64 // (0, 0) by default
	Dilation                [2]int64 // (1, 1) by default
	Groups                  int64    // 1 by default
	Bias                    bool     // true by default
}

// DefaultConv2d is nn.Conv2d(in, out, kernel) with PyTorch's defaults, to adjust before Model.Conv2d.
func DefaultConv2d(in, out int64, kernel [2]int64) Conv2d {
	return Conv2d{InChannels: in, OutChannels: out, KernelSize: kernel, Stride: [2]int64{1, 1},
		Dilation: [2]int64{1, 1}, Groups: 1, Bias: true}
}

// Conv2d appends a 2-D convolution (NCHW), with parameters "weight" (out, in/groups, kh, kw) and "bias" (out)
// initialised as PyTorch's.
func (m *Model) Conv2d(c Conv2d) error {
	defer runtime.KeepAlive(m)
	// Arrays of plain integers: cgo lets C read Go memory that holds no Go pointers, for the call's duration.
	k, s, p, d := c.KernelSize, c.Stride, c.Padding, c.Dilation
	return call(func() int {
		return raw.Dpar_model_add_conv2d(m.raw, c.InChannels, c.OutChannels, unsafe.Pointer(&k[0]),
			unsafe.Pointer(&s[0]), unsafe.Pointer(&p[0]), unsafe.Pointer(&d[0]), c.Groups, b2i(c.Bias))
	})
}

// pool2d calls f with kernel, stride (nil: the kernel) and padding.
func (m *Model) pool2d(f func(raw.Struct_SS_dpar_model, unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) int,
	kernel [2]int64, stride *[2]int64, padding [2]int64) error {
	defer runtime.KeepAlive(m)
	var sp unsafe.Pointer
	if stride != nil {
		s := *stride
		sp = unsafe.Pointer(&s[0])
	}
	return call(func() int { return f(m.raw, unsafe.Pointer(&kernel[0]), sp, unsafe.Pointer(&padding[0])) })
}

// MaxPool2d appends nn.MaxPool2d(kernel, stride, padding); a nil stride is the kernel size.
func (m *Model) MaxPool2d(kernel [2]int64, stride *[2]int64, padding [2]int64) error {
	return m.pool2d(raw.Dpar_model_add_max_pool2d, kernel, stride, padding)
}

// AvgPool2d appends nn.AvgPool2d(kernel, stride, padding) (padding counts in the divisor); a nil stride is the
// kernel size.
func (m *Model) AvgPool2d(kernel [2]int64, stride *[2]int64, padding [2]int64) error {
	return m.pool2d(raw.Dpar_model_add_avg_pool2d, kernel, stride, padding)
}

// AdaptiveAvgPool2d appends nn.AdaptiveAvgPool2d((h, w)); only (1, 1) is implemented (ErrNotSupported otherwise).
func (m *Model) AdaptiveAvgPool2d(h, w int64) error {
	defer runtime.KeepAlive(m)
	return call(func() int { return raw.Dpar_model_add_adaptive_avg_pool2d(m.raw, h, w) })
}

func (m *Model) count(f func(unsafe.Pointer, raw.Struct_SS_dpar_model) int) (int, error) {
	defer runtime.KeepAlive(m)
	var n uint64
	err := call(func() int { return f(unsafe.Pointer(&n), m.raw) })
	return int(n), err
}

func (m *Model) NumLayers() (int, error)        { return m.count(raw.Dpar_model_num_layers) }
func (m *Model) NumParams() (int, error)        { return m.count(raw.Dpar_model_num_params) }
func (m *Model) NumParamElements() (int, error) { return m.count(raw.Dpar_model_num_param_elements) }

// ParamInfo is parameter index's name ("0.weight") and shape.
func (m *Model) ParamInfo(index int) (string, []int64, error) {
	defer runtime.KeepAlive(m)
	var s [4]int64
	var n uint64
	name := ""
	err := call(func() int {
		st := raw.Dpar_model_param_info(unsafe.Pointer(&s[0]), unsafe.Pointer(&n), m.raw, int64(index))
		if st == int(OK) {
			name = raw.Dpar_model_param_name(m.raw, int64(index))
		}
		return st
	})
	return name, append([]int64(nil), s[:n]...), err
}

// ParamDecays tells whether parameter index decays when the engine excludes biases and norms from weight decay
// (Engine.SetWeightDecayExclusion): false for biases and BatchNorm's weight and bias.
func (m *Model) ParamDecays(index int) (bool, error) {
	defer runtime.KeepAlive(m)
	var d int32
	err := call(func() int { return raw.Dpar_model_param_decays(unsafe.Pointer(&d), m.raw, int64(index)) })
	return d != 0, err
}

func (m *Model) GetParam(index int) ([]float32, error) {
	_, shape, err := m.ParamInfo(index)
	if err != nil {
		return nil, err
	}
	n := int64(1)
	for _, e := range shape {
		n *= e
	}
	out := make([]float32, n)
	err = call(func() int { return raw.Dpar_model_get_param(address(out), m.raw, int64(index), n) })
	runtime.KeepAlive(m)
	return out, err
}

func (m *Model) SetParam(index int, values []float32) error {
	defer runtime.KeepAlive(m)
	return call(func() int {
		return raw.Dpar_model_set_param(m.raw, int64(index), address(values), int64(len(values)))
	})
}

// OptimizerKind is a dpar_optimizer_kind.
type OptimizerKind int32

const (
	SGD   OptimizerKind = 0
	Adam  OptimizerKind = 1
	AdamW OptimizerKind = 2
)

// Loss is a dpar_loss, the loss of the fused training step.
type Loss int32

const (
	CrossEntropy Loss = 0
	MSE          Loss = 1
)

// IgnoreIndex is the cross-entropy target that is ignored: no loss, no gradient, not counted in the mean
// (PyTorch's default ignore_index, for padding and prompt tokens).
const IgnoreIndex int32 = -100

// ProcessMode is a dpar_processes: which processes an engine spans.
type ProcessMode int32

const (
	ProcessesAuto   ProcessMode = 0
	ProcessesSingle ProcessMode = 1
	ProcessesMPI    ProcessMode = 2
)

// Compression is how gradient buckets cross the processes (SetGradientCompression).
type Compression int32

const (
	CompressionNone Compression = 0 // f32, as summed
	CompressionBF16 Compression = 1 // each process's sum rounded to bfloat16, summed across the processes in bfloat16
)

// Reduction is how each bucket of summed gradients reaches the replicas (SetGradientReduction).
type Reduction int32

const (
	// Every replica receives the whole bucket (an all-reduce, as DDP): the default. Each process holds the whole
	// optimizer state, among its devices, and only the all-reduce crosses the processes.
	ReductionAllReduce Reduction = 0
	// Each replica receives only the block its optimizer steps (ZeRO stage 2); under mpirun the optimizer's shards
	// span every process, for the all-reduce's bytes between them.
	ReductionReduceScatter Reduction = 1
	// The all-reduce, with the optimizer's shards spanning every process (ZeRO stage 1 over the processes): the
	// memory of ReductionReduceScatter for about 1.5x the bytes between processes (the parameters' all-gather too).
	ReductionAllReduceSharded Reduction = 2
)

// Options of an engine and its optimizer (dpar_optimizer_options and dpar_engine_options, every field); zero
// values take dpar's defaults except where noted. A nil pointer field takes dpar's default too: its zero value is a
// setting of its own.
type Options struct {
	// The optimizer.
	Optimizer   OptimizerKind // SGD (default), Adam, AdamW
	LR          float32       // 0: 0.01
	Momentum    float32       // SGD
	Dampening   float32       // SGD
	Nesterov    bool          // SGD; needs Momentum > 0 and Dampening 0
	WeightDecay float32
	Beta1       float32 // Adam, AdamW; 0: 0.9
	Beta2       float32 // Adam, AdamW; 0: 0.999
	Eps         float32 // Adam, AdamW; 0: 1e-8

	// The engine.
	Devices          int         // CPU devices (0: dpar's default count)
	DeviceKind       DeviceKind  // CPU (default) or CUDA
	DeviceIDs        []int32     // the devices of DeviceKind to use, replica r on DeviceIDs[r] (nil: all)
	OutputDevice     *int32      // where Forward gathers, one of the devices (nil: the first)
	Loss             Loss        // CrossEntropy (default) or MSE
	Seed             uint64      // each replica's RNG stream (dropout)
	TimeoutSeconds   float64     // how long a worker waits for the others (0: 300; math.Inf(1): no limit)
	BLASThreads      int         // BLAS threads in each CPU worker (0: 1)
	PinWorkers       *bool       // worker r on the r-th CPU of the affinity mask (nil: true)
	FirstBucketBytes uint64      // the first gradient bucket closes at this many bytes (0: 1 MiB)
	BucketCapBytes   uint64      // later buckets close at this many bytes (0: 25 MiB; math.MaxUint64: one bucket)
	Processes        ProcessMode // ProcessesAuto (default), ProcessesSingle, ProcessesMPI
	// How long NewEngine waits for every process to create its engine (processes start at different times): the
	// connection between the processes and their first exchanges; TimeoutSeconds holds after. 0: TimeoutSeconds;
	// math.Inf(1): no limit.
	CreateTimeoutSeconds float64
}

// Engine is a DataParallel engine. dpar serialises calls on it, so it may be shared between goroutines.
type Engine struct {
	raw raw.Struct_SS_dpar_engine
}

// NewEngine copies model to every device.
func NewEngine(model *Model, o Options) (*Engine, error) {
	oo := raw.NewDpar_optimizer_options()
	defer raw.DeleteDpar_optimizer_options(oo)
	eo := raw.NewDpar_engine_options()
	defer raw.DeleteDpar_engine_options(eo)
	var p uintptr
	var ids unsafe.Pointer // copied into C memory: the options struct is C's and may not hold a Go pointer
	if len(o.DeviceIDs) > 0 {
		ids = C.malloc(C.size_t(4 * len(o.DeviceIDs)))
		defer C.free(ids)
		copy(unsafe.Slice((*int32)(ids), len(o.DeviceIDs)), o.DeviceIDs)
	}
	err := call(func() int {
		if s := raw.Dpar_optimizer_options_init(oo); s != int(OK) {
			return s
		}
		if s := raw.Dpar_engine_options_init(eo); s != int(OK) {
			return s
		}
		oo.SetKind(int(o.Optimizer))
		if o.LR != 0 {
			oo.SetLr(o.LR)
		}
		oo.SetMomentum(o.Momentum)
		oo.SetDampening(o.Dampening)
		oo.SetNesterov(b2i(o.Nesterov))
		oo.SetWeight_decay(o.WeightDecay)
		if o.Beta1 != 0 {
			oo.SetBeta1(o.Beta1)
		}
		if o.Beta2 != 0 {
			oo.SetBeta2(o.Beta2)
		}
		if o.Eps != 0 {
			oo.SetEps(o.Eps)
		}
		eo.SetNum_cpu_devices(int64(o.Devices))
		eo.SetDevice_kind(int(o.DeviceKind))
		if o.OutputDevice != nil {
			eo.SetOutput_device(int(*o.OutputDevice))
		}
		eo.SetLoss(int(o.Loss))
		eo.SetSeed(o.Seed)
		if o.TimeoutSeconds != 0 {
			eo.SetTimeout_seconds(o.TimeoutSeconds)
		}
		if o.BLASThreads != 0 {
			eo.SetBlas_threads(int64(o.BLASThreads))
		}
		if o.PinWorkers != nil {
			eo.SetPin_workers(b2i(*o.PinWorkers))
		}
		eo.SetFirst_bucket_bytes(int64(o.FirstBucketBytes))
		eo.SetBucket_cap_bytes(int64(o.BucketCapBytes))
		eo.SetProcesses(int(o.Processes))
		eo.SetCreate_timeout_seconds(o.CreateTimeoutSeconds)
		if ids != nil {
			eo.SetDevice_ids(ids)
			eo.SetNum_device_ids(int64(len(o.DeviceIDs)))
		}
		return raw.Dpar_engine_create(unsafe.Pointer(&p), model.raw, oo, eo)
	})
	runtime.KeepAlive(model)
	if err != nil {
		return nil, err
	}
	e := &Engine{raw: raw.SwigcptrStruct_SS_dpar_engine(p)}
	runtime.SetFinalizer(e, (*Engine).Close)
	return e, nil
}

// Close stops the workers and frees the engine.
func (e *Engine) Close() { release(e, &e.raw, raw.Dpar_engine_free) }

// TrainStep is one fused training step; it returns the mean loss over the batch.
func (e *Engine) TrainStep(input, target *Tensor) (float32, error) {
	return e.batchLoss(raw.Dpar_engine_train_step, input, target)
}

// Accumulate adds one micro-batch's gradient (DDP's no_sync); Step then synchronises and steps.
func (e *Engine) Accumulate(input, target *Tensor) (float32, error) {
	return e.batchLoss(raw.Dpar_engine_accumulate, input, target)
}

// batchLoss runs a call that takes a batch (input, target) and writes its mean loss.
func (e *Engine) batchLoss(f func(unsafe.Pointer, raw.Struct_SS_dpar_engine, raw.Struct_SS_dpar_tensor,
	raw.Struct_SS_dpar_tensor) int, input, target *Tensor) (float32, error) {
	var loss float32
	err := call(func() int { return f(unsafe.Pointer(&loss), e.raw, input.raw, target.raw) })
	runtime.KeepAlive(e)
	runtime.KeepAlive(input)
	runtime.KeepAlive(target)
	return loss, err
}

func (e *Engine) simple(f func(raw.Struct_SS_dpar_engine) int) error {
	defer runtime.KeepAlive(e)
	return call(func() int { return f(e.raw) })
}

func (e *Engine) Step() error     { return e.simple(raw.Dpar_engine_step) }
func (e *Engine) ZeroGrad() error { return e.simple(raw.Dpar_engine_zero_grad) }

// Abort ends a call in flight on another goroutine; the engine cannot continue afterwards.
func (e *Engine) Abort() error { return e.simple(raw.Dpar_engine_abort) }

// Forward is DataParallel's forward, gathered on the output device. In training mode the engine keeps the input's
// memory for Backward (closing input does not free it; a loader's batch changes at the loader's next Next).
func (e *Engine) Forward(input *Tensor) (*Tensor, error) {
	var p uintptr
	err := call(func() int { return raw.Dpar_engine_forward(unsafe.Pointer(&p), e.raw, input.raw) })
	runtime.KeepAlive(e)
	runtime.KeepAlive(input)
	if err != nil {
		return nil, err
	}
	return newTensor(p), nil
}

// ForwardFloat32 is Forward on a Go slice: input holds the f32 batch of the given shape (batch first), in row-major
// order, as FromFloat32 takes it. The values are copied into dpar's memory, which the engine keeps for Backward, so
// the slice is the caller's again as soon as ForwardFloat32 returns. Output.Float32s gives the output as a slice.
func (e *Engine) ForwardFloat32(shape []int64, input []float32) (output *Tensor, err error) {
	return e.forwardCopy(FromFloat32(shape, input))
}

// ForwardInt32 is ForwardFloat32 for a model whose input is i32 indices (an Embedding's).
func (e *Engine) ForwardInt32(shape []int64, input []int32) (output *Tensor, err error) {
	return e.forwardCopy(FromInt32(shape, input))
}

// forwardCopy runs Forward on a tensor made for the call, then closes it (the engine holds its memory).
func (e *Engine) forwardCopy(input *Tensor, err error) (*Tensor, error) {
	if err != nil {
		return nil, err
	}
	defer input.Close()
	return e.Forward(input)
}

// Backward is DataParallel's backward from dL/d(output) of the last training-mode Forward, an f32 tensor shaped as
// its output; Step then synchronises the gradients and steps.
func (e *Engine) Backward(gradOutput *Tensor) error {
	defer runtime.KeepAlive(gradOutput)
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_backward(r, gradOutput.raw) })
}

// BackwardFloat32 is Backward on a Go slice: gradOutput holds dL/d(output) in row-major order, shape being the last
// forward's output shape (Output.Shape()). The values are copied; the slice is the caller's again on return.
func (e *Engine) BackwardFloat32(shape []int64, gradOutput []float32) error {
	g, err := FromFloat32(shape, gradOutput)
	if err != nil {
		return err
	}
	defer g.Close()
	return e.Backward(g)
}

func (e *Engine) SetTraining(training bool) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_set_training(r, b2i(training)) })
}

func (e *Engine) SetLR(lr float32) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_set_lr(r, lr) })
}

// SetMaxGradNorm clips the gradient of the following steps to this global L2 norm, as PyTorch's clip_grad_norm_
// between backward and the step; 0 turns clipping off.
func (e *Engine) SetMaxGradNorm(maxNorm float32) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_set_max_grad_norm(r, maxNorm) })
}

// SetGradientCompression compresses gradient buckets between processes from the next step on (CompressionNone,
// CompressionBF16). Every process sets the same; with one process it changes nothing.
func (e *Engine) SetGradientCompression(compression Compression) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_set_gradient_compression(r, int(compression))
	})
}

// SetWeightDecayExclusion, from the next step on, steps biases and norms' parameters (Model.ParamDecays false)
// with weight decay 0, as two PyTorch parameter groups; false (the default) decays every parameter.
func (e *Engine) SetWeightDecayExclusion(excludeBiasesAndNorms bool) error {
	v := 0
	if excludeBiasesAndNorms {
		v = 1
	}
	return e.simple(func(r raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_set_weight_decay_exclusion(r, v)
	})
}

// SetGradientReduction chooses how gradient buckets are reduced from the next step on (ReductionAllReduce,
// ReductionReduceScatter, ReductionAllReduceSharded). Every process sets the same, at the same point: where the
// optimizer's shards move across the processes, its state is gathered and cut anew (pending gradients make it fail
// with ErrInvalidState). Each way the replicas stay bit-identical and, without clipping, train to the same bits, so
// switching between steps is allowed.
func (e *Engine) SetGradientReduction(reduction Reduction) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_set_gradient_reduction(r, int(reduction))
	})
}

// ReduceDtype is the dtype gradient buckets are reduced in (Engine.SetReduceDtype), as FSDP's
// MixedPrecisionPolicy(reduce_dtype=...): a dpar_dtype.
type ReduceDtype int32

const (
	// ReduceF32 sums in f32 within a process, across processes as SetGradientCompression says: the default.
	ReduceF32 ReduceDtype = 0
	// ReduceBF16 rounds every replica's bucket to bf16 and carries the whole reduction in bf16 (within and across
	// the processes), the result widened to f32 for clipping and the optimizer.
	ReduceBF16 ReduceDtype = 2
)

// SetReduceDtype reduces gradient buckets in d from the next step on (dpar_engine_set_reduce_dtype). ErrInvalidArg
// for another dtype, ErrNotSupported where the processes' link does not move bf16, the engine unchanged. Every
// process sets the same.
func (e *Engine) SetReduceDtype(d ReduceDtype) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_set_reduce_dtype(r, int(d)) })
}

// ReduceDtype is the dtype SetReduceDtype set.
func (e *Engine) ReduceDtype() (ReduceDtype, error) {
	var d int32
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_reduce_dtype(unsafe.Pointer(&d), r) })
	return ReduceDtype(d), err
}

// SetReproducible turns the reproducible mode on with micro-chunks of microChunkRows rows, or off with 0
// (dpar_engine_set_reproducible): the same seed and global batches then give the same bits on any number of CPU
// devices and processes (TrainStep, Accumulate and Step). ErrInvalidArg for a negative count, ErrInvalidState while
// gradients are pending, ErrNotSupported on GPUs and for a model with BatchNorm, the engine unchanged. Every process
// sets the same.
func (e *Engine) SetReproducible(microChunkRows int64) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_set_reproducible(r, microChunkRows) })
}

// Reproducible is the rows per micro-chunk SetReproducible set (0: off).
func (e *Engine) Reproducible() (int64, error) {
	var rows int64
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_reproducible(unsafe.Pointer(&rows), r) })
	return rows, err
}

// Precision is what linear layers and convolutions compute in (Engine.SetPrecision), as torch.autocast's policy:
// a dpar_dtype.
type Precision int32

const (
	// PrecisionF32 computes everything in f32: the default.
	PrecisionF32 Precision = 0
	// PrecisionBF16: bf16 operands (the input rounded, each step's bf16 copy of the weights), f32 accumulation and
	// results; master weights, gradients, the optimizer and checkpoints f32.
	PrecisionBF16 Precision = 2
	// PrecisionF16: f16 (IEEE half) operands, f32 accumulation and results, as PrecisionBF16. f16 overflows above
	// 65504: train it with loss scaling (Engine.SetLossScaling). ErrNotSupported on CPU devices (oneDNN 2.6 has no
	// f16 GEMM for CPUs; the error says why); CUDA devices have it.
	PrecisionF16 Precision = 3
)

// SetPrecision makes linear layers and convolutions compute in p from the next call on. ErrNotSupported where a
// device lacks the kernels (bf16 on a CPU without AVX512-BF16 or AMX, f16 on any CPU), the engine unchanged. Every
// process sets the same.
func (e *Engine) SetPrecision(p Precision) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_set_precision(r, int(p)) })
}

// Precision is the compute dtype SetPrecision set.
func (e *Engine) Precision() (Precision, error) {
	var p int32
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_precision(unsafe.Pointer(&p), r) })
	return Precision(p), err
}

// SetAllowTF32 lets f32 GEMMs and convolutions use TF32 where the devices have it (off by default) and says
// whether they have it (CPU devices: false).
func (e *Engine) SetAllowTF32(allow bool) (bool, error) {
	v := 0
	if allow {
		v = 1
	}
	var has int32
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_set_allow_tf32(r, v, unsafe.Pointer(&has))
	})
	return has != 0, err
}

// GradNorm is the gradient's norm before clipping at the last step taken with clipping on (NaN before any).
func (e *Engine) GradNorm() (float32, error) {
	var norm float32
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_grad_norm(unsafe.Pointer(&norm), r) })
	return norm, err
}

// SetLossScaling turns on dynamic loss scaling from the next step on, as torch.amp.GradScaler(initScale,
// growthFactor, backoffFactor, growthInterval) (PyTorch's defaults: 65536, 2, 0.5, 2000); initScale 0 turns it
// off. A step whose scaled gradient holds inf or NaN is skipped on every replica and backs the scale off.
func (e *Engine) SetLossScaling(initScale, growthFactor, backoffFactor float32, growthInterval int64) error {
	return e.simple(func(r raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_set_loss_scaling(r, initScale, growthFactor, backoffFactor, growthInterval)
	})
}

// LossScale is the current loss scale; 1 with loss scaling off.
func (e *Engine) LossScale() (float32, error) {
	var scale float32
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_loss_scale(unsafe.Pointer(&scale), r) })
	return scale, err
}

// LastStepSkipped tells whether the last step taken with loss scaling on was skipped (its gradient held inf or NaN).
func (e *Engine) LastStepSkipped() (bool, error) {
	var skipped int32
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_last_step_skipped(unsafe.Pointer(&skipped), r)
	})
	return skipped != 0, err
}

func (e *Engine) count(f func(unsafe.Pointer, raw.Struct_SS_dpar_engine) int) (int, error) {
	var n uint64
	err := e.simple(func(r raw.Struct_SS_dpar_engine) int { return f(unsafe.Pointer(&n), r) })
	return int(n), err
}

func (e *Engine) StepCount() (int, error)   { return e.count(raw.Dpar_engine_step_count) }
func (e *Engine) NumReplicas() (int, error) { return e.count(raw.Dpar_engine_num_replicas) }
func (e *Engine) NumBuckets() (int, error)  { return e.count(raw.Dpar_engine_num_buckets) }

// Processes is this process's rank and the number of processes the engine spans.
func (e *Engine) Processes() (rank, size int, err error) {
	var r, s uint64
	err = e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_processes(unsafe.Pointer(&r), unsafe.Pointer(&s), x)
	})
	return int(r), int(s), err
}

// ProcessTransport is how gradient buckets travel between the processes: "" for one process, "mpi", "nccl", or
// "mpi through host memory (...)" saying why NCCL could not be used.
func (e *Engine) ProcessTransport() (string, error) {
	transport := ""
	err := e.simple(func(x raw.Struct_SS_dpar_engine) int {
		// The handle is checked by a call that returns a status; the string has none.
		st := raw.Dpar_engine_processes(nil, nil, x)
		if st == int(OK) {
			transport = raw.Dpar_engine_process_transport(x)
		}
		return st
	})
	return transport, err
}

// ReplicaDevice is replica's device (kind, index).
func (e *Engine) ReplicaDevice(replica int) (kind DeviceKind, index int, err error) {
	d := raw.NewDpar_device()
	defer raw.DeleteDpar_device(d)
	err = e.simple(func(x raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_replica_device(d, x, int64(replica)) })
	return DeviceKind(d.GetKind()), d.GetIndex(), err
}

// Split is how a batch of rows is split over the replicas.
func (e *Engine) Split(batch int) ([]int, error) {
	n, err := e.NumReplicas()
	if err != nil {
		return nil, err
	}
	rows := make([]uint64, n)
	err = e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_split(address(rows), x, int64(batch), int64(n))
	})
	out := make([]int, n)
	for i, r := range rows {
		out[i] = int(r)
	}
	return out, err
}

// ReplicaLosses is each replica's loss in the last step (NaN for replicas without rows).
func (e *Engine) ReplicaLosses() ([]float32, error) {
	n, err := e.NumReplicas()
	if err != nil {
		return nil, err
	}
	out := make([]float32, n)
	err = e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_replica_losses(address(out), x, int64(n))
	})
	return out, err
}

// Params is a replica's parameters, flattened (count: the model's number of parameter elements).
func (e *Engine) Params(replica, count int) ([]float32, error) {
	out := make([]float32, count)
	err := e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_get_params(address(out), x, int64(replica), int64(count))
	})
	return out, err
}

// MemoryStats is what a replica's device holds of dpar's tensors, in bytes (Engine.MemoryStats).
type MemoryStats struct {
	AllocatedBytes int64 // held now
	PeakBytes      int64 // the most held at once since the process started or the device's last reset
}

// MemoryStats is what replica `replica`'s device holds of dpar's tensors (parameters, gradients, optimizer state,
// activations, scratch) now and at its peak (dpar_engine_memory_stats; torch.cuda's memory_allocated and
// max_memory_allocated). The count is the device's: replicas and engines on one device count together.
// ErrInvalidArg for a replica out of range.
func (e *Engine) MemoryStats(replica int) (MemoryStats, error) {
	var allocated, peak int64
	err := e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_memory_stats(unsafe.Pointer(&allocated), unsafe.Pointer(&peak), x, int64(replica))
	})
	return MemoryStats{AllocatedBytes: allocated, PeakBytes: peak}, err
}

// ResetPeakMemory starts the peak of replica `replica`'s device again from what it holds now, for every engine on
// that device (dpar_engine_reset_peak_memory).
func (e *Engine) ResetPeakMemory(replica int) error {
	return e.simple(func(x raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_reset_peak_memory(x, int64(replica)) })
}

func (e *Engine) Save(path string) error {
	return e.simple(func(x raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_save(x, path) })
}

func (e *Engine) Load(path string) error {
	return e.simple(func(x raw.Struct_SS_dpar_engine) int { return raw.Dpar_engine_load(x, path) })
}

// Fault is a dpar_fault, for InjectFault.
type Fault int32

const (
	FaultNone     Fault = 0
	FaultAlloc    Fault = 1
	FaultForward  Fault = 2
	FaultBackward Fault = 3
)

func (e *Engine) InjectFault(replica int, fault Fault) error {
	return e.simple(func(x raw.Struct_SS_dpar_engine) int {
		return raw.Dpar_engine_inject_fault(x, int64(replica), int(fault))
	})
}

// ReduceOp is a dpar_reduce_op.
type ReduceOp int32

const (
	Sum  ReduceOp = 0
	Mean ReduceOp = 1
	Max  ReduceOp = 2
	Min  ReduceOp = 3
)

// CommGroup is the participants of one process (one goroutine each, shared memory).
type CommGroup struct {
	raw raw.Struct_SS_dpar_comm_group
}

// withCommOptions calls create with communicator options of the given timeout, freed when it returns; inside
// call(), so that a failure of either is read on the same thread.
func withCommOptions(timeoutSeconds float64, create func(raw.Dpar_comm_options) int) int {
	o := raw.NewDpar_comm_options()
	defer raw.DeleteDpar_comm_options(o)
	if s := raw.Dpar_comm_options_init(o); s != int(OK) {
		return s
	}
	o.SetTimeout_seconds(timeoutSeconds)
	return create(o)
}

// NewCommGroup makes a group of size participants.
func NewCommGroup(size int, timeoutSeconds float64) (*CommGroup, error) {
	var p uintptr
	err := call(func() int {
		return withCommOptions(timeoutSeconds, func(o raw.Dpar_comm_options) int {
			return raw.Dpar_comm_group_create(unsafe.Pointer(&p), int64(size), o)
		})
	})
	if err != nil {
		return nil, err
	}
	g := &CommGroup{raw: raw.SwigcptrStruct_SS_dpar_comm_group(p)}
	runtime.SetFinalizer(g, (*CommGroup).Close)
	return g, nil
}

// NewCommGroupOnDevices makes a group whose participant r's buffers are memory of devices[r] (kind, index pairs
// such as {CUDA, 0}), all of one kind. On GPUs, participant r's collectives are ordered on streams[r], a
// cudaStream_t (nil streams, or a zero entry, is the legacy default stream). Go slices are host memory: on GPUs
// the collectives take device addresses (Comm.AllReduceUnsafe and the other *Unsafe methods), and the reducer
// the framework's gradients (NewReducerUnsafe).
func NewCommGroupOnDevices(devices [][2]int, streams []uintptr, timeoutSeconds float64) (*CommGroup, error) {
	if streams != nil && len(streams) != len(devices) {
		return nil, &Error{Status: ErrInvalidArg,
			Message: fmt.Sprintf("streams: %d streams for %d devices", len(streams), len(devices))}
	}
	// The C struct dpar_device is two int32 fields: kind, index.
	flat := make([]int32, 2*len(devices)+1) // never empty, so that &flat[0] exists
	for i, d := range devices {
		flat[2*i], flat[2*i+1] = int32(d[0]), int32(d[1])
	}
	// The handles travel as C memory: a Go slice holding values that look like pointers is not for cgo to check.
	var native unsafe.Pointer
	if len(streams) > 0 {
		native = C.malloc(C.size_t(len(streams)) * C.size_t(unsafe.Sizeof(uintptr(0))))
		defer C.free(native)
		copy(unsafe.Slice((*uintptr)(native), len(streams)), streams)
	}
	var p uintptr
	err := call(func() int {
		return withCommOptions(timeoutSeconds, func(o raw.Dpar_comm_options) int {
			return raw.Dpar_comm_group_create_on_devices(unsafe.Pointer(&p), unsafe.Pointer(&flat[0]), native,
				int64(len(devices)), o)
		})
	})
	if err != nil {
		return nil, err
	}
	g := &CommGroup{raw: raw.SwigcptrStruct_SS_dpar_comm_group(p)}
	runtime.SetFinalizer(g, (*CommGroup).Close)
	return g, nil
}

// Close releases the caller's reference; members keep the group alive.
func (g *CommGroup) Close() { release(g, &g.raw, raw.Dpar_comm_group_free) }

// Member is participant rank's communicator.
func (g *CommGroup) Member(rank int) (*Comm, error) {
	var p uintptr
	err := call(func() int { return raw.Dpar_comm_group_member(unsafe.Pointer(&p), g.raw, int64(rank)) })
	runtime.KeepAlive(g)
	if err != nil {
		return nil, err
	}
	return newComm(p), nil
}

// Comm is one participant: its collectives must not overlap; Abort and AsyncError may be called from anywhere.
type Comm struct {
	raw raw.Struct_SS_dpar_comm
}

func newComm(p uintptr) *Comm {
	c := &Comm{raw: raw.SwigcptrStruct_SS_dpar_comm(p)}
	runtime.SetFinalizer(c, (*Comm).Close)
	return c
}

// NewMPIComm is this process's communicator over MPI_COMM_WORLD.
func NewMPIComm(timeoutSeconds float64) (*Comm, error) {
	var p uintptr
	err := call(func() int {
		return withCommOptions(timeoutSeconds, func(o raw.Dpar_comm_options) int {
			return raw.Dpar_comm_create_mpi(unsafe.Pointer(&p), o)
		})
	})
	if err != nil {
		return nil, err
	}
	return newComm(p), nil
}

func (c *Comm) Close() { release(c, &c.raw, raw.Dpar_comm_free) }

// Info is (rank, size).
func (c *Comm) Info() (rank, size int, err error) {
	var r, s uint64
	err = call(func() int { return raw.Dpar_comm_info(unsafe.Pointer(&r), unsafe.Pointer(&s), c.raw) })
	runtime.KeepAlive(c)
	return int(r), int(s), err
}

// Device is the device whose memory the buffers are: (CPU, 0) for host memory.
func (c *Comm) Device() (kind DeviceKind, index int, err error) {
	d := raw.NewDpar_device()
	defer raw.DeleteDpar_device(d)
	err = call(func() int { return raw.Dpar_comm_device(d, c.raw) })
	runtime.KeepAlive(c)
	return DeviceKind(d.GetKind()), d.GetIndex(), err
}

// AllReduceFloat32 reduces buf in place across the participants: AllReduce(c, buf, buf, op).
func (c *Comm) AllReduceFloat32(buf []float32, op ReduceOp) error { return AllReduce(c, buf, buf, op) }

// BroadcastFloat32 copies root's buf into every participant's: Broadcast(c, buf, root).
func (c *Comm) BroadcastFloat32(buf []float32, root int) error { return Broadcast(c, buf, root) }

func (c *Comm) Barrier() error {
	defer runtime.KeepAlive(c)
	return call(func() int { return raw.Dpar_comm_barrier(c.raw) })
}

// Abort fails every participant's collectives with ErrRemote and reason.
func (c *Comm) Abort(reason string) error {
	defer runtime.KeepAlive(c)
	return call(func() int { return raw.Dpar_comm_abort(c.raw, reason) })
}

// AsyncError is nil while the communicator is usable, else the error its next collective would return.
func (c *Comm) AsyncError() error {
	defer runtime.KeepAlive(c)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var s int32
	if err := errorOf(raw.Dpar_comm_get_async_error(unsafe.Pointer(&s), c.raw)); err != nil {
		return err
	}
	return errorOf(int(s))
}

var _ = fmt.Sprintf
var _ = C.free
