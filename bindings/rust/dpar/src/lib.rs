//! Safe Rust bindings to dpar, data-parallel training over several devices through dpar's C ABI.
//!
//! Every handle is owned by a type whose `Drop` frees it; every fallible call returns
//! `Result<T, dpar::Error>`, carrying dpar's status and message. Borrowed results (a loader's batch, a custom
//! layer's tensors) borrow their parent, so the compiler keeps the parent alive while they are used.
//!
//! Thread-safety follows `dpar.h`: an [`Engine`] serialises calls on itself, so it is `Send + Sync`; tensors,
//! models, datasets and loaders are `Send` but not `Sync`; a [`Comm`] belongs to one participant (`&mut self` for
//! collectives) but may be aborted or asked for an asynchronous error from any thread.
use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::ptr;

pub use dpar_sys as sys;

// ---------------------------------------------------------------------------------------------------------------
// Errors

/// A failed dpar call: its status (a `dpar_status`, see [`status`]) and dpar's message.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    status: i32,
    message: String,
}

/// The status codes of `dpar.h`. A newer library may return others: any negative value is an error.
pub mod status {
    pub use dpar_sys::{
        DPAR_ERR_COMMUNICATION as COMMUNICATION, DPAR_ERR_CORRUPT as CORRUPT, DPAR_ERR_DEVICE as DEVICE,
        DPAR_ERR_INTERNAL as INTERNAL, DPAR_ERR_INVALID_ARGUMENT as INVALID_ARGUMENT,
        DPAR_ERR_INVALID_STATE as INVALID_STATE, DPAR_ERR_IO as IO, DPAR_ERR_MISMATCH as MISMATCH,
        DPAR_ERR_NOT_SUPPORTED as NOT_SUPPORTED, DPAR_ERR_OUT_OF_MEMORY as OUT_OF_MEMORY,
        DPAR_ERR_REMOTE as REMOTE, DPAR_ERR_TIMEOUT as TIMEOUT, DPAR_OK as OK,
    };
}

impl Error {
    /// An error to return from a callback (a custom layer, the forward hook): dpar reports `message` as the
    /// failing call's message and `status` as its status.
    pub fn new(status: i32, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }
    /// The `dpar_status` (negative).
    pub fn status(&self) -> i32 {
        self.status
    }
    /// dpar's message: what failed and why.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// The status's name, such as "DPAR_ERR_TIMEOUT".
    pub fn name(&self) -> &'static str {
        status_name(self.status)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name(), self.message)
    }
}
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The static name of a status, such as "DPAR_ERR_TIMEOUT" ("DPAR_ERR_UNKNOWN" for a code dpar does not have).
pub fn status_name(status: i32) -> &'static str {
    // Static storage in the library.
    unsafe { CStr::from_ptr(sys::dpar_status_str(status)) }.to_str().unwrap_or("DPAR_ERR_UNKNOWN")
}

/// Reads, then clears, the calling thread's last error (right after the failed call, on the same thread).
fn take_error(status: i32) -> Error {
    let message = unsafe { CStr::from_ptr(sys::dpar_last_error()) }.to_string_lossy().into_owned();
    unsafe { sys::dpar_clear_error() };
    Error { status, message }
}

fn check(status: i32) -> Result<()> {
    if status == sys::DPAR_OK {
        Ok(())
    } else {
        Err(take_error(status))
    }
}

/// A `dpar.h` option struct with the defaults of this crate's layout of it, filled by the library's `_init_sized`
/// (C programs reach it through the `_init` macro, which passes the size the same way). A library older than this
/// crate (but not older than 0.5, which brought `_init_sized`) refuses the layout: the struct then holds this crate's
/// size and version over zeros, so that the call it is passed to refuses it by its version, and the error comes
/// back beside it.
fn defaults<T>(init_sized: unsafe extern "C" fn(*mut T, usize) -> sys::dpar_status, version: u32) -> (T, Result<()>) {
    // Every versioned struct of dpar.h begins with these two fields.
    #[repr(C)]
    struct Head {
        size: usize,
        version: u32,
    }
    let mut o = unsafe { std::mem::zeroed::<T>() };
    let status = check(unsafe { init_sized(&mut o, std::mem::size_of::<T>()) });
    if status.is_err() {
        let head = &mut o as *mut T as *mut Head;
        unsafe {
            (*head).size = std::mem::size_of::<T>();
            (*head).version = version;
        }
    }
    (o, status)
}

/// Runs a dpar call that writes a count through its `out` pointer.
fn count(call: impl FnOnce(*mut usize) -> i32) -> Result<usize> {
    let mut n = 0;
    check(call(&mut n))?;
    Ok(n)
}

fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::new(status::INVALID_ARGUMENT, format!("{}: contains a NUL byte", what)))
}

fn path_cstring(p: &Path) -> Result<CString> {
    cstring(p.to_str().ok_or_else(|| Error::new(status::INVALID_ARGUMENT, "path: not UTF-8"))?, "path")
}

/// Runs a callback body at the C boundary: an `Err` becomes its status with its message (dpar_set_error), a
/// panic becomes DPAR_ERR_INTERNAL with the panic's text. Nothing unwinds into C.
fn boundary(body: impl FnOnce() -> Result<()>) -> i32 {
    let outcome = catch_unwind(AssertUnwindSafe(body));
    let (status, message) = match outcome {
        Ok(Ok(())) => return sys::DPAR_OK,
        Ok(Err(e)) => (if e.status < 0 { e.status } else { status::INTERNAL }, e.message),
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            (status::INTERNAL, format!("panicked: {}", text))
        }
    };
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    unsafe { sys::dpar_set_error(status, c.as_ptr()) }
}

// ---------------------------------------------------------------------------------------------------------------
// Handles

/// Declares a type that owns one dpar handle: the struct with its `raw` pointer, `Send` (a handle may move between
/// threads; `Sync` only where dpar.h says so, written beside the type), and a `Drop` that frees the handle.
/// The doc comments and attributes written before `pub struct` reach the type.
macro_rules! handle {
    ($(#[$meta:meta])* pub struct $name:ident { raw: *mut sys::$raw:ident } freed by sys::$free:ident;) => {
        $(#[$meta])*
        pub struct $name {
            raw: *mut sys::$raw,
        }

        unsafe impl Send for $name {}

        impl Drop for $name {
            fn drop(&mut self) {
                unsafe { sys::$free(self.raw) }
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------------------------
// Versions and devices

/// The loaded library's version, MAJOR*10000 + MINOR*100 + PATCH.
pub fn version() -> i32 {
    unsafe { sys::dpar_version() }
}

/// The loaded library's version string, such as "0.6.0".
pub fn version_string() -> &'static str {
    unsafe { CStr::from_ptr(sys::dpar_version_string()) }.to_str().unwrap_or("")
}

/// What runs the CPU matrix multiplies: the GEMM library, its version and the kernels it chose for this CPU,
/// such as "oneDNN 2.6.3 (OpenMP), avx512_core f32 kernels (CPU ISA avx512_core_amx)".
pub fn cpu_gemm_backend() -> &'static str {
    unsafe { CStr::from_ptr(sys::dpar_cpu_gemm_backend()) }.to_str().unwrap_or("")
}

/// Kinds of devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// A device such as cpu:3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    pub kind: DeviceKind,
    pub index: i32,
}

impl Device {
    pub fn cpu(index: i32) -> Device {
        Device { kind: DeviceKind::Cpu, index }
    }
    /// Parses "cpu:3", "cpu" or "cuda:1".
    pub fn parse(text: &str) -> Result<Device> {
        let c = cstring(text, "text")?;
        let mut d = sys::dpar_device { kind: 0, index: 0 };
        check(unsafe { sys::dpar_device_parse(&mut d, c.as_ptr()) })?;
        Ok(Device::from_raw(d))
    }
    fn from_raw(d: sys::dpar_device) -> Device {
        let kind = if d.kind == sys::DPAR_DEVICE_CUDA { DeviceKind::Cuda } else { DeviceKind::Cpu };
        Device { kind, index: d.index }
    }
    fn raw(&self) -> sys::dpar_device {
        let kind = match self.kind {
            DeviceKind::Cpu => sys::DPAR_DEVICE_CPU,
            DeviceKind::Cuda => sys::DPAR_DEVICE_CUDA,
        };
        sys::dpar_device { kind, index: self.index }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.kind == DeviceKind::Cuda { "cuda" } else { "cpu" };
        write!(f, "{}:{}", kind, self.index)
    }
}

/// How many devices of a kind an engine uses by default (CPU: DPAR_CPU_DEVICES or the cores this process may use).
pub fn device_count(kind: DeviceKind) -> Result<usize> {
    let mut n = 0usize;
    check(unsafe { sys::dpar_device_count(&mut n, Device { kind, index: 0 }.raw().kind) })?;
    Ok(n)
}

// ---------------------------------------------------------------------------------------------------------------
// Tensors

/// Element types of tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    I32,
}

impl DType {
    fn raw(self) -> i32 {
        match self {
            DType::F32 => sys::DPAR_F32,
            DType::I32 => sys::DPAR_I32,
        }
    }
}

/// Read access shared by owned tensors and borrowed ones.
pub trait AsTensor {
    /// The handle, for a dpar call that only reads it.
    fn as_raw(&self) -> *const sys::dpar_tensor;

    /// The extents.
    fn shape(&self) -> Result<Vec<i64>> {
        let mut s = [0i64; sys::DPAR_MAX_DIMS];
        let mut n = 0usize;
        check(unsafe { sys::dpar_tensor_shape(s.as_mut_ptr(), &mut n, self.as_raw(), s.len()) })?;
        Ok(s[..n].to_vec())
    }
    /// The element type, element count and device.
    fn info(&self) -> Result<(DType, usize, Device)> {
        let (mut dt, mut n, mut d) = (0i32, 0usize, sys::dpar_device { kind: 0, index: 0 });
        check(unsafe { sys::dpar_tensor_info(&mut dt, &mut n, &mut d, self.as_raw()) })?;
        let dtype = if dt == sys::DPAR_I32 { DType::I32 } else { DType::F32 };
        Ok((dtype, n, Device::from_raw(d)))
    }
    /// A copy of an f32 tensor's elements.
    fn to_vec_f32(&self) -> Result<Vec<f32>> {
        let (_, n, _) = self.info()?;
        let mut v = vec![0f32; n];
        check(unsafe {
            sys::dpar_tensor_copy_to_host(v.as_mut_ptr() as *mut c_void, self.as_raw(), n * 4)
        })?;
        Ok(v)
    }
    /// A copy of an i32 tensor's elements.
    fn to_vec_i32(&self) -> Result<Vec<i32>> {
        let (_, n, _) = self.info()?;
        let mut v = vec![0i32; n];
        check(unsafe {
            sys::dpar_tensor_copy_to_host(v.as_mut_ptr() as *mut c_void, self.as_raw(), n * 4)
        })?;
        Ok(v)
    }
}

/// An owned tensor. `'a` is the lifetime of caller memory it wraps without a copy (`'static` for dpar's own).
pub struct Tensor<'a> {
    raw: *mut sys::dpar_tensor,
    _memory: PhantomData<&'a mut [u8]>,
}

// A tensor handle may move between threads; it must not be used by two at once (no Sync).
unsafe impl Send for Tensor<'_> {}

impl fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor{:?}", self.shape().unwrap_or_default())
    }
}

impl AsTensor for Tensor<'_> {
    fn as_raw(&self) -> *const sys::dpar_tensor {
        self.raw
    }
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        unsafe { sys::dpar_tensor_free(self.raw) }
    }
}

impl Tensor<'static> {
    /// A zero-filled tensor on a device.
    pub fn zeros(dtype: DType, shape: &[i64], device: Device) -> Result<Tensor<'static>> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_tensor_create(&mut raw, dtype.raw(), shape.as_ptr(), shape.len(), device.raw()) })?;
        Ok(Tensor { raw, _memory: PhantomData })
    }
    /// A cpu:0 f32 tensor holding a copy of `values`.
    pub fn from_f32(shape: &[i64], values: &[f32]) -> Result<Tensor<'static>> {
        let t = Tensor::zeros(DType::F32, shape, Device::cpu(0))?;
        check(unsafe { sys::dpar_tensor_copy_from_host(t.raw, values.as_ptr() as *const c_void, values.len() * 4) })?;
        Ok(t)
    }
    /// A cpu:0 i32 tensor holding a copy of `values`.
    pub fn from_i32(shape: &[i64], values: &[i32]) -> Result<Tensor<'static>> {
        let t = Tensor::zeros(DType::I32, shape, Device::cpu(0))?;
        check(unsafe { sys::dpar_tensor_copy_from_host(t.raw, values.as_ptr() as *const c_void, values.len() * 4) })?;
        Ok(t)
    }
    /// Takes a DLPack tensor (`DLManagedTensor*`) from another framework without a copy; dpar calls its deleter
    /// when the tensor is dropped.
    ///
    /// # Safety
    /// `managed` must be a valid DLManagedTensor whose memory stays valid until its deleter runs.
    pub unsafe fn from_dlpack(managed: *mut c_void) -> Result<Tensor<'static>> {
        let mut raw = ptr::null_mut();
        check(sys::dpar_tensor_from_dlpack(&mut raw, managed as *mut sys::DLManagedTensor))?;
        Ok(Tensor { raw, _memory: PhantomData })
    }
}

impl<'a> Tensor<'a> {
    /// Wraps caller memory as a cpu:0 f32 tensor, without a copy: the slice stays borrowed while the tensor lives.
    pub fn wrap_f32(shape: &[i64], data: &'a mut [f32]) -> Result<Tensor<'a>> {
        Tensor::wrap(DType::F32, shape, data.as_mut_ptr() as *mut c_void, data.len())
    }
    /// Wraps caller memory as a cpu:0 i32 tensor, without a copy.
    pub fn wrap_i32(shape: &[i64], data: &'a mut [i32]) -> Result<Tensor<'a>> {
        Tensor::wrap(DType::I32, shape, data.as_mut_ptr() as *mut c_void, data.len())
    }
    fn wrap(dtype: DType, shape: &[i64], data: *mut c_void, len: usize) -> Result<Tensor<'a>> {
        let numel: i64 = shape.iter().product();
        if shape.is_empty() || numel < 0 || numel as usize != len {
            return Err(Error::new(
                status::INVALID_ARGUMENT,
                format!("shape {:?} holds {} elements, the slice {}", shape, numel, len),
            ));
        }
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_tensor_wrap_host(&mut raw, dtype.raw(), shape.as_ptr(), shape.len(), data) })?;
        Ok(Tensor { raw, _memory: PhantomData })
    }
    /// Overwrites an f32 tensor's elements.
    pub fn copy_from_f32(&mut self, values: &[f32]) -> Result<()> {
        check(unsafe { sys::dpar_tensor_copy_from_host(self.raw, values.as_ptr() as *const c_void, values.len() * 4) })
    }
    /// A host f32 tensor's elements, in place.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        let (dtype, n, _) = self.info()?;
        if dtype != DType::F32 {
            return Err(Error::new(status::INVALID_ARGUMENT, "tensor: not f32"));
        }
        let mut p = ptr::null_mut();
        check(unsafe { sys::dpar_tensor_data(&mut p, self.raw) })?;
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut f32, n) })
    }
    /// Hands the tensor to another framework as a DLPack `DLManagedTensor*` (shares the storage). The receiver
    /// calls its deleter.
    pub fn to_dlpack(&self) -> Result<*mut c_void> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::dpar_tensor_to_dlpack(&mut out, self.raw) })?;
        Ok(out as *mut c_void)
    }
}

/// A tensor borrowed from its parent (a loader's batch, a custom layer's argument) for `'a`.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    raw: *const sys::dpar_tensor,
    _parent: PhantomData<&'a ()>,
}

impl AsTensor for TensorRef<'_> {
    fn as_raw(&self) -> *const sys::dpar_tensor {
        self.raw
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Models and custom layers

/// nn.Conv2d's arguments, PyTorch's defaults unless set: stride (1, 1), padding (0, 0), dilation (1, 1), groups 1,
/// a bias. Pairs are (height, width).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2d {
    pub in_channels: i64,
    pub out_channels: i64,
    pub kernel_size: (i64, i64),
    pub stride: (i64, i64),
    pub padding: (i64, i64),
    pub dilation: (i64, i64),
    pub groups: i64,
    pub bias: bool,
}

impl Conv2d {
    pub fn new(in_channels: i64, out_channels: i64, kernel_size: (i64, i64)) -> Conv2d {
        Conv2d { in_channels, out_channels, kernel_size, stride: (1, 1), padding: (0, 0), dilation: (1, 1), groups: 1,
                 bias: true }
    }
    pub fn stride(mut self, stride: (i64, i64)) -> Conv2d {
        self.stride = stride;
        self
    }
    pub fn padding(mut self, padding: (i64, i64)) -> Conv2d {
        self.padding = padding;
        self
    }
    pub fn dilation(mut self, dilation: (i64, i64)) -> Conv2d {
        self.dilation = dilation;
        self
    }
    pub fn groups(mut self, groups: i64) -> Conv2d {
        self.groups = groups;
        self
    }
    pub fn bias(mut self, bias: bool) -> Conv2d {
        self.bias = bias;
        self
    }
}

fn pair(p: (i64, i64)) -> [i64; 2] {
    [p.0, p.1]
}

/// Elementwise activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    /// x * sigmoid(x), as PyTorch's nn.SiLU.
    Silu,
}

/// How a custom layer's parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Zeros,
    /// Uniform in [-bound, bound], from the model's seed.
    Uniform(f32),
}

/// One parameter of a custom layer.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
}

/// What a custom layer's forward receives: the replica's tensors, for the duration of the call.
pub struct Forward<'a> {
    pub replica: usize,
    pub training: bool,
    pub input_shape: Vec<i64>,
    pub input: &'a [f32],
    pub output: &'a mut [f32],
    pub params: Vec<&'a [f32]>,
}

/// What a custom layer's backward receives. `grads` are written (not added to): dpar accumulates.
pub struct Backward<'a> {
    pub replica: usize,
    pub input_shape: Vec<i64>,
    pub input: &'a [f32],
    pub output: &'a [f32],
    pub grad_output: &'a [f32],
    /// None when dpar does not need dL/d input (the first layer).
    pub grad_input: Option<&'a mut [f32]>,
    pub params: Vec<&'a [f32]>,
    pub grads: Vec<&'a mut [f32]>,
}

/// A layer whose math is written in Rust. Replicas call it concurrently from their worker threads, hence
/// `Send + Sync`. An `Err` fails the engine call with the error's status and message; a panic is caught at the
/// boundary and reported as DPAR_ERR_INTERNAL.
pub trait CustomLayer: Send + Sync + 'static {
    /// The output shape for an input shape (batch extent first, kept).
    fn output_shape(&self, input: &[i64]) -> Result<Vec<i64>>;
    fn forward(&self, args: Forward<'_>) -> Result<()>;
    fn backward(&self, args: Backward<'_>) -> Result<()>;
}

unsafe fn host_slice<'a>(t: *const sys::dpar_tensor) -> Result<&'a mut [f32]> {
    let r = TensorRef { raw: t, _parent: PhantomData };
    let (_, n, _) = r.info()?;
    let mut p = ptr::null_mut();
    check(sys::dpar_tensor_data(&mut p, t as *mut sys::dpar_tensor))?;
    Ok(std::slice::from_raw_parts_mut(p as *mut f32, n))
}

unsafe extern "C" fn custom_shape<L: CustomLayer>(
    payload: *mut c_void,
    out_shape: *mut i64,
    out_ndim: *mut usize,
    in_shape: *const i64,
    in_ndim: usize,
) -> i32 {
    let layer = &*(payload as *const L);
    boundary(|| {
        let input = std::slice::from_raw_parts(in_shape, in_ndim);
        let out = layer.output_shape(input)?;
        if out.is_empty() || out.len() > sys::DPAR_MAX_DIMS {
            return Err(Error::new(status::INVALID_ARGUMENT, format!("output_shape gave {:?}", out)));
        }
        for (i, e) in out.iter().enumerate() {
            *out_shape.add(i) = *e;
        }
        *out_ndim = out.len();
        Ok(())
    })
}

unsafe fn params_of<'a>(call: &sys::dpar_custom_call) -> Result<Vec<&'a [f32]>> {
    (0..call.num_params).map(|i| host_slice(*call.params.add(i)).map(|s| &*s)).collect()
}

unsafe extern "C" fn custom_forward<L: CustomLayer>(payload: *mut c_void, call: *const sys::dpar_custom_call) -> i32 {
    let layer = &*(payload as *const L);
    boundary(|| {
        let c = &*call;
        let input_ref = TensorRef { raw: c.input, _parent: PhantomData };
        layer.forward(Forward {
            replica: c.replica,
            training: c.training != 0,
            input_shape: input_ref.shape()?,
            input: host_slice(c.input)?,
            output: host_slice(c.output)?,
            params: params_of(c)?,
        })
    })
}

unsafe extern "C" fn custom_backward<L: CustomLayer>(payload: *mut c_void, call: *const sys::dpar_custom_call) -> i32 {
    let layer = &*(payload as *const L);
    boundary(|| {
        let c = &*call;
        let input_ref = TensorRef { raw: c.input, _parent: PhantomData };
        let grad_input = if c.grad_input.is_null() { None } else { Some(host_slice(c.grad_input)?) };
        let grads = (0..c.num_params).map(|i| host_slice(*c.grads.add(i))).collect::<Result<Vec<_>>>()?;
        layer.backward(Backward {
            replica: c.replica,
            input_shape: input_ref.shape()?,
            input: host_slice(c.input)?,
            output: host_slice(c.output)?,
            grad_output: host_slice(c.grad_output)?,
            grad_input,
            params: params_of(c)?,
            grads,
        })
    })
}

unsafe extern "C" fn drop_payload<T>(payload: *mut c_void) {
    drop(Box::from_raw(payload as *mut T));
}

/// The model's input, where a node id is expected ([`Model::branch_from`], [`Model::add_sum`]).
pub const MODEL_INPUT: i32 = sys::DPAR_MODEL_INPUT;

/// The cross-entropy target that is ignored: no loss, no gradient, not counted in the mean (PyTorch's default
/// `ignore_index`, for padding and prompt tokens).
pub const IGNORE_INDEX: i32 = sys::DPAR_IGNORE_INDEX;

handle! {
    /// A model graph on the host, built append-only: the template an [`Engine`] copies to every device. Each add
    /// reads the previous node (or the one [`Model::branch_from`] chose); the output is the last node.
    pub struct Model { raw: *mut sys::dpar_model } freed by sys::dpar_model_free;
}

impl Model {
    /// An empty model whose parameters are initialised from `seed`.
    pub fn new(seed: u64) -> Result<Model> {
        let (mut o, status) = defaults(sys::dpar_model_options_init_sized, sys::DPAR_MODEL_OPTIONS_VERSION);
        status?;
        o.seed = seed;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_model_create(&mut raw, &o) })?;
        Ok(Model { raw })
    }
    /// Appends y = x W^T + b, initialised as PyTorch's nn.Linear.
    pub fn linear(&mut self, in_features: i64, out_features: i64, bias: bool) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_linear(self.raw, in_features, out_features, bias as i32) })?;
        Ok(self)
    }
    pub fn activation(&mut self, a: Activation) -> Result<&mut Model> {
        let code = match a {
            Activation::Relu => sys::DPAR_RELU,
            Activation::Gelu => sys::DPAR_GELU,
            Activation::Tanh => sys::DPAR_TANH,
            Activation::Sigmoid => sys::DPAR_SIGMOID,
            Activation::Silu => sys::DPAR_SILU,
        };
        check(unsafe { sys::dpar_model_add_activation(self.raw, code) })?;
        Ok(self)
    }
    pub fn dropout(&mut self, p: f32) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_dropout(self.raw, p) })?;
        Ok(self)
    }
    /// Appends a 2-D convolution (PyTorch's nn.Conv2d, NCHW): `m.conv2d(&Conv2d::new(3, 8, (3, 3)).padding((1, 1)))`.
    /// Parameters "weight" (out, in / groups, kh, kw) and, with a bias, "bias" (out), initialised as PyTorch's.
    pub fn conv2d(&mut self, c: &Conv2d) -> Result<&mut Model> {
        let (k, s, p, d) = (pair(c.kernel_size), pair(c.stride), pair(c.padding), pair(c.dilation));
        check(unsafe {
            sys::dpar_model_add_conv2d(self.raw, c.in_channels, c.out_channels, k.as_ptr(), s.as_ptr(), p.as_ptr(),
                                       d.as_ptr(), c.groups, c.bias as i32)
        })?;
        Ok(self)
    }
    /// Appends PyTorch's nn.MaxPool2d(kernel_size, stride, padding); `stride` None is the kernel size.
    pub fn max_pool2d(&mut self, kernel_size: (i64, i64), stride: Option<(i64, i64)>, padding: (i64, i64))
                      -> Result<&mut Model> {
        let (k, p, s) = (pair(kernel_size), pair(padding), stride.map(pair));
        let sp = s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        check(unsafe { sys::dpar_model_add_max_pool2d(self.raw, k.as_ptr(), sp, p.as_ptr()) })?;
        Ok(self)
    }
    /// Appends PyTorch's nn.AvgPool2d(kernel_size, stride, padding) (padding counted in every window's divisor);
    /// `stride` None is the kernel size.
    pub fn avg_pool2d(&mut self, kernel_size: (i64, i64), stride: Option<(i64, i64)>, padding: (i64, i64))
                      -> Result<&mut Model> {
        let (k, p, s) = (pair(kernel_size), pair(padding), stride.map(pair));
        let sp = s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        check(unsafe { sys::dpar_model_add_avg_pool2d(self.raw, k.as_ptr(), sp, p.as_ptr()) })?;
        Ok(self)
    }
    /// Appends PyTorch's nn.AdaptiveAvgPool2d(output_size); only (1, 1) is implemented (NOT_SUPPORTED otherwise).
    pub fn adaptive_avg_pool2d(&mut self, output_size: (i64, i64)) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_adaptive_avg_pool2d(self.raw, output_size.0, output_size.1) })?;
        Ok(self)
    }
    /// Appends a layer written in Rust. dpar owns `layer` from here: it is dropped when the model and every engine
    /// built from it are gone.
    pub fn custom<L: CustomLayer>(&mut self, name: &str, params: &[ParamSpec], layer: L) -> Result<&mut Model> {
        let cname = cstring(name, "name")?;
        let names = params.iter().map(|p| cstring(&p.name, "param name")).collect::<Result<Vec<_>>>()?;
        let mut specs = Vec::with_capacity(params.len());
        for (p, n) in params.iter().zip(&names) {
            if p.shape.is_empty() || p.shape.len() > sys::DPAR_MAX_DIMS {
                return Err(Error::new(status::INVALID_ARGUMENT, format!("{}: shape {:?}", p.name, p.shape)));
            }
            let mut shape = [0i64; sys::DPAR_MAX_DIMS];
            shape[..p.shape.len()].copy_from_slice(&p.shape);
            let (init, bound) = match p.init {
                Init::Zeros => (sys::DPAR_INIT_ZEROS, 0.0),
                Init::Uniform(b) => (sys::DPAR_INIT_UNIFORM, b),
            };
            specs.push(sys::dpar_param_spec { name: n.as_ptr(), ndim: p.shape.len(), shape, init, bound });
        }
        let (mut desc, status) = defaults(sys::dpar_custom_layer_init_sized, sys::DPAR_CUSTOM_LAYER_VERSION);
        status?;
        desc.name = cname.as_ptr();
        desc.params = specs.as_ptr();
        desc.num_params = specs.len();
        desc.output_shape = Some(custom_shape::<L>);
        desc.forward = Some(custom_forward::<L>);
        desc.backward = Some(custom_backward::<L>);
        desc.payload = Box::into_raw(Box::new(layer)) as *mut c_void;
        desc.destroy = Some(drop_payload::<L>);
        // From here dpar owns the payload, even when it refuses the layer (it calls destroy then).
        check(unsafe { sys::dpar_model_add_custom(self.raw, &desc) })?;
        Ok(self)
    }
    /// The id of the last node added (nodes are numbered 0, 1, ... as added); [`MODEL_INPUT`] when empty.
    pub fn last_node(&self) -> Result<i32> {
        let mut out = 0i32;
        check(unsafe { sys::dpar_model_last_node(&mut out, self.raw) })?;
        Ok(out)
    }
    /// The next node added without explicit inputs reads `node` ([`MODEL_INPUT`] for the model's input).
    pub fn branch_from(&mut self, node: i32) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_branch_from(self.raw, node) })?;
        Ok(self)
    }
    /// Names a node as a PyTorch module path ("layer1.0.conv1"): its parameters become "layer1.0.conv1.weight".
    pub fn set_node_name(&mut self, node: i32, name: &str) -> Result<&mut Model> {
        let c = cstring(name, "name")?;
        check(unsafe { sys::dpar_model_set_node_name(self.raw, node, c.as_ptr()) })?;
        Ok(self)
    }
    /// Ties node `node`'s parameter `param` to node `source_node`'s `source_param`, as PyTorch's
    /// `lm_head.weight = wte.weight`: both nodes read the source's parameter (its values and name), held, counted,
    /// reduced and stepped once, its gradient the sum of both; checkpoints hold it under both keys.
    pub fn tie_param(&mut self, node: i32, param: &str, source_node: i32, source_param: &str) -> Result<&mut Model> {
        let p = cstring(param, "param")?;
        let s = cstring(source_param, "source_param")?;
        check(unsafe { sys::dpar_model_tie_param(self.raw, node, p.as_ptr(), source_node, s.as_ptr()) })?;
        Ok(self)
    }
    /// Appends the elementwise sum of nodes of equal shape (a residual connection).
    pub fn add_sum(&mut self, inputs: &[i32]) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_sum(self.raw, inputs.as_ptr(), inputs.len()) })?;
        Ok(self)
    }
    /// Appends the concatenation of nodes along dim 1.
    pub fn add_concat(&mut self, inputs: &[i32]) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_concat(self.raw, inputs.as_ptr(), inputs.len()) })?;
        Ok(self)
    }
    /// Appends (B, ...) -> (B, prod(...)), a view with no copy.
    pub fn add_flatten(&mut self) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_flatten(self.raw) })?;
        Ok(self)
    }
    /// Appends (B, ...) -> (B, row_shape...), as nn.Unflatten(1, row_shape): a view with no copy.
    pub fn add_reshape(&mut self, row_shape: &[i64]) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_reshape(self.raw, row_shape.as_ptr(), row_shape.len()) })?;
        Ok(self)
    }
    /// The number of nodes.
    pub fn num_layers(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_model_num_layers(n, self.raw) })
    }
    /// The number of parameter tensors.
    pub fn num_params(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_model_num_params(n, self.raw) })
    }
    pub fn num_param_elements(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_model_num_param_elements(n, self.raw) })
    }
    /// Parameter `index`'s name ("0.weight") and shape.
    pub fn param_info(&self, index: usize) -> Result<(String, Vec<i64>)> {
        let mut s = [0i64; sys::DPAR_MAX_DIMS];
        let mut n = 0usize;
        check(unsafe { sys::dpar_model_param_info(s.as_mut_ptr(), &mut n, self.raw, index) })?;
        let name = unsafe { sys::dpar_model_param_name(self.raw, index) };
        if name.is_null() {
            return Err(take_error(status::INVALID_ARGUMENT));
        }
        Ok((unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned(), s[..n].to_vec()))
    }
    /// Whether parameter `index` decays when the engine excludes biases and norms from weight decay
    /// (`Engine::set_weight_decay_exclusion`): false for biases and BatchNorm's weight and bias.
    pub fn param_decays(&self, index: usize) -> Result<bool> {
        let mut d = 0i32;
        check(unsafe { sys::dpar_model_param_decays(&mut d, self.raw, index) })?;
        Ok(d != 0)
    }
    pub fn get_param(&self, index: usize) -> Result<Vec<f32>> {
        let (_, shape) = self.param_info(index)?;
        let mut v = vec![0f32; shape.iter().product::<i64>() as usize];
        check(unsafe { sys::dpar_model_get_param(v.as_mut_ptr(), self.raw, index, v.len()) })?;
        Ok(v)
    }
    pub fn set_param(&mut self, index: usize, values: &[f32]) -> Result<()> {
        check(unsafe { sys::dpar_model_set_param(self.raw, index, values.as_ptr(), values.len()) })
    }
    /// Appends BatchNorm1d over `num_features` channels of (B, C) or (B, C, L) (PyTorch's eps 1e-5, momentum 0.1).
    pub fn batchnorm1d(&mut self, num_features: i64, eps: f32, momentum: f32, affine: bool) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_batchnorm1d(self.raw, num_features, eps, momentum, affine as i32) })?;
        Ok(self)
    }
    /// Appends BatchNorm2d over the channels of (B, C, H, W).
    pub fn batchnorm2d(&mut self, num_features: i64, eps: f32, momentum: f32, affine: bool) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_batchnorm2d(self.raw, num_features, eps, momentum, affine as i32) })?;
        Ok(self)
    }
    /// Appends SyncBatchNorm: statistics over every replica of every process.
    pub fn sync_batchnorm(&mut self, num_features: i64, eps: f32, momentum: f32, affine: bool) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_sync_batchnorm(self.raw, num_features, eps, momentum, affine as i32) })?;
        Ok(self)
    }
    /// Appends LayerNorm over the last dim (`normalized_size`) of (B, ..., D), as torch.nn.LayerNorm (eps 1e-5).
    pub fn layernorm(&mut self, normalized_size: i64, eps: f32, elementwise_affine: bool) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_layernorm(self.raw, normalized_size, eps, elementwise_affine as i32) })?;
        Ok(self)
    }
    /// Appends an Embedding: i32 indices (B) or (B, T) give rows of a (num_embeddings, embedding_dim) weight. A
    /// model whose input it reads takes i32 input tensors.
    pub fn embedding(&mut self, num_embeddings: i64, embedding_dim: i64) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_embedding(self.raw, num_embeddings, embedding_dim) })?;
        Ok(self)
    }
    /// Appends an Embedding whose row `padding_idx` (negative: from the end) starts at zero and gets no gradient.
    pub fn embedding_padded(&mut self, num_embeddings: i64, embedding_dim: i64, padding_idx: i64) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_embedding_padded(self.raw, num_embeddings, embedding_dim, padding_idx) })?;
        Ok(self)
    }
    /// Appends GPT-2's learned position embedding (nanoGPT's wpe): (B, T, C) -> input + weight[t] at position t,
    /// "weight" (max_positions, embedding_dim) drawn from N(0, 1). T past `max_positions` is refused.
    pub fn position_embedding(&mut self, max_positions: i64, embedding_dim: i64) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_add_position_embedding(self.raw, max_positions, embedding_dim) })?;
        Ok(self)
    }
    /// Appends F.scaled_dot_product_attention over `num_heads` heads, the output (B, L, C) with the heads merged.
    /// `inputs`: the nodes q, k and v (3 ids), one packed (B, T, 3C) q|k|v projection (1 id), or none for the next
    /// input as a packed projection. `scale` None is 1/sqrt(head size). No parameters.
    pub fn attention(&mut self, inputs: &[i32], num_heads: i64, is_causal: bool, dropout_p: f32, scale: Option<f32>)
                     -> Result<&mut Model> {
        let ids = if inputs.is_empty() { ptr::null() } else { inputs.as_ptr() };
        check(unsafe {
            sys::dpar_model_add_attention(self.raw, ids, inputs.len(), num_heads, is_causal as i32, dropout_p,
                                          scale.unwrap_or(0.0))
        })?;
        Ok(self)
    }
    /// Appends self-attention as torch.nn.MultiheadAttention(embed_dim, num_heads, dropout_p, bias,
    /// batch_first=True)(x, x, x)[0] on (B, T, embed_dim), with its parameter names ("in_proj_weight",
    /// "in_proj_bias", "out_proj.weight", "out_proj.bias") and initialisation.
    pub fn multihead_attention(&mut self, embed_dim: i64, num_heads: i64, dropout_p: f32, bias: bool, is_causal: bool)
                               -> Result<&mut Model> {
        check(unsafe {
            sys::dpar_model_add_multihead_attention(self.raw, embed_dim, num_heads, dropout_p, bias as i32,
                                                    is_causal as i32)
        })?;
        Ok(self)
    }
    /// Appends nanoGPT's CausalSelfAttention on (B, T, n_embd): c_attn, causal attention of `n_head` heads, c_proj
    /// and resid_dropout. With `name` ("transformer.h.0.attn") the linear nodes are "<name>.c_attn" and
    /// "<name>.c_proj", so their parameters have nanoGPT's state_dict keys. A refusal leaves the model as it was.
    pub fn causal_self_attention(&mut self, n_embd: i64, n_head: i64, dropout_p: f32, bias: bool, name: Option<&str>)
                                 -> Result<&mut Model> {
        let c = name.map(|n| cstring(n, "name")).transpose()?;
        let cp = c.as_ref().map_or(ptr::null(), |c| c.as_ptr());
        check(unsafe {
            sys::dpar_model_add_causal_self_attention(self.raw, n_embd, n_head, dropout_p, bias as i32, cp)
        })?;
        Ok(self)
    }
    /// Turns every BatchNorm layer into SyncBatchNorm.
    pub fn convert_sync_batchnorm(&mut self) -> Result<&mut Model> {
        check(unsafe { sys::dpar_model_convert_sync_batchnorm(self.raw) })?;
        Ok(self)
    }
    /// The number of buffers (BatchNorm's running statistics: state that is not a parameter).
    pub fn num_buffers(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_model_num_buffers(n, self.raw) })
    }
    /// Buffer `index`'s name ("1.running_mean"), dtype (`sys::DPAR_F32` or `sys::DPAR_I64`) and shape (empty for a
    /// scalar).
    pub fn buffer_info(&self, index: usize) -> Result<(String, i32, Vec<i64>)> {
        let mut s = [0i64; sys::DPAR_MAX_DIMS];
        let (mut n, mut dtype) = (0usize, 0i32);
        check(unsafe { sys::dpar_model_buffer_info(&mut dtype, s.as_mut_ptr(), &mut n, self.raw, index) })?;
        let name = unsafe { sys::dpar_model_buffer_name(self.raw, index) };
        if name.is_null() {
            return Err(take_error(status::INVALID_ARGUMENT));
        }
        Ok((unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned(), dtype, s[..n].to_vec()))
    }
    pub fn get_buffer(&self, index: usize) -> Result<Buffer> {
        let (_, dtype, shape) = self.buffer_info(index)?;
        let n = shape.iter().product::<i64>() as usize;
        Ok(if dtype == sys::DPAR_I64 {
            let mut v = vec![0i64; n];
            check(unsafe { sys::dpar_model_get_buffer(v.as_mut_ptr() as *mut c_void, self.raw, index, n) })?;
            Buffer::I64(v)
        } else {
            let mut v = vec![0f32; n];
            check(unsafe { sys::dpar_model_get_buffer(v.as_mut_ptr() as *mut c_void, self.raw, index, n) })?;
            Buffer::F32(v)
        })
    }
    /// Overwrites buffer `index`; the values' type must be the buffer's.
    pub fn set_buffer(&mut self, index: usize, values: &Buffer) -> Result<()> {
        let (_, dtype, _) = self.buffer_info(index)?;
        let (ptr, n, want) = match values {
            Buffer::F32(v) => (v.as_ptr() as *const c_void, v.len(), sys::DPAR_F32),
            Buffer::I64(v) => (v.as_ptr() as *const c_void, v.len(), sys::DPAR_I64),
        };
        if want != dtype {
            return Err(Error::new(status::INVALID_ARGUMENT, format!("buffer {index}: values of another dtype")));
        }
        check(unsafe { sys::dpar_model_set_buffer(self.raw, index, ptr, n) })
    }
}

/// A buffer's values, in its dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

// ---------------------------------------------------------------------------------------------------------------
// The engine

/// Optimizer options, PyTorch's defaults unless set.
#[derive(Clone, Copy)]
pub struct Optimizer(sys::dpar_optimizer_options);

impl Optimizer {
    fn with_kind(kind: i32, lr: f32) -> Optimizer {
        // A refused layout is refused again, by its version, when the engine is created.
        let (mut o, _) = defaults(sys::dpar_optimizer_options_init_sized, sys::DPAR_OPTIMIZER_OPTIONS_VERSION);
        o.kind = kind;
        o.lr = lr;
        Optimizer(o)
    }
    pub fn sgd(lr: f32) -> Optimizer {
        Optimizer::with_kind(sys::DPAR_SGD, lr)
    }
    pub fn adam(lr: f32) -> Optimizer {
        Optimizer::with_kind(sys::DPAR_ADAM, lr)
    }
    pub fn adamw(lr: f32) -> Optimizer {
        Optimizer::with_kind(sys::DPAR_ADAMW, lr)
    }
    pub fn momentum(mut self, m: f32) -> Optimizer {
        self.0.momentum = m;
        self
    }
    pub fn dampening(mut self, d: f32) -> Optimizer {
        self.0.dampening = d;
        self
    }
    pub fn nesterov(mut self, on: bool) -> Optimizer {
        self.0.nesterov = on as i32;
        self
    }
    pub fn weight_decay(mut self, w: f32) -> Optimizer {
        self.0.weight_decay = w;
        self
    }
    pub fn betas(mut self, beta1: f32, beta2: f32) -> Optimizer {
        self.0.beta1 = beta1;
        self.0.beta2 = beta2;
        self
    }
    pub fn eps(mut self, eps: f32) -> Optimizer {
        self.0.eps = eps;
        self
    }
}

/// Losses of the fused training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    CrossEntropy,
    Mse,
}

/// How gradient buckets cross the processes (`Engine::set_gradient_compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// f32, as summed.
    None,
    /// Each process's sum rounded to bfloat16, summed across the processes in bfloat16: half the bytes.
    Bf16,
}

/// The dtype gradient buckets are reduced in (`Engine::set_reduce_dtype`), as FSDP's
/// MixedPrecisionPolicy(reduce_dtype=...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceDtype {
    /// Summed in f32 within a process, across processes as `set_gradient_compression` says: the default.
    F32,
    /// Every replica's bucket rounded to bf16 and the whole reduction carried in bf16 (within and across the
    /// processes), the result widened to f32 for clipping and the optimizer.
    Bf16,
}

/// What linear layers and convolutions compute in (`Engine::set_precision`), as torch.autocast's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32: the default.
    F32,
    /// bf16 operands (the input rounded, each step's bf16 copy of the weights), f32 accumulation and results;
    /// master weights, gradients, the optimizer and checkpoints f32.
    Bf16,
    /// f16 (IEEE half) operands, f32 accumulation and results, as `Bf16`; f16 overflows above 65504, so train it
    /// with loss scaling (`Engine::set_loss_scaling`). NOT_SUPPORTED on CPU devices (oneDNN 2.6 has no f16 GEMM for
    /// CPUs; the message says why); CUDA devices have it.
    F16,
}

impl Precision {
    fn raw(self) -> i32 {
        match self {
            Precision::F32 => sys::DPAR_F32,
            Precision::Bf16 => sys::DPAR_BF16,
            Precision::F16 => sys::DPAR_F16,
        }
    }
}

/// How each bucket of summed gradients reaches the replicas (`Engine::set_gradient_reduction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Every replica receives the whole summed bucket (an all-reduce, as DDP): the default. Each process holds
    /// the whole optimizer state, among its devices, and only the all-reduce crosses the processes.
    AllReduce,
    /// Each replica receives only its block of every bucket, the one its optimizer steps (ZeRO stage 2); under
    /// mpirun the optimizer's shards span every process, for the all-reduce's bytes between them.
    ReduceScatter,
    /// The all-reduce, with the optimizer's shards spanning every process (ZeRO stage 1 over the processes): the
    /// memory of `ReduceScatter` for about 1.5x the bytes between processes (the parameters' all-gather too).
    AllReduceSharded,
}

/// Which processes an engine spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processes {
    Auto,
    Single,
    Mpi,
}

/// Engine options (dpar_engine_options), the header's defaults unless set.
#[derive(Clone)]
pub struct EngineOptions {
    raw: sys::dpar_engine_options,
    device_ids: Option<Vec<i32>>,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        // A refused layout is refused again, by its version, when the engine is created.
        let (raw, _) = defaults(sys::dpar_engine_options_init_sized, sys::DPAR_ENGINE_OPTIONS_VERSION);
        EngineOptions { raw, device_ids: None }
    }
}

impl EngineOptions {
    pub fn new() -> EngineOptions {
        EngineOptions::default()
    }
    /// How many virtual CPU devices exist (0: dpar's default count).
    pub fn cpu_devices(mut self, n: usize) -> EngineOptions {
        self.raw.num_cpu_devices = n;
        self
    }
    /// The kind of every device of this engine (default CPU): with Cuda, device_ids name GPUs (one may repeat, to
    /// put several replicas on it).
    pub fn device_kind(mut self, kind: DeviceKind) -> EngineOptions {
        self.raw.device_kind = Device { kind, index: 0 }.raw().kind;
        self
    }
    /// The devices to use, in order.
    pub fn device_ids(mut self, ids: &[i32]) -> EngineOptions {
        self.device_ids = Some(ids.to_vec());
        self
    }
    pub fn output_device(mut self, id: i32) -> EngineOptions {
        self.raw.output_device = id;
        self
    }
    pub fn loss(mut self, loss: Loss) -> EngineOptions {
        self.raw.loss = if loss == Loss::Mse { sys::DPAR_LOSS_MSE } else { sys::DPAR_LOSS_CROSS_ENTROPY };
        self
    }
    pub fn seed(mut self, seed: u64) -> EngineOptions {
        self.raw.seed = seed;
        self
    }
    pub fn timeout_seconds(mut self, s: f64) -> EngineOptions {
        self.raw.timeout_seconds = s;
        self
    }
    /// How long creating the engine waits for every process to create its own (processes start at different
    /// times; a machine under load is slow to get there): the connection between the processes and their first
    /// exchanges. `timeout_seconds` holds after. 0 (the default): `timeout_seconds`; `f64::INFINITY`: no limit.
    pub fn create_timeout_seconds(mut self, s: f64) -> EngineOptions {
        self.raw.create_timeout_seconds = s;
        self
    }
    pub fn blas_threads(mut self, n: usize) -> EngineOptions {
        self.raw.blas_threads = n;
        self
    }
    pub fn pin_workers(mut self, on: bool) -> EngineOptions {
        self.raw.pin_workers = on as i32;
        self
    }
    pub fn buckets(mut self, first_bucket_bytes: usize, bucket_cap_bytes: usize) -> EngineOptions {
        self.raw.first_bucket_bytes = first_bucket_bytes;
        self.raw.bucket_cap_bytes = bucket_cap_bytes;
        self
    }
    pub fn processes(mut self, p: Processes) -> EngineOptions {
        self.raw.processes = match p {
            Processes::Auto => sys::DPAR_PROCESSES_AUTO,
            Processes::Single => sys::DPAR_PROCESSES_SINGLE,
            Processes::Mpi => sys::DPAR_PROCESSES_MPI,
        };
        self
    }
}

/// Faults that [`Engine::inject_fault`] arms, for tests of error handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    Alloc,
    Forward,
    Backward,
}

type HookFn = dyn Fn(usize, &[i64], &[i64]) -> Result<()> + Send + Sync;

unsafe extern "C" fn hook_trampoline(
    payload: *mut c_void,
    replica: usize,
    input_shape: *const i64,
    input_ndim: usize,
    output_shape: *const i64,
    output_ndim: usize,
) -> i32 {
    let hook = &*(payload as *const Box<HookFn>);
    boundary(|| {
        hook(
            replica,
            std::slice::from_raw_parts(input_shape, input_ndim),
            std::slice::from_raw_parts(output_shape, output_ndim),
        )
    })
}

/// What a replica's device holds of dpar's tensors (Engine::memory_stats), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Held now.
    pub allocated_bytes: i64,
    /// The most held at once since the process started or the device's last reset.
    pub peak_bytes: i64,
}

handle! {
    /// A DataParallel engine: one worker thread per device, each with a persistent replica.
    pub struct Engine { raw: *mut sys::dpar_engine } freed by sys::dpar_engine_free;
}

// dpar.h: "an engine may be called from several threads; calls are serialised by a lock inside it".
unsafe impl Sync for Engine {}

impl Engine {
    /// Copies `model` to every device (the model may be dropped or changed afterwards).
    pub fn new(model: &Model, optimizer: &Optimizer, options: &EngineOptions) -> Result<Engine> {
        let mut o = options.raw;
        if let Some(ids) = &options.device_ids {
            o.device_ids = ids.as_ptr();
            o.num_device_ids = ids.len();
        }
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_engine_create(&mut raw, model.raw, &optimizer.0, &o) })?;
        Ok(Engine { raw })
    }
    /// One fused training step; returns the mean loss over the batch.
    pub fn train_step(&self, input: &impl AsTensor, target: &impl AsTensor) -> Result<f32> {
        let mut loss = 0f32;
        check(unsafe { sys::dpar_engine_train_step(&mut loss, self.raw, input.as_raw(), target.as_raw()) })?;
        Ok(loss)
    }
    /// Forward, loss and backward of a micro-batch, accumulating gradients (DDP's no_sync); then [`Engine::step`].
    pub fn accumulate(&self, input: &impl AsTensor, target: &impl AsTensor) -> Result<f32> {
        let mut loss = 0f32;
        check(unsafe { sys::dpar_engine_accumulate(&mut loss, self.raw, input.as_raw(), target.as_raw()) })?;
        Ok(loss)
    }
    pub fn step(&self) -> Result<()> {
        check(unsafe { sys::dpar_engine_step(self.raw) })
    }
    pub fn zero_grad(&self) -> Result<()> {
        check(unsafe { sys::dpar_engine_zero_grad(self.raw) })
    }
    /// DataParallel's forward, gathered on the output device. In training mode the engine keeps a view of the
    /// input until backward, so the input must be dpar's memory (`Tensor<'static>` or a loader's batch).
    pub fn forward(&self, input: &Tensor<'static>) -> Result<Tensor<'static>> {
        self.forward_raw(input.raw)
    }
    /// [`Engine::forward`] on a loader's batch (dpar's memory, alive while the engine holds a view of it).
    pub fn forward_batch(&self, input: TensorRef<'_>) -> Result<Tensor<'static>> {
        self.forward_raw(input.raw)
    }
    /// [`Engine::forward`] on a slice: `input` holds the f32 batch of `shape` (batch first) in row-major order, as
    /// [`Tensor::from_f32`] takes it. The values are copied into dpar's memory, which the engine keeps for
    /// backward, so the slice is free again on return. `.to_vec_f32()` of the output gives its values.
    pub fn forward_f32(&self, shape: &[i64], input: &[f32]) -> Result<Tensor<'static>> {
        self.forward(&Tensor::from_f32(shape, input)?)
    }
    /// [`Engine::forward_f32`] for a model whose input is i32 indices (an Embedding's).
    pub fn forward_i32(&self, shape: &[i64], input: &[i32]) -> Result<Tensor<'static>> {
        self.forward(&Tensor::from_i32(shape, input)?)
    }
    fn forward_raw(&self, input: *const sys::dpar_tensor) -> Result<Tensor<'static>> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::dpar_engine_forward(&mut out, self.raw, input) })?;
        Ok(Tensor { raw: out, _memory: PhantomData })
    }
    /// DataParallel's backward from dL/d(output) of the last training-mode forward, an f32 tensor shaped as its
    /// output; [`Engine::step`] then synchronises the gradients and steps.
    pub fn backward(&self, grad_output: &impl AsTensor) -> Result<()> {
        check(unsafe { sys::dpar_engine_backward(self.raw, grad_output.as_raw()) })
    }
    /// [`Engine::backward`] on a slice: `grad_output` holds dL/d(output) in row-major order, `shape` being the
    /// last forward's output shape (its `.shape()`). The values are copied; dpar only reads them.
    pub fn backward_f32(&self, shape: &[i64], grad_output: &[f32]) -> Result<()> {
        self.backward(&Tensor::from_f32(shape, grad_output)?)
    }
    pub fn set_training(&self, training: bool) -> Result<()> {
        check(unsafe { sys::dpar_engine_set_training(self.raw, training as i32) })
    }
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        check(unsafe { sys::dpar_engine_set_lr(self.raw, lr) })
    }
    /// Clips the gradient of the following steps to this global L2 norm, as `clip_grad_norm_` between backward and
    /// the step; 0 turns clipping off.
    pub fn set_max_grad_norm(&self, max_norm: f32) -> Result<()> {
        check(unsafe { sys::dpar_engine_set_max_grad_norm(self.raw, max_norm) })
    }
    /// Compresses gradient buckets between processes from the next step on (every process sets the same; no
    /// effect with one process).
    pub fn set_gradient_compression(&self, compression: Compression) -> Result<()> {
        let c = match compression {
            Compression::None => sys::DPAR_COMPRESSION_NONE,
            Compression::Bf16 => sys::DPAR_COMPRESSION_BF16,
        };
        check(unsafe { sys::dpar_engine_set_gradient_compression(self.raw, c) })
    }
    /// Chooses how gradient buckets are reduced from the next step on (every process sets the same, at the same
    /// point: where the optimizer's shards move across the processes, its state is gathered and cut anew, and
    /// pending gradients make it fail with INVALID_STATE). Each way the replicas stay bit-identical and, without
    /// clipping, train to the same bits.
    pub fn set_gradient_reduction(&self, reduction: Reduction) -> Result<()> {
        let r = match reduction {
            Reduction::AllReduce => sys::DPAR_REDUCTION_ALL_REDUCE,
            Reduction::ReduceScatter => sys::DPAR_REDUCTION_REDUCE_SCATTER,
            Reduction::AllReduceSharded => sys::DPAR_REDUCTION_ALL_REDUCE_SHARDED,
        };
        check(unsafe { sys::dpar_engine_set_gradient_reduction(self.raw, r) })
    }
    /// From the next step on, steps biases and norms' parameters (`Model::param_decays` false) with weight decay
    /// 0, as two PyTorch parameter groups; false (the default) decays every parameter.
    pub fn set_weight_decay_exclusion(&self, exclude_biases_and_norms: bool) -> Result<()> {
        check(unsafe { sys::dpar_engine_set_weight_decay_exclusion(self.raw, exclude_biases_and_norms as i32) })
    }
    /// From the next call on, linear layers and convolutions compute in `precision` (bf16: bf16 operands, f32
    /// accumulation and results; everything else f32). NOT_SUPPORTED where a device lacks the kernels (a CPU
    /// without AVX512-BF16 or AMX) and for F16, the engine unchanged. Every process sets the same.
    pub fn set_precision(&self, precision: Precision) -> Result<()> {
        check(unsafe { sys::dpar_engine_set_precision(self.raw, precision.raw()) })
    }
    pub fn precision(&self) -> Result<Precision> {
        let mut p = 0i32;
        check(unsafe { sys::dpar_engine_precision(&mut p, self.raw) })?;
        Ok(match p {
            sys::DPAR_BF16 => Precision::Bf16,
            sys::DPAR_F16 => Precision::F16,
            _ => Precision::F32,
        })
    }
    /// From the next step on, gradient buckets are reduced in `dtype` (dpar_engine_set_reduce_dtype): Bf16 rounds
    /// every replica's bucket to bf16 and carries the whole reduction in bf16, whatever the compression says.
    /// NOT_SUPPORTED where the processes' link does not move bf16, the engine unchanged. Every process sets the same.
    pub fn set_reduce_dtype(&self, dtype: ReduceDtype) -> Result<()> {
        let d = match dtype {
            ReduceDtype::F32 => sys::DPAR_F32,
            ReduceDtype::Bf16 => sys::DPAR_BF16,
        };
        check(unsafe { sys::dpar_engine_set_reduce_dtype(self.raw, d) })
    }
    pub fn reduce_dtype(&self) -> Result<ReduceDtype> {
        let mut d = 0i32;
        check(unsafe { sys::dpar_engine_reduce_dtype(&mut d, self.raw) })?;
        Ok(if d == sys::DPAR_BF16 { ReduceDtype::Bf16 } else { ReduceDtype::F32 })
    }
    /// The reproducible mode (dpar_engine_set_reproducible): micro-chunks of `micro_chunk_rows` rows, 0 off.
    /// The same seed and global batches then give the same bits on any number of CPU devices and processes
    /// (train_step, accumulate and step). INVALID_ARGUMENT for a negative count, INVALID_STATE while gradients are
    /// pending, NOT_SUPPORTED on GPUs and for a model with BatchNorm, the engine unchanged. Every process sets the
    /// same.
    pub fn set_reproducible(&self, micro_chunk_rows: i64) -> Result<()> {
        check(unsafe { sys::dpar_engine_set_reproducible(self.raw, micro_chunk_rows) })
    }
    /// The rows per micro-chunk `set_reproducible` set (0: off).
    pub fn reproducible(&self) -> Result<i64> {
        let mut rows = 0i64;
        check(unsafe { sys::dpar_engine_reproducible(&mut rows, self.raw) })?;
        Ok(rows)
    }
    /// Lets f32 GEMMs and convolutions use TF32 where the devices have it (off by default); returns whether
    /// they have it (CPU devices: false).
    pub fn set_allow_tf32(&self, allow: bool) -> Result<bool> {
        let mut has = 0i32;
        check(unsafe { sys::dpar_engine_set_allow_tf32(self.raw, allow as i32, &mut has) })?;
        Ok(has != 0)
    }
    /// The gradient's norm before clipping at the last step taken with clipping on (NaN before any).
    pub fn grad_norm(&self) -> Result<f32> {
        let mut norm = 0f32;
        check(unsafe { sys::dpar_engine_grad_norm(&mut norm, self.raw) })?;
        Ok(norm)
    }
    pub fn step_count(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_engine_step_count(n, self.raw) })
    }
    /// Dynamic loss scaling from the next step on, as `torch.amp.GradScaler(init_scale, growth_factor,
    /// backoff_factor, growth_interval)` (PyTorch's defaults: 65536, 2, 0.5, 2000); `init_scale` 0 turns it off. A
    /// step whose scaled gradient holds inf or NaN is skipped on every replica and backs the scale off.
    pub fn set_loss_scaling(&self, init_scale: f32, growth_factor: f32, backoff_factor: f32, growth_interval: i64) -> Result<()> {
        check(unsafe {
            sys::dpar_engine_set_loss_scaling(self.raw, init_scale, growth_factor, backoff_factor, growth_interval)
        })
    }
    /// The current loss scale; 1 with loss scaling off.
    pub fn loss_scale(&self) -> Result<f32> {
        let mut scale = 0f32;
        check(unsafe { sys::dpar_engine_loss_scale(&mut scale, self.raw) })?;
        Ok(scale)
    }
    /// Whether the last step taken with loss scaling on was skipped (its gradient held inf or NaN).
    pub fn last_step_skipped(&self) -> Result<bool> {
        let mut skipped = 0i32;
        check(unsafe { sys::dpar_engine_last_step_skipped(&mut skipped, self.raw) })?;
        Ok(skipped != 0)
    }
    pub fn num_replicas(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_engine_num_replicas(n, self.raw) })
    }
    /// This process's rank and the number of processes the engine spans.
    pub fn processes(&self) -> Result<(usize, usize)> {
        let (mut r, mut s) = (0usize, 0usize);
        check(unsafe { sys::dpar_engine_processes(&mut r, &mut s, self.raw) })?;
        Ok((r, s))
    }
    /// How gradient buckets travel between the processes: "" for one process, "mpi", "nccl", or
    /// "mpi through host memory (...)" saying why NCCL could not be used.
    pub fn process_transport(&self) -> Result<String> {
        let t = unsafe { sys::dpar_engine_process_transport(self.raw) };
        if t.is_null() {
            return Err(take_error(status::INVALID_ARGUMENT));
        }
        Ok(unsafe { CStr::from_ptr(t) }.to_string_lossy().into_owned())
    }
    pub fn num_buckets(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_engine_num_buckets(n, self.raw) })
    }
    pub fn replica_device(&self, replica: usize) -> Result<Device> {
        let mut d = sys::dpar_device { kind: 0, index: 0 };
        check(unsafe { sys::dpar_engine_replica_device(&mut d, self.raw, replica) })?;
        Ok(Device::from_raw(d))
    }
    /// How a batch of `batch` rows is split over the replicas.
    pub fn split(&self, batch: usize) -> Result<Vec<usize>> {
        let mut v = vec![0usize; self.num_replicas()?];
        check(unsafe { sys::dpar_engine_split(v.as_mut_ptr(), self.raw, batch, v.len()) })?;
        Ok(v)
    }
    /// Each replica's loss in the last step (NaN for replicas that got no rows).
    pub fn replica_losses(&self) -> Result<Vec<f32>> {
        let mut v = vec![0f32; self.num_replicas()?];
        check(unsafe { sys::dpar_engine_replica_losses(v.as_mut_ptr(), self.raw, v.len()) })?;
        Ok(v)
    }
    /// A replica's parameters, flattened in parameter order.
    pub fn params(&self, replica: usize, model_elements: usize) -> Result<Vec<f32>> {
        let mut v = vec![0f32; model_elements];
        check(unsafe { sys::dpar_engine_get_params(v.as_mut_ptr(), self.raw, replica, v.len()) })?;
        Ok(v)
    }
    /// A replica's buffer `index` of `model` (the model the engine was built from, for its dtype and shape).
    pub fn buffer(&self, model: &Model, replica: usize, index: usize) -> Result<Buffer> {
        let (_, dtype, shape) = model.buffer_info(index)?;
        let n = shape.iter().product::<i64>() as usize;
        Ok(if dtype == sys::DPAR_I64 {
            let mut v = vec![0i64; n];
            check(unsafe { sys::dpar_engine_get_buffer(v.as_mut_ptr() as *mut c_void, self.raw, replica, index, n) })?;
            Buffer::I64(v)
        } else {
            let mut v = vec![0f32; n];
            check(unsafe { sys::dpar_engine_get_buffer(v.as_mut_ptr() as *mut c_void, self.raw, replica, index, n) })?;
            Buffer::F32(v)
        })
    }
    /// The bytes of dpar's tensors (parameters, gradients, optimizer state, activations, scratch) that replica
    /// `replica`'s device holds now and at most since the process started or the device's last
    /// `reset_peak_memory` (dpar_engine_memory_stats; torch.cuda's memory_allocated and max_memory_allocated).
    /// The device's count: replicas and engines on one device count together. INVALID_ARGUMENT for a replica out
    /// of range.
    pub fn memory_stats(&self, replica: usize) -> Result<MemoryStats> {
        let (mut allocated, mut peak) = (0i64, 0i64);
        check(unsafe { sys::dpar_engine_memory_stats(&mut allocated, &mut peak, self.raw, replica) })?;
        Ok(MemoryStats { allocated_bytes: allocated, peak_bytes: peak })
    }
    /// Starts the peak of replica `replica`'s device again from what it holds now, for every engine on that device
    /// (dpar_engine_reset_peak_memory).
    pub fn reset_peak_memory(&self, replica: usize) -> Result<()> {
        check(unsafe { sys::dpar_engine_reset_peak_memory(self.raw, replica) })
    }
    /// Installs a hook called by each replica after its forward with its chunk's input and output shapes, on the
    /// worker threads (concurrently); `None` removes it. An `Err` fails the engine call with its message.
    pub fn set_forward_hook<F>(&self, hook: Option<F>) -> Result<()>
    where
        F: Fn(usize, &[i64], &[i64]) -> Result<()> + Send + Sync + 'static,
    {
        match hook {
            None => check(unsafe { sys::dpar_engine_set_forward_hook(self.raw, None, ptr::null_mut(), None) }),
            Some(f) => {
                let boxed: Box<Box<HookFn>> = Box::new(Box::new(f));
                let payload = Box::into_raw(boxed) as *mut c_void;
                let s = unsafe {
                    sys::dpar_engine_set_forward_hook(
                        self.raw,
                        Some(hook_trampoline),
                        payload,
                        Some(drop_payload::<Box<HookFn>>),
                    )
                };
                check(s)
            }
        }
    }
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let p = path_cstring(path.as_ref())?;
        check(unsafe { sys::dpar_engine_save(self.raw, p.as_ptr()) })
    }
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        let p = path_cstring(path.as_ref())?;
        check(unsafe { sys::dpar_engine_load(self.raw, p.as_ptr()) })
    }
    /// Starts recording a timeline of the engine's calls (each replica's worker and communication thread, span by
    /// span), forgetting one recorded before.
    pub fn trace_start(&self) -> Result<()> {
        check(unsafe { sys::dpar_engine_trace_start(self.raw) })
    }
    /// Stops recording and writes the timeline to `path` in Chrome's trace event format (ui.perfetto.dev,
    /// chrome://tracing), atomically; `None` only stops. The timeline stays until the next `trace_start`, so a
    /// failed write may be tried again with another path.
    pub fn trace_stop(&self, path: Option<&Path>) -> Result<()> {
        let p = path.map(path_cstring).transpose()?;
        check(unsafe { sys::dpar_engine_trace_stop(self.raw, p.as_ref().map_or(ptr::null(), |c| c.as_ptr())) })
    }
    /// Aborts a call in flight on another thread; the engine cannot continue afterwards.
    pub fn abort(&self) -> Result<()> {
        check(unsafe { sys::dpar_engine_abort(self.raw) })
    }
    pub fn inject_fault(&self, replica: usize, fault: Fault) -> Result<()> {
        let f = match fault {
            Fault::None => sys::DPAR_FAULT_NONE,
            Fault::Alloc => sys::DPAR_FAULT_ALLOC,
            Fault::Forward => sys::DPAR_FAULT_FORWARD,
            Fault::Backward => sys::DPAR_FAULT_BACKWARD,
        };
        check(unsafe { sys::dpar_engine_inject_fault(self.raw, replica, f) })
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Datasets and loaders

handle! {
    /// An in-memory dataset of (f32 sample, i32 label).
    pub struct Dataset { raw: *mut sys::dpar_dataset } freed by sys::dpar_dataset_free;
}

impl Dataset {
    /// Reads an IDX image file and an IDX label file (plain or .gz), as MNIST and Fashion-MNIST ship.
    pub fn load_idx(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> Result<Dataset> {
        let (i, l) = (path_cstring(images.as_ref())?, path_cstring(labels.as_ref())?);
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_dataset_load_idx(&mut raw, i.as_ptr(), l.as_ptr()) })?;
        Ok(Dataset { raw })
    }
    /// (samples, features, classes).
    pub fn info(&self) -> Result<(usize, usize, usize)> {
        let (mut s, mut f, mut c) = (0, 0, 0);
        check(unsafe { sys::dpar_dataset_info(&mut s, &mut f, &mut c, self.raw) })?;
        Ok((s, f, c))
    }
    pub fn normalize(&mut self, mean: f32, std: f32) -> Result<()> {
        check(unsafe { sys::dpar_dataset_normalize(self.raw, mean, std) })
    }
}

/// A batch borrowed from its loader until the loader's next call.
pub struct Batch<'a> {
    pub inputs: TensorRef<'a>,
    pub labels: TensorRef<'a>,
}

handle! {
    /// A seeded, shuffling batch loader. It shares the dataset's data: the dataset may be dropped first.
    pub struct Loader { raw: *mut sys::dpar_loader } freed by sys::dpar_loader_free;
}

impl Loader {
    pub fn new(dataset: &Dataset, batch_size: usize, shuffle: bool, seed: u64, drop_last: bool) -> Result<Loader> {
        let mut raw = ptr::null_mut();
        check(unsafe {
            sys::dpar_loader_create(&mut raw, dataset.raw, batch_size, shuffle as i32, seed, drop_last as i32)
        })?;
        Ok(Loader { raw })
    }
    pub fn start_epoch(&mut self, epoch: u64) -> Result<()> {
        check(unsafe { sys::dpar_loader_start_epoch(self.raw, epoch) })
    }
    pub fn num_batches(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_loader_num_batches(n, self.raw) })
    }
    /// Yields only shard `shard` of `num_shards` of each batch (one process's part).
    pub fn shard(&mut self, shard: usize, num_shards: usize) -> Result<()> {
        check(unsafe { sys::dpar_loader_shard(self.raw, shard, num_shards) })
    }
    /// From the next batch on, yields batches in memory of `device`, each prepared (on a GPU: copied) while the
    /// caller still uses the one before. The batches are the same, bit for bit.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        check(unsafe { sys::dpar_loader_to_device(self.raw, device.raw()) })
    }
    /// The next batch of the epoch, or None at its end. The batch borrows the loader until the next call.
    pub fn next_batch(&mut self) -> Result<Option<Batch<'_>>> {
        let mut more = 0i32;
        check(unsafe { sys::dpar_loader_next(&mut more, self.raw) })?;
        if more == 0 {
            return Ok(None);
        }
        let (x, y) = unsafe { (sys::dpar_loader_inputs(self.raw), sys::dpar_loader_labels(self.raw)) };
        if x.is_null() || y.is_null() {
            return Err(take_error(status::INTERNAL));
        }
        Ok(Some(Batch {
            inputs: TensorRef { raw: x, _parent: PhantomData },
            labels: TensorRef { raw: y, _parent: PhantomData },
        }))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Collectives

/// Element types the collectives move.
pub trait CommType: Copy {
    const DTYPE: i32;
}
impl CommType for f32 {
    const DTYPE: i32 = sys::DPAR_F32;
}
impl CommType for f64 {
    const DTYPE: i32 = sys::DPAR_F64;
}
impl CommType for i32 {
    const DTYPE: i32 = sys::DPAR_I32;
}
impl CommType for i64 {
    const DTYPE: i32 = sys::DPAR_I64;
}

/// Reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
}

impl ReduceOp {
    fn raw(self) -> i32 {
        match self {
            ReduceOp::Sum => sys::DPAR_SUM,
            ReduceOp::Mean => sys::DPAR_MEAN,
            ReduceOp::Max => sys::DPAR_MAX,
            ReduceOp::Min => sys::DPAR_MIN,
        }
    }
}

fn comm_options(timeout_seconds: f64) -> Result<sys::dpar_comm_options> {
    let (mut o, status) = defaults(sys::dpar_comm_options_init_sized, sys::DPAR_COMM_OPTIONS_VERSION);
    status?;
    o.timeout_seconds = timeout_seconds;
    Ok(o)
}

handle! {
    /// The participants of one process (one thread each, shared memory). Its members keep it alive.
    pub struct CommGroup { raw: *mut sys::dpar_comm_group } freed by sys::dpar_comm_group_free;
}

impl CommGroup {
    pub fn new(size: usize, timeout_seconds: f64) -> Result<CommGroup> {
        let o = comm_options(timeout_seconds)?;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_comm_group_create(&mut raw, size, &o) })?;
        Ok(CommGroup { raw })
    }
    /// A group whose participant r's buffers are memory of `devices[r]`, all of one kind, each participant's
    /// collectives on the device's legacy default stream (see `on_devices_with_streams`). Slices are host memory:
    /// over GPUs the buffers are [`RawBuffer`]s, for the `*_raw` collectives and [`RawReducer`].
    pub fn on_devices(devices: &[Device], timeout_seconds: f64) -> Result<CommGroup> {
        // SAFETY: null streams are the legacy default stream, which needs nothing kept alive.
        unsafe { CommGroup::create_on_devices(devices, None, timeout_seconds) }
    }
    /// As `on_devices`, with participant r's collectives ordered on `streams[r]` (a `cudaStream_t`; null: the
    /// legacy default stream).
    ///
    /// # Safety
    /// Each stream must be a live CUDA stream of its device (or null), and must outlive the group's members.
    pub unsafe fn on_devices_with_streams(
        devices: &[Device],
        streams: &[*mut c_void],
        timeout_seconds: f64,
    ) -> Result<CommGroup> {
        same_len(streams.len(), devices.len(), "streams")?;
        CommGroup::create_on_devices(devices, Some(streams), timeout_seconds)
    }
    unsafe fn create_on_devices(
        devices: &[Device],
        streams: Option<&[*mut c_void]>,
        timeout_seconds: f64,
    ) -> Result<CommGroup> {
        let o = comm_options(timeout_seconds)?;
        let raw_devices: Vec<sys::dpar_device> = devices.iter().map(Device::raw).collect();
        let streams_ptr = streams.map_or(ptr::null(), |s| s.as_ptr());
        let mut raw = ptr::null_mut();
        check(sys::dpar_comm_group_create_on_devices(
            &mut raw,
            if raw_devices.is_empty() { ptr::null() } else { raw_devices.as_ptr() },
            streams_ptr,
            devices.len(),
            &o,
        ))?;
        Ok(CommGroup { raw })
    }
    /// Participant `rank`'s communicator, for the thread that plays it.
    pub fn member(&self, rank: usize) -> Result<Comm> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_comm_group_member(&mut raw, self.raw, rank) })?;
        Ok(Comm { raw })
    }
}

handle! {
    /// One participant of a group. Collectives take `&mut self` (a participant's calls must not overlap); abort and
    /// async_error may be called from any thread at any time.
    pub struct Comm { raw: *mut sys::dpar_comm } freed by sys::dpar_comm_free;
}

unsafe impl Sync for Comm {}

fn same_len(a: usize, b: usize, what: &str) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::new(status::INVALID_ARGUMENT, format!("{}: {} elements, expected {}", what, a, b)))
    }
}

/// A buffer that dpar reaches through a raw pointer: memory Rust does not own, such as a framework's GPU tensor
/// (a CUDA device pointer from `cudarc`, a tensor's data pointer) for a communicator of a group made by
/// [`CommGroup::on_devices`]. The `*_raw` collectives and [`RawReducer`] take it. dpar refuses, before anything
/// moves, a buffer it can tell is not memory of the communicator's device (host memory handed to a GPU's
/// participant, for instance).
#[derive(Debug)]
pub struct RawBuffer<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for RawBuffer<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RawBuffer<T> {}

// SAFETY: a RawBuffer is an address and a length; `from_raw_parts`'s contract makes its holder answerable for the
// memory, from whichever thread the collective runs.
unsafe impl<T: Send> Send for RawBuffer<T> {}

impl<T: CommType> RawBuffer<T> {
    /// `len` elements at `ptr`.
    ///
    /// # Safety
    /// The elements must be memory of one device (host memory or one GPU's), valid for reads and writes by dpar
    /// whenever a collective uses the buffer: for a blocking call, until it returns; for an asynchronous one, until
    /// its [`Work`] is waited for or dropped; for a [`RawReducer`], for the reducer's whole life. Nothing else may
    /// write them meanwhile, another collective or reducer on overlapping memory included. On a GPU, the work that produced them must be finished or queued on the participant's
    /// stream (see [`CommGroup::on_devices_with_streams`]).
    pub unsafe fn from_raw_parts(ptr: *mut T, len: usize) -> RawBuffer<T> {
        RawBuffer { ptr, len }
    }
    /// A slice's elements, for the span of one blocking call.
    fn of(slice: &[T]) -> RawBuffer<T> {
        RawBuffer { ptr: slice.as_ptr() as *mut T, len: slice.len() }
    }
    fn of_mut(slice: &mut [T]) -> RawBuffer<T> {
        RawBuffer { ptr: slice.as_mut_ptr(), len: slice.len() }
    }
    pub fn as_ptr(&self) -> *mut T {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn c(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }
}

impl Comm {
    /// This process's communicator over MPI_COMM_WORLD.
    pub fn mpi(timeout_seconds: f64) -> Result<Comm> {
        let o = comm_options(timeout_seconds)?;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::dpar_comm_create_mpi(&mut raw, &o) })?;
        Ok(Comm { raw })
    }
    /// (rank, size).
    pub fn info(&self) -> Result<(usize, usize)> {
        let (mut r, mut s) = (0usize, 0usize);
        check(unsafe { sys::dpar_comm_info(&mut r, &mut s, self.raw) })?;
        Ok((r, s))
    }
    /// The device whose memory the buffers are: cpu:0 for host memory.
    pub fn device(&self) -> Result<Device> {
        let mut d = sys::dpar_device { kind: 0, index: 0 };
        check(unsafe { sys::dpar_comm_device(&mut d, self.raw) })?;
        Ok(Device::from_raw(d))
    }
    /// Checks that `whole` (an all-gather's recv, a reduce-scatter's send, named `what`) holds one block of `block`
    /// elements per participant.
    fn same_len_per_rank(&self, whole: usize, block: usize, what: &str) -> Result<()> {
        let (_, size) = self.info()?;
        same_len(whole, block * size, what)
    }
    pub fn all_reduce<T: CommType>(&mut self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_raw(RawBuffer::of(send), RawBuffer::of_mut(recv), op)
    }
    pub fn all_reduce_in_place<T: CommType>(&mut self, buffer: &mut [T], op: ReduceOp) -> Result<()> {
        let b = RawBuffer::of_mut(buffer);
        self.all_reduce_raw(b, b, op)
    }
    pub fn broadcast<T: CommType>(&mut self, buffer: &mut [T], root: usize) -> Result<()> {
        self.broadcast_raw(RawBuffer::of_mut(buffer), root)
    }
    /// Reduces into `root`'s `recv` (ignored elsewhere).
    pub fn reduce<T: CommType>(&mut self, send: &[T], recv: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.reduce_raw(RawBuffer::of(send), RawBuffer::of_mut(recv), op, root)
    }
    /// Every participant's `send` into `recv` (size x send.len()), in rank order.
    pub fn all_gather<T: CommType>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_gather_raw(RawBuffer::of(send), RawBuffer::of_mut(recv))
    }
    /// Reduces `send` (size x recv.len()) element-wise; this participant receives its block in `recv`.
    pub fn reduce_scatter<T: CommType>(&mut self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_raw(RawBuffer::of(send), RawBuffer::of_mut(recv), op)
    }
    /// `all_reduce` on buffers Rust does not own (a GPU's memory); `send` and `recv` may be the same buffer.
    pub fn all_reduce_raw<T: CommType>(&mut self, send: RawBuffer<T>, recv: RawBuffer<T>, op: ReduceOp) -> Result<()> {
        same_len(recv.len(), send.len(), "recv")?;
        check(unsafe { sys::dpar_comm_all_reduce(self.raw, send.c(), recv.c(), send.len(), T::DTYPE, op.raw()) })
    }
    pub fn broadcast_raw<T: CommType>(&mut self, buffer: RawBuffer<T>, root: usize) -> Result<()> {
        check(unsafe { sys::dpar_comm_broadcast(self.raw, buffer.c(), buffer.len(), T::DTYPE, root) })
    }
    pub fn reduce_raw<T: CommType>(
        &mut self,
        send: RawBuffer<T>,
        recv: RawBuffer<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        same_len(recv.len(), send.len(), "recv")?;
        check(unsafe { sys::dpar_comm_reduce(self.raw, send.c(), recv.c(), send.len(), T::DTYPE, op.raw(), root) })
    }
    pub fn all_gather_raw<T: CommType>(&mut self, send: RawBuffer<T>, recv: RawBuffer<T>) -> Result<()> {
        self.same_len_per_rank(recv.len(), send.len(), "recv")?;
        check(unsafe { sys::dpar_comm_all_gather(self.raw, send.c(), recv.c(), send.len(), T::DTYPE) })
    }
    pub fn reduce_scatter_raw<T: CommType>(
        &mut self,
        send: RawBuffer<T>,
        recv: RawBuffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.same_len_per_rank(send.len(), recv.len(), "send")?;
        check(unsafe { sys::dpar_comm_reduce_scatter(self.raw, send.c(), recv.c(), recv.len(), T::DTYPE, op.raw()) })
    }
    pub fn barrier(&mut self) -> Result<()> {
        check(unsafe { sys::dpar_comm_barrier(self.raw) })
    }
    /// Aborts the group: every participant's collectives fail with DPAR_ERR_REMOTE and `reason`.
    pub fn abort(&self, reason: &str) -> Result<()> {
        let r = cstring(reason, "reason")?;
        check(unsafe { sys::dpar_comm_abort(self.raw, r.as_ptr()) })
    }
    /// Ok(()) while the communicator is usable; else the error its next collective would return.
    pub fn async_error(&self) -> Result<()> {
        let mut s = sys::DPAR_OK;
        check(unsafe { sys::dpar_comm_get_async_error(&mut s, self.raw) })?;
        check(s)
    }
    /// An all-reduce, in place, on the communicator's own thread. The Work owns the buffer until
    /// [`Work::wait`] hands it back reduced.
    pub fn all_reduce_async<T: CommType>(&mut self, mut buffer: Vec<T>, op: ReduceOp) -> Result<Work<'_, Vec<T>>> {
        let b = RawBuffer::of_mut(&mut buffer);
        let raw = self.raw;
        Work::start(buffer, |out| unsafe {
            sys::dpar_comm_all_reduce_async(out, raw, b.c(), b.c(), b.len(), T::DTYPE, op.raw())
        })
    }
    pub fn broadcast_async<T: CommType>(&mut self, mut buffer: Vec<T>, root: usize) -> Result<Work<'_, Vec<T>>> {
        let b = RawBuffer::of_mut(&mut buffer);
        let raw = self.raw;
        Work::start(buffer, |out| unsafe { sys::dpar_comm_broadcast_async(out, raw, b.c(), b.len(), T::DTYPE, root) })
    }
    /// Every participant's `send` into `recv` (size x send.len()); [`Work::wait`] hands back (send, recv).
    pub fn all_gather_async<T: CommType>(
        &mut self,
        send: Vec<T>,
        mut recv: Vec<T>,
    ) -> Result<Work<'_, (Vec<T>, Vec<T>)>> {
        self.same_len_per_rank(recv.len(), send.len(), "recv")?;
        let (s, r) = (RawBuffer::of(&send), RawBuffer::of_mut(&mut recv));
        let raw = self.raw;
        Work::start((send, recv), |out| unsafe {
            sys::dpar_comm_all_gather_async(out, raw, s.c(), r.c(), s.len(), T::DTYPE)
        })
    }
    /// Reduces `send` (size x recv.len()); [`Work::wait`] hands back (send, recv) with this participant's block.
    pub fn reduce_scatter_async<T: CommType>(
        &mut self,
        send: Vec<T>,
        mut recv: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<'_, (Vec<T>, Vec<T>)>> {
        self.same_len_per_rank(send.len(), recv.len(), "send")?;
        let (s, r) = (RawBuffer::of(&send), RawBuffer::of_mut(&mut recv));
        let raw = self.raw;
        Work::start((send, recv), |out| unsafe {
            sys::dpar_comm_reduce_scatter_async(out, raw, s.c(), r.c(), r.len(), T::DTYPE, op.raw())
        })
    }
    /// `all_reduce_async` on a buffer Rust does not own, in place. On a GPU the collective is ordered on the
    /// participant's stream when the communicator's thread starts it: read the result after [`Work::wait`].
    pub fn all_reduce_raw_async<T: CommType>(&mut self, buffer: RawBuffer<T>, op: ReduceOp) -> Result<Work<'_, ()>> {
        let p = buffer.c();
        Work::start((), |out| unsafe {
            sys::dpar_comm_all_reduce_async(out, self.raw, p, p, buffer.len(), T::DTYPE, op.raw())
        })
    }
    pub fn broadcast_raw_async<T: CommType>(&mut self, buffer: RawBuffer<T>, root: usize) -> Result<Work<'_, ()>> {
        Work::start((), |out| unsafe {
            sys::dpar_comm_broadcast_async(out, self.raw, buffer.c(), buffer.len(), T::DTYPE, root)
        })
    }
    pub fn all_gather_raw_async<T: CommType>(
        &mut self,
        send: RawBuffer<T>,
        recv: RawBuffer<T>,
    ) -> Result<Work<'_, ()>> {
        self.same_len_per_rank(recv.len(), send.len(), "recv")?;
        Work::start((), |out| unsafe {
            sys::dpar_comm_all_gather_async(out, self.raw, send.c(), recv.c(), send.len(), T::DTYPE)
        })
    }
    pub fn reduce_scatter_raw_async<T: CommType>(
        &mut self,
        send: RawBuffer<T>,
        recv: RawBuffer<T>,
        op: ReduceOp,
    ) -> Result<Work<'_, ()>> {
        self.same_len_per_rank(send.len(), recv.len(), "send")?;
        Work::start((), |out| unsafe {
            sys::dpar_comm_reduce_scatter_async(out, self.raw, send.c(), recv.c(), recv.len(), T::DTYPE, op.raw())
        })
    }
}

/// An asynchronous collective in flight. It owns the buffers it reads and writes (`B`: the vectors moved in, or
/// nothing for [`RawBuffer`]s), so that nothing else can touch them meanwhile, whatever becomes of the Work:
/// [`Work::wait`] hands them back; dropping it waits, then drops them; forgetting it (`mem::forget`) leaks them
/// where the communication thread may still write, which is safe.
pub struct Work<'c, B> {
    raw: *mut sys::dpar_work,
    buffers: Option<B>,
    _comm: PhantomData<&'c mut Comm>,
}

impl<B> Drop for Work<'_, B> {
    fn drop(&mut self) {
        unsafe { sys::dpar_work_free(self.raw) } // waits; the buffers go after
    }
}

impl<'c, B> Work<'c, B> {
    /// Runs a dpar_comm_*_async call, which writes the work's handle through `out`, on `buffers`' memory.
    fn start(buffers: B, call: impl FnOnce(*mut *mut sys::dpar_work) -> i32) -> Result<Work<'c, B>> {
        let mut raw = ptr::null_mut();
        check(call(&mut raw))?;
        Ok(Work { raw, buffers: Some(buffers), _comm: PhantomData })
    }
    /// True once the work has finished (successfully or not). Never blocks.
    pub fn test(&self) -> Result<bool> {
        let mut done = 0i32;
        check(unsafe { sys::dpar_work_test(&mut done, self.raw) })?;
        Ok(done != 0)
    }
    /// Waits; the buffers, or the collective's own status and message.
    pub fn wait(mut self) -> Result<B> {
        let status = check(unsafe { sys::dpar_work_wait(self.raw) });
        let buffers = self.buffers.take();
        drop(self);
        status.map(|()| buffers.expect("a Work holds its buffers until wait"))
    }
}

/// A reducer's options (dpar_reducer_options). `ReducerOptions::default()` is dpar's: 1 MiB and 25 MiB buckets,
/// the mean, over the communicator's participants alone, uncompressed.
#[derive(Clone, Copy)]
pub struct ReducerOptions<'p> {
    /// The first bucket (the last gradients) closes at this many bytes; 0: 1 MiB.
    pub first_bucket_bytes: usize,
    /// Later buckets close at this many bytes; 0: 25 MiB.
    pub bucket_cap_bytes: usize,
    /// `Sum`, or `Mean` over every participant (of every process, with `processes`).
    pub op: ReduceOp,
    /// A communicator over the processes ([`Comm::mpi`]): the reducers of a group's members in several processes
    /// then sum over every member of every process, hierarchically (among the process's members, then across the
    /// processes by member 0, then back). Every member passes its process's same one; the reducer borrows it, so
    /// that no other collective runs on it meanwhile. With `Mean`, every process creates its reducers at the same
    /// point: member 0's creation counts the members of every process.
    pub processes: Option<&'p Comm>,
    /// How buckets cross the processes (nothing crosses without `processes`, or with one process).
    pub compression: Compression,
}

impl Default for ReducerOptions<'_> {
    fn default() -> Self {
        ReducerOptions {
            first_bucket_bytes: 0,
            bucket_cap_bytes: 0,
            op: ReduceOp::Mean,
            processes: None,
            compression: Compression::None,
        }
    }
}

/// A dpar_reducer over `grads`, in the model's forward order.
fn create_reducer(
    comm: &mut Comm,
    grads: &[RawBuffer<f32>],
    options: &ReducerOptions,
) -> Result<*mut sys::dpar_reducer> {
    let (mut o, status) = defaults(sys::dpar_reducer_options_init_sized, sys::DPAR_REDUCER_OPTIONS_VERSION);
    status?;
    o.first_bucket_bytes = options.first_bucket_bytes;
    o.bucket_cap_bytes = options.bucket_cap_bytes;
    o.op = options.op.raw();
    // dpar keeps the communicator behind the handle for the reducer; the borrow keeps other collectives off it.
    o.processes = options.processes.map_or(ptr::null_mut(), |p| p.raw);
    o.compression = match options.compression {
        Compression::None => sys::DPAR_COMPRESSION_NONE,
        Compression::Bf16 => sys::DPAR_COMPRESSION_BF16,
    };
    let ptrs: Vec<*mut f32> = grads.iter().map(|g| g.as_ptr()).collect();
    let counts: Vec<usize> = grads.iter().map(|g| g.len()).collect();
    let mut raw = ptr::null_mut();
    check(unsafe { sys::dpar_reducer_create(&mut raw, comm.raw, ptrs.as_ptr(), counts.as_ptr(), counts.len(), &o) })?;
    Ok(raw)
}

/// DDP's gradient reducer over a communicator, for a framework with its own autograd. It owns the gradient
/// buffers (so that none is written while its bucket is in flight): write one through [`Reducer::grad_mut`],
/// mark it with [`Reducer::grad_ready`], and [`Reducer::wait`] before the optimizer step.
pub struct Reducer<'c> {
    raw: *mut sys::dpar_reducer,
    grads: Vec<Vec<f32>>,
    ready: Vec<bool>,
    _comm: PhantomData<&'c mut Comm>,
}

impl Drop for Reducer<'_> {
    fn drop(&mut self) {
        unsafe { sys::dpar_reducer_free(self.raw) } // before the buffers go
    }
}

impl<'c> Reducer<'c> {
    /// Buffers of `counts` elements, in the model's forward order; the communicator is not used elsewhere
    /// while the reducer lives. `first_bucket_bytes`/`bucket_cap_bytes` 0: the defaults.
    pub fn new(
        comm: &'c mut Comm,
        counts: &[usize],
        first_bucket_bytes: usize,
        bucket_cap_bytes: usize,
        op: ReduceOp,
    ) -> Result<Reducer<'c>> {
        let options = ReducerOptions { first_bucket_bytes, bucket_cap_bytes, op, ..Default::default() };
        Reducer::with_options(comm, counts, &options)
    }
    /// `new` with every option: over the processes too, with `options.processes`, which stays borrowed as long as
    /// the reducer.
    pub fn with_options(comm: &'c mut Comm, counts: &[usize], options: &ReducerOptions<'c>) -> Result<Reducer<'c>> {
        let mut grads: Vec<Vec<f32>> = counts.iter().map(|&n| vec![0f32; n]).collect();
        let buffers: Vec<RawBuffer<f32>> = grads.iter_mut().map(|g| RawBuffer::of_mut(g)).collect();
        // The vectors' heap blocks stay where they are when `grads` moves into the Reducer.
        let raw = create_reducer(comm, &buffers, options)?;
        let ready = vec![false; counts.len()];
        Ok(Reducer { raw, grads, ready, _comm: PhantomData })
    }
    pub fn num_buckets(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_reducer_num_buckets(n, self.raw) })
    }
    /// Gradient `index`'s buffer, to write this step's value; refused once it is marked ready, until wait.
    pub fn grad_mut(&mut self, index: usize) -> Result<&mut [f32]> {
        match self.ready.get(index) {
            None => Err(Error::new(status::INVALID_ARGUMENT, format!("index {} is out of range", index))),
            Some(true) => Err(Error::new(status::INVALID_STATE, format!("gradient {} is in flight until wait()", index))),
            Some(false) => Ok(&mut self.grads[index]),
        }
    }
    /// Gradient `index` holds this step's value: its bucket may start.
    pub fn grad_ready(&mut self, index: usize) -> Result<()> {
        check(unsafe { sys::dpar_reducer_grad_ready(self.raw, index) })?;
        self.ready[index] = true;
        Ok(())
    }
    /// Ends the step: every buffer then holds the reduced gradient.
    pub fn wait(&mut self) -> Result<()> {
        let r = check(unsafe { sys::dpar_reducer_wait(self.raw) });
        self.ready.iter_mut().for_each(|r| *r = false);
        r
    }
    /// Gradient `index` after wait().
    pub fn grad(&self, index: usize) -> &[f32] {
        &self.grads[index]
    }
}

/// DDP's gradient reducer over gradient buffers the caller owns: a framework's GPU gradients, for a communicator
/// of a group made by [`CommGroup::on_devices`] (its copies and collectives are then ordered on the participant's
/// stream). Mark each gradient with [`RawReducer::grad_ready`] once backward has written it (queued on that
/// stream is enough), and [`RawReducer::wait`] before the optimizer step; nothing else writes a gradient between
/// the two.
pub struct RawReducer<'c> {
    raw: *mut sys::dpar_reducer,
    _comm: PhantomData<&'c mut Comm>,
}

impl Drop for RawReducer<'_> {
    fn drop(&mut self) {
        unsafe { sys::dpar_reducer_free(self.raw) }
    }
}

impl<'c> RawReducer<'c> {
    /// `grads` in the model's forward order, each valid for the reducer's life ([`RawBuffer::from_raw_parts`]);
    /// the communicator is not used elsewhere while the reducer lives. `first_bucket_bytes`/`bucket_cap_bytes`
    /// 0: the defaults.
    pub fn new(
        comm: &'c mut Comm,
        grads: &[RawBuffer<f32>],
        first_bucket_bytes: usize,
        bucket_cap_bytes: usize,
        op: ReduceOp,
    ) -> Result<RawReducer<'c>> {
        let options = ReducerOptions { first_bucket_bytes, bucket_cap_bytes, op, ..Default::default() };
        RawReducer::with_options(comm, grads, &options)
    }
    /// `new` with every option: over the processes too, with `options.processes`, which stays borrowed as long as
    /// the reducer.
    pub fn with_options(
        comm: &'c mut Comm,
        grads: &[RawBuffer<f32>],
        options: &ReducerOptions<'c>,
    ) -> Result<RawReducer<'c>> {
        let raw = create_reducer(comm, grads, options)?;
        Ok(RawReducer { raw, _comm: PhantomData })
    }
    pub fn num_buckets(&self) -> Result<usize> {
        count(|n| unsafe { sys::dpar_reducer_num_buckets(n, self.raw) })
    }
    /// Gradient `index` holds this step's value: its bucket may start.
    pub fn grad_ready(&mut self, index: usize) -> Result<()> {
        check(unsafe { sys::dpar_reducer_grad_ready(self.raw, index) })
    }
    /// Ends the step: every gradient then holds the reduced value (on a GPU: for the work queued on the
    /// participant's stream after this call, such as the optimizer step).
    pub fn wait(&mut self) -> Result<()> {
        check(unsafe { sys::dpar_reducer_wait(self.raw) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This crate's `dpar_comm_options` as a later dpar.h might declare it: one field longer, version 2.
    #[repr(C)]
    struct NewerCommOptions {
        known: sys::dpar_comm_options,
        appended: u64,
    }

    unsafe extern "C" fn newer_init_sized(o: *mut NewerCommOptions, size: usize) -> sys::dpar_status {
        sys::dpar_comm_options_init_sized(o.cast(), size)
    }

    #[test]
    fn defaults_fill_the_crates_layout() {
        let (o, init) = defaults(sys::dpar_comm_options_init_sized, sys::DPAR_COMM_OPTIONS_VERSION);
        init.unwrap();
        assert_eq!(o.size, std::mem::size_of::<sys::dpar_comm_options>());
        assert_eq!(o.version, sys::DPAR_COMM_OPTIONS_VERSION);
        assert_eq!(o.timeout_seconds, 300.0);
    }

    #[test]
    fn a_layout_newer_than_the_library_is_refused_by_name() {
        // The library does not know the longer layout: it writes nothing, and the struct keeps this crate's size
        // and version, which the call it is passed to refuses in turn.
        let (o, init) = defaults(newer_init_sized, sys::DPAR_COMM_OPTIONS_VERSION + 1);
        let e = init.err().unwrap();
        assert_eq!(e.status(), status::NOT_SUPPORTED);
        assert!(e.message().contains("newer dpar.h"), "{}", e);
        assert_eq!(o.known.size, std::mem::size_of::<NewerCommOptions>());
        assert_eq!(o.known.version, sys::DPAR_COMM_OPTIONS_VERSION + 1);
        let mut group = ptr::null_mut();
        let refused = check(unsafe { sys::dpar_comm_group_create(&mut group, 2, &o.known) }).err().unwrap();
        assert!(refused.message().contains("unknown version"), "{}", refused);
    }

    #[test]
    fn a_reducers_processes_and_compression_reach_the_library() {
        let group = CommGroup::new(1, 30.0).unwrap();
        let mut comm = group.member(0).unwrap();
        // The reducer's own communicator under a second name, which safe code cannot make (the reducer borrows it
        // mutably): dpar refuses it as the processes' one, so `processes` is what dpar reads.
        let alias = std::mem::ManuallyDrop::new(Comm { raw: comm.raw });
        let options = ReducerOptions { processes: Some(&alias), ..Default::default() };
        let e = Reducer::with_options(&mut comm, &[4], &options).err().unwrap();
        assert_eq!(e.status(), status::INVALID_ARGUMENT);
        assert!(e.message().contains("opts.processes"), "{}", e);
        // Compression cannot hold an unknown value; dpar-sys's field, where dpar reads it, can.
        let (mut o, init) = defaults(sys::dpar_reducer_options_init_sized, sys::DPAR_REDUCER_OPTIONS_VERSION);
        init.unwrap();
        o.compression = 7;
        let mut grad = [0f32; 4];
        let (grads, counts) = ([grad.as_mut_ptr()], [grad.len()]);
        let mut reducer = ptr::null_mut();
        let created =
            unsafe { sys::dpar_reducer_create(&mut reducer, comm.raw, grads.as_ptr(), counts.as_ptr(), 1, &o) };
        let e = check(created).err().unwrap();
        assert_eq!(e.status(), status::INVALID_ARGUMENT);
        assert!(e.message().contains("opts.compression"), "{}", e);
    }

    #[test]
    fn an_unknown_gradient_reduction_is_refused_by_the_library() {
        // Reduction cannot hold an unknown value; the engine's raw handle, where dpar reads it, can.
        let mut m = Model::new(7).unwrap();
        m.linear(4, 3, true).unwrap();
        let options = EngineOptions::new().cpu_devices(2).processes(Processes::Single);
        let engine = Engine::new(&m, &Optimizer::sgd(0.1), &options).unwrap();
        for bad in [3, -1] {
            let e = check(unsafe { sys::dpar_engine_set_gradient_reduction(engine.raw, bad) }).err().unwrap();
            assert_eq!(e.status(), status::INVALID_ARGUMENT);
            assert!(e.message().contains("reduction"), "{}", e);
        }
        engine.set_gradient_reduction(Reduction::ReduceScatter).unwrap();
        engine.set_gradient_reduction(Reduction::AllReduceSharded).unwrap();
        engine.set_gradient_reduction(Reduction::AllReduce).unwrap();
    }

    #[test]
    fn excluding_biases_from_weight_decay_changes_their_step_alone() {
        let mut m = Model::new(7).unwrap();
        m.linear(4, 3, true).unwrap().batchnorm1d(3, 1e-5, 0.1, true).unwrap();
        let decays: Vec<bool> = (0..4).map(|i| m.param_decays(i).unwrap()).collect();
        assert_eq!(decays, vec![true, false, false, false]);
        assert_eq!(m.param_decays(4).err().unwrap().status(), status::INVALID_ARGUMENT);
        let mut lin = Model::new(7).unwrap();
        lin.linear(4, 3, true).unwrap();
        let options = EngineOptions::new().cpu_devices(2).processes(Processes::Single);
        let opt = Optimizer::adamw(0.1).weight_decay(0.5);
        let (plain, excluding) = (Engine::new(&lin, &opt, &options).unwrap(), Engine::new(&lin, &opt, &options).unwrap());
        excluding.set_weight_decay_exclusion(true).unwrap();
        let e = check(unsafe { sys::dpar_engine_set_weight_decay_exclusion(excluding.raw, 2) }).err().unwrap();
        assert!(e.message().contains("exclude_biases_and_norms"), "{}", e);
        let x: Vec<f32> = (0..24).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        let y: Vec<i32> = (0..6).map(|r| (r % 3) as i32).collect();
        let (x, y) = (Tensor::from_f32(&[6, 4], &x).unwrap(), Tensor::from_i32(&[6], &y).unwrap());
        plain.train_step(&x, &y).unwrap();
        excluding.train_step(&x, &y).unwrap();
        let (a, b) = (plain.params(0, 15).unwrap(), excluding.params(0, 15).unwrap());
        assert_eq!(a[..12], b[..12], "the weights decay alike");
        for i in 12..15 {
            assert_ne!(a[i], b[i], "bias element {}", i - 12);
        }
    }

    #[test]
    fn precision_policy() {
        let mut m = Model::new(3).unwrap();
        m.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 3, true).unwrap();
        let options = EngineOptions::new().cpu_devices(2).processes(Processes::Single);
        let e = Engine::new(&m, &Optimizer::sgd(0.1), &options).unwrap();
        assert_eq!(e.precision().unwrap(), Precision::F32);
        // f16: trains, or is refused whole with the reason (CPU devices: oneDNN has no f16 GEMM for them).
        match e.set_precision(Precision::F16) {
            Ok(()) => {
                assert_eq!(e.precision().unwrap(), Precision::F16);
                e.set_precision(Precision::F32).unwrap();
            }
            Err(err) => {
                assert_eq!(err.status(), status::NOT_SUPPORTED, "{}", err);
                assert!(err.message().contains("f16"), "{}", err);
                assert_eq!(e.precision().unwrap(), Precision::F32);
            }
        }
        let bad = check(unsafe { sys::dpar_engine_set_precision(e.raw, 7) }).err().unwrap();
        assert!(bad.message().contains("compute_dtype"), "{}", bad);
        assert!(!e.set_allow_tf32(true).unwrap(), "CPU devices have no TF32");
        let x: Vec<f32> = (0..24).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        let y: Vec<i32> = (0..6).map(|r| (r % 3) as i32).collect();
        let (x, y) = (Tensor::from_f32(&[6, 4], &x).unwrap(), Tensor::from_i32(&[6], &y).unwrap());
        match e.set_precision(Precision::Bf16) {
            Ok(()) => {
                assert_eq!(e.precision().unwrap(), Precision::Bf16);
                let loss = e.train_step(&x, &y).unwrap();
                assert!(loss.is_finite());
            }
            Err(err) => {
                assert_eq!(err.status(), status::NOT_SUPPORTED, "{}", err);
                assert_eq!(e.precision().unwrap(), Precision::F32);
            }
        }
    }

    #[test]
    fn reduce_dtype_bf16_rounds_the_reduction_and_keeps_replicas_identical() {
        let mut m = Model::new(3).unwrap();
        m.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 3, true).unwrap();
        let options = EngineOptions::new().cpu_devices(2).processes(Processes::Single);
        let plain = Engine::new(&m, &Optimizer::sgd(0.1), &options).unwrap();
        let e = Engine::new(&m, &Optimizer::sgd(0.1), &options).unwrap();
        assert_eq!(e.reduce_dtype().unwrap(), ReduceDtype::F32);
        let bad = check(unsafe { sys::dpar_engine_set_reduce_dtype(e.raw, 7) }).err().unwrap();
        assert_eq!(bad.status(), status::INVALID_ARGUMENT);
        assert!(bad.message().contains("reduce_dtype"), "{}", bad);
        assert_eq!(e.reduce_dtype().unwrap(), ReduceDtype::F32);
        e.set_reduce_dtype(ReduceDtype::Bf16).unwrap();
        assert_eq!(e.reduce_dtype().unwrap(), ReduceDtype::Bf16);
        let x: Vec<f32> = (0..24).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        let y: Vec<i32> = (0..6).map(|r| (r % 3) as i32).collect();
        let (x, y) = (Tensor::from_f32(&[6, 4], &x).unwrap(), Tensor::from_i32(&[6], &y).unwrap());
        for _ in 0..3 {
            assert!(e.train_step(&x, &y).unwrap().is_finite());
            plain.train_step(&x, &y).unwrap();
        }
        let n = m.num_param_elements().unwrap();
        let bits = |e: &Engine, r: usize| e.params(r, n).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_ne!(bits(&e, 0), bits(&plain, 0), "the bf16 rounding changed nothing");
        assert_eq!(bits(&e, 0), bits(&e, 1), "replicas differ");
    }

    #[test]
    fn memory_stats_count_each_replicas_parameters_and_the_peak_resets() {
        let mut m = Model::new(3).unwrap();
        m.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 3, true).unwrap();
        // Devices no other test uses: the tests run concurrently, and a device's count is every engine's on it.
        let opts = EngineOptions::new().cpu_devices(256).device_ids(&[250, 251]).processes(Processes::Single);
        let e = Engine::new(&m, &Optimizer::sgd(0.1), &opts).unwrap();
        let x: Vec<f32> = (0..28).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        let y: Vec<i32> = (0..7).map(|r| (r % 3) as i32).collect();
        let (x, y) = (Tensor::from_f32(&[7, 4], &x).unwrap(), Tensor::from_i32(&[7], &y).unwrap());
        e.train_step(&x, &y).unwrap();
        let n = m.num_param_elements().unwrap() as i64;
        for r in 0..2 {
            let s = e.memory_stats(r).unwrap();
            assert!(s.allocated_bytes >= 2 * 4 * n, "replica {}: {:?}", r, s);
            assert!(s.peak_bytes >= s.allocated_bytes, "replica {}: {:?}", r, s);
            e.reset_peak_memory(r).unwrap();
            let s = e.memory_stats(r).unwrap();
            assert_eq!(s.peak_bytes, s.allocated_bytes);
        }
        for bad in [e.memory_stats(2).err().unwrap(), e.reset_peak_memory(2).err().unwrap()] {
            assert_eq!(bad.status(), status::INVALID_ARGUMENT);
            assert!(bad.message().contains("replica: 2"), "{}", bad);
        }
    }

    #[test]
    fn reproducible_mode_gives_the_same_bits_on_one_device_and_on_three() {
        let mut m = Model::new(3).unwrap();
        m.linear(4, 8, true).unwrap().activation(Activation::Relu).unwrap().linear(8, 3, true).unwrap();
        let one = Engine::new(&m, &Optimizer::sgd(0.1), &EngineOptions::new().cpu_devices(1).processes(Processes::Single)).unwrap();
        let three = Engine::new(&m, &Optimizer::sgd(0.1), &EngineOptions::new().cpu_devices(3).processes(Processes::Single)).unwrap();
        assert_eq!(three.reproducible().unwrap(), 0);
        let bad = three.set_reproducible(-2).err().unwrap();
        assert_eq!(bad.status(), status::INVALID_ARGUMENT);
        assert!(bad.message().contains("-2"), "{}", bad);
        one.set_reproducible(2).unwrap();
        three.set_reproducible(2).unwrap();
        assert_eq!(three.reproducible().unwrap(), 2);
        let x: Vec<f32> = (0..28).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        let y: Vec<i32> = (0..7).map(|r| (r % 3) as i32).collect();
        let (x, y) = (Tensor::from_f32(&[7, 4], &x).unwrap(), Tensor::from_i32(&[7], &y).unwrap());
        for _ in 0..3 {
            let a = one.train_step(&x, &y).unwrap();
            assert!(a.is_finite());
            assert_eq!(a.to_bits(), three.train_step(&x, &y).unwrap().to_bits());
        }
        let n = m.num_param_elements().unwrap();
        let bits = |e: &Engine, r: usize| e.params(r, n).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&one, 0), bits(&three, 2));
    }

    #[test]
    fn loss_scaling_by_a_power_of_two_trains_as_none_and_an_overflow_skips_the_step() {
        let mut m = Model::new(7).unwrap();
        m.linear(4, 3, true).unwrap();
        let options = EngineOptions::new().cpu_devices(2).processes(Processes::Single);
        let opt = Optimizer::adam(0.01);
        let (plain, scaled) = (Engine::new(&m, &opt, &options).unwrap(), Engine::new(&m, &opt, &options).unwrap());
        assert_eq!(scaled.loss_scale().unwrap(), 1.0);
        let e = scaled.set_loss_scaling(1024.0, 2.0, 1.5, 2).err().unwrap();
        assert_eq!(e.status(), status::INVALID_ARGUMENT);
        assert!(e.message().contains("backoff_factor"), "{}", e);
        scaled.set_loss_scaling(1024.0, 2.0, 0.5, 2).unwrap();
        let mut x: Vec<f32> = (0..24).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
        let y: Vec<i32> = (0..6).map(|r| (r % 3) as i32).collect();
        let yt = Tensor::from_i32(&[6], &y).unwrap();
        for _ in 0..2 {
            let xt = Tensor::from_f32(&[6, 4], &x).unwrap();
            plain.train_step(&xt, &yt).unwrap();
            scaled.train_step(&xt, &yt).unwrap();
            assert!(!scaled.last_step_skipped().unwrap());
        }
        let bits = |e: &Engine| e.params(0, 15).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&plain), bits(&scaled));
        assert_eq!(scaled.loss_scale().unwrap(), 2048.0);
        // A NaN in the batch: the step is skipped and the scale backs off.
        x[0] = f32::NAN;
        let before = bits(&scaled);
        scaled.train_step(&Tensor::from_f32(&[6, 4], &x).unwrap(), &yt).unwrap();
        assert!(scaled.last_step_skipped().unwrap());
        assert_eq!(scaled.loss_scale().unwrap(), 1024.0);
        assert_eq!(scaled.step_count().unwrap(), 2);
        assert_eq!(bits(&scaled), before);
    }
}
