// DataParallel's own path with Rust slices and Vecs: forward's output as a Vec<f32>, the gradient of the mean
// squared error computed in Rust, backward and step train over 2 CPU devices as train_step with the MSE loss does
// on an identical engine, whether the slices go through forward_f32/backward_f32 or through tensors of from_f32
// (dropped before backward: the engine holds the input's memory) and wrap_f32.
use dpar::*;

const ROWS: usize = 9; // 5 and 4 per replica
const IN: usize = 4;
const OUT: usize = 3;
const STEPS: usize = 3;

fn mse_model() -> Model {
    let mut m = Model::new(5).unwrap();
    m.linear(IN as i64, 8, true).unwrap().activation(Activation::Tanh).unwrap().linear(8, OUT as i64, true).unwrap();
    m
}

fn mse_engine(m: &Model) -> Engine {
    let options = EngineOptions::new().cpu_devices(2).loss(Loss::Mse).seed(3).processes(Processes::Single);
    Engine::new(m, &Optimizer::sgd(0.1).momentum(0.9), &options).unwrap()
}

/// The inputs (ROWS x IN) and targets (ROWS x OUT), row-major.
fn mse_batch() -> (Vec<f32>, Vec<f32>) {
    let x = (0..ROWS * IN).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    let y = (0..ROWS * OUT).map(|i| ((i * 53) % 89) as f32 / 89.0 - 0.5).collect();
    (x, y)
}

/// d/d(out) of the mean of (out - y)^2 over every element, as PyTorch's mse_loss backward: 2 (out - y) / n.
fn mse_grad(out: &[f32], y: &[f32]) -> Vec<f32> {
    let coef = (2.0 / out.len() as f64) as f32;
    out.iter().zip(y).map(|(o, t)| (o - t) * coef).collect()
}

fn mse(out: &[f32], y: &[f32]) -> f64 {
    out.iter().zip(y).map(|(&o, &t)| (o as f64 - t as f64).powi(2)).sum::<f64>() / out.len() as f64
}

/// One forward, backward and step on `e` with slices; the loss computed from the output.
fn forward_backward(e: &Engine, x: &[f32], y: &[f32], through_slices: bool) -> f64 {
    let input_shape = [ROWS as i64, IN as i64];
    let out = if through_slices {
        e.forward_f32(&input_shape, x).unwrap()
    } else {
        let input = Tensor::from_f32(&input_shape, x).unwrap();
        e.forward(&input).unwrap() // `input` is dropped here, before backward
    };
    let shape = out.shape().unwrap();
    assert_eq!(shape, vec![ROWS as i64, OUT as i64]);
    let values = out.to_vec_f32().unwrap();
    drop(out);
    let mut grad = mse_grad(&values, y);
    let expected = grad.clone();
    if through_slices {
        e.backward_f32(&shape, &grad).unwrap();
    } else {
        e.backward(&Tensor::wrap_f32(&shape, &mut grad).unwrap()).unwrap();
    }
    assert_eq!(grad, expected, "backward wrote the caller's gradient");
    e.step().unwrap();
    mse(&values, y)
}

#[test]
fn forward_backward_step_on_slices_trains_as_train_step_with_mse() {
    let (xs, ys) = mse_batch();
    for through_slices in [true, false] {
        let m = mse_model();
        let n = m.num_param_elements().unwrap();
        let (e, reference) = (mse_engine(&m), mse_engine(&m));
        let x = Tensor::from_f32(&[ROWS as i64, IN as i64], &xs).unwrap();
        let y = Tensor::from_f32(&[ROWS as i64, OUT as i64], &ys).unwrap();
        let initial = e.params(0, n).unwrap();
        for step in 0..STEPS {
            let want = reference.train_step(&x, &y).unwrap() as f64;
            let got = forward_backward(&e, &xs, &ys, through_slices);
            assert!((got - want).abs() <= 1e-5 * want, "step {step}: forward's loss {got}, train_step's {want}");
        }
        assert_eq!(e.step_count().unwrap(), STEPS);
        let (got, want) = (e.params(0, n).unwrap(), reference.params(0, n).unwrap());
        // Rust's 2/n and dpar's may differ in the last bit: the parameters agree within float rounding.
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 + 1e-5 * w.abs(), "parameter {i}: {g} after backward, {w} after train_step");
        }
        let moved = got.iter().zip(&initial).map(|(g, i)| (g - i).abs()).fold(0f32, f32::max);
        assert!(moved > 1e-2, "the parameters moved by {moved} at most: nothing trained");
        assert_eq!(e.params(1, n).unwrap(), got, "the replicas differ");
    }
}

#[test]
fn backward_f32_refuses_a_gradient_of_the_wrong_shape_with_dpars_message() {
    let m = mse_model();
    let e = mse_engine(&m);
    let (xs, ys) = mse_batch();
    let values = e.forward_f32(&[ROWS as i64, IN as i64], &xs).unwrap().to_vec_f32().unwrap();
    let err = e.backward_f32(&[ROWS as i64, 2], &vec![0.0; ROWS * 2]).unwrap_err();
    assert_eq!(err.status(), status::INVALID_ARGUMENT);
    assert!(err.message().contains("must be shaped as forward's output"), "{err}");
    let err = e.backward_f32(&[ROWS as i64, OUT as i64], &[0.0; 5]).unwrap_err();
    assert!(err.message().contains("bytes"), "{err}");
    let err = e.forward_f32(&[ROWS as i64, 5], &vec![0.0; ROWS * 5]).unwrap_err();
    assert!(err.message().contains("does not fit the model"), "{err}");
    // The refusals kept the forward: its backward and step still run.
    e.backward_f32(&[ROWS as i64, OUT as i64], &mse_grad(&values, &ys)).unwrap();
    e.step().unwrap();
}

#[test]
fn forward_i32_gives_the_embeddings_rows_of_the_indices() {
    let mut m = Model::new(4).unwrap();
    m.embedding(6, 2).unwrap();
    let weight = m.get_param(0).unwrap(); // 6 x 2
    let e = Engine::new(&m, &Optimizer::sgd(0.1), &EngineOptions::new().cpu_devices(2).processes(Processes::Single))
        .unwrap();
    let indices = [5, 0, 3, 3, 1];
    let got = e.forward_i32(&[indices.len() as i64], &indices).unwrap().to_vec_f32().unwrap();
    for (r, &i) in indices.iter().enumerate() {
        let i = i as usize;
        assert_eq!(got[2 * r..2 * r + 2], weight[2 * i..2 * i + 2], "row {r}: the weight's row {i}");
    }
    let err = e.forward_f32(&[2], &[1.0, 2.0]).unwrap_err();
    assert!(err.message().contains("i32"), "{err}");
}
