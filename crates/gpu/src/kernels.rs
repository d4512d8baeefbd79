//! The kernel registry: every WGSL entry point we dispatch, its source
//! (included at build time from `shaders/`) and the bindings it uses. Each
//! pipeline is compiled on first use and cached for the executor's lifetime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const MATMUL: &str = include_str!("../../../shaders/matmul.wgsl");
pub(crate) const MATMUL_STORE: &str = include_str!("../../../shaders/matmul_store.wgsl");
pub(crate) const MATMUL_PARAMS: &str = include_str!("../../../shaders/matmul_params.wgsl");
const TILE64: &str = include_str!("../../../shaders/matmul_tile64.wgsl");
const TILE128: &str = include_str!("../../../shaders/matmul_tile128.wgsl");
const MATMUL_F32: &str = include_str!("../../../shaders/matmul_f32.wgsl");
const MATMUL_BF16: &str = include_str!("../../../shaders/matmul_bf16.wgsl");
const MATMUL_F16: &str = include_str!("../../../shaders/matmul_f16.wgsl");
const MATMUL_EXACT: &str = include_str!("../../../shaders/matmul_exact.wgsl");
const MATMUL_SCALE: &str = include_str!("../../../shaders/matmul_scale.wgsl");
const MATMUL_ROUND16: &str = include_str!("../../../shaders/matmul_round16.wgsl");
const ABSMAX: &str = include_str!("../../../shaders/absmax.wgsl");
const MAX_BITS: &str = include_str!("../../../shaders/max_bits.wgsl");
const ELEMENTWISE: &str = include_str!("../../../shaders/elementwise.wgsl");
/// elementwise.wgsl and the activation functions its softcap kernels call:
/// every kernel of the file needs them, since a module must resolve every
/// name in it, used by its entry point or not.
const ELEMENTWISE_SOURCES: [&str; 2] = [ACTIVATION_FNS, ELEMENTWISE];
const ACTIVATION: &str = include_str!("../../../shaders/activation.wgsl");
pub(crate) const ACTIVATION_FNS: &str = include_str!("../../../shaders/activation_fns.wgsl");
const EPILOGUE: &str = include_str!("../../../shaders/matmul_epilogue.wgsl");
const NORM: &str = include_str!("../../../shaders/norm.wgsl");
const ROW_MAX: &str = include_str!("../../../shaders/row_max.wgsl");
/// The norm kernels' module: norm.wgsl with the row maxima it stores.
const NORMS: &[&str] = &[MAX_BITS, NORM, ROW_MAX];
const ROPE: &str = include_str!("../../../shaders/rope.wgsl");
const ATTENTION: &str = include_str!("../../../shaders/attention.wgsl");
const ATTENTION_PARAMS: &str = include_str!("../../../shaders/attention_params.wgsl");
pub(crate) const ATTENTION_MASK: &str = include_str!("../../../shaders/attention_mask.wgsl");
const ATTENTION_LANES: &str = include_str!("../../../shaders/attention_lanes.wgsl");
const ATTENTION_F16: &str = include_str!("../../../shaders/attention_f16.wgsl");
/// attention.wgsl and what it reads: the activation functions for the soft
/// cap's `tanh_precise` (attention_params.wgsl's `capped`; the lanes
/// kernels take them too), the maxima's bits, the shared parameters and
/// mask.
const ATTENTION_SOURCES: [&str; 6] = [
    ACTIVATION_FNS,
    MAX_BITS,
    ATTENTION_PARAMS,
    DROPOUT_MASK,
    ATTENTION_MASK,
    ATTENTION,
];
const ATTENTION_SINKS: &str = include_str!("../../../shaders/attention_sinks.wgsl");
const ATTENTION_CACHED: &str = include_str!("../../../shaders/attention_cached.wgsl");
const DELTA_RULE: &str = include_str!("../../../shaders/delta_rule.wgsl");
const DELTA_RULE_CACHED: &str = include_str!("../../../shaders/delta_rule_cached.wgsl");
const CROSS_ENTROPY: &str = include_str!("../../../shaders/cross_entropy.wgsl");
const EMBEDDING: &str = include_str!("../../../shaders/embedding.wgsl");
const F16_COPY: &str = include_str!("../../../shaders/f16_copy.wgsl");
const CONV1D: &str = include_str!("../../../shaders/conv1d.wgsl");
const DROPOUT: &str = include_str!("../../../shaders/dropout.wgsl");
/// The dropout hash (dropout_mask.wgsl), which dropout.wgsl and
/// attention_mask.wgsl's `drop_factor` call: put before either.
pub(crate) const DROPOUT_MASK: &str = include_str!("../../../shaders/dropout_mask.wgsl");

/// The text of section `//// name` of `src` (the WGSL file `file`), up to
/// the next section: the files whose kernels are put together per variant
/// keep their pieces this way.
pub(crate) fn wgsl_section(src: &'static str, file: &str, name: &str) -> &'static str {
    let marker = format!("//// {name}\n");
    let start = src
        .find(&marker)
        .unwrap_or_else(|| panic!("{file} has no section {name}"))
        + marker.len();
    let end = src[start..].find("\n//// ").map_or(src.len(), |e| start + e + 1);
    &src[start..end]
}

/// How the B operand of a matmul is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulB {
    F32,
    /// Packed bf16, two per u32.
    Bf16,
    /// Packed f16, two per u32 (the f16 transport copy of a weight).
    F16,
}

/// A variant of the SIMT tiled matmul (`shaders/matmul.wgsl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimtMatmul {
    /// 128x128 tiles rather than 64x64.
    pub big: bool,
    pub b: MatmulB,
    /// F16 compute precision: operands scaled and rounded to f16.
    pub f16: bool,
    /// With the epilogue bindings (6, 7, 8) and functions: the flags pick
    /// an activation applied at the store (`shaders/matmul_epilogue.wgsl`).
    pub epi: bool,
}

/// Where a matmul kernel folds its invocations' output maxima
/// (matmul_epilogue.wgsl's `fold_…` sections): workgroup memory it no
/// longer needs once its products are stored.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FoldScratch {
    /// The SIMT kernels' A tile (`As`).
    SimtTiles,
    /// The tensor-core kernels' outgoing fragments (`c_s`).
    CoopFragments,
}

/// The WGSL a matmul pipeline stores C through: the activation functions
/// and the fused epilogue, or the identity; then the output maxima
/// (`maxima`, stored through binding 9 by `f16` pipelines) and their fold
/// through `scratch`.
pub(crate) fn epilogue_source(epi: bool, f16: bool, scratch: FoldScratch) -> String {
    let section = |name| wgsl_section(EPILOGUE, "matmul_epilogue.wgsl", name);
    let mut out = String::new();
    if epi {
        out.push_str(ACTIVATION_FNS);
    }
    out.push_str(section(if epi { "fused" } else { "none" }));
    out.push_str(MAX_BITS);
    out.push_str(section("maxima"));
    out.push_str(section(if f16 { "maxima_out" } else { "maxima_none" }));
    out.push_str(section("maxima_fold"));
    out.push_str(section(match scratch {
        FoldScratch::SimtTiles => "fold_simt",
        FoldScratch::CoopFragments => "fold_coop",
    }));
    out
}

/// The most storage bindings any kernel has (the tensor-core dK/dV pass,
/// with dV's maxima and the packed documents' bounds): adapters with fewer
/// per shader stage are refused.
/// Every adapter we target has more: lavapipe 32, Metal 31, NVIDIA's and
/// AMD's Vulkan drivers far more; WebGPU's default is 8.
pub(crate) const STORAGE_BINDINGS_MAX: u32 = 11;

/// A matmul pipeline's storage bindings in the host's order: A, B, bias,
/// C, the f16 operand scales, then the epilogue's aux0, aux1 and aux_out,
/// then (f16) the output maxima.
pub(crate) fn matmul_bindings(f16: bool, epi: bool) -> &'static [u32] {
    match (f16, epi) {
        (false, false) => &[1, 2, 3, 4],
        (true, false) => &[1, 2, 3, 4, 5, 9],
        (false, true) => &[1, 2, 3, 4, 6, 7, 8],
        (true, true) => &[1, 2, 3, 4, 5, 6, 7, 8, 9],
    }
}

/// Every kernel. The discriminant is only an identity; see [`Kernel::spec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Matmul(SimtMatmul),
    /// Whole 128x128 tiles of a SIMT matmul, layout fixed (the edges run
    /// on [`Kernel::Matmul`]).
    MatmulInterior(crate::simt::SimtInterior),
    /// A tensor-core matmul; only on devices with cooperative matrices.
    MatmulCoop(crate::coop::CoopMatmul),
    AbsmaxF32,
    AbsmaxBf16,
    /// The f16 copy of an f32 operand of the tensor-core kernels, rounded
    /// to nearest-even in f32 (`shaders/f16_copy.wgsl`).
    F16Copy,
    Add,
    AddAssign,
    Scale,
    AddScalar,
    /// Each element kept and scaled, or zeroed, by a dropout mask
    /// (dropout.wgsl).
    Dropout,
    /// Uniform noise from the dropout hash added to each element
    /// (dropout.wgsl's `uniform_noise`).
    UniformNoise,
    /// Each row times its own host-given factor (`scale_rows`).
    ScaleRows,
    /// `cap · tanh(x / cap)` and its backward from the capped output.
    Softcap,
    SoftcapBwd,
    CopyCols,
    SumRows,
    SumRowsPart,
    Swiglu,
    SwigluBwd,
    /// GPT-OSS's clamped SwiGLU and its backward.
    SwigluClamped,
    SwigluClampedBwd,
    Geglu,
    GegluBwd,
    Gelu,
    GeluBwd,
    GeluErf,
    GeluErfBwd,
    /// Qwen3-Next's gated attention output `x · σ(gate)` and its backward.
    SigmoidMul,
    SigmoidMulBwd,
    /// The gated delta rule's gates (activation.wgsl's `delta_gates`) and
    /// their backward's elementwise part.
    DeltaGates,
    DeltaGatesBwd,
    /// The gated delta net's short convolution (conv1d.wgsl): the forward,
    /// the pre-activation's gradient, dx from it, and dw's partials per
    /// block of rows.
    ConvSilu,
    ConvDpre,
    ConvDx,
    ConvDwPart,
    RmsFwd,
    LnFwd,
    RmsBwd,
    LnBwd,
    NormDw,
    NormDwPart,
    NormDwSum,
    /// The dot product of each row of two matrices (norm.wgsl's `row_dots`).
    RowDots,
    AddRmsFwd,
    AddLnFwd,
    AddRmsBwd,
    AddLnBwd,
    Rope,
    /// The f32 attention kernels, `d` the head dimensions they take: one
    /// compiled in, or any up to 128 or 256 read from the parameters
    /// ([`AttnHeadDim::of`] picks).
    AttnFwd {
        d: AttnHeadDim,
    },
    AttnDelta,
    AttnDq {
        d: AttnHeadDim,
    },
    AttnDkv {
        d: AttnHeadDim,
    },
    /// The same kernels with each row's D split over 4 subgroup lanes
    /// (attention_lanes.wgsl), `d` compiled in: where the adapter has
    /// subgroups and `attn_lanes_fit` takes the head dimension.
    AttnFwdLanes {
        d: u32,
    },
    AttnDqLanes {
        d: u32,
    },
    AttnDkvLanes {
        d: u32,
    },
    AttnDeltaLanes {
        d: u32,
    },
    /// Rounds an attention operand to f16 under its tensor's scale.
    AttnRound16,
    /// GPT-OSS's attention sinks (attention_sinks.wgsl): each row of an
    /// attention output scaled by its σ(lse − sink), and each row's term
    /// of the sinks' gradient.
    AttnSinkScale,
    AttnSinkRows,
    /// Attention of new queries over a cache of keys and values
    /// (attention_cached.wgsl), for generation.
    AttnCached,
    /// The gated delta rule (delta_rule.wgsl): the forward, the backward
    /// (its chunks replayed from their checkpoints, then walked in reverse)
    /// and the sum of the backward's partials over column blocks and value
    /// heads.
    DeltaRuleFwd,
    DeltaRuleBwd,
    /// The delta rule from a given state, for generation
    /// (delta_rule_cached.wgsl).
    DeltaRuleCached,
    DeltaRuleGroupSum,
    /// A tensor-core flash-attention kernel (real ones need cooperative
    /// matrices; emulated ones run anywhere).
    AttnCoop(crate::coop_attention::CoopAttention),
    CrossEntropy,
    GatherF32,
    GatherBf16,
    GatherF16,
    ScatterAdd,
}

impl Kernel {
    /// Every kernel that runs on any adapter (the tensor-core variants,
    /// which need cooperative matrices, are listed by
    /// [`crate::CoopMatmul::all`]).
    pub fn all() -> Vec<Kernel> {
        use Kernel::*;
        let mut v = Vec::new();
        for big in [false, true] {
            for b in [MatmulB::F32, MatmulB::Bf16, MatmulB::F16] {
                for f16 in [false, true] {
                    for epi in [false, true] {
                        v.push(Matmul(SimtMatmul { big, b, f16, epi }));
                    }
                }
            }
        }
        v.extend(crate::simt::SimtInterior::all().into_iter().map(MatmulInterior));
        v.extend([
            AbsmaxF32,
            AbsmaxBf16,
            F16Copy,
            Add,
            AddAssign,
            Scale,
            AddScalar,
            Dropout,
            UniformNoise,
            ScaleRows,
            Softcap,
            SoftcapBwd,
            CopyCols,
            SumRows,
            SumRowsPart,
            Swiglu,
            SwigluBwd,
            SwigluClamped,
            SwigluClampedBwd,
            Geglu,
            GegluBwd,
            Gelu,
            GeluBwd,
            GeluErf,
            GeluErfBwd,
            SigmoidMul,
            SigmoidMulBwd,
            DeltaGates,
            DeltaGatesBwd,
            ConvSilu,
            ConvDpre,
            ConvDx,
            ConvDwPart,
            RmsFwd,
            LnFwd,
            RmsBwd,
            LnBwd,
            NormDw,
            NormDwPart,
            NormDwSum,
            RowDots,
            AddRmsFwd,
            AddLnFwd,
            AddRmsBwd,
            AddLnBwd,
            Rope,
            AttnDelta,
            AttnRound16,
            AttnSinkScale,
            AttnSinkRows,
            AttnCached,
            DeltaRuleFwd,
            DeltaRuleBwd,
            DeltaRuleCached,
            DeltaRuleGroupSum,
            CrossEntropy,
            GatherF32,
            GatherBf16,
            GatherF16,
            ScatterAdd,
        ]);
        let dims = ATTN_HEAD_DIMS.map(AttnHeadDim::Fixed);
        for d in [AttnHeadDim::Any, AttnHeadDim::AnyWide].into_iter().chain(dims) {
            v.extend([AttnFwd { d }, AttnDq { d }, AttnDkv { d }]);
        }
        for d in ATTN_LANE_DIMS {
            v.extend([
                AttnFwdLanes { d },
                AttnDeltaLanes { d },
                AttnDqLanes { d },
                AttnDkvLanes { d },
            ]);
        }
        v
    }
}

#[derive(Clone)]
pub struct KernelSpec {
    /// The WGSL module (preludes and body concatenated, or generated).
    pub source: String,
    pub entry: &'static str,
    /// Storage binding numbers in the order the host passes buffers; binding
    /// 0 is always the uniform parameter block.
    pub bindings: &'static [u32],
}

/// Appended to every module. wgpu-hal 30's Vulkan backend honours all of a
/// module's `ShaderRuntimeChecks` only when it compiles the module per
/// pipeline, which it does for modules with overrides; for the others it
/// drops the bounds checks but keeps naga's loop-bounding counter in every
/// loop and its guards on every integer division (`vulkan/device.rs`).
const PER_PIPELINE: &str = "\noverride megatrain_per_pipeline: u32 = 1u;\n";

impl Kernel {
    /// Our kernels index only inside the arrays they declare and the buffers
    /// bound to them (every kernel is checked against the CPU reference on
    /// edge shapes, and `tests/gpu_parity.rs` trains bit for bit the same
    /// with the checks on), and every loop ends, so they run without wgpu's
    /// runtime checks: a clamp on every index into a workgroup or private
    /// array, a 64-bit counter and branch in every loop (which also keeps
    /// the driver from unrolling fixed-trip inner loops), and a guard on
    /// every integer division. Buffer accesses stay bounded by the
    /// device's robust buffer access, which wgpu always enables.
    pub const UNCHECKED: wgpu::ShaderRuntimeChecks = wgpu::ShaderRuntimeChecks::unchecked();

    /// The kernel's name in a per-kernel profile: a tensor-core variant's
    /// label, else the variant as written.
    pub fn profile_name(self) -> String {
        match self {
            Kernel::MatmulCoop(c) => c.label(),
            Kernel::AttnCoop(v) => v.label(),
            other => format!("{other:?}"),
        }
    }

    /// Whether the kernel's SPIR-V is ours (`crate::passthrough`), not
    /// wgpu's: the tensor-core attention with subgroup-local rows, whose
    /// subgroup barriers naga writes without workgroup-memory semantics,
    /// and the hardware dk/dv that adds dQ with f32 atomics, whose Device
    /// scope naga writes without the capability the Vulkan memory model
    /// asks for it.
    pub fn own_spirv(self) -> bool {
        matches!(self, Kernel::AttnCoop(v) if v.tile().local || (v.tile().fused_dq && !v.emulated))
    }

    /// naga's SPIR-V options as wgpu-hal 30 sets them for a Vulkan 1.3
    /// device with robustBufferAccess2, with wgpu's runtime checks
    /// (`checked`) or without ([`Kernel::UNCHECKED`]): what our own SPIR-V
    /// is written with, and what the tests compile every kernel with.
    pub fn spirv_options(checked: bool) -> naga::back::spv::Options<'static> {
        crate::passthrough::options(checked)
    }

    /// The SPIR-V an [`Kernel::own_spirv`] kernel's `spec()` becomes, as
    /// the device gets it (for the validator's tests).
    pub fn own_spirv_words(source: &str, entry: &str, checked: bool) -> Result<Vec<u32>, String> {
        crate::passthrough::compile(source, entry, checked).map(|c| c.words)
    }

    pub fn spec(self) -> KernelSpec {
        let mut spec = self.spec_body();
        spec.source.push_str(PER_PIPELINE);
        spec
    }

    fn spec_body(self) -> KernelSpec {
        use Kernel::*;
        let (sources, entry, bindings): (&[&'static str], &'static str, &'static [u32]) = match self {
            Matmul(v) => {
                let tile = if v.big { TILE128 } else { TILE64 };
                let b = match v.b {
                    MatmulB::F32 => MATMUL_F32,
                    MatmulB::Bf16 => MATMUL_BF16,
                    MatmulB::F16 => MATMUL_F16,
                };
                let epi = epilogue_source(v.epi, v.f16, FoldScratch::SimtTiles);
                let source = if v.f16 {
                    [
                        MATMUL_PARAMS,
                        tile,
                        b,
                        MATMUL_SCALE,
                        MATMUL_ROUND16,
                        &epi,
                        MATMUL_STORE,
                        MATMUL,
                    ]
                    .concat()
                } else {
                    [MATMUL_PARAMS, tile, b, MATMUL_EXACT, &epi, MATMUL_STORE, MATMUL].concat()
                };
                return KernelSpec {
                    source,
                    entry: "main",
                    bindings: matmul_bindings(v.f16, v.epi),
                };
            }
            MatmulInterior(v) => {
                return KernelSpec {
                    source: v.source(),
                    entry: "main",
                    bindings: v.bindings(),
                };
            }
            MatmulCoop(v) => {
                return KernelSpec {
                    source: v.source(),
                    entry: "main",
                    bindings: matmul_bindings(true, v.epi),
                };
            }
            AttnCoop(v) => {
                use crate::coop_attention::AttnPass;
                let bindings: &'static [u32] = match v.pass {
                    AttnPass::Fwd => &[1, 2, 3, 4, 5, 6, 12, 13],
                    AttnPass::Dq => &[1, 2, 3, 5, 6, 7, 8, 11, 13],
                    AttnPass::Dkv if v.tile().fused_dq => &[1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13],
                    AttnPass::Dkv => &[1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13],
                };
                return KernelSpec {
                    source: v.source(),
                    entry: "main",
                    bindings,
                };
            }
            F16Copy => (&[MATMUL_SCALE, F16_COPY], "main", &[1, 2, 5]),
            AbsmaxF32 => (&[MAX_BITS, ABSMAX], "absmax_f32", &[1, 3]),
            AbsmaxBf16 => (&[MAX_BITS, ABSMAX], "absmax_bf16", &[2, 3]),
            Add => (&ELEMENTWISE_SOURCES, "add", &[1, 2, 3]),
            AddAssign => (&ELEMENTWISE_SOURCES, "add_assign", &[1, 3]),
            Scale => (&ELEMENTWISE_SOURCES, "scale", &[1, 3]),
            AddScalar => (&ELEMENTWISE_SOURCES, "add_scalar", &[1, 3]),
            Dropout => (&[DROPOUT_MASK, DROPOUT], "dropout", &[1, 3]),
            UniformNoise => (&[DROPOUT_MASK, DROPOUT], "uniform_noise", &[1, 3]),
            ScaleRows => (&ELEMENTWISE_SOURCES, "scale_rows", &[1, 2, 3]),
            Softcap => (&ELEMENTWISE_SOURCES, "softcap", &[3]),
            SoftcapBwd => (&ELEMENTWISE_SOURCES, "softcap_bwd", &[1, 3]),
            CopyCols => (&ELEMENTWISE_SOURCES, "copy_cols", &[1, 3]),
            SumRows => (&ELEMENTWISE_SOURCES, "sum_rows", &[1, 3]),
            SumRowsPart => (&ELEMENTWISE_SOURCES, "sum_rows_part", &[1, 3]),
            Swiglu => (&[ACTIVATION_FNS, ACTIVATION], "swiglu", &[1, 2, 4]),
            SwigluBwd => (&[ACTIVATION_FNS, ACTIVATION], "swiglu_bwd", &[1, 2, 3, 4, 5]),
            SwigluClamped => (&[ACTIVATION_FNS, ACTIVATION], "swiglu_clamped", &[1, 4]),
            SwigluClampedBwd => (&[ACTIVATION_FNS, ACTIVATION], "swiglu_clamped_bwd", &[1, 2, 4]),
            Geglu => (&[ACTIVATION_FNS, ACTIVATION], "geglu", &[1, 2, 4]),
            GegluBwd => (&[ACTIVATION_FNS, ACTIVATION], "geglu_bwd", &[1, 2, 3, 4, 5]),
            Gelu => (&[ACTIVATION_FNS, ACTIVATION], "gelu", &[1, 4]),
            GeluBwd => (&[ACTIVATION_FNS, ACTIVATION], "gelu_bwd", &[1, 2, 4]),
            GeluErf => (&[ACTIVATION_FNS, ACTIVATION], "gelu_erf", &[1, 4]),
            GeluErfBwd => (&[ACTIVATION_FNS, ACTIVATION], "gelu_erf_bwd", &[1, 2, 4]),
            SigmoidMul => (&[ACTIVATION_FNS, ACTIVATION], "sigmoid_mul", &[1, 2, 4]),
            SigmoidMulBwd => (&[ACTIVATION_FNS, ACTIVATION], "sigmoid_mul_bwd", &[1, 2, 3, 4, 5]),
            DeltaGates => (&[ACTIVATION_FNS, ACTIVATION], "delta_gates", &[1, 2, 3, 6, 4, 5]),
            DeltaGatesBwd => (
                &[ACTIVATION_FNS, ACTIVATION],
                "delta_gates_bwd",
                &[1, 2, 3, 6, 7, 8, 4, 5, 9],
            ),
            ConvSilu => (&[CONV1D], "conv_silu", &[1, 2, 4, 5]),
            ConvDpre => (&[CONV1D], "conv_dpre", &[1, 2, 3, 4, 5]),
            ConvDx => (&[CONV1D], "conv_dx", &[2, 3, 4, 5]),
            ConvDwPart => (&[CONV1D], "conv_dw_part", &[1, 3, 4, 5]),
            RmsFwd => (NORMS, "rms_fwd", &[1, 2, 4, 5, 11]),
            LnFwd => (NORMS, "ln_fwd", &[1, 2, 3, 4, 5, 6, 11]),
            RmsBwd => (NORMS, "rms_bwd", &[1, 2, 3, 4, 7, 11]),
            LnBwd => (NORMS, "ln_bwd", &[1, 2, 3, 4, 7, 8, 11]),
            NormDw => (NORMS, "norm_dw", &[1, 3, 4, 5, 7, 8]),
            NormDwPart => (NORMS, "norm_dw_part", &[1, 3, 6, 7, 8]),
            NormDwSum => (NORMS, "norm_dw_sum", &[4, 5, 6]),
            RowDots => (NORMS, "row_dots", &[1, 3, 5]),
            AddRmsFwd => (NORMS, "add_rms_fwd", &[1, 2, 4, 5, 9, 10, 11]),
            AddLnFwd => (NORMS, "add_ln_fwd", &[1, 2, 3, 4, 5, 6, 9, 10, 11]),
            AddRmsBwd => (NORMS, "add_rms_bwd", &[1, 2, 3, 4, 7, 9, 11]),
            AddLnBwd => (NORMS, "add_ln_bwd", &[1, 2, 3, 4, 7, 8, 9, 11]),
            Rope => (&[MAX_BITS, ROPE], "rope", &[1, 2, 3, 4, 5, 6]),
            AttnFwd { d } => return attention(d, "attn_fwd", &[1, 2, 3, 4, 5, 10, 11, 13]),
            AttnDelta => (&ATTENTION_SOURCES, "attn_delta", &[4, 6, 10]),
            AttnDq { d } => return attention(d, "attn_dq", &[1, 2, 3, 5, 6, 7, 10, 13]),
            AttnDkv { d } => return attention(d, "attn_dkv", &[1, 2, 3, 5, 6, 8, 9, 10, 11, 13]),
            AttnFwdLanes { d } => return attention_lanes(d, "attn_fwd", &[1, 2, 3, 4, 5, 10, 11, 13]),
            AttnDeltaLanes { d } => return attention_lanes(d, "attn_delta", &[4, 6, 10]),
            AttnDqLanes { d } => return attention_lanes(d, "attn_dq", &[1, 2, 3, 5, 6, 7, 10, 13]),
            AttnDkvLanes { d } => return attention_lanes(d, "attn_dkv", &[1, 2, 3, 5, 6, 8, 9, 10, 11, 13]),
            AttnRound16 => (&[MATMUL_SCALE, ATTENTION_F16], "round_operand", &[1, 4, 5]),
            AttnSinkScale => (&[ATTENTION_SINKS], "sink_scale", &[1, 2, 3, 5]),
            AttnSinkRows => (&[ATTENTION_SINKS], "sink_rows", &[1, 2, 3, 4, 5]),
            AttnCached => (
                &[ACTIVATION_FNS, ATTENTION_CACHED],
                "attn_cached",
                &[1, 2, 3, 4, 5],
            ),
            DeltaRuleFwd => (&[DELTA_RULE], "dr_fwd", &[1, 2, 3, 4, 5, 6, 7, 12]),
            DeltaRuleBwd => (&[DELTA_RULE], "dr_bwd", &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]),
            DeltaRuleGroupSum => (&[DELTA_RULE], "dr_group_sum", &[10, 11]),
            DeltaRuleCached => (&[DELTA_RULE_CACHED], "dr_cached", &[1, 2, 3, 4, 5, 6, 7]),
            CrossEntropy => (
                &[MAX_BITS, CROSS_ENTROPY, ROW_MAX],
                "cross_entropy",
                &[1, 2, 3, 4, 5],
            ),
            GatherF32 => (&[EMBEDDING], "gather_f32", &[1, 2, 4]),
            GatherBf16 => (&[EMBEDDING], "gather_bf16", &[1, 3, 4]),
            GatherF16 => (&[EMBEDDING], "gather_f16", &[1, 3, 4]),
            ScatterAdd => (&[EMBEDDING], "scatter_add", &[1, 4, 5, 6, 7]),
        };
        KernelSpec {
            source: sources.concat(),
            entry,
            bindings,
        }
    }
}

/// Head dimensions the f32 attention kernels are compiled for, besides
/// the general ones: each thread's row vectors are arrays of D floats
/// indexed by loop counters, which a compiler keeps in registers only when
/// D is a constant (they live in local memory otherwise, on GPUs). 32 is
/// gpt2-nano's (the README's main job), 64 GPT-2's and TinyLlama's, 256
/// Gemma 2's and 3's (on the wide tiles, [`AttnHeadDim::kb`]).
pub const ATTN_HEAD_DIMS: [u32; 3] = [32, 64, 256];

/// The largest head dimension of the f32 attention kernels (attention.wgsl
/// with [`AttnHeadDim::AnyWide`]'s arrays).
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// attention.wgsl's DM, KB and QB as written: the arrays of the kernels
/// with [`AttnHeadDim::Any`], and the tiles of every kernel whose D is at
/// most 128.
const ATTN_DM: u32 = 128;
const ATTN_KB: u32 = 16;
const ATTN_QB: u32 = 8;
/// attention.wgsl's tiles T1 and T2 (16 KiB together, the WebGPU minimum
/// of workgroup memory), and where dkv keeps its tile's statistics in them.
const ATTN_TILE: u32 = 2048;
const ATTN_STATS: u32 = 1024;

/// The head dimensions an f32 attention kernel (attention.wgsl) takes,
/// which fix its arrays' length DM and its tiles: up to DM = 128 a key tile
/// of KB = 16 rows (forward, dq) and a query tile of QB = 8 (dkv); past it
/// KB = 8 and QB = 4, so that the tiles still fill no more than their
/// 2 × 2048 floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnHeadDim {
    /// Exactly D, compiled in (one of [`ATTN_HEAD_DIMS`]): DM = D.
    Fixed(u32),
    /// Any D ≤ 128, read from the parameters.
    Any,
    /// Any D ≤ 256, read from the parameters, on the wide tiles.
    AnyWide,
}

impl AttnHeadDim {
    /// The kernels of head dimension `d` (at most [`ATTN_MAX_HEAD_DIM`]):
    /// compiled in where `d` is one of [`ATTN_HEAD_DIMS`], else the general
    /// ones that hold it.
    pub fn of(d: usize) -> AttnHeadDim {
        match ATTN_HEAD_DIMS.into_iter().find(|&x| x as usize == d) {
            Some(x) => AttnHeadDim::Fixed(x),
            None if d <= ATTN_DM as usize => AttnHeadDim::Any,
            None => AttnHeadDim::AnyWide,
        }
    }

    /// The length of the kernels' row arrays: the most D they take.
    pub fn dm(self) -> u32 {
        match self {
            AttnHeadDim::Fixed(d) => d,
            AttnHeadDim::Any => ATTN_DM,
            AttnHeadDim::AnyWide => 2 * ATTN_DM,
        }
    }

    fn wide(self) -> bool {
        self.dm() > ATTN_DM
    }

    /// Key rows per tile of the forward and dq kernels.
    pub fn kb(self) -> usize {
        (if self.wide() { ATTN_KB / 2 } else { ATTN_KB }) as usize
    }

    /// Query rows per tile of the dkv kernel.
    pub fn qb(self) -> usize {
        (if self.wide() { ATTN_QB / 2 } else { ATTN_QB }) as usize
    }
}

/// Head dimensions whose lanes kernels `Kernel::all` lists (compiled
/// ahead by the tests): the zoo's families'. Any other `attn_lanes_fit`
/// D compiles when first used.
pub const ATTN_LANE_DIMS: [u32; 5] = [32, 64, 80, 96, 128];

/// Whether the lanes kernels (attention_lanes.wgsl) take head dimension
/// `d`: four lanes of whole vec4s, at most 128 (the f32 kernels' bound).
pub fn attn_lanes_fit(d: usize) -> bool {
    d.is_multiple_of(16) && (16..=128).contains(&d)
}

/// Workgroup memory of the lanes kernels at head dimension `d`: two tiles
/// of 16 rows and the statistics (attention_lanes.wgsl's T1, T2, S1, S2).
pub fn attn_lanes_workgroup_bytes(d: usize) -> u32 {
    (2 * 16 * d * 4 + 256 * 4 + 16 * 4) as u32
}

/// attention_lanes.wgsl with entry `entry`, D compiled in and its
/// `// unroll` blocks repeated D / 16 times.
fn attention_lanes(d: u32, entry: &'static str, bindings: &'static [u32]) -> KernelSpec {
    assert!(attn_lanes_fit(d as usize), "lanes attention at head dim {d}");
    KernelSpec {
        source: [
            &format!("const D: u32 = {d}u;\n"),
            ACTIVATION_FNS,
            MAX_BITS,
            ATTENTION_PARAMS,
            DROPOUT_MASK,
            ATTENTION_MASK,
            &unroll(ATTENTION_LANES, d / 16),
        ]
        .concat(),
        entry,
        bindings,
    }
}

/// `src` with the lines between each `// unroll` line and the next
/// `// end` line written `n` times, `UV` replaced by 0u, 1u, … in the
/// copies (so a loop over a row's vec4s indexes its arrays by constants).
fn unroll(src: &str, n: u32) -> String {
    let mut out = String::with_capacity(src.len() * 2);
    let mut block: Option<Vec<&str>> = None;
    for line in src.lines() {
        match (line.trim(), block.as_mut()) {
            ("// unroll", None) => block = Some(Vec::new()),
            ("// end", Some(lines)) => {
                for i in 0..n {
                    for l in lines.iter() {
                        out.push_str(&l.replace("UV", &format!("{i}u")));
                        out.push('\n');
                    }
                }
                block = None;
            }
            (_, Some(lines)) => lines.push(line),
            (_, None) => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    assert!(block.is_none(), "an `// unroll` block without its `// end`");
    out
}

/// attention.wgsl with entry `entry` for head dimensions `d`: DM (the
/// arrays' length) is `d.dm()`, KB and QB are `d`'s tiles, and with D
/// compiled in every read of the parameter `p.d` is DM. The kernels of
/// [`AttnHeadDim::Any`] and of the compiled-in D ≤ 128 keep the file's tiles.
fn attention(d: AttnHeadDim, entry: &'static str, bindings: &'static [u32]) -> KernelSpec {
    let mut source = ATTENTION_SOURCES.concat();
    let (dm, kb, qb) = (d.dm(), d.kb() as u32, d.qb() as u32);
    assert!(
        (1..=ATTN_MAX_HEAD_DIM as u32).contains(&dm)
            && kb * dm <= ATTN_TILE
            && qb * dm <= ATTN_STATS
            && ATTN_STATS + qb <= ATTN_TILE,
        "attention kernels of {d:?}: tiles of {kb} and {qb} rows of {dm} past their workgroup memory"
    );
    let mut set = |name: &str, was: u32, to: u32| {
        let decl = |v: u32| format!("const {name}: u32 = {v}u;");
        assert!(
            source.contains(&decl(was)),
            "attention.wgsl declares no {}",
            decl(was)
        );
        if to != was {
            source = source.replace(&decl(was), &decl(to));
        }
    };
    set("DM", ATTN_DM, dm);
    set("KB", ATTN_KB, kb);
    set("QB", ATTN_QB, qb);
    set("STATS", ATTN_STATS, ATTN_STATS);
    assert!(
        source.contains(&format!("array<f32, {ATTN_TILE}>")),
        "attention.wgsl's tiles are not {ATTN_TILE} floats"
    );
    if let AttnHeadDim::Fixed(_) = d {
        source = replace_token(&source, "p.d", "DM");
    }
    KernelSpec {
        source,
        entry,
        bindings,
    }
}

/// `from` replaced by `to` where it is not followed by an identifier
/// character (`p.d` but not `p.dd_off`).
fn replace_token(src: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find(from) {
        let after = rest[i + from.len()..].chars().next();
        out.push_str(&rest[..i]);
        if after.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            out.push_str(from);
        } else {
            out.push_str(to);
        }
        rest = &rest[i + from.len()..];
    }
    out.push_str(rest);
    out
}

pub struct Pipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    pub entry: &'static str,
    pub bindings: &'static [u32],
}

pub struct KernelRegistry {
    cache: Mutex<HashMap<Kernel, Arc<Pipeline>>>,
    checks: wgpu::ShaderRuntimeChecks,
    /// Every tensor-core attention kernel from our own SPIR-V
    /// (`GpuOptions::own_spirv`).
    own_attention: bool,
}

impl KernelRegistry {
    /// `checked`: compile with all of wgpu's runtime checks (for hunting an
    /// index out of bounds), else [`Kernel::UNCHECKED`]; `own_attention`:
    /// every tensor-core attention kernel from our own SPIR-V.
    pub fn new(checked: bool, own_attention: bool) -> Self {
        KernelRegistry {
            cache: Mutex::default(),
            checks: if checked {
                wgpu::ShaderRuntimeChecks::checked()
            } else {
                Kernel::UNCHECKED
            },
            own_attention,
        }
    }

    pub fn get(&self, device: &wgpu::Device, k: Kernel) -> Arc<Pipeline> {
        let mut cache = self.cache.lock().expect("kernel cache poisoned");
        cache
            .entry(k)
            .or_insert_with(|| {
                let spec = k.spec();
                if k.own_spirv() || (self.own_attention && matches!(k, Kernel::AttnCoop(_))) {
                    return Arc::new(own_spirv_pipeline(device, spec, self.checks.bounds_checks));
                }
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(spec.entry),
                    source: wgpu::ShaderSource::Wgsl(spec.source.into()),
                };
                // SAFETY: see `Kernel::UNCHECKED`; with `checked` every check is on.
                let module = unsafe { device.create_shader_module_trusted(desc, self.checks) };
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(spec.entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(spec.entry),
                    compilation_options: Default::default(),
                    cache: None,
                });
                let layout = pipeline.get_bind_group_layout(0);
                Arc::new(Pipeline {
                    pipeline,
                    layout,
                    entry: spec.entry,
                    bindings: spec.bindings,
                })
            })
            .clone()
    }

    /// Compiles every kernel now (startup cost instead of first-use latency).
    pub fn warm_all(&self, device: &wgpu::Device) {
        for k in Kernel::all() {
            self.get(device, k);
        }
    }
}

/// A pipeline from SPIR-V we write (`crate::passthrough`), with the
/// layout wgpu would have derived: group 0, the buffers the entry point uses.
fn own_spirv_pipeline(device: &wgpu::Device, spec: KernelSpec, checked: bool) -> Pipeline {
    let label = spec.entry;
    let c = crate::passthrough::compile(&spec.source, spec.entry, checked)
        .unwrap_or_else(|e| panic!("kernel '{label}': our SPIR-V: {e}"));
    let entries: Vec<wgpu::BindGroupLayoutEntry> = c
        .bindings
        .iter()
        .map(|&(binding, ty)| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(label),
        entries: &entries,
    });
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(label),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 0,
    });
    let (x, y, z) = (c.workgroup_size[0], c.workgroup_size[1], c.workgroup_size[2]);
    // SAFETY: naga validated the module and wrote it, and the one change
    // made to it (`passthrough.rs`) is checked by spirv-val in CI
    // (tests/spirv_val.rs); the layout is read from the same module.
    let module = unsafe {
        device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
            label: Some(label),
            entry_points: std::borrow::Cow::Owned(vec![wgpu::PassthroughShaderEntryPoint {
                name: spec.entry.into(),
                workgroup_size: (x, y, z),
            }]),
            spirv: Some(std::borrow::Cow::Owned(c.words)),
            ..Default::default()
        })
    };
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: Some(&pipeline_layout),
        module: &module,
        entry_point: Some(spec.entry),
        compilation_options: Default::default(),
        cache: None,
    });
    Pipeline {
        pipeline,
        layout,
        entry: spec.entry,
        bindings: spec.bindings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_kernel_has_more_storage_bindings_than_adapters_must_offer() {
        let coop = crate::CoopMatmul::all().into_iter().map(Kernel::MatmulCoop);
        let attn = crate::coop_attention::CoopAttention::all()
            .into_iter()
            .map(Kernel::AttnCoop);
        let widest = Kernel::all()
            .into_iter()
            .chain(coop)
            .chain(attn)
            .map(|k| k.spec().bindings.len())
            .max();
        assert_eq!(widest, Some(STORAGE_BINDINGS_MAX as usize));
    }

    #[test]
    fn unroll_repeats_each_block_with_its_index() {
        let src = "a\n    // unroll\nx[UV] = y_UV;\n    // end\nb\n";
        assert_eq!(unroll(src, 2), "a\nx[0u] = y_0u;\nx[1u] = y_1u;\nb\n");
        assert_eq!(unroll(src, 0), "a\nb\n");
        let open = std::panic::catch_unwind(|| unroll("// unroll\nx\n", 1));
        assert!(open.is_err(), "a block without its end is refused");
    }

    /// The workgroup memory of a kernel's source as naga lays it out.
    fn workgroup_bytes(src: &str) -> u32 {
        let module = naga::front::wgsl::parse_str(src).expect("the kernel parses");
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).expect("layout");
        module
            .global_variables
            .iter()
            .filter(|(_, g)| g.space == naga::AddressSpace::WorkGroup)
            .map(|(_, g)| layouter[g.ty].size)
            .sum()
    }

    /// The lanes kernels' workgroup memory as naga lays out the module,
    /// against what `GpuContext::attention_lanes` checks the adapter for.
    #[test]
    fn lanes_attention_workgroup_bytes_are_the_modules() {
        for d in ATTN_LANE_DIMS {
            let src = Kernel::AttnDkvLanes { d }.spec().source;
            let bytes = workgroup_bytes(&src);
            assert_eq!(bytes, attn_lanes_workgroup_bytes(d as usize), "D = {d}");
            assert!(bytes <= 32 << 10, "D = {d}: {bytes} bytes past lavapipe's 32 KiB");
        }
    }

    #[test]
    fn head_dim_compiled_in_replaces_only_the_parameter() {
        assert_eq!(
            replace_token("p.d + p.dd_off * p.d;", "p.d", "DM"),
            "DM + p.dd_off * DM;"
        );
        let src = Kernel::AttnDq {
            d: AttnHeadDim::Fixed(32),
        }
        .spec()
        .source;
        assert!(src.contains("const DM: u32 = 32u;") && !src.contains("p.d ") && src.contains("p.dd_off"));
        use AttnHeadDim::*;
        let picked = [64, 48, 128, 1, 256, 129, 200].map(AttnHeadDim::of);
        assert_eq!(picked, [Fixed(64), Any, Any, Any, Fixed(256), AnyWide, AnyWide]);
    }

    /// Every f32 attention kernel's tiles and arrays as naga lays out the
    /// module: the tiles within WebGPU's 16 KiB of workgroup memory, DM,
    /// KB and QB those the host takes (`AttnHeadDim`), the kernels up to
    /// D = 128 on the file's own tiles and the general ones on its arrays.
    #[test]
    fn attention_variants_fit_16_kib_on_their_tiles() {
        use AttnHeadDim::*;
        for d in [Any, AnyWide].into_iter().chain(ATTN_HEAD_DIMS.map(Fixed)) {
            for k in [Kernel::AttnFwd { d }, Kernel::AttnDq { d }, Kernel::AttnDkv { d }] {
                let src = k.spec().source;
                let bytes = workgroup_bytes(&src);
                assert_eq!(bytes, 16 << 10, "{k:?}");
                let has = |c: &str, v: usize| src.contains(&format!("const {c}: u32 = {v}u;"));
                assert!(
                    has("DM", d.dm() as usize) && has("KB", d.kb()) && has("QB", d.qb()),
                    "{k:?}"
                );
                assert_eq!(d.wide(), d.dm() > 128, "{k:?}");
                assert_eq!((d.kb(), d.qb()), if d.wide() { (8, 4) } else { (16, 8) }, "{k:?}");
                assert_eq!(
                    src.contains("p.d;") || src.contains("p.d)"),
                    !matches!(d, Fixed(_))
                );
            }
        }
        assert_eq!((Any.dm(), AnyWide.dm()), (128, ATTN_MAX_HEAD_DIM as u32));
        let narrow = Kernel::AttnFwd { d: Any }.spec().source;
        assert_eq!(
            narrow,
            ATTENTION_SOURCES.concat() + PER_PIPELINE,
            "the general kernels up to 128 are attention.wgsl as written"
        );
    }
}
