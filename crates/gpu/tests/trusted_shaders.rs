//! Our kernels are compiled without wgpu's runtime checks (index clamps,
//! loop-bounding counters, integer-division guards: `Kernel::RUNTIME_CHECKS`).
//! These tests compile every kernel the way wgpu-hal's Vulkan backend does
//! for a module with overrides (`process_overrides`, then naga's SPIR-V
//! writer with the checks off) and say what the checks would have cost.

use megatrain_gpu::{CoopAttention, CoopMatmul, Kernel};
use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// naga's SPIR-V options as wgpu-hal 30 builds them for a Vulkan 1.3 device
/// with robustBufferAccess2 (NVIDIA's drivers), checked or not.
fn options(checked: bool) -> spv::Options<'static> {
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy::*};
    spv::Options {
        lang_version: (1, 6),
        bounds_check_policies: BoundsCheckPolicies {
            index: if checked { Restrict } else { Unchecked },
            buffer: Unchecked,
            image_load: Unchecked,
            binding_array: Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::Native,
        force_loop_bounding: checked,
        emit_int_div_checks: checked,
        ..Default::default()
    }
}

/// SPIR-V of one entry point, through the path wgpu-hal takes for modules
/// with overrides (the only one that honours every runtime-check flag).
fn spirv(src: &str, entry: &str, checked: bool) -> Result<Vec<u32>, String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    if module.overrides.is_empty() {
        return Err("declares no override: wgpu-hal would keep its loop bounding and division checks".into());
    }
    let caps = Capabilities::COOPERATIVE_MATRIX
        | Capabilities::SHADER_FLOAT16
        | Capabilities::SHADER_FLOAT16_IN_FLOAT32
        | Capabilities::SUBGROUP;
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| e.emit_to_string(src))?;
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &Default::default(),
    )
    .map_err(|e| e.to_string())?;
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.into(),
    };
    spv::write_vec(&module, &info, &options(checked), Some(&pipeline)).map_err(|e| e.to_string())
}

/// Instructions in a SPIR-V module (after its 5-word header).
fn instructions(words: &[u32]) -> usize {
    let (mut i, mut n) = (5, 0);
    while i < words.len() {
        i += (words[i] >> 16).max(1) as usize;
        n += 1;
    }
    n
}

fn every_kernel() -> Vec<(String, String, &'static str)> {
    let mut all: Vec<(String, String, &'static str)> = Kernel::all()
        .into_iter()
        .map(|k| {
            let s = k.spec();
            (format!("{k:?}"), s.source, s.entry)
        })
        .collect();
    for v in CoopMatmul::all() {
        let s = Kernel::MatmulCoop(v).spec();
        all.push((v.label(), s.source, s.entry));
    }
    for v in CoopAttention::all() {
        let s = Kernel::AttnCoop(v).spec();
        all.push((v.label(), s.source, s.entry));
    }
    all
}

#[test]
fn every_kernel_compiles_unchecked_on_the_per_pipeline_path() {
    let mut failed = Vec::new();
    let mut total = 0;
    for (label, src, entry) in every_kernel() {
        match std::panic::catch_unwind(|| spirv(&src, entry, false)) {
            Ok(Ok(words)) => assert!(instructions(&words) > 20, "{label}: empty module"),
            Ok(Err(e)) => failed.push(format!("{label}: {e}")),
            Err(_) => failed.push(format!("{label}: naga panicked")),
        }
        total += 1;
    }
    assert!(total > 700, "only {total} kernels");
    assert!(
        failed.is_empty(),
        "{} of {total} fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// What the checks add, per family: the instruction count of each kernel
/// with them and without (printed with --nocapture), and a floor on the
/// saving so that a kernel compiled with them again fails here.
#[test]
fn the_checks_we_drop_are_code_in_every_kernel() {
    let mut rows = Vec::new();
    for (label, src, entry) in every_kernel() {
        let with = instructions(&spirv(&src, entry, true).expect("checked"));
        let without = instructions(&spirv(&src, entry, false).expect("unchecked"));
        // Only these elementwise kernels neither loop nor index an array.
        let flat = [
            "Add",
            "AddAssign",
            "Scale",
            "Gelu",
            "GeluBwd",
            "Swiglu",
            "SwigluBwd",
            "AttnRound16",
        ];
        assert!(
            without < with || (flat.contains(&label.as_str()) && without == with),
            "{label}: {without} instructions unchecked, {with} checked"
        );
        rows.push((label, with, without));
    }
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
