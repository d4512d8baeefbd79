//! Resident set size of this process, for the bytes-per-parameter
//! measurement (Linux only, `/proc/self/status`; `None` elsewhere), and
//! what keeps it down: freed memory and read file pages handed back.

/// Current resident set size in bytes (`VmRSS`).
pub fn current_rss_bytes() -> Option<u64> {
    status_field("VmRSS:")
}

/// Current proportional set size in bytes (`Pss` of
/// `/proc/self/smaps_rollup`): a page the process shares with k others
/// counts 1/(k+1), so the ranks' figures add up to the machine's memory
/// where they map one transport copy ([`crate::shared`]), which RSS counts
/// whole in each.
pub fn current_pss_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
        parse_kb_field(&rollup, "Pss:")
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// Peak resident set size in bytes since start or the last
/// [`reset_peak_rss`] (`VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    status_field("VmHWM:")
}

/// Resets the peak to the current RSS (writes `5` to
/// `/proc/self/clear_refs`, Linux ≥ 4.0). Returns whether it worked.
pub fn reset_peak_rss() -> bool {
    #[cfg(target_os = "linux")]
    {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// From this size up, an allocation is a mapping of its own once
/// [`return_large_frees_to_os`] has run.
pub const MMAP_THRESHOLD: usize = 1 << 20;

/// Makes every allocation of [`MMAP_THRESHOLD`] bytes or more a mapping of
/// its own, unmapped (gone from the RSS) when freed. glibc's malloc
/// otherwise raises that threshold to the size of each large block freed
/// (up to 32 MiB), and blocks under it then come from heaps that keep
/// freed memory resident. A training step allocates and frees layer-sized
/// tensors all the time (on the CPU executor they are host memory): on
/// TinyLlama-1.1B's shape that kept 100–200 MB resident beyond every
/// live buffer, more than the whole margin between the tier's 14 bytes
/// per parameter and the 14.5 target (see BENCHMARKS.md). Call it at the
/// start of a process that trains. Returns whether it took effect (glibc
/// on Linux only; elsewhere it does nothing).
pub fn return_large_frees_to_os() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter (under its own
        // lock); no memory is touched.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(target_os = "linux")]
fn status_field(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kb_field(&status, key)
}

#[cfg(not(target_os = "linux"))]
fn status_field(_key: &str) -> Option<u64> {
    None
}

/// Finds `key   1234 kB` in a /proc status text and returns bytes.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse_kb_field(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let mut parts = line[key.len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

pub use megatrain_tensor::release_mapped;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_status_fields() {
        let s = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nBad:\t12\n";
        assert_eq!(parse_kb_field(s, "VmRSS:"), Some(1024 * 1024));
        assert_eq!(parse_kb_field(s, "VmHWM:"), Some(2048 * 1024));
        assert_eq!(parse_kb_field(s, "Bad:"), None);
        assert_eq!(parse_kb_field(s, "VmSwap:"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let cur = current_rss_bytes().unwrap();
        let peak = peak_rss_bytes().unwrap();
        assert!(cur > 0 && peak >= cur / 2, "cur {cur} peak {peak}");
    }
}
