//! Fused causal attention, forward and backward. Throughput counts the
//! useful (causal) score and value FLOPs: 2·2·B·Hq·D·T(T+1)/2 forward.

mod common;

use criterion::{Criterion, Throughput};
use megatrain_tensor::Executor;

fn bench(c: &mut Criterion) {
    let Some(g) = common::executor() else { return };
    let mut shapes = vec![(1, 256, 8, 2, 64), (1, 512, 8, 2, 64)];
    if common::is_real_gpu(&g) {
        shapes.extend([(4, 2048, 32, 8, 128), (8, 1024, 12, 12, 64)]);
    }
    let mut group = c.benchmark_group("attention");
    group.sample_size(10);
    for (b, t, hq, hkv, d) in shapes {
        let q = g.upload(&common::rand(1, &[b, t, hq, d])).unwrap();
        let k = g.upload(&common::rand(2, &[b, t, hkv, d])).unwrap();
        let v = g.upload(&common::rand(3, &[b, t, hkv, d])).unwrap();
        let dout = g.upload(&common::rand(4, &[b, t, hq, d])).unwrap();
        let flops = 4 * (b * hq * d * t * (t + 1) / 2) as u64;
        let name = format!("B{b}_T{t}_Hq{hq}_Hkv{hkv}_D{d}");
        group.throughput(Throughput::Elements(flops));
        group.bench_function(format!("fwd_{name}"), |bench| {
            bench.iter(|| {
                let o = g.attention(&q, &k, &v).unwrap();
                g.synchronize().unwrap();
                o
            })
        });
        let fwd = g.attention(&q, &k, &v).unwrap();
        // Backward recomputes the scores and does 4 more products: ~2.5x forward.
        group.throughput(Throughput::Elements(flops * 5 / 2));
        group.bench_function(format!("bwd_{name}"), |bench| {
            bench.iter(|| {
                let gr = g.attention_backward(&q, &k, &v, &fwd, &dout).unwrap();
                g.synchronize().unwrap();
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
