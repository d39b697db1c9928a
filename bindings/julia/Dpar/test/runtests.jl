# Dpar.jl against dpar's C reference (tests/binding_reference.c): same model, data and seed on 2 CPU devices,
# same loss bits; a bad call throws DparError with dpar's message; a hook's exception comes back with its text.
using Dpar
using Test

reference_model(m) = (Dpar.linear!(m, 4, 8); Dpar.activation!(m, Dpar.RELU); Dpar.linear!(m, 8, 3))

function reference_batch()
    x = Float32[((i * 37) % 101) / 101 - 0.5 for i in 0:39]
    (Dpar.Tensor(reshape(x, 4, 10)), Dpar.Tensor(Int32[r % 3 for r in 0:9]))
end

@testset "Dpar" begin
    @testset "loss bits of the C reference" begin
        expected = split(read(ENV["DPAR_REFERENCE_LOSSES"], String))
        Dpar.Model(7) do m
            reference_model(m)
            Dpar.Engine(m; lr=0.1, momentum=0.9, devices=2, processes=Dpar.PROCESSES_SINGLE) do e
                x, y = reference_batch()
                got = [string(reinterpret(UInt32, Dpar.train_step!(e, x, y)), base=16, pad=8) for _ in 1:5]
                @test got == expected
                @test Dpar.step_count(e) == 5
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
    if VERSION >= v"1.9"
        @testset "a hook's exception comes back with its message" begin
            Dpar.Model(7) do m
                reference_model(m)
                Dpar.Engine(m; devices=2) do e
                    x, y = reference_batch()
                    Dpar.set_forward_hook!(e, (r, i, o) -> r == 1 ? throw(DparError(Dpar.ERR_DEVICE, "the Julia probe failed")) : nothing)
                    err = try Dpar.train_step!(e, x, y); nothing catch ex; ex end
                    @test err isa DparError && err.status == Dpar.ERR_DEVICE
                    @test occursin("the Julia probe failed", err.message)
                end
            end
        end
    end
end
