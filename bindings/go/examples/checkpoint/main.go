// Command checkpoint trains a small classifier on 2 CPU devices, evaluates it, saves a checkpoint and reloads it
// into a new engine, which must predict exactly as the one that saved it. bindings/go/README.md shows this file,
// and the CTest test go_module_installed runs the README's copy in a module of its own against an installed dpar.
package main

import (
	"fmt"
	"log"
	"os"
	"path/filepath"

	"dpar.dev/go/dpar"
)

// newEngine builds the model (4 inputs, 3 classes) and an engine over it on 2 CPU devices.
func newEngine() (*dpar.Model, *dpar.Engine) {
	m, err := dpar.NewModel(7) // the seed of the initial parameters
	if err != nil {
		log.Fatal(err)
	}
	if err := m.Linear(4, 16, true); err != nil {
		log.Fatal(err)
	}
	if err := m.Activation(dpar.ReLU); err != nil {
		log.Fatal(err)
	}
	if err := m.Linear(16, 3, true); err != nil {
		log.Fatal(err)
	}
	e, err := dpar.NewEngine(m, dpar.Options{Optimizer: dpar.Adam, LR: 0.01, Devices: 2})
	if err != nil {
		log.Fatal(err) // an *dpar.Error: dpar's status and message
	}
	return m, e
}

// evaluate returns the logits of x in eval mode, and the fraction of the rows whose arg-max is their label.
func evaluate(e *dpar.Engine, x *dpar.Tensor, labels []int32) ([]float32, float64) {
	if err := e.SetTraining(false); err != nil {
		log.Fatal(err)
	}
	defer e.SetTraining(true)
	out, err := e.Forward(x) // gathered on the first device
	if err != nil {
		log.Fatal(err)
	}
	defer out.Close()
	logits, err := out.Float32s() // a copy
	if err != nil {
		log.Fatal(err)
	}
	right := 0
	for i, label := range labels {
		row := logits[3*i : 3*i+3]
		best := 0
		for k := range row {
			if row[k] > row[best] {
				best = k
			}
		}
		if int32(best) == label {
			right++
		}
	}
	return logits, float64(right) / float64(len(labels))
}

func main() {
	// 30 samples of 3 classes: the class is the feature among the first three that is raised by one.
	const n = 30
	x := make([]float32, n*4)
	y := make([]int32, n)
	for i := range y {
		y[i] = int32(i % 3)
		for j := 0; j < 4; j++ {
			x[4*i+j] = float32((i*7+j*3)%5) / 10
		}
		x[4*i+int(y[i])] += 1
	}
	input, err := dpar.FromFloat32([]int64{n, 4}, x) // copied into dpar's memory
	if err != nil {
		log.Fatal(err)
	}
	defer input.Close()
	target, err := dpar.FromInt32([]int64{n}, y)
	if err != nil {
		log.Fatal(err)
	}
	defer target.Close()

	model, engine := newEngine()
	defer model.Close()
	defer engine.Close()
	var first, last float32
	for step := 0; step < 100; step++ { // each step splits the batch over the devices and averages the gradients
		loss, err := engine.TrainStep(input, target)
		if err != nil {
			log.Fatal(err)
		}
		if step == 0 {
			first = loss
		}
		last = loss
	}
	fmt.Printf("first step's loss: %.3f\n", first)
	fmt.Printf("loss fell below a tenth of it: %v\n", last < first/10)
	logits, accuracy := evaluate(engine, input, y)
	fmt.Printf("accuracy: %.0f%%\n", 100*accuracy)

	dir, err := os.MkdirTemp("", "dpar-checkpoint")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "model.safetensors")
	if err := engine.Save(path); err != nil { // parameters, optimizer state, step and RNG streams
		log.Fatal(err)
	}

	model2, engine2 := newEngine() // the same model, freshly initialised
	defer model2.Close()
	defer engine2.Close()
	if err := engine2.Load(path); err != nil {
		log.Fatal(err)
	}
	steps, err := engine2.StepCount()
	if err != nil {
		log.Fatal(err)
	}
	reloaded, _ := evaluate(engine2, input, y)
	same := len(reloaded) == len(logits)
	for i := range logits {
		same = same && reloaded[i] == logits[i]
	}
	fmt.Printf("reloaded at step %d, predicts the same: %v\n", steps, same)
	if !same || accuracy < 1 {
		os.Exit(1)
	}
}
