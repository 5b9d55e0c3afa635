//! Builds the CUDA driver double (`driver/libcuda.rs`) with `rustc` as a
//! shared library answering to the driver's soname, into `OUT_DIR`, and
//! tells the crate where (`KVMOVE_CUDA_DOUBLE_BUILT`). A cargo `cdylib`
//! target would not do: `cargo test` does not rebuild a package's cdylib
//! for its tests, and the tests must load the double of this source.
#![allow(clippy::expect_used)] // a build script: a panic is the build error

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("libkvmove_cuda_double.so");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.args(["--edition", "2021", "--crate-type", "cdylib", "--crate-name", "kvmove_cuda_double"])
        .args(["-C", "opt-level=1", "-C", "debuginfo=1", "-C", "link-arg=-Wl,-soname,libcuda.so.1"])
        .arg("-o")
        .arg(&lib)
        .arg("driver/libcuda.rs");
    if let (Ok(target), Ok(host)) = (std::env::var("TARGET"), std::env::var("HOST")) {
        if target != host {
            cmd.args(["--target", &target]);
        }
    }
    let status = cmd.status().expect("cannot run rustc for the CUDA driver double");
    assert!(status.success(), "building the CUDA driver double (driver/libcuda.rs) failed");
    // The directory a process puts on its library path to load the double
    // as the driver.
    let dir = out.join("driver");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cannot make the double's directory");
    for name in ["libcuda.so.1", "libcuda.so"] {
        std::os::unix::fs::symlink(&lib, dir.join(name)).expect("cannot link the double");
    }
    println!("cargo:rerun-if-changed=driver/libcuda.rs");
    println!("cargo:rustc-env=KVMOVE_CUDA_DOUBLE_DIR={}", dir.display());
    println!("cargo:rustc-env=KVMOVE_CUDA_DOUBLE_BUILT={}", lib.display());
}
