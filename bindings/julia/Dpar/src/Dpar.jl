"""
    Dpar

dpar for Julia: data-parallel training over several devices through dpar's C ABI (`libdpar.so.0`): an `Engine`
that trains a `Model` on several devices; collectives (`CommGroup`, `Comm`, `all_reduce!`, ...) and a gradient
`Reducer` for a program that brings its own model and autograd; IDX datasets and a batch `Loader`.

Every handle is a Julia object with `close` (a finalizer frees it too); every failed call throws a `DparError`
carrying dpar's status and message. `do`-block helpers (`Model(seed) do m ... end`) close at the end. The library is
found when the package loads (not when it is precompiled) through `ENV["DPAR_LIB"]` (a path to libdpar.so), else
the CMake build tree of this checkout, else the dynamic loader's search path (`libdpar.so.0`); `Dpar.libdpar_path[]`
says which.
"""
module Dpar

using Libdl

# Every ccall names the library by its soname. __init__ loads the copy chosen when the package loads (not when it
# was precompiled), and the dynamic loader resolves the soname to the copy already loaded.
const libdpar = "libdpar.so.0"

"The path of the libdpar that this session loaded (set when the package loads)."
const libdpar_path = Ref{String}("")

function __init__()
    chosen = get(ENV, "DPAR_LIB", "")
    if isempty(chosen)
        tree = joinpath(@__DIR__, "..", "..", "..", "..", "build", "libdpar.so")
        chosen = isfile(tree) ? tree : libdpar
    end
    handle = Libdl.dlopen(chosen, Libdl.RTLD_NOW | Libdl.RTLD_GLOBAL; throw_error = false)
    handle === nothing && error("Dpar: cannot load libdpar from \"$chosen\": set ENV[\"DPAR_LIB\"] to the path of " *
                                "libdpar.so, or install dpar where the dynamic loader finds libdpar.so.0")
    libdpar_path[] = Libdl.dlpath(handle)
    nothing
end

export DparError, Model, Engine, Tensor, linear!, activation!, dropout!, last_node, branch_from!, set_node_name!, tie_param!,
       add_sum!, add_concat!, add_flatten!, add_reshape!, MODEL_INPUT, conv2d!, max_pool2d!, avg_pool2d!,
       adaptive_avg_pool2d!, train_step!, step_count, num_params,
       param_info, get_param, set_param!, set_forward_hook!, set_lr!, set_max_grad_norm!, grad_norm, set_training!,
       set_gradient_compression!, set_gradient_reduction!, set_weight_decay_exclusion!, set_precision!, precision,
       set_reduce_dtype!, reduce_dtype,
       set_reproducible!, reproducible, memory_stats, reset_peak_memory!,
       set_allow_tf32!, set_loss_scaling!, loss_scale, last_step_skipped, param_decays, forward, num_replicas,
       trace_start!, trace_stop!,
       ReduceOp, CommGroup, Comm, member, all_reduce!, reduce!, all_gather!, reduce_scatter!, barrier, Work,
       all_reduce_async!, broadcast_async!, all_gather_async!, reduce_scatter_async!, Reducer, grad_ready!,
       num_buckets, Dataset, Loader, start_epoch!, num_batches, shard!, to_device!, batchnorm1d!, batchnorm2d!,
       layernorm!, embedding!, position_embedding!, attention!, multihead_attention!, causal_self_attention!,
       sync_batchnorm!, convert_sync_batchnorm!, num_buffers, buffer_info, get_buffer, set_buffer!, buffer

const OK = Int32(0)
const ERR_INVALID_ARGUMENT = Int32(-1)
const ERR_OUT_OF_MEMORY = Int32(-2)
const ERR_DEVICE = Int32(-3)
const ERR_COMMUNICATION = Int32(-4)
const ERR_REMOTE = Int32(-5)
const ERR_TIMEOUT = Int32(-6)
const ERR_MISMATCH = Int32(-7)
const ERR_IO = Int32(-8)
const ERR_CORRUPT = Int32(-9)
const ERR_NOT_SUPPORTED = Int32(-10)
const ERR_INVALID_STATE = Int32(-11)
const ERR_INTERNAL = Int32(-12)
const F32 = Int32(0)
const I32 = Int32(1)
const BF16 = Int32(2)
const F16 = Int32(3)
const RELU, GELU, TANH, SIGMOID, SILU = Int32(0), Int32(1), Int32(2), Int32(3), Int32(4)
const SGD, ADAM, ADAMW = Int32(0), Int32(1), Int32(2)
const LOSS_CROSS_ENTROPY, LOSS_MSE = Int32(0), Int32(1)
# The cross-entropy target that is ignored: no loss, no gradient, not counted in the mean (PyTorch's ignore_index).
const IGNORE_INDEX = Int32(-100)
const PROCESSES_AUTO, PROCESSES_SINGLE, PROCESSES_MPI = Int32(0), Int32(1), Int32(2)
const COMPRESSION_NONE, COMPRESSION_BF16 = Int32(0), Int32(1)
const REDUCTION_ALL_REDUCE, REDUCTION_REDUCE_SCATTER, REDUCTION_ALL_REDUCE_SHARDED = Int32(0), Int32(1), Int32(2)

"""A failed dpar call: `status` (negative) and dpar's `message`. Throw one from a callback to fail the engine
call with that status and message."""
struct DparError <: Exception
    status::Int32
    message::String
end
Base.showerror(io::IO, e::DparError) = print(io, status_name(e.status), ": ", e.message)

status_name(s::Integer) = unsafe_string(ccall((:dpar_status_str, libdpar), Cstring, (Int32,), s))
version() = ccall((:dpar_version, libdpar), Int32, ())
version_string() = unsafe_string(ccall((:dpar_version_string, libdpar), Cstring, ()))
"What runs the CPU matrix multiplies: the GEMM library, its version and the kernels it chose for this CPU."
cpu_gemm_backend() = unsafe_string(ccall((:dpar_cpu_gemm_backend, libdpar), Cstring, ()))

# Reads, then clears, the thread's error: the ccall and this read run on the same OS thread (no task switch
# between them: neither yields).
function take_error(status::Int32)
    msg = unsafe_string(ccall((:dpar_last_error, libdpar), Cstring, ()))
    ccall((:dpar_clear_error, libdpar), Cvoid, ())
    DparError(status, msg)
end

function check(status::Int32)
    status == OK && return nothing
    throw(take_error(status))
end

function device_count(kind::Integer=0)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_device_count, libdpar), Int32, (Ptr{Csize_t}, Int32), n, kind))
    Int(n[])
end

"""A device: `kind` (0 for a CPU device, 1 for a CUDA GPU) and `index`, from 0; `parse_device("cuda:1")` makes
one from its name."""
struct DparDevice
    kind::Int32
    index::Int32
end

"""`parse_device(text)`: the `DparDevice` named "cpu:3", "cpu" (index 0) or "cuda:1"."""
function parse_device(text::AbstractString)
    d = Ref(DparDevice(0, 0))
    check(ccall((:dpar_device_parse, libdpar), Int32, (Ptr{DparDevice}, Cstring), d, text))
    d[]
end

# ---- Tensors -----------------------------------------------------------------------------------------------

"""A dpar tensor. `Tensor(array)` copies a Float32 or Int32 array (row-major: dpar's shape is the array's
dimensions reversed, so a Julia `features x batch` matrix is dpar's `(batch, features)`). A `Loader`'s batches are
tensors borrowed from the loader: valid until its next batch, never freed by `close`."""
mutable struct Tensor
    ptr::Ptr{Cvoid}
    keep::Any     # memory the tensor wraps, or the loader a borrowed batch belongs to
    owned::Bool   # false for a borrowed tensor: its parent frees it
    function Tensor(ptr::Ptr{Cvoid}, keep=nothing; owned::Bool=true)
        t = new(ptr, keep, owned)
        owned ? finalizer(close, t) : t
    end
end

function Base.close(t::Tensor)
    t.ptr == C_NULL && return
    t.owned && ccall((:dpar_tensor_free, libdpar), Cvoid, (Ptr{Cvoid},), t.ptr)
    t.ptr = C_NULL
end

dtype_of(::Type{Float32}) = F32
dtype_of(::Type{Int32}) = I32

function Tensor(a::Array{T}) where {T<:Union{Float32,Int32}}
    shape = Int64[reverse(size(a))...]
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_tensor_create, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Int32, Ptr{Int64}, Csize_t, DparDevice),
                out, dtype_of(T), shape, length(shape), DparDevice(0, 0)))
    t = Tensor(out[])
    check(ccall((:dpar_tensor_copy_from_host, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t),
                t.ptr, a, sizeof(a)))
    t
end

"""Wraps an array without a copy; the tensor keeps it alive."""
function wrap(a::Array{T}) where {T<:Union{Float32,Int32}}
    shape = Int64[reverse(size(a))...]
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_tensor_wrap_host, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Int32, Ptr{Int64}, Csize_t, Ptr{Cvoid}),
                out, dtype_of(T), shape, length(shape), a))
    Tensor(out[], a)
end

function Base.size(t::Tensor)
    s = zeros(Int64, 4)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_tensor_shape, libdpar), Int32, (Ptr{Int64}, Ptr{Csize_t}, Ptr{Cvoid}, Csize_t),
                s, n, t.ptr, 4))
    Tuple(s[1:n[]])
end

function info(t::Tensor)
    dt, n, d = Ref{Int32}(0), Ref{Csize_t}(0), Ref(DparDevice(0, 0))
    check(ccall((:dpar_tensor_info, libdpar), Int32, (Ptr{Int32}, Ptr{Csize_t}, Ptr{DparDevice}, Ptr{Cvoid}),
                dt, n, d, t.ptr))
    (dt[], Int(n[]), d[])
end

"""A copy of the tensor as a Julia array (dimensions reversed: column-major)."""
function Base.Array(t::Tensor)
    dt, _, _ = info(t)
    a = Array{dt == F32 ? Float32 : Int32}(undef, reverse(size(t))...)
    check(ccall((:dpar_tensor_copy_to_host, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t),
                a, t.ptr, sizeof(a)))
    a
end

# ---- Models ------------------------------------------------------------------------------------------------

struct ModelOptions
    size::Csize_t
    version::UInt32
    seed::UInt64
end

"""
    Model(seed=0)
    Model(f, seed=0)

An empty sequential model, whose layers' parameters are initialised from `seed`: the template an `Engine` copies to
every device. Append layers with `linear!`, `activation!` and `dropout!`. The `do`-block form closes it at the end.
"""
mutable struct Model
    ptr::Ptr{Cvoid}
    function Model(seed::Integer=0)
        o = Ref(ModelOptions(0, 0, 0))
        check(ccall((:dpar_model_options_init_sized, libdpar), Int32, (Ptr{ModelOptions}, Csize_t),
                    o, sizeof(ModelOptions)))
        o[] = ModelOptions(o[].size, o[].version, UInt64(seed))
        out = Ref{Ptr{Cvoid}}(C_NULL)
        check(ccall((:dpar_model_create, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{ModelOptions}), out, o))
        finalizer(close, new(out[]))
    end
end

"""`Model(seed) do m ... end`: the model is closed at the end of the block."""
function Model(f::Function, seed::Integer=0)
    m = Model(seed)
    try
        f(m)
    finally
        close(m)
    end
end

function Base.close(m::Model)
    m.ptr == C_NULL && return
    ccall((:dpar_model_free, libdpar), Cvoid, (Ptr{Cvoid},), m.ptr)
    m.ptr = C_NULL
end

"""`linear!(model, in_features, out_features; bias=true)`: appends y = x W^T + b, initialised as PyTorch's
nn.Linear is."""
function linear!(m::Model, in_features::Integer, out_features::Integer; bias::Bool=true)
    check(ccall((:dpar_model_add_linear, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64, Int32),
                m.ptr, in_features, out_features, bias))
    m
end

"""`activation!(model, kind)`: appends `Dpar.RELU`, `Dpar.GELU`, `Dpar.TANH`, `Dpar.SIGMOID` or `Dpar.SILU`."""
function activation!(m::Model, kind::Integer)
    check(ccall((:dpar_model_add_activation, libdpar), Int32, (Ptr{Cvoid}, Int32), m.ptr, kind))
    m
end

"""`dropout!(model, p)`: appends dropout with drop probability `p` in [0, 1), active in training mode only."""
function dropout!(m::Model, p::Real)
    check(ccall((:dpar_model_add_dropout, libdpar), Int32, (Ptr{Cvoid}, Cfloat), m.ptr, p))
    m
end

"""The model's input, where a node id is expected (`branch_from!`, `add_sum!`, `add_concat!`)."""
const MODEL_INPUT = Int32(-1)

"""`last_node(model)`: the id of the last node added (nodes are numbered 0, 1, ... as added); `MODEL_INPUT` when
empty."""
function last_node(m::Model)
    n = Ref{Int32}(0)
    check(ccall((:dpar_model_last_node, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), n, m.ptr))
    Int(n[])
end

"""`branch_from!(model, node)`: the next node added without explicit inputs reads `node` (`MODEL_INPUT` for the
model's input)."""
function branch_from!(m::Model, node::Integer)
    check(ccall((:dpar_model_branch_from, libdpar), Int32, (Ptr{Cvoid}, Int32), m.ptr, node))
    m
end

"""`set_node_name!(model, node, name)`: names a node as a PyTorch module path ("layer1.0.conv1"); its parameters
become "layer1.0.conv1.weight"."""
function set_node_name!(m::Model, node::Integer, name::AbstractString)
    check(ccall((:dpar_model_set_node_name, libdpar), Int32, (Ptr{Cvoid}, Int32, Cstring), m.ptr, node, name))
    m
end

"""`tie_param!(model, node, param, source_node, source_param)`: ties `node`'s parameter `param` to `source_node`'s
`source_param` (nodes from 0, as dpar numbers them), as PyTorch's `lm_head.weight = wte.weight`: both nodes read the
source's parameter (its values and name), held, counted, reduced and stepped once, its gradient the sum of both;
checkpoints hold it under both keys."""
function tie_param!(m::Model, node::Integer, param::AbstractString, source_node::Integer,
                    source_param::AbstractString)
    check(ccall((:dpar_model_tie_param, libdpar), Int32, (Ptr{Cvoid}, Int32, Cstring, Int32, Cstring),
                m.ptr, node, param, source_node, source_param))
    m
end

"""`add_sum!(model, inputs)`: appends the elementwise sum of nodes of equal shape (a residual connection)."""
function add_sum!(m::Model, inputs::AbstractVector{<:Integer})
    v = Vector{Int32}(inputs)
    check(ccall((:dpar_model_add_sum, libdpar), Int32, (Ptr{Cvoid}, Ptr{Int32}, Csize_t), m.ptr, v, length(v)))
    m
end

"""`add_concat!(model, inputs)`: appends the concatenation of nodes along dim 1."""
function add_concat!(m::Model, inputs::AbstractVector{<:Integer})
    v = Vector{Int32}(inputs)
    check(ccall((:dpar_model_add_concat, libdpar), Int32, (Ptr{Cvoid}, Ptr{Int32}, Csize_t), m.ptr, v, length(v)))
    m
end

"""`add_flatten!(model)`: appends (B, ...) -> (B, prod(...)), a view with no copy."""
function add_flatten!(m::Model)
    check(ccall((:dpar_model_add_flatten, libdpar), Int32, (Ptr{Cvoid},), m.ptr))
    m
end

"""`add_reshape!(model, row_shape)`: appends (B, ...) -> (B, row_shape...), as nn.Unflatten(1, row_shape); a view
with no copy."""
function add_reshape!(m::Model, row_shape::AbstractVector{<:Integer})
    v = Vector{Int64}(row_shape)
    check(ccall((:dpar_model_add_reshape, libdpar), Int32, (Ptr{Cvoid}, Ptr{Int64}, Csize_t), m.ptr, v, length(v)))
    m
end

# An integer or a (height, width) pair, as the C ABI's int64_t[2] (PyTorch takes either).
_pair(v::Integer) = Int64[v, v]
function _pair(v)
    length(v) == 2 || throw(DparError(ERR_INVALID_ARGUMENT, "expected an integer or a (height, width) pair, got $v"))
    Int64[v[1], v[2]]
end

"""`conv2d!(model, in_channels, out_channels, kernel_size; stride=1, padding=0, dilation=1, groups=1,
bias=true)`: appends PyTorch's nn.Conv2d over (batch, channels, height, width) inputs (a Julia array of size (width,
height, channels, batch)); each size an integer or a (height, width) pair. Parameters "weight" (out, in / groups, kh,
kw) and "bias" (out), initialised as PyTorch's."""
function conv2d!(m::Model, in_channels::Integer, out_channels::Integer, kernel_size; stride=1, padding=0,
                 dilation=1, groups::Integer=1, bias::Bool=true)
    k, s, p, d = _pair(kernel_size), _pair(stride), _pair(padding), _pair(dilation)
    check(ccall((:dpar_model_add_conv2d, libdpar), Int32,
                (Ptr{Cvoid}, Int64, Int64, Ptr{Int64}, Ptr{Int64}, Ptr{Int64}, Ptr{Int64}, Int64, Int32),
                m.ptr, in_channels, out_channels, k, s, p, d, groups, bias))
    m
end

"""`max_pool2d!(model, kernel_size; stride=nothing, padding=0)`: appends PyTorch's nn.MaxPool2d; `stride` nothing is
the kernel size."""
function max_pool2d!(m::Model, kernel_size; stride=nothing, padding=0)
    k, p = _pair(kernel_size), _pair(padding)
    s = stride === nothing ? Ptr{Int64}(C_NULL) : _pair(stride)
    GC.@preserve s begin
        sp = s isa Vector{Int64} ? pointer(s) : s
        check(ccall((:dpar_model_add_max_pool2d, libdpar), Int32, (Ptr{Cvoid}, Ptr{Int64}, Ptr{Int64}, Ptr{Int64}),
                    m.ptr, k, sp, p))
    end
    m
end

"""`avg_pool2d!(model, kernel_size; stride=nothing, padding=0)`: appends PyTorch's nn.AvgPool2d (padding counted in
each window's divisor); `stride` nothing is the kernel size."""
function avg_pool2d!(m::Model, kernel_size; stride=nothing, padding=0)
    k, p = _pair(kernel_size), _pair(padding)
    s = stride === nothing ? Ptr{Int64}(C_NULL) : _pair(stride)
    GC.@preserve s begin
        sp = s isa Vector{Int64} ? pointer(s) : s
        check(ccall((:dpar_model_add_avg_pool2d, libdpar), Int32, (Ptr{Cvoid}, Ptr{Int64}, Ptr{Int64}, Ptr{Int64}),
                    m.ptr, k, sp, p))
    end
    m
end

"""`adaptive_avg_pool2d!(model, output_size)`: appends PyTorch's nn.AdaptiveAvgPool2d; only 1 / (1, 1) is
implemented (a DparError with ERR_NOT_SUPPORTED otherwise)."""
function adaptive_avg_pool2d!(m::Model, output_size)
    o = _pair(output_size)
    check(ccall((:dpar_model_add_adaptive_avg_pool2d, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64), m.ptr, o[1], o[2]))
    m
end

"""`num_params(model)`: the number of parameter tensors."""
function num_params(m::Model)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_model_num_params, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, m.ptr))
    Int(n[])
end

function num_param_elements(m::Model)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_model_num_param_elements, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, m.ptr))
    Int(n[])
end

function num_layers(m::Model)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_model_num_layers, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, m.ptr))
    Int(n[])
end

"""(name, shape) of parameter `index` (from 0, as dpar numbers them)."""
function param_info(m::Model, index::Integer)
    s = zeros(Int64, 4)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_model_param_info, libdpar), Int32, (Ptr{Int64}, Ptr{Csize_t}, Ptr{Cvoid}, Csize_t),
                s, n, m.ptr, index))
    name = ccall((:dpar_model_param_name, libdpar), Cstring, (Ptr{Cvoid}, Csize_t), m.ptr, index)
    (unsafe_string(name), Tuple(s[1:n[]]))
end

"""`param_decays(model, index)`: whether parameter `index` (from 0) decays when the engine excludes biases and norms
from weight decay (`set_weight_decay_exclusion!`): false for biases and BatchNorm's weight and bias."""
function param_decays(m::Model, index::Integer)
    d = Ref{Int32}(0)
    check(ccall((:dpar_model_param_decays, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}, Csize_t), d, m.ptr, index))
    d[] != 0
end

"""`get_param(model, index)`: parameter `index` (from 0), flattened, as a copy."""
function get_param(m::Model, index::Integer)
    _, shape = param_info(m, index)
    v = zeros(Float32, prod(shape))
    check(ccall((:dpar_model_get_param, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Csize_t, Csize_t),
                v, m.ptr, index, length(v)))
    v
end

"""`set_param!(model, index, values)`: overwrites parameter `index` (from 0) with `values`, exactly its size."""
function set_param!(m::Model, index::Integer, v::Vector{Float32})
    check(ccall((:dpar_model_set_param, libdpar), Int32, (Ptr{Cvoid}, Csize_t, Ptr{Cfloat}, Csize_t),
                m.ptr, index, v, length(v)))
end

# ---- BatchNorm and buffers ---------------------------------------------------------------------------------

"""`layernorm!(model, normalized_size; eps=1e-5, elementwise_affine=true)`: appends LayerNorm over the last dim
of (B, ..., D) inputs, as torch.nn.LayerNorm((D,))."""
function layernorm!(m::Model, normalized_size::Integer; eps::Real = 1e-5, elementwise_affine::Bool = true)
    check(ccall((:dpar_model_add_layernorm, libdpar), Int32, (Ptr{Cvoid}, Int64, Cfloat, Int32),
                m.ptr, normalized_size, eps, elementwise_affine ? 1 : 0))
    m
end

"""`embedding!(model, num_embeddings, embedding_dim; padding_idx=nothing)`: appends an Embedding; Int32 indices
(B) or (B, T) (0-based) give rows of its weight, and the model then takes Int32 input tensors. Row `padding_idx`
(0-based; negative: from the end), if given, starts at zero and gets no gradient."""
function embedding!(m::Model, num_embeddings::Integer, embedding_dim::Integer; padding_idx = nothing)
    if padding_idx === nothing
        check(ccall((:dpar_model_add_embedding, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64),
                    m.ptr, num_embeddings, embedding_dim))
    else
        check(ccall((:dpar_model_add_embedding_padded, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64, Int64),
                    m.ptr, num_embeddings, embedding_dim, padding_idx))
    end
    m
end

"""`position_embedding!(model, max_positions, embedding_dim)`: appends GPT-2's learned position embedding
(nanoGPT's wpe): a (B, T, C) input gives input + weight[t] at position t, its "weight" (max_positions,
embedding_dim) drawn from N(0, 1). A sequence longer than `max_positions` is refused."""
function position_embedding!(m::Model, max_positions::Integer, embedding_dim::Integer)
    check(ccall((:dpar_model_add_position_embedding, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64),
                m.ptr, max_positions, embedding_dim))
    m
end

"""`attention!(model, num_heads; inputs=nothing, is_causal=false, dropout_p=0, scale=nothing)`: appends
F.scaled_dot_product_attention(q, k, v; dropout_p, is_causal, scale) over `num_heads` heads, the output (B, L, C)
with the heads merged. `inputs`: the (0-based) nodes q, k and v; one node, a packed (B, T, 3C) q|k|v projection; or
`nothing` for the next input as a packed projection. `scale` `nothing` is 1/sqrt(head size). No parameters."""
function attention!(m::Model, num_heads::Integer; inputs = nothing, is_causal::Bool = false, dropout_p::Real = 0,
                    scale = nothing)
    v = inputs === nothing ? Int32[] : Vector{Int32}(inputs)
    p = isempty(v) ? Ptr{Int32}(C_NULL) : pointer(v)
    GC.@preserve v check(ccall((:dpar_model_add_attention, libdpar), Int32,
                               (Ptr{Cvoid}, Ptr{Int32}, Csize_t, Int64, Int32, Cfloat, Cfloat),
                               m.ptr, p, length(v), num_heads, is_causal ? 1 : 0, dropout_p,
                               scale === nothing ? 0 : scale))
    m
end

"""`multihead_attention!(model, embed_dim, num_heads; dropout=0, bias=true, is_causal=false)`: appends
self-attention as torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, batch_first=True)(x, x, x,
need_weights=False, is_causal)[0] on (B, T, embed_dim) inputs, with the module's parameter names (in_proj_weight,
in_proj_bias, out_proj.weight, out_proj.bias) and initialisation."""
function multihead_attention!(m::Model, embed_dim::Integer, num_heads::Integer; dropout::Real = 0,
                              bias::Bool = true, is_causal::Bool = false)
    check(ccall((:dpar_model_add_multihead_attention, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64, Cfloat, Int32, Int32),
                m.ptr, embed_dim, num_heads, dropout, bias ? 1 : 0, is_causal ? 1 : 0))
    m
end

"""`causal_self_attention!(model, n_embd, n_head; dropout=0, bias=true, name=nothing)`: appends nanoGPT's
CausalSelfAttention on (B, T, n_embd) inputs: c_attn, causal attention of `n_head` heads, c_proj and
resid_dropout. With a `name` ("transformer.h.0.attn") the linear nodes are "<name>.c_attn" and "<name>.c_proj", so
that their parameters have nanoGPT's state_dict keys. A refusal leaves the model as it was."""
function causal_self_attention!(m::Model, n_embd::Integer, n_head::Integer; dropout::Real = 0, bias::Bool = true,
                                name::Union{AbstractString,Nothing} = nothing)
    check(ccall((:dpar_model_add_causal_self_attention, libdpar), Int32,
                (Ptr{Cvoid}, Int64, Int64, Cfloat, Int32, Cstring),
                m.ptr, n_embd, n_head, dropout, bias ? 1 : 0, name === nothing ? C_NULL : name))
    m
end

"""`batchnorm1d!(model, num_features; eps=1e-5, momentum=0.1, affine=true)`: appends BatchNorm1d over the
channels of (B, C) or (B, C, L) inputs."""
function batchnorm1d!(m::Model, num_features::Integer; eps::Real = 1e-5, momentum::Real = 0.1, affine::Bool = true)
    check(ccall((:dpar_model_add_batchnorm1d, libdpar), Int32, (Ptr{Cvoid}, Int64, Cfloat, Cfloat, Int32),
                m.ptr, num_features, eps, momentum, affine ? 1 : 0))
    m
end

"""`batchnorm2d!(model, num_features; eps=1e-5, momentum=0.1, affine=true)`: appends BatchNorm2d over the
channels of (B, C, H, W) inputs."""
function batchnorm2d!(m::Model, num_features::Integer; eps::Real = 1e-5, momentum::Real = 0.1, affine::Bool = true)
    check(ccall((:dpar_model_add_batchnorm2d, libdpar), Int32, (Ptr{Cvoid}, Int64, Cfloat, Cfloat, Int32),
                m.ptr, num_features, eps, momentum, affine ? 1 : 0))
    m
end

"""`sync_batchnorm!(model, num_features; eps=1e-5, momentum=0.1, affine=true)`: appends SyncBatchNorm, whose
statistics are those of every replica of every process."""
function sync_batchnorm!(m::Model, num_features::Integer; eps::Real = 1e-5, momentum::Real = 0.1,
                         affine::Bool = true)
    check(ccall((:dpar_model_add_sync_batchnorm, libdpar), Int32, (Ptr{Cvoid}, Int64, Cfloat, Cfloat, Int32),
                m.ptr, num_features, eps, momentum, affine ? 1 : 0))
    m
end

"""`convert_sync_batchnorm!(model)`: turns every BatchNorm layer into SyncBatchNorm."""
function convert_sync_batchnorm!(m::Model)
    check(ccall((:dpar_model_convert_sync_batchnorm, libdpar), Int32, (Ptr{Cvoid},), m.ptr))
    m
end

"""`num_buffers(model)`: the number of buffers (BatchNorm's running statistics: state that is not a parameter)."""
function num_buffers(m::Model)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_model_num_buffers, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, m.ptr))
    Int(n[])
end

"""`buffer_info(model, index)`: (name, element type (Float32 or Int64), shape; () for a scalar) of buffer `index`
(from 0)."""
function buffer_info(m::Model, index::Integer)
    s = zeros(Int64, 4)
    n = Ref{Csize_t}(0)
    dtype = Ref{Int32}(0)
    check(ccall((:dpar_model_buffer_info, libdpar), Int32, (Ptr{Int32}, Ptr{Int64}, Ptr{Csize_t}, Ptr{Cvoid}, Csize_t),
                dtype, s, n, m.ptr, index))
    name = ccall((:dpar_model_buffer_name, libdpar), Cstring, (Ptr{Cvoid}, Csize_t), m.ptr, index)
    (unsafe_string(name), dtype[] == 6 ? Int64 : Float32, Tuple(s[1:n[]]))
end

"""`get_buffer(model, index)`: buffer `index` (from 0), flattened, as a copy (Vector{Float32} or Vector{Int64})."""
function get_buffer(m::Model, index::Integer)
    _, T, shape = buffer_info(m, index)
    v = zeros(T, prod(shape))
    check(ccall((:dpar_model_get_buffer, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Csize_t),
                v, m.ptr, index, length(v)))
    v
end

"""`set_buffer!(model, index, values)`: overwrites buffer `index` (from 0) with `values`, of its element type and
exactly its size."""
function set_buffer!(m::Model, index::Integer, v::Vector)
    _, T, _ = buffer_info(m, index)
    eltype(v) === T || throw(ArgumentError("values: buffer $index holds $T, got $(eltype(v))"))
    check(ccall((:dpar_model_set_buffer, libdpar), Int32, (Ptr{Cvoid}, Csize_t, Ptr{Cvoid}, Csize_t),
                m.ptr, index, v, length(v)))
end

# ---- The engine --------------------------------------------------------------------------------------------

mutable struct OptimizerOptions
    size::Csize_t
    version::UInt32
    kind::Int32
    lr::Cfloat
    momentum::Cfloat
    dampening::Cfloat
    nesterov::Int32
    weight_decay::Cfloat
    beta1::Cfloat
    beta2::Cfloat
    eps::Cfloat
    OptimizerOptions() = new()
end

mutable struct EngineOptions
    size::Csize_t
    version::UInt32
    device_kind::Int32
    num_cpu_devices::Csize_t
    device_ids::Ptr{Int32}
    num_device_ids::Csize_t
    output_device::Int32
    loss::Int32
    seed::UInt64
    timeout_seconds::Cdouble
    blas_threads::Csize_t
    pin_workers::Int32
    first_bucket_bytes::Csize_t
    bucket_cap_bytes::Csize_t
    processes::Int32
    create_timeout_seconds::Cdouble
    EngineOptions() = new()
end
const ENGINE_OPTIONS_VERSION = UInt32(3)

"""
    Engine(model; optimizer=SGD, lr=0.01, momentum=0.0, dampening=0.0, nesterov=false, weight_decay=0.0,
           beta1=0.9, beta2=0.999, eps=1e-8, devices=0, device_kind=DEVICE_CPU, device_ids=nothing,
           output_device=nothing, loss=LOSS_CROSS_ENTROPY, seed=0, timeout_seconds=nothing, blas_threads=nothing,
           pin_workers=nothing, first_bucket_bytes=nothing, bucket_cap_bytes=nothing, processes=PROCESSES_AUTO,
           create_timeout_seconds=nothing)
    Engine(f, model; kwargs...)

dpar's DataParallel engine: a replica of `model` on each of `devices` CPU devices (0: as many as dpar counts), or
with `device_kind=DEVICE_CUDA` on every GPU, or on the devices `device_ids` of that kind (replica r on
`device_ids[r]`, a device may repeat). Each batch is split across them, gradients all-reduced and one optimizer step
applied to every replica. Every keyword is a field of dpar_optimizer_options or dpar_engine_options (`optimizer`
is the kind, `devices` is num_cpu_devices); `nothing` is dpar's default. `timeout_seconds` is how long a worker
waits for the others at each synchronisation point (300; `Inf`: no limit); `create_timeout_seconds` is how long
creation waits for every process to create its engine, across processes that start at different times (0, the
default: `timeout_seconds`; `Inf`: no limit). Calls on an engine are serialised by a lock inside it. The `do`-block
form closes it at the end.
"""
mutable struct Engine
    ptr::Ptr{Cvoid}
    hook::Any   # the forward hook's Julia closure, rooted while dpar may call it
    input::Any  # the last forward's input: dpar keeps views of its memory (a wrapped Array's) for backward
end

function Engine(model::Model; optimizer::Integer=SGD, lr::Real=0.01, momentum::Real=0.0, dampening::Real=0.0,
                nesterov::Bool=false, weight_decay::Real=0.0, beta1::Union{Real,Nothing}=nothing,
                beta2::Union{Real,Nothing}=nothing, eps::Union{Real,Nothing}=nothing, devices::Integer=0,
                device_kind::Integer=DEVICE_CPU, device_ids::Union{AbstractVector{<:Integer},Nothing}=nothing,
                output_device::Union{Integer,Nothing}=nothing, loss::Integer=LOSS_CROSS_ENTROPY, seed::Integer=0,
                timeout_seconds::Union{Real,Nothing}=nothing, blas_threads::Union{Integer,Nothing}=nothing,
                pin_workers::Union{Bool,Nothing}=nothing, first_bucket_bytes::Union{Integer,Nothing}=nothing,
                bucket_cap_bytes::Union{Integer,Nothing}=nothing, processes::Integer=PROCESSES_AUTO,
                create_timeout_seconds::Union{Real,Nothing}=nothing)
    oo, eo = OptimizerOptions(), EngineOptions()
    check(ccall((:dpar_optimizer_options_init_sized, libdpar), Int32, (Ref{OptimizerOptions}, Csize_t),
                oo, sizeof(OptimizerOptions)))
    check(ccall((:dpar_engine_options_init_sized, libdpar), Int32, (Ref{EngineOptions}, Csize_t),
                eo, sizeof(EngineOptions)))
    oo.kind, oo.lr, oo.momentum, oo.dampening = optimizer, lr, momentum, dampening
    oo.nesterov, oo.weight_decay = nesterov, weight_decay
    beta1 === nothing || (oo.beta1 = beta1)
    beta2 === nothing || (oo.beta2 = beta2)
    eps === nothing || (oo.eps = eps)
    eo.num_cpu_devices, eo.device_kind, eo.loss, eo.seed, eo.processes = devices, device_kind, loss, seed, processes
    output_device === nothing || (eo.output_device = output_device)
    timeout_seconds === nothing || (eo.timeout_seconds = timeout_seconds)
    blas_threads === nothing || (eo.blas_threads = blas_threads)
    pin_workers === nothing || (eo.pin_workers = pin_workers)
    first_bucket_bytes === nothing || (eo.first_bucket_bytes = first_bucket_bytes)
    bucket_cap_bytes === nothing || (eo.bucket_cap_bytes = bucket_cap_bytes)
    create_timeout_seconds === nothing || (eo.create_timeout_seconds = create_timeout_seconds)
    ids = device_ids === nothing ? Int32[] : Vector{Int32}(device_ids)  # dpar copies them
    if device_ids !== nothing
        eo.device_ids, eo.num_device_ids = pointer(ids), length(ids)
    end
    out = Ref{Ptr{Cvoid}}(C_NULL)
    # Creating an engine over several processes is a collective: it waits for the others.
    outp, h = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, out), model.ptr
    oop, eop = Ptr{OptimizerOptions}(pointer_from_objref(oo)), Ptr{EngineOptions}(pointer_from_objref(eo))
    check(blocking(out, model, oo, eo, ids) do
        ccall((:dpar_engine_create, libdpar), Int32,
              (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{OptimizerOptions}, Ptr{EngineOptions}), outp, h, oop, eop)
    end)
    finalizer(close, Engine(out[], nothing, nothing))
end

function Engine(f::Function, model::Model; kwargs...)
    e = Engine(model; kwargs...)
    try
        f(e)
    finally
        close(e)
    end
end

# Every engine call runs in GC-safe state (see `blocking`): it may wait for the engine's lock while another
# thread's call runs, and for the workers, on whose threads a forward hook runs Julia code that may collect
# garbage; a caller blocked outside GC-safe state would stop that collection, and the hook, for good. `f` makes the
# ccall alone, on arguments converted beforehand; `roots` stay alive until it returns.
engine_call(f, e::Engine, roots...) = check(blocking(f, e, roots...))

function Base.close(e::Engine)
    e.ptr == C_NULL && return
    h = e.ptr
    blocking(e) do  # joins the workers, which may be running a hook
        ccall((:dpar_engine_free, libdpar), Cvoid, (Ptr{Cvoid},), h)
    end
    e.ptr = C_NULL
    e.input = nothing  # dpar no longer reads it
end

"""One fused training step; returns the mean loss."""
function train_step!(e::Engine, input::Tensor, target::Tensor)
    l = Ref{Cfloat}(0)
    lp, h, x, y = Base.unsafe_convert(Ptr{Cfloat}, l), e.ptr, input.ptr, target.ptr
    engine_call(e, l, input, target) do
        ccall((:dpar_engine_train_step, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
              lp, h, x, y)
    end
    l[]
end

"""
    forward(engine, input)

The output of the model for `input`, gathered in batch order, as a new `Tensor` (`Array(output)` copies it out). In
training mode `backward!` with dL/d(output), then `step!`, follow. `input` is a `Tensor` or an array of the model's
input: a Julia `features x batch` matrix is dpar's `(batch, features)`, as `Tensor(array)` takes it; an array is
copied (integers as Int32 indices, other reals as Float32). The engine keeps the input alive until the next forward
has succeeded, as dpar reads it in backward (a `wrap`ped array's memory must stay unchanged until then).
"""
function forward(e::Engine, input::Tensor)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    outp, h, x = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, out), e.ptr, input.ptr
    # Both inputs until dpar returns: a refused forward leaves dpar's views of the last one for backward.
    e.input = (e.input, input)
    engine_call(e, out, input) do
        ccall((:dpar_engine_forward, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Cvoid}), outp, h, x)
    end
    e.input = input
    Tensor(out[])
end
forward(e::Engine, input::AbstractArray{<:Real}) = forward(e, host_tensor(input))

# An array as a new tensor holding a copy of it: integers as Int32 (indices), other reals as Float32.
host_tensor(a::AbstractArray{<:Integer}) = Tensor(convert(Array{Int32}, a))
host_tensor(a::AbstractArray{<:Real}) = Tensor(convert(Array{Float32}, a))

"""`step_count(engine)`: the number of optimizer steps taken."""
function step_count(e::Engine)
    n = Ref{Csize_t}(0)
    np, h = Base.unsafe_convert(Ptr{Csize_t}, n), e.ptr
    engine_call(e, n) do
        ccall((:dpar_engine_step_count, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), np, h)
    end
    Int(n[])
end

"""`num_replicas(engine)`: the number of replicas (devices) of this process."""
function num_replicas(e::Engine)
    n = Ref{Csize_t}(0)
    np, h = Base.unsafe_convert(Ptr{Csize_t}, n), e.ptr
    engine_call(e, n) do
        ccall((:dpar_engine_num_replicas, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), np, h)
    end
    Int(n[])
end

"""`set_lr!(engine, lr)`: the learning rate of the following steps."""
function set_lr!(e::Engine, lr::Real)
    h, v = e.ptr, Cfloat(lr)
    engine_call(() -> ccall((:dpar_engine_set_lr, libdpar), Int32, (Ptr{Cvoid}, Cfloat), h, v), e)
end
"""`set_max_grad_norm!(engine, max_norm)`: clips the gradient of the following steps to this global L2 norm
(`clip_grad_norm_` between backward and the step); 0 turns clipping off."""
function set_max_grad_norm!(e::Engine, max_norm::Real)
    h, v = e.ptr, Cfloat(max_norm)
    engine_call(() -> ccall((:dpar_engine_set_max_grad_norm, libdpar), Int32, (Ptr{Cvoid}, Cfloat), h, v), e)
end
"""`set_gradient_compression!(engine, compression)`: compresses gradient buckets between processes from the next
step on (`COMPRESSION_NONE`, `COMPRESSION_BF16`). Every process sets the same; with one process it changes nothing."""
function set_gradient_compression!(e::Engine, compression::Integer)
    h, v = e.ptr, Int32(compression)
    engine_call(() -> ccall((:dpar_engine_set_gradient_compression, libdpar), Int32, (Ptr{Cvoid}, Int32), h, v), e)
end
"""`set_gradient_reduction!(engine, reduction)`: how gradient buckets are reduced from the next step on:
`REDUCTION_ALL_REDUCE` (the default, every replica receives the whole bucket; each process holds the whole optimizer
state, as DDP's bytes), `REDUCTION_REDUCE_SCATTER` (ZeRO-2: each replica receives the block its optimizer steps;
under mpirun the optimizer's shards span every process) or `REDUCTION_ALL_REDUCE_SHARDED` (the all-reduce with the
shards over every process: ZeRO-2's memory for about 1.5x the bytes between processes). Every process sets the
same, at the same point: where the shards move across the processes the optimizer's state is gathered and cut anew
(INVALID_STATE while gradients are pending). Each way the replicas stay bit-identical and, without clipping, train
to the same bits, so switching between steps is allowed."""
function set_gradient_reduction!(e::Engine, reduction::Integer)
    h, v = e.ptr, Int32(reduction)
    engine_call(() -> ccall((:dpar_engine_set_gradient_reduction, libdpar), Int32, (Ptr{Cvoid}, Int32), h, v), e)
end
"""`set_weight_decay_exclusion!(engine, exclude_biases_and_norms)`: from the next step on, steps biases and norms'
parameters (`param_decays` false) with weight decay 0, as two PyTorch parameter groups; false (the default) decays
every parameter."""
function set_weight_decay_exclusion!(e::Engine, exclude_biases_and_norms::Union{Bool,Integer})
    h, v = e.ptr, Int32(exclude_biases_and_norms)
    engine_call(() -> ccall((:dpar_engine_set_weight_decay_exclusion, libdpar), Int32, (Ptr{Cvoid}, Int32), h, v), e)
end
"""`set_precision!(engine, compute_dtype)`: from the next call on, linear layers and convolutions compute in
`compute_dtype`, as torch.autocast's policy: `F32` (the default) or `BF16` (bf16 operands: the input rounded and each
step's bf16 copy of the weights; f32 accumulation and results; master weights, gradients, the optimizer and
checkpoints f32) or `F16` (the same in IEEE half, which overflows above 65504: train it with loss scaling,
`set_loss_scaling!`). `ERR_NOT_SUPPORTED` where a device lacks the kernels (bf16 on a CPU without AVX512-BF16 or
AMX; f16 on any CPU, oneDNN 2.6 having no f16 GEMM for CPUs: the message says why), the engine unchanged. Every
process sets the same."""
function set_precision!(e::Engine, compute_dtype::Integer)
    h, v = e.ptr, Int32(compute_dtype)
    engine_call(() -> ccall((:dpar_engine_set_precision, libdpar), Int32, (Ptr{Cvoid}, Int32), h, v), e)
end
"""`precision(engine)`: the compute dtype `set_precision!` set (`F32`, `BF16` or `F16`)."""
function precision(e::Engine)
    out = Ref{Int32}(0)
    op, h = Base.unsafe_convert(Ptr{Int32}, out), e.ptr
    engine_call(() -> ccall((:dpar_engine_precision, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), op, h), e, out)
    out[]
end
"""`set_reduce_dtype!(engine, dtype)`: from the next step on, gradient buckets are reduced in `dtype`, as FSDP's
MixedPrecisionPolicy(reduce_dtype=...): `F32` (the default: f32 within a process, across processes as
`set_gradient_compression!` says) or `BF16` (every replica's bucket rounded to bf16 and the whole reduction carried in
bf16, within and across the processes, the result widened to f32 for clipping and the optimizer).
`ERR_INVALID_ARGUMENT` for another dtype, `ERR_NOT_SUPPORTED` where the processes' link does not move bf16, the engine
unchanged. Every process sets the same."""
function set_reduce_dtype!(e::Engine, dtype::Integer)
    h, v = e.ptr, Int32(dtype)
    engine_call(() -> ccall((:dpar_engine_set_reduce_dtype, libdpar), Int32, (Ptr{Cvoid}, Int32), h, v), e)
end
"""`reduce_dtype(engine)`: the dtype `set_reduce_dtype!` set (`F32` or `BF16`)."""
function reduce_dtype(e::Engine)
    out = Ref{Int32}(0)
    op, h = Base.unsafe_convert(Ptr{Int32}, out), e.ptr
    engine_call(() -> ccall((:dpar_engine_reduce_dtype, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), op, h), e, out)
    out[]
end
"""`set_reproducible!(engine, micro_chunk_rows)`: the reproducible mode (`dpar_engine_set_reproducible`):
`train_step!` cuts each batch into micro-chunks of `micro_chunk_rows` rows and sums their gradients exactly, so that
the same seed and global batches give the same bits on any number of CPU devices and processes; 0 turns it off.
`ERR_INVALID_ARGUMENT` for a negative count, `ERR_INVALID_STATE` while gradients are pending, `ERR_NOT_SUPPORTED` on
GPUs and for a model with BatchNorm, the engine unchanged. Every process sets the same."""
function set_reproducible!(e::Engine, micro_chunk_rows::Integer)
    h, v = e.ptr, Int64(micro_chunk_rows)
    engine_call(() -> ccall((:dpar_engine_set_reproducible, libdpar), Int32, (Ptr{Cvoid}, Int64), h, v), e)
end
"""`reproducible(engine)`: the rows per micro-chunk `set_reproducible!` set (0: off)."""
function reproducible(e::Engine)
    out = Ref{Int64}(0)
    op, h = Base.unsafe_convert(Ptr{Int64}, out), e.ptr
    engine_call(() -> ccall((:dpar_engine_reproducible, libdpar), Int32, (Ptr{Int64}, Ptr{Cvoid}), op, h), e, out)
    out[]
end
"""`set_allow_tf32!(engine, allow)`: lets f32 GEMMs and convolutions use TF32 where the devices have it (off by
default); returns whether they have it (CPU devices: false)."""
function set_allow_tf32!(e::Engine, allow::Bool)
    has = Ref{Int32}(0)
    hp, h, v = Base.unsafe_convert(Ptr{Int32}, has), e.ptr, Int32(allow)
    engine_call(() -> ccall((:dpar_engine_set_allow_tf32, libdpar), Int32, (Ptr{Cvoid}, Int32, Ptr{Int32}), h, v, hp),
                e, has)
    has[] != 0
end
"""`set_loss_scaling!(engine, init_scale; growth_factor=2, backoff_factor=0.5, growth_interval=2000)`: dynamic loss
scaling from the next step on, as torch.amp.GradScaler; `init_scale` 0 turns it off (PyTorch's default: 65536). A
step whose scaled gradient holds inf or NaN is skipped on every replica and backs the scale off."""
function set_loss_scaling!(e::Engine, init_scale::Real; growth_factor::Real=2.0, backoff_factor::Real=0.5,
                           growth_interval::Integer=2000)
    h, s, g, b, n = e.ptr, Cfloat(init_scale), Cfloat(growth_factor), Cfloat(backoff_factor), Int64(growth_interval)
    engine_call(() -> ccall((:dpar_engine_set_loss_scaling, libdpar), Int32,
                            (Ptr{Cvoid}, Cfloat, Cfloat, Cfloat, Int64), h, s, g, b, n), e)
end
"""`loss_scale(engine)`: the current loss scale; 1 with loss scaling off."""
function loss_scale(e::Engine)
    out = Ref{Cfloat}(0)
    op, h = Base.unsafe_convert(Ptr{Cfloat}, out), e.ptr
    engine_call(() -> ccall((:dpar_engine_loss_scale, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}), op, h), e, out)
    out[]
end
"""`last_step_skipped(engine)`: whether the last step taken with loss scaling on was skipped (its gradient held inf
or NaN)."""
function last_step_skipped(e::Engine)
    out = Ref{Int32}(0)
    op, h = Base.unsafe_convert(Ptr{Int32}, out), e.ptr
    engine_call(() -> ccall((:dpar_engine_last_step_skipped, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), op, h), e, out)
    out[] != 0
end
"""`grad_norm(engine)`: the gradient's norm before clipping at the last step taken with clipping on (NaN before any)."""
function grad_norm(e::Engine)
    out = Ref{Cfloat}(0)
    op, h = Base.unsafe_convert(Ptr{Cfloat}, out), e.ptr
    engine_call(() -> ccall((:dpar_engine_grad_norm, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}), op, h), e, out)
    out[]
end
"""`set_training!(engine, on)`: training mode (dropout active) or eval mode; engines start in training mode."""
function set_training!(e::Engine, on::Bool)
    h, v = e.ptr, Int32(on)
    engine_call(() -> ccall((:dpar_engine_set_training, libdpar), Int32, (Ptr{Cvoid}, Int32), h, v), e)
end
# A path as a C string, converted before the GC-safe call (the conversion checks for NUL bytes and may throw).
function path_call(f, e::Engine, path::AbstractString)
    c = Base.cconvert(Cstring, path)
    GC.@preserve c begin
        h, p = e.ptr, Base.unsafe_convert(Cstring, c)
        engine_call(() -> f(h, p), e, c)
    end
end
save(e::Engine, path::AbstractString) =
    path_call(e, path) do h, p
        ccall((:dpar_engine_save, libdpar), Int32, (Ptr{Cvoid}, Cstring), h, p)
    end
load(e::Engine, path::AbstractString) =
    path_call(e, path) do h, p
        ccall((:dpar_engine_load, libdpar), Int32, (Ptr{Cvoid}, Cstring), h, p)
    end
abort(e::Engine) = check(ccall((:dpar_engine_abort, libdpar), Int32, (Ptr{Cvoid},), e.ptr))
"""`trace_start!(engine)`: records a timeline of the engine's calls (each replica's worker and communication
thread, span by span), forgetting one recorded before."""
function trace_start!(e::Engine)
    h = e.ptr
    engine_call(() -> ccall((:dpar_engine_trace_start, libdpar), Int32, (Ptr{Cvoid},), h), e)
end
"""`trace_stop!(engine, path=nothing)`: stops recording and writes the timeline to `path` in Chrome's trace event
format (ui.perfetto.dev), atomically; `nothing` only stops. The timeline stays until the next `trace_start!`."""
function trace_stop!(e::Engine, path::Union{AbstractString,Nothing}=nothing)
    path === nothing || return path_call(e, path) do h, p
        ccall((:dpar_engine_trace_stop, libdpar), Int32, (Ptr{Cvoid}, Cstring), h, p)
    end
    h = e.ptr
    engine_call(e) do
        ccall((:dpar_engine_trace_stop, libdpar), Int32, (Ptr{Cvoid}, Cstring), h, C_NULL)
    end
end

"""Replica `replica`'s parameters (from 0), flattened."""
function params(e::Engine, replica::Integer, count::Integer)
    v = zeros(Float32, count)
    vp, h, r, n = pointer(v), e.ptr, Csize_t(replica), Csize_t(count)
    engine_call(e, v) do
        ccall((:dpar_engine_get_params, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Csize_t, Csize_t), vp, h, r, n)
    end
    v
end

"""`memory_stats(engine, replica)`: `(allocated_bytes=..., peak_bytes=...)`, what replica `replica`'s (from 0) device
holds of dpar's tensors (parameters, gradients, optimizer state, activations, scratch) now, and the most it held at
once since the process started or the device's last `reset_peak_memory!` (`dpar_engine_memory_stats`; torch.cuda's
memory_allocated and max_memory_allocated). The count is the device's: replicas and engines on one device count
together. `ERR_INVALID_ARGUMENT` for a replica out of range."""
function memory_stats(e::Engine, replica::Integer)
    a, p = Ref{Int64}(0), Ref{Int64}(0)
    ap, pp, h, r = Base.unsafe_convert(Ptr{Int64}, a), Base.unsafe_convert(Ptr{Int64}, p), e.ptr, Csize_t(replica)
    engine_call(e, a, p) do
        ccall((:dpar_engine_memory_stats, libdpar), Int32, (Ptr{Int64}, Ptr{Int64}, Ptr{Cvoid}, Csize_t), ap, pp, h, r)
    end
    (allocated_bytes=a[], peak_bytes=p[])
end

"""`reset_peak_memory!(engine, replica)`: starts the peak of replica `replica`'s device again from what it holds now,
for every engine on that device (`dpar_engine_reset_peak_memory`)."""
function reset_peak_memory!(e::Engine, replica::Integer)
    h, r = e.ptr, Csize_t(replica)
    engine_call(() -> ccall((:dpar_engine_reset_peak_memory, libdpar), Int32, (Ptr{Cvoid}, Csize_t), h, r), e)
end

"""`buffer(engine, model, replica, index)`: a replica's buffer `index` (from 0) of `model`, the model the engine was
built from (for its element type and shape), flattened."""
function buffer(e::Engine, m::Model, replica::Integer, index::Integer)
    _, T, shape = buffer_info(m, index)
    v = zeros(T, prod(shape))
    vp, h, r, i, n = Ptr{Cvoid}(pointer(v)), e.ptr, Csize_t(replica), Csize_t(index), Csize_t(length(v))
    engine_call(e, v) do
        ccall((:dpar_engine_get_buffer, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Csize_t, Csize_t),
              vp, h, r, i, n)
    end
    v
end

function accumulate!(e::Engine, input::Tensor, target::Tensor)
    l = Ref{Cfloat}(0)
    lp, h, x, y = Base.unsafe_convert(Ptr{Cfloat}, l), e.ptr, input.ptr, target.ptr
    engine_call(e, l, input, target) do
        ccall((:dpar_engine_accumulate, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
              lp, h, x, y)
    end
    l[]
end
function step!(e::Engine)
    h = e.ptr
    engine_call(() -> ccall((:dpar_engine_step, libdpar), Int32, (Ptr{Cvoid},), h), e)
end
function zero_grad!(e::Engine)
    h = e.ptr
    engine_call(() -> ccall((:dpar_engine_zero_grad, libdpar), Int32, (Ptr{Cvoid},), h), e)
end
"""
    backward!(engine, grad_output)

DataParallel's backward from dL/d(output) of the last training-mode `forward`: a `Tensor` or an array shaped as
the output (`out x batch` for dpar's `(batch, out)`), an array being copied as Float32. `step!` then synchronises
the gradients and steps.
"""
function backward!(e::Engine, grad_output::Tensor)
    h, g = e.ptr, grad_output.ptr
    engine_call(() -> ccall((:dpar_engine_backward, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}), h, g), e, grad_output)
end
backward!(e::Engine, grad_output::AbstractArray{<:Real}) = backward!(e, Tensor(convert(Array{Float32}, grad_output)))
function inject_fault!(e::Engine, replica::Integer, fault::Integer)
    h, r, f = e.ptr, Csize_t(replica), Int32(fault)
    engine_call(() -> ccall((:dpar_engine_inject_fault, libdpar), Int32, (Ptr{Cvoid}, Csize_t, Int32), h, r, f), e)
end

function num_buckets(e::Engine)
    n = Ref{Csize_t}(0)
    np, h = Base.unsafe_convert(Ptr{Csize_t}, n), e.ptr
    engine_call(e, n) do
        ccall((:dpar_engine_num_buckets, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), np, h)
    end
    Int(n[])
end

"""(rank, size) of this process among those the engine spans (rank from 0)."""
function processes(e::Engine)
    r, s = Ref{Csize_t}(0), Ref{Csize_t}(0)
    rp, sp, h = Base.unsafe_convert(Ptr{Csize_t}, r), Base.unsafe_convert(Ptr{Csize_t}, s), e.ptr
    engine_call(e, r, s) do
        ccall((:dpar_engine_processes, libdpar), Int32, (Ptr{Csize_t}, Ptr{Csize_t}, Ptr{Cvoid}), rp, sp, h)
    end
    (Int(r[]), Int(s[]))
end

"""How gradient buckets travel between the processes: "" for one process, "mpi", "nccl", or
"mpi through host memory (...)" saying why NCCL could not be used."""
function process_transport(e::Engine)
    h = e.ptr
    t = blocking(e) do
        ccall((:dpar_engine_process_transport, libdpar), Cstring, (Ptr{Cvoid},), h)
    end
    t == C_NULL && check(ERR_INVALID_ARGUMENT)
    unsafe_string(t)
end

function replica_device(e::Engine, replica::Integer)
    d = Ref(DparDevice(0, 0))
    dp, h, r = Base.unsafe_convert(Ptr{DparDevice}, d), e.ptr, Csize_t(replica)
    engine_call(e, d) do
        ccall((:dpar_engine_replica_device, libdpar), Int32, (Ptr{DparDevice}, Ptr{Cvoid}, Csize_t), dp, h, r)
    end
    d[]
end

function split(e::Engine, batch::Integer)
    v = zeros(Csize_t, num_replicas(e))
    vp, h, b, n = pointer(v), e.ptr, Csize_t(batch), Csize_t(length(v))
    engine_call(e, v) do
        ccall((:dpar_engine_split, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}, Csize_t, Csize_t), vp, h, b, n)
    end
    Int.(v)
end

function replica_losses(e::Engine)
    v = zeros(Float32, num_replicas(e))
    vp, h, n = pointer(v), e.ptr, Csize_t(length(v))
    engine_call(e, v) do
        ccall((:dpar_engine_replica_losses, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Csize_t), vp, h, n)
    end
    v
end

"""A host tensor's memory as a Julia array, without a copy (dimensions reversed); valid while `t` is open."""
function unsafe_data(t::Tensor)
    dt, _, _ = info(t)
    p = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_tensor_data, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}), p, t.ptr))
    unsafe_wrap(Array, Ptr{dt == F32 ? Float32 : Int32}(p[]), reverse(size(t)))
end

# The hook runs on dpar's worker threads, outside Julia's tasks: only Julia 1.9+ (foreign threads adopted) may
# run Julia code there. The C trampoline receives the closure as its payload.
function hook_trampoline(payload::Ptr{Cvoid}, replica::Csize_t, in_shape::Ptr{Int64}, in_ndim::Csize_t,
                         out_shape::Ptr{Int64}, out_ndim::Csize_t)::Int32
    f = unsafe_pointer_to_objref(payload)[]
    try
        f(Int(replica), Tuple(unsafe_wrap(Array, in_shape, in_ndim)), Tuple(unsafe_wrap(Array, out_shape, out_ndim)))
        return OK
    catch err
        status = err isa DparError ? err.status : ERR_INTERNAL
        msg = err isa DparError ? err.message : sprint(showerror, err)
        return ccall((:dpar_set_error, libdpar), Int32, (Int32, Cstring), status, msg)
    end
end

"""Installs `f(replica, input_shape, output_shape)` as the forward hook (`nothing` removes it). An exception
fails the engine call with its message. Needs Julia 1.9 or later (dpar's worker threads call it)."""
function set_forward_hook!(e::Engine, f)
    tramp = @cfunction(hook_trampoline, Int32, (Ptr{Cvoid}, Csize_t, Ptr{Int64}, Csize_t, Ptr{Int64}, Csize_t))
    if f === nothing
        h = e.ptr
        engine_call(e) do  # waits for a step in flight, whose workers may be running the hook
            ccall((:dpar_engine_set_forward_hook, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
                  h, C_NULL, C_NULL, C_NULL)
        end
        e.hook = nothing
    else
        box = Ref{Any}(f)  # rooted by the engine object, which outlives its hook: no destroy needed
        e.hook = box
        h, payload = e.ptr, pointer_from_objref(box)
        engine_call(e, box) do
            ccall((:dpar_engine_set_forward_hook, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
                  h, tramp, payload, C_NULL)
        end
    end
    nothing
end

# ---- Collectives -------------------------------------------------------------------------------------------

const F64 = Int32(5)
const I64 = Int32(6)

"""The element types the collectives move: `Float32`, `Float64`, `Int32` and `Int64`."""
const CommType = Union{Float32,Float64,Int32,Int64}

comm_dtype(::Type{Float32}) = F32
comm_dtype(::Type{Float64}) = F64
comm_dtype(::Type{Int32}) = I32
comm_dtype(::Type{Int64}) = I64

"""
    ReduceOp

The reductions: `Dpar.SUM`, `Dpar.MEAN` (the sum divided by the number of participants, truncated toward zero for
integers), `Dpar.MAX` and `Dpar.MIN`. Wherever an `op` is taken, Base's `+`, `max` and `min` name `SUM`, `MAX`
and `MIN` too.
"""
@enum ReduceOp::Int32 begin
    SUM = 0   # DPAR_SUM
    MEAN = 1  # DPAR_MEAN
    MAX = 2   # DPAR_MAX
    MIN = 3   # DPAR_MIN
end

reduce_op(op::ReduceOp) = Int32(op)
reduce_op(::typeof(+)) = Int32(SUM)
reduce_op(::typeof(max)) = Int32(MAX)
reduce_op(::typeof(min)) = Int32(MIN)

# Runs `f()`, the ccall of a dpar call that waits for other participants (a collective, a wait, a free that waits
# for work in flight), in GC-safe state, keeping `roots` (the handle's object, the arrays dpar reads and writes)
# alive until it returns. Julia's GC stops every thread at a safepoint first, and a thread blocked inside dpar
# reaches none: a member that collects garbage while another member waits for it in a collective would wait for
# that member, which waits for it, until dpar's timeout. In GC-safe state nothing may allocate or touch Julia
# objects, so `f` makes the ccall alone, on arguments already converted to pointers and integers.
@inline function blocking(f, roots...)
    GC.@preserve roots begin
        state = ccall(:jl_gc_safe_enter, Int8, ())
        result = f()
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), state)
        result
    end
end

struct CommOptions  # dpar_comm_options, version 1
    size::Csize_t
    version::UInt32
    timeout_seconds::Cdouble
end
const COMM_OPTIONS_VERSION = UInt32(1)

# dpar's defaults, or the given timeout, as this struct's version: a newer library reads only the fields it has.
function comm_options(timeout_seconds::Union{Real,Nothing})
    o = Ref(CommOptions(0, 0, 0))
    check(ccall((:dpar_comm_options_init_sized, libdpar), Int32, (Ptr{CommOptions}, Csize_t), o, sizeof(CommOptions)))
    Ref(CommOptions(sizeof(CommOptions), COMM_OPTIONS_VERSION,
                    timeout_seconds === nothing ? o[].timeout_seconds : timeout_seconds))
end

# `T(args...) do x ... end`: x is closed at the end of the block.
function closing(f, x)
    try
        f(x)
    finally
        close(x)
    end
end

"""
    CommGroup(size; timeout_seconds=300)
    CommGroup(devices; streams=nothing, timeout_seconds=300)
    CommGroup(f, args...; kwargs...)

The participants of a group inside this process: one task each (on a thread of its own: a participant blocks its
thread inside dpar until the others arrive), sharing memory. [`member`](@ref) gives each its [`Comm`](@ref). A
participant waits `timeout_seconds` for the others at each step of a collective, then throws `ERR_TIMEOUT` naming
the one that did not come. The members keep the group alive: close it and them in any order. The `do`-block form
closes the group at the end of the block.

The second form puts participant r's buffers in the memory of `devices[r + 1]` (`DparDevice`s or names such as
"cuda:0", all of one kind), for a framework that keeps its tensors on the GPU: the members' collectives and
reducers then take device memory through their `Ptr` methods. On GPUs participant r's collectives are ordered on
`streams[r + 1]`, a `cudaStream_t` as a `Ptr{Cvoid}` (`nothing` or `C_NULL`, or no `streams`: the legacy default
stream), which must outlive the members. Over CPU devices it is the first form's group, host memory and no streams.
"""
mutable struct CommGroup
    ptr::Ptr{Cvoid}
    CommGroup(ptr::Ptr{Cvoid}) = finalizer(close, new(ptr))
end

function CommGroup(n::Integer; timeout_seconds::Union{Real,Nothing}=nothing)
    o = comm_options(timeout_seconds)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_comm_group_create, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Csize_t, Ptr{CommOptions}), out, n, o))
    CommGroup(out[])
end

function CommGroup(devices::AbstractVector; streams::Union{AbstractVector,Nothing}=nothing,
                   timeout_seconds::Union{Real,Nothing}=nothing)
    devs = DparDevice[d isa AbstractString ? parse_device(d) : d for d in devices]
    if streams !== nothing && length(streams) != length(devs)
        throw(DparError(ERR_INVALID_ARGUMENT, "streams: $(length(streams)) streams for $(length(devs)) devices"))
    end
    ptrs = streams === nothing ? Ptr{Cvoid}[] : Ptr{Cvoid}[s === nothing ? C_NULL : s for s in streams]
    o = comm_options(timeout_seconds)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    GC.@preserve ptrs check(ccall((:dpar_comm_group_create_on_devices, libdpar), Int32,
                                  (Ptr{Ptr{Cvoid}}, Ptr{DparDevice}, Ptr{Ptr{Cvoid}}, Csize_t, Ptr{CommOptions}),
                                  out, devs, streams === nothing ? C_NULL : pointer(ptrs), length(devs), o))
    CommGroup(out[])
end

CommGroup(f::Function, args...; kwargs...) = closing(f, CommGroup(args...; kwargs...))

function Base.close(g::CommGroup)
    g.ptr == C_NULL && return
    ccall((:dpar_comm_group_free, libdpar), Cvoid, (Ptr{Cvoid},), g.ptr)
    g.ptr = C_NULL
end

"""
    Comm

One participant of a group: a [`member`](@ref) of a [`CommGroup`](@ref), or this process among those of an MPI
job ([`mpi_comm`](@ref)). A participant's calls must not overlap (one task drives it), except [`abort`](@ref) and
[`async_error`](@ref), which any task may call at any time. `close` frees it, after its asynchronous work has
finished.

Its collectives take `Array`s of `Float32`, `Float64`, `Int32` or `Int64` (host memory), or for memory of the
communicator's device ([`device`](@ref); a group made on devices, see [`CommGroup`](@ref)) a `Ptr{T}` and an
element count: for a CUDA.jl `CuArray` `x`, `reinterpret(Ptr{Float32}, pointer(x))`, kept alive by the caller
(`GC.@preserve`) until the call returns, or until the asynchronous work completes. Every participant calls the
same collectives in the same order with the same lengths, element type, op and root; a participant that differs
makes each throw `DparError` with `ERR_MISMATCH` naming it.
"""
mutable struct Comm
    ptr::Ptr{Cvoid}
    Comm(ptr::Ptr{Cvoid}) = finalizer(close, new(ptr))
end

"""`member(group, rank)`: participant `rank`'s [`Comm`](@ref) (ranks from 0, as dpar and MPI number them), for the
task that plays it."""
function member(g::CommGroup, rank::Integer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_comm_group_member, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Csize_t), out, g.ptr, rank))
    Comm(out[])
end

"""`mpi_comm(; timeout_seconds=300)`: this process's [`Comm`](@ref) over MPI_COMM_WORLD (MPI is started if the
program has not; without mpirun the process is rank 0 of 1). Every process of the job calls it."""
function mpi_comm(; timeout_seconds::Union{Real,Nothing}=nothing)
    o = comm_options(timeout_seconds)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    outp, op = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, out), Base.unsafe_convert(Ptr{CommOptions}, o)
    check(blocking(out, o) do
        ccall((:dpar_comm_create_mpi, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{CommOptions}), outp, op)
    end)
    Comm(out[])
end

function Base.close(c::Comm)
    c.ptr == C_NULL && return
    h = c.ptr
    c.ptr = C_NULL
    blocking(c) do
        ccall((:dpar_comm_free, libdpar), Cvoid, (Ptr{Cvoid},), h)
    end
    nothing
end

function comm_info(c::Comm)
    r, n = Ref{Csize_t}(0), Ref{Csize_t}(0)
    check(ccall((:dpar_comm_info, libdpar), Int32, (Ptr{Csize_t}, Ptr{Csize_t}, Ptr{Cvoid}), r, n, c.ptr))
    (Int(r[]), Int(n[]))
end

"""`rank(comm)`: this participant's rank, from 0."""
rank(c::Comm) = comm_info(c)[1]

"""`nranks(comm)`: the number of participants in the communicator's group."""
nranks(c::Comm) = comm_info(c)[2]

"""`device(comm)`: the `DparDevice` whose memory the buffers are: the participant's device in a group made on
devices, cpu:0 (host memory) for every other communicator."""
function device(c::Comm)
    d = Ref(DparDevice(0, 0))
    check(ccall((:dpar_comm_device, libdpar), Int32, (Ptr{DparDevice}, Ptr{Cvoid}), d, c.ptr))
    d[]
end

"""`abort(comm, reason="")`: aborts the group from this participant: every participant waiting in a collective,
or calling one later, throws `ERR_REMOTE` naming this one and `reason`. Any task may call it at any time. The
communicator can run no collective afterwards; close it as usual."""
abort(c::Comm, reason::AbstractString="") =
    check(ccall((:dpar_comm_abort, libdpar), Int32, (Ptr{Cvoid}, Cstring), c.ptr, reason))

"""`async_error(comm)`: `nothing` while the communicator is usable, else the `DparError` its next collective would
throw (an abort, a participant that gave up, failed asynchronous work). Never blocks; any task may call it."""
function async_error(c::Comm)
    s = Ref{Int32}(OK)
    check(ccall((:dpar_comm_get_async_error, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), s, c.ptr))
    s[] == OK ? nothing : take_error(s[])
end

same_length(got::Integer, expected::Integer, what::AbstractString) =
    got == expected || throw(DparError(ERR_INVALID_ARGUMENT, "$what: $got elements, expected $expected"))

"""
    all_reduce!(comm, recv, send; op=SUM) -> recv
    all_reduce!(comm, buffer; op=SUM) -> buffer
    all_reduce!(comm, recv::Ptr{T}, send::Ptr{T}, count; op=SUM)
    all_reduce!(comm, buffer::Ptr{T}, count; op=SUM)

Reduces every participant's `send` element-wise with `op` (a [`ReduceOp`](@ref), or `+`, `max`, `min`) into every
participant's `recv`, an array of the same length; the two-argument forms work in place.
"""
function all_reduce! end

function all_reduce!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer; op=SUM) where {T<:CommType}
    h, n, dt, o = c.ptr, Csize_t(count), comm_dtype(T), reduce_op(op)
    check(blocking(c) do
        ccall((:dpar_comm_all_reduce, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Int32),
              h, send, recv, n, dt, o)
    end)
end

all_reduce!(c::Comm, buffer::Ptr{T}, count::Integer; op=SUM) where {T<:CommType} =
    all_reduce!(c, buffer, buffer, count; op=op)

function all_reduce!(c::Comm, recv::Array{T}, send::Array{T}; op=SUM) where {T<:CommType}
    same_length(length(recv), length(send), "recv")
    GC.@preserve recv send all_reduce!(c, pointer(recv), pointer(send), length(send); op=op)
    recv
end

all_reduce!(c::Comm, buffer::Array{<:CommType}; op=SUM) = all_reduce!(c, buffer, buffer; op=op)

"""
    Dpar.broadcast!(comm, buffer; root=0) -> buffer
    Dpar.broadcast!(comm, buffer::Ptr{T}, count; root=0)

Copies participant `root`'s `buffer` into every participant's. Not exported, since `using Dpar` would make it
ambiguous with `Base.broadcast!`: call it as `Dpar.broadcast!`.
"""
function broadcast! end

function broadcast!(c::Comm, buffer::Ptr{T}, count::Integer; root::Integer=0) where {T<:CommType}
    h, n, dt, r = c.ptr, Csize_t(count), comm_dtype(T), Csize_t(root)
    check(blocking(c) do
        ccall((:dpar_comm_broadcast, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Csize_t),
              h, buffer, n, dt, r)
    end)
end

function broadcast!(c::Comm, buffer::Array{T}; root::Integer=0) where {T<:CommType}
    GC.@preserve buffer broadcast!(c, pointer(buffer), length(buffer); root=root)
    buffer
end

"""
    reduce!(comm, recv, send; op=SUM, root=0) -> recv
    reduce!(comm, recv::Ptr{T}, send::Ptr{T}, count; op=SUM, root=0)

Reduces every participant's `send` element-wise with `op` into participant `root`'s `recv`. Elsewhere `recv` is
left as it is, and may be `nothing` (a null `Ptr`).
"""
function reduce! end

function reduce!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer; op=SUM, root::Integer=0) where {T<:CommType}
    h, n, dt, o, r = c.ptr, Csize_t(count), comm_dtype(T), reduce_op(op), Csize_t(root)
    check(blocking(c) do
        ccall((:dpar_comm_reduce, libdpar), Int32,
              (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Int32, Csize_t), h, send, recv, n, dt, o, r)
    end)
end

function reduce!(c::Comm, recv::Union{Array{T},Nothing}, send::Array{T}; op=SUM, root::Integer=0) where {T<:CommType}
    recv === nothing || same_length(length(recv), length(send), "recv")
    GC.@preserve recv send reduce!(c, recv === nothing ? Ptr{T}(C_NULL) : pointer(recv), pointer(send),
                                   length(send); op=op, root=root)
    recv
end

"""
    all_gather!(comm, recv, send) -> recv
    all_gather!(comm, recv::Ptr{T}, send::Ptr{T}, count)

Every participant's `send` into every participant's `recv`, in rank order: `recv` holds `nranks(comm)` times
`length(send)` elements (a `length(send) x nranks(comm)` matrix gets participant r's in column r + 1). The `Ptr`
method's `count` is the elements of `send`.
"""
function all_gather! end

function all_gather!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer) where {T<:CommType}
    h, n, dt = c.ptr, Csize_t(count), comm_dtype(T)
    check(blocking(c) do
        ccall((:dpar_comm_all_gather, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32),
              h, send, recv, n, dt)
    end)
end

function all_gather!(c::Comm, recv::Array{T}, send::Array{T}) where {T<:CommType}
    same_length(length(recv), length(send) * nranks(c), "recv")
    GC.@preserve recv send all_gather!(c, pointer(recv), pointer(send), length(send))
    recv
end

"""
    reduce_scatter!(comm, recv, send; op=SUM) -> recv
    reduce_scatter!(comm, recv::Ptr{T}, send::Ptr{T}, count; op=SUM)

Reduces every participant's `send` (`nranks(comm)` blocks of `length(recv)` elements, in rank order) element-wise
with `op`; participant r receives block r in `recv`. The `Ptr` method's `count` is the elements of `recv`.
"""
function reduce_scatter! end

function reduce_scatter!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer; op=SUM) where {T<:CommType}
    h, n, dt, o = c.ptr, Csize_t(count), comm_dtype(T), reduce_op(op)
    check(blocking(c) do
        ccall((:dpar_comm_reduce_scatter, libdpar), Int32,
              (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Int32), h, send, recv, n, dt, o)
    end)
end

function reduce_scatter!(c::Comm, recv::Array{T}, send::Array{T}; op=SUM) where {T<:CommType}
    same_length(length(send), length(recv) * nranks(c), "send")
    GC.@preserve recv send reduce_scatter!(c, pointer(recv), pointer(send), length(recv); op=op)
    recv
end

"""`barrier(comm)`: returns once every participant has entered it."""
function barrier(c::Comm)
    h = c.ptr
    check(blocking(c) do
        ccall((:dpar_comm_barrier, libdpar), Int32, (Ptr{Cvoid},), h)
    end)
end

# ---- Asynchronous work -------------------------------------------------------------------------------------

"""
    Work

An asynchronous collective, started by [`all_reduce_async!`](@ref), [`broadcast_async!`](@ref),
[`all_gather_async!`](@ref) or [`reduce_scatter_async!`](@ref) on the communicator's own thread. The collectives
started on one communicator run in the order they were started.

`wait(work)` waits for it, and throws its `DparError` if it failed; `isready(work)` says, without blocking, whether
it has finished (successfully or not); `close(work)` frees it, waiting first if it still runs. The arrays it reads
and writes are held by the `Work` until `wait` or `close` (so that dropping them cannot free them under dpar), and
must be neither read, written nor resized before it has finished. Wait for or close every `Work`: its finalizer
waits too, stalling whichever task the garbage collector happens to run it on.
"""
mutable struct Work
    ptr::Ptr{Cvoid}
    buffers::Any  # the arrays dpar reads and writes until the work has finished; nothing for pointers
    Work(ptr::Ptr{Cvoid}) = finalizer(close, new(ptr, nothing))
end

function Base.wait(w::Work)
    h = w.ptr
    status = blocking(w) do
        ccall((:dpar_work_wait, libdpar), Int32, (Ptr{Cvoid},), h)
    end
    w.buffers = nothing  # finished, successfully or not: dpar is done with them
    check(status)
end

function Base.isready(w::Work)
    done = Ref{Int32}(0)
    check(ccall((:dpar_work_test, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), done, w.ptr))
    done[] != 0
end

function Base.close(w::Work)
    w.ptr == C_NULL && return
    h = w.ptr
    w.ptr = C_NULL
    blocking(w) do
        ccall((:dpar_work_free, libdpar), Cvoid, (Ptr{Cvoid},), h)
    end
    w.buffers = nothing
    nothing
end

# The Work of an asynchronous start, `start(out)`, which writes its handle through `out`.
function start_work(start)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(start(out))
    Work(out[])
end

# `w`, holding `buffers` until it finishes: called inside the GC.@preserve of the arrays whose pointers started it.
function holding(w::Work, buffers...)
    w.buffers = buffers
    w
end

"""
    all_reduce_async!(comm, recv, send; op=SUM) -> Work
    all_reduce_async!(comm, buffer; op=SUM) -> Work
    all_reduce_async!(comm, recv::Ptr{T}, send::Ptr{T}, count; op=SUM) -> Work
    all_reduce_async!(comm, buffer::Ptr{T}, count; op=SUM) -> Work

[`all_reduce!`](@ref) on the communicator's thread: returns at once with the [`Work`](@ref).
"""
function all_reduce_async! end

function all_reduce_async!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer; op=SUM) where {T<:CommType}
    start_work() do out
        ccall((:dpar_comm_all_reduce_async, libdpar), Int32,
              (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Int32),
              out, c.ptr, send, recv, count, comm_dtype(T), reduce_op(op))
    end
end

all_reduce_async!(c::Comm, buffer::Ptr{T}, count::Integer; op=SUM) where {T<:CommType} =
    all_reduce_async!(c, buffer, buffer, count; op=op)

function all_reduce_async!(c::Comm, recv::Array{T}, send::Array{T}; op=SUM) where {T<:CommType}
    same_length(length(recv), length(send), "recv")
    GC.@preserve recv send holding(all_reduce_async!(c, pointer(recv), pointer(send), length(send); op=op),
                                   recv, send)
end

all_reduce_async!(c::Comm, buffer::Array{<:CommType}; op=SUM) = all_reduce_async!(c, buffer, buffer; op=op)

"""
    broadcast_async!(comm, buffer; root=0) -> Work
    broadcast_async!(comm, buffer::Ptr{T}, count; root=0) -> Work

[`Dpar.broadcast!`](@ref) on the communicator's thread: returns at once with the [`Work`](@ref).
"""
function broadcast_async! end

function broadcast_async!(c::Comm, buffer::Ptr{T}, count::Integer; root::Integer=0) where {T<:CommType}
    start_work() do out
        ccall((:dpar_comm_broadcast_async, libdpar), Int32,
              (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Csize_t),
              out, c.ptr, buffer, count, comm_dtype(T), root)
    end
end

function broadcast_async!(c::Comm, buffer::Array{T}; root::Integer=0) where {T<:CommType}
    GC.@preserve buffer holding(broadcast_async!(c, pointer(buffer), length(buffer); root=root), buffer)
end

"""
    all_gather_async!(comm, recv, send) -> Work
    all_gather_async!(comm, recv::Ptr{T}, send::Ptr{T}, count) -> Work

[`all_gather!`](@ref) on the communicator's thread: returns at once with the [`Work`](@ref).
"""
function all_gather_async! end

function all_gather_async!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer) where {T<:CommType}
    start_work() do out
        ccall((:dpar_comm_all_gather_async, libdpar), Int32,
              (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32),
              out, c.ptr, send, recv, count, comm_dtype(T))
    end
end

function all_gather_async!(c::Comm, recv::Array{T}, send::Array{T}) where {T<:CommType}
    same_length(length(recv), length(send) * nranks(c), "recv")
    GC.@preserve recv send holding(all_gather_async!(c, pointer(recv), pointer(send), length(send)), recv, send)
end

"""
    reduce_scatter_async!(comm, recv, send; op=SUM) -> Work
    reduce_scatter_async!(comm, recv::Ptr{T}, send::Ptr{T}, count; op=SUM) -> Work

[`reduce_scatter!`](@ref) on the communicator's thread: returns at once with the [`Work`](@ref).
"""
function reduce_scatter_async! end

function reduce_scatter_async!(c::Comm, recv::Ptr{T}, send::Ptr{T}, count::Integer; op=SUM) where {T<:CommType}
    start_work() do out
        ccall((:dpar_comm_reduce_scatter_async, libdpar), Int32,
              (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Csize_t, Int32, Int32),
              out, c.ptr, send, recv, count, comm_dtype(T), reduce_op(op))
    end
end

function reduce_scatter_async!(c::Comm, recv::Array{T}, send::Array{T}; op=SUM) where {T<:CommType}
    same_length(length(send), length(recv) * nranks(c), "send")
    GC.@preserve recv send holding(reduce_scatter_async!(c, pointer(recv), pointer(send), length(recv); op=op),
                                   recv, send)
end

# ---- The gradient reducer ----------------------------------------------------------------------------------

struct ReducerOptions  # dpar_reducer_options, version 2
    size::Csize_t
    version::UInt32
    first_bucket_bytes::Csize_t
    bucket_cap_bytes::Csize_t
    op::Int32
    processes::Ptr{Cvoid}  # a dpar_comm
    compression::Int32
end
const REDUCER_OPTIONS_VERSION = UInt32(2)

"""
    Reducer(comm, grads; first_bucket_bytes=nothing, bucket_cap_bytes=nothing, op=MEAN, processes=nothing,
            compression=COMPRESSION_NONE)
    Reducer(comm, grads::AbstractVector{Ptr{Float32}}, counts; kwargs...)
    Reducer(f, comm, grads...; kwargs...)

DDP's gradient reducer over `comm`, for a program with its own autograd: register the gradient buffers once, in
the model's forward order (`Array{Float32}`s, held by the reducer until it is closed; or, for memory of the
communicator's device, pointers with their element counts, kept valid by the caller until `close`). Every
participant registers the same sizes in the same order. Each step, mark each buffer with [`grad_ready!`](@ref) as
soon as it holds its gradient: buckets of gradients (the last ones first, closing at `first_bucket_bytes`, then at
`bucket_cap_bytes`; `nothing`: dpar's 1 MiB and 25 MiB) are reduced on the communicator's thread while backward
goes on. `wait(reducer)` ends the step: every buffer then holds the `op` (`SUM`, or `MEAN` over the participants)
of the participants' gradients, a gradient never marked in the step counting as zeros. Between a step's first
`grad_ready!` and its `wait`, a marked buffer must not be written, and the communicator must not run other
collectives. Several tasks may call one reducer (dpar serialises the calls), as backward hooks on several threads
do. `close` frees the reducer after its buckets in flight; the `do`-block form closes it at the end.

`processes`, a [`Comm`](@ref) over the processes ([`mpi_comm`](@ref)), makes the reducers of a group's members in
several processes sum over every member of every process, hierarchically: among the process's members, then
across the processes by member 0, then back. Every member passes its process's same `Comm`, which runs no other
collective during a step; dpar keeps it for the reducer, so it may be closed first. With `MEAN`, every process
creates its reducers at the same point (member 0's creation counts every process's members). `compression` is how
buckets cross the processes: `COMPRESSION_NONE` or `COMPRESSION_BF16`.
"""
mutable struct Reducer
    ptr::Ptr{Cvoid}
    grads::Union{Vector{Array{Float32}},Nothing}  # the buffers dpar reads and writes, held until close
    index::IdDict{Any,Int}                       # each buffer's index, from 0
    Reducer(ptr::Ptr{Cvoid}) = finalizer(close, new(ptr, nothing, IdDict{Any,Int}()))
end

function Reducer(c::Comm, grads::AbstractVector{Ptr{Float32}}, counts::AbstractVector{<:Integer};
                 first_bucket_bytes::Union{Integer,Nothing}=nothing, bucket_cap_bytes::Union{Integer,Nothing}=nothing,
                 op=nothing, processes::Union{Comm,Nothing}=nothing, compression::Union{Integer,Nothing}=nothing)
    same_length(length(counts), length(grads), "counts")
    # A closed Comm's pointer is NULL, which dpar would take for no processes at all.
    processes !== nothing && processes.ptr == C_NULL &&
        throw(DparError(ERR_INVALID_ARGUMENT, "processes: the communicator is closed"))
    d = Ref(ReducerOptions(0, 0, 0, 0, 0, C_NULL, 0))
    check(ccall((:dpar_reducer_options_init_sized, libdpar), Int32, (Ptr{ReducerOptions}, Csize_t),
                d, sizeof(ReducerOptions)))
    o = Ref(ReducerOptions(sizeof(ReducerOptions), REDUCER_OPTIONS_VERSION,
                           first_bucket_bytes === nothing ? d[].first_bucket_bytes : first_bucket_bytes,
                           bucket_cap_bytes === nothing ? d[].bucket_cap_bytes : bucket_cap_bytes,
                           op === nothing ? d[].op : reduce_op(op),
                           processes === nothing ? d[].processes : processes.ptr,
                           compression === nothing ? d[].compression : compression))
    ptrs, ns = Vector{Ptr{Cfloat}}(grads), Vector{Csize_t}(counts)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    outp, h, pp, np, n, opts = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, out), c.ptr, pointer(ptrs), pointer(ns),
                               length(ptrs), Base.unsafe_convert(Ptr{ReducerOptions}, o)
    # With processes and MEAN, member 0's creation counts every process's members and tells the others: a
    # collective, run GC-safe as the others are. The handles live through the call; dpar keeps the communicators
    # behind them for the reducer.
    check(blocking(c, processes, out, ptrs, ns, o) do
        ccall((:dpar_reducer_create, libdpar), Int32,
              (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Ptr{Cfloat}}, Ptr{Csize_t}, Csize_t, Ptr{ReducerOptions}),
              outp, h, pp, np, n, opts)
    end)
    Reducer(out[])
end

function Reducer(c::Comm, grads::AbstractVector{<:Array{Float32}}; kwargs...)
    held = Array{Float32}[g for g in grads]  # the list as given: a later change to the caller's vector unroots none
    r = GC.@preserve held Reducer(c, Ptr{Float32}[pointer(g) for g in held], [length(g) for g in held]; kwargs...)
    r.grads = held
    for (i, g) in enumerate(held)
        r.index[g] = i - 1
    end
    r
end

Reducer(f::Function, c::Comm, args...; kwargs...) = closing(f, Reducer(c, args...; kwargs...))

function Base.close(r::Reducer)
    r.ptr == C_NULL && return
    h = r.ptr
    r.ptr = C_NULL
    blocking(r) do
        ccall((:dpar_reducer_free, libdpar), Cvoid, (Ptr{Cvoid},), h)
    end
    r.grads = nothing
    empty!(r.index)
    nothing
end

# Every call on a reducer takes its lock, which `wait` holds while it waits for the other participants: they all
# run GC-safe.

"""`num_buckets(reducer)`: the number of buckets the gradients were grouped in."""
function num_buckets(r::Reducer)
    n = Ref{Csize_t}(0)
    h, np = r.ptr, Base.unsafe_convert(Ptr{Csize_t}, n)
    check(blocking(r, n) do
        ccall((:dpar_reducer_num_buckets, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), np, h)
    end)
    Int(n[])
end

"""
    grad_ready!(reducer, grad::Array{Float32})
    grad_ready!(reducer, index)

Gradient `grad` (one of the registered arrays), or gradient `index` (from 0, as dpar numbers them: the buffer
`grads[index + 1]`), holds this step's value; the first call of a step starts it. Launches the buckets this
completes. Marking a gradient twice in a step throws `ERR_INVALID_STATE`, and leaves the step as it was.
"""
function grad_ready! end

function grad_ready!(r::Reducer, index::Integer)
    h, i = r.ptr, Csize_t(index)
    check(blocking(r) do
        ccall((:dpar_reducer_grad_ready, libdpar), Int32, (Ptr{Cvoid}, Csize_t), h, i)
    end)
end

function grad_ready!(r::Reducer, grad::Array{Float32})
    index = get(r.index, grad, -1)
    index >= 0 || throw(DparError(ERR_INVALID_ARGUMENT, "grad: not one of the reducer's buffers"))
    grad_ready!(r, index)
end

function Base.wait(r::Reducer)
    h = r.ptr
    check(blocking(r) do
        ccall((:dpar_reducer_wait, libdpar), Int32, (Ptr{Cvoid},), h)
    end)
end

# ---- Datasets and loaders ----------------------------------------------------------------------------------

"""
    Dataset(images_path, labels_path)
    Dataset(f, images_path, labels_path)

An in-memory dataset of (Float32 sample, Int32 label) read from an IDX image file and an IDX label file, each plain
or gzip-compressed, as MNIST and Fashion-MNIST ship; pixels become Float32 in [0, 1]. A damaged file throws
`ERR_CORRUPT`, a missing one `ERR_IO`. Loaders share its data: close it before or after them. The `do`-block form
closes it at the end.
"""
mutable struct Dataset
    ptr::Ptr{Cvoid}
    Dataset(ptr::Ptr{Cvoid}) = finalizer(close, new(ptr))
end

function Dataset(images_path::AbstractString, labels_path::AbstractString)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_dataset_load_idx, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Cstring, Cstring),
                out, images_path, labels_path))
    Dataset(out[])
end

Dataset(f::Function, images_path::AbstractString, labels_path::AbstractString) =
    closing(f, Dataset(images_path, labels_path))

function Base.close(d::Dataset)
    d.ptr == C_NULL && return
    ccall((:dpar_dataset_free, libdpar), Cvoid, (Ptr{Cvoid},), d.ptr)
    d.ptr = C_NULL
end

"""`info(dataset)`: `(samples=..., features=..., classes=...)`, classes being the largest label + 1."""
function info(d::Dataset)
    s, f, c = Ref{Csize_t}(0), Ref{Csize_t}(0), Ref{Csize_t}(0)
    check(ccall((:dpar_dataset_info, libdpar), Int32, (Ptr{Csize_t}, Ptr{Csize_t}, Ptr{Csize_t}, Ptr{Cvoid}),
                s, f, c, d.ptr))
    (samples=Int(s[]), features=Int(f[]), classes=Int(c[]))
end

"""`Dpar.normalize!(dataset, mean, std)`: standardises every feature, x = (x - mean) / std. Not exported: it would
be ambiguous with `LinearAlgebra.normalize!`."""
function normalize!(d::Dataset, mean::Real, std::Real)
    check(ccall((:dpar_dataset_normalize, libdpar), Int32, (Ptr{Cvoid}, Cfloat, Cfloat), d.ptr, mean, std))
    d
end

"""
    Loader(dataset, batch_size; shuffle=false, seed=0, drop_last=false)
    Loader(f, dataset, batch_size; kwargs...)

A batch loader over `dataset`. Iterating it yields the rest of the current epoch's batches, each an
`(inputs, labels)` pair of [`Tensor`](@ref)s: `(b, features)` Float32 and `(b,)` Int32 (as Julia arrays,
`Array(inputs)` is `features x b`). They are borrowed from the loader and hold the next batch once the loop moves
on: copy what must outlive the iteration. Batches have `batch_size` rows, the last fewer unless `drop_last`. The
loader starts at epoch 0; [`start_epoch!`](@ref) starts another, whose order with `shuffle` is a permutation drawn
from (`seed`, epoch) alone. See also [`shard!`](@ref) and [`to_device!`](@ref). The `do`-block form closes it at
the end.
"""
mutable struct Loader
    ptr::Ptr{Cvoid}
    Loader(ptr::Ptr{Cvoid}) = finalizer(close, new(ptr))
end

function Loader(d::Dataset, batch_size::Integer; shuffle::Bool=false, seed::Integer=0, drop_last::Bool=false)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_loader_create, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Csize_t, Int32, UInt64, Int32),
                out, d.ptr, batch_size, shuffle, seed, drop_last))
    Loader(out[])
end

Loader(f::Function, d::Dataset, batch_size::Integer; kwargs...) = closing(f, Loader(d, batch_size; kwargs...))

function Base.close(l::Loader)
    l.ptr == C_NULL && return
    ccall((:dpar_loader_free, libdpar), Cvoid, (Ptr{Cvoid},), l.ptr)
    l.ptr = C_NULL
end

"""`start_epoch!(loader, epoch)`: starts epoch `epoch` from its first batch."""
function start_epoch!(l::Loader, epoch::Integer)
    check(ccall((:dpar_loader_start_epoch, libdpar), Int32, (Ptr{Cvoid}, UInt64), l.ptr, epoch))
    l
end

"""`num_batches(loader)`: the number of batches in an epoch."""
function num_batches(l::Loader)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_loader_num_batches, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, l.ptr))
    Int(n[])
end

"""`shard!(loader, shard, num_shards)`: from the next batch, yields only part `shard` (from 0) of `num_shards` of
each batch: the shard-th of `num_shards` contiguous slices of its rows, their sizes differing by at most one
(`batch_size` stays the global batch). Each process of a multi-process engine makes the same loader, same seed,
and takes its own shard; a last batch with fewer rows than shards is dropped."""
function shard!(l::Loader, shard::Integer, num_shards::Integer)
    check(ccall((:dpar_loader_shard, libdpar), Int32, (Ptr{Cvoid}, Csize_t, Csize_t), l.ptr, shard, num_shards))
    l
end

"""`to_device!(loader, device)`: from the next batch, yields batches in memory of `device` (a `DparDevice`, or a
name such as "cuda:0"), each prepared, on a GPU copied, while the caller still uses the one before: the batches
are the same, bit for bit. An engine's replica on that device takes its rows without a copy."""
function to_device!(l::Loader, device::DparDevice)
    check(ccall((:dpar_loader_to_device, libdpar), Int32, (Ptr{Cvoid}, DparDevice), l.ptr, device))
    l
end

to_device!(l::Loader, device::AbstractString) = to_device!(l, parse_device(device))

# The next batch of the epoch as (inputs, labels) tensors borrowed from the loader, or nothing at its end.
function next_batch!(l::Loader)
    more = Ref{Int32}(0)
    check(ccall((:dpar_loader_next, libdpar), Int32, (Ptr{Int32}, Ptr{Cvoid}), more, l.ptr))
    more[] == 0 && return nothing
    x = ccall((:dpar_loader_inputs, libdpar), Ptr{Cvoid}, (Ptr{Cvoid},), l.ptr)
    x == C_NULL && throw(take_error(ERR_INTERNAL))
    y = ccall((:dpar_loader_labels, libdpar), Ptr{Cvoid}, (Ptr{Cvoid},), l.ptr)
    y == C_NULL && throw(take_error(ERR_INTERNAL))
    (Tensor(x, l; owned=false), Tensor(y, l; owned=false))
end

function Base.iterate(l::Loader, state=nothing)
    batch = next_batch!(l)
    batch === nothing ? nothing : (batch, nothing)
end

Base.IteratorSize(::Type{Loader}) = Base.SizeUnknown()
Base.eltype(::Type{Loader}) = Tuple{Tensor,Tensor}

end # module
