//! `megatrain`: train, sample, evaluate, export and plan — see `--help`.

mod cli;

use clap::Parser;

fn main() -> std::process::ExitCode {
    // Past a file-size limit (ulimit -f) a write then fails with EFBIG,
    // which is reported like a full disk, instead of killing the process.
    #[cfg(unix)]
    // SAFETY: setting a signal to be ignored, before any thread starts.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    // Freed tensors leave the RSS at once (see the function).
    megatrain_tier::rss::return_large_frees_to_os();
    let args = cli::Cli::parse();
    #[cfg(unix)]
    if cli::prints_for_a_pipe(&args) {
        // SAFETY: restoring a signal's default action, before any thread
        // starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli::run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<cli::Interrupted>() {
            // Already said, with the checkpoint it saved.
            Some(i) => std::process::ExitCode::from((128 + i.0).clamp(0, 255) as u8),
            None => {
                eprintln!("error: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
    }
}
