//! Matmul throughput. criterion's "elements" are floating-point operations
//! (2·M·N·K per product), so its Gelem/s reads as GFLOP/s.

mod common;

use criterion::{Criterion, Throughput};
use megatrain_tensor::{DType, Executor, Transpose};

fn bench(c: &mut Criterion) {
    let Some(g) = common::executor() else { return };
    // (M, K, N, transpose, b dtype)
    let mut shapes = vec![
        (256, 256, 256, Transpose::NN, DType::F32),
        (512, 512, 512, Transpose::NN, DType::F32),
        (1024, 768, 3072, Transpose::NT, DType::F32),
        (1024, 768, 3072, Transpose::NT, DType::BF16),
    ];
    if common::is_real_gpu(&g) {
        shapes.extend([
            (2048, 2048, 2048, Transpose::NN, DType::F32),
            (4096, 4096, 4096, Transpose::NN, DType::F32),
            (4096, 4096, 4096, Transpose::NT, DType::F32),
            (4096, 4096, 4096, Transpose::NT, DType::BF16),
        ]);
    }
    let mut group = c.benchmark_group("matmul");
    group.sample_size(10);
    for (m, k, n, t, dt) in shapes {
        let a = g.upload(&common::rand(1, &[m, k])).unwrap();
        let bd = if t.b { [n, k] } else { [k, n] };
        let b = g.upload(&common::rand(2, &bd).to_dtype(dt)).unwrap();
        group.throughput(Throughput::Elements(2 * (m * n * k) as u64));
        let name = format!(
            "{m}x{k}x{n}_{}{}_{dt}",
            if t.a { "T" } else { "N" },
            if t.b { "T" } else { "N" }
        );
        group.bench_function(name, |bench| {
            bench.iter(|| {
                let y = g.matmul(&a, &b, None, t).unwrap();
                g.synchronize().unwrap();
                y
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
