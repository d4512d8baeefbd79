//! `rss::return_large_frees_to_os`: a freed block under glibc's default
//! dynamic threshold (raised by an earlier larger free) leaves the RSS.
//! Its own test binary, so no other test allocates meanwhile.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_freed_block_below_a_larger_freed_one_leaves_the_rss() {
    use megatrain_tier::rss::{MMAP_THRESHOLD, current_rss_bytes, return_large_frees_to_os};

    const MIB: usize = 1 << 20;
    assert!(return_large_frees_to_os());
    // Without the call, freeing this raises glibc's threshold to 24 MiB ...
    drop(std::hint::black_box(vec![1u8; 24 * MIB]));
    // ... and a 16 MiB block then comes from a heap that keeps it resident
    // after it is freed.
    let block = std::hint::black_box(vec![1u8; 16 * MIB]);
    let before = current_rss_bytes().unwrap();
    drop(block);
    let after = current_rss_bytes().unwrap();
    assert!(
        before.saturating_sub(after) >= 12 * MIB as u64,
        "freeing 16 MiB moved the RSS from {before} to {after} (threshold {MMAP_THRESHOLD})"
    );
}
