//! The residual add fused with RMSNorm / LayerNorm against the two ops it
//! replaces, forward and backward (`add` + `rmsnorm`; `rmsnorm_backward` +
//! `add_assign`). Throughput counts the bytes the fused op must move: the
//! forward reads x and r and writes h and y (16 bytes an element), the
//! backward reads h, dy and dh and writes dx (16), plus the weight-gradient
//! sums' second read of h and dy (8): a floor at the memory bandwidth.
//! Run: cargo bench -p megatrain-gpu --bench add_norm

mod common;

use criterion::{Criterion, Throughput};
use megatrain_tensor::Executor;

fn bench(c: &mut Criterion) {
    let Some(g) = common::executor() else { return };
    // (rows = B·T, C): a lavapipe-sized one; TinyLlama and Qwen2.5-7B widths
    // at 8×1024 tokens on a real GPU.
    let mut shapes = vec![(256, 300)];
    if common::is_real_gpu(&g) {
        shapes.extend([(8192, 2048), (8192, 3584)]);
    }
    let mut group = c.benchmark_group("add_norm");
    group.sample_size(10);
    for (rows, cols) in shapes {
        let up = |seed, dims: &[usize]| g.upload(&common::rand(seed, dims)).unwrap();
        let (x, r, dy, dh) = (
            up(1, &[rows, cols]),
            up(2, &[rows, cols]),
            up(3, &[rows, cols]),
            up(4, &[rows, cols]),
        );
        let (w, b) = (up(5, &[cols]), up(6, &[cols]));
        let elems = (rows * cols) as u64;
        let name = format!("{rows}x{cols}");
        let sync = || g.synchronize().unwrap();

        group.throughput(Throughput::Bytes(16 * elems));
        group.bench_function(format!("rms_fwd_fused_{name}"), |bench| {
            bench.iter(|| {
                let o = g.add_rmsnorm(&x, &r, &w, 1e-5).unwrap();
                sync();
                o
            })
        });
        group.bench_function(format!("rms_fwd_unfused_{name}"), |bench| {
            bench.iter(|| {
                let h = g.add(&x, &r).unwrap();
                let o = g.rmsnorm(&h, &w, 1e-5).unwrap();
                sync();
                (h, o)
            })
        });
        group.bench_function(format!("ln_fwd_fused_{name}"), |bench| {
            bench.iter(|| {
                let o = g.add_layernorm(&x, &r, &w, &b, 1e-5).unwrap();
                sync();
                o
            })
        });

        let f = g.add_rmsnorm(&x, &r, &w, 1e-5).unwrap();
        group.throughput(Throughput::Bytes(24 * elems));
        group.bench_function(format!("rms_bwd_fused_{name}"), |bench| {
            bench.iter(|| {
                let gr = g.add_rmsnorm_backward(&f.h, &w, &f.norm.rstd, &dy, &dh).unwrap();
                sync();
                gr
            })
        });
        group.bench_function(format!("rms_bwd_unfused_{name}"), |bench| {
            bench.iter(|| {
                let mut gr = g.rmsnorm_backward(&f.h, &w, &f.norm.rstd, &dy).unwrap();
                g.add_assign(&mut gr.dx, &dh).unwrap();
                sync();
                gr
            })
        });
        let l = g.add_layernorm(&x, &r, &w, &b, 1e-5).unwrap();
        let mean = l.norm.mean.as_ref().unwrap();
        group.bench_function(format!("ln_bwd_fused_{name}"), |bench| {
            bench.iter(|| {
                let gr = g
                    .add_layernorm_backward(&l.h, &w, mean, &l.norm.rstd, &dy, &dh)
                    .unwrap();
                sync();
                gr
            })
        });
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
