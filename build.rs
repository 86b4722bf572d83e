//! Compiles the C++ PyTorch entry points (src/ffi/torch_shim.cpp) into the library.
fn main() {
    println!("cargo:rerun-if-changed=src/ffi/torch_shim.cpp");
    println!("cargo:rerun-if-changed=include/gpupool.h");
    cc::Build::new()
        .cpp(true)
        .file("src/ffi/torch_shim.cpp")
        .include("include")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .compile("gpupool_torch_shim");
}
