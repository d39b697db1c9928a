//! Trains an MLP (784-256-128-10), or with `--model cnn` the small residual CNN of examples/c/fashion_cnn.h
//! (convolutions, BatchNorm, max pooling, a basic block, torchvision's names), on Fashion-MNIST over every GPU when
//! dpar finds any, and over every CPU device otherwise, as examples/c/train_fashion_mnist.c does, with the same
//! options, schedule and seed: it prints the same losses and accuracies, bit for bit. The crate's other program,
//! src/bin/train_char_gpt.rs, is examples/c/train_char_gpt.c's twin: nanoGPT's model on Debian's fortunes.
//!
//!   cargo run --release -- [--model mlp|cnn] [--device auto|cuda|cpu] [--devices N] [--epochs E]
//!                          [--batch-size B] [--lr LR] [--optimizer adam|sgd] [--data DIR] [--seed S]
//!                          [--min-accuracy PCT] [--sync-batchnorm] [--steps-per-epoch N]
use dpar::{Activation, AsTensor, Conv2d, Dataset, DeviceKind, Engine, EngineOptions, Loader, Model, Optimizer};
use std::process::ExitCode;
use std::time::Instant;

struct Args {
    model: String,
    sync_batchnorm: bool,
    steps_per_epoch: usize,
    device: String,
    devices: usize,
    epochs: usize,
    batch: usize,
    lr: f32,
    optimizer: String,
    data: String,
    seed: u64,
    min_accuracy: f64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: "mlp".into(),
        sync_batchnorm: false,
        steps_per_epoch: 0,
        device: "auto".into(),
        devices: 0,
        epochs: 10,
        batch: 128,
        lr: 1e-3,
        optimizer: "adam".into(),
        data: "/usr/share/datasets/fashion-mnist".into(),
        seed: 0,
        min_accuracy: 0.0,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        if argv[i] == "--sync-batchnorm" {
            a.sync_batchnorm = true;
            i += 1;
            continue;
        }
        let v = argv.get(i + 1).ok_or(format!("{} needs a value", argv[i]))?;
        let bad = || format!("{}: bad value {}", argv[i], v);
        match argv[i].as_str() {
            "--model" => a.model = v.clone(),
            "--steps-per-epoch" => a.steps_per_epoch = v.parse().map_err(|_| bad())?,
            "--device" => a.device = v.clone(),
            "--devices" => a.devices = v.parse().map_err(|_| bad())?,
            "--epochs" => a.epochs = v.parse().map_err(|_| bad())?,
            "--batch-size" => a.batch = v.parse().map_err(|_| bad())?,
            "--lr" => a.lr = v.parse().map_err(|_| bad())?,
            "--optimizer" => a.optimizer = v.clone(),
            "--data" => a.data = v.clone(),
            "--seed" => a.seed = v.parse().map_err(|_| bad())?,
            "--min-accuracy" => a.min_accuracy = v.parse().map_err(|_| bad())?,
            o => return Err(format!("unknown option {}", o)),
        }
        i += 2;
    }
    if !["mlp", "cnn"].contains(&a.model.as_str()) {
        return Err(format!("--model must be mlp or cnn, not {}", a.model));
    }
    if !["auto", "cuda", "cpu"].contains(&a.device.as_str()) {
        return Err(format!("--device must be auto, cuda or cpu, not {}", a.device));
    }
    Ok(a)
}

/// A 3x3 convolution without bias, then its BatchNorm, each named as torchvision names them.
fn conv_bn(m: &mut Model, conv: &str, bn: &str, cin: i64, cout: i64) -> dpar::Result<()> {
    m.conv2d(&Conv2d::new(cin, cout, (3, 3)).padding((1, 1)).bias(false))?;
    let node = m.last_node()?;
    m.set_node_name(node, conv)?.batchnorm2d(cout, 1e-5, 0.1, true)?;
    let node = m.last_node()?;
    m.set_node_name(node, bn)?;
    Ok(())
}

/// examples/c/fashion_cnn.h's CNN: conv1, bn1, relu, max pool; a basic block (layer1.0) with its shortcut; max pool,
/// flatten, fc.
fn add_cnn(m: &mut Model, classes: i64) -> dpar::Result<()> {
    m.add_reshape(&[1, 28, 28])?;
    conv_bn(m, "conv1", "bn1", 1, 32)?;
    m.activation(Activation::Relu)?.max_pool2d((2, 2), None, (0, 0))?;
    let shortcut = m.last_node()?;
    conv_bn(m, "layer1.0.conv1", "layer1.0.bn1", 32, 32)?;
    m.activation(Activation::Relu)?;
    conv_bn(m, "layer1.0.conv2", "layer1.0.bn2", 32, 32)?;
    let block = m.last_node()?;
    m.add_sum(&[block, shortcut])?.activation(Activation::Relu)?.max_pool2d((2, 2), None, (0, 0))?;
    m.add_flatten()?.linear(32 * 7 * 7, classes, true)?;
    let fc = m.last_node()?;
    m.set_node_name(fc, "fc")?;
    Ok(())
}

/// The fraction of `test` whose arg-max output is its label, in eval mode.
fn evaluate(engine: &Engine, test: &Dataset, batch: usize) -> dpar::Result<f64> {
    let mut loader = Loader::new(test, batch, false, 0, false)?;
    engine.set_training(false)?;
    let (mut correct, mut seen) = (0usize, 0usize);
    while let Some(b) = loader.next_batch()? {
        let out = engine.forward_batch(b.inputs)?;
        let shape = out.shape()?;
        let (rows, classes) = (shape[0] as usize, shape[1] as usize);
        let logits = out.to_vec_f32()?;
        let labels = b.labels.to_vec_i32()?;
        for r in 0..rows {
            let row = &logits[r * classes..(r + 1) * classes];
            let best = (0..classes).fold(0, |best, c| if row[c] > row[best] { c } else { best });
            correct += (best as i32 == labels[r]) as usize;
        }
        seen += rows;
    }
    engine.set_training(true)?;
    Ok(correct as f64 / seen as f64)
}

fn run(a: &Args) -> dpar::Result<f64> {
    // The GPUs when there are any (auto) or when asked for (cuda); --devices N replicas spread over them in turn.
    let gpus = match a.device.as_str() {
        "cuda" => dpar::device_count(DeviceKind::Cuda)?,
        "auto" => dpar::device_count(DeviceKind::Cuda).unwrap_or(0),
        _ => 0,
    };
    let use_cuda = gpus > 0;
    let devices = match (a.devices, use_cuda) {
        (0, true) => gpus,
        (0, false) => dpar::device_count(DeviceKind::Cpu)?,
        (n, _) => n,
    };
    let mut train = Dataset::load_idx(
        format!("{}/train-images-idx3-ubyte.gz", a.data),
        format!("{}/train-labels-idx1-ubyte.gz", a.data),
    )?;
    let mut test = Dataset::load_idx(
        format!("{}/t10k-images-idx3-ubyte.gz", a.data),
        format!("{}/t10k-labels-idx1-ubyte.gz", a.data),
    )?;
    train.normalize(0.2860, 0.3530)?; // Fashion-MNIST's pixel mean and standard deviation
    test.normalize(0.2860, 0.3530)?;
    let (n_train, features, classes) = train.info()?;
    let mut model = Model::new(a.seed)?;
    if a.model == "cnn" {
        add_cnn(&mut model, classes as i64)?;
        if a.sync_batchnorm {
            model.convert_sync_batchnorm()?;
        }
    } else {
        model
            .linear(features as i64, 256, true)?
            .activation(Activation::Relu)?
            .linear(256, 128, true)?
            .activation(Activation::Relu)?
            .linear(128, classes as i64, true)?;
    }
    let optimizer = if a.optimizer == "sgd" { Optimizer::sgd(a.lr).momentum(0.9) } else { Optimizer::adam(a.lr) };
    let options = if use_cuda {
        let ids: Vec<i32> = (0..devices).map(|i| (i % gpus) as i32).collect();
        EngineOptions::new().device_kind(DeviceKind::Cuda).device_ids(&ids)
    } else {
        EngineOptions::new().cpu_devices(devices)
    };
    let engine = Engine::new(&model, &optimizer, &options.seed(a.seed))?;
    drop(model); // the engine holds its replicas
    let (rank, nproc) = engine.processes()?;
    if rank == 0 {
        println!(
            "dpar {} (Rust): {}, {} lr {}, batch {} over {} process(es) x {} {}",
            dpar::version_string(),
            if a.model == "cnn" { "CNN with a residual block".to_string() } else { format!("MLP {}-256-128-{}", features, classes) },
            a.optimizer, a.lr, a.batch, nproc, devices,
            if use_cuda { "replicas on GPUs" } else { "CPU devices" }
        );
    }
    let mut loader = Loader::new(&train, a.batch, true, a.seed, false)?;
    if nproc > 1 {
        loader.shard(rank, nproc)?;
    }
    if use_cuda {
        // Batches on the first replica's GPU, each copied while the step before it runs.
        loader.to_device(engine.replica_device(0)?)?;
    }
    let epoch_batches = loader.num_batches()?;
    let batches = if a.steps_per_epoch > 0 { a.steps_per_epoch.min(epoch_batches) } else { epoch_batches };
    let mut accuracy = 0.0;
    for epoch in 0..a.epochs {
        loader.start_epoch(epoch as u64)?;
        let (mut loss_sum, mut samples, t0) = (0.0f64, 0usize, Instant::now());
        let mut b = 0usize;
        while b < batches {
            let Some(batch) = loader.next_batch()? else { break };
            // The same cosine schedule as the C example, computed the same way.
            let progress = (epoch * batches + b) as f64 / (a.epochs * batches) as f64;
            engine.set_lr((0.5 * a.lr as f64 * (1.0 + (3.14159265358979 * progress).cos())) as f32)?;
            let loss = engine.train_step(&batch.inputs, &batch.labels)?;
            let rows = if b + 1 == epoch_batches && n_train % a.batch != 0 { n_train % a.batch } else { a.batch };
            loss_sum += loss as f64 * rows as f64;
            samples += rows;
            b += 1;
        }
        let seconds = t0.elapsed().as_secs_f64();
        if rank != 0 {
            continue;
        }
        accuracy = evaluate(&engine, &test, 1000)?;
        println!(
            "epoch {:2}  train loss {:.4}  test accuracy {:.2}%  {:.0} samples/s",
            epoch + 1, loss_sum / samples as f64, 100.0 * accuracy, samples as f64 / seconds
        );
    }
    Ok(100.0 * accuracy)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("train_fashion_mnist: {}", e);
            return ExitCode::from(2);
        }
    };
    if args.device == "cuda" && dpar::device_count(DeviceKind::Cuda).map_or(true, |n| n == 0) {
        eprintln!("train_fashion_mnist: --device cuda: no CUDA device");
        return ExitCode::FAILURE;
    }
    match run(&args) {
        Ok(acc) if acc < args.min_accuracy => {
            eprintln!("test accuracy {:.2}% is below the required {:.2}%", acc, args.min_accuracy);
            ExitCode::FAILURE
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_fashion_mnist: {}", e);
            ExitCode::FAILURE
        }
    }
}
