//! The `kvmove` command.
fn main() {}
