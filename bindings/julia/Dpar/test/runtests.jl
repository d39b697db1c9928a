# Dpar.jl against dpar's C reference (tests/binding_reference.c): same model, data and seed on 2 CPU devices,
# same loss bits; a bad call throws DparError with dpar's message; a hook's exception comes back with its text.
# The collectives run one task per member of a group, each on a thread of its own: the sizes this julia has too
# few threads for are skipped with a warning (julia --threads=4 runs them all).
using Dpar
using Dpar: libdpar
using Test

# f() throws a DparError with `status` whose message contains `needle`.
function throws_dpar(f, status, needle)
    err = try
        f()
        nothing
    catch e
        e
    end
    ok = err isa DparError && err.status == status && occursin(needle, err.message)
    ok || @error "expected a DparError $(Dpar.status_name(status)) with \"$needle\"" got = err
    ok
end

# Runs body(comm) for each of the n members of `group`, each in a task of its own, and returns their results in
# rank order. A member blocks its OS thread inside dpar until the others arrive, so the n tasks need n threads. A
# member that throws aborts the group, so that the others fail at once instead of at the timeout.
function on_each_member(body, group::Dpar.CommGroup, n::Integer)
    comms = [Dpar.member(group, r) for r in 0:n-1]
    tasks = map(comms) do c
        Threads.@spawn try
            body(c)
        catch err
            Dpar.abort(c, sprint(showerror, err))
            rethrow()
        end
    end
    for t in tasks  # every member has left dpar before its communicator is closed
        try
            wait(t)
        catch
        end
    end
    close.(comms)
    fetch.(tasks)
end

# Whether this julia has a thread for each of n members; warns when it has not.
function threads_for(n, what)
    Threads.nthreads() >= n && return true
    @warn "skipped: $what needs $n threads (julia --threads=4); this julia has $(Threads.nthreads())"
    false
end

# Starts an all-reduce on an array that only the returned work refers to (not inlined: no caller's variable holds
# the array).
@noinline function unreferenced_all_reduce(c, value)
    buffer = fill(value, 1 << 16)
    (Dpar.all_reduce_async!(c, buffer), WeakRef(buffer))
end

# A reducer over one array that only the reducer refers to, and a weak reference to that array.
@noinline function unreferenced_reducer(c, n)
    grad = zeros(Float32, n)
    (Dpar.Reducer(c, [grad]), WeakRef(grad))
end

# Participant r's gradient k (from 0) in a step: distinct per participant, gradient and step.
grad_value(r, k, step) = Float32((r + 1) * 4 + k + step)

# An IDX file as dpar reads it: big-endian u32 magic and extents, then the u8 data.
function write_idx(path, magic, dims, data)
    open(path, "w") do io
        write(io, hton(UInt32(magic)))
        foreach(d -> write(io, hton(UInt32(d))), dims)
        write(io, UInt8.(data))
    end
    path
end

# A small IDX pair: 10 images of 2 x 3 pixels, pixel j of sample i being 16 i + j (so that a batch's row tells which
# sample it is), and label (7 i) mod 4.
const SAMPLES = 10
pixels(i) = Float32[Float32(16i + j) / 255.0f0 for j in 0:5]  # as dpar reads them: u8 / 255 in Float32
label(i) = Int32((7i) % 4)
sample_of(column) = round(Int, column[1] * 255) ÷ 16

function write_dataset(dir)
    images = write_idx(joinpath(dir, "images-idx3-ubyte"), 0x00000803, (SAMPLES, 2, 3),
                       [16i + j for i in 0:SAMPLES-1 for j in 0:5])
    labels = write_idx(joinpath(dir, "labels-idx1-ubyte"), 0x00000801, (SAMPLES,), label.(0:SAMPLES-1))
    (images, labels)
end

# The rest of the loader's epoch, each batch copied into (features x b inputs, labels) before the next.
copies(loader) = [(Array(x), Array(y)) for (x, y) in loader]

const DTYPES = (Float32, Float64, Int32, Int64)
const OPS = (Dpar.SUM, Dpar.MEAN, Dpar.MAX, Dpar.MIN)

# Participant r's element i (from 1) of an all-reduce: distinct per participant and signed, so that MEAN's
# truncation toward zero shows on integers; small, so that every dtype holds the sums exactly.
contribution(T, r, i) = T((r + 1) * i * (isodd(i) ? -1 : 1))

# MEAN as dpar defines it: the sum divided by the number of participants, truncated toward zero for integers.
mean_of(T, s, n) = T <: Integer ? T(div(s, n)) : T(s) / T(n)

# What `op` makes of the n participants' element i, computed from the contributions themselves.
function reduced(T, op, n, i)
    v = [contribution(T, r, i) for r in 0:n-1]
    op == Dpar.SUM ? T(sum(v)) : op == Dpar.MAX ? maximum(v) : op == Dpar.MIN ? minimum(v) : mean_of(T, sum(v), n)
end

reference_model(m) = (Dpar.linear!(m, 4, 8); Dpar.activation!(m, Dpar.RELU); Dpar.linear!(m, 8, 3))

function reference_batch()
    x = Float32[((i * 37) % 101) / 101 - 0.5 for i in 0:39]
    (Dpar.Tensor(reshape(x, 4, 10)), Dpar.Tensor(Int32[r % 3 for r in 0:9]))
end

# DataParallel's own path (forward, backward!, step!) against train_step! with the MSE loss: the model, the engines'
# options, 9 rows (5 and 4 per replica) of 4 inputs and 3 targets as Julia matrices (features x rows), and the
# gradient of the mean of (out - y)^2 over every element, as PyTorch's mse_loss backward: 2 (out - y) / numel.
mse_model(m) = (Dpar.linear!(m, 4, 8); Dpar.activation!(m, Dpar.TANH); Dpar.linear!(m, 8, 3))
const MSE_OPTIONS = (lr=0.1, momentum=0.9, devices=2, loss=Dpar.LOSS_MSE, seed=3, processes=Dpar.PROCESSES_SINGLE)
mse_batch() = (reshape(Float32[((i * 37) % 101) / 101 - 0.5 for i in 0:35], 4, 9),
               reshape(Float32[((i * 53) % 89) / 89 - 0.5 for i in 0:26], 3, 9))
mse_grad(out, y) = (out .- y) .* Float32(2 / length(out))

# 32 arrays of `dims` filled with 1f6: memory the collector freed is handed out again, holding other values.
churn(dims) = [fill(1f6, dims) for _ in 1:32]

# Batch `step` of 11 rows of 6 features (6 and 5 per replica); a Julia matrix is (features, rows).
function reduction_batch(step)
    x = Float32[(((i + 7 * step) * 37) % 101) / 101 - 0.5 for i in 0:65]
    (Dpar.Tensor(reshape(x, 6, 11)), Dpar.Tensor(Int32[(r + step) % 3 for r in 0:10]))
end

# One training step, traced: its loss and the trace's text.
function traced_step(e, x, y)
    Dpar.trace_start!(e)
    loss = Dpar.train_step!(e, x, y)
    path = joinpath(mktempdir(), "trace.json")
    Dpar.trace_stop!(e, path)
    (loss, read(path, String))
end

# The C reference's loss bits: $DPAR_REFERENCE_LOSSES (ctest sets it), else the file that ctest's binding_reference
# test writes into this checkout's build tree.
const REFERENCE_LOSSES = get(ENV, "DPAR_REFERENCE_LOSSES",
                             joinpath(@__DIR__, "..", "..", "..", "..", "build", "tests", "reference_losses.txt"))

@testset "Dpar" begin
    @testset "LayerNorm and Embedding" begin
        Dpar.Model(5) do m
            Dpar.embedding!(m, 9, 4)
            Dpar.layernorm!(m, 4)
            Dpar.add_flatten!(m)
            Dpar.linear!(m, 12, 3)
            @test throws_dpar(() -> Dpar.embedding!(m, 0, 4), Dpar.ERR_INVALID_ARGUMENT, "num_embeddings")
            @test throws_dpar(() -> Dpar.layernorm!(m, 4; eps=0.0), Dpar.ERR_INVALID_ARGUMENT, "eps")
            @test throws_dpar(() -> Dpar.embedding!(m, 4, 2; padding_idx=4), Dpar.ERR_INVALID_ARGUMENT, "padding_idx")
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                # dpar (5, 3) is a Julia 3 x 5 matrix (dimensions reversed).
                tokens = Int32[(i * 5) % 9 for i in 0:14]
                x = Dpar.Tensor(reshape(tokens, 3, 5))
                y = Dpar.Tensor(Int32[0, 1, 2, 1, 0])
                @test !isnan(Dpar.train_step!(e, x, y))
                tokens[5] = 9
                bad = Dpar.Tensor(reshape(tokens, 3, 5))
                @test throws_dpar(() -> Dpar.train_step!(e, bad, y), Dpar.ERR_INVALID_ARGUMENT,
                                  "index 9 at position (1, 1)")
                @test !isnan(Dpar.train_step!(e, x, y))
            end
        end
    end
    @testset "Tied weights" begin
        # The GPT pattern: the output projection reads the token embedding's weight (lm_head.weight = wte.weight).
        Dpar.Model(4) do m
            Dpar.embedding!(m, 7, 5)
            Dpar.linear!(m, 5, 7; bias=false)
            @test throws_dpar(() -> Dpar.tie_param!(m, 1, "weight", 0, "bias"), Dpar.ERR_INVALID_ARGUMENT,
                              "has no parameter \"bias\"")
            Dpar.tie_param!(m, 1, "weight", 0, "weight")
            @test Dpar.num_params(m) == 1
            @test Dpar.num_param_elements(m) == 35
            @test Dpar.param_info(m, 0) == ("0.weight", (7, 5))
            @test throws_dpar(() -> Dpar.tie_param!(m, 1, "weight", 0, "weight"), Dpar.ERR_INVALID_ARGUMENT,
                              "tied already")
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                x = Dpar.Tensor(Int32[0, 3, 6, 2, 3])
                y = Dpar.Tensor(Int32[3, 6, 2, 3, 1])
                first = Dpar.train_step!(e, x, y)
                @test Dpar.train_step!(e, x, y) < first
            end
        end
    end
    @testset "BatchNorm buffers" begin
        Dpar.Model(3) do m
            Dpar.linear!(m, 4, 6; bias=false)
            Dpar.batchnorm1d!(m, 6)
            Dpar.linear!(m, 6, 3)
            Dpar.convert_sync_batchnorm!(m)
            @test Dpar.num_buffers(m) == 3
            @test Dpar.buffer_info(m, 0) == ("1.running_mean", Float32, (6,))
            @test Dpar.buffer_info(m, 2) == ("1.num_batches_tracked", Int64, ())
            @test Dpar.get_buffer(m, 1) == fill(1.0f0, 6)
            Dpar.set_buffer!(m, 2, Int64[4])
            @test Dpar.get_buffer(m, 2) == Int64[4]
            @test throws_dpar(() -> Dpar.buffer_info(m, 3), Dpar.ERR_INVALID_ARGUMENT, "index")
            Dpar.Engine(m; lr=0.1, devices=3, processes=Dpar.PROCESSES_SINGLE) do e
                x, y = reference_batch()
                Dpar.train_step!(e, x, y)
                mean = Dpar.buffer(e, m, 0, 0)
                @test mean != zeros(Float32, 6)
                @test Dpar.buffer(e, m, 2, 0) == mean
                @test Dpar.buffer(e, m, 1, 2) == Int64[5]
                @test throws_dpar(() -> Dpar.buffer(e, m, 3, 0), Dpar.ERR_INVALID_ARGUMENT, "replica")
            end
        end
    end
    if !isfile(REFERENCE_LOSSES)
        @warn "skipped the loss bits of the C reference: no $REFERENCE_LOSSES (run ctest -R binding_reference, or " *
              "set DPAR_REFERENCE_LOSSES to the file build/tests/binding_reference writes)"
        @test_skip "loss bits of the C reference"
    else
        @testset "loss bits of the C reference" begin
            expected = split(read(REFERENCE_LOSSES, String))
            Dpar.Model(7) do m
                reference_model(m)
                Dpar.Engine(m; lr=0.1, momentum=0.9, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                    x, y = reference_batch()
                    got = [string(reinterpret(UInt32, Dpar.train_step!(e, x, y)), base=16, pad=8) for _ in 1:5]
                    @test got == expected
                    @test Dpar.step_count(e) == 5
                    @test Dpar.processes(e) == (0, 1)
                    @test Dpar.process_transport(e) == ""  # one process: nothing travels between processes
                    Dpar.set_gradient_compression!(e, Dpar.COMPRESSION_BF16)  # one process: changes nothing
                    @test throws_dpar(() -> Dpar.set_gradient_compression!(e, 7), Dpar.ERR_INVALID_ARGUMENT,
                                      "compression")
                end
            end
        end
    end
    @testset "a bad call throws dpar's message" begin
        Dpar.Model(7) do m
            reference_model(m)
            Dpar.Engine(m; devices=2) do e
                x = Dpar.Tensor(zeros(Float32, 5, 2))
                y = Dpar.Tensor(Int32[0, 1])
                err = try Dpar.train_step!(e, x, y); nothing catch ex; ex end
                @test err isa DparError
                @test err.status == Dpar.ERR_INVALID_ARGUMENT
                @test occursin("4", err.message)
            end
        end
    end
    # forward and backward! take Arrays (Float32, or Float64 converted) as well as Tensors; a wrapped input that
    # only the engine refers to survives a collection between forward and backward! (before, nothing held it and
    # backward! read memory handed out again), and so does the input before a refused forward.
    @testset "forward, backward! and step! with Arrays train as train_step! with the MSE loss" begin
        x, y = mse_batch()
        ways = [("Float32 arrays", identity, identity),
                ("Float64 arrays", a -> Float64.(a), g -> Float64.(g)),
                ("Tensors", Dpar.Tensor, Dpar.Tensor),
                ("wrapped arrays that only the engine holds", a -> Dpar.wrap(copy(a)), Dpar.wrap)]
        for (name, as_input, as_grad) in ways
            @testset "$name" begin
                Dpar.Model(5) do m
                    mse_model(m)
                    n = Dpar.num_param_elements(m)
                    Dpar.Engine(m; MSE_OPTIONS...) do e
                        Dpar.Engine(m; MSE_OPTIONS...) do reference
                            initial = Dpar.params(e, 0, n)
                            tx, ty = Dpar.Tensor(x), Dpar.Tensor(y)
                            for step in 1:3
                                expected = Dpar.train_step!(reference, tx, ty)
                                out = Array(Dpar.forward(e, as_input(x)))
                                @test size(out) == size(y)
                                @test isapprox(sum(abs2, Float64.(out) .- y) / length(y), expected; rtol=1e-5)
                                GC.gc()
                                reused = churn(size(x))
                                grad = mse_grad(out, y)
                                given = copy(grad)
                                Dpar.backward!(e, as_grad(given))
                                @test given == grad  # read, never written
                                Dpar.step!(e)
                                @test all(r -> r[1] == 1f6, reused)
                            end
                            @test Dpar.step_count(e) == 3
                            p = Dpar.params(e, 0, n)
                            # Julia's 2/numel and dpar's may differ in the last bit: equal within float rounding.
                            @test all(isapprox.(p, Dpar.params(reference, 0, n); rtol=1e-5, atol=1e-6))
                            @test maximum(abs.(p .- initial)) > 1e-2  # it trained
                            @test Dpar.params(e, 1, n) == p  # the replicas stay identical
                        end
                    end
                end
            end
        end
        @testset "a refused forward keeps the input before it for backward!" begin
            Dpar.Model(5) do m
                mse_model(m)
                n = Dpar.num_param_elements(m)
                grad = fill(0.25f0, size(y))
                Dpar.Engine(m; MSE_OPTIONS...) do e
                    Dpar.Engine(m; MSE_OPTIONS...) do reference
                        Dpar.forward(reference, x)
                        Dpar.backward!(reference, grad)
                        Dpar.step!(reference)
                        Dpar.forward(e, Dpar.wrap(copy(x)))
                        @test throws_dpar(() -> Dpar.forward(e, zeros(Float32, 5, 9)), Dpar.ERR_INVALID_ARGUMENT,
                                          "does not fit the model")
                        @test throws_dpar(() -> Dpar.backward!(e, zeros(Float32, 2, 9)), Dpar.ERR_INVALID_ARGUMENT,
                                          "must be shaped as forward's output")
                        GC.gc()
                        reused = churn(size(x))
                        Dpar.backward!(e, grad)
                        Dpar.step!(e)
                        @test Dpar.params(e, 0, n) == Dpar.params(reference, 0, n)
                        @test all(r -> r[1] == 1f6, reused)
                    end
                end
            end
        end
    end
    @testset "a residual graph is built, named and checked" begin
        Dpar.Model(3) do m
            @test Dpar.last_node(m) == Dpar.MODEL_INPUT
            Dpar.linear!(m, 4, 8)
            Dpar.activation!(m, Dpar.RELU)
            Dpar.linear!(m, 8, 4)
            fc2 = Dpar.last_node(m)
            @test fc2 == 2
            Dpar.add_sum!(m, [fc2, Dpar.MODEL_INPUT])
            Dpar.set_node_name!(m, 0, "block.fc1")
            Dpar.branch_from!(m, 3)
            Dpar.add_reshape!(m, [2, 2])
            Dpar.add_concat!(m, [4, 4])
            Dpar.add_flatten!(m)
            Dpar.linear!(m, 8, 3)
            @test Dpar.num_layers(m) == 8
            @test Dpar.param_info(m, 0)[1] == "block.fc1.weight"
            @test Dpar.param_info(m, 4)[1] == "7.weight"
            @test throws_dpar(() -> Dpar.add_sum!(m, [0, 42]), Dpar.ERR_INVALID_ARGUMENT, "node 42")
            @test throws_dpar(() -> Dpar.set_node_name!(m, 1, "block.fc1"), Dpar.ERR_INVALID_ARGUMENT,
                              "already node 0")
        end
    end
    @testset "attention: PyTorch's and nanoGPT's names, refusals, a tiny GPT trains on tokens" begin
        # nanoGPT's first layers, small: wte (11 tokens, 8 channels), wpe (4 positions), one attention block of 2
        # heads with its residual, then (B, T x C) to 3 classes for the cross-entropy over (B, classes).
        function tiny_gpt(m)
            Dpar.embedding!(m, 11, 8)
            Dpar.set_node_name!(m, 0, "transformer.wte")
            Dpar.position_embedding!(m, 4, 8)
            Dpar.set_node_name!(m, 1, "transformer.wpe")
            x = Dpar.last_node(m)
            Dpar.causal_self_attention!(m, 8, 2; name="transformer.h.0.attn")
            Dpar.add_sum!(m, [Dpar.last_node(m), x])
            Dpar.add_flatten!(m)
            Dpar.linear!(m, 4 * 8, 3)
        end
        Dpar.Model(7) do m
            tiny_gpt(m)
            @test Dpar.num_layers(m) == 8  # wte, wpe, c_attn, attention, c_proj, sum, flatten, linear
            @test [Dpar.param_info(m, i) for i in 0:Dpar.num_params(m)-1] == [
                ("transformer.wte.weight", (11, 8)), ("transformer.wpe.weight", (4, 8)),
                ("transformer.h.0.attn.c_attn.weight", (24, 8)), ("transformer.h.0.attn.c_attn.bias", (24,)),
                ("transformer.h.0.attn.c_proj.weight", (8, 8)), ("transformer.h.0.attn.c_proj.bias", (8,)),
                ("7.weight", (3, 32)), ("7.bias", (3,))]
            # A bad value is refused, named, and leaves the model as it was.
            bad = Dpar.ERR_INVALID_ARGUMENT
            @test throws_dpar(() -> Dpar.multihead_attention!(m, 8, 0), bad, "num_heads: 0")
            @test throws_dpar(() -> Dpar.multihead_attention!(m, 8, 3), bad, "num_heads: 3")
            @test throws_dpar(() -> Dpar.causal_self_attention!(m, 8, 2; dropout=1.0), bad, "dropout_p: 1")
            @test throws_dpar(() -> Dpar.causal_self_attention!(m, 8, 3), bad, "n_head: 3")
            @test throws_dpar(() -> Dpar.causal_self_attention!(m, 8, 2; name="transformer.h.0.attn"), bad,
                              "transformer.h.0.attn.c_attn")
            @test throws_dpar(() -> Dpar.attention!(m, 2; inputs=[0, 1]), bad, "n: 2")
            @test throws_dpar(() -> Dpar.attention!(m, 0), bad, "num_heads: 0")
            @test throws_dpar(() -> Dpar.attention!(m, 2; scale=-1.0), bad, "scale: -1")
            @test throws_dpar(() -> Dpar.position_embedding!(m, 0, 8), bad, "max_positions: 0")
            @test (Dpar.num_layers(m), Dpar.num_params(m)) == (8, 8)
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                # dpar (4, 4) is a Julia 4 x 4 matrix (dimensions reversed).
                x = Dpar.Tensor(reshape(Int32[(i * 7) % 11 for i in 0:15], 4, 4))
                y = Dpar.Tensor(Int32[0, 1, 2, 1])
                long = Dpar.Tensor(reshape(Int32[i % 11 for i in 0:19], 5, 4))
                @test throws_dpar(() -> Dpar.train_step!(e, long, y), bad,
                                  "a sequence of 5 positions is longer than the 4")
                first = Dpar.train_step!(e, x, y)
                @test isfinite(first)
                @test Dpar.train_step!(e, x, y) < first
            end
        end
        Dpar.Model(1) do mha
            Dpar.embedding!(mha, 11, 8)
            Dpar.multihead_attention!(mha, 8, 2; is_causal=true)
            @test [Dpar.param_info(mha, i) for i in 1:4] == [
                ("1.in_proj_weight", (24, 8)), ("1.in_proj_bias", (24,)), ("1.out_proj.weight", (8, 8)),
                ("1.out_proj.bias", (8,))]
            @test Dpar.get_param(mha, 2) == zeros(Float32, 24)  # zero biases, as the module's
            Dpar.multihead_attention!(mha, 8, 1; bias=false)
            @test Dpar.num_params(mha) == 7
        end
        # Attention over q, k and v of explicit nodes, over one packed projection, and over the next input.
        Dpar.Model(1) do sdpa
            Dpar.embedding!(sdpa, 11, 8)
            Dpar.attention!(sdpa, 2; inputs=[0, 0, 0], is_causal=true, dropout_p=0.1, scale=0.5)
            Dpar.linear!(sdpa, 8, 24; bias=false)
            Dpar.attention!(sdpa, 4; inputs=[2], is_causal=true)
            Dpar.branch_from!(sdpa, 2)
            Dpar.attention!(sdpa, 4)
            @test (Dpar.num_layers(sdpa), Dpar.num_params(sdpa)) == (5, 2)
        end
    end
    @testset "convolution and pooling layers: PyTorch's names, refusals, 2 devices train as one" begin
        function cnn(m)
            Dpar.conv2d!(m, 1, 4, 3; padding=1)
            Dpar.activation!(m, Dpar.RELU)
            Dpar.max_pool2d!(m, 2)
            Dpar.conv2d!(m, 4, 4, (3, 3); stride=(2, 2), padding=2, dilation=2, groups=2, bias=false)
            Dpar.avg_pool2d!(m, 2; stride=1, padding=1)
            Dpar.adaptive_avg_pool2d!(m, 1)
        end
        Dpar.Model(5) do m
            cnn(m)
            @test Dpar.num_layers(m) == 6
            @test Dpar.param_info(m, 0) == ("0.weight", (4, 1, 3, 3))
            @test Dpar.param_info(m, 2) == ("3.weight", (4, 2, 3, 3))
            @test throws_dpar(() -> Dpar.conv2d!(m, 4, 6, 3; groups=4), Dpar.ERR_INVALID_ARGUMENT, "divisible by groups")
            @test throws_dpar(() -> Dpar.max_pool2d!(m, 2; stride=(0, 1)), Dpar.ERR_INVALID_ARGUMENT, "stride[0]")
            @test throws_dpar(() -> Dpar.adaptive_avg_pool2d!(m, (2, 2)), Dpar.ERR_NOT_SUPPORTED, "only 1x1")
            @test Dpar.num_layers(m) == 6
            # A Julia array of size (width, height, channels, batch) is dpar's (batch, channels, height, width).
            x = Dpar.Tensor(reshape(Float32[((i * 37) % 101) / 101 - 0.5 for i in 0:5*64-1], 8, 8, 1, 5))
            y = Dpar.Tensor(reshape(Float32[((i * 13) % 7) / 7 - 0.5 for i in 0:5*4-1], 1, 1, 4, 5))
            n = Dpar.num_param_elements(m)
            finals = Vector{Vector{Float32}}()
            for devices in (1, 2)
                Dpar.Engine(m; lr=0.5, devices=devices, loss=Dpar.LOSS_MSE, processes=Dpar.PROCESSES_SINGLE) do e
                    first = Dpar.train_step!(e, x, y)
                    last = first
                    for _ in 1:10
                        last = Dpar.train_step!(e, x, y)
                    end
                    @test last < first
                    push!(finals, Dpar.params(e, 0, n))
                end
            end
            @test maximum(abs.(finals[1] .- finals[2]) ./ max.(abs.(finals[1]), 1f-2)) <= 1f-5
        end
    end
    @testset "a trace is written as Chrome's JSON" begin
        Dpar.Model(7) do m
            reference_model(m)
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                err = try Dpar.trace_stop!(e); nothing catch ex; ex end
                @test err isa DparError && err.status == Dpar.ERR_INVALID_STATE
                x, y = reference_batch()
                Dpar.trace_start!(e)
                Dpar.train_step!(e, x, y)
                path = joinpath(mktempdir(), "trace.json")
                Dpar.trace_stop!(e, path)
                text = read(path, String)
                @test occursin("\"traceEvents\"", text)
                for name in ("train_step", "forward", "backward", "optimizer", "replica 1 (cpu:1) worker")
                    @test occursin("\"$name\"", text)
                end
                Dpar.trace_stop!(e)  # only stops, again: allowed
            end
        end
    end
    @testset "precision policy" begin
        Dpar.Model(7) do m
            reference_model(m)
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                @test Dpar.precision(e) == Dpar.F32
                # f16: accepted, or refused whole with the reason (CPU devices: oneDNN has no f16 GEMM for them)
                err = try Dpar.set_precision!(e, Dpar.F16); nothing catch ex; ex end
                if err === nothing
                    @test Dpar.precision(e) == Dpar.F16
                    Dpar.set_precision!(e, Dpar.F32)
                else
                    @test err isa DparError && err.status == Dpar.ERR_NOT_SUPPORTED && occursin("f16", err.message)
                    @test Dpar.precision(e) == Dpar.F32
                end
                err = try Dpar.set_precision!(e, 7); nothing catch ex; ex end
                @test err isa DparError && occursin("compute_dtype", err.message)
                @test !Dpar.set_allow_tf32!(e, true)
                x, y = reference_batch()
                refused = try Dpar.set_precision!(e, Dpar.BF16); nothing catch ex; ex end
                if refused === nothing
                    @test Dpar.precision(e) == Dpar.BF16
                    @test isfinite(Dpar.train_step!(e, x, y))
                else
                    @test refused.status == Dpar.ERR_NOT_SUPPORTED && Dpar.precision(e) == Dpar.F32
                end
            end
        end
    end
    @testset "reduce dtype" begin
        Dpar.Model(7) do m
            reference_model(m)
            n = Dpar.num_param_elements(m)
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do plain
                Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                    @test Dpar.reduce_dtype(e) == Dpar.F32
                    err = try Dpar.set_reduce_dtype!(e, 7); nothing catch ex; ex end
                    @test err isa DparError && err.status == Dpar.ERR_INVALID_ARGUMENT &&
                          occursin("reduce_dtype", err.message)
                    Dpar.set_reduce_dtype!(e, Dpar.BF16)
                    @test Dpar.reduce_dtype(e) == Dpar.BF16
                    x, y = reference_batch()
                    for _ in 1:3
                        @test isfinite(Dpar.train_step!(e, x, y))
                        Dpar.train_step!(plain, x, y)
                    end
                    @test reinterpret(UInt32, Dpar.params(e, 0, n)) == reinterpret(UInt32, Dpar.params(e, 1, n))
                    @test Dpar.params(e, 0, n) != Dpar.params(plain, 0, n)
                end
            end
        end
    end
    @testset "the reproducible mode: the same bits on one device and on three" begin
        Dpar.Model(3) do m
            reference_model(m)
            n = Dpar.num_param_elements(m)
            Dpar.Engine(m; lr=0.1, devices=1, processes=Dpar.PROCESSES_SINGLE) do one
                Dpar.Engine(m; lr=0.1, devices=3, processes=Dpar.PROCESSES_SINGLE) do three
                    @test Dpar.reproducible(three) == 0
                    err = try Dpar.set_reproducible!(three, -2); nothing catch ex; ex end
                    @test err isa DparError && err.status == Dpar.ERR_INVALID_ARGUMENT && occursin("-2", err.message)
                    Dpar.set_reproducible!(one, 2)
                    Dpar.set_reproducible!(three, 2)
                    @test Dpar.reproducible(three) == 2
                    x, y = reference_batch()
                    for _ in 1:3
                        @test Dpar.train_step!(one, x, y) === Dpar.train_step!(three, x, y)
                    end
                    @test reinterpret(UInt32, Dpar.params(one, 0, n)) == reinterpret(UInt32, Dpar.params(three, 2, n))
                end
            end
        end
    end
    @testset "memory stats: each replica holds its parameters, the peak resets" begin
        Dpar.Model(3) do m
            reference_model(m)
            n = Dpar.num_param_elements(m)
            Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                x, y = reference_batch()
                Dpar.train_step!(e, x, y)
                for r in 0:1
                    s = Dpar.memory_stats(e, r)
                    @test s.allocated_bytes >= 2 * 4 * n
                    @test s.peak_bytes >= s.allocated_bytes
                    Dpar.reset_peak_memory!(e, r)
                    s = Dpar.memory_stats(e, r)
                    @test s.peak_bytes == s.allocated_bytes
                end
                for call in (() -> Dpar.memory_stats(e, 2), () -> Dpar.reset_peak_memory!(e, 2))
                    err = try call(); nothing catch ex; ex end
                    @test err isa DparError && err.status == Dpar.ERR_INVALID_ARGUMENT &&
                          occursin("replica: 2", err.message)
                end
            end
        end
    end
    @testset "gradient clipping and the reported norm" begin
        Dpar.Model(7) do m
            reference_model(m)
            opts = (lr=0.1, momentum=0.9, devices=2, processes=Dpar.PROCESSES_SINGLE)
            Dpar.Engine(m; opts...) do plain
                Dpar.Engine(m; opts...) do clipping
                    x, y = reference_batch()
                    @test isnan(Dpar.grad_norm(clipping))
                    Dpar.set_max_grad_norm!(clipping, 1e6)  # far above the norm: the same step
                    Dpar.train_step!(plain, x, y); Dpar.train_step!(clipping, x, y)  # a loss precedes its update
                    @test Dpar.train_step!(plain, x, y) == Dpar.train_step!(clipping, x, y)
                    norm = Dpar.grad_norm(clipping)
                    @test 0 < norm < 1e6
                    Dpar.set_max_grad_norm!(clipping, norm / 10)
                    Dpar.train_step!(plain, x, y); Dpar.train_step!(clipping, x, y)  # a loss precedes its update
                    @test Dpar.train_step!(plain, x, y) != Dpar.train_step!(clipping, x, y)
                    err = try Dpar.set_max_grad_norm!(clipping, -1); nothing catch ex; ex end
                    @test err isa DparError && occursin("max_grad_norm", err.message)
                end
            end
        end
    end
    # set_gradient_reduction!: the engine's trace shows its buckets reduce-scattered (ZeRO-2), and without clipping
    # it trains to the bits of the all-reduce, over several buckets split unevenly between 2 CPU devices, switching
    # between steps included; an unknown reduction is refused with dpar's message.
    @testset "the reduce-scatter trains to the bits of the all-reduce" begin
        @test (Dpar.REDUCTION_ALL_REDUCE, Dpar.REDUCTION_REDUCE_SCATTER, Dpar.REDUCTION_ALL_REDUCE_SHARDED) == (0, 1, 2)
        Dpar.Model(11) do m
            Dpar.linear!(m, 6, 16); Dpar.activation!(m, Dpar.RELU)
            Dpar.linear!(m, 16, 8); Dpar.activation!(m, Dpar.RELU); Dpar.linear!(m, 8, 3)
            n = Dpar.num_param_elements(m)
            # 128-byte buckets: 32 gradients each, several buckets, most of them not a multiple of 2.
            options = (optimizer=Dpar.ADAM, lr=0.01, devices=2, processes=Dpar.PROCESSES_SINGLE,
                       first_bucket_bytes=128, bucket_cap_bytes=128)
            Dpar.Engine(m; options...) do all_reduce
                Dpar.Engine(m; options...) do scatter
                    Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_REDUCE_SCATTER)
                    Dpar.set_gradient_reduction!(all_reduce, Dpar.REDUCTION_ALL_REDUCE)  # the default, set again
                    @test Dpar.num_buckets(scatter) > 2
                    initial = Dpar.params(all_reduce, 0, n)
                    for step in 0:5
                        # switching between steps (one process: the sharded all-reduce has the same shards)
                        step == 3 && Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_ALL_REDUCE_SHARDED)
                        step == 4 && Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_ALL_REDUCE)
                        step == 5 && Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_REDUCE_SCATTER)
                        x, y = reduction_batch(step)
                        if step == 0
                            # The setting reached dpar: its buckets are reduce-scattered, the other's all-reduced.
                            la, trace_all = traced_step(all_reduce, x, y)
                            ls, trace_scatter = traced_step(scatter, x, y)
                            @test occursin("\"bucket reduce-scatter\"", trace_scatter)
                            @test !occursin("\"bucket all-reduce\"", trace_scatter)
                            @test occursin("\"bucket all-reduce\"", trace_all)
                            @test !occursin("\"bucket reduce-scatter\"", trace_all)
                        else
                            la, ls = Dpar.train_step!(all_reduce, x, y), Dpar.train_step!(scatter, x, y)
                        end
                        @test reinterpret(UInt32, la) == reinterpret(UInt32, ls)
                    end
                    trained = Dpar.params(all_reduce, 0, n)
                    @test trained != initial
                    for replica in 0:1, e in (all_reduce, scatter)
                        @test reinterpret(UInt32, Dpar.params(e, replica, n)) == reinterpret(UInt32, trained)
                    end
                    for bad in (3, -1)
                        @test throws_dpar(() -> Dpar.set_gradient_reduction!(scatter, bad),
                                          Dpar.ERR_INVALID_ARGUMENT, "reduction")
                    end
                end
            end
        end
    end
    # set_loss_scaling!: a power-of-two scale trains as none, bit for bit; a NaN in a batch skips its step.
    @testset "loss scaling skips an overflowed step" begin
        Dpar.Model(7) do m
            Dpar.linear!(m, 6, 3)
            options = (optimizer=Dpar.ADAM, lr=0.01, devices=2, processes=Dpar.PROCESSES_SINGLE)
            Dpar.Engine(m; options...) do plain
                Dpar.Engine(m; options...) do scaled
                    @test Dpar.loss_scale(scaled) == 1
                    @test throws_dpar(() -> Dpar.set_loss_scaling!(scaled, 1024; backoff_factor=1.5),
                                      Dpar.ERR_INVALID_ARGUMENT, "backoff_factor")
                    Dpar.set_loss_scaling!(scaled, 1024; growth_interval=2)
                    for step in 0:1
                        x, y = reduction_batch(step)
                        Dpar.train_step!(plain, x, y); Dpar.train_step!(scaled, x, y)
                        @test !Dpar.last_step_skipped(scaled)
                    end
                    @test reinterpret(UInt32, Dpar.params(plain, 0, 21)) == reinterpret(UInt32, Dpar.params(scaled, 0, 21))
                    @test Dpar.loss_scale(scaled) == 2048
                    xs = zeros(Float32, 6, 11); xs[1, 1] = NaN32
                    _, y = reduction_batch(0)
                    before = Dpar.params(scaled, 0, 21)
                    Dpar.train_step!(scaled, Dpar.Tensor(xs), y)
                    @test Dpar.last_step_skipped(scaled)
                    @test Dpar.loss_scale(scaled) == 1024
                    @test Dpar.step_count(scaled) == 2
                    @test reinterpret(UInt32, Dpar.params(scaled, 0, 21)) == reinterpret(UInt32, before)
                end
            end
        end
    end
    # set_weight_decay_exclusion!: the bias steps without decay, the weights as before, bit for bit.
    @testset "biases and norms can be excluded from weight decay" begin
        Dpar.Model(7) do m
            Dpar.linear!(m, 6, 3); Dpar.batchnorm1d!(m, 3)
            @test [Dpar.param_decays(m, i) for i in 0:3] == [true, false, false, false]
            @test throws_dpar(() -> Dpar.param_decays(m, 4), Dpar.ERR_INVALID_ARGUMENT, "index")
        end
        Dpar.Model(7) do m
            Dpar.linear!(m, 6, 3)
            options = (optimizer=Dpar.ADAMW, lr=0.1, weight_decay=0.5, devices=2, processes=Dpar.PROCESSES_SINGLE)
            Dpar.Engine(m; options...) do plain
                Dpar.Engine(m; options...) do excluding
                    Dpar.set_weight_decay_exclusion!(excluding, true)
                    @test throws_dpar(() -> Dpar.set_weight_decay_exclusion!(excluding, 2), Dpar.ERR_INVALID_ARGUMENT,
                                      "exclude_biases_and_norms")
                    x, y = reduction_batch(0)
                    Dpar.train_step!(plain, x, y); Dpar.train_step!(excluding, x, y)
                    a, b = Dpar.params(plain, 0, 21), Dpar.params(excluding, 0, 21)
                    @test reinterpret(UInt32, a[1:18]) == reinterpret(UInt32, b[1:18])
                    for i in 19:21
                        @test a[i] != b[i]  # the bias stepped without decay
                    end
                end
            end
        end
    end
    @testset "every optimizer and engine option reaches dpar" begin
        # Each keyword changes the parameters after a few steps; one dropped on the way would not.
        function params_after(; kw...)
            Dpar.Model(7) do m
                reference_model(m)
                Dpar.Engine(m; devices=2, processes=Dpar.PROCESSES_SINGLE, kw...) do e
                    x, y = reference_batch()
                    for _ in 1:3
                        Dpar.train_step!(e, x, y)
                    end
                    Dpar.params(e, 0, Dpar.num_param_elements(m))
                end
            end
        end
        adam = (optimizer=Dpar.ADAM, lr=0.01)
        base = params_after(; adam...)
        for kw in [(beta1=0.5,), (beta2=0.9,), (eps=0.1,), (weight_decay=0.5,)]
            @test params_after(; adam..., kw...) != base
        end
        @test params_after(; adam..., beta1=0.9, beta2=0.999, eps=1e-8) == base  # dpar's defaults, spelled out
        sgd = (lr=0.1, momentum=0.9)
        base = params_after(; sgd...)
        for kw in [(dampening=0.5,), (nesterov=true,), (weight_decay=0.5,)]
            @test params_after(; sgd..., kw...) != base
        end
        Dpar.Model(7) do m
            reference_model(m)
            Dpar.Engine(m; device_ids=[1, 0, 1], output_device=1, first_bucket_bytes=64, bucket_cap_bytes=64,
                        blas_threads=1, pin_workers=false, timeout_seconds=30, processes=Dpar.PROCESSES_SINGLE) do e
                @test Dpar.num_replicas(e) == 3
                @test Dpar.replica_device(e, 0).index == 1
                @test Dpar.num_buckets(e) > 1
            end
            # create_timeout_seconds: refused by its name when negative or NaN; a finite or infinite one gives an
            # engine that trains.
            for bad in (-1, NaN)
                @test throws_dpar(() -> Dpar.Engine(m; devices=2, processes=Dpar.PROCESSES_SINGLE,
                                                    create_timeout_seconds=bad),
                                  Dpar.ERR_INVALID_ARGUMENT, "create_timeout_seconds")
            end
            for good in (30, Inf)
                Dpar.Engine(m; devices=2, processes=Dpar.PROCESSES_SINGLE, timeout_seconds=60,
                            create_timeout_seconds=good) do e
                    loss = Dpar.train_step!(e, reference_batch()...)
                    @test isfinite(loss) && loss > 0
                end
            end
        end
    end
    if VERSION >= v"1.9"
        @testset "a hook's exception comes back with its message" begin
            Dpar.Model(7) do m
                reference_model(m)
                Dpar.Engine(m; devices=2) do e
                    x, y = reference_batch()
                    Dpar.set_forward_hook!(e, (r, i, o) ->
                        r == 1 ? throw(DparError(Dpar.ERR_DEVICE, "the Julia probe failed")) : nothing)
                    err = try Dpar.train_step!(e, x, y); nothing catch ex; ex end
                    @test err isa DparError && err.status == Dpar.ERR_DEVICE
                    @test occursin("the Julia probe failed", err.message)
                end
            end
        end
    end

    @testset "collectives over $n members" for n in 2:4
        if !threads_for(n, "a group of $n members")
            @test_skip Threads.nthreads() >= n
        else
            results = Dpar.CommGroup(n; timeout_seconds=60) do group
                on_each_member(group, n) do c
                    r = Dpar.rank(c)
                    all_reduced = Dict()
                    for T in DTYPES, op in OPS
                        all_reduced[(T, op)] = Dpar.all_reduce!(c, zeros(T, 5), [contribution(T, r, i) for i in 1:5];
                                                                op=op)
                    end
                    in_place = Dpar.all_reduce!(c, [contribution(Float64, r, i) for i in 1:5]; op=+)
                    bcast = Dict(T => Dpar.broadcast!(c, fill(T(10r + 1), 3); root=n - 1) for T in DTYPES)
                    reduced_max = Dict(T => Dpar.reduce!(c, r == 1 ? fill(T(-7), 4) : nothing,
                                                         [contribution(T, r, i) for i in 1:4]; op=max, root=1)
                                       for T in DTYPES)
                    reduced_sum = Dpar.reduce!(c, fill(-7, 4), [contribution(Int64, r, i) for i in 1:4])
                    gathered = Dict(T => Dpar.all_gather!(c, zeros(T, 3, n), T[100r + i for i in 1:3]) for T in DTYPES)
                    # Block b of participant r holds 10 r + 3 b + e at element e: a wrong block or rank shows.
                    blocks(T) = T[10r + 3b + e for e in 0:1, b in 0:n-1]
                    scattered = Dict((T, op) => Dpar.reduce_scatter!(c, zeros(T, 2), blocks(T); op=op)
                                     for T in DTYPES, op in (Dpar.SUM, Dpar.MEAN))
                    if r == 0
                        sleep(0.2)  # the others wait in the barrier by now, blocked inside dpar
                        GC.gc()     # which stops every thread: those in dpar let it, being GC-safe
                    end
                    Dpar.barrier(c)
                    (rank=r, size=Dpar.nranks(c), device=Dpar.device(c), all_reduced=all_reduced, in_place=in_place,
                     bcast=bcast, reduced_max=reduced_max, reduced_sum=reduced_sum, gathered=gathered,
                     scattered=scattered)
                end
            end
            for (k, got) in enumerate(results)
                r = k - 1
                @test (got.rank, got.size, got.device) == (r, n, Dpar.DparDevice(0, 0))
                for T in DTYPES, op in OPS
                    @test got.all_reduced[(T, op)] == [reduced(T, op, n, i) for i in 1:5]
                end
                @test got.in_place == [reduced(Float64, Dpar.SUM, n, i) for i in 1:5]
                for T in DTYPES
                    @test got.bcast[T] == fill(T(10(n - 1) + 1), 3)
                    @test got.reduced_max[T] == (r == 1 ? [reduced(T, Dpar.MAX, n, i) for i in 1:4] : nothing)
                    @test got.gathered[T] == T[100p + i for i in 1:3, p in 0:n-1]
                    for op in (Dpar.SUM, Dpar.MEAN)
                        sums = [sum(T(10p + 3r + e) for p in 0:n-1) for e in 0:1]
                        @test got.scattered[(T, op)] == (op == Dpar.SUM ? sums : [mean_of(T, s, n) for s in sums])
                    end
                end
                # The root's recv gets the sum; the others' is left as it was.
                @test got.reduced_sum == (r == 0 ? [reduced(Int64, Dpar.SUM, n, i) for i in 1:4] : fill(-7, 4))
            end
        end
    end

    @testset "a group on CPU devices: its buffers' device, and pointers" begin
        if !threads_for(2, "a group of 2 members")
            @test_skip Threads.nthreads() >= 2
        else
            results = Dpar.CommGroup(["cpu:0", Dpar.DparDevice(0, 1)]; timeout_seconds=60) do group
                on_each_member(group, 2) do c
                    r = Dpar.rank(c)
                    x = fill(Float64(r + 1), 4)
                    send, recv = Int32[r, 10r], zeros(Int32, 4)
                    GC.@preserve x send recv begin
                        Dpar.all_reduce!(c, pointer(x), length(x); op=Dpar.MAX)
                        Dpar.all_gather!(c, pointer(recv), pointer(send), length(send))
                    end
                    (device=Dpar.device(c), x=x, gathered=recv)
                end
            end
            for (k, got) in enumerate(results)
                @test got.device == Dpar.DparDevice(0, k - 1)
                @test got.x == fill(2.0, 4)
                @test got.gathered == Int32[0, 0, 1, 10]
            end
        end
    end

    @testset "an abort releases every member and shows as an asynchronous error" begin
        n = 3
        if !threads_for(n, "a group of $n members")
            @test_skip Threads.nthreads() >= n
        else
            results = Dpar.CommGroup(n; timeout_seconds=60) do group
                on_each_member(group, n) do c
                    before = Dpar.async_error(c)
                    Dpar.barrier(c)  # every member asked before the abort
                    Dpar.rank(c) == n - 1 && Dpar.abort(c, "the input pipeline died")
                    err = try Dpar.barrier(c); nothing catch e; e end
                    (before=before, err=err, after=Dpar.async_error(c))
                end
            end
            for got in results
                @test got.before === nothing
                @test got.err isa DparError && got.err.status == Dpar.ERR_REMOTE
                @test occursin("the input pipeline died", got.err.message)
                @test got.after isa DparError && got.after.status == Dpar.ERR_REMOTE
                @test occursin("participant $(n - 1) called dpar_comm_abort", got.after.message)
            end
        end
    end

    @testset "members that disagree all throw a mismatch naming the one that differs" begin
        if !threads_for(2, "a group of 2 members")
            @test_skip Threads.nthreads() >= 2
        else
            errs = Dpar.CommGroup(2; timeout_seconds=60) do group
                on_each_member(group, 2) do c
                    x = zeros(Float32, Dpar.rank(c) == 0 ? 100 : 200)
                    try Dpar.all_reduce!(c, x); nothing catch e; e end
                end
            end
            for err in errs
                @test err isa DparError && err.status == Dpar.ERR_MISMATCH
                @test occursin("all_reduce", err.message) && occursin("participant 1", err.message)
            end
        end
    end

    @testset "asynchronous work" begin
        if !threads_for(2, "a group of 2 members")
            @test_skip Threads.nthreads() >= 2
        else
            results = Dpar.CommGroup(2; timeout_seconds=60) do group
                on_each_member(group, 2) do c
                    r = Dpar.rank(c)
                    a = fill(Float32(r + 1), 4096)
                    v, vmax = fill(Int64(10(r + 1)), 4096), zeros(Int64, 4096)
                    wa = Dpar.all_reduce_async!(c, a)
                    wb = Dpar.all_reduce_async!(c, vmax, v; op=Dpar.MAX)
                    wait(wb)
                    a_done_first = isready(wa)  # they run in the order they were started
                    wait(wa)
                    a_done = isready(wa)
                    # The work holds the array it writes: one that only the work refers to outlives a collection.
                    w, weak = unreferenced_all_reduce(c, Float64(r + 1))
                    GC.gc()
                    kept = weak.value
                    wait(w)
                    bc = fill(Int32(r + 5), 3)
                    wait(Dpar.broadcast_async!(c, bc; root=1))
                    gathered = zeros(Float32, 2, 2)
                    wait(Dpar.all_gather_async!(c, gathered, Float32[r, -r]))
                    scattered = zeros(Float64, 2)
                    wait(Dpar.reduce_scatter_async!(c, scattered, Float64[10r + 3b + e for e in 0:1, b in 0:1];
                                                    op=Dpar.MEAN))
                    x = Float32[r, r]
                    GC.@preserve x wait(Dpar.all_reduce_async!(c, pointer(x), length(x); op=Dpar.MIN))
                    closed = Dpar.all_reduce_async!(c, fill(1.0f0, 2))
                    close(closed)  # waits for it
                    close(closed)  # does nothing
                    err = try wait(closed); nothing catch e; e end
                    (a=a, vmax=vmax, a_done_first=a_done_first, a_done=a_done, kept=kept, bc=bc,
                     gathered=gathered, scattered=scattered, x=x, err=err)
                end
            end
            for (k, got) in enumerate(results)
                r = k - 1
                @test got.a == fill(3.0f0, 4096)
                @test got.vmax == fill(20, 4096)
                @test got.a_done_first && got.a_done
                @test got.kept !== nothing && got.kept == fill(3.0, 1 << 16)
                @test got.bc == fill(Int32(6), 3)
                @test got.gathered == Float32[0 1; 0 -1]
                @test got.scattered == [mean_of(Float64, 10 + 2 * (3r + e), 2) for e in 0:1]
                @test got.x == Float32[0, 0]
                @test got.err isa DparError && got.err.status == Dpar.ERR_INVALID_ARGUMENT
                @test occursin("work", got.err.message)
            end
        end
    end

    @testset "the reducer sums what each member produced, in its own order, step after step" begin
        n = Threads.nthreads() >= 4 ? 4 : 2
        if !threads_for(n, "a group of $n members")
            @test_skip Threads.nthreads() >= n
        else
            sizes = [300, 7, 1200, 64, 513]
            results = Dpar.CommGroup(n; timeout_seconds=60) do group
                on_each_member(group, n) do c
                    r = Dpar.rank(c)
                    grads = [zeros(Float32, s) for s in sizes]
                    red = Dpar.Reducer(c, grads; first_bucket_bytes=256, bucket_cap_bytes=2048, op=Dpar.SUM)
                    buckets = Dpar.num_buckets(red)
                    steps = []
                    for step in 0:2
                        # Backward's order, and another on odd members. Member 1 has no data in step 1, and the last
                        # member never produces gradient 1 (an unused parameter): a gradient never marked counts
                        # as zeros, whatever its buffer holds.
                        for k in (isodd(r) ? [2, 3, 4, 1, 0] : [4, 3, 2, 1, 0])
                            if (r == 1 && step == 1) || (r == n - 1 && k == 1)
                                fill!(grads[k + 1], NaN32)
                                continue
                            end
                            fill!(grads[k + 1], grad_value(r, k, step))
                            # Marked by the array, or by dpar's index.
                            isodd(k) ? Dpar.grad_ready!(red, grads[k + 1]) : Dpar.grad_ready!(red, k)
                        end
                        wait(red)
                        push!(steps, copy.(grads))
                    end
                    close(red)
                    (buckets=buckets, steps=steps)
                end
            end
            for got in results
                @test got.buckets >= 3
                for step in 0:2, k in 0:4
                    total = sum(Float32[grad_value(p, k, step) for p in 0:n-1
                                        if !(p == 1 && step == 1) && !(p == n - 1 && k == 1)])
                    @test got.steps[step + 1][k + 1] == fill(total, sizes[k + 1])
                end
            end
        end
    end

    @testset "the reducer holds its arrays, averages by default, and takes pointers on a group on devices" begin
        if !threads_for(2, "a group of 2 members")
            @test_skip Threads.nthreads() >= 2
        else
            results = Dpar.CommGroup(["cpu:0", "cpu:1"]; timeout_seconds=60) do group
                on_each_member(group, 2) do c
                    r = Dpar.rank(c)
                    # An array that only the reducer refers to outlives a collection.
                    red, weak = unreferenced_reducer(c, 100)
                    GC.gc()
                    g = weak.value
                    g === nothing || fill!(g, r + 1)
                    Dpar.grad_ready!(red, 0)
                    wait(red)
                    close(red)
                    # Pointers with their counts, as a CuArray's would be over GPUs.
                    bufs = [fill(Float32(r + 1), 7), fill(Float32(10(r + 1)), 15)]
                    GC.@preserve bufs begin
                        Dpar.Reducer(c, Ptr{Float32}[pointer(b) for b in bufs], length.(bufs); op=Dpar.SUM) do pr
                            Dpar.grad_ready!(pr, 1)
                            Dpar.grad_ready!(pr, 0)
                            wait(pr)
                        end
                    end
                    (mean=g, bufs=bufs)
                end
            end
            for got in results
                @test got.mean == fill(1.5f0, 100)
                @test got.bufs == [fill(3.0f0, 7), fill(30.0f0, 15)]
            end
        end
    end

    @testset "a reducer over the processes of a job of one gives the group's mean, which bf16 does not round" begin
        if !threads_for(2, "a group of 2 members")
            @test_skip Threads.nthreads() >= 2
        else
            # Without mpirun, mpi_comm() is rank 0 of 1: nothing crosses the processes. Values that bfloat16 cannot
            # hold (1/1024 beside 1 to 4) show any rounding.
            processes = Dpar.mpi_comm(; timeout_seconds=30)
            @test (Dpar.rank(processes), Dpar.nranks(processes)) == (0, 1)
            results = Dpar.CommGroup(2; timeout_seconds=60) do group
                on_each_member(group, 2) do c
                    r = Dpar.rank(c)
                    grads = [zeros(Float32, 300), zeros(Float32, 15)]
                    Dpar.Reducer(c, grads; first_bucket_bytes=32, bucket_cap_bytes=256, op=Dpar.MEAN,
                                 processes=processes, compression=Dpar.COMPRESSION_BF16) do red
                        for k in (1, 0)
                            fill!(grads[k + 1], r + 1 + 2k + 1.0f0 / 1024)
                            Dpar.grad_ready!(red, k)
                        end
                        wait(red)
                        (buckets=Dpar.num_buckets(red), grads=grads)
                    end
                end
            end
            close(processes)
            for got in results
                @test got.buckets == 2
                @test got.grads == [fill(1.5f0 + 1.0f0 / 1024, 300), fill(3.5f0 + 1.0f0 / 1024, 15)]
            end
        end
    end

    @testset "collectives and the reducer refuse bad arguments with dpar's message" begin
        @test throws_dpar(() -> Dpar.CommGroup(0), Dpar.ERR_INVALID_ARGUMENT, "size")
        @test throws_dpar(() -> Dpar.CommGroup(2; timeout_seconds=-1), Dpar.ERR_INVALID_ARGUMENT, "timeout_seconds")
        @test throws_dpar(() -> Dpar.CommGroup(["cpu:0", "cpu:1"]; streams=[C_NULL]), Dpar.ERR_INVALID_ARGUMENT,
                          "streams: 1 streams for 2 devices")
        @test throws_dpar(() -> Dpar.CommGroup(["cpu:0"]; streams=[Ptr{Cvoid}(UInt(0x1234))]),
                          Dpar.ERR_INVALID_ARGUMENT, "streams[0]")
        @test throws_dpar(() -> Dpar.CommGroup([Dpar.DparDevice(0, 0), Dpar.DparDevice(0, -1)]),
                          Dpar.ERR_INVALID_ARGUMENT, "devices[1]")
        Dpar.CommGroup(1; timeout_seconds=30) do g
            @test throws_dpar(() -> Dpar.member(g, 1), Dpar.ERR_INVALID_ARGUMENT, "rank")
            c = Dpar.member(g, 0)
            x = Float32[1, 2, 3, 4]
            @test throws_dpar(() -> Dpar.broadcast!(c, x; root=1), Dpar.ERR_INVALID_ARGUMENT, "root")
            @test throws_dpar(() -> Dpar.reduce!(c, nothing, x; root=2), Dpar.ERR_INVALID_ARGUMENT, "root")
            # Lengths are checked before any participant waits for the others.
            @test throws_dpar(() -> Dpar.all_reduce!(c, zeros(Float32, 3), x), Dpar.ERR_INVALID_ARGUMENT,
                              "recv: 3 elements, expected 4")
            @test throws_dpar(() -> Dpar.all_gather!(c, zeros(Float32, 3), x), Dpar.ERR_INVALID_ARGUMENT,
                              "recv: 3 elements, expected 4")
            @test throws_dpar(() -> Dpar.reduce_scatter!(c, zeros(Float32, 2), Float32[1, 2, 3]),
                              Dpar.ERR_INVALID_ARGUMENT, "send: 3 elements, expected 2")
            @test throws_dpar(() -> Dpar.reduce_scatter_async!(c, zeros(Float32, 2), Float32[1, 2, 3]),
                              Dpar.ERR_INVALID_ARGUMENT, "send: 3 elements, expected 2")
            @test throws_dpar(() -> Dpar.broadcast_async!(c, x; root=1), Dpar.ERR_INVALID_ARGUMENT, "root")
            grad, other = zeros(Float32, 4), zeros(Float32, 4)
            @test throws_dpar(() -> Dpar.Reducer(c, [grad]; op=Dpar.MAX), Dpar.ERR_INVALID_ARGUMENT, "opts.op")
            # Refusals that show that processes and compression reach dpar.
            @test throws_dpar(() -> Dpar.Reducer(c, [grad]; processes=c), Dpar.ERR_INVALID_ARGUMENT,
                              "opts.processes: is the reducer's own communicator")
            @test throws_dpar(() -> Dpar.Reducer(c, [grad]; compression=7), Dpar.ERR_INVALID_ARGUMENT,
                              "opts.compression: 7")
            Dpar.CommGroup(1) do other
                closed = Dpar.member(other, 0)
                close(closed)
                @test throws_dpar(() -> Dpar.Reducer(c, [grad]; processes=closed), Dpar.ERR_INVALID_ARGUMENT,
                                  "processes: the communicator is closed")
            end
            @test throws_dpar(() -> GC.@preserve(grad, other, Dpar.Reducer(c, [pointer(grad), pointer(other)], [4, 0])),
                              Dpar.ERR_INVALID_ARGUMENT, "counts[1]")
            @test throws_dpar(() -> Dpar.Reducer(c, [grad, grad]), Dpar.ERR_INVALID_ARGUMENT, "overlap")
            @test throws_dpar(() -> Dpar.Reducer(c, [pointer(grad)], [4, 4]), Dpar.ERR_INVALID_ARGUMENT,
                              "counts: 2 elements, expected 1")
            Dpar.Reducer(c, [grad]) do red
                Dpar.grad_ready!(red, 0)
                @test throws_dpar(() -> Dpar.grad_ready!(red, grad), Dpar.ERR_INVALID_STATE, "twice")
                @test throws_dpar(() -> Dpar.grad_ready!(red, 1), Dpar.ERR_INVALID_ARGUMENT, "out of range")
                @test throws_dpar(() -> Dpar.grad_ready!(red, other), Dpar.ERR_INVALID_ARGUMENT,
                                  "not one of the reducer's buffers")
                wait(red)  # the step went on
            end
            red = Dpar.Reducer(c, [grad])
            close(red)
            @test throws_dpar(() -> wait(red), Dpar.ERR_INVALID_ARGUMENT, "reducer")
            # The communicator still works after the refusals, and a group of one is the identity.
            @test Dpar.all_reduce!(c, copy(x); op=Dpar.MEAN) == x
            @test (Dpar.rank(c), Dpar.nranks(c)) == (0, 1)
            close(c)
            @test throws_dpar(() -> Dpar.barrier(c), Dpar.ERR_INVALID_ARGUMENT, "comm")
            close(c)  # a second close does nothing
        end
    end

    @testset "datasets and the loader" begin
        mktempdir() do dir
            images, labels = write_dataset(dir)
            Dpar.Dataset(images, labels) do d
                @test Dpar.info(d) == (samples=10, features=6, classes=4)
                # In order: the plain pass over the samples, 4 at a time, the last batch short.
                plain = Dpar.Loader(d, 4) do l
                    @test Dpar.num_batches(l) == 3
                    got = copies(l)
                    @test isempty(copies(l))  # the epoch is over until another starts
                    @test copies(Dpar.start_epoch!(l, 1)) == got  # without shuffle every epoch is the same
                    got
                end
                @test [size(x, 2) for (x, _) in plain] == [4, 4, 2]
                @test reduce(hcat, first.(plain)) == reduce(hcat, pixels.(0:9))
                @test reduce(vcat, last.(plain)) == label.(0:9)
                Dpar.Loader(d, 4; drop_last=true) do l
                    @test Dpar.num_batches(l) == 2
                    @test [size(x, 2) for (x, _) in copies(l)] == [4, 4]
                end
                # Shuffled: each epoch a permutation of the samples, each label with its sample.
                shuffled = Dpar.Loader(d, 4; shuffle=true, seed=3) do l
                    [copies(Dpar.start_epoch!(l, epoch)) for epoch in 0:1]
                end
                for epoch in shuffled
                    xs, ys = reduce(hcat, first.(epoch)), reduce(vcat, last.(epoch))
                    order = [sample_of(xs[:, k]) for k in 1:size(xs, 2)]
                    @test sort(order) == 0:9
                    @test xs == reduce(hcat, pixels.(order)) && ys == label.(order)
                end
                @test shuffled[1] != shuffled[2]
                # The order is a function of (seed, epoch) alone; batches prepared ahead on a device are the same,
                # bit for bit.
                Dpar.Loader(d, 4; shuffle=true, seed=3) do l
                    Dpar.to_device!(l, "cpu:0")
                    @test [copies(Dpar.start_epoch!(l, epoch)) for epoch in 0:1] == shuffled
                end
                # Two shards of each batch make the batch.
                parts = [Dpar.Loader(l -> copies(Dpar.shard!(l, s, 2)), d, 4; shuffle=true, seed=3) for s in 0:1]
                @test length(parts[1]) == length(parts[2]) == 3
                for b in 1:3
                    @test hcat(parts[1][b][1], parts[2][b][1]) == shuffled[1][b][1]
                    @test vcat(parts[1][b][2], parts[2][b][2]) == shuffled[1][b][2]
                end
                # A borrowed batch trains an engine as a copy of it does.
                losses = map((true, false)) do borrowed
                    Dpar.Model(5) do m
                        Dpar.linear!(m, 6, 4)
                        Dpar.Engine(m; lr=0.1, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                            Dpar.Loader(d, 4) do l
                                [borrowed ? Dpar.train_step!(e, x, y) :
                                            Dpar.train_step!(e, Dpar.Tensor(Array(x)), Dpar.Tensor(Array(y)))
                                 for (x, y) in l]
                            end
                        end
                    end
                end
                @test length(losses[1]) == 3 && losses[1] == losses[2]
                # Bad arguments.
                @test throws_dpar(() -> Dpar.Loader(d, 0), Dpar.ERR_INVALID_ARGUMENT, "batch_size")
                @test throws_dpar(() -> Dpar.Loader(d, 11; drop_last=true), Dpar.ERR_INVALID_ARGUMENT, "batch_size")
                Dpar.Loader(d, 4) do l
                    @test throws_dpar(() -> Dpar.shard!(l, 2, 2), Dpar.ERR_INVALID_ARGUMENT, "shard")
                    @test throws_dpar(() -> Dpar.shard!(l, 0, 5), Dpar.ERR_INVALID_ARGUMENT, "num_shards")
                    @test throws_dpar(() -> Dpar.to_device!(l, Dpar.DparDevice(7, 0)), Dpar.ERR_INVALID_ARGUMENT,
                                      "device")
                    x, _ = first(l)
                    close(l)
                    @test throws_dpar(() -> Array(x), Dpar.ERR_INVALID_ARGUMENT, "tensor")  # its loader is gone
                    @test throws_dpar(() -> Dpar.num_batches(l), Dpar.ERR_INVALID_ARGUMENT, "loader")
                end
                @test throws_dpar(() -> Dpar.normalize!(d, 0, 0), Dpar.ERR_INVALID_ARGUMENT, "std")
                # Standardised: (x - mean) / std, every feature.
                Dpar.normalize!(d, 0.5, 0.25)
                Dpar.Loader(d, SAMPLES) do l
                    x, _ = first(copies(l))
                    @test x == reduce(hcat, [(pixels(i) .- 0.5f0) ./ 0.25f0 for i in 0:9])
                end
            end
            missing_images = joinpath(dir, "missing-images-idx3-ubyte")
            @test throws_dpar(() -> Dpar.Dataset(missing_images, labels), Dpar.ERR_IO, missing_images)
            garbage = joinpath(dir, "garbage")
            write(garbage, "GIF89a and so on, not an IDX file")
            @test throws_dpar(() -> Dpar.Dataset(garbage, labels), Dpar.ERR_CORRUPT, garbage)
        end
    end

    @testset "the option structs have the library's layout" begin
        o = Ref(Dpar.CommOptions(0, 0, 0))
        @test ccall((:dpar_comm_options_init_sized, libdpar), Int32, (Ptr{Dpar.CommOptions}, Csize_t),
                    o, sizeof(Dpar.CommOptions)) == Dpar.OK
        @test (o[].size, o[].version, o[].timeout_seconds) == (sizeof(Dpar.CommOptions), Dpar.COMM_OPTIONS_VERSION, 300)
        r = Ref(Dpar.ReducerOptions(0, 0, 0, 0, 0, Ptr{Cvoid}(UInt(0x1234)), 7))
        @test ccall((:dpar_reducer_options_init_sized, libdpar), Int32, (Ptr{Dpar.ReducerOptions}, Csize_t),
                    r, sizeof(Dpar.ReducerOptions)) == Dpar.OK
        @test (r[].size, r[].version, r[].op) == (sizeof(Dpar.ReducerOptions), Dpar.REDUCER_OPTIONS_VERSION,
                                                     Int32(Dpar.MEAN))
        @test (r[].processes, r[].compression) == (C_NULL, Dpar.COMPRESSION_NONE)
        e = Dpar.EngineOptions()
        e.create_timeout_seconds = 7
        @test ccall((:dpar_engine_options_init_sized, libdpar), Int32, (Ref{Dpar.EngineOptions}, Csize_t),
                    e, sizeof(Dpar.EngineOptions)) == Dpar.OK
        @test (e.size, e.version) == (sizeof(Dpar.EngineOptions), Dpar.ENGINE_OPTIONS_VERSION)
        @test (e.timeout_seconds, e.create_timeout_seconds) == (300, 0)  # the appended field gets its default
    end
end
