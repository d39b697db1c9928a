// Puts libdpar.so's directory, as dpar-sys found it, in this program's rpath.
fn main() {
    if let Ok(dir) = std::env::var("DEP_DPAR_LIB_DIR") {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{}", dir);
    }
}
