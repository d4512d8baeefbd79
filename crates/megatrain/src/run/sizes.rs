//! Sizes on the command line and in config files.

/// `24G`, `1.5GiB`, `800M`, `5GB`, `1024` (bytes): K/M/G/T and KiB/MiB/GiB/TiB
/// are powers of 1024, KB/MB/GB/TB powers of 1000 (as transformers reads
/// `max_shard_size`); the unit in any case.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.trim();
    let not_a_size = || format!("'{s}' is not a size (e.g. 24G, 5GB, 512MiB, 1073741824)");
    if num.is_empty() {
        return Err(not_a_size());
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit '{other}' in '{s}' (K, M, G, T or KiB, MiB, GiB, TiB: powers of 1024; KB, MB, GB, TB: powers of 1000)"
            ));
        }
    };
    let too_large = || format!("'{s}' is more than {} bytes", u64::MAX);
    // Whole numbers exactly; a fraction through f64.
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(too_large);
    }
    if !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(not_a_size());
    }
    let n: f64 = num.parse().map_err(|_| not_a_size())?;
    let bytes = n * mult as f64;
    // 2^64 is the first f64 past u64::MAX.
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_transformers_and_iec_write_them() {
        for (s, want) in [
            ("1000000", 1_000_000),
            ("5GB", 5_000_000_000),
            ("500mb", 500_000_000),
            ("2GiB", 2 << 30),
            ("24G", 24 << 30),
            ("1.5 KiB", 1536),
            ("3kB", 3000),
            ("1TB", 1_000_000_000_000),
            ("1tib", 1 << 40),
            ("0", 0),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse_bytes(s), Ok(want), "{s}");
        }
        for (s, needle) in [
            ("", "not a size"),
            ("GB", "not a size"),
            ("-5GB", "not a size"),
            ("1e9", "unknown size unit 'e9'"),
            ("12 parsecs", "unknown size unit 'parsecs'"),
            ("lots", "not a size"),
            ("18446744073709551616", "more than"),
            ("17179869184GiB", "more than"),
            ("20000000000.5TB", "more than"),
        ] {
            let err = parse_bytes(s).unwrap_err();
            assert!(err.contains(needle), "{s}: {err}");
        }
    }
}
