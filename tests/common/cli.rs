//! The `megatrain` binary as the command-line tests run it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary Cargo built for these tests.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_megatrain"))
}

/// Runs it with `args` to the end.
pub fn run(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

/// Fails with a message that contains every `needle`, and never panics.
pub fn refused(args: &[&str], needles: &[&str]) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: '{n}' not in: {err}");
    }
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `dir/corpus.txt`: one line of Romeo and Juliet, 40 times.
pub fn corpus(dir: &Path) -> PathBuf {
    let p = dir.join("corpus.txt");
    std::fs::write(&p, "O Romeo, Romeo! wherefore art thou Romeo?\n".repeat(40)).unwrap();
    p
}
