//! The two layer transports on this adapter: a layer's upload into
//! alternating weight slots (until the device holds it), a gradient
//! download (begin + finish), and the calibration's round trip (upload, a
//! matmul that reads every weight, download). criterion's bytes/s are of
//! the transport bytes moved. On a machine lent a real GPU, run
//! `cargo bench -p megatrain-gpu --bench transport` and record both rows.

mod common;

use std::sync::Arc;

use criterion::{Criterion, Throughput};
use megatrain_gpu::{GpuContext, GpuExecutor, GpuOptions, TransportChoice};
use megatrain_tensor::{DType, Executor, HostSlice, Shape, Transpose, WeightSlot, WeightUpload};

fn bench(c: &mut Criterion) {
    let Ok(ctx) = GpuContext::new() else {
        eprintln!("no GPU adapter, skipping transport benches");
        return;
    };
    eprintln!("bench device: {}", ctx.info);
    let mut choices = vec![TransportChoice::Staging];
    if ctx.features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS) {
        choices.push(TransportChoice::Mapped);
    }
    let mut sizes_mib = vec![1usize, 16, 64];
    if ctx.info.device_type != "Cpu" {
        sizes_mib.push(256);
    }
    let mut group = c.benchmark_group("transport");
    group.sample_size(10);
    for t in choices {
        let g = GpuExecutor::with_options(
            Arc::clone(&ctx),
            GpuOptions {
                transport: t,
                ..Default::default()
            },
        );
        g.warm_up();
        for &mib in &sizes_mib {
            let cols = 1024usize;
            let rows = mib * (1 << 20) / 4 / cols;
            let host = vec![0.25f32; rows * cols];
            let shape = Shape::new([rows, cols]);
            let up = |i: usize| {
                g.load_weights(
                    WeightSlot {
                        kind: 0,
                        index: i % 2,
                    },
                    &[WeightUpload {
                        shape: &shape,
                        data: HostSlice::F32(&host),
                        dtype: DType::F32,
                    }],
                )
                .unwrap()
            };
            let x = g.zeros(&Shape::new([8, cols])).unwrap();
            let grads = g.zeros(&Shape::new([rows * cols])).unwrap();
            let mut out = vec![0.0f32; rows * cols];
            group.throughput(Throughput::Bytes((rows * cols * 4) as u64));
            let mut i = 0;
            group.bench_function(format!("{t}/upload_{mib}MiB"), |b| {
                b.iter(|| {
                    up(i);
                    i += 1;
                    g.synchronize().unwrap();
                })
            });
            group.bench_function(format!("{t}/download_{mib}MiB"), |b| {
                b.iter(|| {
                    let d = g.begin_download(vec![grads.clone()]).unwrap();
                    g.finish_download(d, &mut out).unwrap();
                })
            });
            group.throughput(Throughput::Bytes((2 * rows * cols * 4) as u64));
            let mut back = vec![0.0f32; rows * cols + 8 * rows];
            group.bench_function(format!("{t}/round_trip_matmul_{mib}MiB"), |b| {
                b.iter(|| {
                    let w = up(i);
                    i += 1;
                    let y = g.matmul(&x, &w[0], None, Transpose::NT).unwrap();
                    let d = g.begin_download(vec![grads.clone(), y]).unwrap();
                    g.finish_download(d, &mut back).unwrap();
                })
            });
        }
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
