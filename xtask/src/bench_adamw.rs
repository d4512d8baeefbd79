//! `cargo xtask bench-adamw`: the fused CPU AdamW step on one large slab,
//! against a STREAM-style triad measured in the same run with the same
//! thread count, so the output says what fraction of the machine's memory
//! bandwidth the optimizer reaches.

use std::time::Instant;

use half::{bf16, f16};
use megatrain_adamw::bandwidth::{TRIAD_BYTES_PER_ELEMENT, triad, triad_streaming};
use megatrain_adamw::{AdamW, AdamWConfig, DecayMask, SlabState, SlabUpdate, Transport};
use rayon::prelude::*;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Parameters in the slab.
    #[arg(long, default_value_t = 100_000_000)]
    params: usize,
    /// Rayon threads; repeat for several runs (default: 1 and all cores).
    #[arg(long)]
    threads: Vec<usize>,
    /// Timed rounds (after 2 warm-up rounds); each round runs the triad and
    /// every optimizer variant once. The best and the median are reported;
    /// GB/s and the fraction of the triad use the best.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// The triad runs on at least this many elements (3 × 128 MiB), far past
/// any last-level cache, whatever --params says.
const TRIAD_MIN_LEN: usize = 32 << 20;

#[derive(Clone, Copy)]
enum Variant {
    Update,
    Bf16,
    F16,
    /// The f16 copy written with plain stores (the default streams it).
    F16Plain,
    F32,
    Bf16ZeroGrad,
}

impl Variant {
    const ALL: [Variant; 6] = [
        Variant::Update,
        Variant::Bf16,
        Variant::F16,
        Variant::F16Plain,
        Variant::F32,
        Variant::Bf16ZeroGrad,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Update => "update",
            Variant::Bf16 => "update+bf16",
            Variant::F16 => "update+f16",
            Variant::F16Plain => "update+f16 plain stores",
            Variant::F32 => "update+f32",
            Variant::Bf16ZeroGrad => "update+bf16+zero_grad",
        }
    }

    /// Bytes counted per parameter: p, g, m, v read (16) and p, m, v
    /// written (12), plus the transport copy and the zeroed gradient.
    fn bytes(self) -> usize {
        match self {
            Variant::Update => 28,
            Variant::Bf16 | Variant::F16 | Variant::F16Plain => 30,
            Variant::F32 => 32,
            Variant::Bf16ZeroGrad => 34,
        }
    }
}

struct Timing {
    best_s: f64,
    median_s: f64,
}

impl Timing {
    fn from(mut t: Vec<f64>) -> Self {
        t.sort_by(f64::total_cmp);
        Timing {
            best_s: t[0],
            median_s: t[t.len() / 2],
        }
    }
}

fn secs(f: impl FnOnce()) -> f64 {
    let s = Instant::now();
    f();
    s.elapsed().as_secs_f64()
}

/// Allocates and first-touches in parallel so pages are spread over the threads.
fn filled(n: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    v.par_iter_mut().enumerate().for_each(|(i, x)| *x = f(i));
    v
}

fn run_threads(args: &Args, threads: usize) -> anyhow::Result<serde_json::Value> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    pool.install(|| -> anyhow::Result<serde_json::Value> {
        let tn = args.params.max(TRIAD_MIN_LEN);
        let tb = filled(tn, |i| (i % 1024) as f32);
        let tc = filled(tn, |i| (i % 777) as f32);
        let mut ta = filled(tn, |_| 0.0);

        let n = args.params;
        let mut p = filled(n, |i| 0.5 + (i % 1000) as f32 * 1e-3);
        let mut g = filled(n, |i| ((i % 777) as f32 - 388.0) * 1e-5);
        let mut m = filled(n, |_| 0.0);
        let mut v = filled(n, |_| 0.0);
        let mut copy16 = vec![bf16::ZERO; n];
        copy16.par_iter_mut().for_each(|x| *x = bf16::ZERO);
        let mut copy_h = vec![f16::ZERO; n];
        copy_h.par_iter_mut().for_each(|x| *x = f16::ZERO);
        let mut copy32 = filled(n, |_| 0.0);
        let opt = AdamW::new(AdamWConfig::default())?;
        // A realistic mask: decay everywhere except a small tail (norms, biases).
        let mask = DecayMask::from_ranges(n, std::iter::once(0..n - n / 64))?;
        let mut state = SlabState::new();

        // Triad and optimizer variants take turns in every round, so a
        // change in machine load during the run hits all of them alike.
        let mut triad_s = Vec::new();
        let mut stream_s = Vec::new();
        let mut streaming = true;
        let mut opt_s = vec![Vec::new(); Variant::ALL.len()];
        for round in 0..args.iters + 2 {
            let t = secs(|| triad(&mut ta, &tb, &tc, 3.0).expect("equal lengths"));
            if round >= 2 {
                triad_s.push(t);
            }
            let t = secs(|| streaming &= triad_streaming(&mut ta, &tb, &tc, 3.0).expect("equal lengths"));
            if round >= 2 {
                stream_s.push(t);
            }
            for (k, variant) in Variant::ALL.into_iter().enumerate() {
                megatrain_adamw::set_plain_copy_stores(matches!(variant, Variant::F16Plain));
                let t = secs(|| {
                    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).decay(&mask);
                    let u = match variant {
                        Variant::Update => u,
                        Variant::Bf16 => u.transport(Transport::Bf16(&mut copy16)),
                        Variant::F16 | Variant::F16Plain => u.transport(Transport::F16(&mut copy_h)),
                        Variant::F32 => u.transport(Transport::F32(&mut copy32)),
                        Variant::Bf16ZeroGrad => u.transport(Transport::Bf16(&mut copy16)).zero_grad(true),
                    };
                    opt.step(&mut state, 1e-4, u).expect("valid slab");
                });
                if round >= 2 {
                    opt_s[k].push(t);
                }
            }
            megatrain_adamw::set_plain_copy_stores(false);
        }
        let gbs_of = |t: &Timing| (TRIAD_BYTES_PER_ELEMENT * tn) as f64 / t.best_s / 1e9;
        let plain_t = Timing::from(triad_s);
        let stream_t = streaming.then(|| Timing::from(stream_s));
        // The bound is the faster triad: the one that moves only what it counts.
        let triad_gbs = gbs_of(&plain_t).max(stream_t.as_ref().map_or(0.0, gbs_of));
        let mut rows = Vec::new();
        for (variant, times) in Variant::ALL.into_iter().zip(opt_s) {
            let t = Timing::from(times);
            let gbs = (variant.bytes() * n) as f64 / t.best_s / 1e9;
            rows.push(serde_json::json!({
                "variant": variant.name(),
                "bytes_per_param": variant.bytes(),
                "ms_best": t.best_s * 1e3,
                "ms_median": t.median_s * 1e3,
                "params_per_s": n as f64 / t.best_s,
                "gb_per_s": gbs,
                "fraction_of_triad": gbs / triad_gbs,
            }));
        }
        Ok(serde_json::json!({
            "threads": threads,
            "params": n,
            "triad": {
                "elements": tn,
                "bytes_per_element": TRIAD_BYTES_PER_ELEMENT,
                "bound_gb_per_s": triad_gbs,
                "plain_stores": {
                    "ms_best": plain_t.best_s * 1e3,
                    "ms_median": plain_t.median_s * 1e3,
                    "gb_per_s": gbs_of(&plain_t),
                },
                "streaming_stores": stream_t.as_ref().map(|t| serde_json::json!({
                    "ms_best": t.best_s * 1e3,
                    "ms_median": t.median_s * 1e3,
                    "gb_per_s": gbs_of(t),
                })),
            },
            "adamw": rows,
        }))
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.params > 0, "--params must be at least 1");
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads.is_empty() {
        if all > 1 { vec![1, all] } else { vec![1] }
    } else {
        args.threads.clone()
    };
    anyhow::ensure!(threads.iter().all(|&t| t > 0), "--threads must be at least 1");
    let mut runs = Vec::new();
    for &t in &threads {
        let r = run_threads(&args, t)?;
        if !args.json {
            print_table(&r);
        }
        runs.push(r);
    }
    if args.json {
        let out = serde_json::json!({
            "bench": "adamw",
            "simd_path": AdamW::simd_path(),
            "iters": args.iters,
            "runs": runs,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

fn print_table(r: &serde_json::Value) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let tr = &r["triad"];
    println!(
        "adamw: {} params, {} thread(s), {} loop; triad bound {:.2} GB/s \
         (plain stores {:.2} GB/s, streaming stores {:.2} GB/s; {} elements, 12 B each)",
        r["params"],
        r["threads"],
        AdamW::simd_path(),
        f(&tr["bound_gb_per_s"]),
        f(&tr["plain_stores"]["gb_per_s"]),
        f(&tr["streaming_stores"]["gb_per_s"]),
        tr["elements"],
    );
    println!(
        "  {:<24} {:>5} {:>9} {:>9} {:>11} {:>8} {:>9}",
        "variant", "B/par", "ms best", "ms med", "Mparams/s", "GB/s", "of triad"
    );
    for row in r["adamw"].as_array().into_iter().flatten() {
        println!(
            "  {:<24} {:>5} {:>9.1} {:>9.1} {:>11.0} {:>8.2} {:>9.3}",
            row["variant"].as_str().unwrap_or("?"),
            row["bytes_per_param"],
            f(&row["ms_best"]),
            f(&row["ms_median"]),
            f(&row["params_per_s"]) / 1e6,
            f(&row["gb_per_s"]),
            f(&row["fraction_of_triad"]),
        );
    }
}
