//! dpcoord's addition: zmq-sys's build script compiles libzmq from `vendor/`
//! through this crate, and cargo rebuilds a path dependency only when a file
//! rustc read changes. Watching `vendor/` here makes an edit to libzmq's
//! source rebuild this crate, and with it libzmq.
fn main() {
    println!("cargo:rerun-if-changed=vendor");
}
