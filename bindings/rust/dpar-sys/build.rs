// Finds libdpar.so: $DPAR_LIB_DIR, else the CMake build tree of this checkout (build/ at the repository root).
// Exports the directory as the `lib_dir` metadata (DEP_DPAR_LIB_DIR for direct dependents), so that a crate that
// links a program can put it in the program's rpath: cargo does not pass an rpath on from a -sys crate.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=DPAR_LIB_DIR");
    let dir = match env::var_os("DPAR_LIB_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../../build"),
    };
    let dir = dir.canonicalize().unwrap_or(dir);
    if !dir.join("libdpar.so").exists() {
        panic!(
            "dpar-sys: no libdpar.so in {} (build dpar first: bash scripts/build.sh, or set DPAR_LIB_DIR)",
            dir.display()
        );
    }
    println!("cargo:rerun-if-changed={}", dir.join("libdpar.so").display());
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=dpar");
    println!("cargo:lib_dir={}", dir.display());
}
