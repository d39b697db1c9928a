// Command train_fashion_mnist trains an MLP (784-256-128-10), or with --model cnn the small residual CNN of
// examples/c/fashion_cnn.h (convolutions, BatchNorm, max pooling, a basic block, torchvision's names), on
// Fashion-MNIST over every GPU when dpar finds any, and over every CPU device otherwise, as
// examples/c/train_fashion_mnist.c does, with the same options, schedule and seed: it prints the same per-epoch
// losses and accuracies, bit for bit.
//
//	go run ./examples/train_fashion_mnist [--model mlp|cnn] [--device auto|cuda|cpu] [--devices N] [--epochs E]
//	    [--batch-size B] [--lr LR] [--optimizer adam|sgd] [--data DIR] [--seed S] [--min-accuracy PCT]
//	    [--sync-batchnorm] [--steps-per-epoch N]
//
// (from bindings/go; libdpar is found as the package dpar.dev/go/dpar says.)
package main

/*
#cgo LDFLAGS: -lm
// The C library's cos, so that the learning-rate schedule is the C example's to the last bit (Go's math.Cos may
// differ from it in the last place).
#include <math.h>
*/
import "C"

import (
	"flag"
	"fmt"
	"os"
	"time"

	"dpar.dev/go/dpar"
)

type args struct {
	model       string
	syncBN      bool
	steps       int
	device      string
	devices     int
	epochs      int
	batch       int
	lr          float32
	optimizer   string
	data        string
	seed        uint64
	minAccuracy float64
}

func parseArgs() args {
	var a args
	var lr float64
	flag.StringVar(&a.model, "model", "mlp", "mlp or cnn")
	flag.BoolVar(&a.syncBN, "sync-batchnorm", false, "the CNN's BatchNorm over the global batch")
	flag.IntVar(&a.steps, "steps-per-epoch", 0, "end each epoch after N batches (0: all)")
	flag.StringVar(&a.device, "device", "auto", "auto, cuda or cpu")
	flag.IntVar(&a.devices, "devices", 0, "replicas (0: one per GPU, or every CPU device)")
	flag.IntVar(&a.epochs, "epochs", 10, "epochs")
	flag.IntVar(&a.batch, "batch-size", 128, "global batch size")
	flag.Float64Var(&lr, "lr", 1e-3, "peak learning rate (cosine schedule down to 0)")
	flag.StringVar(&a.optimizer, "optimizer", "adam", "adam or sgd")
	flag.StringVar(&a.data, "data", "/usr/share/datasets/fashion-mnist", "directory of the IDX files")
	flag.Uint64Var(&a.seed, "seed", 0, "seed of the model, the engine and the shuffling")
	flag.Float64Var(&a.minAccuracy, "min-accuracy", 0, "exit 1 when the final test accuracy (%) is lower")
	flag.Parse()
	a.lr = float32(lr) // a C float, as strtof gives it
	if a.model != "mlp" && a.model != "cnn" {
		fmt.Fprintf(os.Stderr, "train_fashion_mnist: --model must be mlp or cnn, not %s\n", a.model)
		os.Exit(2)
	}
	if a.device != "auto" && a.device != "cuda" && a.device != "cpu" {
		fmt.Fprintf(os.Stderr, "train_fashion_mnist: --device must be auto, cuda or cpu, not %s\n", a.device)
		os.Exit(2)
	}
	return a
}

// cnnBuilder appends examples/c/fashion_cnn.h's CNN, keeping the first error.
type cnnBuilder struct {
	m   *dpar.Model
	err error
}

func (b *cnnBuilder) do(f func() error) {
	if b.err == nil {
		b.err = f()
	}
}

// name names the node just added, as torchvision names its modules.
func (b *cnnBuilder) name(name string) {
	b.do(func() error {
		node, err := b.m.LastNode()
		if err != nil {
			return err
		}
		return b.m.SetNodeName(node, name)
	})
}

// last is the id of the node just added.
func (b *cnnBuilder) last() int32 {
	var node int32
	b.do(func() (err error) { node, err = b.m.LastNode(); return })
	return node
}

// convBN appends a 3x3 convolution without bias, then its BatchNorm.
func (b *cnnBuilder) convBN(conv, bn string, in, out int64) {
	c := dpar.DefaultConv2d(in, out, [2]int64{3, 3})
	c.Padding, c.Bias = [2]int64{1, 1}, false
	b.do(func() error { return b.m.Conv2d(c) })
	b.name(conv)
	b.do(func() error { return b.m.BatchNorm2d(out, 1e-5, 0.1, true) })
	b.name(bn)
}

// addCNN: conv1, bn1, relu, max pool; a basic block (layer1.0) with its shortcut; max pool, flatten, fc.
func addCNN(m *dpar.Model, classes int64) error {
	b := &cnnBuilder{m: m}
	pool := func() error { return m.MaxPool2d([2]int64{2, 2}, nil, [2]int64{0, 0}) }
	relu := func() error { return m.Activation(dpar.ReLU) }
	b.do(func() error { return m.AddReshape(1, 28, 28) })
	b.convBN("conv1", "bn1", 1, 32)
	b.do(relu)
	b.do(pool)
	shortcut := b.last()
	b.convBN("layer1.0.conv1", "layer1.0.bn1", 32, 32)
	b.do(relu)
	b.convBN("layer1.0.conv2", "layer1.0.bn2", 32, 32)
	block := b.last()
	b.do(func() error { return m.AddSum(block, shortcut) })
	b.do(relu)
	b.do(pool)
	b.do(m.AddFlatten)
	b.do(func() error { return m.Linear(32*7*7, classes, true) })
	b.name("fc")
	return b.err
}

// evaluate is the fraction of test whose arg-max output is its label, in eval mode.
func evaluate(engine *dpar.Engine, test *dpar.Dataset, batch int) (float64, error) {
	loader, err := dpar.NewLoader(test, batch, false, 0, false)
	if err != nil {
		return 0, err
	}
	defer loader.Close()
	if err := engine.SetTraining(false); err != nil {
		return 0, err
	}
	correct, seen := 0, 0
	for {
		x, y, ok, err := loader.Next()
		if err != nil || !ok {
			if err == nil {
				err = engine.SetTraining(true)
			}
			return float64(correct) / float64(seen), err
		}
		out, err := engine.Forward(x)
		if err != nil {
			return 0, err
		}
		shape, err := out.Shape()
		if err != nil {
			return 0, err
		}
		logits, err := out.ToFloat32() // a copy: on a GPU engine the output lives on its GPU
		if err != nil {
			return 0, err
		}
		labels, err := y.Int32s()
		if err != nil {
			return 0, err
		}
		rows, classes := int(shape[0]), int(shape[1])
		for i := 0; i < rows; i++ {
			row := logits[i*classes : (i+1)*classes]
			best := 0
			for c := 1; c < classes; c++ {
				if row[c] > row[best] {
					best = c
				}
			}
			if int32(best) == labels[i] {
				correct++
			}
		}
		seen += rows
		out.Close()
	}
}

func run(a args) (float64, error) {
	// The GPUs when there are any (auto) or when asked for (cuda); --devices N replicas spread over them in turn.
	gpus := 0
	switch a.device {
	case "cuda":
		n, err := dpar.DeviceCount(dpar.CUDA)
		if err != nil {
			return 0, err
		}
		if n == 0 {
			return 0, fmt.Errorf("--device cuda: no CUDA device")
		}
		gpus = n
	case "auto":
		if n, err := dpar.DeviceCount(dpar.CUDA); err == nil {
			gpus = n
		}
	}
	useCUDA := gpus > 0
	devices := a.devices
	if devices == 0 {
		if useCUDA {
			devices = gpus
		} else {
			n, err := dpar.DeviceCount(dpar.CPU)
			if err != nil {
				return 0, err
			}
			devices = n
		}
	}

	train, err := dpar.LoadIDX(a.data+"/train-images-idx3-ubyte.gz", a.data+"/train-labels-idx1-ubyte.gz")
	if err != nil {
		return 0, err
	}
	defer train.Close()
	test, err := dpar.LoadIDX(a.data+"/t10k-images-idx3-ubyte.gz", a.data+"/t10k-labels-idx1-ubyte.gz")
	if err != nil {
		return 0, err
	}
	defer test.Close()
	// Fashion-MNIST's pixel mean and standard deviation.
	if err := train.Normalize(0.2860, 0.3530); err != nil {
		return 0, err
	}
	if err := test.Normalize(0.2860, 0.3530); err != nil {
		return 0, err
	}
	nTrain, features, classes, err := train.Info()
	if err != nil {
		return 0, err
	}

	model, err := dpar.NewModel(a.seed)
	if err != nil {
		return 0, err
	}
	if a.model == "cnn" {
		err = addCNN(model, int64(classes))
		if err == nil && a.syncBN {
			err = model.ConvertSyncBatchNorm()
		}
		if err != nil {
			return 0, err
		}
	} else {
		for _, err := range []error{
			model.Linear(int64(features), 256, true), model.Activation(dpar.ReLU),
			model.Linear(256, 128, true), model.Activation(dpar.ReLU),
			model.Linear(128, int64(classes), true),
		} {
			if err != nil {
				return 0, err
			}
		}
	}
	opts := dpar.Options{Optimizer: dpar.Adam, LR: a.lr, Seed: a.seed}
	if a.optimizer == "sgd" {
		opts.Optimizer, opts.Momentum = dpar.SGD, 0.9
	}
	if useCUDA {
		opts.DeviceKind = dpar.CUDA
		for i := 0; i < devices; i++ {
			opts.DeviceIDs = append(opts.DeviceIDs, int32(i%gpus))
		}
	} else {
		opts.Devices = devices
	}
	engine, err := dpar.NewEngine(model, opts)
	model.Close() // the engine holds its replicas
	if err != nil {
		return 0, err
	}
	defer engine.Close()
	rank, nproc, err := engine.Processes()
	if err != nil {
		return 0, err
	}
	if rank == 0 {
		where := "CPU devices"
		if useCUDA {
			where = "replicas on GPUs"
		}
		what := fmt.Sprintf("MLP %d-256-128-%d", features, classes)
		if a.model == "cnn" {
			what = "CNN with a residual block"
		}
		fmt.Printf("dpar %s (Go): %s, %s lr %g, batch %d over %d process(es) x %d %s\n",
			dpar.VersionString(), what, a.optimizer, a.lr, a.batch, nproc, devices, where)
	}

	loader, err := dpar.NewLoader(train, a.batch, true, a.seed, false)
	if err != nil {
		return 0, err
	}
	defer loader.Close()
	if nproc > 1 {
		if err := loader.Shard(rank, nproc); err != nil {
			return 0, err
		}
	}
	if useCUDA {
		// Batches on the first replica's GPU, each copied while the step before it runs.
		kind, index, err := engine.ReplicaDevice(0)
		if err == nil {
			err = loader.ToDevice(kind, index)
		}
		if err != nil {
			return 0, err
		}
	}
	epochBatches, err := loader.NumBatches()
	if err != nil {
		return 0, err
	}
	batches := epochBatches
	if a.steps > 0 && a.steps < epochBatches {
		batches = a.steps
	}
	accuracy := 0.0
	for epoch := 0; epoch < a.epochs; epoch++ {
		if err := loader.StartEpoch(uint64(epoch)); err != nil {
			return 0, err
		}
		lossSum, samples, t0 := 0.0, 0, time.Now()
		for b := 0; b < batches; b++ {
			x, y, ok, err := loader.Next()
			if err != nil {
				return 0, err
			}
			if !ok {
				break
			}
			// The same cosine schedule as the C example, computed the same way (in doubles, then a C float).
			progress := float64(epoch*batches+b) / float64(a.epochs*batches)
			lr := 0.5 * float64(a.lr) * (1.0 + float64(C.cos(C.double(3.14159265358979*progress))))
			if err := engine.SetLR(float32(lr)); err != nil {
				return 0, err
			}
			loss, err := engine.TrainStep(x, y) // the mean over the global batch
			if err != nil {
				return 0, err
			}
			rows := a.batch
			if b+1 == epochBatches && nTrain%a.batch != 0 {
				rows = nTrain % a.batch
			}
			lossSum += float64(loss) * float64(rows)
			samples += rows
		}
		seconds := time.Since(t0).Seconds()
		if rank != 0 {
			continue // Forward is local: rank 0 evaluates alone, the parameters being the same
		}
		if accuracy, err = evaluate(engine, test, 1000); err != nil {
			return 0, err
		}
		fmt.Printf("epoch %2d  train loss %.4f  test accuracy %.2f%%  %.0f samples/s\n", epoch+1,
			lossSum/float64(samples), 100.0*accuracy, float64(samples)/seconds)
	}
	if rank != 0 {
		return -1, nil
	}
	return 100.0 * accuracy, nil
}

func main() {
	a := parseArgs()
	accuracy, err := run(a)
	if err != nil {
		fmt.Fprintf(os.Stderr, "train_fashion_mnist: %v\n", err)
		os.Exit(1)
	}
	if accuracy >= 0 && accuracy < a.minAccuracy {
		fmt.Fprintf(os.Stderr, "test accuracy %.2f%% is below the required %.2f%%\n", accuracy, a.minAccuracy)
		os.Exit(1)
	}
}
