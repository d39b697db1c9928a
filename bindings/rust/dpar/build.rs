// Puts libdpar.so's directory (found by dpar-sys) in the rpath of this crate's tests and examples.
fn main() {
    if let Ok(dir) = std::env::var("DEP_DPAR_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    }
}
