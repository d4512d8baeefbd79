//! Criterion bench of the LM head's weight gradient summed over chunks on
//! the CPU executor: `matmul_backward` then `add_assign` (a fresh f32
//! gradient of the head's size per chunk, then a pass adding it) against
//! `matmul_backward_into` (2^22 elements of it at a time, added as they
//! come). TinyLlama-1.1B's head (32,000 × 2,048), a chunk of 256 rows.
//! `cargo bench -p megatrain-tensor --bench cpu_head_db`.

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{CpuExecutor, Executor, HostTensor, MatmulNeeds, Transpose};

const ROWS: usize = 256;
const HIDDEN: usize = 2048;
const VOCAB: usize = 32_000;

fn bench(c: &mut Criterion) {
    let ex = CpuExecutor::new();
    let up = |seed, shape: [usize; 2]| {
        ex.upload(&HostTensor::from_f32(shape, random_f32(seed, shape[0] * shape[1])).unwrap())
            .unwrap()
    };
    let (x, w, dy) = (
        up(1, [ROWS, HIDDEN]),
        up(2, [VOCAB, HIDDEN]),
        up(3, [ROWS, VOCAB]),
    );
    let mut acc = up(4, [VOCAB, HIDDEN]);
    let db = MatmulNeeds {
        da: false,
        db: true,
        dbias: false,
    };
    let mut group = c.benchmark_group("cpu_head_db");
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    group.throughput(Throughput::Elements((2 * ROWS * VOCAB * HIDDEN) as u64));
    group.bench_function("db then add_assign", |b| {
        b.iter(|| {
            let g = ex.matmul_backward(&x, &w, &dy, Transpose::NT, db).unwrap();
            ex.add_assign(&mut acc, g.db.as_ref().unwrap()).unwrap();
        })
    });
    let none = MatmulNeeds { db: false, ..db };
    group.bench_function("matmul_backward_into", |b| {
        b.iter(|| {
            ex.matmul_backward_into(&x, &w, &dy, Transpose::NT, none, &mut acc)
                .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
