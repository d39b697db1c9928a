// Trains a small classifier on 2 CPU devices, evaluates it, saves a checkpoint, reloads it into a fresh engine
// and checks that the reloaded engine predicts exactly what the saved one did.
use dpar::{Activation, AsTensor, Engine, EngineOptions, Model, Optimizer, Tensor};

// 512 points of 4 features; the label is whichever of the first three features is largest.
fn data() -> (Vec<f32>, Vec<i32>) {
    let mut state = 12345u32;
    let mut uniform = move || {
        state = state.wrapping_mul(1664525).wrapping_add(1013904223);
        (state >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
    };
    let x: Vec<f32> = (0..512 * 4).map(|_| uniform()).collect();
    let y = x.chunks(4).map(|r| (0..3).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as i32).collect();
    (x, y)
}

fn model(seed: u64) -> dpar::Result<Model> {
    let mut m = Model::new(seed)?;
    m.linear(4, 32, true)?.activation(Activation::Relu)?.linear(32, 3, true)?;
    Ok(m)
}

// The logits of every row in eval mode, and the fraction whose largest logit is the label.
fn evaluate(engine: &Engine, x: &Tensor<'static>, y: &[i32]) -> dpar::Result<(Vec<f32>, f32)> {
    engine.set_training(false)?;
    let logits = engine.forward(x)?.to_vec_f32()?;
    engine.set_training(true)?;
    let right = logits
        .chunks(3)
        .zip(y)
        .filter(|(row, &label)| (0..3).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i32 == label)
        .count();
    Ok((logits, right as f32 / y.len() as f32))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (features, labels) = data();
    let x = Tensor::from_f32(&[512, 4], &features)?;
    let y = Tensor::from_i32(&[512], &labels)?;
    let optimizer = Optimizer::sgd(0.2).momentum(0.9);
    let options = EngineOptions::new().cpu_devices(2);

    let engine = Engine::new(&model(7)?, &optimizer, &options)?;
    for step in 1..=100 {
        let loss = engine.train_step(&x, &y)?; // the batch is split over the 2 devices
        if step == 1 || step % 25 == 0 {
            println!("step {step:3}  loss {loss:.4}");
        }
    }
    let (logits, accuracy) = evaluate(&engine, &x, &labels)?;
    println!("accuracy {:.1}%", accuracy * 100.0);

    let path = std::env::temp_dir().join(format!("dpar_example_{}.safetensors", std::process::id()));
    engine.save(&path)?; // parameters, optimizer state, step count and RNG streams

    // Another seed: the checkpoint, not the initialisation, decides what this engine computes.
    let reloaded = Engine::new(&model(99)?, &optimizer, &options)?;
    reloaded.load(&path)?;
    std::fs::remove_file(&path)?;
    let (logits_again, accuracy_again) = evaluate(&reloaded, &x, &labels)?;
    println!("reloaded at step {}: accuracy {:.1}%", reloaded.step_count()?, accuracy_again * 100.0);
    if logits_again != logits || reloaded.step_count()? != 100 {
        return Err("the reloaded engine differs from the saved one".into());
    }
    // Training goes on from where the checkpoint left it.
    println!("step 101  loss {:.4}", reloaded.train_step(&x, &y)?);
    Ok(())
}
