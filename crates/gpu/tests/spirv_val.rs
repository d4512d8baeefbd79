//! Every kernel's SPIR-V, as wgpu-hal hands it to a Vulkan driver
//! (`common::spirv`: per pipeline, without the runtime checks), through the
//! Khronos validator, `spirv-val --target-env vulkan1.3`. naga validates the
//! WGSL module, not what its SPIR-V writer makes of it, and a driver may
//! reject or silently miscompile an invalid module: on lavapipe that would
//! show as a failing kernel test, but the tensor-core variants only run on
//! GPUs, which CI does not have.
//!
//! The validator is `$MEGATRAIN_SPIRV_VAL`, else `spirv-val` on PATH. One
//! that predates SPV_KHR_cooperative_matrix (Debian 12's v2023.1) cannot
//! read the hardware tensor-core variants: they are then named as not
//! validated and everything else still is (the emulated variants
//! included). A newer one validates all of them: CI runs Debian 13's
//! (2025.1), which `tools/lavapipe_coop.sh spirv-val` provides on Debian 12.

mod common;

use std::path::Path;
use std::process::Command;

use common::spirv::{DEVICE_CAPS, compile, every_kernel};
use megatrain_gpu::Kernel;

fn validator() -> Option<String> {
    let exe = std::env::var("MEGATRAIN_SPIRV_VAL").unwrap_or_else(|_| "spirv-val".into());
    match Command::new(&exe).arg("--version").output() {
        Ok(out) if out.status.success() => {
            let version = String::from_utf8_lossy(&out.stdout);
            eprintln!("validator: {exe}: {}", version.lines().next().unwrap_or("?"));
            Some(exe)
        }
        _ => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!(
                    "CI=true but `{exe}` cannot be run: set MEGATRAIN_SPIRV_VAL=$(bash tools/lavapipe_coop.sh spirv-val) (`.ci/run` does)"
                );
            }
            eprintln!(
                "skipping: `{exe}` cannot be run (install spirv-tools, or set MEGATRAIN_SPIRV_VAL: tools/lavapipe_coop.sh)"
            );
            None
        }
    }
}

/// The validator's complaint about the module at `path`, if any.
fn validate(exe: &str, path: &Path) -> Option<String> {
    let out = Command::new(exe)
        .args(["--target-env", "vulkan1.3"])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("running {exe}: {e}"));
    (!out.status.success()).then(|| {
        let mut msg = String::from_utf8_lossy(&out.stderr).into_owned();
        msg.push_str(&String::from_utf8_lossy(&out.stdout));
        msg.lines().take(4).collect::<Vec<_>>().join("\n")
    })
}

/// A validator that does not know SPV_KHR_cooperative_matrix rejects the
/// capability itself, before anything else in the module.
fn predates_coop(complaint: &str) -> bool {
    complaint.contains("Invalid capability operand")
}

#[test]
fn every_kernel_is_valid_vulkan_spirv() {
    let Some(exe) = validator() else { return };
    let dir = tempfile::tempdir().unwrap();
    let kernels = every_kernel();
    let own = kernels.iter().filter(|k| k.3).count();
    assert!(own > 0, "no kernel of our own SPIR-V among the swept variants");
    let modules: Vec<(String, bool, std::path::PathBuf)> = kernels
        .iter()
        .enumerate()
        .map(|(i, (label, src, entry, own))| {
            // Ours as the device gets it (naga's, one fix: passthrough.rs).
            let words = if *own {
                Kernel::own_spirv_words(src, entry, false)
            } else {
                compile(src, entry, DEVICE_CAPS, false)
            }
            .unwrap_or_else(|e| panic!("{label}: {e}"));
            let path = dir.path().join(format!("{i}.spv"));
            std::fs::write(&path, bytemuck::cast_slice::<u32, u8>(&words)).unwrap();
            (
                label.clone(),
                src.contains("enable wgpu_cooperative_matrix"),
                path,
            )
        })
        .collect();
    let hardware = modules.iter().filter(|m| m.1).count();
    assert!(hardware > 300, "only {hardware} tensor-core variants");

    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunk = modules.len().div_ceil(threads);
    let complaints: Vec<(String, bool, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = modules
            .chunks(chunk)
            .map(|part| {
                let exe = &exe;
                s.spawn(move || {
                    part.iter()
                        .filter_map(|(label, coop, path)| {
                            validate(exe, path).map(|c| (label.clone(), *coop, c))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        jobs.into_iter().flat_map(|j| j.join().unwrap()).collect()
    });

    let old = complaints
        .iter()
        .filter(|(_, coop, c)| *coop && predates_coop(c))
        .count();
    let failed: Vec<String> = complaints
        .iter()
        .filter(|(_, coop, c)| !(*coop && predates_coop(c)))
        .map(|(label, _, c)| format!("{label}:\n{c}"))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} kernels are not valid Vulkan 1.3 SPIR-V:\n{}",
        failed.len(),
        modules.len(),
        failed.join("\n")
    );
    // Either the validator reads cooperative matrices or it reads none.
    assert!(
        old == 0 || old == hardware,
        "{old} of {hardware} tensor-core variants unreadable"
    );
    eprintln!("{} of {} kernels validated", modules.len() - old, modules.len());
    if old > 0 {
        eprintln!(
            "NOT validated: the {old} tensor-core variants (this spirv-val predates SPV_KHR_cooperative_matrix)"
        );
    }
}
