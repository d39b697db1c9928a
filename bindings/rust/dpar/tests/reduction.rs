// Engine::set_gradient_reduction: the engine's trace shows its buckets reduce-scattered (ZeRO-2), and without
// clipping it trains to the bits of the all-reduce, over several buckets split unevenly between 2 CPU devices;
// switching between steps keeps them equal.
use dpar::*;

fn model() -> Model {
    let mut m = Model::new(11).unwrap();
    m.linear(6, 16, true).unwrap().activation(Activation::Relu).unwrap();
    m.linear(16, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 3, true).unwrap();
    m
}

/// Batch `step` of 11 rows (6 and 5 per replica).
fn batch(step: usize) -> (Tensor<'static>, Tensor<'static>) {
    let x: Vec<f32> = (0..66).map(|i| (((i + 7 * step) * 37) % 101) as f32 / 101.0 - 0.5).collect();
    let y: Vec<i32> = (0..11).map(|r| ((r + step) % 3) as i32).collect();
    (Tensor::from_f32(&[11, 6], &x).unwrap(), Tensor::from_i32(&[11], &y).unwrap())
}

/// One training step, traced: its loss and the trace's text.
fn traced_step(e: &Engine, x: &Tensor<'_>, y: &Tensor<'_>, name: &str) -> (f32, String) {
    let path = std::env::temp_dir().join(format!("dpar_rust_reduction_{}_{}.json", name, std::process::id()));
    e.trace_start().unwrap();
    let loss = e.train_step(x, y).unwrap();
    e.trace_stop(Some(&path)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    (loss, text)
}

#[test]
fn reduce_scatter_trains_to_the_bits_of_the_all_reduce() {
    let m = model();
    let n = m.num_param_elements().unwrap();
    // 128-byte buckets: 32 gradients each, several buckets, most of them not a multiple of 2.
    let options = EngineOptions::new().cpu_devices(2).processes(Processes::Single).buckets(128, 128);
    let opt = Optimizer::adam(0.01);
    let (all, scatter) = (Engine::new(&m, &opt, &options).unwrap(), Engine::new(&m, &opt, &options).unwrap());
    scatter.set_gradient_reduction(Reduction::ReduceScatter).unwrap();
    all.set_gradient_reduction(Reduction::AllReduce).unwrap(); // the default, set again
    assert!(scatter.num_buckets().unwrap() > 2, "{}", scatter.num_buckets().unwrap());
    let initial = all.params(0, n).unwrap();
    for step in 0..6 {
        if step == 3 {
            scatter.set_gradient_reduction(Reduction::AllReduceSharded).unwrap(); // one process: the same shards
        }
        if step == 4 {
            scatter.set_gradient_reduction(Reduction::AllReduce).unwrap(); // switching between steps
        }
        if step == 5 {
            scatter.set_gradient_reduction(Reduction::ReduceScatter).unwrap();
        }
        let (x, y) = batch(step);
        let (la, ls) = if step == 0 {
            // The setting reached dpar: its buckets are reduce-scattered, the other engine's all-reduced.
            let ((la, ta), (ls, ts)) = (traced_step(&all, &x, &y, "all"), traced_step(&scatter, &x, &y, "scatter"));
            assert!(ts.contains("\"bucket reduce-scatter\"") && !ts.contains("\"bucket all-reduce\""));
            assert!(ta.contains("\"bucket all-reduce\"") && !ta.contains("\"bucket reduce-scatter\""));
            (la, ls)
        } else {
            (all.train_step(&x, &y).unwrap(), scatter.train_step(&x, &y).unwrap())
        };
        assert_eq!(la.to_bits(), ls.to_bits(), "step {}: loss {} against {}", step, la, ls);
    }
    let first = all.params(0, n).unwrap();
    assert_ne!(first, initial, "training moved nothing");
    for replica in 0..2 {
        let (pa, ps) = (all.params(replica, n).unwrap(), scatter.params(replica, n).unwrap());
        let bits = |v: &[f32]| v.iter().map(|p| p.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&pa), bits(&ps), "replica {}", replica);
        assert_eq!(bits(&pa), bits(&first), "replica {} differs from replica 0", replica);
    }
}
