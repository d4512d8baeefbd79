//! Matmul throughput. criterion's "elements" are floating-point operations
//! (2·M·N·K per product), so its Gelem/s reads as GFLOP/s (1000 Gelem/s =
//! 1 TFLOP/s).
//!
//! Rows are named `{M}x{K}x{N}_{layout}_{b dtype}` (the f32 tiled kernel:
//! whole 128x128 tiles on its interior pipelines, edges checked),
//! `checked_…` (the same products wholly on the checked kernel, as before
//! the interior pipelines),
//! `f16_simt_…` (the same kernel rounding operands to f16) and
//! `f16_coop64_…`, `f16_coop128_…`, `f16_coop256x128_…`, `f16_coop128x256w16_…`, `f16_coop128x256_…`, `f16_coop128w4_…` (the tensor-core
//! tiles, only where the adapter has cooperative matrices, reading the f16
//! copies of f32 operands: made once per value of A and B, so outside the
//! timed loop, as a training step makes each once for several products),
//! `f16_coop128x256w16_stage_…` (the default tile converting f32 operands as it
//! stages them, `F16Operands::Stage`), and
//! `shader_checks_…` (one f32 and one f16 product compiled with wgpu's
//! runtime checks, as every kernel was before they were turned off), and
//! `f16_copy_…` (an operand's max scan and f16 copy, in bytes moved), and,
//! where `MEGATRAIN_COOP_SWEEP` names tile shapes (`default` for
//! `CoopTile::SWEEP`), `f16_sweep_{shape}_…` at 8192³ and a 7B MLP forward.
//! Where `MEGATRAIN_COOP_PROBE` names tiles (`default` for the default
//! tile), each is taken apart by its timing probes (`CoopProbe`) at 8192³
//! instead, printed as `megatrain coop probe` lines.
//! Pick rows with criterion's filter, e.g. `cargo bench -p megatrain-gpu
//! --bench matmul -- f16_coop128x256w16_8192`. Every f16 row is first checked
//! against the f32 kernel's result (relative error under f16's rounding).

mod common;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use std::cell::OnceCell;

use megatrain_gpu::{CoopProbe, CoopTile, F16Matmul, F16Operands, GpuExecutor, GpuOptions, GpuTensor};
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{ComputePrecision, DType, Executor, HostTensor, Transpose};

type Shape = (usize, usize, usize, Transpose, DType);

fn layout(t: Transpose) -> String {
    format!("{}{}", if t.a { "T" } else { "N" }, if t.b { "T" } else { "N" })
}

/// Random operands for product (m, k, n, t) with B in `dt`, on the host.
fn operands(seed: u64, (m, k, n, t, dt): Shape) -> (HostTensor, HostTensor) {
    let ad = if t.a { [k, m] } else { [m, k] };
    let bd = if t.b { [n, k] } else { [k, n] };
    (common::rand(seed, &ad), common::rand(seed + 1, &bd).to_dtype(dt))
}

/// Fails above f16's rounding against the reference product.
fn check_against(what: &str, got: &GpuTensor, g: &GpuExecutor, want: &[f32]) {
    let got = g.download(got).unwrap().to_f32_vec();
    let err = rel_norm_err(&got, want);
    assert!(err < 3e-3, "{what}: relative error {err:e} against f32");
}

/// One row per shape. Each row's operands are made, and its product first
/// checked against `reference`'s, only where criterion's filter selects
/// it (inside the row's routine, once): a GPU session's minutes are few,
/// and 8192² random operands and an f32 reference product take seconds.
fn run(c: &mut Criterion, g: &GpuExecutor, reference: Option<&GpuExecutor>, tag: &str, shapes: &[Shape]) {
    let mut group = c.benchmark_group("matmul");
    group.sample_size(10);
    for &shape in shapes {
        let (m, k, n, t, dt) = shape;
        let name = format!("{tag}{m}x{k}x{n}_{}_{dt}", layout(t));
        let setup = || {
            let (ha, hb) = operands(1, shape);
            let (a, b) = (g.upload(&ha).unwrap(), g.upload(&hb).unwrap());
            if let Some(r) = reference {
                let want = r
                    .matmul(&r.upload(&ha).unwrap(), &r.upload(&hb).unwrap(), None, t)
                    .unwrap();
                let want = r.download(&want).unwrap().to_f32_vec();
                check_against(&name, &g.matmul(&a, &b, None, t).unwrap(), g, &want);
            }
            (a, b)
        };
        product_row(&mut group, g, &name, shape, setup);
    }
    group.finish();
}

/// Row `name`: `g`'s product of `shape` over the operands `setup` makes
/// (once, when the filter selects the row).
fn product_row(
    group: &mut BenchmarkGroup<'_, WallTime>,
    g: &GpuExecutor,
    name: &str,
    (m, k, n, t, _): Shape,
    setup: impl Fn() -> (GpuTensor, GpuTensor),
) {
    let ready = OnceCell::new();
    group.throughput(Throughput::Elements(2 * (m * n * k) as u64));
    group.bench_function(name, |bench| {
        let (a, b) = ready.get_or_init(&setup);
        bench.iter(|| {
            let y = g.matmul(a, b, None, t).unwrap();
            g.synchronize().unwrap();
            y
        })
    });
}

fn bench(c: &mut Criterion) {
    let Some(g) = common::executor() else { return };
    let real = common::is_real_gpu(&g);
    let nn = Transpose::NN;
    let nt = Transpose::NT;
    let tn = Transpose::TN;
    let mut shapes = vec![
        (256, 256, 256, nn, DType::F32),
        (512, 512, 512, nn, DType::F32),
        (1024, 768, 3072, nt, DType::F32),
        (1024, 768, 3072, nt, DType::BF16),
    ];
    if real {
        shapes.extend([
            (2048, 2048, 2048, nn, DType::F32),
            (4096, 4096, 4096, nn, DType::F32),
            (4096, 4096, 4096, nt, DType::F32),
            (4096, 4096, 4096, nt, DType::BF16),
            (8192, 8192, 8192, nn, DType::F32),
            (4096, 3584, 18944, nt, DType::F32),
            (4096, 18944, 3584, nn, DType::F32),
            (18944, 4096, 3584, tn, DType::F32),
        ]);
    }
    run(c, &g, None, "", &shapes);
    let checked = GpuExecutor::with_options(
        g.context().clone(),
        GpuOptions {
            checked_matmul_only: true,
            ..Default::default()
        },
    );
    run(c, &checked, Some(&g), "checked_", &shapes);

    // f16: square products, and a 7B layer's MLP at 4096 tokens (hidden
    // 3584, intermediate 18944; weights [out, in] in f16): forward x·Wᵀ,
    // backward dx = dy·W and dW = dyᵀ·x (f32 operands).
    let f16_shapes: Vec<Shape> = if real {
        vec![
            (4096, 4096, 4096, nn, DType::F32),
            (8192, 8192, 8192, nn, DType::F32),
            (4096, 3584, 18944, nt, DType::F16),
            (4096, 18944, 3584, nt, DType::F16),
            (4096, 18944, 3584, nn, DType::F16),
            (18944, 4096, 3584, tn, DType::F32),
            // TinyLlama's K and V projections at 8×1024 tokens: N = 256
            // gives a 256×128 tile 64 workgroups, the 128 tile 128 (the
            // H200 has 132 multiprocessors).
            (8192, 2048, 256, nt, DType::F16),
        ]
    } else {
        vec![(256, 256, 256, nn, DType::F32), (256, 200, 300, nt, DType::F16)]
    };
    let ctx = g.context().clone();
    let f16_opts = |k: F16Matmul, opts: GpuOptions| {
        let mut e = GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                f16_matmul: k,
                ..opts
            },
        );
        e.set_compute_precision(ComputePrecision::F16).unwrap();
        e
    };
    let f16_with = |k: F16Matmul, shader_checks: bool| {
        f16_opts(
            k,
            GpuOptions {
                shader_checks,
                ..Default::default()
            },
        )
    };
    let f16 = |k: F16Matmul| f16_with(k, false);
    let mut kernels = vec![F16Matmul::Simt];
    if ctx.has_cooperative_matrix() {
        kernels.extend(
            [
                CoopTile::Simple64,
                CoopTile::Tile128,
                CoopTile::Tile256x128,
                CoopTile::Tile128x256w16,
                CoopTile::Tile128x256,
                CoopTile::Tile128w4,
            ]
            .map(F16Matmul::Coop),
        );
    } else {
        eprintln!("adapter has no cooperative matrices: tensor-core rows skipped");
    }
    for &k in &kernels {
        run(c, &f16(k), Some(&g), &format!("f16_{k}_"), &f16_shapes);
    }
    sweep(c, &g, real);
    // The default tile converting f32 operands as it stages them, instead
    // of reading their f16 copies (made once, outside the timed loop, since
    // A and B do not change between iterations).
    let default_f16 = f16(F16Matmul::Auto).f16_matmul_kernel();
    if matches!(default_f16, F16Matmul::Coop(_)) {
        let stage = GpuOptions {
            f16_operands: F16Operands::Stage,
            ..Default::default()
        };
        run(
            c,
            &f16_opts(default_f16, stage),
            Some(&g),
            &format!("f16_{default_f16}_stage_"),
            &f16_shapes,
        );
    }

    // The same kernels with wgpu's runtime checks compiled in: what turning
    // them off bought.
    let checked_shaders = GpuExecutor::with_options(
        ctx.clone(),
        GpuOptions {
            shader_checks: true,
            ..Default::default()
        },
    );
    let square = if real { 4096 } else { 256 };
    run(
        c,
        &checked_shaders,
        Some(&g),
        "shader_checks_",
        &[(square, square, square, nn, DType::F32)],
    );
    run(
        c,
        &f16_with(default_f16, true),
        Some(&g),
        &format!("shader_checks_f16_{default_f16}_"),
        &f16_shapes[..2],
    );

    // What an operand's f16 copy costs where it is made: the max scan (4
    // bytes an element) and the copy (4 read, 2 written), on an executor
    // that remembers neither, so each iteration makes both. Throughput in
    // bytes moved; a 7B layer's activations (4096 tokens × 3584, and × 18944).
    let fresh = f16_opts(
        default_f16,
        GpuOptions {
            recompute_operand_maxima: true,
            ..Default::default()
        },
    );
    let sizes: &[(usize, usize)] = if real {
        &[(4096, 3584), (4096, 18944)]
    } else {
        &[(256, 300)]
    };
    let mut group = c.benchmark_group("matmul");
    group.sample_size(10);
    for &(rows, cols) in sizes {
        let x = OnceCell::new();
        group.throughput(Throughput::Bytes(10 * (rows * cols) as u64));
        group.bench_function(format!("f16_copy_{rows}x{cols}"), |bench| {
            let x = x.get_or_init(|| fresh.upload(&common::rand(5, &[rows, cols])).unwrap());
            bench.iter(|| {
                let h = fresh.f16_operand(x).unwrap();
                fresh.synchronize().unwrap();
                h
            })
        });
    }
    group.finish();
}

/// The tile shapes `MEGATRAIN_COOP_SWEEP` names (`default`: `CoopTile::SWEEP`;
/// else shapes or tile names joined by commas), each timed at 8192³ and a
/// 7B MLP forward (1024 and 256 x 200 x 300 where the adapter is not a
/// real GPU) after its result is checked against the f32 kernel's,
/// computed once per shape. Rows `f16_sweep_{tile}_…`.
fn sweep(c: &mut Criterion, g: &GpuExecutor, real: bool) {
    let Ok(list) = std::env::var(SWEEP_ENV) else {
        return;
    };
    if !g.context().has_cooperative_matrix() {
        eprintln!("{SWEEP_ENV}: adapter has no cooperative matrices, no sweep");
        return;
    }
    let names: Vec<String> = match list.trim() {
        "default" => CoopTile::SWEEP.iter().map(|s| s.to_string()).collect(),
        l => l.split(',').map(|s| s.trim().to_string()).collect(),
    };
    let tiles: Vec<CoopTile> = names
        .iter()
        .map(|n| CoopTile::parse(n).unwrap_or_else(|e| panic!("{SWEEP_ENV}: {e}")))
        .collect();
    let shapes: Vec<Shape> = if real {
        vec![
            (8192, 8192, 8192, Transpose::NN, DType::F32),
            (4096, 3584, 18944, Transpose::NT, DType::F16),
        ]
    } else {
        vec![
            (1024, 1024, 1024, Transpose::NN, DType::F32),
            (256, 200, 300, Transpose::NT, DType::F16),
        ]
    };
    let mut group = c.benchmark_group("matmul");
    group.sample_size(10);
    // Tile by tile, each at every shape, so that a run cut short has the
    // first tiles' rates at both. As in `run`: made and checked only for
    // rows the filter selects; the reference once per shape.
    let references: Vec<OnceCell<_>> = shapes.iter().map(|_| OnceCell::new()).collect();
    for &tile in &tiles {
        for (i, &shape) in shapes.iter().enumerate() {
            let (m, k, n, t, dt) = shape;
            let reference = &references[i];
            let want = || {
                let (ha, hb) = operands(10 + 2 * i as u64, shape);
                let y = g
                    .matmul(&g.upload(&ha).unwrap(), &g.upload(&hb).unwrap(), None, t)
                    .unwrap();
                (ha, hb, g.download(&y).unwrap().to_f32_vec())
            };
            let name = format!("f16_sweep_{}_{m}x{k}x{n}_{}_{dt}", tile.name(), layout(t));
            let mut e = GpuExecutor::with_options(
                g.context().clone(),
                GpuOptions {
                    f16_matmul: F16Matmul::Coop(tile),
                    ..Default::default()
                },
            );
            e.set_compute_precision(ComputePrecision::F16).unwrap();
            let setup = || {
                let (ha, hb, want) = reference.get_or_init(want);
                let (a, b) = (e.upload(ha).unwrap(), e.upload(hb).unwrap());
                check_against(&name, &e.matmul(&a, &b, None, t).unwrap(), &e, want);
                (a, b)
            };
            product_row(&mut group, &e, &name, shape, setup);
        }
    }
    group.finish();
}

/// Names the tile shapes [`sweep`] times.
const SWEEP_ENV: &str = "MEGATRAIN_COOP_SWEEP";

/// Names the tiles [`probe`] takes apart.
const PROBE_ENV: &str = "MEGATRAIN_COOP_PROBE";

/// Where a tensor-core tile's time goes: for each tile
/// `MEGATRAIN_COOP_PROBE` names (`default`: the default tile; else tile
/// names or shapes joined by commas), the product at 8192³ (512³ where the
/// adapter is not a real GPU) on the real kernel, checked against the f32
/// kernel first, and on each of its timing probes (`CoopProbe`: wrong
/// products, not checked), from the multiply-adds alone to all but the
/// global reads. Medians of `reps` timed runs after two untimed ones,
/// printed as `megatrain coop probe` lines in the real product's TFLOP/s.
/// Runs instead of criterion's rows, on a device whose other kernels are
/// not compiled first (`common::executor` warms every kernel up).
fn probe() {
    let Ok(list) = std::env::var(PROBE_ENV) else {
        return;
    };
    let Some(ctx) = common::probe_context(PROBE_ENV) else {
        return;
    };
    let g = GpuExecutor::new(ctx);
    let real = common::is_real_gpu(&g);
    let tiles: Vec<CoopTile> = match list.trim() {
        "default" => vec![CoopTile::DEFAULT],
        l => l
            .split(',')
            .map(|n| CoopTile::parse(n.trim()).unwrap_or_else(|e| panic!("{PROBE_ENV}: {e}")))
            .collect(),
    };
    let (size, reps) = if real { (8192, 10) } else { (512, 3) };
    let shape = (size, size, size, Transpose::NN, DType::F32);
    let (ha, hb) = operands(20, shape);
    let want = g
        .download(
            &g.matmul(
                &g.upload(&ha).unwrap(),
                &g.upload(&hb).unwrap(),
                None,
                Transpose::NN,
            )
            .unwrap(),
        )
        .unwrap()
        .to_f32_vec();
    let flops = 2.0 * (size as f64).powi(3);
    for tile in tiles {
        let runs = std::iter::once(None).chain(CoopProbe::ALL.map(Some));
        let mut line = format!("megatrain coop probe {} {size}x{size}x{size}_NN:", tile.name());
        for p in runs {
            let mut e = GpuExecutor::with_options(
                g.context().clone(),
                GpuOptions {
                    f16_matmul: F16Matmul::Coop(tile),
                    coop_probe: p,
                    ..Default::default()
                },
            );
            e.set_compute_precision(ComputePrecision::F16).unwrap();
            let (a, b) = (e.upload(&ha).unwrap(), e.upload(&hb).unwrap());
            if p.is_none() {
                check_against(
                    &tile.name(),
                    &e.matmul(&a, &b, None, Transpose::NN).unwrap(),
                    &e,
                    &want,
                );
            }
            let mut ms: Vec<f64> = (0..reps + 2)
                .map(|_| {
                    let t = std::time::Instant::now();
                    let y = e.matmul(&a, &b, None, Transpose::NN).unwrap();
                    e.synchronize().unwrap();
                    drop(y);
                    t.elapsed().as_secs_f64() * 1e3
                })
                .skip(2)
                .collect();
            ms.sort_by(f64::total_cmp);
            let median = ms[ms.len() / 2];
            let name = p.map_or("full", CoopProbe::name);
            let rate = common::flops_rate(flops / median * 1e3);
            line.push_str(&format!(" {name} {median:.3} ms ({rate}),"));
        }
        println!("{}", line.trim_end_matches(','));
    }
}

fn main() {
    if std::env::var_os(PROBE_ENV).is_some() {
        probe();
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
