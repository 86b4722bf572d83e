//! Compiles the C++ PyTorch entry points (src/ffi/torch_shim.cpp) into the library.
fn main() {
    println!("cargo:rerun-if-changed=src/ffi/torch_shim.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/ffi/torch_shim.cpp")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .compile("gpupool_torch_shim");
}
