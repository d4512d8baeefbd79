//! Criterion bench of the fused step on a slab larger than the last-level
//! cache (the 100M-parameter table with the triad bound is
//! `cargo xtask bench-adamw`).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use megatrain_adamw::{AdamW, AdamWConfig, SlabState, SlabUpdate, Transport};

const N: usize = 16 << 20;

fn bench(c: &mut Criterion) {
    let opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut p: Vec<f32> = (0..N).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let mut g: Vec<f32> = (0..N).map(|i| (i % 777) as f32 * 1e-4 - 0.03).collect();
    let (mut m, mut v) = (vec![0.0f32; N], vec![0.0f32; N]);
    let mut copy = vec![bf16::ZERO; N];
    let mut state = SlabState::new();

    let mut group = c.benchmark_group("adamw_16M");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(28 * N as u64));
    group.bench_function("update", |b| {
        b.iter(|| {
            opt.step(&mut state, 1e-3, SlabUpdate::new(&mut p, &mut g, &mut m, &mut v))
                .unwrap()
        })
    });
    group.throughput(Throughput::Bytes(30 * N as u64));
    group.bench_function("update+bf16", |b| {
        b.iter(|| {
            let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).transport(Transport::Bf16(&mut copy));
            opt.step(&mut state, 1e-3, u).unwrap()
        })
    });
    // As the trainer runs it where gradients are held (accumulation,
    // clipping): the gradient is zeroed for the next step in the same call.
    group.throughput(Throughput::Bytes(34 * N as u64));
    group.bench_function("update+bf16+zero_grad", |b| {
        b.iter(|| {
            let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v)
                .transport(Transport::Bf16(&mut copy))
                .zero_grad(true);
            opt.step(&mut state, 1e-3, u).unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
