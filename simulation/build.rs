fn main() {
    // Set for the workspace in .cargo/config.toml; a build without it (RUSTFLAGS given in the
    // environment replaces the config's) still compiles, with a runtime that is not seeded.
    println!("cargo::rustc-check-cfg=cfg(tokio_unstable)");
}
