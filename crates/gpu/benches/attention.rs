//! Fused causal attention, forward and backward. Throughput counts the
//! useful (causal) score and value FLOPs: 2·2·B·Hq·D·T(T+1)/2 forward,
//! 2.5x that backward.
//!
//! `attention` times the f32 kernels: a row's D over four subgroup lanes
//! (`fwd_…`, `bwd_…`, where the adapter has subgroups and D is a multiple
//! of 16) and one thread per row (`one_row_fwd_…`, `one_row_bwd_…`); on a
//! GPU also at Gemma 3 1B's heads (4/1, D = 256: one thread per row in
//! both).
//!
//! `attention_f16` times the F16 compute precision: the tensor-core flash
//! attention family on adapters with cooperative matrices, at the
//! Llama-7B/Qwen-7B (32/8 heads) and Qwen2.5-7B (28/4) shapes, B = 4, D =
//! 128, T = 1024, 2048, 4096, and at T = 8192 (B = 1) causal and in
//! Mistral-7B's window of 4096 keys (`_W4096`, its FLOPs counted over the
//! keys the window leaves); elsewhere one small shape, causal and in a
//! window, on the emulated kernels. Each is checked against the CPU F16
//! reference first (B = 1, T =
//! 256, same heads): reading f16 copies of Q, K and V (the default; the
//! summary adds a forward that makes them, "fwd fresh") and, on a GPU,
//! converting as they stage (`…_stage_…` rows, T = 2048); then it runs
//! `benches/torch_sdpa.py` for PyTorch's figure on the same shapes where
//! torch with CUDA imports. Where `MEGATRAIN_ATTN_SWEEP` names tile sets
//! (`default`: `AttnTiles::SWEEP`), `fwd_sweep{i}_…`/`bwd_sweep{i}_…` time
//! each at B4 T2048 32/8 D128. Where `MEGATRAIN_ATTN_PROBE` is set, the
//! kernels are taken apart by their timing probes (`AttnProbe`) instead,
//! printed as `megatrain attention probe` lines.

mod common;

use std::cell::{OnceCell, RefCell};
use std::time::Instant;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use megatrain_gpu::{
    AttnProbe, AttnTiles, F16Attention, F16Operands, GpuContext, GpuExecutor, GpuOptions, GpuTensor,
    TimingSource,
};
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{AttentionOut, AttnMask, ComputePrecision, CpuExecutor, Executor, HostTensor};

fn bench(c: &mut Criterion) {
    let Some(g) = common::executor() else { return };
    // The f32 kernels a row's D splits over four subgroup lanes, where the
    // adapter allows it, and the kernels with one thread per row
    // (`one_row_…`) on the same shapes.
    let one_row = GpuExecutor::with_options(
        g.context().clone(),
        GpuOptions {
            one_row_attention: true,
            ..Default::default()
        },
    );
    let mut shapes = vec![(1, 256, 8, 2, 64), (1, 512, 8, 2, 64)];
    if common::is_real_gpu(&g) {
        // Gemma 3 1B's heads (4/1, D = 256) run only on these kernels.
        shapes.extend([(4, 2048, 32, 8, 128), (8, 1024, 12, 12, 64), (4, 2048, 4, 1, 256)]);
    }
    let mut group = c.benchmark_group("attention");
    group.sample_size(10);
    for (tag, g) in [("", &g), ("one_row_", &one_row)] {
        for &(b, t, hq, hkv, d) in &shapes {
            let q = g.upload(&common::rand(1, &[b, t, hq, d])).unwrap();
            let k = g.upload(&common::rand(2, &[b, t, hkv, d])).unwrap();
            let v = g.upload(&common::rand(3, &[b, t, hkv, d])).unwrap();
            let dout = g.upload(&common::rand(4, &[b, t, hq, d])).unwrap();
            let flops = 4 * (b * hq * d * t * (t + 1) / 2) as u64;
            let name = format!("B{b}_T{t}_Hq{hq}_Hkv{hkv}_D{d}");
            group.throughput(Throughput::Elements(flops));
            group.bench_function(format!("{tag}fwd_{name}"), |bench| {
                bench.iter(|| {
                    let o = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
                    g.synchronize().unwrap();
                    o
                })
            });
            let fwd = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
            // Backward recomputes the scores and does 4 more products: ~2.5x forward.
            group.throughput(Throughput::Elements(flops * 5 / 2));
            group.bench_function(format!("{tag}bwd_{name}"), |bench| {
                bench.iter(|| {
                    let gr = g.attention_backward(&q, &k, &v, &fwd, &dout).unwrap();
                    g.synchronize().unwrap();
                    gr
                })
            });
        }
    }
    group.finish();
}

/// (B, T, Hq, Hkv, D)
type Dims = (usize, usize, usize, usize, usize);

fn f16_executor(kind: F16Attention, opts: GpuOptions) -> Option<GpuExecutor> {
    let ctx = GpuContext::new().ok()?;
    let mut g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            f16_attention: kind,
            ..opts
        },
    );
    g.set_compute_precision(ComputePrecision::F16).ok()?;
    Some(g)
}

/// The executor's F16 attention against the CPU reference on (1, t, hq,
/// hkv, d): panics above 2e-3 relative error, so that nothing wrong is timed.
fn check(g: &GpuExecutor, t: usize, hq: usize, hkv: usize, d: usize) {
    let cpu = CpuExecutor::with_precision(ComputePrecision::F16);
    let hs = [
        common::rand(11, &[1, t, hq, d]),
        common::rand(12, &[1, t, hkv, d]),
        common::rand(13, &[1, t, hkv, d]),
        common::rand(14, &[1, t, hq, d]),
    ];
    let c: Vec<_> = hs.iter().map(|h| cpu.upload(h).unwrap()).collect();
    let x: Vec<_> = hs.iter().map(|h| g.upload(h).unwrap()).collect();
    let rf = cpu.attention(&c[0], &c[1], &c[2], AttnMask::CAUSAL).unwrap();
    let rg = cpu.attention_backward(&c[0], &c[1], &c[2], &rf, &c[3]).unwrap();
    let of = g.attention(&x[0], &x[1], &x[2], AttnMask::CAUSAL).unwrap();
    let og = g.attention_backward(&x[0], &x[1], &x[2], &of, &x[3]).unwrap();
    let pairs = [
        ("out", &of.out, &rf.out),
        ("lse", &of.lse, &rf.lse),
        ("dq", &og.dq, &rg.dq),
        ("dk", &og.dk, &rg.dk),
        ("dv", &og.dv, &rg.dv),
    ];
    for (name, got, want) in pairs {
        let e = rel_norm_err(
            &g.download(got).unwrap().to_f32_vec(),
            &cpu.download(want).unwrap().to_f32_vec(),
        );
        assert!(
            e <= 2e-3,
            "T{t} Hq{hq} Hkv{hkv} D{d} {name}: relative error {e:e} against the CPU reference"
        );
    }
    eprintln!("checked T{t}_Hq{hq}_Hkv{hkv}_D{d} against the CPU F16 reference");
}

fn dims_name((b, t, hq, hkv, d): Dims) -> String {
    format!("B{b}_T{t}_Hq{hq}_Hkv{hkv}_D{d}")
}

/// The forward's useful score and value FLOPs: 2·2·B·Hq·D per (query, key)
/// pair the mask lets through.
fn attn_flops((b, t, hq, _, d): Dims, mask: &AttnMask) -> u64 {
    let pairs: usize = (0..t).map(|i| i + 1 - mask.first_key(0, i)).sum();
    4 * (b * hq * d * pairs) as u64
}

/// A shape whose rows ran: its host inputs, the executor's medians of
/// five forwards and backwards, and its causal FLOPs.
struct Timed {
    hs: [HostTensor; 4],
    flops: u64,
    fwd_s: f64,
    bwd_s: f64,
}

impl Timed {
    fn rates(&self) -> String {
        format!(
            "fwd {:.3} ms {:.2} TFLOP/s, bwd {:.3} ms {:.2} TFLOP/s",
            self.fwd_s * 1e3,
            self.flops as f64 / self.fwd_s / 1e12,
            self.bwd_s * 1e3,
            2.5 * self.flops as f64 / self.bwd_s / 1e12
        )
    }
}

/// Rows `fwd_{name}` and `bwd_{name}` of `g` at `dims`. The inputs are
/// made (and `first` run: the check against the CPU reference) only where
/// criterion's filter selects a row, so that a GPU session's minutes go to
/// the rows it asked for; `None` where it selected neither.
fn time_rows(
    group: &mut BenchmarkGroup<'_, WallTime>,
    g: &GpuExecutor,
    (dims, mask): (Dims, AttnMask),
    name: &str,
    first: impl Fn(&GpuExecutor),
) -> Option<Timed> {
    let (b, t, hq, hkv, d) = dims;
    let flops = attn_flops(dims, &mask);
    let ready = OnceCell::new();
    let setup = || {
        first(g);
        let hs = [[b, t, hq, d], [b, t, hkv, d], [b, t, hkv, d], [b, t, hq, d]];
        let hs = [1, 2, 3, 4].map(|i| common::rand(i, &hs[i as usize - 1]));
        let up = hs.each_ref().map(|h| g.upload(h).unwrap());
        let fwd = g.attention(&up[0], &up[1], &up[2], mask.clone()).unwrap();
        (hs, up, fwd)
    };
    let fwd_run = |[q, k, v, _]: &[GpuTensor; 4]| {
        let o = g.attention(q, k, v, mask.clone()).unwrap();
        g.synchronize().unwrap();
        o
    };
    let bwd_run = |[q, k, v, dout]: &[GpuTensor; 4], fwd: &AttentionOut<GpuTensor>| {
        let gr = g.attention_backward(q, k, v, fwd, dout).unwrap();
        g.synchronize().unwrap();
        gr
    };
    group.throughput(Throughput::Elements(flops));
    group.bench_function(format!("fwd_{name}"), |bench| {
        let (_, up, _) = ready.get_or_init(setup);
        bench.iter(|| fwd_run(up))
    });
    // Backward recomputes the scores and does 4 more products: ~2.5x forward.
    group.throughput(Throughput::Elements(flops * 5 / 2));
    group.bench_function(format!("bwd_{name}"), |bench| {
        let (_, up, fwd) = ready.get_or_init(setup);
        bench.iter(|| bwd_run(up, fwd))
    });
    let (hs, up, fwd) = ready.into_inner()?;
    let fwd_s = median(5, || drop(fwd_run(&up)));
    let bwd_s = median(5, || drop(bwd_run(&up, &fwd)));
    Some(Timed {
        hs,
        flops,
        fwd_s,
        bwd_s,
    })
}

/// Each kernel's time in one causal forward and backward of `hs`, profiled
/// (a sync after each op, each dispatch in a pass of its own): the backward
/// is timed whole above, and this says how its dq and dk/dv passes share
/// it. Empty without timestamp queries.
fn kernel_times(g: &GpuExecutor, hs: &[HostTensor; 4]) -> String {
    if g.timing_source() != TimingSource::GpuTimestamps {
        return String::new();
    }
    let up = hs.each_ref().map(|h| g.upload(h).unwrap());
    let fwd = g.attention(&up[0], &up[1], &up[2], AttnMask::CAUSAL).unwrap();
    g.synchronize().unwrap();
    g.profile().clear();
    g.set_profiling(true);
    let fwd2 = g.attention(&up[0], &up[1], &up[2], AttnMask::CAUSAL);
    let grads = g.attention_backward(&up[0], &up[1], &up[2], &fwd, &up[3]);
    g.set_profiling(false);
    drop((fwd2.unwrap(), grads.unwrap()));
    let parts: Vec<String> = g
        .profile()
        .kernel_snapshot()
        .into_iter()
        .map(|(k, t)| format!("{k} {:.3} ms", t.total_ns as f64 / 1e6))
        .collect();
    format!("; profiled once, per kernel: {}", parts.join(", "))
}

/// Median seconds of `f` over `n` runs after one warm-up.
fn median(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[n / 2]
}

fn bench_f16(c: &mut Criterion) {
    let Some(probe) = common::executor() else { return };
    let real = common::is_real_gpu(&probe) && probe.context().has_cooperative_matrix();
    drop(probe);
    let causal = AttnMask::CAUSAL;
    let (kind, shapes): (_, Vec<(Dims, AttnMask)>) = if real {
        let mut v = Vec::new();
        for (hq, hkv) in [(32, 8), (28, 4)] {
            for t in [1024, 2048, 4096] {
                v.push(((4, t, hq, hkv, 128), causal.clone()));
            }
        }
        // The window's skipped tiles, against the same T causal.
        v.push(((1, 8192, 32, 8, 128), causal.clone()));
        v.push(((1, 8192, 32, 8, 128), AttnMask::sliding(4096)));
        (F16Attention::Coop, v)
    } else {
        let small = (1, 64, 4, 2, 64);
        (
            F16Attention::CoopEmulated,
            vec![(small, causal.clone()), (small, AttnMask::sliding(20))],
        )
    };
    // The default reads f16 copies of Q, K, V (and dO), made once per value:
    // the fwd_/bwd_ rows reuse them (as a step's backward does the forward's);
    // `fresh` times a forward that makes them (and scans the maxima) as the
    // first forward over new tensors does. On a GPU the same kernels
    // converting as they stage (`_stage` rows, at T = 2048) are timed beside
    // them.
    let mut ways = vec![("", GpuOptions::default())];
    if real {
        let stage = GpuOptions {
            f16_operands: F16Operands::Stage,
            ..Default::default()
        };
        ways.push(("_stage", stage));
    }
    let fresh_opts = GpuOptions {
        recompute_operand_maxima: true,
        ..Default::default()
    };
    let Some(fresh) = f16_executor(kind, fresh_opts) else {
        return;
    };
    let checked = RefCell::new(Vec::new());
    let mut summary = Vec::new();
    let mut group = c.benchmark_group("attention_f16");
    group.sample_size(10);
    for (way, opts) in ways {
        let Some(g) = f16_executor(kind, opts) else { return };
        for (dims, mask) in &shapes {
            let dims = *dims;
            // Staging is timed at the T only: the comparison, not
            // every shape again, within the GPU session's budget.
            if !way.is_empty() && dims.1 != 2048 {
                continue;
            }
            let window = mask.window.map_or(String::new(), |w| format!("_W{w}"));
            let name = format!("{kind:?}{way}_{}{window}", dims_name(dims));
            // Checked once per (Hq, Hkv, D), on the executor of the first
            // row the filter selects.
            let check_once = |g: &GpuExecutor| {
                let (_, t, hq, hkv, d) = dims;
                if !checked.borrow().contains(&(hq, hkv, d)) {
                    check(g, t.min(256), hq, hkv, d);
                    checked.borrow_mut().push((hq, hkv, d));
                }
            };
            let Some(ops) = time_rows(&mut group, &g, (dims, mask.clone()), &name, check_once) else {
                continue;
            };
            let mut line = format!("megatrain f16 {name}: {}", ops.rates());
            if way.is_empty() {
                let [q, k, v] = [&ops.hs[0], &ops.hs[1], &ops.hs[2]].map(|h| fresh.upload(h).unwrap());
                let tn = median(5, || {
                    drop(fresh.attention(&q, &k, &v, mask.clone()).unwrap());
                    fresh.synchronize().unwrap();
                });
                line += &format!(
                    ", fwd fresh (max scans and f16 copies of Q, K, V included) {:.3} ms {:.2} TFLOP/s",
                    tn * 1e3,
                    ops.flops as f64 / tn / 1e12
                );
            }
            summary.push(line);
        }
    }
    group.finish();
    for line in &summary {
        println!("{line}");
    }
    // PyTorch's figure where any of ours was timed (its import alone takes
    // seconds of a GPU session).
    if real && !summary.is_empty() {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../benches/torch_sdpa.py");
        match std::process::Command::new("python3").arg(script).status() {
            Ok(s) if s.success() => {}
            Ok(s) => println!("torch_sdpa.py exited with {s}"),
            Err(e) => println!("torch_sdpa.py not run: python3: {e}"),
        }
    }
}

/// Names the tensor-core attention tile sets [`bench_f16_sweep`] times.
const ATTN_SWEEP_ENV: &str = "MEGATRAIN_ATTN_SWEEP";

/// The shape the sweep times (`B4_T2048_Hq32_Hkv8_D128`, as the rows name
/// it) where not issue 13's: e.g. TinyLlama's `B8_T1024_Hq32_Hkv4_D64`,
/// whose head dimension may want other tiles.
const ATTN_SWEEP_SHAPE_ENV: &str = "MEGATRAIN_ATTN_SWEEP_SHAPE";

/// The dims [`dims_name`] writes.
fn parse_dims(s: &str) -> Option<Dims> {
    let mut it = s.split('_');
    let mut num = |prefix: &str| it.next()?.strip_prefix(prefix)?.parse::<usize>().ok();
    let dims = (num("B")?, num("T")?, num("Hq")?, num("Hkv")?, num("D")?);
    (it.next().is_none() && dims.3 > 0 && dims.2 % dims.3 == 0).then_some(dims)
}

/// The tile sets `MEGATRAIN_ATTN_SWEEP` names (`default`: `AttnTiles::SWEEP`;
/// else sets joined by `;`, each as `MEGATRAIN_F16_ATTENTION_TILES` takes
/// it), forward and backward at issue 13's shape (B4 T2048 32/8 D128; one
/// small shape where the adapter's cooperative matrices are not a GPU's;
/// `MEGATRAIN_ATTN_SWEEP_SHAPE` names another),
/// each set checked against the CPU reference first: rows
/// `fwd_sweep{i}_…` and `bwd_sweep{i}_…`, and a summary line per set.
fn bench_f16_sweep(c: &mut Criterion) {
    let Ok(list) = std::env::var(ATTN_SWEEP_ENV) else {
        return;
    };
    let Some(probe) = common::executor() else { return };
    if !probe.context().has_cooperative_matrix() {
        eprintln!("{ATTN_SWEEP_ENV}: adapter has no cooperative matrices, no sweep");
        return;
    }
    let dims: Dims = match std::env::var(ATTN_SWEEP_SHAPE_ENV) {
        Ok(shape) => parse_dims(&shape).unwrap_or_else(|| {
            panic!("{ATTN_SWEEP_SHAPE_ENV}: '{shape}' is not B{{b}}_T{{t}}_Hq{{hq}}_Hkv{{hkv}}_D{{d}}")
        }),
        Err(_) if common::is_real_gpu(&probe) => (4, 2048, 32, 8, 128),
        Err(_) => (1, 64, 4, 2, 64),
    };
    drop(probe);
    let sets: Vec<String> = match list.trim() {
        "default" => AttnTiles::SWEEP.iter().map(|s| s.to_string()).collect(),
        l => l.split(';').map(|s| s.trim().to_string()).collect(),
    };
    let mut summary = Vec::new();
    let mut group = c.benchmark_group("attention_f16");
    group.sample_size(10);
    for (i, set) in sets.iter().enumerate() {
        let tiles: AttnTiles = set.parse().unwrap_or_else(|e| panic!("{ATTN_SWEEP_ENV}: {e}"));
        let opts = GpuOptions {
            attention_tiles: tiles,
            ..Default::default()
        };
        let Some(g) = f16_executor(F16Attention::Coop, opts) else {
            return;
        };
        let name = format!("sweep{i}_{}", dims_name(dims));
        // A set that is refused or wrong here is reported and the sweep
        // goes on: the sets after it are still timed.
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            check(&g, dims.1.min(256), dims.2, dims.3, dims.4)
        }));
        if let Err(e) = checked {
            let why = e
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| e.downcast_ref::<&str>().copied())
                .unwrap_or("panicked");
            summary.push(format!("megatrain f16 {name} ({tiles}): not timed: {why}"));
            continue;
        }
        if let Some(ops) = time_rows(&mut group, &g, (dims, AttnMask::CAUSAL), &name, |_| {}) {
            let kernels = kernel_times(&g, &ops.hs);
            summary.push(format!(
                "megatrain f16 {name} ({tiles}): {}{kernels}",
                ops.rates()
            ));
        }
    }
    group.finish();
    for line in &summary {
        println!("{line}");
    }
}

/// Turns on [`probe_attention`].
const ATTN_PROBE_ENV: &str = "MEGATRAIN_ATTN_PROBE";

/// Where the tensor-core attention's time goes, where
/// `MEGATRAIN_ATTN_PROBE` is set (to anything): at issue 13's shape (B4
/// T2048 32/8 D128) and TinyLlama's (B8 T1024 32/4 D64) on a GPU, one small
/// shape elsewhere, the default tiles' forward and backward (checked
/// against the CPU first) and their timing probes (`AttnProbe`: wrong
/// results, not checked), each pass the median of five after one, and,
/// where the adapter has timestamps, each kernel (fwd, dq, dkv) alone from
/// one profiled forward and backward. Printed as `megatrain attention
/// probe` lines, a line a shape and way, in the real passes' causal
/// FLOP/s; runs instead of criterion's rows.
fn probe_attention() {
    let Some(ctx) = common::probe_context(ATTN_PROBE_ENV) else {
        return;
    };
    let shapes: Vec<Dims> = if ctx.info.device_type != "Cpu" {
        vec![(4, 2048, 32, 8, 128), (8, 1024, 32, 4, 64)]
    } else {
        vec![(1, 64, 4, 2, 64)]
    };
    drop(ctx);
    for dims in shapes {
        let (b, t, hq, hkv, d) = dims;
        let flops = attn_flops(dims, &AttnMask::CAUSAL) as f64;
        let hs = [[b, t, hq, d], [b, t, hkv, d], [b, t, hkv, d], [b, t, hq, d]];
        let hs = [1, 2, 3, 4].map(|i| common::rand(i, &hs[i as usize - 1]));
        for probe in std::iter::once(None).chain(AttnProbe::ALL.map(Some)) {
            let opts = GpuOptions {
                attention_probe: probe,
                ..Default::default()
            };
            let Some(g) = f16_executor(F16Attention::Coop, opts) else {
                return;
            };
            if probe.is_none() {
                check(&g, t.min(256), hq, hkv, d);
            }
            let [q, k, v, dout] = hs.each_ref().map(|h| g.upload(h).unwrap());
            let fwd = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
            let forward = || {
                let o = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
                g.synchronize().unwrap();
                drop(o);
            };
            let backward = || {
                let gr = g.attention_backward(&q, &k, &v, &fwd, &dout).unwrap();
                g.synchronize().unwrap();
                drop(gr);
            };
            let (fs, bs) = (median(5, forward), median(5, backward));
            let mut kernels = String::new();
            if g.timing_source() == TimingSource::GpuTimestamps {
                g.profile().clear();
                g.set_profiling(true);
                forward();
                backward();
                g.set_profiling(false);
                for pass in ["fwd", "dq", "dkv"] {
                    let at = format!("/flash_{pass}_");
                    let ns: u64 = g
                        .profile()
                        .kernel_snapshot()
                        .iter()
                        .filter(|(k, _)| k.contains(&at))
                        .map(|(_, t)| t.total_ns)
                        .sum();
                    kernels.push_str(&format!(" {pass} {:.3}", ns as f64 / 1e6));
                }
                kernels = format!("; kernels ms:{kernels}");
            }
            println!(
                "megatrain attention probe {} {}: forward {:.3} ms ({}), backward {:.3} ms ({}){kernels}",
                dims_name(dims),
                probe.map_or("full", AttnProbe::name),
                fs * 1e3,
                common::flops_rate(flops / fs),
                bs * 1e3,
                common::flops_rate(2.5 * flops / bs)
            );
        }
    }
}

fn main() {
    if std::env::var_os(ATTN_PROBE_ENV).is_some() {
        probe_attention();
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    bench_f16(&mut c);
    bench_f16_sweep(&mut c);
    c.final_summary();
}
