// Finds the libdpar to link against, trying in turn:
//   1. $DPAR_LIB_DIR, a directory holding libdpar.so. It comes first because setting it is a deliberate choice for
//      one build: it must win over whatever dpar happens to be installed (dpar's own tests point it at the build
//      tree on machines that may have another dpar installed, and a user can test a prefix of their own the same way).
//   2. pkg-config (the program in $PKG_CONFIG, else `pkg-config`, so $PKG_CONFIG_PATH is honoured): an installed
//      dpar, the way a -sys crate normally finds its library. A standard prefix needs nothing set.
//   3. build/ at the root of the dpar source tree this crate sits in (a checkout after scripts/build.sh). A packaged
//      crate has no such tree around it, so this only ever applies to a checkout.
// Nothing of dpar's C++ tree is compiled here: the declarations are written by hand in src/lib.rs.
//
// The directory found is exported as the `lib_dir` metadata, which cargo gives to the build scripts of the crates
// that depend on this one directly, as DEP_DPAR_LIB_DIR. Cargo never passes a link argument (an rpath) on from a
// dependency's build script to the programs that use it, so a program whose libdpar lies outside the loader's
// search path puts DEP_DPAR_LIB_DIR in its own run path (README.md shows the three lines).
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    for var in ["DPAR_LIB_DIR", "PKG_CONFIG", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "PKG_CONFIG_SYSROOT_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let library = library_file_name();
    let mut tried = Vec::new();
    let found = from_env(&library, &mut tried)
        .or_else(|| from_pkg_config(&library, &mut tried))
        .or_else(|| from_source_tree(&library, &mut tried));
    let Some(found) = found else {
        panic!(
            "\ndpar-sys: no {library} to link against. Looked in, in this order:\n{}\n\
             Install dpar (cmake --install build --prefix PREFIX) and, for a prefix pkg-config does not search, set \
             PKG_CONFIG_PATH=PREFIX/lib/pkgconfig; or set DPAR_LIB_DIR to the directory holding {library}; or build \
             this checkout with scripts/build.sh.\n",
            tried.iter().map(|t| format!("  - {t}")).collect::<Vec<_>>().join("\n")
        );
    };
    println!("cargo:rerun-if-changed={}", found.lib_dir.join(&library).display());
    if let Some(pc) = &found.pc_file {
        println!("cargo:rerun-if-changed={}", pc.display());
    }
    for dir in &found.search_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=dpar");
    println!("cargo:lib_dir={}", found.lib_dir.display());
}

struct Found {
    /// The directory holding the library (exported as DEP_DPAR_LIB_DIR).
    lib_dir: PathBuf,
    /// The linker's -L directories: none where pkg-config leaves out a directory the linker searches anyway.
    search_dirs: Vec<PathBuf>,
    /// The dpar.pc pkg-config read, to build again when it changes.
    pc_file: Option<PathBuf>,
}

fn library_file_name() -> String {
    match env::var("CARGO_CFG_TARGET_OS").as_deref() {
        Ok("macos") => "libdpar.dylib".into(),
        _ => "libdpar.so".into(),
    }
}

fn in_dir(dir: PathBuf, library: &str) -> Option<PathBuf> {
    let dir = dir.canonicalize().unwrap_or(dir);
    dir.join(library).exists().then_some(dir)
}

fn from_env(library: &str, tried: &mut Vec<String>) -> Option<Found> {
    let Some(dir) = env::var_os("DPAR_LIB_DIR") else {
        tried.push("$DPAR_LIB_DIR: not set".into());
        return None;
    };
    let dir = PathBuf::from(dir);
    match in_dir(dir.clone(), library) {
        Some(d) => Some(Found { lib_dir: d.clone(), search_dirs: vec![d], pc_file: None }),
        // A directory given explicitly and wrong is an error, not a reason to link another libdpar silently.
        None => panic!("dpar-sys: DPAR_LIB_DIR={} holds no {library}", dir.display()),
    }
}

fn pkg_config(args: &[&str]) -> Result<String, String> {
    let program = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into());
    let out = Command::new(&program).args(args).output().map_err(|e| format!("{program} could not run: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{program} {}: {}", args.join(" "), err.lines().next().unwrap_or("failed")));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn from_pkg_config(library: &str, tried: &mut Vec<String>) -> Option<Found> {
    // The declarations in src/lib.rs are those of this crate's version of dpar.h; the ABI only grows within a
    // major version, so any later release of the same major version will do.
    let major = env::var("CARGO_PKG_VERSION_MAJOR").unwrap();
    let minor = env::var("CARGO_PKG_VERSION_MINOR").unwrap();
    let wanted = format!("dpar >= {major}.{minor}");
    let path = env::var("PKG_CONFIG_PATH").unwrap_or_default();
    let attempt = || -> Result<Found, String> {
        let version = pkg_config(&["--modversion", "dpar"])?;
        if version.split('.').next() != Some(major.as_str()) || pkg_config(&["--exists", &wanted]).is_err() {
            return Err(format!("found dpar {version}, this crate needs {major}.x from {major}.{minor}"));
        }
        let libdir = PathBuf::from(pkg_config(&["--variable=libdir", "dpar"])?);
        let search_dirs: Vec<PathBuf> = pkg_config(&["--libs-only-L", "dpar"])?
            .split_whitespace()
            .filter_map(|flag| flag.strip_prefix("-L"))
            .map(PathBuf::from)
            .collect();
        // With a sysroot the -L flags carry it and libdir does not: the -L directory is the real one.
        let lib_dir = search_dirs
            .iter()
            .chain(std::iter::once(&libdir))
            .find_map(|d| in_dir(d.clone(), library))
            .ok_or_else(|| {
                format!("dpar.pc says libdir={} but it holds no {library} (was the prefix moved?)", libdir.display())
            })?;
        let pc_file = pkg_config(&["--variable=pcfiledir", "dpar"]).ok().map(|d| Path::new(&d).join("dpar.pc"));
        Ok(Found { lib_dir, search_dirs, pc_file })
    };
    match attempt() {
        Ok(found) => Some(found),
        Err(why) => {
            tried.push(format!("pkg-config (PKG_CONFIG_PATH={path:?}): {why}"));
            None
        }
    }
}

fn from_source_tree(library: &str, tried: &mut Vec<String>) -> Option<Found> {
    // bindings/rust/dpar-sys -> the repository root, recognised by its include/dpar.h.
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../..");
    let root = root.canonicalize().unwrap_or(root);
    if !root.join("include/dpar.h").exists() {
        tried.push(format!("the dpar source tree around this crate: {} is not one", root.display()));
        return None;
    }
    let build = root.join("build");
    match in_dir(build.clone(), library) {
        Some(d) => Some(Found { lib_dir: d.clone(), search_dirs: vec![d], pc_file: None }),
        None => {
            tried.push(format!("{}: no {library} (build it with scripts/build.sh)", build.display()));
            None
        }
    }
}
