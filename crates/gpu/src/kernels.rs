//! The kernel registry: every WGSL entry point we dispatch, its source
//! (included at build time from `shaders/`) and the bindings it uses. Each
//! pipeline is compiled on first use and cached for the executor's lifetime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const MATMUL: &str = include_str!("../../../shaders/matmul.wgsl");
const TILE64: &str = include_str!("../../../shaders/matmul_tile64.wgsl");
const TILE128: &str = include_str!("../../../shaders/matmul_tile128.wgsl");
const MATMUL_F32: &str = include_str!("../../../shaders/matmul_f32.wgsl");
const MATMUL_BF16: &str = include_str!("../../../shaders/matmul_bf16.wgsl");
const ELEMENTWISE: &str = include_str!("../../../shaders/elementwise.wgsl");
const ACTIVATION: &str = include_str!("../../../shaders/activation.wgsl");
const NORM: &str = include_str!("../../../shaders/norm.wgsl");
const ROPE: &str = include_str!("../../../shaders/rope.wgsl");
const ATTENTION: &str = include_str!("../../../shaders/attention.wgsl");
const CROSS_ENTROPY: &str = include_str!("../../../shaders/cross_entropy.wgsl");
const EMBEDDING: &str = include_str!("../../../shaders/embedding.wgsl");

/// Every kernel. The discriminant is only an identity; see [`Kernel::spec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    MatmulF32,
    MatmulBf16,
    MatmulF32Big,
    MatmulBf16Big,
    Add,
    AddAssign,
    Scale,
    CopyCols,
    SumRows,
    Swiglu,
    SwigluBwd,
    Gelu,
    GeluBwd,
    RmsFwd,
    LnFwd,
    RmsBwd,
    LnBwd,
    NormDw,
    Rope,
    AttnFwd,
    AttnDelta,
    AttnDq,
    AttnDkv,
    CrossEntropy,
    GatherF32,
    GatherBf16,
    ScatterAdd,
}

impl Kernel {
    /// Every variant, so that lists of kernels cannot drift from the enum.
    pub const ALL: [Kernel; 27] = {
        use Kernel::*;
        [
            MatmulF32,
            MatmulBf16,
            MatmulF32Big,
            MatmulBf16Big,
            Add,
            AddAssign,
            Scale,
            CopyCols,
            SumRows,
            Swiglu,
            SwigluBwd,
            Gelu,
            GeluBwd,
            RmsFwd,
            LnFwd,
            RmsBwd,
            LnBwd,
            NormDw,
            Rope,
            AttnFwd,
            AttnDelta,
            AttnDq,
            AttnDkv,
            CrossEntropy,
            GatherF32,
            GatherBf16,
            ScatterAdd,
        ]
    };
}

#[derive(Clone, Copy)]
pub struct KernelSpec {
    /// WGSL pieces concatenated in order.
    pub sources: &'static [&'static str],
    pub entry: &'static str,
    /// Storage binding numbers in the order the host passes buffers; binding
    /// 0 is always the uniform parameter block.
    pub bindings: &'static [u32],
}

impl Kernel {
    pub fn spec(self) -> KernelSpec {
        use Kernel::*;
        let (sources, entry, bindings): (&'static [&'static str], &'static str, &'static [u32]) = match self {
            MatmulF32 => (&[TILE64, MATMUL_F32, MATMUL], "main", &[1, 2, 3, 4]),
            MatmulBf16 => (&[TILE64, MATMUL_BF16, MATMUL], "main", &[1, 2, 3, 4]),
            MatmulF32Big => (&[TILE128, MATMUL_F32, MATMUL], "main", &[1, 2, 3, 4]),
            MatmulBf16Big => (&[TILE128, MATMUL_BF16, MATMUL], "main", &[1, 2, 3, 4]),
            Add => (&[ELEMENTWISE], "add", &[1, 2, 3]),
            AddAssign => (&[ELEMENTWISE], "add_assign", &[1, 3]),
            Scale => (&[ELEMENTWISE], "scale", &[1, 3]),
            CopyCols => (&[ELEMENTWISE], "copy_cols", &[1, 3]),
            SumRows => (&[ELEMENTWISE], "sum_rows", &[1, 3]),
            Swiglu => (&[ACTIVATION], "swiglu", &[1, 2, 4]),
            SwigluBwd => (&[ACTIVATION], "swiglu_bwd", &[1, 2, 3, 4, 5]),
            Gelu => (&[ACTIVATION], "gelu", &[1, 4]),
            GeluBwd => (&[ACTIVATION], "gelu_bwd", &[1, 2, 4]),
            RmsFwd => (&[NORM], "rms_fwd", &[1, 2, 4, 5]),
            LnFwd => (&[NORM], "ln_fwd", &[1, 2, 3, 4, 5, 6]),
            RmsBwd => (&[NORM], "rms_bwd", &[1, 2, 3, 4, 7]),
            LnBwd => (&[NORM], "ln_bwd", &[1, 2, 3, 4, 7, 8]),
            NormDw => (&[NORM], "norm_dw", &[1, 3, 4, 5, 7, 8]),
            Rope => (&[ROPE], "rope", &[1, 2, 3, 4]),
            AttnFwd => (&[ATTENTION], "attn_fwd", &[1, 2, 3, 4, 5, 10]),
            AttnDelta => (&[ATTENTION], "attn_delta", &[4, 6, 10]),
            AttnDq => (&[ATTENTION], "attn_dq", &[1, 2, 3, 5, 6, 7, 10]),
            AttnDkv => (&[ATTENTION], "attn_dkv", &[1, 2, 3, 5, 6, 8, 9, 10]),
            CrossEntropy => (&[CROSS_ENTROPY], "cross_entropy", &[1, 2, 3, 4]),
            GatherF32 => (&[EMBEDDING], "gather_f32", &[1, 2, 4]),
            GatherBf16 => (&[EMBEDDING], "gather_bf16", &[1, 3, 4]),
            ScatterAdd => (&[EMBEDDING], "scatter_add", &[1, 4, 5, 6, 7]),
        };
        KernelSpec {
            sources,
            entry,
            bindings,
        }
    }
}

pub struct Pipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

#[derive(Default)]
pub struct KernelRegistry {
    cache: Mutex<HashMap<Kernel, Arc<Pipeline>>>,
}

impl KernelRegistry {
    pub fn get(&self, device: &wgpu::Device, k: Kernel) -> Arc<Pipeline> {
        let mut cache = self.cache.lock().expect("kernel cache poisoned");
        cache
            .entry(k)
            .or_insert_with(|| {
                let spec = k.spec();
                let source: String = spec.sources.concat();
                let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(spec.entry),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                });
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(spec.entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(spec.entry),
                    compilation_options: Default::default(),
                    cache: None,
                });
                let layout = pipeline.get_bind_group_layout(0);
                Arc::new(Pipeline { pipeline, layout })
            })
            .clone()
    }

    /// Compiles every kernel now (startup cost instead of first-use latency).
    pub fn warm_all(&self, device: &wgpu::Device) {
        for k in Kernel::ALL {
            self.get(device, k);
        }
    }
}
