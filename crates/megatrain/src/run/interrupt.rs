//! SIGINT and SIGTERM (Ctrl-C; a cloud machine's notice before it is taken
//! back) end a training run at the end of the step under way, with a
//! checkpoint of that step, instead of losing every step since the last
//! save. The handler only records the signal; a second one acts as if no
//! handler were installed (the process ends at once).

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal received, 0 for none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn record(signal: libc::c_int) {
    // Async-signal-safe: a store to an atomic.
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Installs the handler for SIGINT and SIGTERM (a no-op off Unix).
pub fn install() {
    #[cfg(unix)]
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid; the handler only stores to
        // an atomic, and SA_RESETHAND puts the default action back for the
        // next signal of the kind.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = record as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The signal that asked the run to stop, if one has.
pub fn requested() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `SIGINT`, `SIGTERM` or `signal N`.
pub fn signal_name(signal: i32) -> String {
    #[cfg(unix)]
    match signal {
        libc::SIGINT => return "SIGINT".into(),
        libc::SIGTERM => return "SIGTERM".into(),
        _ => {}
    }
    format!("signal {signal}")
}
