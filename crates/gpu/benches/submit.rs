//! Per-op cost of small ops, submitted op by op and in batches: what a step
//! of many small ops (the README's main job) pays per op beyond its
//! arithmetic. A chain of dependent element-wise ops on 256 elements, so the
//! kernels themselves take almost nothing; median over repetitions, one run.
//! Run: cargo bench -p megatrain-gpu --bench submit [-- --ops N --reps N]

mod common;

use std::time::Instant;

use megatrain_gpu::{GpuContext, GpuExecutor, GpuOptions};
use megatrain_tensor::Executor;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number, got {v}"))
        })
        .unwrap_or(default)
}

fn main() {
    let ctx = match GpuContext::new() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("no GPU adapter, skipping: {e}");
            return;
        }
    };
    let (ops, reps) = (arg("--ops", 600), arg("--reps", 9));
    println!("device: {}", ctx.info);
    println!("{ops} dependent ops on 256 elements (add, scale alternately), median of {reps} runs");
    // "host us/op": recording and submitting, until the last op is on its
    // way; "us per op": until the device has finished it.
    println!(
        "{:>10} {:>12} {:>12} {:>14} {:>12}",
        "batch_ops", "us per op", "host us/op", "submissions", "vs 1"
    );
    let mut base = None;
    for batch in [1usize, 8, 64, 256] {
        let g = GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                batch_ops: Some(batch),
                ..Default::default()
            },
        );
        let y = g.upload(&common::rand(1, &[256])).unwrap();
        let run = || {
            let mut x = g.upload(&common::rand(2, &[256])).unwrap();
            let t = Instant::now();
            for i in 0..ops / 2 {
                x = g.add(&x, &y).unwrap();
                x = g.scale(&x, if i % 2 == 0 { 0.5 } else { 2.0 }).unwrap();
            }
            let host = t.elapsed();
            g.synchronize().unwrap();
            let n = (ops / 2 * 2) as f64;
            (t.elapsed().as_secs_f64() * 1e6 / n, host.as_secs_f64() * 1e6 / n)
        };
        run(); // compile, fill the pool and the bind group cache
        let s0 = g.submit_stats();
        let (mut times, mut host): (Vec<f64>, Vec<f64>) = (0..reps).map(|_| run()).unzip();
        let subs = (g.submit_stats().op_submissions - s0.op_submissions) / reps as u64;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (med, host) = (median(&mut times), median(&mut host));
        let b = *base.get_or_insert(med);
        println!(
            "{batch:>10} {med:>12.2} {host:>12.2} {subs:>14} {:>11.2}x",
            b / med
        );
    }
}
