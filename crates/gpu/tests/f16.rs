//! The F16 compute precision on the GPU (crates/tensor/src/precision.rs)
//! against a host reference built here: each operand scaled by 2^-e from
//! its own max|x|, rounded to f16 (half's nearest-even), and — forward — an
//! f64 product scaled back; backward, the CPU executor's f32 products of
//! those exactly representable operands. Every layout the step uses
//! (transposes, batched and shared B, the chunked accumulate path), f32 and
//! f16-stored B, on the SIMT kernel everywhere and on each tensor-core tile
//! where the adapter has cooperative matrices. The tensor-core kernels'
//! own code (staging, fragment offsets, double buffering, interior and edge
//! pipelines, epilogue) also runs everywhere with the cooperative-matrix
//! operations emulated in plain WGSL, on the tiles whose emulation fits
//! 32 KiB of workgroup memory.

mod common;

use std::sync::{Arc, OnceLock};

use common::matmul_case::{Case, abs_terms, case, interior_cases, operands};
use common::*;
use megatrain_gpu::{CoopProbe, CoopTile, F16Matmul, F16Operands, GpuContext, GpuExecutor, GpuOptions};
use megatrain_tensor::{
    ComputePrecision, DType, Executor, HostTensor, MatmulNeeds, Shape, Transpose, f16, f16_scale_exponent,
};
use proptest::prelude::*;

/// Far below the f16 rounding the reference shares with the kernel (2^-11):
/// what is left is f32 accumulation against f64.
const TOL: f64 = 1e-5;

fn f16_executor(ctx: Arc<GpuContext>, opts: GpuOptions) -> GpuExecutor {
    let mut g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            ..opts
        },
    );
    g.set_compute_precision(ComputePrecision::F16).unwrap();
    g
}

static SIMT: OnceLock<Option<GpuExecutor>> = OnceLock::new();
static SIMT_SMALL: OnceLock<Option<GpuExecutor>> = OnceLock::new();
static SIMT_BIG: OnceLock<Option<GpuExecutor>> = OnceLock::new();

/// The SIMT f16 kernel, whatever the adapter has.
fn simt(which: usize) -> Option<&'static GpuExecutor> {
    let (cell, opts) = match which {
        0 => (&SIMT, GpuOptions::default()),
        1 => (
            &SIMT_SMALL,
            GpuOptions {
                max_binding_bytes: Some(4096),
                ..Default::default()
            },
        ),
        _ => (
            &SIMT_BIG,
            GpuOptions {
                matmul_tile: Some(128),
                ..Default::default()
            },
        ),
    };
    cell.get_or_init(|| {
        ctx().map(|c| {
            f16_executor(
                c,
                GpuOptions {
                    f16_matmul: F16Matmul::Simt,
                    ..opts
                },
            )
        })
    })
    .as_ref()
}

/// An executor on tensor-core tile `t`, or `None` (with a notice) where the
/// adapter has no cooperative matrices.
fn coop(t: CoopTile) -> Option<GpuExecutor> {
    coop_with(t, GpuOptions::default())
}

fn coop_with(t: CoopTile, opts: GpuOptions) -> Option<GpuExecutor> {
    let c = ctx()?;
    if !c.has_cooperative_matrix() {
        eprintln!(
            "adapter '{}' has no 16x16x16 f16 cooperative matrices: tensor-core kernel {} NOT tested here",
            c.info.name,
            t.name()
        );
        return None;
    }
    Some(f16_executor(
        c,
        GpuOptions {
            f16_matmul: F16Matmul::Coop(t),
            ..opts
        },
    ))
}

/// x scaled, rounded to f16 and scaled back, per tensor: the value the
/// kernels multiply (exact in f32 for any operand in f32's normal range).
fn quantize(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = f16_scale_exponent(max);
    x.iter()
        .map(|&v| (f16::from_f64(v as f64 * 2f64.powi(-e)).to_f64() * 2f64.powi(e)) as f32)
        .collect()
}

fn quantized(h: &HostTensor) -> HostTensor {
    HostTensor::from_f32(h.shape().clone(), quantize(&h.to_f32_vec())).unwrap()
}

/// op(A) @ op(B) (+ bias) in f64, batched over A's leading dims, B shared
/// when it is 2-D.
fn product_f64(a: &HostTensor, b: &HostTensor, bias: Option<&[f32]>, t: Transpose) -> Vec<f32> {
    let (ad, bd) = (a.dims(), b.dims());
    let (r0, r1) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (m, k) = if t.a { (r1, r0) } else { (r0, r1) };
    let n = if t.b { bd[bd.len() - 2] } else { bd[bd.len() - 1] };
    let batch: usize = ad[..ad.len() - 2].iter().product();
    let shared = bd.len() == 2;
    let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
    let mut out = Vec::with_capacity(batch * m * n);
    for z in 0..batch {
        let ao = z * m * k;
        let bo = if shared { 0 } else { z * k * n };
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    let x = av[ao + if t.a { p * m + i } else { i * k + p }] as f64;
                    let y = bv[bo + if t.b { j * k + p } else { p * n + j }] as f64;
                    s += x * y;
                }
                out.push((s + bias.map_or(0.0, |b| b[j] as f64)) as f32);
            }
        }
    }
    out
}

/// Forward (against the f64 reference) and both backward products (against
/// the CPU on quantized operands) of one case; `scale` multiplies A and
/// dout so that magnitudes far from 1 are exercised.
fn check(g: &GpuExecutor, c: &Case, b_dtype: DType, scale: f32) {
    let (a, b, bias, dout) = operands(c);
    let scaled = |h: HostTensor| {
        HostTensor::from_f32(
            h.shape().clone(),
            h.to_f32_vec().iter().map(|x| x * scale).collect(),
        )
        .unwrap()
    };
    let a = scaled(a);
    let b = b.to_dtype(b_dtype);
    let dout = scaled(dout);
    let b32 = b.to_dtype(DType::F32);
    let (qa, qb, qd) = (quantized(&a), quantized(&b32), quantized(&dout));

    let (ga, gb, gbias, gd) = (
        g.upload(&a).unwrap(),
        g.upload(&b).unwrap(),
        g.upload(&bias).unwrap(),
        g.upload(&dout).unwrap(),
    );
    let bias_v = bias.to_f32_vec();
    let cpu = cpu();
    // Judged against the size of the terms each element sums
    // (`matmul.rs`'s check says why).
    let terms = abs_terms(&cpu, c, [&qa, &qb, &bias, &qd]);
    let y = g.matmul(&ga, &gb, c.bias.then_some(&gbias), c.t).unwrap();
    let want = product_f64(&qa, &qb, c.bias.then_some(&bias_v[..]), c.t);
    assert_close_terms(
        &format!("f16 matmul {c:?} b {b_dtype}"),
        &down(g, &y),
        &want,
        terms[0],
        TOL,
    );

    let (ca, cb, cd) = (
        cpu.upload(&qa).unwrap(),
        cpu.upload(&qb).unwrap(),
        cpu.upload(&qd).unwrap(),
    );
    let gr = g.matmul_backward(&ga, &gb, &gd, c.t, MatmulNeeds::ALL).unwrap();
    let rr = cpu.matmul_backward(&ca, &cb, &cd, c.t, MatmulNeeds::ALL).unwrap();
    for (what, got, want, terms) in [("da", &gr.da, &rr.da, terms[1]), ("db", &gr.db, &rr.db, terms[2])] {
        assert_close_terms(
            &format!("f16 {what} {c:?} b {b_dtype}"),
            &down(g, got.as_ref().unwrap()),
            &down_cpu(&cpu, want.as_ref().unwrap()),
            terms,
            TOL,
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn simt_f16_matches_host_reference(c in case(70, 3)) {
        let Some(g) = simt(0) else { return Ok(()) };
        check(g, &c, DType::F32, 1.0);
        check(g, &c, DType::F16, 1.0);
    }

    #[test]
    fn simt_f16_128_tile_and_binding_ranges(c in case(150, 3)) {
        if let Some(g) = simt(2) {
            check(g, &c, DType::F32, 3.0);
            check(g, &c, DType::BF16, 1.0);
        }
        if let Some(g) = simt(1) {
            check(g, &c, DType::F32, 0.25);
            check(g, &c, DType::F16, 1.0);
        }
    }
}

/// The SIMT interior pipelines round their operands as the checked kernel
/// does (f32, bf16 and f16 B; the scales of the f16 precision).
#[test]
fn simt_f16_interior_tiles_match_host_reference() {
    let Some(g) = simt(2) else { return };
    for c in interior_cases() {
        check(g, &c, DType::F32, 3.0);
        check(g, &c, DType::BF16, 1.0);
        check(g, &c, DType::F16, 0.5);
    }
}

/// The layouts and shapes the tensor-core checks run: whole tiles, M and N
/// edges, K a multiple of the K step or not, all four transposes, batched
/// and shared B, bias or not.
fn coop_cases() -> Vec<Case> {
    let shapes = [(64, 128, 64), (96, 160, 48), (70, 45, 37), (5, 7, 3)];
    let mut v = Vec::new();
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for (j, t) in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT]
            .into_iter()
            .enumerate()
        {
            v.push(Case {
                batch: if (i + j) % 3 == 0 { vec![2] } else { vec![] },
                m,
                n,
                k,
                t,
                shared_b: j % 2 == 0,
                bias: i % 2 == 0,
                seed: (i * 4 + j) as u64,
            });
        }
    }
    v
}

/// Every case of `coop_cases` on emulated tile `tile`, on a device of its
/// own (`own_ctx`), so that the tiles' kernels compile side by side.
fn emulated_tile_matches_host_reference(tile: CoopTile) {
    let Some(c) = own_ctx() else { return };
    let g = f16_executor(
        c,
        GpuOptions {
            f16_matmul: F16Matmul::CoopEmulated(tile),
            ..Default::default()
        },
    );
    for case in coop_cases() {
        check(&g, &case, DType::F32, 1.0);
        // f16 B is a weight: never the transposed-A side of a product.
        if !case.t.a {
            check(&g, &case, DType::F16, 1.0);
        }
    }
    check_rounding(&g, &format!("{}_sw", tile.name()));
}

#[test]
fn emulated_tensor_core_kernels_match_host_reference_simple64() {
    emulated_tile_matches_host_reference(CoopTile::Simple64);
}

#[test]
fn emulated_tensor_core_kernels_match_host_reference_small64() {
    emulated_tile_matches_host_reference(CoopTile::Small64);
}

#[test]
fn emulated_tensor_core_kernels_match_host_reference_small16x64() {
    emulated_tile_matches_host_reference(CoopTile::Small16x64);
}

/// Tile shapes written out (`coop_tile.rs`), emulated as the named tiles
/// are: the prefetching K loop (one buffer, the next step's loads in
/// flight), and workgroups walking two tile rows before the next column
/// (`coop_cases`' 96 rows are three: the last group is short).
#[test]
fn emulated_tensor_core_kernels_match_host_reference_prefetch_g2() {
    emulated_tile_matches_host_reference(CoopTile::parse("coop32x32x32_2x1_prefetch_g2").unwrap());
}

/// Workgroups walking three tile rows (`coop_cases`' 64 rows are four,
/// its 96 six) on the double-buffered loop, and on the edge strips.
#[test]
fn emulated_tensor_core_kernels_match_host_reference_double_g3() {
    emulated_tile_matches_host_reference(CoopTile::parse("coop16x64x16_1x2_double_g3").unwrap());
}

/// `F16Matmul::Auto` takes the default tensor-core tile only once it has
/// matched the SIMT kernel on the device (`exec/matmul_check.rs`): where
/// the adapter has cooperative matrices the check runs on first asking and
/// passes (the tile is right here), and nothing is refused; elsewhere
/// Auto is the SIMT kernel and nothing is checked.
#[test]
fn auto_takes_the_default_tile_once_it_matches_the_simt_kernel() {
    let Some(c) = own_ctx() else { return };
    let g = f16_executor(c.clone(), GpuOptions::default());
    let kernel = g.f16_matmul_kernel();
    assert_eq!(c.coop_matmul_refused(), vec![]);
    if c.has_cooperative_matrix() {
        assert_eq!(kernel, F16Matmul::Coop(CoopTile::DEFAULT));
        let tile = format!("matmul {}", CoopTile::DEFAULT.name());
        assert!(g.name().contains(&tile), "{}", g.name());
    } else {
        assert_eq!(kernel, F16Matmul::Simt);
    }
}

/// Every shape the matmul bench sweeps (`CoopTile::SWEEP`), where the
/// adapter has cooperative matrices: whole tiles in groups of tile rows
/// (five rows of 128: a short group), M and N edges, K not a multiple of
/// the K step, three layouts, f32 and f16 B.
#[test]
fn swept_tile_shapes_match_host_reference() {
    for name in CoopTile::SWEEP {
        let Some(g) = coop(CoopTile::parse(name).unwrap()) else {
            return;
        };
        for (i, &(m, n, k)) in [(640, 384, 128), (300, 260, 100)].iter().enumerate() {
            for (j, t) in [Transpose::NN, Transpose::NT, Transpose::TN]
                .into_iter()
                .enumerate()
            {
                let c = Case {
                    batch: if i == 1 && j == 0 { vec![2] } else { vec![] },
                    m,
                    n,
                    k,
                    t,
                    shared_b: false,
                    bias: j == 1,
                    seed: 200 + (i * 3 + j) as u64,
                };
                check(&g, &c, DType::F32, 1.0);
                check(&g, &c, DType::F16, 1.0);
            }
        }
        eprintln!("{name}: matches");
    }
}

/// Operands bound as several ranges (the chunked path, accumulating K
/// blocks into C), on one emulated tile.
#[test]
fn emulated_tensor_core_kernels_match_host_reference_chunked() {
    let Some(c) = own_ctx() else { return };
    let g = f16_executor(
        c,
        GpuOptions {
            f16_matmul: F16Matmul::CoopEmulated(CoopTile::Small64),
            max_binding_bytes: Some(16 << 10),
            ..Default::default()
        },
    );
    for case in coop_cases().into_iter().filter(|c| c.m == 96) {
        check(&g, &case, DType::F32, 1.0);
        check(&g, &case, DType::F16, 1.0);
    }
}

#[test]
fn tensor_core_kernels_match_host_reference() {
    // Whole tiles, M and N edges, K a multiple of the K step or not, all
    // four transposes, batched and shared B, f32 and f16 B.
    let shapes = [
        (256, 256, 64),
        (200, 300, 96),
        (129, 257, 100),
        (64, 33, 17),
        (5, 7, 3),
    ];
    for tile in CoopTile::ALL {
        let Some(g) = coop(tile) else { continue };
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            for (j, t) in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT]
                .into_iter()
                .enumerate()
            {
                let c = Case {
                    batch: if (i + j) % 3 == 0 { vec![2] } else { vec![] },
                    m,
                    n,
                    k,
                    t,
                    shared_b: j % 2 == 0,
                    bias: i % 2 == 0,
                    seed: (i * 4 + j) as u64,
                };
                check(&g, &c, DType::F32, 1.0);
                check(&g, &c, DType::F16, 1.0);
            }
        }
        // Operands bound as several ranges: the chunked path, which also
        // accumulates K blocks into C.
        let small = coop_with(
            tile,
            GpuOptions {
                max_binding_bytes: Some(64 << 10),
                ..Default::default()
            },
        )
        .expect("adapter checked above");
        for (j, t) in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT]
            .into_iter()
            .enumerate()
        {
            let c = Case {
                batch: vec![2],
                m: 200,
                n: 300,
                k: 96,
                t,
                shared_b: j < 2,
                bias: true,
                seed: 100 + j as u64,
            };
            check(&small, &c, DType::F32, 1.0);
            check(&small, &c, DType::F16, 1.0);
        }
    }
}

/// The timing probes (`CoopProbe`, the matmul bench's
/// `MEGATRAIN_COOP_PROBE`) time the kernel's own fragments, staging and
/// multiply-adds: over one K step the probes that stage the operands once
/// (all but `Mma`, and `Mma` too where the K step is one fragment) give the
/// real kernel's product bit for bit, and over two steps every probe gives
/// another (it reads the first step's operands again), so none is the real
/// loop in disguise. On the hardware's fragments where the adapter has
/// cooperative matrices, else on the emulated ones (lavapipe in CI); naga
/// and spirv-val check every probe's hardware variant in CI
/// (`coop_naga.rs`, `spirv_val.rs`).
#[test]
fn timing_probes_run_the_kernels_own_fragments() {
    let Some(c) = own_ctx() else { return };
    let hardware = c.has_cooperative_matrix();
    // The default tile (a K step of two fragments, as the bench runs it)
    // and one whose K step is one fragment.
    for tile in [CoopTile::DEFAULT, CoopTile::Small64] {
        let on = |probe| {
            let kind = if hardware {
                F16Matmul::Coop(tile)
            } else {
                F16Matmul::CoopEmulated(tile)
            };
            f16_executor(
                c.clone(),
                GpuOptions {
                    f16_matmul: kind,
                    coop_probe: probe,
                    ..Default::default()
                },
            )
        };
        let s = tile.shape();
        let (m, n, bk) = (2 * s.bm as usize, 2 * s.bn as usize, s.bk as usize);
        let real = on(None);
        let product = |g: &GpuExecutor, k: usize| {
            let a = g.upload(&rand_host(1, &[m, k])).unwrap();
            let b = g.upload(&rand_host(2, &[k, n])).unwrap();
            let y = g.matmul(&a, &b, None, Transpose::NN).unwrap();
            g.download(&y).unwrap().to_f32_vec()
        };
        let (one, two) = (product(&real, bk), product(&real, 2 * bk));
        for probe in CoopProbe::ALL {
            let g = on(Some(probe));
            let what = format!("{} {}", tile.name(), probe.name());
            let got = product(&g, bk);
            assert!(got.iter().all(|x| x.is_finite()), "{what}: a value not finite");
            let same = got.iter().zip(&one).all(|(x, y)| x.to_bits() == y.to_bits());
            let staged_once = probe != CoopProbe::Mma || bk == 16;
            assert_eq!(same, staged_once, "{what}: one K step the real product's bits");
            let got = product(&g, 2 * bk);
            assert!(got != two, "{what}: two K steps gave the real product");
        }
    }
}

/// `c`'s operands with elements whose scaled values are f16 subnormals
/// (every 7th, at 1e-9 of the rest) or below f16 entirely (every 11th).
fn operands_with_tiny(c: &Case) -> [HostTensor; 3] {
    let (a, b, _, dout) = operands(c);
    [a, b, dout].map(|h| {
        let v = h.to_f32_vec().into_iter().enumerate();
        let v = v.map(|(i, x)| match (i % 7, i % 11) {
            (0, _) => x * 1e-9,
            (_, 0) => x * 1e-13,
            _ => x,
        });
        HostTensor::from_f32(h.shape().clone(), v.collect()).unwrap()
    })
}

/// Case `c`'s forward and both backward products on `g`, as bits.
fn product_bits(g: &GpuExecutor, c: &Case, b_dtype: DType) -> Vec<Vec<u32>> {
    let [a, b, dout] = operands_with_tiny(c);
    let (ga, gb, gd) = (
        g.upload(&a).unwrap(),
        g.upload(&b.to_dtype(b_dtype)).unwrap(),
        g.upload(&dout).unwrap(),
    );
    let y = g.matmul(&ga, &gb, None, c.t).unwrap();
    let r = g.matmul_backward(&ga, &gb, &gd, c.t, MatmulNeeds::ALL).unwrap();
    [Some(y), r.da, r.db]
        .iter()
        .map(|t| down(g, t.as_ref().unwrap()).iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The f16 operand copies (`F16Operands::Copy`, the default) give the
/// products' bits exactly as the kernels converting f32 operands as they
/// stage them (`Stage`): forward and both backward products, every case of
/// `coop_cases` (layouts, edges, batches), f32 and f16 B, operands with
/// f16-subnormal elements, and the chunked path; on an emulated tile
/// everywhere and on every real tile where the adapter has them.
#[test]
fn operand_copies_give_the_bits_of_staging() {
    // A device of its own: its emulated kernels compile beside the others'.
    let Some(c) = own_ctx() else { return };
    let with = |f16_matmul, f16_operands, max_binding_bytes| {
        f16_executor(
            c.clone(),
            GpuOptions {
                f16_matmul,
                f16_operands,
                max_binding_bytes,
                ..Default::default()
            },
        )
    };
    let mut families = vec![(F16Matmul::CoopEmulated(CoopTile::Small64), None)];
    families.push((F16Matmul::CoopEmulated(CoopTile::Small64), Some(16 << 10)));
    if c.has_cooperative_matrix() {
        families.extend(CoopTile::ALL.map(|t| (F16Matmul::Coop(t), None)));
        families.push((F16Matmul::Coop(CoopTile::DEFAULT), Some(64 << 10)));
    }
    for (family, binding) in families {
        let (copy, stage) = (
            with(family, F16Operands::Copy, binding),
            with(family, F16Operands::Stage, binding),
        );
        for case in coop_cases() {
            let b_dtypes: &[DType] = if case.t.a {
                &[DType::F32]
            } else {
                &[DType::F32, DType::F16]
            };
            for &dt in b_dtypes {
                let before = copy.operand_f16_copies();
                let got = product_bits(&copy, &case, dt);
                assert!(copy.operand_f16_copies() > before, "{family}: no copy was made");
                assert_eq!(stage.operand_f16_copies(), 0);
                for (what, (g, w)) in ["y", "da", "db"]
                    .iter()
                    .zip(got.iter().zip(&product_bits(&stage, &case, dt)))
                {
                    assert!(
                        g == w,
                        "{family} (binding {binding:?}) {case:?} b {dt}: {what} differs from staging's"
                    );
                }
            }
        }
    }
}

/// The f16 copy itself (one kernel, whatever the matmul family): each
/// element scaled by its tensor's power of two and rounded to the nearest
/// f16 (ties to even, subnormals kept, values below f16 to zero), bit for
/// bit against half's conversion; awkward lengths (odd, one element, past
/// a workgroup) and one split over several bindings at an odd element
/// count; remembered, so a second call makes no copy.
#[test]
fn operand_copy_rounds_each_element_to_nearest_even() {
    let Some(c) = ctx() else { return };
    let (rounding, _) = rounding_case();
    for binding in [None, Some(4096)] {
        let g = f16_executor(
            c.clone(),
            GpuOptions {
                max_binding_bytes: binding,
                ..Default::default()
            },
        );
        let lengths = [1, 2, 3, 5, 257, rounding.len(), 5001];
        for (i, n) in lengths.into_iter().enumerate() {
            let mut x = megatrain_tensor::testing::random_f32(50 + i as u64, n);
            let tail = rounding.len().min(n);
            x[n - tail..].copy_from_slice(&rounding[..tail]);
            let gx = g
                .upload(&HostTensor::from_f32(Shape::new([n]), x.clone()).unwrap())
                .unwrap();
            let copy = g.f16_operand(&gx).unwrap();
            assert_eq!(megatrain_tensor::TensorHandle::dtype(&copy), DType::F16);
            let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let e = f16_scale_exponent(max);
            let got = down(&g, &copy);
            for (j, (&got, &x)) in got.iter().zip(&x).enumerate() {
                let want = f16::from_f64(x as f64 * 2f64.powi(-e));
                assert!(
                    f16::from_f32(got).to_bits() == want.to_bits(),
                    "binding {binding:?} n {n}: element {j} ({x:e}) copied as {got:e}, want {want}"
                );
            }
            let made = g.operand_f16_copies();
            g.f16_operand(&gx).unwrap();
            assert_eq!(g.operand_f16_copies(), made, "the copy is remembered");
        }
    }
}

/// The copy's conversion itself over every f32 exponent, both signs, and
/// the significands where rounding decides (the bits just below, at and
/// above each tie, all ones, carries into the exponent, and the ties of
/// every f16 subnormal quantum), against half's nearest-even conversion
/// bit for bit. An infinity in the tensor sets its scale to 2^0, so the
/// values are converted as they are: overflow to infinity, NaN to the
/// quiet 0x7e00 with its sign, f32 subnormals to zero.
#[test]
fn operand_copy_converts_every_exponent_and_tie_as_half_does() {
    let Some(c) = ctx() else { return };
    let g = f16_executor(c, GpuOptions::default());
    let mut x = vec![f32::INFINITY];
    for sign in [0u32, 0x8000_0000] {
        for e in 0u32..256 {
            let mut mantissas: Vec<u32> = vec![
                0, 1, 0x7f_ffff, 0x40_0000, 0x7f_e000, 0x7f_f000, 0x7f_efff, 0x7f_f001,
            ];
            // Ties of the normal f16 quantum (13 bits dropped), even and odd.
            for m in [0x1000u32, 0x3000, 0x5000, 0x7f_d000, 0x7f_f000] {
                mantissas.extend([m - 1, m, m + 1]);
            }
            // Ties of the subnormal quantum 2^-24: d = 126 - e bits dropped.
            if (102..113).contains(&e) {
                let d = 126 - e;
                for q in [0u32, 1, 2, 3] {
                    let tie = ((q << d) | (1 << (d - 1))) & 0x7f_ffff;
                    mantissas.extend([tie.saturating_sub(1), tie, tie + 1]);
                }
            }
            mantissas.extend(
                megatrain_tensor::testing::random_f32(e as u64, 4)
                    .iter()
                    .map(|v| v.to_bits() & 0x7f_ffff),
            );
            x.extend(
                mantissas
                    .into_iter()
                    .map(|m| f32::from_bits(sign | e << 23 | (m & 0x7f_ffff))),
            );
        }
    }
    let n = x.len();
    let gx = g
        .upload(&HostTensor::from_f32(Shape::new([n]), x.clone()).unwrap())
        .unwrap();
    let got = g.download(&g.f16_operand(&gx).unwrap()).unwrap();
    let got: &[u16] = bytemuck::cast_slice(got.data().as_bytes());
    for (j, (&got, &x)) in got.iter().zip(&x).enumerate() {
        let want = match x.is_nan() {
            true => (x.to_bits() >> 16) as u16 & 0x8000 | 0x7e00,
            false => f16::from_f32(x).to_bits(),
        };
        assert_eq!(
            got,
            want,
            "element {j}: {x:e} ({:#010x}) copied as {got:#06x}, want {want:#06x}",
            x.to_bits()
        );
    }
}

/// Elements whose scaled values are f16 ties, halfway cases below f16's
/// normal range and random values, as a [n, 1] A times B = [[1]]: each
/// output is one rounded element, compared exactly with half's
/// nearest-even rounding (the kernel's own max|x| sets the scale).
fn rounding_case() -> (Vec<f32>, Vec<f32>) {
    // max|x| = 1 makes e = -14: x is scaled by 2^14.
    let s = 2f32.powi(-14);
    let mut a = vec![1.0f32, -1.0];
    for i in 0..64 {
        // 1 + (2i+1)·2^-11: halfway between neighbours of f16's [1, 2).
        a.push((1.0 + (2 * i + 1) as f32 * 2f32.powi(-11)) * s);
        a.push(-(1.0 + (2 * i + 1) as f32 * 2f32.powi(-11)) * s);
        // Halfway between f16 subnormals (quantum 2^-24).
        a.push((2 * i + 1) as f32 * 2f32.powi(-25) * s);
        // Just above and below such a tie.
        a.push(((2 * i + 1) as f32 * 2f32.powi(-25) * (1.0 + 2f32.powi(-20))) * s);
        a.push(((2 * i + 1) as f32 * 2f32.powi(-25) * (1.0 - 2f32.powi(-20))) * s);
    }
    // 2^-25 exactly (ties to 0), just above it (to 2^-24), below f16 entirely.
    a.extend([2f32.powi(-25) * s, 2f32.powi(-25) * 1.0001 * s, 1e-12, -3e-13]);
    a.extend(megatrain_tensor::testing::random_f32(3, 300));
    let want = a.iter().map(|&x| f16::from_f32(x / s).to_f32() * s).collect();
    (a, want)
}

fn check_rounding(g: &GpuExecutor, what: &str) {
    let (a, want) = rounding_case();
    let n = a.len();
    let ga = g
        .upload(&HostTensor::from_f32(Shape::new([n, 1]), a).unwrap())
        .unwrap();
    let gb = g
        .upload(&HostTensor::from_f32(Shape::new([1, 1]), vec![1.0]).unwrap())
        .unwrap();
    let got = down(g, &g.matmul(&ga, &gb, None, Transpose::NN).unwrap());
    for i in 0..n {
        // Equal as floats: the sign of a zero is the accumulator's (0 + -0).
        assert!(
            got[i] == want[i],
            "{what}: element {i}: got {:e}, want {:e}",
            got[i],
            want[i]
        );
    }
}

#[test]
fn operands_round_to_nearest_even_bit_for_bit() {
    if let Some(g) = simt(0) {
        check_rounding(g, "simt");
    }
    for tile in CoopTile::ALL {
        if let Some(g) = coop(tile) {
            check_rounding(&g, &tile.name());
        }
    }
}

/// Operands far outside f16's range (A ~ 1e-30, B ~ 1e25; their product is
/// ordinary): per-tensor scaling keeps every mantissa bit f16 has. Without
/// it A would round to zero and B to infinity — the reference without
/// scaling is checked to be far off, so this test would catch a kernel that
/// skipped the scaling. Then the scalings that take more than one power of
/// two in f32 (the kernels' slow path, `Pow2Steps::one` false): A ~ 1e-36
/// is scaled up by 2^134, and 1e-28 · 1e-12 brings the product back down
/// by 2^-161, into f32's subnormals.
///
/// WGSL lets an implementation flush f32 subnormals to zero, and some do
/// (Mesa 26's lavapipe flushes them in and out of every operation; Mesa
/// 22's keeps them): where the adapter flushes, the reference is what
/// flushing gives, the subnormal elements of A ~ 1e-36 and of the last
/// case's products taken as 0.
#[test]
fn huge_and_tiny_operands_keep_f16_precision() {
    let Some(c) = ctx() else { return };
    let flushes = flushes_subnormals(c);
    if flushes {
        eprintln!("this adapter flushes f32 subnormals: so does the reference");
    }
    for (sa, sb) in [(1e-30f32, 1e25f32), (1e-36, 1e31), (1e-28, 1e-12)] {
        scaled_operands_keep_f16_precision(sa, sb, flushes);
    }
}

/// Whether the adapter's f32 arithmetic flushes subnormals: an f32 product
/// with the identity that should give them back.
fn flushes_subnormals(ctx: Arc<GpuContext>) -> bool {
    let tiny = [1e-39f32, -3e-40, 1e-41, 5e-45];
    let eye = [1.0f32, 0.0, 0.0, 1.0];
    let g = GpuExecutor::new(ctx);
    let up = |v: &[f32]| {
        g.upload(&HostTensor::from_f32(Shape::new([2, 2]), v.to_vec()).unwrap())
            .unwrap()
    };
    let y = g.matmul(&up(&tiny), &up(&eye), None, Transpose::NN).unwrap();
    let got = down(&g, &y);
    match got.as_slice() {
        g if g == tiny => false,
        g if g.iter().all(|&x| x == 0.0) => true,
        g => panic!("subnormals neither kept nor flushed: {tiny:?} came back as {g:?}"),
    }
}

fn flush(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| if x.abs() < f32::MIN_POSITIVE { 0.0 } else { x })
        .collect()
}

fn scaled_operands_keep_f16_precision(sa: f32, sb: f32, flushes: bool) {
    let (m, k, n) = (19, 37, 23);
    let a = rand_host(11, &[m, k])
        .to_f32_vec()
        .iter()
        .map(|x| x * sa)
        .collect::<Vec<_>>();
    let b = rand_host(12, &[k, n])
        .to_f32_vec()
        .iter()
        .map(|x| x * sb)
        .collect::<Vec<_>>();
    let (ha, hb) = (
        HostTensor::from_f32(Shape::new([m, k]), a.clone()).unwrap(),
        HostTensor::from_f32(Shape::new([k, n]), b.clone()).unwrap(),
    );
    let want = product_f64(&quantized(&ha), &quantized(&hb), None, Transpose::NN);
    // What an adapter that flushes subnormals computes, exactly as well.
    let flushed_want = || {
        let fa = HostTensor::from_f32(Shape::new([m, k]), flush(&a)).unwrap();
        flush(&product_f64(
            &quantized(&fa),
            &quantized(&hb),
            None,
            Transpose::NN,
        ))
    };
    let want_here = if flushes { flushed_want() } else { want.clone() };
    let unscaled = |x: &[f32]| x.iter().map(|&v| f16::from_f32(v).to_f32()).collect::<Vec<_>>();
    let naive = product_f64(
        &HostTensor::from_f32(Shape::new([m, k]), unscaled(&a)).unwrap(),
        &HostTensor::from_f32(Shape::new([k, n]), unscaled(&b)).unwrap(),
        None,
        Transpose::NN,
    );
    let naive_err = megatrain_tensor::testing::rel_norm_err(&naive, &want);
    assert!(
        naive_err.is_nan() || naive_err > 0.5,
        "unscaled f16 is not off: {naive_err}"
    );
    let run = |g: &GpuExecutor, what: &str| {
        let y = g
            .matmul(
                &g.upload(&ha).unwrap(),
                &g.upload(&hb).unwrap(),
                None,
                Transpose::NN,
            )
            .unwrap();
        let (got, what) = (down(g, &y), format!("{what}, A ~ {sa:e}, B ~ {sb:e}"));
        if want_here.iter().all(|&x| x == 0.0) {
            // Every product subnormal, flushed: nothing else to compare.
            assert!(
                got.iter().all(|&x| x == 0.0),
                "{what}: flushed products are not 0"
            );
        } else {
            assert_close(&what, &got, &want_here, TOL);
        }
    };
    if let Some(g) = simt(0) {
        run(g, "simt");
        let emulated = GpuOptions {
            f16_matmul: F16Matmul::CoopEmulated(CoopTile::Small64),
            ..Default::default()
        };
        run(&f16_executor(ctx().unwrap(), emulated), "emulated tensor cores");
    }
    for tile in CoopTile::ALL {
        if let Some(g) = coop(tile) {
            run(&g, &tile.name());
        }
    }
}

/// f16 weights holding f16 subnormals (|w| < 2^-14) are used exactly: the
/// kernels widen f16 without flushing.
#[test]
fn f16_weights_keep_subnormals() {
    let k = 8;
    let w: Vec<f32> = (0..k * 3)
        .map(|i| [3e-7f32, -5.9e-8, 1e-5, 0.5][i % 4] * (1 + i % 5) as f32)
        .collect();
    let wt = HostTensor::from_f32(Shape::new([k, 3]), w)
        .unwrap()
        .to_dtype(DType::F16);
    let eye: Vec<f32> = (0..k * k)
        .map(|i| if i % (k + 1) == 0 { 1.0 } else { 0.0 })
        .collect();
    let x = HostTensor::from_f32(Shape::new([k, k]), eye).unwrap();
    let want = wt.to_f32_vec();
    assert!(
        want.iter().any(|&v| v != 0.0 && v.abs() < 6.1e-5),
        "no subnormal in the test"
    );
    let check = |g: &GpuExecutor, what: &str| {
        let y = g
            .matmul(
                &g.upload(&x).unwrap(),
                &g.upload(&wt).unwrap(),
                None,
                Transpose::NN,
            )
            .unwrap();
        assert_eq!(down(g, &y), want, "{what}");
    };
    if let Some(g) = gpu() {
        check(g, "f32 precision");
    }
    if let Some(g) = simt(0) {
        check(g, "simt f16");
    }
    for tile in CoopTile::ALL {
        if let Some(g) = coop(tile) {
            check(&g, &tile.name());
        }
    }
}

#[test]
fn precision_is_reported_and_f32_is_unchanged() {
    let Some(c) = ctx() else { return };
    let mut g = GpuExecutor::new(c.clone());
    assert_eq!(g.compute_precision(), ComputePrecision::F32);
    g.set_compute_precision(ComputePrecision::F16).unwrap();
    assert_eq!(g.compute_precision(), ComputePrecision::F16);
    g.set_compute_precision(ComputePrecision::F32).unwrap();
    // Back to f32: operands are not rounded to f16.
    let a = HostTensor::from_f32(Shape::new([1, 1]), vec![0.1]).unwrap();
    let y = g
        .matmul(
            &g.upload(&a).unwrap(),
            &g.upload(&a).unwrap(),
            None,
            Transpose::NN,
        )
        .unwrap();
    assert_eq!(down(&g, &y), vec![0.1f32 * 0.1]);
    if !c.has_cooperative_matrix() {
        let mut forced = GpuExecutor::with_options(
            c,
            GpuOptions {
                f16_matmul: F16Matmul::Coop(CoopTile::Tile128),
                ..Default::default()
            },
        );
        assert!(forced.set_compute_precision(ComputePrecision::F16).is_err());
    }
}
