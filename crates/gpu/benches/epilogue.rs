//! The MLP's products with the activation applied at their store (the
//! matmul epilogues) against the product and the standalone activation
//! kernel they replace: SwiGLU (Llama's up projection forward, the down
//! projection's input gradient backward) and GELU (GPT-2's fc forward, proj
//! backward). criterion's "elements" are the product's FLOPs (2·M·N·K), so
//! Gelem/s reads as GFLOP/s; the fused row saves the activation's pass over
//! the [rows, I] intermediates (backward: reading dS, gate, up and writing
//! dgate, dup becomes reading gate, up and writing dgate, dup at the store).
//! Rows: `{act}_{fwd|bwd}_{fused|unfused}_{precision}_{rows}x{C}x{I}`.
//! Run: cargo bench -p megatrain-gpu --bench epilogue

mod common;

use criterion::{Criterion, Throughput};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::{ComputePrecision, Executor, MatmulNeeds, Transpose};

const DA: MatmulNeeds = MatmulNeeds {
    da: true,
    db: false,
    dbias: false,
};

fn bench_shape(c: &mut Criterion, g: &GpuExecutor, tag: &str, rows: usize, ch: usize, inter: usize) {
    let mut group = c.benchmark_group("epilogue");
    group.sample_size(10);
    let up = |seed, dims: &[usize]| g.upload(&common::rand(seed, dims)).unwrap();
    let sync = || g.synchronize().unwrap();
    let name = format!("{tag}_{rows}x{ch}x{inter}");
    group.throughput(Throughput::Elements(2 * (rows * ch * inter) as u64));

    // SwiGLU (Llama: weights [out, in], NT).
    let (x, w_up, w_down) = (up(1, &[rows, ch]), up(2, &[inter, ch]), up(3, &[ch, inter]));
    let (gate, upm, dy) = (up(4, &[rows, inter]), up(5, &[rows, inter]), up(6, &[rows, ch]));
    let s = g.swiglu(&gate, &upm).unwrap();
    let nt = Transpose::NT;
    group.bench_function(format!("swiglu_fwd_fused_{name}"), |b| {
        b.iter(|| {
            let o = g.matmul_swiglu(&x, &w_up, None, nt, &gate).unwrap();
            sync();
            o
        })
    });
    group.bench_function(format!("swiglu_fwd_unfused_{name}"), |b| {
        b.iter(|| {
            let u = g.matmul(&x, &w_up, None, nt).unwrap();
            let s = g.swiglu(&gate, &u).unwrap();
            sync();
            (u, s)
        })
    });
    group.bench_function(format!("swiglu_bwd_fused_{name}"), |b| {
        b.iter(|| {
            let o = g
                .matmul_backward_swiglu(&s, &w_down, &dy, nt, DA, &gate, &upm)
                .unwrap();
            sync();
            o
        })
    });
    group.bench_function(format!("swiglu_bwd_unfused_{name}"), |b| {
        b.iter(|| {
            let gr = g.matmul_backward(&s, &w_down, &dy, nt, DA).unwrap();
            let o = g.swiglu_backward(&gate, &upm, gr.da.as_ref().unwrap()).unwrap();
            sync();
            o
        })
    });

    // GELU (GPT-2: Conv1D weights [in, out], NN, with biases).
    let nn = Transpose::NN;
    let (w_fc, b_fc, w_proj) = (up(7, &[ch, inter]), up(8, &[inter]), up(9, &[inter, ch]));
    let (f, gl) = g.matmul_gelu(&x, &w_fc, Some(&b_fc), nn).unwrap();
    group.bench_function(format!("gelu_fwd_fused_{name}"), |b| {
        b.iter(|| {
            let o = g.matmul_gelu(&x, &w_fc, Some(&b_fc), nn).unwrap();
            sync();
            o
        })
    });
    group.bench_function(format!("gelu_fwd_unfused_{name}"), |b| {
        b.iter(|| {
            let f = g.matmul(&x, &w_fc, Some(&b_fc), nn).unwrap();
            let a = g.gelu(&f).unwrap();
            sync();
            (f, a)
        })
    });
    group.bench_function(format!("gelu_bwd_fused_{name}"), |b| {
        b.iter(|| {
            let o = g.matmul_backward_gelu(&gl, &w_proj, &dy, nn, DA, &f).unwrap();
            sync();
            o
        })
    });
    group.bench_function(format!("gelu_bwd_unfused_{name}"), |b| {
        b.iter(|| {
            let gr = g.matmul_backward(&gl, &w_proj, &dy, nn, DA).unwrap();
            let o = g.gelu_backward(&f, gr.da.as_ref().unwrap()).unwrap();
            sync();
            o
        })
    });
    group.finish();
}

fn bench(c: &mut Criterion) {
    let Some(mut g) = common::executor() else { return };
    let real = common::is_real_gpu(&g);
    // (rows = B·T, C, I): a lavapipe-sized MLP; on a real GPU GPT-2 small,
    // TinyLlama and Qwen2.5-7B at 8×1024 tokens.
    let shapes: &[(usize, usize, usize)] = if real {
        &[(8192, 768, 3072), (8192, 2048, 5632), (8192, 3584, 18944)]
    } else {
        &[(200, 96, 260)]
    };
    for &(rows, ch, inter) in shapes {
        bench_shape(c, &g, "f32", rows, ch, inter);
    }
    if real {
        // Tensor cores where the adapter has them: the products are fast,
        // so the activation's pass is a larger share.
        g.set_compute_precision(ComputePrecision::F16).unwrap();
        for &(rows, ch, inter) in shapes {
            bench_shape(c, &g, "f16", rows, ch, inter);
        }
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
