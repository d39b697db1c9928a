"""dpar in one short program: train a small classifier over 2 CPU devices, evaluate it, save a checkpoint, and load
it into a new engine that then evaluates and trains exactly as the first one does.

    python quickstart.py [checkpoint path]      (default: quickstart.safetensors in a temporary directory)

The wheel's test (bindings/python/check_wheel.sh) runs it in a fresh virtual environment."""
import os
import sys
import tempfile

import numpy as np

import dpar

# 256 points of 4 features in 3 classes: the class is which of three directions the point leans to most.
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 4)).astype(np.float32)
y = np.argmax(x[:, :3] + 0.5 * x[:, 3:], axis=1).astype(np.int32)


def evaluate(engine):
    """(accuracy, logits) on the whole set, in evaluation mode (no dropout)."""
    engine.set_training(False)
    logits = engine.forward(x).copy_to_numpy()
    engine.set_training(True)
    return float(np.mean(np.argmax(logits, axis=1) == y)), logits


def make_engine(model):
    return dpar.Engine(model, optimizer=dpar.ADAM, lr=0.01, devices=2, seed=1)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "quickstart.safetensors")
    with dpar.Model(seed=7).linear(4, 32).activation(dpar.RELU).dropout(0.1).linear(32, 3) as model:
        with make_engine(model) as engine:
            for step in range(200):
                loss = engine.train_step(x, y)  # the arrays are wrapped, not copied
                if step == 0:
                    print(f"loss after 1 step: {loss:.4f}")
            accuracy, logits = evaluate(engine)
            print(f"loss after 200 steps: {loss:.4f}, accuracy {accuracy:.3f}")
            engine.save(path)  # parameters, Adam's moments, the step and the dropout streams
            next_loss = engine.train_step(x, y)

        with make_engine(model) as restored:  # starts from the model's initial parameters...
            restored.load(path)  # ...and continues from the checkpoint
            step = restored.step_count
            again, logits_again = evaluate(restored)
            assert step == 200, step
            assert np.array_equal(logits, logits_again), "the reloaded engine evaluates differently"
            assert restored.train_step(x, y) == next_loss, "the reloaded engine trains differently"
            print(f"reloaded {path}: step {step}, accuracy {again:.3f}, the same next loss")
    if accuracy < 0.9:
        sys.exit(f"accuracy {accuracy:.3f} < 0.9")


if __name__ == "__main__":
    main()
