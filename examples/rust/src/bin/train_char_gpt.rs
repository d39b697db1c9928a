//! Trains a small character-level GPT (nanoGPT's model: token and position embeddings, pre-LayerNorm blocks of causal
//! self-attention and a GELU MLP, a final LayerNorm and a language-model head tied to the token embedding) on Debian's
//! fortunes over every GPU when dpar finds any, and over every CPU device otherwise, then samples text from it, as
//! examples/c/train_char_gpt.c does: the same options, corpus, vocabulary, split, batches, initialisation, optimizer,
//! schedule and sampling, so that for the same arguments it prints the same losses, bit for bit.
//!
//!   cargo run --release --bin train_char_gpt -- [--data FILE|DIR] [--device auto|cuda|cpu] [--devices N]
//!       [--steps S] [--eval-every K] [--batch-size B] [--block T] [--layers L] [--heads H] [--embd C]
//!       [--dropout P] [--lr LR] [--seed S] [--checkpoint PATH] [--max-val-loss X] [--sample N] [--eval-batches E]
//!
//! The corpus is every plain file of /usr/share/games/fortunes in name order (leaving out fortune's .dat index files
//! and the .u8 links to the same text), or the file (or the directory's plain files) given by --data; its distinct
//! bytes are the vocabulary; the first 90% is the training text, the rest the validation text. See the C program for
//! the rest of the description: each step here is the same computation, in the same order.
use dpar::{Activation, AsTensor, DeviceKind, Engine, EngineOptions, Model, Optimizer, Tensor};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// The C program's schedule multiplies by this truncated pi; the same constant gives the same learning rates, bit
/// for bit.
#[allow(clippy::approx_constant)]
const PI_AS_IN_C: f64 = 3.14159265358979;

struct Args {
    data: String,
    device: String,
    devices: usize,
    steps: usize,
    eval_every: usize,
    batch: usize,
    block: i64,
    layers: i64,
    heads: i64,
    embd: i64,
    dropout: f32,
    lr: f32,
    seed: u64,
    checkpoint: String,
    max_val_loss: f64,
    sample: usize,
    eval_batches: usize,
}

const USAGE: &str = "usage: train_char_gpt [--data FILE|DIR] [--device auto|cuda|cpu] [--devices N] [--steps S]
          [--eval-every K] [--batch-size B] [--block T] [--layers L] [--heads H] [--embd C] [--dropout P]
          [--lr LR] [--seed S] [--checkpoint PATH] [--max-val-loss X] [--sample N] [--eval-batches E]";

/// The arguments, or None for --help.
fn parse_args() -> Result<Option<Args>, String> {
    let mut a = Args {
        data: "/usr/share/games/fortunes".into(),
        device: "auto".into(),
        devices: 0,
        steps: 1500,
        eval_every: 250,
        batch: 32,
        block: 128,
        layers: 4,
        heads: 4,
        embd: 128,
        dropout: 0.0,
        lr: 3e-3,
        seed: 0,
        checkpoint: "char_gpt.safetensors".into(),
        max_val_loss: 0.0,
        sample: 400,
        eval_batches: 8,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        if argv[i] == "--help" || argv[i] == "-h" {
            return Ok(None);
        }
        let v = argv.get(i + 1).ok_or(format!("{} needs a value (see --help)", argv[i]))?;
        let bad = || format!("{}: bad value {}", argv[i], v);
        match argv[i].as_str() {
            "--data" => a.data = v.clone(),
            "--device" => a.device = v.clone(),
            "--devices" => a.devices = v.parse().map_err(|_| bad())?,
            "--steps" => a.steps = v.parse().map_err(|_| bad())?,
            "--eval-every" => a.eval_every = v.parse().map_err(|_| bad())?,
            "--batch-size" => a.batch = v.parse().map_err(|_| bad())?,
            "--block" => a.block = v.parse().map_err(|_| bad())?,
            "--layers" => a.layers = v.parse().map_err(|_| bad())?,
            "--heads" => a.heads = v.parse().map_err(|_| bad())?,
            "--embd" => a.embd = v.parse().map_err(|_| bad())?,
            "--dropout" => a.dropout = v.parse().map_err(|_| bad())?,
            "--lr" => a.lr = v.parse().map_err(|_| bad())?,
            "--seed" => a.seed = v.parse().map_err(|_| bad())?,
            "--checkpoint" => a.checkpoint = v.clone(),
            "--max-val-loss" => a.max_val_loss = v.parse().map_err(|_| bad())?,
            "--sample" => a.sample = v.parse().map_err(|_| bad())?,
            "--eval-batches" => a.eval_batches = v.parse().map_err(|_| bad())?,
            o => return Err(format!("unknown option {} (see --help)", o)),
        }
        i += 2;
    }
    if a.steps == 0 || a.eval_every == 0 || a.batch == 0 || a.block < 1 || a.layers < 1 {
        return Err("--steps, --eval-every, --batch-size, --block and --layers must be positive".into());
    }
    if !["auto", "cuda", "cpu"].contains(&a.device.as_str()) {
        return Err(format!("--device must be auto, cuda or cpu, not {}", a.device));
    }
    Ok(Some(a))
}

/// splitmix64: the example's own random numbers (batch offsets, initial weights, sampling), the C program's.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn next_uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_uniform();
        let u2 = self.next_uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

// ---- The corpus ------------------------------------------------------------------------------------------------

/// A file, or a directory's regular files in name order (byte order, as strcmp), leaving out hidden files, fortune's
/// index files (.dat) and the links to UTF-8 copies (.u8).
fn load_corpus(path: &str) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|_| {
        format!("{} not found: install Debian's fortunes packages (apt-get install fortunes fortunes-min) or pass \
                 --data FILE", path)
    })?;
    if !meta.is_dir() {
        return std::fs::read(path).map_err(|e| format!("cannot open {}: {}", path, e));
    }
    let dir = std::fs::read_dir(path).map_err(|e| format!("cannot read the directory {}: {}", path, e))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|e| format!("cannot read the directory {}: {}", path, e))?;
        let name = entry.file_name();
        let n = name.as_bytes();
        if n.first() == Some(&b'.') || (n.len() > 4 && n.ends_with(b".dat")) || (n.len() > 3 && n.ends_with(b".u8")) {
            continue;
        }
        let file = Path::new(path).join(&name);
        if std::fs::metadata(&file).map(|m| m.is_file()).unwrap_or(false) {
            files.push(file);
        }
    }
    files.sort_by(|a, b| a.as_os_str().as_bytes().cmp(b.as_os_str().as_bytes()));
    let mut text = Vec::new();
    for f in &files {
        text.extend(std::fs::read(f).map_err(|e| format!("cannot open {}: {}", f.display(), e))?);
    }
    Ok(text)
}

// ---- The model -------------------------------------------------------------------------------------------------

struct GptConfig {
    vocab: i64,
    block: i64,
    layers: i64,
    heads: i64,
    embd: i64,
    dropout: f32,
}

/// Names the last node added.
fn name_last(m: &mut Model, name: &str) -> dpar::Result<()> {
    let node = m.last_node()?;
    m.set_node_name(node, name)?;
    Ok(())
}

/// nanoGPT's GPT, node by node, with its module names: transformer.wte, transformer.wpe, transformer.h.<i>.ln_1,
/// .attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj, transformer.ln_f, lm_head (tied to wte).
fn build_gpt(c: &GptConfig, seed: u64) -> dpar::Result<Model> {
    let mut m = Model::new(seed)?;
    m.embedding(c.vocab, c.embd)?; // (B, T) bytes -> (B, T, C)
    name_last(&mut m, "transformer.wte")?;
    let wte = m.last_node()?;
    m.position_embedding(c.block, c.embd)?;
    name_last(&mut m, "transformer.wpe")?;
    if c.dropout > 0.0 {
        m.dropout(c.dropout)?;
    }
    let mut x = m.last_node()?;
    for l in 0..c.layers {
        // x = x + attn(ln_1(x))
        m.branch_from(x)?.layernorm(c.embd, 1e-5, true)?;
        name_last(&mut m, &format!("transformer.h.{}.ln_1", l))?;
        m.causal_self_attention(c.embd, c.heads, c.dropout, true, Some(&format!("transformer.h.{}.attn", l)))?;
        let y = m.last_node()?;
        m.add_sum(&[x, y])?;
        x = m.last_node()?;
        // x = x + mlp(ln_2(x))
        m.layernorm(c.embd, 1e-5, true)?;
        name_last(&mut m, &format!("transformer.h.{}.ln_2", l))?;
        m.linear(c.embd, 4 * c.embd, true)?;
        name_last(&mut m, &format!("transformer.h.{}.mlp.c_fc", l))?;
        m.activation(Activation::Gelu)?.linear(4 * c.embd, c.embd, true)?;
        name_last(&mut m, &format!("transformer.h.{}.mlp.c_proj", l))?;
        if c.dropout > 0.0 {
            m.dropout(c.dropout)?;
        }
        let y = m.last_node()?;
        m.add_sum(&[x, y])?;
        x = m.last_node()?;
    }
    m.layernorm(c.embd, 1e-5, true)?;
    name_last(&mut m, "transformer.ln_f")?;
    m.linear(c.embd, c.vocab, false)?; // (B, T, C) -> (B, T, V) logits
    name_last(&mut m, "lm_head")?;
    let head = m.last_node()?;
    m.tie_param(head, "weight", wte, "weight")?;
    Ok(m)
}

/// nanoGPT's _init_weights: every Linear's and Embedding's weight from N(0, 0.02), biases zero (LayerNorms keep ones
/// and zeros), then the residual projections (c_proj) from N(0, 0.02 / sqrt(2 L)); the C program's draws, in order.
fn init_like_nanogpt(m: &mut Model, c: &GptConfig, seed: u64) -> dpar::Result<()> {
    let mut rng = SplitMix64(seed ^ 0x5DEECE66D);
    for i in 0..m.num_params()? {
        let (name, shape) = m.param_info(i)?;
        if name.contains("ln_") {
            continue;
        }
        let count = shape.iter().product::<i64>() as usize;
        let bias = name.len() > 5 && name.ends_with(".bias");
        let std = if name.contains("c_proj.weight") { 0.02 / (2.0 * c.layers as f64).sqrt() } else { 0.02 };
        let values: Vec<f32> =
            (0..count).map(|_| if bias { 0.0 } else { (std * rng.next_normal()) as f32 }).collect();
        m.set_param(i, &values)?;
    }
    Ok(())
}

// ---- Batches ---------------------------------------------------------------------------------------------------

/// Rows [first, first + x.len() / T) of a global batch of `batch` windows at offsets drawn from `rng` (every process
/// draws the whole batch's offsets and keeps its rows). x and y: (rows, T) token ids, y shifted by one.
fn draw_batch(x: &mut [i32], y: &mut [i32], tokens: &[i32], batch: usize, first: usize, t: usize, rng: &mut SplitMix64) {
    let rows = x.len() / t;
    for b in 0..batch {
        let offset = (rng.next_u64() % (tokens.len() - t - 1) as u64) as usize;
        if b < first || b >= first + rows {
            continue;
        }
        let r = b - first;
        x[r * t..(r + 1) * t].copy_from_slice(&tokens[offset..offset + t]);
        y[r * t..(r + 1) * t].copy_from_slice(&tokens[offset + 1..offset + 1 + t]);
    }
}

/// The mean loss over `batches` fixed batches of the validation text, in eval mode: the engine's forward gives the
/// logits, and the cross-entropy is computed here (log-sum-exp per position, in f64), as the C program does.
fn validation_loss(engine: &Engine, tokens: &[i32], batch: usize, t: usize, v: usize, batches: usize)
                   -> dpar::Result<f64> {
    engine.set_training(false)?;
    let (mut x, mut y) = (vec![0i32; batch * t], vec![0i32; batch * t]);
    let mut rng = SplitMix64(1234567); // the same validation batches every time
    let (mut total, mut count) = (0.0f64, 0usize);
    for _ in 0..batches {
        draw_batch(&mut x, &mut y, tokens, batch, 0, t, &mut rng);
        let logits = engine.forward_i32(&[batch as i64, t as i64], &x)?.to_vec_f32()?;
        for p in 0..batch * t {
            let row = &logits[p * v..(p + 1) * v];
            let max = row[1..].iter().fold(row[0], |m, &r| if r > m { r } else { m });
            let mut sum = 0.0f64;
            for &r in row {
                sum += ((r - max) as f64).exp();
            }
            total += sum.ln() + max as f64 - row[y[p] as usize] as f64;
            count += 1;
        }
    }
    engine.set_training(true)?;
    Ok(total / count as f64)
}

/// `n` bytes sampled after a newline: each step a forward in eval mode on the last T bytes (one sequence), the next
/// byte drawn from the last position's softmax at `temperature`. No key/value cache: the whole prefix each time.
fn sample_text(engine: &Engine, vocab: &[u8], t: usize, n: usize, temperature: f64, seed: u64) -> dpar::Result<()> {
    engine.set_training(false)?;
    let v = vocab.len();
    let mut context: Vec<i32> = Vec::with_capacity(n + 1);
    context.extend((0..v).filter(|&i| vocab[i] == b'\n').map(|i| i as i32));
    if context.is_empty() {
        context.push(0);
    }
    let mut p = vec![0f64; v];
    let mut rng = SplitMix64(seed);
    let mut out = std::io::stdout().lock();
    for _ in 0..n {
        let start = context.len().saturating_sub(t);
        let window = &context[start..];
        let logits = engine.forward_i32(&[1, window.len() as i64], window)?.to_vec_f32()?;
        let last = &logits[(window.len() - 1) * v..window.len() * v];
        let max = last[1..].iter().fold(last[0] as f64, |m, &r| if r as f64 > m { r as f64 } else { m });
        let mut sum = 0.0f64;
        for (pv, &l) in p.iter_mut().zip(last) {
            *pv = ((l as f64 - max) / temperature).exp();
            sum += *pv;
        }
        let mut u = rng.next_uniform() * sum;
        let mut next = v - 1;
        for (i, &pv) in p.iter().enumerate() {
            if u < pv {
                next = i;
                break;
            }
            u -= pv;
        }
        context.push(next as i32);
        let _ = out.write_all(&[vocab[next]]);
    }
    let _ = out.write_all(b"\n");
    let _ = out.flush();
    engine.set_training(true)?;
    Ok(())
}

/// Trains and samples; returns the final validation loss (rank 0's; 0 elsewhere).
fn run(a: &Args) -> Result<f64, String> {
    // The corpus, its vocabulary (the distinct bytes, in byte order) and the two splits as token ids.
    let corpus = load_corpus(&a.data)?;
    let mut present = [false; 256];
    for &b in &corpus {
        present[b as usize] = true;
    }
    let vocab: Vec<u8> = (0..=255u8).filter(|&b| present[b as usize]).collect();
    let mut id_of = [0i32; 256];
    for (i, &b) in vocab.iter().enumerate() {
        id_of[b as usize] = i as i32;
    }
    let tokens: Vec<i32> = corpus.iter().map(|&b| id_of[b as usize]).collect();
    let n_train = corpus.len() * 9 / 10;
    let n_val = corpus.len() - n_train;
    if n_val <= a.block as usize + 1 {
        return Err(format!("the corpus ({} bytes) is too short for windows of {}", corpus.len(), a.block));
    }
    let cfg = GptConfig {
        vocab: vocab.len() as i64,
        block: a.block,
        layers: a.layers,
        heads: a.heads,
        embd: a.embd,
        dropout: a.dropout,
    };
    let t = a.block as usize;
    let e = |err: dpar::Error| err.to_string();

    // The GPUs when there are any (auto) or when asked for (cuda); --devices N replicas spread over them in turn.
    let gpus = match a.device.as_str() {
        "cuda" => dpar::device_count(DeviceKind::Cuda).map_err(e)?,
        "auto" => dpar::device_count(DeviceKind::Cuda).unwrap_or(0),
        _ => 0,
    };
    if a.device == "cuda" && gpus == 0 {
        return Err("--device cuda: no CUDA device".into());
    }
    let use_cuda = gpus > 0;
    let devices = match (a.devices, use_cuda) {
        (0, true) => gpus,
        (0, false) => dpar::device_count(DeviceKind::Cpu).map_err(e)?,
        (n, _) => n,
    };

    let mut model = build_gpt(&cfg, a.seed).map_err(e)?;
    init_like_nanogpt(&mut model, &cfg, a.seed).map_err(e)?;
    let n_params = model.num_param_elements().map_err(e)?;
    let optimizer = Optimizer::adamw(a.lr).betas(0.9, 0.99).weight_decay(0.1);
    let options = if use_cuda {
        let ids: Vec<i32> = (0..devices).map(|i| (i % gpus) as i32).collect();
        EngineOptions::new().device_kind(DeviceKind::Cuda).device_ids(&ids)
    } else {
        EngineOptions::new().cpu_devices(devices)
    };
    let engine = Engine::new(&model, &optimizer, &options.seed(a.seed)).map_err(e)?;
    drop(model); // the engine holds its replicas
    // nanoGPT decays the matrices only: biases and LayerNorms' weights go without (the embeddings decay).
    engine.set_weight_decay_exclusion(true).map_err(e)?;
    engine.set_max_grad_norm(1.0).map_err(e)?;
    let (rank, nproc) = engine.processes().map_err(e)?;
    let root = rank == 0;
    if root {
        println!(
            "dpar {} (Rust): GPT of {} layers, {} heads, {} channels, context {}, vocabulary {} bytes: {:.2}M \
             parameters; {} train / {} validation bytes of {}; batch {} x {} tokens over {} process{} x {} {}",
            dpar::version_string(), cfg.layers, cfg.heads, cfg.embd, cfg.block, cfg.vocab, n_params as f64 / 1e6,
            n_train, n_val, a.data, a.batch, cfg.block, nproc, if nproc > 1 { "es" } else { "" }, devices,
            if use_cuda { "replicas on GPUs" } else { "CPU devices" }
        );
    }

    // This process's rows of each global batch: as even as DataParallel splits them.
    let first = a.batch * rank / nproc;
    let rows = a.batch * (rank + 1) / nproc - first;
    let (mut x, mut y) = (vec![0i32; rows * t], vec![0i32; rows * t]);
    let shape = [rows as i64, cfg.block];
    let mut rng = SplitMix64(a.seed.wrapping_mul(0x9E3779B97F4A7C15).wrapping_add(1));
    let warmup = a.steps / 20;
    let (mut val, mut loss_sum, mut since) = (0.0f64, 0.0f64, 0usize);
    let (start, mut t0) = (Instant::now(), Instant::now());
    for step in 1..=a.steps {
        draw_batch(&mut x, &mut y, &tokens[..n_train], a.batch, first, t, &mut rng);
        let progress = (step - 1) as f64 / a.steps as f64;
        let scale = if step <= warmup {
            step as f64 / warmup as f64
        } else {
            0.5 * (1.0 + (PI_AS_IN_C * progress).cos())
        };
        engine.set_lr((a.lr as f64 * (0.1 + 0.9 * scale)) as f32).map_err(e)?;
        // The batch wraps x and y without a copy; the loss is the mean over every token of the global batch.
        let loss = {
            let input = Tensor::wrap_i32(&shape, &mut x).map_err(e)?;
            let target = Tensor::wrap_i32(&shape, &mut y).map_err(e)?;
            engine.train_step(&input, &target).map_err(e)?
        };
        loss_sum += loss as f64;
        since += 1;
        if step % a.eval_every != 0 && step != a.steps {
            continue;
        }
        let seconds = t0.elapsed().as_secs_f64();
        // forward() is local: rank 0 evaluates alone, the parameters being the same in every process
        if root {
            val = validation_loss(&engine, &tokens[n_train..], a.batch, t, vocab.len(), a.eval_batches).map_err(e)?;
            println!(
                "step {:5}  train loss {:.4}  val loss {:.4}  {:.0} tokens/s  ({:.0} s)",
                step, loss_sum / since as f64, val, (since * a.batch * t) as f64 / seconds,
                start.elapsed().as_secs_f64()
            );
        }
        loss_sum = 0.0;
        since = 0;
        t0 = Instant::now();
    }
    engine.save(&a.checkpoint).map_err(e)?; // every process calls it; rank 0 writes
    if root {
        println!("saved {}", a.checkpoint);
        if a.sample > 0 {
            println!("---- {} sampled bytes ----", a.sample);
            sample_text(&engine, &vocab, t, a.sample, 0.8, a.seed.wrapping_add(7)).map_err(e)?;
        }
    }
    Ok(if root { val } else { 0.0 })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{}", USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("train_char_gpt: {}", e);
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(val) if args.max_val_loss > 0.0 && (val.is_nan() || val > args.max_val_loss) => {
            eprintln!("validation loss {:.4} is above the required {:.4}", val, args.max_val_loss);
            ExitCode::FAILURE
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_char_gpt: {}", e);
            ExitCode::FAILURE
        }
    }
}
