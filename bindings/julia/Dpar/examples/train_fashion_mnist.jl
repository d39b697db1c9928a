# Trains an MLP (or, with "cnn" as the third argument, the small residual CNN of examples/c/fashion_cnn.h:
# convolutions, BatchNorm, max pooling, a basic block, torchvision's names) on Fashion-MNIST over every CPU device,
# evaluates it, saves a checkpoint and reloads it into a fresh engine, which must evaluate the same. Run:
#     julia --project=bindings/julia/Dpar bindings/julia/Dpar/examples/train_fashion_mnist.jl [data directory] \
#         [epochs] [mlp|cnn]
using Dpar

const DATA = get(ARGS, 1, "/usr/share/datasets/fashion-mnist")
const EPOCHS = parse(Int, get(ARGS, 2, "2"))
const MODEL = get(ARGS, 3, "mlp")

mlp(m) = (linear!(m, 784, 256); activation!(m, Dpar.RELU); linear!(m, 256, 128); activation!(m, Dpar.RELU);
          linear!(m, 128, 10))

# A 3x3 convolution without bias, then its BatchNorm, each named as torchvision names them.
function conv_bn!(m, conv, bn, cin, cout)
    conv2d!(m, cin, cout, 3; padding=1, bias=false)
    set_node_name!(m, last_node(m), conv)
    batchnorm2d!(m, cout)
    set_node_name!(m, last_node(m), bn)
end

# conv1, bn1, relu, max pool; a basic block (layer1.0) with its shortcut; max pool, flatten, fc.
function cnn(m)
    add_reshape!(m, [1, 28, 28])
    conv_bn!(m, "conv1", "bn1", 1, 32)
    activation!(m, Dpar.RELU)
    max_pool2d!(m, 2)
    shortcut = last_node(m)
    conv_bn!(m, "layer1.0.conv1", "layer1.0.bn1", 32, 32)
    activation!(m, Dpar.RELU)
    conv_bn!(m, "layer1.0.conv2", "layer1.0.bn2", 32, 32)
    add_sum!(m, [last_node(m), shortcut])
    activation!(m, Dpar.RELU)
    max_pool2d!(m, 2)
    add_flatten!(m)
    linear!(m, 32 * 7 * 7, 10)
    set_node_name!(m, last_node(m), "fc")
end

build(m) = MODEL == "cnn" ? cnn(m) : mlp(m)

# The share of `data`'s samples whose largest output is their label, in eval mode, batch by batch.
function accuracy(engine, data)
    set_training!(engine, false)
    right = total = 0
    Loader(data, 1000) do batches
        for (x, y) in batches
            out, labels = Array(forward(engine, x)), Array(y)   # out is classes x b
            right += count(i -> argmax(view(out, :, i)) - 1 == labels[i], eachindex(labels))
            total += length(labels)
        end
    end
    set_training!(engine, true)
    right / total
end

Dataset(joinpath(DATA, "train-images-idx3-ubyte.gz"), joinpath(DATA, "train-labels-idx1-ubyte.gz")) do train
Dataset(joinpath(DATA, "t10k-images-idx3-ubyte.gz"), joinpath(DATA, "t10k-labels-idx1-ubyte.gz")) do test
    checkpoint = joinpath(mktempdir(), "fashion_mnist.ckpt")
    Model(42) do model
        build(model)
        Engine(model; optimizer=Dpar.ADAM, lr=1e-3, seed=42) do engine
            println("dpar ", Dpar.version_string(), " on ", num_replicas(engine), " CPU devices (",
                    Dpar.cpu_gemm_backend(), ")")
            Loader(train, 256; shuffle=true, seed=42) do loader
                for epoch in 0:EPOCHS-1
                    start_epoch!(loader, epoch)
                    loss = 0.0
                    for (x, y) in loader
                        loss += train_step!(engine, x, y)
                    end
                    println("epoch $(epoch + 1): loss $(round(loss / num_batches(loader), digits=4)), ",
                            "test accuracy $(round(100 * accuracy(engine, test), digits=2))%")
                end
            end
            Dpar.save(engine, checkpoint)
            trained = accuracy(engine, test)
            Model(0) do fresh   # another seed: the checkpoint brings the weights
                build(fresh)
                Engine(fresh; optimizer=Dpar.ADAM, lr=1e-3) do reloaded
                    Dpar.load(reloaded, checkpoint)
                    again = accuracy(reloaded, test)
                    again == trained || error("the reloaded engine evaluates to $again, not $trained")
                    println("reloaded from $checkpoint: test accuracy $(round(100 * again, digits=2))%, the same")
                end
            end
        end
    end
end
end
