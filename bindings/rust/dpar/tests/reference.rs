// The binding against dpar's C reference (tests/binding_reference.c): the same model, data and seed on 2 CPU
// devices must give the same loss bits; a bad call and a callback's failure come back as dpar::Error with
// their messages.
use std::path::Path;
use dpar::*;

fn reference_model() -> Model {
    let mut m = Model::new(7).unwrap();
    m.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 3, true).unwrap();
    m
}

fn reference_batch() -> (Vec<f32>, Vec<i32>) {
    let x = (0..40).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    let y = (0..10).map(|r| r % 3).collect();
    (x, y)
}

fn options() -> EngineOptions {
    EngineOptions::new().cpu_devices(2).processes(Processes::Single)
}

#[test]
fn cpu_gemm_backend_names_the_library_and_its_kernels() {
    let what = cpu_gemm_backend();
    assert!(what.starts_with("oneDNN "), "{}", what);
    assert!(what.contains(" kernels"), "{}", what);
}

/// The C reference's five loss bits: the file in $DPAR_REFERENCE_LOSSES (ctest sets it), else what this checkout's
/// build/tests/binding_reference prints; `Err` says why neither is there.
fn reference_losses() -> std::result::Result<String, String> {
    if let Some(path) = std::env::var_os("DPAR_REFERENCE_LOSSES") {
        return std::fs::read_to_string(&path).map_err(|e| format!("DPAR_REFERENCE_LOSSES={path:?}: {e}"));
    }
    let program = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../build/tests/binding_reference");
    if !program.exists() {
        return Err(format!(
            "DPAR_REFERENCE_LOSSES is not set and there is no {} (build dpar with scripts/build.sh, or run \
             ctest -R rust_dpar)",
            program.display()
        ));
    }
    let out = std::process::Command::new(&program).output().map_err(|e| format!("{}: {e}", program.display()))?;
    assert!(out.status.success(), "{} failed: {}", program.display(), String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout).unwrap())
}

#[test]
fn losses_have_the_c_reference_bits() {
    let expected = match reference_losses() {
        Ok(text) => text,
        Err(why) => {
            eprintln!("skipped: no C reference to compare with: {why}");
            return;
        }
    };
    let expected: Vec<String> = expected.lines().map(str::to_string).collect();
    assert_eq!(expected.len(), 5);
    let engine = Engine::new(&reference_model(), &Optimizer::sgd(0.1).momentum(0.9), &options()).unwrap();
    let (mut x, mut y) = reference_batch();
    let input = Tensor::wrap_f32(&[10, 4], &mut x).unwrap();
    let labels = Tensor::wrap_i32(&[10], &mut y).unwrap();
    let got: Vec<String> =
        (0..5).map(|_| format!("{:08x}", engine.train_step(&input, &labels).unwrap().to_bits())).collect();
    assert_eq!(got, expected);
    assert_eq!(engine.step_count().unwrap(), 5);
    assert_eq!(engine.processes().unwrap(), (0, 1));
    assert_eq!(engine.process_transport().unwrap(), ""); // one process: nothing travels between processes
    engine.set_gradient_compression(dpar::Compression::Bf16).unwrap(); // one process: changes nothing
}

#[test]
fn a_bad_call_is_an_error_with_dpars_message() {
    let engine = Engine::new(&reference_model(), &Optimizer::sgd(0.1), &options()).unwrap();
    let input = Tensor::from_f32(&[2, 5], &[0.0; 10]).unwrap(); // 5 features, the model takes 4
    let labels = Tensor::from_i32(&[2], &[0, 1]).unwrap();
    let e = engine.train_step(&input, &labels).unwrap_err();
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    assert_eq!(e.name(), "DPAR_ERR_INVALID_ARGUMENT");
    assert!(e.message().contains("4"), "{}", e);
    let e = Device::parse("tpu:1").unwrap_err();
    assert!(e.message().contains("tpu:1"), "{}", e);
    // The error was read and cleared: the next good call is unaffected.
    assert!(Device::parse("cpu:1").is_ok());
}

/// y = x W^T + b in Rust, to be checked against the built-in linear layer.
struct RustLinear {
    inp: usize,
    out: usize,
    fail: Option<&'static str>,
}

impl CustomLayer for RustLinear {
    fn output_shape(&self, input: &[i64]) -> Result<Vec<i64>> {
        if input.len() != 2 || input[1] as usize != self.inp {
            return Err(Error::new(status::MISMATCH, format!("RustLinear takes {} features", self.inp)));
        }
        Ok(vec![input[0], self.out as i64])
    }
    fn forward(&self, a: Forward<'_>) -> Result<()> {
        if let Some(msg) = self.fail {
            if a.replica == 1 {
                return Err(Error::new(status::DEVICE, msg));
            }
        }
        let (w, b) = (a.params[0], a.params[1]);
        let rows = a.input_shape[0] as usize;
        for i in 0..rows {
            for o in 0..self.out {
                let mut acc = b[o];
                for k in 0..self.inp {
                    acc += a.input[i * self.inp + k] * w[o * self.inp + k];
                }
                a.output[i * self.out + o] = acc;
            }
        }
        Ok(())
    }
    fn backward(&self, a: Backward<'_>) -> Result<()> {
        let rows = a.input_shape[0] as usize;
        let w = a.params[0];
        let mut grads = a.grads;
        let (dw, rest) = grads.split_at_mut(1);
        let (dw, db) = (&mut *dw[0], &mut *rest[0]);
        dw.iter_mut().for_each(|v| *v = 0.0);
        db.iter_mut().for_each(|v| *v = 0.0);
        for i in 0..rows {
            for o in 0..self.out {
                let g = a.grad_output[i * self.out + o];
                db[o] += g;
                for k in 0..self.inp {
                    dw[o * self.inp + k] += g * a.input[i * self.inp + k];
                }
            }
        }
        if let Some(dx) = a.grad_input {
            for i in 0..rows {
                for k in 0..self.inp {
                    dx[i * self.inp + k] = (0..self.out).map(|o| a.grad_output[i * self.out + o] * w[o * self.inp + k]).sum();
                }
            }
        }
        Ok(())
    }
}

fn specs(inp: i64, out: i64) -> Vec<ParamSpec> {
    vec![
        ParamSpec { name: "weight".into(), shape: vec![out, inp], init: Init::Zeros },
        ParamSpec { name: "bias".into(), shape: vec![out], init: Init::Zeros },
    ]
}

#[test]
fn a_trace_is_written_as_chromes_json_and_stop_is_checked() {
    let m = reference_model();
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap();
    let e = engine.trace_stop(None).unwrap_err();
    assert_eq!(e.status(), status::INVALID_STATE, "{}", e);
    let (x, y) = reference_batch();
    let (input, labels) = (Tensor::from_f32(&[10, 4], &x).unwrap(), Tensor::from_i32(&[10], &y).unwrap());
    engine.trace_start().unwrap();
    engine.train_step(&input, &labels).unwrap();
    let e = engine.trace_stop(Some(Path::new("/nonexistent-dpar-dir/trace.json"))).unwrap_err();
    assert_eq!(e.status(), status::IO, "{}", e);
    let path = std::env::temp_dir().join(format!("dpar_rust_trace_{}.json", std::process::id()));
    engine.trace_stop(Some(&path)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(text.starts_with("{") && text.contains("\"traceEvents\""), "{}", &text[..80.min(text.len())]);
    for span in ["\"train_step\"", "\"forward\"", "\"backward\"", "\"optimizer\"", "replica 1 (cpu:1) worker"] {
        assert!(text.contains(span), "no {} in the trace", span);
    }
}

#[test]
fn gradient_clipping_and_the_reported_norm() {
    let m = reference_model();
    let (plain, clipping) = (
        Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap(),
        Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap(),
    );
    let (x, y) = reference_batch();
    let (input, labels) = (Tensor::from_f32(&[10, 4], &x).unwrap(), Tensor::from_i32(&[10], &y).unwrap());
    assert!(clipping.grad_norm().unwrap().is_nan());
    clipping.set_max_grad_norm(1e6).unwrap(); // far above the norm: the same step
    plain.train_step(&input, &labels).unwrap(); // a step's loss is taken before its update
    clipping.train_step(&input, &labels).unwrap();
    assert_eq!(plain.train_step(&input, &labels).unwrap(), clipping.train_step(&input, &labels).unwrap());
    let norm = clipping.grad_norm().unwrap();
    assert!(norm > 0.0 && norm < 1e6, "{}", norm);
    clipping.set_max_grad_norm(norm / 10.0).unwrap();
    clipping.train_step(&input, &labels).unwrap();
    plain.train_step(&input, &labels).unwrap();
    assert_ne!(plain.train_step(&input, &labels).unwrap(), clipping.train_step(&input, &labels).unwrap());
    let e = clipping.set_max_grad_norm(f32::NAN).unwrap_err();
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    assert!(e.message().contains("max_grad_norm"), "{}", e);
}

// Plain SGD with lr 1 moves the parameters by the (clipped) gradient itself, up to the rounding of p - g: below the
// gradient's norm the move's L2 norm is max_norm and it points where the unclipped move does; above it nothing is
// scaled. grad_norm is the norm before clipping.
#[test]
fn the_clipped_step_has_the_norm_it_was_clipped_to() {
    let m = reference_model();
    let n = m.num_param_elements().unwrap();
    let (x, y) = reference_batch();
    let (input, labels) = (Tensor::from_f32(&[10, 4], &x).unwrap(), Tensor::from_i32(&[10], &y).unwrap());
    let step = |max_norm: f32| -> (Vec<f64>, f32) {
        let e = Engine::new(&m, &Optimizer::sgd(1.0), &options()).unwrap();
        let before = e.params(0, n).unwrap();
        e.set_max_grad_norm(max_norm).unwrap();
        e.train_step(&input, &labels).unwrap();
        let after = e.params(0, n).unwrap();
        (before.iter().zip(&after).map(|(b, a)| *b as f64 - *a as f64).collect(), e.grad_norm().unwrap())
    };
    let l2 = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let (plain, _) = step(0.0);
    let norm = l2(&plain);
    assert!(norm > 1e-2, "{}", norm);
    let (same, reported) = step(1e6);
    assert_eq!(same, plain);
    assert!((reported as f64 - norm).abs() <= 1e-4 * norm, "reported {} for {}", reported, norm);
    for fraction in [0.5, 0.1] {
        let max_norm = (norm * fraction) as f32;
        let (clipped, reported) = step(max_norm);
        let want = max_norm as f64;
        assert!((l2(&clipped) - want).abs() <= 1e-4 * want, "clipped to {}, the step's norm is {}", want, l2(&clipped));
        assert!((reported as f64 - norm).abs() <= 1e-4 * norm, "reported {} for {}", reported, norm);
        for (c, p) in clipped.iter().zip(&plain) {
            assert!((c - p * want / norm).abs() <= 1e-4 * want, "{} against {}", c, p * want / norm);
        }
    }
}

#[test]
fn a_custom_layer_in_rust_trains_like_the_built_in_one() {
    let mut custom = Model::new(7).unwrap();
    custom.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap();
    custom.custom("rust_linear", &specs(8, 3), RustLinear { inp: 8, out: 3, fail: None }).unwrap();
    let builtin = reference_model();
    // The same starting parameters in both.
    for i in 0..4 {
        custom.set_param(i, &builtin.get_param(i).unwrap()).unwrap();
    }
    assert_eq!(custom.param_info(2).unwrap(), ("2.weight".to_string(), vec![3, 8]));
    let opt = Optimizer::sgd(0.1).momentum(0.9);
    let (ec, eb) = (Engine::new(&custom, &opt, &options()).unwrap(), Engine::new(&builtin, &opt, &options()).unwrap());
    drop(custom); // the engine keeps the layer
    let (x, y) = reference_batch();
    let (input, labels) = (Tensor::from_f32(&[10, 4], &x).unwrap(), Tensor::from_i32(&[10], &y).unwrap());
    for _ in 0..5 {
        let (lc, lb) = (ec.train_step(&input, &labels).unwrap(), eb.train_step(&input, &labels).unwrap());
        assert!((lc - lb).abs() < 1e-5, "{} vs {}", lc, lb);
    }
    let n = builtin.num_param_elements().unwrap();
    let (pc, pb) = (ec.params(1, n).unwrap(), eb.params(1, n).unwrap());
    assert!(pc.iter().zip(&pb).all(|(a, b)| (a - b).abs() < 1e-5));
}

#[test]
fn a_callbacks_error_comes_back_with_its_own_message() {
    let mut m = Model::new(1).unwrap();
    m.custom("rust_linear", &specs(4, 3), RustLinear { inp: 4, out: 3, fail: Some("the Rust layer gave up") }).unwrap();
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap();
    let (x, y) = reference_batch();
    let (input, labels) = (Tensor::from_f32(&[10, 4], &x).unwrap(), Tensor::from_i32(&[10], &y).unwrap());
    let e = engine.train_step(&input, &labels).unwrap_err();
    assert_eq!(e.status(), status::DEVICE);
    assert!(e.message().contains("the Rust layer gave up"), "{}", e);
    // output_shape's own refusal.
    let wrong = Tensor::from_f32(&[2, 5], &[0.0; 10]).unwrap();
    let e = engine.forward(&wrong).unwrap_err();
    assert_eq!(e.status(), status::MISMATCH);
    assert!(e.message().contains("RustLinear takes 4 features"), "{}", e);
    // A panicking hook is caught at the boundary.
    let mut ok = Model::new(1).unwrap();
    ok.linear(4, 3, true).unwrap();
    let engine2 = Engine::new(&ok, &Optimizer::sgd(0.1), &options()).unwrap();
    engine2.set_forward_hook(Some(|_: usize, _: &[i64], _: &[i64]| -> Result<()> { panic!("hook exploded") })).unwrap();
    let e = engine2.train_step(&input, &labels).unwrap_err();
    assert_eq!(e.status(), status::INTERNAL);
    assert!(e.message().contains("hook exploded"), "{}", e);
}

#[test]
fn collectives_over_a_thread_group() {
    let group = CommGroup::new(3, 30.0).unwrap();
    let comms: Vec<Comm> = (0..3).map(|r| group.member(r).unwrap()).collect();
    drop(group);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let (rank, size) = c.info().unwrap();
                let mut v = vec![rank as f64 + 1.0; 5];
                c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v, vec![6.0; 5]);
                let mut g = vec![0i32; size];
                c.all_gather(&[rank as i32], &mut g).unwrap();
                assert_eq!(g, vec![0, 1, 2]);
                let a = c.all_reduce_async(vec![1.0f32; 4], ReduceOp::Mean).unwrap().wait().unwrap();
                assert_eq!(a, vec![1.0; 4]);
                c.barrier().unwrap();
                c
            })
        })
        .collect();
    // Every participant has left the collectives: participant 2 aborts, and each sees it by asking alone.
    let comms: Vec<Comm> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    comms[2].abort("rank 2 is done").unwrap();
    for c in &comms {
        let e = c.async_error().unwrap_err();
        assert_eq!(e.status(), status::REMOTE);
        assert!(e.message().contains("rank 2 is done"), "{}", e);
    }
}

/// Runs `body` for each of the group's `n` members, each on a thread of its own, and waits for all of them.
fn on_each_member(group: &CommGroup, n: usize, body: fn(&mut Comm)) {
    let comms: Vec<Comm> = (0..n).map(|r| group.member(r).unwrap()).collect();
    let handles: Vec<_> = comms.into_iter().map(|mut c| std::thread::spawn(move || body(&mut c))).collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
}

#[test]
fn a_group_on_cpu_devices_says_where_its_buffers_are() {
    let group = CommGroup::on_devices(&[Device::cpu(0), Device::cpu(1)], 30.0).unwrap();
    on_each_member(&group, 2, |c| {
        let (rank, _) = c.info().unwrap();
        assert_eq!(c.device().unwrap(), Device::cpu(rank as i32));
        let mut v = vec![rank as f32; 3];
        c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![1.0; 3]);
    });
    let e = unsafe { CommGroup::on_devices_with_streams(&[Device::cpu(0)], &[], 30.0) }.err().unwrap();
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    let mut not_a_stream = 0u8;
    let stream = &mut not_a_stream as *mut u8 as *mut std::ffi::c_void;
    let e = unsafe { CommGroup::on_devices_with_streams(&[Device::cpu(0)], &[stream], 30.0) }.err().unwrap();
    assert!(e.message().contains("streams[0]"), "{}", e);
    assert_eq!(CommGroup::on_devices(&[], 30.0).err().unwrap().status(), status::INVALID_ARGUMENT);
}

#[test]
fn option_structs_have_the_crates_layout() {
    // _init_sized writes the layout of the size it is given, this crate's: equal to the library's here, version 3
    // with create_timeout_seconds at its default.
    let mut o = unsafe { std::mem::zeroed::<sys::dpar_engine_options>() };
    o.create_timeout_seconds = 7.0;
    let size = std::mem::size_of::<sys::dpar_engine_options>();
    assert_eq!(unsafe { sys::dpar_engine_options_init_sized(&mut o, size) }, 0);
    assert_eq!((o.size, o.version), (size, sys::DPAR_ENGINE_OPTIONS_VERSION));
    assert_eq!((o.timeout_seconds, o.create_timeout_seconds), (300.0, 0.0));
    // The function without the size writes dpar.h 0.4's layout, version 2, which ends before
    // create_timeout_seconds: no byte past it.
    let mut plain = unsafe { std::mem::zeroed::<sys::dpar_engine_options>() };
    plain.create_timeout_seconds = 7.0;
    assert_eq!(unsafe { sys::dpar_engine_options_init(&mut plain) }, 0);
    let v2 = std::mem::offset_of!(sys::dpar_engine_options, create_timeout_seconds);
    assert_eq!((plain.size, plain.version, plain.create_timeout_seconds), (v2, 2, 7.0));
    let mut l = unsafe { std::mem::zeroed::<sys::dpar_custom_layer>() };
    let size = std::mem::size_of::<sys::dpar_custom_layer>();
    assert_eq!(unsafe { sys::dpar_custom_layer_init_sized(&mut l, size) }, 0);
    assert_eq!(l.size, size);
    let mut p = unsafe { std::mem::zeroed::<sys::dpar_optimizer_options>() };
    let size = std::mem::size_of::<sys::dpar_optimizer_options>();
    assert_eq!(unsafe { sys::dpar_optimizer_options_init_sized(&mut p, size) }, 0);
    assert_eq!(p.size, size);
    // A size that is no layout of the struct is refused.
    assert_eq!(unsafe { sys::dpar_optimizer_options_init_sized(&mut p, size + 8) }, status::NOT_SUPPORTED);
    // The reducer's version 2: its appended fields get their defaults where the library writes them.
    let mut r = unsafe { std::mem::zeroed::<sys::dpar_reducer_options>() };
    (r.processes, r.compression) = (std::ptr::NonNull::dangling().as_ptr(), 7);
    let size = std::mem::size_of::<sys::dpar_reducer_options>();
    assert_eq!(unsafe { sys::dpar_reducer_options_init_sized(&mut r, size) }, 0);
    assert_eq!((r.size, r.version, r.op), (size, sys::DPAR_REDUCER_OPTIONS_VERSION, sys::DPAR_MEAN));
    assert_eq!((r.processes, r.compression), (std::ptr::null_mut(), sys::DPAR_COMPRESSION_NONE));
    assert_eq!(version(), sys::DPAR_VERSION);
}

#[test]
fn the_creation_timeout_reaches_the_library() {
    // A negative or NaN one is refused by its name; a finite or infinite one gives an engine that trains.
    for bad in [-1.0, f64::NAN] {
        let options = options().create_timeout_seconds(bad);
        let e = Engine::new(&reference_model(), &Optimizer::sgd(0.1), &options).err().unwrap();
        assert_eq!(e.status(), status::INVALID_ARGUMENT);
        assert!(e.message().contains("create_timeout_seconds"), "{}", e);
    }
    let (x, y) = reference_batch();
    let (x, y) = (Tensor::from_f32(&[10, 4], &x).unwrap(), Tensor::from_i32(&[10], &y).unwrap());
    for good in [30.0, f64::INFINITY] {
        let options = options().timeout_seconds(60.0).create_timeout_seconds(good);
        let engine = Engine::new(&reference_model(), &Optimizer::sgd(0.1), &options).unwrap();
        let loss = engine.train_step(&x, &y).unwrap();
        assert!(loss > 0.0 && loss.is_finite(), "create_timeout_seconds {good}: loss {loss}");
    }
}

#[test]
fn every_collective_and_its_length_checks() {
    let group = CommGroup::new(2, 30.0).unwrap();
    on_each_member(&group, 2, |c| {
        let (rank, _) = c.info().unwrap();
        let me = rank as f32 + 1.0; // 1 and 2
        let mut r = [0f32; 2];
        c.all_reduce(&[me, 10.0 * me], &mut r, ReduceOp::Sum).unwrap();
        assert_eq!(r, [3.0, 30.0]);
        let mut b = [me; 3];
        c.broadcast(&mut b, 1).unwrap();
        assert_eq!(b, [2.0; 3]);
        let mut r = [0f32; 1];
        c.reduce(&[me], &mut r, ReduceOp::Max, 0).unwrap();
        assert_eq!(r[0], if rank == 0 { 2.0 } else { 0.0 });
        let mut g = [0f32; 2];
        c.all_gather(&[me], &mut g).unwrap();
        assert_eq!(g, [1.0, 2.0]);
        let mut s = [0f32; 1];
        c.reduce_scatter(&[me, 10.0 * me], &mut s, ReduceOp::Sum).unwrap();
        assert_eq!(s[0], if rank == 0 { 3.0 } else { 30.0 });
        let b = c.broadcast_async(vec![me; 2], 0).unwrap().wait().unwrap();
        assert_eq!(b, [1.0; 2]);
        let (send, g) = c.all_gather_async(vec![me], vec![0f32; 2]).unwrap().wait().unwrap();
        assert_eq!((send, g), (vec![me], vec![1.0, 2.0]));
        let (_, s) = c.reduce_scatter_async(vec![me, 10.0 * me], vec![0f32; 1], ReduceOp::Mean).unwrap().wait().unwrap();
        assert_eq!(s[0], if rank == 0 { 1.5 } else { 15.0 });
        // A Work dropped unwaited waits; one forgotten keeps its buffer, whatever the collective still writes.
        drop(c.all_reduce_async(vec![me; 8], ReduceOp::Sum).unwrap());
        std::mem::forget(c.all_reduce_async(vec![me; 8], ReduceOp::Sum).unwrap());
        let after = c.all_reduce_async(vec![me; 8], ReduceOp::Max).unwrap().wait().unwrap();
        assert_eq!(after, [2.0; 8]);
        // Refused before any participant waits for the others.
        let e = c.all_reduce(&[me; 2], &mut [0f32; 3], ReduceOp::Sum).unwrap_err();
        assert_eq!(e.message(), "recv: 3 elements, expected 2");
        let e = c.all_gather(&[me; 2], &mut [0f32; 3]).unwrap_err();
        assert_eq!(e.message(), "recv: 3 elements, expected 4");
        let e = c.reduce_scatter_async(vec![me; 3], vec![0f32; 2], ReduceOp::Sum).err().unwrap();
        assert_eq!(e.status(), status::INVALID_ARGUMENT);
        assert_eq!(e.message(), "send: 3 elements, expected 4");
        c.barrier().unwrap();
    });
    let model = reference_model();
    assert_eq!((model.num_layers().unwrap(), model.num_params().unwrap()), (3, 4));
}

#[test]
fn a_reducer_sums_gradients_marked_in_any_order_and_guards_them_in_flight() {
    let group = CommGroup::new(2, 30.0).unwrap();
    on_each_member(&group, 2, |c| {
        let (rank, _) = c.info().unwrap();
        let me = rank as f32 + 1.0; // 1 and 2
        // 8-byte first bucket, 16-byte later ones: gradients of 3, 5 and 2 floats make three buckets.
        let mut reducer = Reducer::new(c, &[3, 5, 2], 8, 16, ReduceOp::Sum).unwrap();
        assert_eq!(reducer.num_buckets().unwrap(), 3);
        for step in 1..=2 {
            let s = step as f32;
            for i in 0..3 {
                reducer.grad_mut(i).unwrap().iter_mut().for_each(|g| *g = s * me * (i as f32 + 1.0));
            }
            // Rank 0 marks backward's order; rank 1 another, and leaves gradient 1 out (it counts as zero).
            let order: &[usize] = if rank == 0 { &[2, 1, 0] } else { &[0, 2] };
            for &i in order {
                reducer.grad_ready(i).unwrap();
                let e = reducer.grad_mut(i).unwrap_err();
                assert_eq!(e.status(), status::INVALID_STATE);
            }
            assert_eq!(reducer.grad_ready(order[0]).unwrap_err().status(), status::INVALID_STATE);
            reducer.wait().unwrap();
            assert_eq!(reducer.grad(0), &[3.0 * s; 3]);
            assert_eq!(reducer.grad(1), &[2.0 * s; 5]); // rank 0's alone
            assert_eq!(reducer.grad(2), &[9.0 * s; 2]);
        }
        assert_eq!(reducer.grad_mut(3).unwrap_err().status(), status::INVALID_ARGUMENT);
        assert_eq!(reducer.grad_ready(3).unwrap_err().status(), status::INVALID_ARGUMENT);
    });
}

#[test]
fn a_reducer_over_the_processes_of_a_job_of_one_gives_the_groups_mean_in_bf16() {
    // Without mpirun, this process is rank 0 of 1: nothing crosses the processes, so bf16 rounds nothing, and the
    // mean is over the group's 2 members. Values that bfloat16 cannot hold (1/1024 beside 1 or 2) show any rounding.
    let processes = Comm::mpi(30.0).unwrap();
    assert_eq!(processes.info().unwrap(), (0, 1));
    let group = CommGroup::new(2, 30.0).unwrap();
    let comms: Vec<Comm> = (0..2).map(|r| group.member(r).unwrap()).collect();
    let processes = &processes;
    std::thread::scope(|s| {
        for mut c in comms {
            s.spawn(move || {
                let (rank, _) = c.info().unwrap();
                let me = rank as f32 + 1.0 + 1.0 / 1024.0;
                let options = ReducerOptions {
                    first_bucket_bytes: 8,
                    bucket_cap_bytes: 16,
                    op: ReduceOp::Mean,
                    processes: Some(processes),
                    compression: Compression::Bf16,
                };
                let mut reducer = Reducer::with_options(&mut c, &[3, 5], &options).unwrap();
                assert_eq!(reducer.num_buckets().unwrap(), 2);
                for i in 0..2 {
                    reducer.grad_mut(i).unwrap().iter_mut().for_each(|g| *g = me * (i as f32 + 1.0));
                }
                reducer.grad_ready(1).unwrap();
                reducer.grad_ready(0).unwrap();
                reducer.wait().unwrap();
                let mean = 1.5 + 1.0 / 1024.0;
                assert_eq!(reducer.grad(0), &[mean; 3]);
                assert_eq!(reducer.grad(1), &[2.0 * mean; 5]);
            });
        }
    });
}

#[test]
fn raw_buffers_go_through_every_collective_and_the_reducer() {
    // A group on devices, as a framework with GPU tensors makes one; here its devices are CPU devices, whose
    // memory is host memory, so the buffers can be plain vectors.
    let group = CommGroup::on_devices(&[Device::cpu(0), Device::cpu(1)], 30.0).unwrap();
    on_each_member(&group, 2, |c| {
        let (rank, _) = c.info().unwrap();
        let me = rank as f64 + 1.0; // 1 and 2
        let mut v = vec![me, 10.0 * me];
        let mut r = vec![0f64; 2];
        let raw = |v: &mut Vec<f64>| unsafe { RawBuffer::from_raw_parts(v.as_mut_ptr(), v.len()) };
        c.all_reduce_raw(raw(&mut v), raw(&mut r), ReduceOp::Sum).unwrap();
        assert_eq!(r, [3.0, 30.0]);
        let inplace = raw(&mut v);
        c.all_reduce_raw(inplace, inplace, ReduceOp::Max).unwrap();
        assert_eq!(v, [2.0, 20.0]);
        let mut b = vec![me; 3];
        c.broadcast_raw(raw(&mut b), 0).unwrap();
        assert_eq!(b, [1.0; 3]);
        let (mut send, mut recv) = (vec![me], vec![0.0]);
        c.reduce_raw(raw(&mut send), raw(&mut recv), ReduceOp::Min, 1).unwrap();
        assert_eq!(recv[0], if rank == 1 { 1.0 } else { 0.0 });
        let mut g = vec![0f64; 2];
        c.all_gather_raw(raw(&mut send), raw(&mut g)).unwrap();
        assert_eq!(g, [1.0, 2.0]);
        let (mut whole, mut mine) = (vec![me, 10.0 * me], vec![0.0]);
        c.reduce_scatter_raw(raw(&mut whole), raw(&mut mine), ReduceOp::Mean).unwrap();
        assert_eq!(mine[0], if rank == 0 { 1.5 } else { 15.0 });

        let mut a = vec![me; 4];
        c.all_reduce_raw_async(raw(&mut a), ReduceOp::Sum).unwrap().wait().unwrap();
        assert_eq!(a, [3.0; 4]);
        let mut b = vec![me; 2];
        c.broadcast_raw_async(raw(&mut b), 1).unwrap().wait().unwrap();
        assert_eq!(b, [2.0; 2]);
        c.all_gather_raw_async(raw(&mut send), raw(&mut g)).unwrap().wait().unwrap();
        assert_eq!(g, [1.0, 2.0]);
        let work = c.reduce_scatter_raw_async(raw(&mut whole), raw(&mut mine), ReduceOp::Sum).unwrap();
        work.wait().unwrap();
        assert_eq!(mine[0], if rank == 0 { 3.0 } else { 30.0 });

        // Refused before any participant waits for the others.
        let mut three = vec![0f64; 3];
        let e = c.all_reduce_raw(raw(&mut v), raw(&mut three), ReduceOp::Sum).unwrap_err();
        assert_eq!(e.message(), "recv: 3 elements, expected 2");
        let e = c.all_gather_raw(raw(&mut v), raw(&mut three)).unwrap_err();
        assert_eq!(e.message(), "recv: 3 elements, expected 4");
        let e = c.reduce_scatter_raw_async(raw(&mut three), raw(&mut v), ReduceOp::Sum).err().unwrap();
        assert_eq!(e.message(), "send: 3 elements, expected 4");
        c.barrier().unwrap();

        // The reducer over gradients the caller owns: a mean over the participants.
        let mut grads = [vec![me as f32; 3], vec![-me as f32; 2]];
        let raw_grads: Vec<RawBuffer<f32>> =
            grads.iter_mut().map(|g| unsafe { RawBuffer::from_raw_parts(g.as_mut_ptr(), g.len()) }).collect();
        {
            let mut reducer = RawReducer::new(c, &raw_grads, 0, 0, ReduceOp::Mean).unwrap();
            assert_eq!(reducer.num_buckets().unwrap(), 1);
            reducer.grad_ready(1).unwrap();
            reducer.grad_ready(0).unwrap();
            assert_eq!(reducer.grad_ready(0).unwrap_err().status(), status::INVALID_STATE);
            reducer.wait().unwrap();
        }
        assert_eq!(grads[0], [1.5f32; 3]);
        assert_eq!(grads[1], [-1.5f32; 2]);
    });
}

#[test]
fn a_residual_graph_is_built_named_and_checked() {
    let mut m = Model::new(3).unwrap();
    assert_eq!(m.last_node().unwrap(), MODEL_INPUT);
    m.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 4, true).unwrap();
    let fc2 = m.last_node().unwrap();
    assert_eq!(fc2, 2);
    m.add_sum(&[fc2, MODEL_INPUT]).unwrap();
    m.set_node_name(0, "block.fc1").unwrap().set_node_name(2, "block.fc2").unwrap();
    m.branch_from(3).unwrap().add_reshape(&[2, 2]).unwrap();
    let view = m.last_node().unwrap();
    m.add_concat(&[view, view]).unwrap().add_flatten().unwrap().linear(8, 3, true).unwrap();
    assert_eq!(m.num_layers().unwrap(), 8);
    assert_eq!(m.param_info(0).unwrap().0, "block.fc1.weight");
    assert_eq!(m.param_info(3).unwrap().0, "block.fc2.bias");
    assert_eq!(m.param_info(4).unwrap().0, "7.weight");
    let e = m.add_sum(&[0, 42]).err().unwrap();
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    assert!(e.message().contains("node 42"), "{}", e);
    let e = m.set_node_name(1, "block.fc1").err().unwrap();
    assert!(e.message().contains("already node 0"), "{}", e);
    // The graph trains on 2 devices.
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap();
    let (x, y) = reference_batch();
    let loss = engine.train_step(&Tensor::from_f32(&[10, 4], &x).unwrap(), &Tensor::from_i32(&[10], &y).unwrap());
    assert!(loss.unwrap().is_finite());
}

#[test]
fn a_tied_weight_is_one_parameter_read_by_two_nodes() {
    // The GPT pattern: the output projection reads the token embedding's weight (lm_head.weight = wte.weight).
    let mut m = Model::new(4).unwrap();
    m.embedding(7, 5).unwrap().linear(5, 7, false).unwrap();
    let e = m.tie_param(1, "weight", 0, "bias").err().unwrap();
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    assert!(e.message().contains("has no parameter \"bias\""), "{}", e);
    assert_eq!(m.num_params().unwrap(), 2);
    m.tie_param(1, "weight", 0, "weight").unwrap();
    assert_eq!(m.num_params().unwrap(), 1);
    assert_eq!(m.num_param_elements().unwrap(), 35);
    assert_eq!(m.param_info(0).unwrap(), ("0.weight".to_string(), vec![7, 5]));
    let e = m.tie_param(1, "weight", 0, "weight").err().unwrap();
    assert!(e.message().contains("tied already"), "{}", e);
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &EngineOptions::new().cpu_devices(2).processes(Processes::Single)).unwrap();
    let tokens = Tensor::from_i32(&[5], &[0, 3, 6, 2, 3]).unwrap();
    let labels = Tensor::from_i32(&[5], &[3, 6, 2, 3, 1]).unwrap();
    let first = engine.train_step(&tokens, &labels).unwrap();
    let second = engine.train_step(&tokens, &labels).unwrap();
    assert!(second < first, "{} then {}", first, second);
}

#[test]
fn batchnorm_buffers_are_named_typed_and_equal_on_every_replica() {
    let mut m = Model::new(3).unwrap();
    m.linear(4, 6, false).unwrap().batchnorm1d(6, 1e-5, 0.1, true).unwrap().linear(6, 3, true).unwrap();
    m.convert_sync_batchnorm().unwrap();
    assert_eq!(m.num_buffers().unwrap(), 3);
    assert_eq!(m.buffer_info(0).unwrap(), ("1.running_mean".to_string(), sys::DPAR_F32, vec![6]));
    assert_eq!(m.buffer_info(2).unwrap(), ("1.num_batches_tracked".to_string(), sys::DPAR_I64, vec![]));
    assert_eq!(m.get_buffer(1).unwrap(), Buffer::F32(vec![1.0; 6]));
    m.set_buffer(2, &Buffer::I64(vec![5])).unwrap();
    assert_eq!(m.get_buffer(2).unwrap(), Buffer::I64(vec![5]));
    assert!(m.set_buffer(2, &Buffer::F32(vec![5.0])).is_err());
    assert!(m.buffer_info(3).is_err());
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &EngineOptions::new().cpu_devices(3).processes(Processes::Single)).unwrap();
    let (mut x, mut y) = reference_batch();
    let input = Tensor::wrap_f32(&[10, 4], &mut x).unwrap();
    let labels = Tensor::wrap_i32(&[10], &mut y).unwrap();
    engine.train_step(&input, &labels).unwrap();
    let mean = engine.buffer(&m, 0, 0).unwrap();
    assert_ne!(mean, Buffer::F32(vec![0.0; 6]));
    assert_eq!(engine.buffer(&m, 2, 0).unwrap(), mean);
    assert_eq!(engine.buffer(&m, 1, 2).unwrap(), Buffer::I64(vec![6]));
    assert!(engine.buffer(&m, 3, 0).is_err());
}

#[test]
fn layernorm_and_embedding_train_on_i32_tokens_and_refuse_a_bad_index() {
    let mut m = Model::new(5).unwrap();
    m.embedding(9, 4).unwrap().layernorm(4, 1e-5, true).unwrap().add_flatten().unwrap().linear(12, 3, true).unwrap();
    assert!(Model::new(1).unwrap().embedding(0, 4).is_err());
    assert!(Model::new(1).unwrap().layernorm(4, 0.0, true).is_err());
    let mut padded = Model::new(1).unwrap();
    padded.embedding_padded(4, 2, -1).unwrap();
    assert_eq!(&padded.get_param(0).unwrap()[6..8], &[0.0, 0.0]);
    assert!(Model::new(1).unwrap().embedding_padded(4, 2, 4).is_err());
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &EngineOptions::new().cpu_devices(2).processes(Processes::Single)).unwrap();
    let tokens: Vec<i32> = (0..15).map(|i| (i * 5 % 9) as i32).collect();
    let labels = Tensor::from_i32(&[5], &[0, 1, 2, 1, 0]).unwrap();
    let loss = engine.train_step(&Tensor::from_i32(&[5, 3], &tokens).unwrap(), &labels).unwrap();
    assert!(loss.is_finite());
    let mut bad = tokens.clone();
    bad[4] = 9;
    let e = engine.train_step(&Tensor::from_i32(&[5, 3], &bad).unwrap(), &labels).err().unwrap();
    assert!(e.message().contains("index 9 at position (1, 1)"), "{}", e);
    let f = vec![0f32; 15];
    assert!(engine.train_step(&Tensor::from_f32(&[5, 3], &f).unwrap(), &labels).is_err());
    assert!(engine.train_step(&Tensor::from_i32(&[5, 3], &tokens).unwrap(), &labels).unwrap().is_finite());
}

/// nanoGPT's first layers, small: wte (11 tokens, 8 channels), wpe (4 positions), one attention block of 2 heads with
/// its residual, then (B, T x C) to 3 classes for the cross-entropy over (B, classes).
fn tiny_gpt() -> Model {
    let (vocab, t, c) = (11, 4, 8);
    let mut m = Model::new(7).unwrap();
    m.embedding(vocab, c).unwrap().set_node_name(0, "transformer.wte").unwrap();
    m.position_embedding(t, c).unwrap().set_node_name(1, "transformer.wpe").unwrap();
    let x = m.last_node().unwrap();
    m.causal_self_attention(c, 2, 0.0, true, Some("transformer.h.0.attn")).unwrap();
    let attn = m.last_node().unwrap();
    m.add_sum(&[attn, x]).unwrap().add_flatten().unwrap().linear(t * c, 3, true).unwrap();
    m
}

#[test]
fn attention_layers_have_pytorchs_names_and_refuse_bad_values() {
    let m = tiny_gpt();
    // wte, wpe, c_attn, attention, c_proj, sum, flatten, linear
    assert_eq!(m.num_layers().unwrap(), 8);
    let names: Vec<(String, Vec<i64>)> = (0..m.num_params().unwrap()).map(|i| m.param_info(i).unwrap()).collect();
    let expected = [
        ("transformer.wte.weight", vec![11, 8]),
        ("transformer.wpe.weight", vec![4, 8]),
        ("transformer.h.0.attn.c_attn.weight", vec![24, 8]),
        ("transformer.h.0.attn.c_attn.bias", vec![24]),
        ("transformer.h.0.attn.c_proj.weight", vec![8, 8]),
        ("transformer.h.0.attn.c_proj.bias", vec![8]),
        ("7.weight", vec![3, 32]),
        ("7.bias", vec![3]),
    ];
    assert_eq!(names, expected.iter().map(|(n, s)| (n.to_string(), s.clone())).collect::<Vec<_>>());

    let mut mha = Model::new(1).unwrap();
    mha.embedding(11, 8).unwrap().multihead_attention(8, 2, 0.0, true, true).unwrap();
    let names: Vec<String> = (1..5).map(|i| mha.param_info(i).unwrap().0).collect();
    assert_eq!(names, ["1.in_proj_weight", "1.in_proj_bias", "1.out_proj.weight", "1.out_proj.bias"]);
    assert_eq!(mha.param_info(1).unwrap().1, vec![24, 8]);
    assert_eq!(mha.get_param(2).unwrap(), vec![0.0; 24]); // zero biases, as the module's
    mha.multihead_attention(8, 1, 0.0, false, false).unwrap();
    assert_eq!(mha.num_params().unwrap(), 7); // no biases

    // Attention over q, k and v of explicit nodes, over one packed projection, and over the next input.
    let mut sdpa = Model::new(1).unwrap();
    sdpa.embedding(11, 8).unwrap().attention(&[0, 0, 0], 2, true, 0.1, Some(0.5)).unwrap();
    sdpa.linear(8, 24, false).unwrap().attention(&[2], 4, true, 0.0, None).unwrap();
    sdpa.branch_from(2).unwrap().attention(&[], 4, false, 0.0, None).unwrap();
    assert_eq!(sdpa.num_layers().unwrap(), 5);
    assert_eq!(sdpa.num_params().unwrap(), 2);

    // A bad value is refused, named, and leaves the model as it was.
    let mut m = tiny_gpt();
    let refused = |r: Result<&mut Model>, what: &str| {
        let e = r.err().expect(what);
        assert_eq!(e.status(), status::INVALID_ARGUMENT);
        assert!(e.message().contains(what), "{} does not name {}", e, what);
    };
    refused(m.multihead_attention(8, 0, 0.0, true, false), "num_heads: 0");
    refused(m.multihead_attention(8, 3, 0.0, true, false), "num_heads: 3");
    refused(m.causal_self_attention(8, 2, 1.0, true, None), "dropout_p: 1");
    refused(m.causal_self_attention(8, 3, 0.0, true, None), "n_head: 3");
    refused(m.causal_self_attention(8, 2, 0.0, true, Some("transformer.h.0.attn")), "transformer.h.0.attn.c_attn");
    refused(m.attention(&[0, 1], 2, true, 0.0, None), "n: 2");
    refused(m.attention(&[], 0, true, 0.0, None), "num_heads: 0");
    refused(m.attention(&[], 2, true, 0.0, Some(-1.0)), "scale: -1");
    refused(m.position_embedding(0, 8), "max_positions: 0");
    assert!(m.causal_self_attention(8, 2, 0.0, true, Some("a\0b")).is_err());
    assert_eq!(m.num_layers().unwrap(), 8);
    assert_eq!(m.num_params().unwrap(), 8);
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap();
    let long: Vec<i32> = (0..20).map(|i| (i % 11) as i32).collect();
    let labels = Tensor::from_i32(&[4], &[0; 4]).unwrap();
    let e = engine.train_step(&Tensor::from_i32(&[4, 5], &long).unwrap(), &labels).err().unwrap();
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    assert!(e.message().contains("a sequence of 5 positions is longer than the 4"), "{}", e);
}

#[test]
fn a_tiny_gpt_trains_on_tokens() {
    let m = tiny_gpt();
    let engine = Engine::new(&m, &Optimizer::sgd(0.1), &options()).unwrap();
    let tokens: Vec<i32> = (0..16).map(|i| (i * 7 % 11) as i32).collect();
    let labels = Tensor::from_i32(&[4], &[0, 1, 2, 1]).unwrap();
    let first = engine.train_step(&Tensor::from_i32(&[4, 4], &tokens).unwrap(), &labels).unwrap();
    assert!(first.is_finite());
    let second = engine.train_step(&Tensor::from_i32(&[4, 4], &tokens).unwrap(), &labels).unwrap();
    assert!(second < first, "{} then {}", first, second);
}
