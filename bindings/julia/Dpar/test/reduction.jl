# set_gradient_reduction!: without clipping the reduce-scatter (ZeRO-2) trains to the bits of the all-reduce, over
# several buckets split unevenly between 2 CPU devices, switching between steps included; an unknown reduction is
# refused with dpar's message. Included by runtests.jl, inside its testset (throws_dpar is defined there).

# Batch `step` of 11 rows of 6 features (6 and 5 per replica); a Julia matrix is (features, rows).
function reduction_batch(step)
    x = Float32[(((i + 7 * step) * 37) % 101) / 101 - 0.5 for i in 0:65]
    (Dpar.Tensor(reshape(x, 6, 11)), Dpar.Tensor(Int32[(r + step) % 3 for r in 0:10]))
end

@testset "the reduce-scatter trains to the bits of the all-reduce" begin
    @test (Dpar.REDUCTION_ALL_REDUCE, Dpar.REDUCTION_REDUCE_SCATTER) == (0, 1)
    Dpar.Model(11) do m
        Dpar.linear!(m, 6, 16); Dpar.activation!(m, Dpar.RELU)
        Dpar.linear!(m, 16, 8); Dpar.activation!(m, Dpar.RELU); Dpar.linear!(m, 8, 3)
        n = Dpar.num_param_elements(m)
        # 128-byte buckets: 32 gradients each, several buckets, most of them not a multiple of 2.
        options = (optimizer=Dpar.ADAM, lr=0.01, devices=2, processes=Dpar.PROCESSES_SINGLE, first_bucket_bytes=128,
                   bucket_cap_bytes=128)
        Dpar.Engine(m; options...) do all_reduce
            Dpar.Engine(m; options...) do scatter
                Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_REDUCE_SCATTER)
                Dpar.set_gradient_reduction!(all_reduce, Dpar.REDUCTION_ALL_REDUCE)  # the default, set again
                @test Dpar.num_buckets(scatter) > 2
                initial = Dpar.params(all_reduce, 0, n)
                for step in 0:5
                    step == 4 && Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_ALL_REDUCE)  # between steps
                    step == 5 && Dpar.set_gradient_reduction!(scatter, Dpar.REDUCTION_REDUCE_SCATTER)
                    x, y = reduction_batch(step)
                    @test reinterpret(UInt32, Dpar.train_step!(all_reduce, x, y)) ==
                          reinterpret(UInt32, Dpar.train_step!(scatter, x, y))
                end
                trained = Dpar.params(all_reduce, 0, n)
                @test trained != initial
                for replica in 0:1, e in (all_reduce, scatter)
                    @test reinterpret(UInt32, Dpar.params(e, replica, n)) == reinterpret(UInt32, trained)
                end
                for bad in (2, -1)
                    @test throws_dpar(() -> Dpar.set_gradient_reduction!(scatter, bad), Dpar.ERR_INVALID_ARGUMENT,
                                      "reduction")
                end
            end
        end
    end
end
