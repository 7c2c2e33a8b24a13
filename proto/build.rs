//! Compiles `cloudprovider/v1/*.proto` without a system `protoc`: protox parses the files into
//! a descriptor set, which tonic-prost-build turns into Rust.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from("cloudprovider/v1");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "proto") {
            files.push(path);
        }
    }
    files.sort();
    println!("cargo:rerun-if-changed=cloudprovider/v1");
    let fds = protox::compile(&files, ["."])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
