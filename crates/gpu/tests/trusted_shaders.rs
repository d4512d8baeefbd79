//! Our kernels are compiled without wgpu's runtime checks (index clamps,
//! loop-bounding counters, integer-division guards: `Kernel::UNCHECKED`).
//! This compiles every kernel the way wgpu-hal's Vulkan backend does
//! (`common::spirv`), with the checks and without, and says what they
//! would have cost. (`coop_naga.rs` compiles the tensor-core families the
//! same way with only the capabilities each variant needs.)

mod common;

use common::spirv::{DEVICE_CAPS, compile, every_kernel, instructions};

fn spirv(src: &str, entry: &str, checked: bool) -> Result<Vec<u32>, String> {
    compile(src, entry, DEVICE_CAPS, checked)
}

/// Every kernel compiles without the checks, and the checks are code in
/// every one that loops or indexes an array, so that a kernel compiled
/// with them again fails here. The instruction counts per family, with the
/// checks and without, are printed with --nocapture.
#[test]
fn every_kernel_compiles_unchecked_and_the_checks_were_code_in_it() {
    // Only these elementwise kernels neither loop nor index an array.
    let flat = [
        "Add",
        "AddAssign",
        "Scale",
        "AddScalar",
        "Softcap",
        "SoftcapBwd",
        "Gelu",
        "GeluBwd",
        "GeluErf",
        "GeluErfBwd",
        "Swiglu",
        "SwigluBwd",
        "SwigluClamped",
        "SwigluClampedBwd",
        "Geglu",
        "GegluBwd",
        "SigmoidMul",
        "SigmoidMulBwd",
        "AttnRound16",
        "F16Copy",
    ];
    let (mut rows, mut failed) = (Vec::new(), Vec::new());
    for (label, src, entry, _) in every_kernel() {
        let both = std::panic::catch_unwind(|| -> Result<(usize, usize), String> {
            let with = instructions(&spirv(&src, entry, true)?);
            Ok((with, instructions(&spirv(&src, entry, false)?)))
        });
        match both {
            Ok(Ok((with, without))) => {
                if !(without < with || (flat.contains(&label.as_str()) && without == with)) {
                    failed.push(format!(
                        "{label}: {without} instructions unchecked, {with} checked"
                    ));
                }
                rows.push((label, with, without));
            }
            Ok(Err(e)) => failed.push(format!("{label}: {e}")),
            Err(_) => failed.push(format!("{label}: naga panicked")),
        }
    }
    let total = rows.len() + failed.len();
    assert!(total > 700, "only {total} kernels");
    assert!(
        failed.is_empty(),
        "{} of {total} fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
    let family = |l: &str| l.split(['(', '_', ' ']).next().unwrap_or(l).to_string();
    let mut seen = std::collections::BTreeMap::<String, (usize, usize, usize)>::new();
    for (label, with, without) in &rows {
        let e = seen.entry(family(label)).or_default();
        e.0 += 1;
        e.1 += with;
        e.2 += without;
    }
    eprintln!("family | kernels | instructions checked | unchecked | removed");
    for (f, (n, with, without)) in seen {
        let removed = 100.0 * (with - without) as f64 / with as f64;
        eprintln!("{f} | {n} | {with} | {without} | {removed:.1}%");
    }
}
