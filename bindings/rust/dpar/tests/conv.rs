// Model::conv2d, max_pool2d, avg_pool2d and adaptive_avg_pool2d reach dpar: parameter names and shapes as
// PyTorch's, refusals with dpar's message, and a small CNN trained on (B, 1, 8, 8) inputs over 2 CPU devices to the
// same parameters as on one device.
use dpar::*;

fn cnn() -> Model {
    let mut m = Model::new(5).unwrap();
    m.conv2d(&Conv2d::new(1, 4, (3, 3)).padding((1, 1))).unwrap();
    m.activation(Activation::Relu).unwrap();
    m.max_pool2d((2, 2), None, (0, 0)).unwrap();
    m.conv2d(&Conv2d::new(4, 4, (3, 3)).stride((2, 2)).padding((2, 2)).dilation((2, 2)).groups(2).bias(false)).unwrap();
    m.avg_pool2d((2, 2), Some((1, 1)), (1, 1)).unwrap();
    m.adaptive_avg_pool2d((1, 1)).unwrap();
    m
}

#[test]
fn conv2d_and_pooling_layers_are_pytorchs() {
    let mut m = cnn();
    assert_eq!(m.num_layers().unwrap(), 6);
    assert_eq!(m.num_params().unwrap(), 3);
    assert_eq!(m.param_info(0).unwrap(), ("0.weight".to_string(), vec![4, 1, 3, 3]));
    assert_eq!(m.param_info(1).unwrap(), ("0.bias".to_string(), vec![4]));
    assert_eq!(m.param_info(2).unwrap(), ("3.weight".to_string(), vec![4, 2, 3, 3]));
    let e = m.conv2d(&Conv2d::new(4, 6, (3, 3)).groups(4)).err().expect("refused");
    assert_eq!(e.status(), status::INVALID_ARGUMENT);
    assert!(e.message().contains("divisible by groups"), "{}", e.message());
    let e = m.max_pool2d((2, 2), Some((0, 1)), (0, 0)).err().expect("refused");
    assert!(e.message().contains("stride[0]"), "{}", e.message());
    let e = m.adaptive_avg_pool2d((2, 2)).err().expect("refused");
    assert_eq!(e.status(), status::NOT_SUPPORTED);
    assert!(e.message().contains("only 1x1"), "{}", e.message());
    assert_eq!(m.num_layers().unwrap(), 6, "a refused layer was added");
}

#[test]
fn a_cnn_on_two_devices_trains_as_on_one() {
    let m = cnn();
    let n = m.num_param_elements().unwrap();
    let x: Vec<f32> = (0..5 * 64).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    let y: Vec<f32> = (0..5 * 4).map(|i| ((i * 13) % 7) as f32 / 7.0 - 0.5).collect();
    let (x, y) = (Tensor::from_f32(&[5, 1, 8, 8], &x).unwrap(), Tensor::from_f32(&[5, 4, 1, 1], &y).unwrap());
    let opt = Optimizer::sgd(0.5);
    let mut finals = Vec::new();
    for devices in [1usize, 2] {
        let e = Engine::new(&m, &opt, &EngineOptions::new().cpu_devices(devices).loss(Loss::Mse)).unwrap();
        let first = e.train_step(&x, &y).unwrap();
        let mut last = first;
        for _ in 0..10 {
            last = e.train_step(&x, &y).unwrap();
        }
        assert!(last < first, "{} devices: loss {} -> {}", devices, first, last);
        finals.push(e.params(0, n).unwrap());
    }
    for (a, b) in finals[0].iter().zip(&finals[1]) {
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1e-2), "{} against {}", a, b);
    }
}
