//! Every tensor-core variant through naga's WGSL front end, its validator
//! (with the cooperative-matrix and f16 capabilities), `process_overrides`
//! and its SPIR-V back end without runtime checks (`common/spirv.rs`) —
//! what wgpu does before a Vulkan driver sees the shader — so that a
//! variant naga cannot compile fails here, on machines without tensor cores.
//! The software-emulated variants (run on lavapipe by tests/f16.rs) go
//! through the same steps without either capability.

mod common;

use megatrain_gpu::{CoopAttention, CoopMatmul, CoopTile, Kernel};
use naga::valid::Capabilities;

fn compile(v: &CoopMatmul) -> Result<Vec<u32>, String> {
    compile_source(&Kernel::MatmulCoop(*v).spec().source, v.emulated)
}

/// As wgpu compiles it (`common::spirv`: per pipeline, without the runtime
/// checks), with only the capabilities the variant needs.
fn compile_source(src: &str, emulated: bool) -> Result<Vec<u32>, String> {
    // The software variants need neither (only unpack2x16float, which every
    // wgpu adapter offers).
    // f32 atomics: dk/dv's dQ (`AttnTile::fused_dq`), on devices that have them.
    let caps = if emulated {
        Capabilities::SHADER_FLOAT16_IN_FLOAT32 | Capabilities::SHADER_FLOAT32_ATOMIC
    } else {
        // Subgroups and their barriers: the attention's subgroup-local
        // rows (`AttnTile::local`), which run only where the device has both.
        Capabilities::COOPERATIVE_MATRIX
            | Capabilities::SHADER_FLOAT16
            | Capabilities::SUBGROUP
            | Capabilities::SUBGROUP_BARRIER
            | Capabilities::SHADER_FLOAT32_ATOMIC
    };
    common::spirv::compile(src, "main", caps, false)
}

#[test]
fn every_tensor_core_variant_compiles_to_spirv() {
    let all = CoopMatmul::all();
    // Seven tiles; every layout, edge, epilogue and emulation; f32 or f16 B
    // with f32 A, and f16 A with f16 B.
    assert_eq!(all.len(), CoopTile::ALL.len() * 64 * 3);
    assert_eq!(CoopTile::ALL.len(), 8);
    let mut failed = Vec::new();
    for v in &all {
        match std::panic::catch_unwind(|| compile(v)) {
            Ok(Ok(words)) => assert!(words.len() > 100, "{}: empty module", v.label()),
            Ok(Err(e)) => failed.push(format!("{}:\n{e}", v.label())),
            Err(_) => failed.push(format!("{}: naga panicked", v.label())),
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} variants fail:\n{}",
        failed.len(),
        all.len(),
        failed.join("\n")
    );
}

/// The hardware variants of every shape the matmul bench sweeps
/// (`CoopTile::SWEEP`), which a GPU session may time or train with
/// (`MEGATRAIN_F16_MATMUL`) on a driver that sees them first.
#[test]
fn every_swept_tile_shape_compiles_to_spirv() {
    let mut failed = Vec::new();
    let mut n = 0;
    for name in CoopTile::SWEEP {
        let tile = CoopTile::parse(name).unwrap();
        for v in CoopMatmul::variants(tile).iter().filter(|v| !v.emulated) {
            n += 1;
            match std::panic::catch_unwind(|| compile(v)) {
                Ok(Ok(words)) => assert!(words.len() > 100, "{}: empty module", v.label()),
                Ok(Err(e)) => failed.push(format!("{}:\n{e}", v.label())),
                Err(_) => failed.push(format!("{}: naga panicked", v.label())),
            }
        }
    }
    assert_eq!(n, CoopTile::SWEEP.len() * 96);
    assert!(
        failed.is_empty(),
        "{} of {n} variants fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// The matmul's and the attention's timing probes (`CoopProbe`,
/// `AttnProbe`), which a GPU session runs on a driver that sees them first.
#[test]
fn every_timing_probe_compiles_to_spirv() {
    let matmul = CoopMatmul::all_probes();
    assert_eq!(matmul.len(), 3 * 32 * 4);
    let attention = CoopAttention::all_probes();
    assert_eq!(attention.len(), 3 * 4 * 2 * 2 * 2);
    let sources = matmul
        .iter()
        .map(|v| (v.label(), Kernel::MatmulCoop(*v), v.emulated))
        .chain(
            attention
                .iter()
                .map(|v| (v.label(), Kernel::AttnCoop(*v), v.emulated)),
        );
    let mut all = 0;
    let failed: Vec<String> = sources
        .filter_map(|(label, k, emulated)| {
            all += 1;
            match std::panic::catch_unwind(|| compile_source(&k.spec().source, emulated)) {
                Ok(Ok(words)) if words.len() > 100 => None,
                Ok(Ok(_)) => Some(format!("{label}: empty module")),
                Ok(Err(e)) => Some(format!("{label}:\n{e}")),
                Err(_) => Some(format!("{label}: naga panicked")),
            }
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {all} probes fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn every_flash_attention_variant_compiles_to_spirv() {
    let all = CoopAttention::all();
    assert_eq!(all.len(), 3 * 4 * 2 * 2);
    // And the hardware variants of every tile set the attention bench
    // sweeps (AttnTiles::SWEEP).
    let swept = CoopAttention::swept();
    assert_eq!(swept.len(), megatrain_gpu::AttnTiles::SWEEP.len() * 3 * 4 * 2);
    let all: Vec<CoopAttention> = all.into_iter().chain(swept).collect();
    let mut failed = Vec::new();
    for v in &all {
        match std::panic::catch_unwind(|| compile_source(&Kernel::AttnCoop(*v).spec().source, v.emulated)) {
            Ok(Ok(words)) => assert!(words.len() > 100, "{}: empty module", v.label()),
            Ok(Err(e)) => failed.push(format!("{}:\n{e}", v.label())),
            Err(_) => failed.push(format!("{}: naga panicked", v.label())),
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} variants fail:\n{}",
        failed.len(),
        all.len(),
        failed.join("\n")
    );
}
