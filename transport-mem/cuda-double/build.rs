//! The double answers to the driver's soname, so `dlopen("libcuda.so.1")`
//! and `RTLD_NOLOAD` lookups by that name find it once it is loaded.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
