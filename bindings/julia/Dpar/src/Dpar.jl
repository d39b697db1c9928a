"""
    Dpar

dpar for Julia: data-parallel training over several devices through dpar's C ABI (`libdpar.so.0`).

Every handle is a Julia object with `close` (a finalizer frees it too); every failed call throws a `DparError`
carrying dpar's status and message. `do`-block helpers (`Model(seed) do m ... end`) close at the end. The library is
found through `ENV["DPAR_LIB"]` (a path to libdpar.so), else the CMake build tree of this checkout, else the system.
"""
module Dpar

using Libdl

const libdpar = let p = get(ENV, "DPAR_LIB", joinpath(@__DIR__, "..", "..", "..", "..", "build", "libdpar.so"))
    isfile(p) ? p : "libdpar.so.0"
end

export DparError, Model, Engine, Tensor, linear!, activation!, dropout!, train_step!, step_count, num_params,
       param_info, get_param, set_param!, set_forward_hook!, set_lr!, set_max_grad_norm!, grad_norm, set_training!,
       forward, num_replicas

const OK = Int32(0)
const ERR_INVALID_ARGUMENT = Int32(-1)
const ERR_DEVICE = Int32(-3)
const ERR_INTERNAL = Int32(-12)
const F32 = Int32(0)
const I32 = Int32(1)
const RELU, GELU, TANH, SIGMOID = Int32(0), Int32(1), Int32(2), Int32(3)
const SGD, ADAM, ADAMW = Int32(0), Int32(1), Int32(2)
const LOSS_CROSS_ENTROPY, LOSS_MSE = Int32(0), Int32(1)
const PROCESSES_AUTO, PROCESSES_SINGLE, PROCESSES_MPI = Int32(0), Int32(1), Int32(2)

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

# Reads, then clears, the thread's error: the ccall and this read run on the same OS thread (no task switch
# between them: neither yields).
function check(status::Int32)
    status == OK && return nothing
    msg = unsafe_string(ccall((:dpar_last_error, libdpar), Cstring, ()))
    ccall((:dpar_clear_error, libdpar), Cvoid, ())
    throw(DparError(status, msg))
end

function device_count(kind::Integer=0)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_device_count, libdpar), Int32, (Ptr{Csize_t}, Int32), n, kind))
    Int(n[])
end

struct DparDevice
    kind::Int32
    index::Int32
end

function parse_device(text::AbstractString)
    d = Ref(DparDevice(0, 0))
    check(ccall((:dpar_device_parse, libdpar), Int32, (Ptr{DparDevice}, Cstring), d, text))
    d[]
end

# ---- Tensors -----------------------------------------------------------------------------------------------

"""A dpar tensor. `Tensor(array)` copies a Float32 or Int32 array (row-major: dpar's shape is the array's
dimensions reversed, so a Julia `features x batch` matrix is dpar's `(batch, features)`)."""
mutable struct Tensor
    ptr::Ptr{Cvoid}
    keep::Any  # memory the tensor wraps
    function Tensor(ptr::Ptr{Cvoid}, keep=nothing)
        t = new(ptr, keep)
        finalizer(close, t)
    end
end

function Base.close(t::Tensor)
    t.ptr == C_NULL && return
    ccall((:dpar_tensor_free, libdpar), Cvoid, (Ptr{Cvoid},), t.ptr)
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

mutable struct Model
    ptr::Ptr{Cvoid}
    function Model(seed::Integer=0)
        o = Ref(ModelOptions(0, 0, 0))
        check(ccall((:dpar_model_options_init, libdpar), Int32, (Ptr{ModelOptions},), o))
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

function linear!(m::Model, in_features::Integer, out_features::Integer; bias::Bool=true)
    check(ccall((:dpar_model_add_linear, libdpar), Int32, (Ptr{Cvoid}, Int64, Int64, Int32),
                m.ptr, in_features, out_features, bias))
    m
end

function activation!(m::Model, kind::Integer)
    check(ccall((:dpar_model_add_activation, libdpar), Int32, (Ptr{Cvoid}, Int32), m.ptr, kind))
    m
end

function dropout!(m::Model, p::Real)
    check(ccall((:dpar_model_add_dropout, libdpar), Int32, (Ptr{Cvoid}, Cfloat), m.ptr, p))
    m
end

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

function get_param(m::Model, index::Integer)
    _, shape = param_info(m, index)
    v = zeros(Float32, prod(shape))
    check(ccall((:dpar_model_get_param, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Csize_t, Csize_t),
                v, m.ptr, index, length(v)))
    v
end

function set_param!(m::Model, index::Integer, v::Vector{Float32})
    check(ccall((:dpar_model_set_param, libdpar), Int32, (Ptr{Cvoid}, Csize_t, Ptr{Cfloat}, Csize_t),
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
    EngineOptions() = new()
end

mutable struct Engine
    ptr::Ptr{Cvoid}
    hook::Any  # the forward hook's Julia closure, rooted while dpar may call it
end

function Engine(model::Model; optimizer::Integer=SGD, lr::Real=0.01, momentum::Real=0.0, devices::Integer=0,
                loss::Integer=LOSS_CROSS_ENTROPY, seed::Integer=0, processes::Integer=PROCESSES_AUTO)
    oo, eo = OptimizerOptions(), EngineOptions()
    check(ccall((:dpar_optimizer_options_init, libdpar), Int32, (Ref{OptimizerOptions},), oo))
    check(ccall((:dpar_engine_options_init, libdpar), Int32, (Ref{EngineOptions},), eo))
    oo.kind, oo.lr, oo.momentum = optimizer, lr, momentum
    eo.num_cpu_devices, eo.loss, eo.seed, eo.processes = devices, loss, seed, processes
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_engine_create, libdpar), Int32,
                (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ref{OptimizerOptions}, Ref{EngineOptions}), out, model.ptr, oo, eo))
    finalizer(close, Engine(out[], nothing))
end

function Engine(f::Function, model::Model; kwargs...)
    e = Engine(model; kwargs...)
    try
        f(e)
    finally
        close(e)
    end
end

function Base.close(e::Engine)
    e.ptr == C_NULL && return
    ccall((:dpar_engine_free, libdpar), Cvoid, (Ptr{Cvoid},), e.ptr)
    e.ptr = C_NULL
end

"""One fused training step; returns the mean loss."""
function train_step!(e::Engine, input::Tensor, target::Tensor)
    l = Ref{Cfloat}(0)
    check(ccall((:dpar_engine_train_step, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
                l, e.ptr, input.ptr, target.ptr))
    l[]
end

function forward(e::Engine, input::Tensor)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:dpar_engine_forward, libdpar), Int32, (Ptr{Ptr{Cvoid}}, Ptr{Cvoid}, Ptr{Cvoid}),
                out, e.ptr, input.ptr))
    Tensor(out[])
end

function step_count(e::Engine)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_engine_step_count, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, e.ptr))
    Int(n[])
end

function num_replicas(e::Engine)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_engine_num_replicas, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, e.ptr))
    Int(n[])
end

set_lr!(e::Engine, lr::Real) = check(ccall((:dpar_engine_set_lr, libdpar), Int32, (Ptr{Cvoid}, Cfloat), e.ptr, lr))
"""Clips the gradient of the following steps to this global L2 norm (`clip_grad_norm_` between backward and the
step); 0 turns clipping off."""
set_max_grad_norm!(e::Engine, max_norm::Real) =
    check(ccall((:dpar_engine_set_max_grad_norm, libdpar), Int32, (Ptr{Cvoid}, Cfloat), e.ptr, max_norm))
"""The gradient's norm before clipping at the last step that clipped (NaN before any)."""
function grad_norm(e::Engine)
    out = Ref{Cfloat}(0)
    check(ccall((:dpar_engine_grad_norm, libdpar), Int32, (Ref{Cfloat}, Ptr{Cvoid}), out, e.ptr))
    out[]
end
set_training!(e::Engine, on::Bool) =
    check(ccall((:dpar_engine_set_training, libdpar), Int32, (Ptr{Cvoid}, Int32), e.ptr, on))
save(e::Engine, path::AbstractString) =
    check(ccall((:dpar_engine_save, libdpar), Int32, (Ptr{Cvoid}, Cstring), e.ptr, path))
load(e::Engine, path::AbstractString) =
    check(ccall((:dpar_engine_load, libdpar), Int32, (Ptr{Cvoid}, Cstring), e.ptr, path))
abort(e::Engine) = check(ccall((:dpar_engine_abort, libdpar), Int32, (Ptr{Cvoid},), e.ptr))

"""Replica `replica`'s parameters (from 0), flattened."""
function params(e::Engine, replica::Integer, count::Integer)
    v = zeros(Float32, count)
    check(ccall((:dpar_engine_get_params, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Csize_t, Csize_t),
                v, e.ptr, replica, count))
    v
end

function accumulate!(e::Engine, input::Tensor, target::Tensor)
    l = Ref{Cfloat}(0)
    check(ccall((:dpar_engine_accumulate, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
                l, e.ptr, input.ptr, target.ptr))
    l[]
end
step!(e::Engine) = check(ccall((:dpar_engine_step, libdpar), Int32, (Ptr{Cvoid},), e.ptr))
zero_grad!(e::Engine) = check(ccall((:dpar_engine_zero_grad, libdpar), Int32, (Ptr{Cvoid},), e.ptr))
backward!(e::Engine, grad_output::Tensor) =
    check(ccall((:dpar_engine_backward, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}), e.ptr, grad_output.ptr))
inject_fault!(e::Engine, replica::Integer, fault::Integer) =
    check(ccall((:dpar_engine_inject_fault, libdpar), Int32, (Ptr{Cvoid}, Csize_t, Int32), e.ptr, replica, fault))

function num_buckets(e::Engine)
    n = Ref{Csize_t}(0)
    check(ccall((:dpar_engine_num_buckets, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}), n, e.ptr))
    Int(n[])
end

"""(rank, size) of this process among those the engine spans (rank from 0)."""
function processes(e::Engine)
    r, s = Ref{Csize_t}(0), Ref{Csize_t}(0)
    check(ccall((:dpar_engine_processes, libdpar), Int32, (Ptr{Csize_t}, Ptr{Csize_t}, Ptr{Cvoid}), r, s, e.ptr))
    (Int(r[]), Int(s[]))
end

function replica_device(e::Engine, replica::Integer)
    d = Ref(DparDevice(0, 0))
    check(ccall((:dpar_engine_replica_device, libdpar), Int32, (Ptr{DparDevice}, Ptr{Cvoid}, Csize_t),
                d, e.ptr, replica))
    d[]
end

function split(e::Engine, batch::Integer)
    v = zeros(Csize_t, num_replicas(e))
    check(ccall((:dpar_engine_split, libdpar), Int32, (Ptr{Csize_t}, Ptr{Cvoid}, Csize_t, Csize_t),
                v, e.ptr, batch, length(v)))
    Int.(v)
end

function replica_losses(e::Engine)
    v = zeros(Float32, num_replicas(e))
    check(ccall((:dpar_engine_replica_losses, libdpar), Int32, (Ptr{Cfloat}, Ptr{Cvoid}, Csize_t),
                v, e.ptr, length(v)))
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
        check(ccall((:dpar_engine_set_forward_hook, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
                    e.ptr, C_NULL, C_NULL, C_NULL))
        e.hook = nothing
    else
        box = Ref{Any}(f)  # rooted by the engine object, which outlives its hook: no destroy needed
        e.hook = box
        check(ccall((:dpar_engine_set_forward_hook, libdpar), Int32, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}),
                    e.ptr, tramp, pointer_from_objref(box), C_NULL))
    end
    nothing
end

end # module
