// Puts libdpar.so's directory, as dpar-sys found it, in the rpath of this crate's programs (train_fashion_mnist,
// train_char_gpt).
fn main() {
    if let Ok(dir) = std::env::var("DEP_DPAR_LIB_DIR") {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{}", dir);
    }
}
