"""dpar for Python: data-parallel training over several devices through dpar's C ABI.

Every handle is an object with close() and a context manager (and a finalizer as a safety net); every failed call
raises DparError carrying dpar's status and message. float32/int32 NumPy arrays go in and come out without a copy:
Tensor.wrap(array) keeps the array alive as long as the tensor, Tensor.numpy() is a view of dpar's memory that
keeps that memory alive (after close() too), and tensors speak DLPack (__dlpack__, Tensor.from_dlpack). Every
option of dpar.h's option structs is a keyword; the enums are IntEnums.
"""
import enum
import operator
import re
import weakref

import numpy as np

from . import raw as _swig

# SWIG's refusal of an argument: "in method 'dpar_model_add_linear', argument 2 of type 'int64_t'".
_SWIG_REFUSAL = re.compile(r"in method '(\w+)', argument (\d+) of type '([^']+)'")
_C_TYPES = {"int32_t": "an integer in [-2**31, 2**31)", "int64_t": "an integer in [-2**63, 2**63)",
            "uint64_t": "an integer in [0, 2**64)", "size_t": "an integer in [0, 2**64)", "float": "a number",
            "double": "a number", "char const *": "a str", "char *": "a str"}


class _Raw:
    """The raw layer, each function wrapped so that SWIG's own message for an argument it refuses ("in method
    'dpar_x', argument 2 of type 'int64_t'") never reaches the user: the error names the argument (from the
    function's docstring, "dpar_x(model, in_features, ...)") and the value it got."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        f = getattr(self._module, name)
        if callable(f) and not isinstance(f, type) and name.startswith("dpar_"):
            f = self._wrap(name, f)
        setattr(self, name, f)  # looked up once
        return f

    @staticmethod
    def _wrap(name, f):
        doc = f.__doc__ or ""
        m = re.match(rf"{name}\(([^)]*)\)", doc)
        params = [p.strip() for p in m.group(1).split(",")] if m else []

        def call(*args):
            try:
                return f(*args)
            except (TypeError, OverflowError, ValueError) as e:
                refused = _SWIG_REFUSAL.search(str(e))
                if refused is None:
                    raise
                n, ctype = int(refused.group(2)), refused.group(3)
                arg = params[n - 1] if n <= len(params) else f"argument {n}"
                got = repr(args[n - 1]) if n <= len(args) else "nothing"
                raise type(e)(f"{name[len('dpar_'):]}: {arg} must be {_C_TYPES.get(ctype, ctype)}, got {got}") \
                    from None

        call.__name__ = call.__qualname__ = name
        call.__doc__ = doc
        return call


_raw = _Raw(_swig)

def _enum(name, prefix, members, doc):
    """An IntEnum of dpar.h's constants `prefix + member` (an int wherever dpar takes one)."""
    e = enum.IntEnum(name, [(m, getattr(_raw, prefix + m)) for m in members], module=__name__)
    e.__doc__ = doc
    return e


Status = _enum("Status", "DPAR_", ["OK", "ERR_INVALID_ARGUMENT", "ERR_OUT_OF_MEMORY", "ERR_DEVICE",
                                   "ERR_COMMUNICATION", "ERR_REMOTE", "ERR_TIMEOUT", "ERR_MISMATCH", "ERR_IO",
                                   "ERR_CORRUPT", "ERR_NOT_SUPPORTED", "ERR_INVALID_STATE", "ERR_INTERNAL"],
               "dpar_status. A newer library may return others: any negative status is an error.")
DType = _enum("DType", "DPAR_", ["F32", "I32", "BF16", "F16", "U8", "F64", "I64"], "dpar_dtype: element types.")
DeviceKind = _enum("DeviceKind", "DPAR_DEVICE_", ["CPU", "CUDA"], "dpar_device_kind.")
Activation = _enum("Activation", "DPAR_", ["RELU", "GELU", "TANH", "SIGMOID", "SILU"], "dpar_activation.")
ReduceOp = _enum("ReduceOp", "DPAR_", ["SUM", "MEAN", "MAX", "MIN"], "dpar_reduce_op.")
Loss = _enum("Loss", "DPAR_LOSS_", ["CROSS_ENTROPY", "MSE"], "dpar_loss.")
Processes = _enum("Processes", "DPAR_PROCESSES_", ["AUTO", "SINGLE", "MPI"], "dpar_processes.")
Compression = _enum("Compression", "DPAR_COMPRESSION_", ["NONE", "BF16"], "dpar_gradient_compression.")
Reduction = _enum("Reduction", "DPAR_REDUCTION_", ["ALL_REDUCE", "REDUCE_SCATTER", "ALL_REDUCE_SHARDED"],
                  "dpar_gradient_reduction.")
Optimizer = _enum("Optimizer", "DPAR_", ["SGD", "ADAM", "ADAMW"], "dpar_optimizer_kind.")
Fault = _enum("Fault", "DPAR_FAULT_", ["NONE", "ALLOC", "FORWARD", "BACKWARD"], "dpar_fault.")
Init = _enum("Init", "DPAR_INIT_", ["ZEROS", "UNIFORM"], "dpar_init: a custom layer's parameter initialisation.")

# The flat names of earlier versions, as members of those enums.
globals().update({m.name: m for m in Status})
F32, I32 = DType.F32, DType.I32
RELU, GELU, TANH, SIGMOID, SILU = Activation
MODEL_INPUT = _raw.DPAR_MODEL_INPUT  # the model's input, where a node id is expected
SUM, MEAN, MAX, MIN = ReduceOp
LOSS_CROSS_ENTROPY, LOSS_MSE = Loss
IGNORE_INDEX = _raw.DPAR_IGNORE_INDEX  # the cross-entropy target that is ignored (PyTorch's ignore_index)
PROCESSES_AUTO, PROCESSES_SINGLE, PROCESSES_MPI = Processes
COMPRESSION_NONE, COMPRESSION_BF16 = Compression
REDUCTION_ALL_REDUCE, REDUCTION_REDUCE_SCATTER, REDUCTION_ALL_REDUCE_SHARDED = Reduction
SGD, ADAM, ADAMW = Optimizer
FAULT_NONE, FAULT_ALLOC, FAULT_FORWARD, FAULT_BACKWARD = Fault
DEVICE_CPU, DEVICE_CUDA = DeviceKind


class DparError(Exception):
    """A failed dpar call: `status` (a negative dpar_status), `name` ("DPAR_ERR_TIMEOUT") and dpar's `message`.
    Raise one from a callback to fail the engine call with that status and message."""

    def __init__(self, status, message):
        super().__init__(f"{status_name(status)}: {message}")
        self.status = Status(status) if status in Status._value2member_map_ else status
        self.message = message

    @property
    def name(self):
        return status_name(self.status)


def status_name(status):
    return _raw.dpar_status_str(status)


def _check(result):
    """A raw call's result: the status alone, or [status, outputs...]. Raises DparError after reading, then
    clearing, the thread's message (the raw call and this read run on the same thread)."""
    status, rest = (result[0], result[1:]) if isinstance(result, list) else (result, [])
    if status != OK:
        message = _raw.dpar_last_error()
        _raw.dpar_clear_error()
        raise DparError(status, message)
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def _scalar(dtype):
    return np.zeros(1, dtype=dtype)


def version():
    return _raw.dpar_version()


def version_string():
    return _raw.dpar_version_string()


def cpu_gemm_backend():
    """What runs the CPU matrix multiplies: library, version and the kernels it chose for this CPU."""
    return _raw.dpar_cpu_gemm_backend()


def device_count(kind=DEVICE_CPU):
    n = _scalar(np.uintp)
    _check(_raw.dpar_device_count(n.ctypes.data, kind))
    return int(n[0])


def parse_device(text):
    """(kind, index) of "cpu:3", "cpu" or "cuda:1"."""
    d = _raw.dpar_device()
    _check(_raw.dpar_device_parse(d, text))
    return d.kind, d.index


class _Life:
    """A handle's claim on its dpar object: the object is freed when the last holder of its _Life lets go. The
    handle holds it until close(); a NumPy view of the object's memory holds it too (through the view's base), so
    that a view read after close(), or after its `with` block, still reads live memory. `keep` is what the memory
    belongs to (a wrapped array, a loader's _Life for its batches), kept as long."""

    __slots__ = ("raw", "keep", "_finalizer", "__weakref__")

    def __init__(self, raw, free, keep=None):
        self.raw, self.keep = raw, keep
        self._finalizer = None if free is None else weakref.finalize(self, free, raw)


class _Handle:
    """Owns one dpar handle: close() lets it go (idempotent), freeing it unless views of its memory remain, which
    then free it when the last is gone; the finalizer is a safety net only. A closed handle's methods raise
    DparError rather than pass dpar a freed pointer."""

    _free = None
    _life = None
    _handle = None

    def _own(self, raw, keep=None):
        self._handle = raw
        self._life = _Life(raw, type(self)._free, keep)

    @property
    def _raw(self):
        if self._handle is None:
            raise DparError(ERR_INVALID_STATE, f"this {type(self).__name__} is closed")
        return self._handle

    def close(self):
        # In CPython the object is freed here, as the last reference to its _Life goes, unless a view holds it.
        self._life = None
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_NP = {F32: np.float32, I32: np.int32}


class Tensor(_Handle):
    """A dpar tensor. From NumPy without a copy (wrap), or a copy (from_numpy); numpy() is a view of its memory."""

    _free = staticmethod(_raw.dpar_tensor_free)

    def __init__(self, raw, keep=None, owned=True):
        if owned:
            self._own(raw, keep)  # keep: what the memory belongs to (a wrapped array, a DLPack producer)
        else:  # borrowed from its parent (a loader's batch): never freed here; `keep` is the parent's _Life
            self._handle, self._life = raw, keep

    @classmethod
    def zeros(cls, shape, dtype=F32, device=(DEVICE_CPU, 0)):
        shape_a = np.asarray(shape, dtype=np.int64)
        d = _raw.dpar_device()
        d.kind, d.index = device
        return cls(_check(_raw.dpar_tensor_create(dtype, shape_a.ctypes.data, len(shape_a), d)))

    @classmethod
    def wrap(cls, array):
        """Wraps a C-contiguous float32 or int32 array without a copy; the tensor keeps it alive."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.dtype not in (np.float32,
                                                                                                  np.int32):
            raise DparError(ERR_INVALID_ARGUMENT, "wrap: takes a C-contiguous float32 or int32 numpy array")
        shape = np.asarray(array.shape, dtype=np.int64)
        dtype = F32 if array.dtype == np.float32 else I32
        return cls(_check(_raw.dpar_tensor_wrap_host(dtype, shape.ctypes.data, len(shape), array.ctypes.data)),
                   keep=array)

    @classmethod
    def from_numpy(cls, array):
        """A copy of any array convertible to float32 (or int32 for integer arrays)."""
        a = np.asarray(array)
        a = np.ascontiguousarray(a, dtype=np.int32 if a.dtype.kind in "iu" else np.float32)
        t = cls.zeros(a.shape, F32 if a.dtype == np.float32 else I32)
        _check(_raw.dpar_tensor_copy_from_host(t._raw, a.ctypes.data, a.nbytes))
        return t

    @classmethod
    def from_dlpack(cls, obj):
        """Takes any object with __dlpack__ (NumPy, PyTorch, CuPy, a dpar Tensor) without a copy.

        A CUDA producer is asked for the tensor with stream=1 (the Python array API's DLPack stream protocol:
        the legacy default stream): it orders its pending writes on that stream, and dpar_tensor_from_dlpack
        waits for that stream before dpar's own streams can read the memory. A CPU producer gets no stream
        (the protocol requires None there)."""
        if not hasattr(obj, "__dlpack__"):
            capsule = obj  # already a capsule: its producer ordered it (see dpar_tensor_from_dlpack in dpar.h)
        elif _dlpack_device_type(obj) == _KDL_CUDA:
            capsule = obj.__dlpack__(stream=_LEGACY_DEFAULT_STREAM)
        else:
            capsule = obj.__dlpack__()
        return cls(_check(list(_raw.dpar_py_tensor_from_dlpack(capsule))), keep=obj)

    @property
    def shape(self):
        out, n = np.zeros(4, dtype=np.int64), _scalar(np.uintp)
        _check(_raw.dpar_tensor_shape(out.ctypes.data, n.ctypes.data, self._raw, 4))
        return tuple(int(v) for v in out[: int(n[0])])

    def info(self):
        """(dtype, numel, (device kind, index))."""
        dt, n, d = _scalar(np.int32), _scalar(np.uintp), _raw.dpar_device()
        _check(_raw.dpar_tensor_info(dt.ctypes.data, n.ctypes.data, d, self._raw))
        return DType(int(dt[0])), int(n[0]), (DeviceKind(d.kind), d.index)

    @property
    def dtype(self):
        return self.info()[0]

    def numpy(self):
        """A view of the tensor's host memory (no copy). The view keeps the memory alive: after close(), or the
        end of a `with` block, the memory is freed when the last view goes."""
        dtype, n, _ = self.info()
        addr = _scalar(np.uintp)
        _check(_raw.dpar_tensor_data(addr.ctypes.data, self._raw))
        return np.asarray(_Memory(self._life, int(addr[0]), self.shape, _NP[dtype]))

    def copy_to_numpy(self):
        dtype, n, _ = self.info()
        out = np.empty(self.shape, dtype=_NP[dtype])
        _check(_raw.dpar_tensor_copy_to_host(out.ctypes.data, self._raw, out.nbytes))
        return out

    def copy_from(self, array):
        a = np.ascontiguousarray(array, dtype=_NP[self.dtype])
        _check(_raw.dpar_tensor_copy_from_host(self._raw, a.ctypes.data, a.nbytes))

    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        """The DLPack export of the array API: a "dltensor_versioned" capsule (DLPack 1.0, whose flags say the
        memory is writable, so np.from_dlpack's array is) when max_version is (1, 0) or later, else DLPack 0.x's
        "dltensor". dl_device other than the tensor's own, or copy=True, exports a copy, to the host only
        ((1, 0), kDLCPU); copy=False refuses to copy (BufferError), as the protocol says. Any stream is fine:
        dpar's work on the tensor has finished when the call that queued it returned, so there is nothing to order
        on the consumer's stream."""
        source, here = self, self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != here:
            if copy is False:
                raise BufferError(f"dl_device: {tuple(dl_device)} is not the tensor's device {here}, and copy=False")
            if tuple(dl_device) != (1, 0):
                raise BufferError(f"dl_device: {tuple(dl_device)}: a copy goes to the host, (1, 0), only")
            copy = True
        if copy:
            source = Tensor.from_numpy(self.copy_to_numpy())  # the capsule keeps its storage after it is freed
        if max_version is not None and tuple(max_version) >= (1, 0):
            return _check(list(_raw.dpar_py_tensor_to_dlpack_versioned(source._raw, int(bool(copy)))))
        return _check(list(_raw.dpar_py_tensor_to_dlpack(source._raw)))

    def __dlpack_device__(self):
        _, _, (kind, index) = self.info()
        return (2, index) if kind == DEVICE_CUDA else (1, 0)  # kDLCUDA, kDLCPU


_KDL_CUDA = 2  # DLPack's kDLCUDA
_LEGACY_DEFAULT_STREAM = 1  # the DLPack stream protocol's handle for CUDA's legacy default stream


def _dlpack_device_type(obj):
    """The DLPack device type of a producer (kDLCPU when it does not say)."""
    device = getattr(obj, "__dlpack_device__", None)
    return int(device()[0]) if device is not None else 1


class _Memory:
    """A dpar object's memory as NumPy sees it (__array_interface__): the base of a view, holding the object's
    _Life, so that the memory lives as long as any view of it (NumPy keeps a view's base alive, and the base of
    every view taken from that view)."""

    __slots__ = ("_life", "__array_interface__")

    def __init__(self, life, address, shape, dtype):
        self._life = life
        self.__array_interface__ = {"version": 3, "shape": tuple(shape), "typestr": np.dtype(dtype).str,
                                    "data": (address, False)}


def _pair(v):
    """An int or an (height, width) pair as the C ABI's int64_t[2], kept alive by the caller for the call."""
    a = np.asarray((v, v) if np.ndim(v) == 0 else v, dtype=np.int64)
    if a.shape != (2,):
        raise DparError(ERR_INVALID_ARGUMENT, f"expected an int or a (height, width) pair, got {v!r}")
    return np.ascontiguousarray(a)


class Model(_Handle):
    """A model graph built append-only: the template an Engine copies to every device. Each add reads the previous
    node (or the one branch_from chose); join nodes (add_sum, add_concat) name their inputs; the output is the last
    node."""

    _free = staticmethod(_raw.dpar_model_free)

    def __init__(self, seed=0):
        o = _raw.dpar_model_options()
        _check(_raw.dpar_model_options_init(o))
        _set_fields(o, {"seed": "uint64"}, seed=seed)
        self._own(_check(_raw.dpar_model_create(o)))

    def linear(self, in_features, out_features, bias=True):
        _check(_raw.dpar_model_add_linear(self._raw, in_features, out_features, 1 if bias else 0))
        return self

    def activation(self, kind):
        _check(_raw.dpar_model_add_activation(self._raw, kind))
        return self

    def dropout(self, p):
        _check(_raw.dpar_model_add_dropout(self._raw, p))
        return self

    @property
    def last_node(self):
        """The id of the last node added (nodes are numbered 0, 1, ... as added); MODEL_INPUT when empty."""
        n = np.zeros(1, dtype=np.int32)
        _check(_raw.dpar_model_last_node(n.ctypes.data, self._raw))
        return int(n[0])

    def branch_from(self, node):
        """The next node added without explicit inputs reads `node` (MODEL_INPUT for the model's input)."""
        _check(_raw.dpar_model_branch_from(self._raw, node))
        return self

    def set_node_name(self, node, name):
        """Names a node as a PyTorch module path ("layer1.0.conv1"): its parameters become "layer1.0.conv1.weight"."""
        _check(_raw.dpar_model_set_node_name(self._raw, node, str(name)))
        return self

    def tie_param(self, node, param, source_node, source_param):
        """Ties node's parameter `param` to source_node's `source_param`, as PyTorch's lm_head.weight = wte.weight:
        both nodes read the source's parameter (its values and name), held, counted, reduced and stepped once, its
        gradient the sum of both; checkpoints hold it under both keys."""
        _check(_raw.dpar_model_tie_param(self._raw, node, str(param), source_node, str(source_param)))
        return self

    def add_sum(self, inputs):
        """Appends the elementwise sum of nodes of equal shape (a residual connection)."""
        ids = np.ascontiguousarray(inputs, dtype=np.int32)
        _check(_raw.dpar_model_add_sum(self._raw, ids.ctypes.data, ids.size))
        return self

    def add_concat(self, inputs):
        """Appends the concatenation of nodes along dim 1."""
        ids = np.ascontiguousarray(inputs, dtype=np.int32)
        _check(_raw.dpar_model_add_concat(self._raw, ids.ctypes.data, ids.size))
        return self

    def add_flatten(self):
        """Appends (B, ...) -> (B, prod(...)): a view, no copy."""
        _check(_raw.dpar_model_add_flatten(self._raw))
        return self

    def add_reshape(self, row_shape):
        """Appends (B, ...) -> (B, *row_shape), as nn.Unflatten(1, row_shape): a view, no copy."""
        shape = np.ascontiguousarray(row_shape, dtype=np.int64)
        _check(_raw.dpar_model_add_reshape(self._raw, shape.ctypes.data, shape.size))
        return self

    def conv2d(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True):
        """Appends nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias) over
        NCHW inputs; each size is an int or an (height, width) pair, as PyTorch takes them. Parameters "weight"
        (out, in / groups, kh, kw) and "bias" (out), initialised as PyTorch's."""
        k, s, p, d = _pair(kernel_size), _pair(stride), _pair(padding), _pair(dilation)
        _check(_raw.dpar_model_add_conv2d(self._raw, in_channels, out_channels, k.ctypes.data, s.ctypes.data,
                                          p.ctypes.data, d.ctypes.data, groups, 1 if bias else 0))
        return self

    def max_pool2d(self, kernel_size, stride=None, padding=0):
        """Appends nn.MaxPool2d(kernel_size, stride, padding); stride None is the kernel size."""
        return self._pool2d(_raw.dpar_model_add_max_pool2d, kernel_size, stride, padding)

    def avg_pool2d(self, kernel_size, stride=None, padding=0):
        """Appends nn.AvgPool2d(kernel_size, stride, padding) (count_include_pad=True); stride None is the kernel."""
        return self._pool2d(_raw.dpar_model_add_avg_pool2d, kernel_size, stride, padding)

    def _pool2d(self, f, kernel_size, stride, padding):
        k, p = _pair(kernel_size), _pair(padding)
        s = None if stride is None else _pair(stride)
        _check(f(self._raw, k.ctypes.data, 0 if s is None else s.ctypes.data, p.ctypes.data))
        return self

    def adaptive_avg_pool2d(self, output_size):
        """Appends nn.AdaptiveAvgPool2d(output_size) (an int or a pair); only 1 / (1, 1) is implemented
        (DparError with ERR_NOT_SUPPORTED otherwise)."""
        h, w = (int(v) for v in _pair(output_size))
        _check(_raw.dpar_model_add_adaptive_avg_pool2d(self._raw, h, w))
        return self

    def custom(self, layer):
        """Appends a layer written in Python (a CustomLayer). dpar holds it until the model and every engine built
        from it are freed; replicas call it from their worker threads, one at a time (the interpreter lock)."""
        if not isinstance(layer, CustomLayer):
            raise DparError(ERR_INVALID_ARGUMENT, "custom: takes a dpar.CustomLayer")
        specs = [p if isinstance(p, Param) else Param(*p) for p in layer.params]
        raw_specs = [(str(p.name), tuple(int(e) for e in p.shape), int(p.init), float(p.bound)) for p in specs]
        _check(_raw.dpar_py_model_add_custom(self._raw, str(layer.name), raw_specs, _CustomBridge(layer)))
        return self

    def _count(self, fn):
        n = _scalar(np.uintp)
        _check(fn(n.ctypes.data, self._raw))
        return int(n[0])

    @property
    def num_layers(self):
        return self._count(_raw.dpar_model_num_layers)

    @property
    def num_params(self):
        return self._count(_raw.dpar_model_num_params)

    @property
    def num_param_elements(self):
        return self._count(_raw.dpar_model_num_param_elements)

    def param_info(self, index):
        """(name, shape) of parameter `index`."""
        shape, n = np.zeros(4, dtype=np.int64), _scalar(np.uintp)
        _check(_raw.dpar_model_param_info(shape.ctypes.data, n.ctypes.data, self._raw, index))
        name = _raw.dpar_model_param_name(self._raw, index)
        if name is None:
            _check(ERR_INVALID_ARGUMENT)
        return name, tuple(int(v) for v in shape[: int(n[0])])

    def param_decays(self, index):
        """Whether parameter `index` decays when the engine excludes biases and norms from weight decay
        (Engine.set_weight_decay_exclusion): False for biases and BatchNorm's weight and bias."""
        d = _scalar(np.int32)
        _check(_raw.dpar_model_param_decays(d.ctypes.data, self._raw, index))
        return bool(d[0])

    def get_param(self, index):
        _, shape = self.param_info(index)
        out = np.empty(shape, dtype=np.float32)
        _check(_raw.dpar_model_get_param(out.ctypes.data, self._raw, index, out.size))
        return out

    def set_param(self, index, values):
        a = np.ascontiguousarray(values, dtype=np.float32)
        _check(_raw.dpar_model_set_param(self._raw, index, a.ctypes.data, a.size))

    def batchnorm1d(self, num_features, eps=1e-5, momentum=0.1, affine=True):
        """BatchNorm1d over the channels of (B, C) or (B, C, L) inputs."""
        _check(_raw.dpar_model_add_batchnorm1d(self._raw, num_features, eps, momentum, 1 if affine else 0))
        return self

    def batchnorm2d(self, num_features, eps=1e-5, momentum=0.1, affine=True):
        """BatchNorm2d over the channels of (B, C, H, W) inputs."""
        _check(_raw.dpar_model_add_batchnorm2d(self._raw, num_features, eps, momentum, 1 if affine else 0))
        return self

    def sync_batchnorm(self, num_features, eps=1e-5, momentum=0.1, affine=True):
        """SyncBatchNorm: the statistics of every replica of every process."""
        _check(_raw.dpar_model_add_sync_batchnorm(self._raw, num_features, eps, momentum, 1 if affine else 0))
        return self

    def layernorm(self, normalized_size, eps=1e-5, elementwise_affine=True):
        """LayerNorm over the last dim of (B, ..., D) inputs, as torch.nn.LayerNorm((D,))."""
        _check(_raw.dpar_model_add_layernorm(self._raw, normalized_size, eps, 1 if elementwise_affine else 0))
        return self

    def embedding(self, num_embeddings, embedding_dim, padding_idx=None):
        """An Embedding: int32 indices (B) or (B, T) give rows of its weight; the model then takes int32 input.
        Row padding_idx (negative: from the end), if given, starts at zero and gets no gradient."""
        if padding_idx is None:
            _check(_raw.dpar_model_add_embedding(self._raw, num_embeddings, embedding_dim))
        else:
            _check(_raw.dpar_model_add_embedding_padded(self._raw, num_embeddings, embedding_dim, padding_idx))
        return self

    def position_embedding(self, max_positions, embedding_dim):
        """GPT-2's learned position embedding (nanoGPT's wpe): (B, T, C) -> input + weight[t] at position t, its
        "weight" (max_positions, embedding_dim) drawn from N(0, 1). A sequence longer than max_positions is refused."""
        _check(_raw.dpar_model_add_position_embedding(self._raw, max_positions, embedding_dim))
        return self

    def attention(self, num_heads, inputs=None, is_causal=False, dropout_p=0.0, scale=None):
        """F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal, scale) over num_heads heads, the output
        (B, L, C) with the heads merged. inputs: the nodes q, k and v; one node, a packed (B, T, 3C) q|k|v
        projection; or None for the next input as a packed projection. scale None is 1/sqrt(head size). No
        parameters."""
        ids = np.ascontiguousarray(() if inputs is None else inputs, dtype=np.int32)
        address = ids.ctypes.data if ids.size else 0
        _check(_raw.dpar_model_add_attention(self._raw, address, ids.size, num_heads, 1 if is_causal else 0,
                                             dropout_p, 0.0 if scale is None else scale))
        return self

    def multihead_attention(self, embed_dim, num_heads, dropout=0.0, bias=True, is_causal=False):
        """Self-attention as nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, batch_first=True)(x, x, x,
        need_weights=False, is_causal=is_causal)[0] on (B, T, embed_dim), with the module's parameter names
        (in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias) and initialisation."""
        _check(_raw.dpar_model_add_multihead_attention(self._raw, embed_dim, num_heads, dropout, 1 if bias else 0,
                                                       1 if is_causal else 0))
        return self

    def causal_self_attention(self, n_embd, n_head, dropout=0.0, bias=True, name=None):
        """nanoGPT's CausalSelfAttention on (B, T, n_embd): c_attn, causal attention of n_head heads, c_proj and
        resid_dropout. With name ("transformer.h.0.attn") the linear nodes are "<name>.c_attn" and "<name>.c_proj",
        so that their parameters have nanoGPT's state_dict keys. A refusal leaves the model as it was."""
        _check(_raw.dpar_model_add_causal_self_attention(self._raw, n_embd, n_head, dropout, 1 if bias else 0,
                                                         None if name is None else str(name)))
        return self

    def convert_sync_batchnorm(self):
        """Turns every BatchNorm layer into SyncBatchNorm."""
        _check(_raw.dpar_model_convert_sync_batchnorm(self._raw))
        return self

    @property
    def num_buffers(self):
        return self._count(_raw.dpar_model_num_buffers)

    def buffer_info(self, index):
        """(name, numpy dtype, shape) of buffer `index` (state that is not a parameter: "1.running_mean")."""
        shape, n, dtype = np.zeros(4, dtype=np.int64), _scalar(np.uintp), _scalar(np.int32)
        _check(_raw.dpar_model_buffer_info(dtype.ctypes.data, shape.ctypes.data, n.ctypes.data, self._raw, index))
        name = _raw.dpar_model_buffer_name(self._raw, index)
        if name is None:
            _check(ERR_INVALID_ARGUMENT)
        kind = np.dtype(np.int64) if int(dtype[0]) == DType.I64 else np.dtype(np.float32)
        return name, kind, tuple(int(v) for v in shape[: int(n[0])])

    def get_buffer(self, index):
        _, kind, shape = self.buffer_info(index)
        out = np.empty(shape, dtype=kind)
        _check(_raw.dpar_model_get_buffer(out.ctypes.data, self._raw, index, out.size))
        return out

    def set_buffer(self, index, values):
        _, kind, _ = self.buffer_info(index)
        a = np.ascontiguousarray(values, dtype=kind)
        _check(_raw.dpar_model_set_buffer(self._raw, index, a.ctypes.data, a.size))


INIT_ZEROS, INIT_UNIFORM = Init


class Param:
    """One parameter of a custom layer: its name ("weight"), shape, and initialisation (INIT_ZEROS, or
    INIT_UNIFORM in [-bound, bound] from the model's seed)."""

    def __init__(self, name, shape, init=INIT_ZEROS, bound=0.0):
        self.name, self.shape, self.init, self.bound = name, tuple(shape), init, bound

    def __repr__(self):
        return f"Param({self.name!r}, {self.shape}, init={self.init}, bound={self.bound})"


class CustomLayer:
    """A layer whose math is written in Python. Subclass it: set `name` and `params` (a list of Param, in the
    order forward and backward receive them) and write output_shape, forward and backward.

    forward(call) writes call.output from call.input and call.params; backward(call) writes call.grads (written,
    not added to: dpar accumulates) and call.grad_input (None for the first layer) from call.grad_output. Every
    tensor is a float32 NumPy view of the replica's memory, valid during the call only; inputs are read-only.
    Each replica calls from its own worker thread. An exception fails the engine call with its text (a
    DparError's status is kept)."""

    name = "custom"
    params = ()

    def output_shape(self, input_shape):
        """The output's shape (a tuple, the batch extent first and kept) for an input's shape."""
        raise NotImplementedError

    def forward(self, call):
        raise NotImplementedError

    def backward(self, call):
        raise NotImplementedError


def _host_view(pair, writeable):
    if pair is None:
        return None
    address, shape = pair
    if 0 in shape or not address:
        view = np.zeros(shape, dtype=np.float32)
    else:
        pointer = np.ctypeslib.ctypes.cast(address, np.ctypeslib.ctypes.POINTER(np.ctypeslib.ctypes.c_float))
        view = np.ctypeslib.as_array(pointer, shape=shape)
    view.flags.writeable = writeable
    return view


class CustomCall:
    """What a custom layer's forward or backward receives (see CustomLayer)."""

    __slots__ = ("replica", "device", "training", "input", "output", "grad_output", "grad_input", "params", "grads")

    def __init__(self, args, backward):
        replica, kind, index, training, x, out, dout, din, params, grads = args
        self.replica, self.device, self.training = replica, (kind, index), bool(training)
        self.input = _host_view(x, False)
        self.output = _host_view(out, not backward)
        self.grad_output = _host_view(dout, False)
        self.grad_input = _host_view(din, True)
        self.params = [_host_view(p, False) for p in params]
        self.grads = [_host_view(g, True) for g in grads] if backward else []


class _CustomBridge:
    """dpar's payload for a CustomLayer: the C trampolines in bindings/swig/dpar.i call these methods."""

    def __init__(self, layer):
        self.layer = layer

    def _output_shape(self, input_shape):
        return tuple(int(e) for e in self.layer.output_shape(input_shape))

    def _forward(self, args):
        self.layer.forward(CustomCall(args, backward=False))

    def _backward(self, args):
        self.layer.backward(CustomCall(args, backward=True))


# The C type of every option field a keyword sets, for checking a value before SWIG sees it (its own message names
# a generated setter, not the argument). The keyword is the field's name except where a comment says otherwise.
_OPTIMIZER_FIELDS = {"kind": "int32",  # the keyword `optimizer`
                     "lr": "float", "momentum": "float", "dampening": "float", "nesterov": "bool",
                     "weight_decay": "float", "beta1": "float", "beta2": "float", "eps": "float"}
_ENGINE_FIELDS = {"device_kind": "int32", "num_cpu_devices": "size",  # the keyword `devices`
                  "output_device": "int32", "loss": "int32", "seed": "uint64", "timeout_seconds": "double",
                  "blas_threads": "size", "pin_workers": "bool", "first_bucket_bytes": "size",
                  "bucket_cap_bytes": "size", "processes": "int32", "create_timeout_seconds": "double"}
_KEYWORD = {"kind": "optimizer", "num_cpu_devices": "devices"}
_RANGES = {"int32": (-2**31, 2**31 - 1), "uint64": (0, 2**64 - 1), "size": (0, 2**64 - 1)}


def _field_value(name, ctype, value):
    """value converted for a C field of type ctype, or TypeError/ValueError naming the argument and the value."""
    if ctype == "bool":
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
            return int(bool(value))
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    if ctype in ("float", "double"):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name}: expected a number, got {value!r}")
        value = float(value)
        if ctype == "float" and np.isfinite(value) and abs(value) > float(np.finfo(np.float32).max):
            raise ValueError(f"{name}: {value!r} does not fit a float32")
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {value!r}") from None
    low, high = _RANGES[ctype]
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is out of range [{low}, {high}]")
    return value


def _set_fields(struct, types, **values):
    """Sets each field whose value is not None (None keeps what the options' init set: dpar's default)."""
    for field, value in values.items():
        if value is not None:
            setattr(struct, field, _field_value(_KEYWORD.get(field, field), types[field], value))


class Engine(_Handle):
    """A DataParallel engine. Thread-safe (dpar serialises calls on it); the lock is released during calls."""

    _free = staticmethod(_raw.dpar_engine_free)

    def __init__(self, model, optimizer=None, lr=None, momentum=None, weight_decay=None, nesterov=None,
                 devices=None, device_ids=None, loss=None, seed=None, timeout_seconds=None, processes=None, *,
                 dampening=None, beta1=None, beta2=None, eps=None, device_kind=None, output_device=None,
                 blas_threads=None, pin_workers=None, first_bucket_bytes=None, bucket_cap_bytes=None,
                 create_timeout_seconds=None):
        """Every field of dpar_optimizer_options and dpar_engine_options is a keyword (None: dpar's default).
        optimizer is the optimizer's kind (SGD, ADAM, ADAMW); devices is num_cpu_devices; device_ids sets
        device_ids and num_device_ids. An unknown keyword is a TypeError naming it, as for any Python function.
        timeout_seconds is how long a worker waits for the others at each synchronisation point (300;
        math.inf: no limit); create_timeout_seconds is how long creation waits for every process to create its
        engine, across processes that start at different times (0, the default: timeout_seconds; math.inf: no
        limit)."""
        oo = _raw.dpar_optimizer_options()
        _check(_raw.dpar_optimizer_options_init(oo))
        _set_fields(oo, _OPTIMIZER_FIELDS, kind=optimizer, lr=lr, momentum=momentum, dampening=dampening,
                    nesterov=nesterov, weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps)
        eo = _raw.dpar_engine_options()
        _check(_raw.dpar_engine_options_init(eo))
        _set_fields(eo, _ENGINE_FIELDS, device_kind=device_kind, num_cpu_devices=devices, output_device=output_device,
                    loss=loss, seed=seed, timeout_seconds=timeout_seconds, blas_threads=blas_threads,
                    pin_workers=pin_workers, first_bucket_bytes=first_bucket_bytes,
                    bucket_cap_bytes=bucket_cap_bytes, processes=processes,
                    create_timeout_seconds=create_timeout_seconds)
        self._ids = None
        if device_ids is not None:
            try:
                self._ids = np.array([operator.index(i) for i in device_ids], dtype=np.int32)
            except (TypeError, OverflowError):
                raise TypeError(f"device_ids: expected a sequence of device indices, got {device_ids!r}") from None
            eo.device_ids, eo.num_device_ids = self._ids.ctypes.data, len(self._ids)
        self._inputs = None  # a training-mode forward's input stays alive until the next call
        self._own(_check(_raw.dpar_engine_create(model._raw, oo, eo)))

    @staticmethod
    def _tensor(x):
        """A Tensor as it is; anything else as np.asarray makes it an array: wrapped without a copy where it is a
        C-contiguous float32 or int32 array, else converted as Tensor.from_numpy converts (integers to int32, the
        rest to float32, in C order). The caller holds the result in a variable until dpar has returned."""
        if isinstance(x, Tensor):
            return x
        a = np.asarray(x)
        return Tensor.wrap(np.ascontiguousarray(a, dtype=np.int32 if a.dtype.kind in "iu" else np.float32))

    def train_step(self, inputs, targets):
        """One fused step; returns the mean loss. inputs and targets are Tensors or arrays: NumPy arrays, or anything
        np.asarray takes (a list); a C-contiguous float32 or int32 array is wrapped without a copy, any other is
        converted as Tensor.from_numpy converts. So are forward's and backward's."""
        x, y = self._tensor(inputs), self._tensor(targets)
        loss = _scalar(np.float32)
        _check(_raw.dpar_engine_train_step(loss.ctypes.data, self._raw, x._raw, y._raw))
        return float(loss[0])

    def accumulate(self, inputs, targets):
        x, y = self._tensor(inputs), self._tensor(targets)
        loss = _scalar(np.float32)
        _check(_raw.dpar_engine_accumulate(loss.ctypes.data, self._raw, x._raw, y._raw))
        return float(loss[0])

    def step(self):
        _check(_raw.dpar_engine_step(self._raw))

    def zero_grad(self):
        _check(_raw.dpar_engine_zero_grad(self._raw))

    def forward(self, inputs):
        """DataParallel's forward; returns a Tensor (its numpy() is a view). The input stays referenced until the
        next forward has succeeded, as the engine keeps a view of it for backward (a refused forward keeps the one
        before it)."""
        x = self._tensor(inputs)
        # Until dpar returns, both inputs: a refused forward leaves the engine's views of the last one in place.
        self._inputs = (self._inputs, x)
        out = _check(_raw.dpar_engine_forward(self._raw, x._raw))
        self._inputs = x
        return Tensor(out)

    def backward(self, grad_output):
        """DataParallel's backward from dL/d(output) of the last training-mode forward (a Tensor or an array, as
        train_step takes them, shaped as its output); step() then synchronises the gradients and steps."""
        g = self._tensor(grad_output)  # held until dpar returns: a temporary's handle is freed as soon as read
        _check(_raw.dpar_engine_backward(self._raw, g._raw))

    def set_training(self, training):
        _check(_raw.dpar_engine_set_training(self._raw, 1 if training else 0))

    def set_lr(self, lr):
        _check(_raw.dpar_engine_set_lr(self._raw, lr))

    def set_max_grad_norm(self, max_norm):
        """Clips the gradient of the following steps to this global L2 norm (torch.nn.utils.clip_grad_norm_
        between backward and the step); 0 turns clipping off."""
        _check(_raw.dpar_engine_set_max_grad_norm(self._raw, max_norm))

    def set_gradient_compression(self, compression):
        """Compresses gradient buckets between processes from the next step on (COMPRESSION_NONE,
        COMPRESSION_BF16). Every process sets the same; with one process it changes nothing."""
        _check(_raw.dpar_engine_set_gradient_compression(self._raw, compression))

    def set_weight_decay_exclusion(self, exclude_biases_and_norms):
        """From the next step on, steps biases and norms' parameters (Model.param_decays False) with weight decay 0,
        as two PyTorch parameter groups; False (the default) decays every parameter."""
        _check(_raw.dpar_engine_set_weight_decay_exclusion(self._raw, operator.index(exclude_biases_and_norms)))

    def set_gradient_reduction(self, reduction):
        """Chooses how gradient buckets are reduced from the next step on: REDUCTION_ALL_REDUCE (the default, every
        replica receives the whole bucket; each process holds the whole optimizer state, as DDP's bytes),
        REDUCTION_REDUCE_SCATTER (ZeRO-2: each replica receives the block its optimizer steps; under mpirun the
        optimizer's shards span every process) or REDUCTION_ALL_REDUCE_SHARDED (the all-reduce with the shards over
        every process: ZeRO-2's memory for about 1.5x the bytes between processes). Every process sets the same, at
        the same point: where the shards move across the processes the optimizer's state is gathered and cut anew
        (DparError INVALID_STATE while gradients are pending). Each way the replicas stay bit-identical and, without
        clipping, train to the same bits, so switching between steps is allowed."""
        _check(_raw.dpar_engine_set_gradient_reduction(self._raw, reduction))

    def set_precision(self, compute_dtype):
        """From the next call on, linear layers and convolutions compute in `compute_dtype`, as torch.autocast's
        policy: DType.F32 (the default) or DType.BF16 (bf16 operands: the input rounded and each step's bf16 copy of
        the weights; f32 accumulation and results; master weights, gradients, the optimizer and checkpoints f32) or
        DType.F16 (the same in IEEE half, which overflows above 65504: train it with loss scaling,
        set_loss_scaling). DparError NOT_SUPPORTED where a device lacks the kernels (bf16 on a CPU without
        AVX512-BF16 or AMX; f16 on any CPU, oneDNN 2.6 having no f16 GEMM for CPUs: the message says why), the
        engine unchanged. Every process sets the same."""
        _check(_raw.dpar_engine_set_precision(self._raw, operator.index(compute_dtype)))

    @property
    def precision(self):
        """The compute dtype set_precision set: DType.F32, DType.BF16 or DType.F16."""
        out = _scalar(np.int32)
        _check(_raw.dpar_engine_precision(out.ctypes.data, self._raw))
        return DType(int(out[0]))

    def set_reduce_dtype(self, dtype):
        """From the next step on, gradient buckets are reduced in `dtype`, as FSDP's
        MixedPrecisionPolicy(reduce_dtype=...): DType.F32 (the default: f32 within a process, across processes as
        set_gradient_compression says) or DType.BF16 (every replica's bucket rounded to bf16 and the whole reduction
        carried in bf16, within and across the processes, the result widened to f32 for clipping and the
        optimizer). DparError INVALID_ARGUMENT for another dtype, NOT_SUPPORTED where the processes' link does not
        move bf16, the engine unchanged. Every process sets the same."""
        _check(_raw.dpar_engine_set_reduce_dtype(self._raw, operator.index(dtype)))

    @property
    def reduce_dtype(self):
        """The dtype set_reduce_dtype set: DType.F32 or DType.BF16."""
        out = _scalar(np.int32)
        _check(_raw.dpar_engine_reduce_dtype(out.ctypes.data, self._raw))
        return DType(int(out[0]))

    def set_reproducible(self, micro_chunk_rows):
        """The reproducible mode (dpar_engine_set_reproducible): train_step cuts each batch into micro-chunks of
        `micro_chunk_rows` rows and sums their gradients exactly, so that the same seed and global batches give the
        same bits on any number of CPU devices and processes; 0 turns it off. DparError INVALID_ARGUMENT for a
        negative count, INVALID_STATE while gradients are pending, NOT_SUPPORTED on GPUs and for a model with
        BatchNorm, the engine unchanged. Every process sets the same."""
        _check(_raw.dpar_engine_set_reproducible(self._raw, operator.index(micro_chunk_rows)))

    @property
    def reproducible(self):
        """The rows per micro-chunk set_reproducible set (0: off)."""
        out = _scalar(np.int64)
        _check(_raw.dpar_engine_reproducible(out.ctypes.data, self._raw))
        return int(out[0])

    def set_allow_tf32(self, allow):
        """Lets f32 GEMMs and convolutions use TF32 where the devices have it (off by default); returns whether
        they have it (CPU devices: False)."""
        has = _scalar(np.int32)
        _check(_raw.dpar_engine_set_allow_tf32(self._raw, operator.index(allow), has.ctypes.data))
        return bool(has[0])

    def set_loss_scaling(self, init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        """Dynamic loss scaling from the next step on, as torch.amp.GradScaler(init_scale, growth_factor,
        backoff_factor, growth_interval); init_scale 0 turns it off (PyTorch's default init_scale: 65536.0). A step
        whose scaled gradient holds inf or NaN is skipped on every replica and backs the scale off."""
        _check(_raw.dpar_engine_set_loss_scaling(self._raw, init_scale, growth_factor, backoff_factor,
                                                 operator.index(growth_interval)))

    @property
    def loss_scale(self):
        """The current loss scale; 1.0 with loss scaling off."""
        out = _scalar(np.float32)
        _check(_raw.dpar_engine_loss_scale(out.ctypes.data, self._raw))
        return float(out[0])

    @property
    def last_step_skipped(self):
        """Whether the last step taken with loss scaling on was skipped (its gradient held inf or NaN)."""
        out = _scalar(np.int32)
        _check(_raw.dpar_engine_last_step_skipped(out.ctypes.data, self._raw))
        return bool(out[0])

    @property
    def grad_norm(self):
        """The gradient's norm before clipping at the last step taken with clipping on (NaN before any)."""
        out = _scalar(np.float32)
        _check(_raw.dpar_engine_grad_norm(out.ctypes.data, self._raw))
        return float(out[0])

    def _count(self, fn):
        n = _scalar(np.uintp)
        _check(fn(n.ctypes.data, self._raw))
        return int(n[0])

    @property
    def step_count(self):
        return self._count(_raw.dpar_engine_step_count)

    @property
    def num_replicas(self):
        return self._count(_raw.dpar_engine_num_replicas)

    @property
    def num_buckets(self):
        return self._count(_raw.dpar_engine_num_buckets)

    @property
    def processes(self):
        r, s = _scalar(np.uintp), _scalar(np.uintp)
        _check(_raw.dpar_engine_processes(r.ctypes.data, s.ctypes.data, self._raw))
        return int(r[0]), int(s[0])

    @property
    def process_transport(self):
        """How gradient buckets travel between the processes: "" for one process, "mpi", "nccl", or
        "mpi through host memory (...)" saying why NCCL could not be used."""
        transport = _raw.dpar_engine_process_transport(self._raw)
        if transport is None:
            _check(ERR_INVALID_ARGUMENT)
        return transport

    def replica_device(self, replica):
        d = _raw.dpar_device()
        _check(_raw.dpar_engine_replica_device(d, self._raw, replica))
        return d.kind, d.index

    def split(self, batch):
        out = np.zeros(self.num_replicas, dtype=np.uintp)
        _check(_raw.dpar_engine_split(out.ctypes.data, self._raw, batch, len(out)))
        return [int(v) for v in out]

    def replica_losses(self):
        out = np.zeros(self.num_replicas, dtype=np.float32)
        _check(_raw.dpar_engine_replica_losses(out.ctypes.data, self._raw, len(out)))
        return out

    def params(self, replica, count):
        out = np.zeros(count, dtype=np.float32)
        _check(_raw.dpar_engine_get_params(out.ctypes.data, self._raw, replica, count))
        return out

    def memory_stats(self, replica):
        """(allocated_bytes, peak_bytes): what replica `replica`'s device holds of dpar's tensors (parameters,
        gradients, optimizer state, activations, scratch) now, and the most it held at once since the process
        started or the device's last reset_peak_memory (dpar_engine_memory_stats; torch.cuda's memory_allocated and
        max_memory_allocated). The count is the device's: replicas and engines on one device count together.
        DparError INVALID_ARGUMENT for a replica out of range."""
        allocated, peak = _scalar(np.int64), _scalar(np.int64)
        _check(_raw.dpar_engine_memory_stats(allocated.ctypes.data, peak.ctypes.data, self._raw,
                                             operator.index(replica)))
        return int(allocated[0]), int(peak[0])

    def reset_peak_memory(self, replica):
        """Starts the peak of replica `replica`'s device again from what it holds now, for every engine on that
        device (dpar_engine_reset_peak_memory; torch.cuda.reset_peak_memory_stats)."""
        _check(_raw.dpar_engine_reset_peak_memory(self._raw, operator.index(replica)))

    def buffer(self, model, replica, index):
        """A replica's buffer `index` of `model`, the model the engine was built from (for its dtype and shape)."""
        _, kind, shape = model.buffer_info(index)
        out = np.empty(shape, dtype=kind)
        _check(_raw.dpar_engine_get_buffer(out.ctypes.data, self._raw, replica, index, out.size))
        return out

    def set_forward_hook(self, hook):
        """hook(replica, input_shape, output_shape) on every replica's worker thread after its forward; None
        removes it. An exception fails the engine call with its text (a DparError's status is kept)."""
        if hook is None:
            _check(_raw.dpar_py_set_forward_hook(self._raw, None))
            self._hook = None
            return
        # dpar holds a trampoline that reaches the hook through a weak reference to the engine, and the engine holds
        # the hook: a hook that captures its engine is a cycle Python's collector sees, not a reference held in C
        # that would keep the engine (and its threads) alive for good.
        engine = weakref.ref(self)

        def trampoline(replica, input_shape, output_shape):
            e = engine()
            f = None if e is None else e._hook
            if f is not None:
                f(replica, input_shape, output_shape)

        self._hook = hook
        _check(_raw.dpar_py_set_forward_hook(self._raw, trampoline))

    def save(self, path):
        _check(_raw.dpar_engine_save(self._raw, str(path)))

    def load(self, path):
        _check(_raw.dpar_engine_load(self._raw, str(path)))

    def trace_start(self):
        """Starts recording a timeline of the engine's calls (each replica's worker and communication thread, span
        by span), forgetting one recorded before."""
        _check(_raw.dpar_engine_trace_start(self._raw))

    def trace_stop(self, path=None):
        """Stops recording and writes the timeline to path in Chrome's trace event format (ui.perfetto.dev,
        chrome://tracing), atomically; None only stops. The timeline stays until the next trace_start(), so a
        failed write may be tried again with another path."""
        _check(_raw.dpar_engine_trace_stop(self._raw, None if path is None else str(path)))

    def abort(self):
        _check(_raw.dpar_engine_abort(self._raw))

    def inject_fault(self, replica, fault):
        _check(_raw.dpar_engine_inject_fault(self._raw, replica, fault))


class Dataset(_Handle):
    _free = staticmethod(_raw.dpar_dataset_free)

    def __init__(self, images_path, labels_path):
        self._own(_check(_raw.dpar_dataset_load_idx(str(images_path), str(labels_path))))

    def info(self):
        """(samples, features, classes)."""
        s, f, c = _scalar(np.uintp), _scalar(np.uintp), _scalar(np.uintp)
        _check(_raw.dpar_dataset_info(s.ctypes.data, f.ctypes.data, c.ctypes.data, self._raw))
        return int(s[0]), int(f[0]), int(c[0])

    def normalize(self, mean, std):
        _check(_raw.dpar_dataset_normalize(self._raw, mean, std))


class Loader(_Handle):
    """Iterating yields (inputs, labels) Tensors borrowed from the loader until the next batch."""

    _free = staticmethod(_raw.dpar_loader_free)

    def __init__(self, dataset, batch_size, shuffle=False, seed=0, drop_last=False):
        self._own(_check(_raw.dpar_loader_create(dataset._raw, batch_size, int(shuffle), seed, int(drop_last))))

    _epoch = 0  # a new loader is at the start of epoch 0
    _rewound = True  # no `for` has begun since the loader was made or rewound

    def start_epoch(self, epoch):
        """Rewinds the loader to the start of `epoch` (its order drawn from the seed and the epoch)."""
        _check(_raw.dpar_loader_start_epoch(self._raw, epoch))
        self._epoch, self._rewound = epoch, True

    @property
    def num_batches(self):
        n = _scalar(np.uintp)
        _check(_raw.dpar_loader_num_batches(n.ctypes.data, self._raw))
        return int(n[0])

    def shard(self, shard, num_shards):
        _check(_raw.dpar_loader_shard(self._raw, shard, num_shards))

    def to_device(self, device):
        """From the next batch on, batches in memory of `device` ("cuda:0", "cpu" or (kind, index)), each prepared
        (on a GPU: copied) while the caller still uses the one before. The batches are the same, bit for bit."""
        d = _raw.dpar_device()
        d.kind, d.index = parse_device(device) if isinstance(device, str) else tuple(device)
        _check(_raw.dpar_loader_to_device(self._raw, d))

    def next(self):
        more = _scalar(np.int32)
        _check(_raw.dpar_loader_next(more.ctypes.data, self._raw))
        if not more[0]:
            return None
        x, y = _raw.dpar_loader_inputs(self._raw), _raw.dpar_loader_labels(self._raw)
        # Borrowed from the loader: their views hold the loader's _Life, so close() frees it after the last view.
        return Tensor(x, keep=self._life, owned=False), Tensor(y, keep=self._life, owned=False)

    def __iter__(self):
        """One epoch of batches. A `for` after the first, without start_epoch() between, starts the next epoch (as
        PyTorch's DataLoader reshuffles each time it is iterated)."""
        if not self._rewound:
            self.start_epoch(self._epoch + 1)
        self._rewound = False
        while True:
            batch = self.next()
            if batch is None:
                return
            yield batch


_DT = {np.dtype(np.float32): F32, np.dtype(np.float64): _raw.DPAR_F64, np.dtype(np.int32): I32,
       np.dtype(np.int64): _raw.DPAR_I64}


def _buffer(obj, what):
    """(address, elements, dtype) of a C-contiguous buffer: a NumPy array (host memory), or an object with
    __cuda_array_interface__ (PyTorch CUDA tensors, CuPy and Numba arrays: memory of a GPU, for a group made by
    CommGroup.on_devices). Their writer's stream must have finished with them, or be the group's stream."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous or obj.dtype not in _DT:
            raise DparError(ERR_INVALID_ARGUMENT, f"{what}: a C-contiguous array of float32, float64, int32 or "
                                                  f"int64, got {obj.dtype} {'' if obj.flags.c_contiguous else 'strided'}")
        return obj.ctypes.data, obj.size, _DT[obj.dtype]
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise DparError(ERR_INVALID_ARGUMENT, f"{what}: expected a NumPy array or an object with "
                                              f"__cuda_array_interface__, got {type(obj).__name__}")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    strides = cai.get("strides")
    if strides is not None:
        expected, step = [], dtype.itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if tuple(reversed(expected)) != tuple(strides) and n > 1:
            raise DparError(ERR_INVALID_ARGUMENT, f"{what}: strided CUDA arrays are not supported (make it contiguous)")
    if dtype not in _DT:
        raise DparError(ERR_INVALID_ARGUMENT, f"{what}: {dtype} is not float32, float64, int32 or int64")
    return int(cai["data"][0]), n, _DT[dtype]


def _comm_options(timeout_seconds):
    o = _raw.dpar_comm_options()
    _check(_raw.dpar_comm_options_init(o))
    _set_fields(o, {"timeout_seconds": "double"}, timeout_seconds=timeout_seconds)
    return o


class CommGroup(_Handle):
    _free = staticmethod(_raw.dpar_comm_group_free)

    def __init__(self, size, timeout_seconds=300.0):
        self._own(_check(_raw.dpar_comm_group_create(size, _comm_options(timeout_seconds))))

    @classmethod
    def on_devices(cls, devices, streams=None, timeout_seconds=300.0):
        """A group whose participant r's buffers are memory of devices[r] ("cpu:1", "cuda:0" or (kind, index)).

        On GPUs each participant's collectives are ordered on streams[r], a cudaStream_t as an integer (PyTorch:
        torch.cuda.Stream.cuda_stream); None, or a None entry, is the legacy default stream. Over GPUs, Comm's
        collectives and the Reducer take arrays with __cuda_array_interface__ (NumPy arrays are host memory)."""
        devs = np.array([parse_device(d) if isinstance(d, str) else tuple(d) for d in devices], dtype=np.int32)
        ptrs = None if streams is None else np.array([s or 0 for s in streams], dtype=np.uintp)
        if ptrs is not None and len(ptrs) != len(devs):
            raise DparError(ERR_INVALID_ARGUMENT, f"streams: {len(ptrs)} streams for {len(devs)} devices")
        group = cls.__new__(cls)
        group._own(_check(_raw.dpar_comm_group_create_on_devices(
            devs.ctypes.data, 0 if ptrs is None else ptrs.ctypes.data, len(devs), _comm_options(timeout_seconds))))
        return group

    def member(self, rank):
        return Comm(_check(_raw.dpar_comm_group_member(self._raw, rank)))


class Comm(_Handle):
    """One participant: collectives on NumPy arrays (in place when recv is None)."""

    _free = staticmethod(_raw.dpar_comm_free)

    def __init__(self, raw):
        self._own(raw)

    @classmethod
    def mpi(cls, timeout_seconds=300.0):
        return cls(_check(_raw.dpar_comm_create_mpi(_comm_options(timeout_seconds))))

    @property
    def rank_size(self):
        r, s = _scalar(np.uintp), _scalar(np.uintp)
        _check(_raw.dpar_comm_info(r.ctypes.data, s.ctypes.data, self._raw))
        return int(r[0]), int(s[0])

    @property
    def device(self):
        """(kind, index) of the device whose memory the buffers are: (DEVICE_CPU, 0) for host memory."""
        d = _raw.dpar_device()
        _check(_raw.dpar_comm_device(d, self._raw))
        return d.kind, d.index

    def all_reduce(self, send, recv=None, op=SUM):
        recv = send if recv is None else recv
        (sp, n, dt), (rp, _, _) = _buffer(send, "send"), _buffer(recv, "recv")
        _check(_raw.dpar_comm_all_reduce(self._raw, sp, rp, n, dt, op))
        return recv

    def broadcast(self, buffer, root):
        p, n, dt = _buffer(buffer, "buffer")
        _check(_raw.dpar_comm_broadcast(self._raw, p, n, dt, root))
        return buffer

    def reduce(self, send, recv, op=SUM, root=0):
        (sp, n, dt), (rp, _, _) = _buffer(send, "send"), _buffer(recv, "recv")
        _check(_raw.dpar_comm_reduce(self._raw, sp, rp, n, dt, op, root))

    def all_gather(self, send, recv):
        (sp, n, dt), (rp, _, _) = _buffer(send, "send"), _buffer(recv, "recv")
        _check(_raw.dpar_comm_all_gather(self._raw, sp, rp, n, dt))
        return recv

    def reduce_scatter(self, send, recv, op=SUM):
        (sp, _, dt), (rp, n, _) = _buffer(send, "send"), _buffer(recv, "recv")
        _check(_raw.dpar_comm_reduce_scatter(self._raw, sp, rp, n, dt, op))
        return recv

    def barrier(self):
        _check(_raw.dpar_comm_barrier(self._raw))

    def abort(self, reason=""):
        _check(_raw.dpar_comm_abort(self._raw, reason))

    def async_error(self):
        """None while usable; else the DparError the next collective would raise."""
        s = _scalar(np.int32)
        _check(_raw.dpar_comm_get_async_error(s.ctypes.data, self._raw))
        if s[0] != OK:
            message = _raw.dpar_last_error()
            _raw.dpar_clear_error()
            return DparError(int(s[0]), message)
        return None

    def _work(self, result, *buffers):
        return Work(_check(result), buffers)

    def all_reduce_async(self, buffer, op=SUM):
        p, n, dt = _buffer(buffer, "buffer")
        return self._work(_raw.dpar_comm_all_reduce_async(self._raw, p, p, n, dt, op), buffer)

    def broadcast_async(self, buffer, root):
        p, n, dt = _buffer(buffer, "buffer")
        return self._work(_raw.dpar_comm_broadcast_async(self._raw, p, n, dt, root), buffer)

    def all_gather_async(self, send, recv):
        (sp, n, dt), (rp, _, _) = _buffer(send, "send"), _buffer(recv, "recv")
        return self._work(_raw.dpar_comm_all_gather_async(self._raw, sp, rp, n, dt), send, recv)

    def reduce_scatter_async(self, send, recv, op=SUM):
        (sp, _, dt), (rp, n, _) = _buffer(send, "send"), _buffer(recv, "recv")
        return self._work(_raw.dpar_comm_reduce_scatter_async(self._raw, sp, rp, n, dt, op), send, recv)


class Work(_Handle):
    """An asynchronous collective; it keeps its arrays alive until freed (close() waits)."""

    _free = staticmethod(_raw.dpar_work_free)

    def __init__(self, raw, buffers):
        self._own(raw)
        self._buffers = buffers

    def test(self):
        done = _scalar(np.int32)
        _check(_raw.dpar_work_test(done.ctypes.data, self._raw))
        return bool(done[0])

    def wait(self):
        _check(_raw.dpar_work_wait(self._raw))


class Reducer(_Handle):
    """DDP's gradient reducer over float32 buffers it keeps alive (NumPy arrays, or on a group made on GPUs, CUDA
    arrays such as PyTorch's or CuPy's); mark each with grad_ready(i), then wait().

    processes: a communicator over the processes (Comm.mpi()), or None. With one, the reducers of a group's members
    in several processes sum over every member of every process, hierarchically (among the process's members, then
    across the processes by member 0, then back); every member passes its process's same Comm, which runs no other
    collective during a step. With MEAN, every process creates its reducers at the same point (member 0's creation
    counts every process's members). compression: how buckets cross the processes (COMPRESSION_NONE, the default,
    or COMPRESSION_BF16)."""

    _free = staticmethod(_raw.dpar_reducer_free)

    def __init__(self, comm, grads, first_bucket_bytes=0, bucket_cap_bytes=0, op=MEAN, *, processes=None,
                 compression=None):
        self._grads = list(grads)
        views = [_buffer(g, f"grads[{i}]") for i, g in enumerate(self._grads)]
        if any(dt != F32 for _, _, dt in views):
            raise DparError(ERR_INVALID_ARGUMENT, "grads: float32 buffers only")
        self._ptrs = np.array([p for p, _, _ in views], dtype=np.uintp)
        self._counts = np.array([n for _, n, _ in views], dtype=np.uintp)
        o = _raw.dpar_reducer_options()
        _check(_raw.dpar_reducer_options_init(o))
        _set_fields(o, {"first_bucket_bytes": "size", "bucket_cap_bytes": "size", "op": "int32",
                        "compression": "int32"},
                    first_bucket_bytes=first_bucket_bytes, bucket_cap_bytes=bucket_cap_bytes, op=op,
                    compression=compression)
        if processes is not None:
            if not isinstance(processes, Comm):
                raise TypeError(f"processes: expected a dpar.Comm (Comm.mpi()), got {processes!r}")
            o.processes = processes._raw
        # The handles stay as long as the reducer (dpar keeps the communicators behind them in any case).
        self._comm, self._processes = comm, processes
        self._own(_check(_raw.dpar_reducer_create(comm._raw, self._ptrs.ctypes.data, self._counts.ctypes.data,
                                                  len(grads), o)))

    @property
    def num_buckets(self):
        n = _scalar(np.uintp)
        _check(_raw.dpar_reducer_num_buckets(n.ctypes.data, self._raw))
        return int(n[0])

    def grad_ready(self, index):
        _check(_raw.dpar_reducer_grad_ready(self._raw, index))

    def wait(self):
        _check(_raw.dpar_reducer_wait(self._raw))
