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

/// Runs it with `args`, which must succeed, and returns what it printed.
pub fn stdout_of(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Fails with a message that contains every `needle`, says nothing twice,
/// and never panics.
pub fn refused(args: &[&str], needles: &[&str]) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: '{n}' not in: {err}");
    }
    for line in err.lines() {
        assert!(
            repeated(line).is_none(),
            "{args:?}: says '{}' twice: {err}",
            repeated(line).unwrap()
        );
    }
}

/// A run of ": "-separated parts of `line` said twice in a row, as an
/// error that quotes its cause and also returns it as its `source()`
/// prints under `{:#}` ("x.txt: No such file: No such file").
pub fn repeated(line: &str) -> Option<String> {
    let parts: Vec<&str> = line.split(": ").collect();
    for len in 1..=parts.len() / 2 {
        for i in 0..=parts.len() - 2 * len {
            if parts[i..i + len] == parts[i + len..i + 2 * len] {
                return Some(parts[i..i + len].join(": "));
            }
        }
    }
    None
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
