//! Every tensor-core variant through naga's WGSL front end, its validator
//! (with the cooperative-matrix and f16 capabilities) and its SPIR-V back
//! end — what wgpu does before a Vulkan driver sees the shader — so that a
//! variant naga cannot compile fails here, on machines without tensor cores.
//! The software-emulated variants (run on lavapipe by tests/f16.rs) go
//! through the same steps without either capability.

use megatrain_gpu::{CoopAttention, CoopMatmul};
use naga::valid::{Capabilities, ValidationFlags, Validator};

fn compile(v: &CoopMatmul) -> Result<Vec<u32>, String> {
    compile_source(&v.source(), v.emulated)
}

fn compile_source(src: &str, emulated: bool) -> Result<Vec<u32>, String> {
    let src = src.to_string();
    let module = naga::front::wgsl::parse_str(&src).map_err(|e| e.emit_to_string(&src))?;
    // The software variants need neither (only unpack2x16float, which every
    // wgpu adapter offers).
    let caps = if emulated {
        Capabilities::SHADER_FLOAT16_IN_FLOAT32
    } else {
        Capabilities::COOPERATIVE_MATRIX | Capabilities::SHADER_FLOAT16
    };
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| e.emit_to_string(&src))?;
    let opts = naga::back::spv::Options {
        lang_version: (1, 3),
        ..Default::default()
    };
    let pipeline = naga::back::spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    naga::back::spv::write_vec(&module, &info, &opts, Some(&pipeline)).map_err(|e| e.to_string())
}

#[test]
fn every_tensor_core_variant_compiles_to_spirv() {
    let all = CoopMatmul::all();
    assert_eq!(all.len(), 5 * 128);
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

#[test]
fn every_flash_attention_variant_compiles_to_spirv() {
    let all = CoopAttention::all();
    assert_eq!(all.len(), 3 * 4 * 2);
    let mut failed = Vec::new();
    for v in &all {
        match std::panic::catch_unwind(|| compile_source(&v.source(), v.emulated)) {
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
