//! Our kernels through naga as wgpu-hal 30's Vulkan backend compiles them:
//! the WGSL front end, the validator, `process_overrides` for the entry
//! point (every module declares an override, so wgpu-hal takes this
//! per-pipeline path), then the SPIR-V writer with the options it builds for
//! a Vulkan 1.3 device with robustBufferAccess2 (NVIDIA's drivers), with or
//! without the runtime checks (`Kernel::UNCHECKED`).

use megatrain_gpu::{CoopAttention, CoopMatmul, Kernel};
use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// What a device with tensor cores offers the kernels.
pub const DEVICE_CAPS: Capabilities = Capabilities::COOPERATIVE_MATRIX
    .union(Capabilities::SHADER_FLOAT16)
    .union(Capabilities::SHADER_FLOAT16_IN_FLOAT32)
    .union(Capabilities::SUBGROUP)
    .union(Capabilities::SUBGROUP_BARRIER)
    .union(Capabilities::SHADER_FLOAT32_ATOMIC);

/// naga's SPIR-V options, checked or not: the library's, which our own
/// SPIR-V (`Kernel::own_spirv`) is written with too.
pub fn options(checked: bool) -> spv::Options<'static> {
    Kernel::spirv_options(checked)
}

/// SPIR-V of entry point `entry` of `src`, validated with `caps`.
pub fn compile(src: &str, entry: &str, caps: Capabilities, checked: bool) -> Result<Vec<u32>, String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    if module.overrides.is_empty() {
        return Err("declares no override: wgpu-hal would keep its loop bounding and division checks".into());
    }
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
pub fn instructions(words: &[u32]) -> usize {
    let (mut i, mut n) = (5, 0);
    while i < words.len() {
        i += (words[i] >> 16).max(1) as usize;
        n += 1;
    }
    n
}

/// Every kernel the executor can build, as (label, WGSL, entry point,
/// whether its SPIR-V is ours: `Kernel::own_spirv`): the registry's kernels
/// and each tensor-core variant, emulated ones included.
pub fn every_kernel() -> Vec<(String, String, &'static str, bool)> {
    let mut all: Vec<(String, String, &'static str, bool)> = Kernel::all()
        .into_iter()
        .map(|k| {
            let s = k.spec();
            (format!("{k:?}"), s.source, s.entry, k.own_spirv())
        })
        .collect();
    // The named tiles, the hardware variants of the bench's swept shapes
    // and the timing probes of the matmul bench.
    let swept = megatrain_gpu::CoopTile::SWEEP
        .iter()
        .map(|n| megatrain_gpu::CoopTile::parse(n).unwrap())
        .flat_map(CoopMatmul::variants)
        .filter(|v| !v.emulated);
    for v in CoopMatmul::all()
        .into_iter()
        .chain(swept)
        .chain(CoopMatmul::all_probes())
    {
        let k = Kernel::MatmulCoop(v);
        let s = k.spec();
        all.push((v.label(), s.source, s.entry, k.own_spirv()));
    }
    for v in CoopAttention::all()
        .into_iter()
        .chain(CoopAttention::swept())
        .chain(CoopAttention::all_probes())
    {
        let k = Kernel::AttnCoop(v);
        let s = k.spec();
        all.push((v.label(), s.source, s.entry, k.own_spirv()));
    }
    all
}
