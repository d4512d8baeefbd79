//! Shared test fixtures: one device per test binary, the CPU reference, and
//! comparison helpers.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};

pub mod matmul_case;
pub mod spirv;

use megatrain_gpu::{GpuContext, GpuExecutor, GpuOptions, GpuTensor};
use megatrain_tensor::testing::{random_f32, rel_norm_err};
use megatrain_tensor::{ComputePrecision, CpuExecutor, Executor, HostTensor, Shape};

/// f32 kernels against the f32 CPU reference: both round every operation to
/// f32 but sum in different orders, so errors are a few ulps of the norm.
pub const TOL_F32: f64 = 1e-5;

fn init() -> Option<Arc<GpuContext>> {
    match GpuContext::new() {
        Ok(ctx) => {
            let lavapipe = if ctx.is_lavapipe_coop() {
                " with lavapipe's cooperative matrices (MEGATRAIN_LAVAPIPE_COOP)"
            } else {
                ""
            };
            eprintln!("GPU tests on {}{lavapipe}", ctx.info);
            Some(ctx)
        }
        Err(e) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI=true but no GPU adapter could be opened (is mesa-vulkan-drivers installed?): {e}");
            }
            eprintln!("skipping GPU tests: {e}");
            None
        }
    }
}

static CTX: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
static GPU: OnceLock<Option<GpuExecutor>> = OnceLock::new();
static SMALL: OnceLock<Option<GpuExecutor>> = OnceLock::new();
static BIG_TILE: OnceLock<Option<GpuExecutor>> = OnceLock::new();

/// An executor that always uses the 128x128 matmul tile (normally chosen only
/// for large products), so that small random shapes test it too.
pub fn gpu_big_tile() -> Option<&'static GpuExecutor> {
    BIG_TILE
        .get_or_init(|| {
            ctx().map(|c| {
                GpuExecutor::with_options(
                    c,
                    GpuOptions {
                        poison_outputs: true,
                        matmul_tile: Some(128),
                        ..Default::default()
                    },
                )
            })
        })
        .as_ref()
}

pub fn ctx() -> Option<Arc<GpuContext>> {
    CTX.get_or_init(init).clone()
}

/// A device of the caller's own on [`ctx`]'s adapter, for a test with many
/// kernels of its own. lavapipe compiles a kernel when a submission first
/// runs it, one submission at a time per device, so tests on [`ctx`]'s
/// device compile one after another whatever the test threads; on devices
/// of their own they compile side by side (on CI's 2 cores, with an empty
/// shader cache, 2026-11-27: attention_f16 in 215 s instead of 437, f16 in
/// 103 instead of 188; both took far less once the emulated fragments kept
/// their loop rolled, 2026-12-02: `emu_k` in shaders/matmul_coop.wgsl).
pub fn own_ctx() -> Option<Arc<GpuContext>> {
    ctx()?;
    Some(GpuContext::new().expect("a second device on the adapter that ctx() opened"))
}

/// The shared executor, with NaN-poisoned outputs; `None` means skip.
pub fn gpu() -> Option<&'static GpuExecutor> {
    GPU.get_or_init(|| {
        ctx().map(|c| {
            GpuExecutor::with_options(
                c,
                GpuOptions {
                    poison_outputs: true,
                    ..Default::default()
                },
            )
        })
    })
    .as_ref()
}

/// An executor whose storage bindings are capped at 4 KiB, so that small
/// tensors take the multi-range paths that big ones take on a real device.
pub fn gpu_small_bindings() -> Option<&'static GpuExecutor> {
    SMALL
        .get_or_init(|| {
            ctx().map(|c| {
                GpuExecutor::with_options(
                    c,
                    GpuOptions {
                        poison_outputs: true,
                        max_binding_bytes: Some(4096),
                        ..Default::default()
                    },
                )
            })
        })
        .as_ref()
}

/// A fresh executor with `opts` (outputs poisoned, so a kernel that skips
/// an element shows) at `precision`; `None` without an adapter.
pub fn gpu_with(opts: GpuOptions, precision: ComputePrecision) -> Option<GpuExecutor> {
    let mut g = GpuExecutor::with_options(
        ctx()?,
        GpuOptions {
            poison_outputs: true,
            ..opts
        },
    );
    g.set_compute_precision(precision).unwrap();
    Some(g)
}

/// The f16 SIMT kernel on its 128 tile (interior pipelines and edges)
/// whatever the shape: the f16 path of adapters without tensor cores.
pub fn simt128_f16() -> Option<GpuExecutor> {
    let simt = GpuOptions {
        f16_matmul: megatrain_gpu::F16Matmul::Simt,
        matmul_tile: Some(128),
        ..Default::default()
    };
    gpu_with(simt, ComputePrecision::F16)
}

/// An f16 executor on each hardware tensor-core tile, or none (with a
/// notice naming `what`) where the adapter has no cooperative matrices.
pub fn hardware_tiles(what: &str) -> Vec<(megatrain_gpu::CoopTile, GpuExecutor)> {
    if !ctx().is_some_and(|c| c.has_cooperative_matrix()) {
        eprintln!("no cooperative matrices: hardware tensor-core {what} NOT tested here");
        return Vec::new();
    }
    megatrain_gpu::CoopTile::ALL
        .into_iter()
        .map(|tile| {
            let opts = GpuOptions {
                f16_matmul: megatrain_gpu::F16Matmul::Coop(tile),
                ..Default::default()
            };
            (tile, gpu_with(opts, ComputePrecision::F16).expect("adapter"))
        })
        .collect()
}

pub fn cpu() -> CpuExecutor {
    CpuExecutor::new()
}

pub fn rand_host(seed: u64, shape: &[usize]) -> HostTensor {
    let shape = Shape::new(shape.to_vec());
    HostTensor::from_f32(shape.clone(), random_f32(seed, shape.numel())).unwrap()
}

pub fn down(g: &GpuExecutor, t: &GpuTensor) -> Vec<f32> {
    g.download(t).unwrap().to_f32_vec()
}

pub fn down_cpu(c: &CpuExecutor, t: &<CpuExecutor as Executor>::Tensor) -> Vec<f32> {
    c.download(t).unwrap().to_f32_vec()
}

/// Fails unless `got` is as long as `want` and has no NaN or infinity (an
/// unwritten, poisoned element, or an overflow).
pub fn assert_written(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} is {} (unwritten or overflow)", got[i]);
    }
}

/// Fails on any NaN (an unwritten, poisoned element) or a relative error
/// above `tol`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_written(what, got, want);
    let err = rel_norm_err(got, want);
    assert!(err <= tol, "{what}: relative error {err:e} > {tol:e}");
}

/// As [`assert_close`], but the error is judged against the larger of the
/// result's norm and `terms`, the norm of the terms the result is a
/// difference of. Where those cancel (gelu's 1 + tanh at a large negative
/// x: a one-element tensor's whole value may lie in the rounding of the
/// two, and the CPU's and the GPU's tanh round differently), the error
/// relative to the result says nothing of the kernel.
pub fn assert_close_terms(what: &str, got: &[f32], want: &[f32], terms: f64, tol: f64) {
    assert_written(what, got, want);
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let err = norm(&mut got.iter().zip(want).map(|(&a, &b)| a as f64 - b as f64));
    let scale = norm(&mut want.iter().map(|&x| x as f64)).max(terms);
    let rel = err / scale.max(f64::MIN_POSITIVE);
    assert!(
        rel <= tol,
        "{what}: error {rel:e} of its size and its terms' > {tol:e}"
    );
}

/// ‖a ∘ b‖·k: the norm of the elementwise products of `a` and `b`, times `k`.
pub fn product_norm(a: &[f32], b: &[f32], k: f64) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 * y as f64 * k).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// A norm's dx is a difference of near-equal terms (with one column,
/// rmsnorm's is w·dy·rstd·eps/(x²+eps)), so no f32 executor holds it to a
/// fixed bound relative to itself. Its error is judged against the size of
/// the terms instead: ‖got − float64‖ within `TOL_F32` of ‖rstd·w·dy‖ (row
/// by row), where any f32 summation order lands, while a wrong term is off
/// by a fair fraction of it.
pub fn assert_dx_close(what: &str, got: &[f32], exact: &[f32], rstd: &[f32], w: &[f32], dy: &[f32]) {
    assert_written(what, got, exact);
    let cols = w.len();
    let terms: f64 = dy
        .iter()
        .enumerate()
        .map(|(e, &d)| (rstd[e / cols] as f64 * w[e % cols] as f64 * d as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let err: f64 = got
        .iter()
        .zip(exact)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let rel = err / terms.max(f64::MIN_POSITIVE);
    assert!(rel <= TOL_F32, "{what}: {rel:e} of its terms' size from float64");
}
