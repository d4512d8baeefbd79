//! Resident set size of this process, for the bytes-per-parameter
//! measurement. Linux only (`/proc/self/status`); `None` elsewhere.

/// Current resident set size in bytes (`VmRSS`).
pub fn current_rss_bytes() -> Option<u64> {
    status_field("VmRSS:")
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
