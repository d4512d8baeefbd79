//! Criterion bench of the CPU executor's matmul with a weight stored f32
//! against the same weight stored bf16 (widened a panel at a time inside
//! the op), on TinyLlama-1.1B's shapes at B×T = 32: the LM head
//! (32,000 × 2,048) and the MLP's gate (5,632 × 2,048), both `x · Wᵀ`.
//! `cargo bench -p megatrain-tensor --bench cpu_matmul`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{CpuExecutor, DType, Executor, HostTensor, MatmulNeeds, Transpose};

const ROWS: usize = 32;
const HIDDEN: usize = 2048;

fn bench(c: &mut Criterion) {
    let ex = CpuExecutor::new();
    let x = ex
        .upload(&HostTensor::from_f32([ROWS, HIDDEN], random_f32(1, ROWS * HIDDEN)).unwrap())
        .unwrap();
    for (name, n) in [("head", 32_000), ("gate", 5_632)] {
        let w32 = HostTensor::from_f32([n, HIDDEN], random_f32(2, n * HIDDEN))
            .unwrap()
            .to_dtype(DType::BF16)
            .to_dtype(DType::F32);
        let dy = ex
            .upload(&HostTensor::from_f32([ROWS, n], random_f32(3, ROWS * n)).unwrap())
            .unwrap();
        let mut group = c.benchmark_group(format!("cpu_matmul_{name}"));
        group.sample_size(10);
        group.throughput(Throughput::Elements((2 * ROWS * n * HIDDEN) as u64));
        for dtype in [DType::F32, DType::BF16] {
            let w = ex.upload(&w32.to_dtype(dtype)).unwrap();
            group.bench_function(format!("forward {dtype}"), |b| {
                b.iter(|| ex.matmul(&x, &w, None, Transpose::NT).unwrap())
            });
            let da = MatmulNeeds {
                da: true,
                db: false,
                dbias: false,
            };
            group.bench_function(format!("backward da {dtype}"), |b| {
                b.iter(|| ex.matmul_backward(&x, &w, &dy, Transpose::NT, da).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
