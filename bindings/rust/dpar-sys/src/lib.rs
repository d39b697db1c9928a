//! Raw bindings to dpar's C ABI: every function, type and constant of `include/dpar.h`, one to one, written by
//! hand. Everything here is `unsafe` to use; the `dpar` crate is the safe layer. The header's documentation is
//! the reference for each item.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_void};

/// `dpar_status`: a fixed-width integer; its values are the `DPAR_OK`/`DPAR_ERR_*` constants (any negative value
/// is an error, including codes newer than this crate).
pub type dpar_status = i32;
pub const DPAR_OK: dpar_status = 0;
/// The model's input, where a node id is expected.
pub const DPAR_MODEL_INPUT: i32 = -1;
/// The cross-entropy target that is ignored (PyTorch's default ignore_index).
pub const DPAR_IGNORE_INDEX: i32 = -100;
pub const DPAR_ERR_INVALID_ARGUMENT: dpar_status = -1;
pub const DPAR_ERR_OUT_OF_MEMORY: dpar_status = -2;
pub const DPAR_ERR_DEVICE: dpar_status = -3;
pub const DPAR_ERR_COMMUNICATION: dpar_status = -4;
pub const DPAR_ERR_REMOTE: dpar_status = -5;
pub const DPAR_ERR_TIMEOUT: dpar_status = -6;
pub const DPAR_ERR_MISMATCH: dpar_status = -7;
pub const DPAR_ERR_IO: dpar_status = -8;
pub const DPAR_ERR_CORRUPT: dpar_status = -9;
pub const DPAR_ERR_NOT_SUPPORTED: dpar_status = -10;
pub const DPAR_ERR_INVALID_STATE: dpar_status = -11;
pub const DPAR_ERR_INTERNAL: dpar_status = -12;

pub const DPAR_VERSION_MAJOR: i32 = 0;
pub const DPAR_VERSION_MINOR: i32 = 6;
pub const DPAR_VERSION_PATCH: i32 = 0;
pub const DPAR_VERSION: i32 = DPAR_VERSION_MAJOR * 10000 + DPAR_VERSION_MINOR * 100 + DPAR_VERSION_PATCH;
pub const DPAR_MAX_DIMS: usize = 4;

pub const DPAR_DEVICE_CPU: i32 = 0;
pub const DPAR_DEVICE_CUDA: i32 = 1;

pub const DPAR_F32: i32 = 0;
pub const DPAR_I32: i32 = 1;
pub const DPAR_BF16: i32 = 2;
pub const DPAR_F16: i32 = 3;
pub const DPAR_U8: i32 = 4;
pub const DPAR_F64: i32 = 5;
pub const DPAR_I64: i32 = 6;

pub const DPAR_RELU: i32 = 0;
pub const DPAR_GELU: i32 = 1;
pub const DPAR_TANH: i32 = 2;
pub const DPAR_SIGMOID: i32 = 3;
pub const DPAR_SILU: i32 = 4;

pub const DPAR_INIT_ZEROS: i32 = 0;
pub const DPAR_INIT_UNIFORM: i32 = 1;

pub const DPAR_SGD: i32 = 0;
pub const DPAR_ADAM: i32 = 1;
pub const DPAR_ADAMW: i32 = 2;

pub const DPAR_LOSS_CROSS_ENTROPY: i32 = 0;
pub const DPAR_LOSS_MSE: i32 = 1;

pub const DPAR_PROCESSES_AUTO: i32 = 0;
pub const DPAR_PROCESSES_SINGLE: i32 = 1;
pub const DPAR_PROCESSES_MPI: i32 = 2;
pub const DPAR_COMPRESSION_NONE: i32 = 0;
pub const DPAR_COMPRESSION_BF16: i32 = 1;
pub const DPAR_REDUCTION_ALL_REDUCE: i32 = 0;
pub const DPAR_REDUCTION_REDUCE_SCATTER: i32 = 1;
pub const DPAR_REDUCTION_ALL_REDUCE_SHARDED: i32 = 2;

pub const DPAR_FAULT_NONE: i32 = 0;
pub const DPAR_FAULT_ALLOC: i32 = 1;
pub const DPAR_FAULT_FORWARD: i32 = 2;
pub const DPAR_FAULT_BACKWARD: i32 = 3;

pub const DPAR_SUM: i32 = 0;
pub const DPAR_MEAN: i32 = 1;
pub const DPAR_MAX: i32 = 2;
pub const DPAR_MIN: i32 = 3;

pub const DPAR_MODEL_OPTIONS_VERSION: u32 = 1;
pub const DPAR_CUSTOM_LAYER_VERSION: u32 = 1;
pub const DPAR_OPTIMIZER_OPTIONS_VERSION: u32 = 1;
pub const DPAR_ENGINE_OPTIONS_VERSION: u32 = 3;
pub const DPAR_COMM_OPTIONS_VERSION: u32 = 1;
pub const DPAR_REDUCER_OPTIONS_VERSION: u32 = 2;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct dpar_device {
    pub kind: i32,
    pub index: i32,
}

macro_rules! opaque {
    ($($name:ident),*) => {$(
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
            _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
        }
    )*};
}
opaque!(dpar_tensor, dpar_model, dpar_engine, dpar_dataset, dpar_loader, dpar_comm, dpar_comm_group, dpar_work,
        dpar_reducer, DLManagedTensor);

pub type dpar_destroy_fn = unsafe extern "C" fn(payload: *mut c_void);

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dpar_model_options {
    pub size: usize,
    pub version: u32,
    pub seed: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dpar_param_spec {
    pub name: *const c_char,
    pub ndim: usize,
    pub shape: [i64; DPAR_MAX_DIMS],
    pub init: i32,
    pub bound: f32,
}

#[repr(C)]
pub struct dpar_custom_call {
    pub replica: usize,
    pub device: dpar_device,
    pub training: i32,
    pub input: *const dpar_tensor,
    pub output: *const dpar_tensor,
    pub grad_output: *const dpar_tensor,
    pub grad_input: *mut dpar_tensor,
    pub params: *const *mut dpar_tensor,
    pub grads: *const *mut dpar_tensor,
    pub num_params: usize,
}

pub type dpar_custom_fn = unsafe extern "C" fn(payload: *mut c_void, call: *const dpar_custom_call) -> dpar_status;
pub type dpar_custom_shape_fn = unsafe extern "C" fn(
    payload: *mut c_void,
    out_shape: *mut i64,
    out_ndim: *mut usize,
    in_shape: *const i64,
    in_ndim: usize,
) -> dpar_status;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct dpar_custom_layer {
    pub size: usize,
    pub version: u32,
    pub name: *const c_char,
    pub params: *const dpar_param_spec,
    pub num_params: usize,
    pub output_shape: Option<dpar_custom_shape_fn>,
    pub forward: Option<dpar_custom_fn>,
    pub backward: Option<dpar_custom_fn>,
    pub payload: *mut c_void,
    pub destroy: Option<dpar_destroy_fn>,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dpar_optimizer_options {
    pub size: usize,
    pub version: u32,
    pub kind: i32,
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: i32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dpar_engine_options {
    pub size: usize,
    pub version: u32,
    pub device_kind: i32,
    pub num_cpu_devices: usize,
    pub device_ids: *const i32,
    pub num_device_ids: usize,
    pub output_device: i32,
    pub loss: i32,
    pub seed: u64,
    pub timeout_seconds: f64,
    pub blas_threads: usize,
    pub pin_workers: i32,
    pub first_bucket_bytes: usize,
    pub bucket_cap_bytes: usize,
    pub processes: i32,
    pub create_timeout_seconds: f64,
}

pub type dpar_forward_hook = unsafe extern "C" fn(
    payload: *mut c_void,
    replica: usize,
    input_shape: *const i64,
    input_ndim: usize,
    output_shape: *const i64,
    output_ndim: usize,
) -> dpar_status;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dpar_comm_options {
    pub size: usize,
    pub version: u32,
    pub timeout_seconds: f64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dpar_reducer_options {
    pub size: usize,
    pub version: u32,
    pub first_bucket_bytes: usize,
    pub bucket_cap_bytes: usize,
    pub op: i32,
    pub processes: *mut dpar_comm,
    pub compression: i32,
}

extern "C" {
    pub fn dpar_version() -> i32;
    pub fn dpar_version_string() -> *const c_char;
    pub fn dpar_cpu_gemm_backend() -> *const c_char;
    pub fn dpar_last_error() -> *const c_char;
    pub fn dpar_clear_error();
    pub fn dpar_status_str(status: dpar_status) -> *const c_char;
    pub fn dpar_set_error(status: dpar_status, message: *const c_char) -> dpar_status;
    pub fn dpar_device_count(out: *mut usize, kind: i32) -> dpar_status;
    pub fn dpar_device_parse(out: *mut dpar_device, text: *const c_char) -> dpar_status;
    pub fn dpar_tensor_create(out: *mut *mut dpar_tensor, dtype: i32, shape: *const i64, ndim: usize, device: dpar_device) -> dpar_status;
    pub fn dpar_tensor_wrap_host(out: *mut *mut dpar_tensor, dtype: i32, shape: *const i64, ndim: usize, data: *mut c_void) -> dpar_status;
    pub fn dpar_tensor_free(tensor: *mut dpar_tensor);
    pub fn dpar_tensor_copy_from_host(tensor: *mut dpar_tensor, src: *const c_void, bytes: usize) -> dpar_status;
    pub fn dpar_tensor_copy_to_host(dst: *mut c_void, tensor: *const dpar_tensor, bytes: usize) -> dpar_status;
    pub fn dpar_tensor_shape(out_shape: *mut i64, out_ndim: *mut usize, tensor: *const dpar_tensor, capacity: usize) -> dpar_status;
    pub fn dpar_tensor_info(out_dtype: *mut i32, out_numel: *mut usize, out_device: *mut dpar_device, tensor: *const dpar_tensor) -> dpar_status;
    pub fn dpar_tensor_data(out: *mut *mut c_void, tensor: *mut dpar_tensor) -> dpar_status;
    pub fn dpar_tensor_from_dlpack(out: *mut *mut dpar_tensor, managed: *mut DLManagedTensor) -> dpar_status;
    pub fn dpar_tensor_to_dlpack(out: *mut *mut DLManagedTensor, tensor: *mut dpar_tensor) -> dpar_status;
    /// Writes dpar.h 0.4's layout, for programs built against it: call `dpar_model_options_init_sized`.
    pub fn dpar_model_options_init(opts: *mut dpar_model_options) -> dpar_status;
    /// Fills `size` bytes (`size_of::<dpar_model_options>()`) with the defaults of that layout.
    pub fn dpar_model_options_init_sized(opts: *mut dpar_model_options, size: usize) -> dpar_status;
    pub fn dpar_model_create(out: *mut *mut dpar_model, opts: *const dpar_model_options) -> dpar_status;
    pub fn dpar_model_free(model: *mut dpar_model);
    pub fn dpar_model_add_linear(model: *mut dpar_model, in_features: i64, out_features: i64, has_bias: i32) -> dpar_status;
    pub fn dpar_model_add_activation(model: *mut dpar_model, activation: i32) -> dpar_status;
    pub fn dpar_model_add_dropout(model: *mut dpar_model, p: f32) -> dpar_status;
    /// `kernel_size` (height, width) must not be null; null `stride`, `padding`, `dilation`: (1, 1), (0, 0), (1, 1).
    pub fn dpar_model_add_conv2d(model: *mut dpar_model, in_channels: i64, out_channels: i64, kernel_size: *const i64,
                                 stride: *const i64, padding: *const i64, dilation: *const i64, groups: i64,
                                 has_bias: i32) -> dpar_status;
    /// Null `stride`: the kernel size; null `padding`: (0, 0).
    pub fn dpar_model_add_max_pool2d(model: *mut dpar_model, kernel_size: *const i64, stride: *const i64,
                                     padding: *const i64) -> dpar_status;
    pub fn dpar_model_add_avg_pool2d(model: *mut dpar_model, kernel_size: *const i64, stride: *const i64,
                                     padding: *const i64) -> dpar_status;
    pub fn dpar_model_add_adaptive_avg_pool2d(model: *mut dpar_model, output_h: i64, output_w: i64) -> dpar_status;
    /// Writes dpar.h 0.4's layout, for programs built against it: call `dpar_custom_layer_init_sized`.
    pub fn dpar_custom_layer_init(layer: *mut dpar_custom_layer) -> dpar_status;
    /// Fills `size` bytes (`size_of::<dpar_custom_layer>()`) with the defaults of that layout.
    pub fn dpar_custom_layer_init_sized(layer: *mut dpar_custom_layer, size: usize) -> dpar_status;
    pub fn dpar_model_add_custom(model: *mut dpar_model, layer: *const dpar_custom_layer) -> dpar_status;
    pub fn dpar_model_last_node(out: *mut i32, model: *const dpar_model) -> dpar_status;
    pub fn dpar_model_branch_from(model: *mut dpar_model, node: i32) -> dpar_status;
    pub fn dpar_model_set_node_name(model: *mut dpar_model, node: i32, name: *const c_char) -> dpar_status;
    pub fn dpar_model_tie_param(model: *mut dpar_model, node: i32, param: *const c_char, source_node: i32, source_param: *const c_char) -> dpar_status;
    pub fn dpar_model_add_sum(model: *mut dpar_model, inputs: *const i32, n: usize) -> dpar_status;
    pub fn dpar_model_add_concat(model: *mut dpar_model, inputs: *const i32, n: usize) -> dpar_status;
    pub fn dpar_model_add_flatten(model: *mut dpar_model) -> dpar_status;
    pub fn dpar_model_add_reshape(model: *mut dpar_model, row_shape: *const i64, ndim: usize) -> dpar_status;
    pub fn dpar_model_num_layers(out: *mut usize, model: *const dpar_model) -> dpar_status;
    pub fn dpar_model_num_params(out: *mut usize, model: *const dpar_model) -> dpar_status;
    pub fn dpar_model_num_param_elements(out: *mut usize, model: *const dpar_model) -> dpar_status;
    pub fn dpar_model_param_info(out_shape: *mut i64, out_ndim: *mut usize, model: *const dpar_model, index: usize) -> dpar_status;
    pub fn dpar_model_param_name(model: *const dpar_model, index: usize) -> *const c_char;
    pub fn dpar_model_param_decays(out: *mut i32, model: *const dpar_model, index: usize) -> dpar_status;
    pub fn dpar_model_get_param(dst: *mut f32, model: *const dpar_model, index: usize, count: usize) -> dpar_status;
    pub fn dpar_model_set_param(model: *mut dpar_model, index: usize, src: *const f32, count: usize) -> dpar_status;
    pub fn dpar_model_add_batchnorm1d(model: *mut dpar_model, num_features: i64, eps: f32, momentum: f32, affine: i32) -> dpar_status;
    pub fn dpar_model_add_batchnorm2d(model: *mut dpar_model, num_features: i64, eps: f32, momentum: f32, affine: i32) -> dpar_status;
    pub fn dpar_model_add_sync_batchnorm(model: *mut dpar_model, num_features: i64, eps: f32, momentum: f32, affine: i32) -> dpar_status;
    pub fn dpar_model_convert_sync_batchnorm(model: *mut dpar_model) -> dpar_status;
    pub fn dpar_model_add_layernorm(model: *mut dpar_model, normalized_size: i64, eps: f32, elementwise_affine: i32) -> dpar_status;
    pub fn dpar_model_add_embedding(model: *mut dpar_model, num_embeddings: i64, embedding_dim: i64) -> dpar_status;
    pub fn dpar_model_add_embedding_padded(model: *mut dpar_model, num_embeddings: i64, embedding_dim: i64, padding_idx: i64) -> dpar_status;
    pub fn dpar_model_add_position_embedding(model: *mut dpar_model, max_positions: i64, embedding_dim: i64) -> dpar_status;
    /// `inputs`: q, k, v (n = 3), one packed q|k|v projection (n = 1), or null with n = 0 for the next input.
    pub fn dpar_model_add_attention(model: *mut dpar_model, inputs: *const i32, n: usize, num_heads: i64, is_causal: i32,
                                    dropout_p: f32, scale: f32) -> dpar_status;
    pub fn dpar_model_add_multihead_attention(model: *mut dpar_model, embed_dim: i64, num_heads: i64, dropout_p: f32,
                                              has_bias: i32, is_causal: i32) -> dpar_status;
    /// Null `name`: the default node names.
    pub fn dpar_model_add_causal_self_attention(model: *mut dpar_model, n_embd: i64, n_head: i64, dropout_p: f32,
                                                has_bias: i32, name: *const c_char) -> dpar_status;
    pub fn dpar_model_num_buffers(out: *mut usize, model: *const dpar_model) -> dpar_status;
    pub fn dpar_model_buffer_name(model: *const dpar_model, index: usize) -> *const c_char;
    pub fn dpar_model_buffer_info(out_dtype: *mut i32, out_shape: *mut i64, out_ndim: *mut usize, model: *const dpar_model, index: usize) -> dpar_status;
    pub fn dpar_model_get_buffer(dst: *mut c_void, model: *const dpar_model, index: usize, count: usize) -> dpar_status;
    pub fn dpar_model_set_buffer(model: *mut dpar_model, index: usize, src: *const c_void, count: usize) -> dpar_status;
    /// Writes dpar.h 0.4's layout, for programs built against it: call `dpar_optimizer_options_init_sized`.
    pub fn dpar_optimizer_options_init(opts: *mut dpar_optimizer_options) -> dpar_status;
    /// Fills `size` bytes (`size_of::<dpar_optimizer_options>()`) with the defaults of that layout.
    pub fn dpar_optimizer_options_init_sized(opts: *mut dpar_optimizer_options, size: usize) -> dpar_status;
    /// Writes dpar.h 0.4's layout, for programs built against it: call `dpar_engine_options_init_sized`.
    pub fn dpar_engine_options_init(opts: *mut dpar_engine_options) -> dpar_status;
    /// Fills `size` bytes (`size_of::<dpar_engine_options>()`) with the defaults of that layout.
    pub fn dpar_engine_options_init_sized(opts: *mut dpar_engine_options, size: usize) -> dpar_status;
    pub fn dpar_engine_create(out: *mut *mut dpar_engine, model: *const dpar_model, optimizer: *const dpar_optimizer_options, opts: *const dpar_engine_options) -> dpar_status;
    pub fn dpar_engine_free(engine: *mut dpar_engine);
    pub fn dpar_engine_abort(engine: *mut dpar_engine) -> dpar_status;
    pub fn dpar_engine_num_replicas(out: *mut usize, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_processes(out_rank: *mut usize, out_size: *mut usize, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_process_transport(engine: *const dpar_engine) -> *const c_char;
    pub fn dpar_engine_num_buckets(out: *mut usize, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_replica_device(out: *mut dpar_device, engine: *const dpar_engine, replica: usize) -> dpar_status;
    pub fn dpar_engine_split(out: *mut usize, engine: *const dpar_engine, batch: usize, capacity: usize) -> dpar_status;
    pub fn dpar_engine_train_step(out_loss: *mut f32, engine: *mut dpar_engine, input: *const dpar_tensor, target: *const dpar_tensor) -> dpar_status;
    pub fn dpar_engine_accumulate(out_loss: *mut f32, engine: *mut dpar_engine, input: *const dpar_tensor, target: *const dpar_tensor) -> dpar_status;
    pub fn dpar_engine_step(engine: *mut dpar_engine) -> dpar_status;
    pub fn dpar_engine_zero_grad(engine: *mut dpar_engine) -> dpar_status;
    pub fn dpar_engine_forward(out: *mut *mut dpar_tensor, engine: *mut dpar_engine, input: *const dpar_tensor) -> dpar_status;
    pub fn dpar_engine_backward(engine: *mut dpar_engine, grad_output: *const dpar_tensor) -> dpar_status;
    pub fn dpar_engine_set_training(engine: *mut dpar_engine, training: i32) -> dpar_status;
    pub fn dpar_engine_set_lr(engine: *mut dpar_engine, lr: f32) -> dpar_status;
    pub fn dpar_engine_set_max_grad_norm(engine: *mut dpar_engine, max_norm: f32) -> dpar_status;
    pub fn dpar_engine_set_gradient_compression(engine: *mut dpar_engine, compression: i32) -> dpar_status;
    pub fn dpar_engine_set_gradient_reduction(engine: *mut dpar_engine, reduction: i32) -> dpar_status;
    pub fn dpar_engine_set_weight_decay_exclusion(engine: *mut dpar_engine, exclude_biases_and_norms: i32) -> dpar_status;
    pub fn dpar_engine_grad_norm(out: *mut f32, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_set_precision(engine: *mut dpar_engine, compute_dtype: i32) -> dpar_status;
    pub fn dpar_engine_precision(out: *mut i32, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_set_reduce_dtype(engine: *mut dpar_engine, dtype: i32) -> dpar_status;
    pub fn dpar_engine_reduce_dtype(out: *mut i32, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_set_reproducible(engine: *mut dpar_engine, micro_chunk_rows: i64) -> dpar_status;
    pub fn dpar_engine_reproducible(out: *mut i64, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_set_allow_tf32(engine: *mut dpar_engine, allow: i32, has_tf32: *mut i32) -> dpar_status;
    pub fn dpar_engine_step_count(out: *mut usize, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_set_loss_scaling(engine: *mut dpar_engine, init_scale: f32, growth_factor: f32, backoff_factor: f32, growth_interval: i64) -> dpar_status;
    pub fn dpar_engine_loss_scale(out: *mut f32, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_last_step_skipped(out: *mut i32, engine: *const dpar_engine) -> dpar_status;
    pub fn dpar_engine_replica_losses(out: *mut f32, engine: *const dpar_engine, capacity: usize) -> dpar_status;
    pub fn dpar_engine_get_params(dst: *mut f32, engine: *mut dpar_engine, replica: usize, count: usize) -> dpar_status;
    pub fn dpar_engine_get_buffer(dst: *mut c_void, engine: *mut dpar_engine, replica: usize, index: usize, count: usize) -> dpar_status;
    pub fn dpar_engine_memory_stats(allocated_bytes: *mut i64, peak_bytes: *mut i64, engine: *const dpar_engine, replica: usize) -> dpar_status;
    pub fn dpar_engine_reset_peak_memory(engine: *mut dpar_engine, replica: usize) -> dpar_status;
    pub fn dpar_engine_set_forward_hook(engine: *mut dpar_engine, hook: Option<dpar_forward_hook>, payload: *mut c_void, destroy: Option<dpar_destroy_fn>) -> dpar_status;
    pub fn dpar_engine_save(engine: *mut dpar_engine, path: *const c_char) -> dpar_status;
    pub fn dpar_engine_load(engine: *mut dpar_engine, path: *const c_char) -> dpar_status;
    pub fn dpar_engine_trace_start(engine: *mut dpar_engine) -> dpar_status;
    pub fn dpar_engine_trace_stop(engine: *mut dpar_engine, path: *const c_char) -> dpar_status;
    pub fn dpar_engine_inject_fault(engine: *mut dpar_engine, replica: usize, fault: i32) -> dpar_status;
    /// Writes dpar.h 0.4's layout, for programs built against it: call `dpar_comm_options_init_sized`.
    pub fn dpar_comm_options_init(opts: *mut dpar_comm_options) -> dpar_status;
    /// Fills `size` bytes (`size_of::<dpar_comm_options>()`) with the defaults of that layout.
    pub fn dpar_comm_options_init_sized(opts: *mut dpar_comm_options, size: usize) -> dpar_status;
    pub fn dpar_comm_group_create(out: *mut *mut dpar_comm_group, size: usize, opts: *const dpar_comm_options) -> dpar_status;
    pub fn dpar_comm_group_free(group: *mut dpar_comm_group);
    pub fn dpar_comm_group_member(out: *mut *mut dpar_comm, group: *mut dpar_comm_group, rank: usize) -> dpar_status;
    pub fn dpar_comm_group_create_on_devices(out: *mut *mut dpar_comm_group, devices: *const dpar_device, streams: *const *mut c_void, size: usize, opts: *const dpar_comm_options) -> dpar_status;
    pub fn dpar_comm_create_mpi(out: *mut *mut dpar_comm, opts: *const dpar_comm_options) -> dpar_status;
    pub fn dpar_comm_free(comm: *mut dpar_comm);
    pub fn dpar_comm_info(out_rank: *mut usize, out_size: *mut usize, comm: *const dpar_comm) -> dpar_status;
    pub fn dpar_comm_device(out: *mut dpar_device, comm: *const dpar_comm) -> dpar_status;
    pub fn dpar_comm_abort(comm: *mut dpar_comm, reason: *const c_char) -> dpar_status;
    pub fn dpar_comm_get_async_error(out: *mut dpar_status, comm: *mut dpar_comm) -> dpar_status;
    pub fn dpar_comm_all_reduce(comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32, op: i32) -> dpar_status;
    pub fn dpar_comm_broadcast(comm: *mut dpar_comm, buffer: *mut c_void, count: usize, dtype: i32, root: usize) -> dpar_status;
    pub fn dpar_comm_reduce(comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32, op: i32, root: usize) -> dpar_status;
    pub fn dpar_comm_all_gather(comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32) -> dpar_status;
    pub fn dpar_comm_reduce_scatter(comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32, op: i32) -> dpar_status;
    pub fn dpar_comm_barrier(comm: *mut dpar_comm) -> dpar_status;
    pub fn dpar_comm_all_reduce_async(out: *mut *mut dpar_work, comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32, op: i32) -> dpar_status;
    pub fn dpar_comm_broadcast_async(out: *mut *mut dpar_work, comm: *mut dpar_comm, buffer: *mut c_void, count: usize, dtype: i32, root: usize) -> dpar_status;
    pub fn dpar_comm_all_gather_async(out: *mut *mut dpar_work, comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32) -> dpar_status;
    pub fn dpar_comm_reduce_scatter_async(out: *mut *mut dpar_work, comm: *mut dpar_comm, send: *const c_void, recv: *mut c_void, count: usize, dtype: i32, op: i32) -> dpar_status;
    pub fn dpar_work_test(out: *mut i32, work: *mut dpar_work) -> dpar_status;
    pub fn dpar_work_wait(work: *mut dpar_work) -> dpar_status;
    pub fn dpar_work_free(work: *mut dpar_work);
    /// Writes dpar.h 0.4's layout, for programs built against it: call `dpar_reducer_options_init_sized`.
    pub fn dpar_reducer_options_init(opts: *mut dpar_reducer_options) -> dpar_status;
    /// Fills `size` bytes (`size_of::<dpar_reducer_options>()`) with the defaults of that layout.
    pub fn dpar_reducer_options_init_sized(opts: *mut dpar_reducer_options, size: usize) -> dpar_status;
    pub fn dpar_reducer_create(out: *mut *mut dpar_reducer, comm: *mut dpar_comm, grads: *const *mut f32, counts: *const usize, num_grads: usize, opts: *const dpar_reducer_options) -> dpar_status;
    pub fn dpar_reducer_free(reducer: *mut dpar_reducer);
    pub fn dpar_reducer_num_buckets(out: *mut usize, reducer: *const dpar_reducer) -> dpar_status;
    pub fn dpar_reducer_grad_ready(reducer: *mut dpar_reducer, index: usize) -> dpar_status;
    pub fn dpar_reducer_wait(reducer: *mut dpar_reducer) -> dpar_status;
    pub fn dpar_dataset_load_idx(out: *mut *mut dpar_dataset, images_path: *const c_char, labels_path: *const c_char) -> dpar_status;
    pub fn dpar_dataset_free(dataset: *mut dpar_dataset);
    pub fn dpar_dataset_info(out_samples: *mut usize, out_features: *mut usize, out_classes: *mut usize, dataset: *const dpar_dataset) -> dpar_status;
    pub fn dpar_dataset_normalize(dataset: *mut dpar_dataset, mean: f32, std: f32) -> dpar_status;
    pub fn dpar_loader_create(out: *mut *mut dpar_loader, dataset: *const dpar_dataset, batch_size: usize, shuffle: i32, seed: u64, drop_last: i32) -> dpar_status;
    pub fn dpar_loader_free(loader: *mut dpar_loader);
    pub fn dpar_loader_start_epoch(loader: *mut dpar_loader, epoch: u64) -> dpar_status;
    pub fn dpar_loader_num_batches(out: *mut usize, loader: *const dpar_loader) -> dpar_status;
    pub fn dpar_loader_shard(loader: *mut dpar_loader, shard: usize, num_shards: usize) -> dpar_status;
    pub fn dpar_loader_to_device(loader: *mut dpar_loader, device: dpar_device) -> dpar_status;
    pub fn dpar_loader_next(out: *mut i32, loader: *mut dpar_loader) -> dpar_status;
    pub fn dpar_loader_inputs(loader: *const dpar_loader) -> *const dpar_tensor;
    pub fn dpar_loader_labels(loader: *const dpar_loader) -> *const dpar_tensor;
}
