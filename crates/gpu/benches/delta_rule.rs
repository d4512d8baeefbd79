//! The gated delta rule (Qwen3.5's and Qwen3-Next's linear attention),
//! forward and backward, on its SIMT kernels. Throughput counts 7·Dk·Dv
//! FLOPs a value head a token forward (decaying, reading, writing and
//! reading out the state) and twice that backward (the chunk's replay
//! not counted), as `ModelConfig::mixer_flops_per_token` does.
//!
//! On a GPU at Qwen3.5-9B's and Qwen3-Next's heads (16 key heads, 32 value
//! heads, Dk = Dv = 128) for B·T = 8×1024 and 2×4096; elsewhere one small
//! shape. Each shape is checked against the CPU reference first at B = 1.

mod common;

use criterion::{Criterion, Throughput};
use megatrain_gpu::GpuExecutor;
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{CpuExecutor, Executor, HostTensor, Shape};

/// (B, T, Hk, Hv, Dk, Dv).
type Dims = (usize, usize, usize, usize, usize, usize);

/// Operands as the model feeds them: q and k l2-normalised (q scaled by
/// Dk^−½), g = −softplus(·) < 0, β = σ(·).
fn inputs((b, t, hk, hv, dk, dv): Dims) -> [HostTensor; 5] {
    let unit = |seed, scale: f32| {
        let mut x = common::rand(seed, &[b, t, hk, dk]).to_f32_vec();
        for row in x.chunks_mut(dk) {
            let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            row.iter_mut().for_each(|v| *v *= scale / n);
        }
        HostTensor::from_f32(Shape::new(vec![b, t, hk, dk]), x).expect("sized")
    };
    let map = |seed, f: fn(f32) -> f32| {
        let x = common::rand(seed, &[b, t, hv])
            .to_f32_vec()
            .into_iter()
            .map(f)
            .collect();
        HostTensor::from_f32(Shape::new(vec![b, t, hv]), x).expect("sized")
    };
    [
        unit(1, 1.0 / (dk as f32).sqrt()),
        unit(2, 1.0),
        common::rand(3, &[b, t, hv, dv]),
        map(4, |x| -(1.0 + (2.0 * x).exp()).ln()),
        map(5, |x| 1.0 / (1.0 + (-3.0 * x).exp())),
    ]
}

/// The GPU's output and gradients against the CPU's at `dims` (B = 1).
fn check(g: &GpuExecutor, dims: Dims) {
    let dims = (1, dims.1, dims.2, dims.3, dims.4, dims.5);
    let x = inputs(dims);
    let dout = common::rand(6, &[dims.0, dims.1, dims.3, dims.5]);
    let c = CpuExecutor::new();
    let cx: Vec<_> = x.iter().map(|h| c.upload(h).unwrap()).collect();
    let cf = c
        .gated_delta_rule(&cx[0], &cx[1], &cx[2], &cx[3], &cx[4], None)
        .unwrap();
    let cd = c.upload(&dout).unwrap();
    let cg = c
        .gated_delta_rule_backward(&cx[0], &cx[1], &cx[2], &cx[3], &cx[4], &cf, &cd)
        .unwrap();
    let gx: Vec<_> = x.iter().map(|h| g.upload(h).unwrap()).collect();
    let gf = g
        .gated_delta_rule(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], None)
        .unwrap();
    let gd = g.upload(&dout).unwrap();
    let gg = g
        .gated_delta_rule_backward(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], &gf, &gd)
        .unwrap();
    let pairs = [
        ("out", &cf.out, &gf.out),
        ("dq", &cg.dq, &gg.dq),
        ("dk", &cg.dk, &gg.dk),
        ("dv", &cg.dv, &gg.dv),
        ("dg", &cg.dg, &gg.dg),
        ("dbeta", &cg.dbeta, &gg.dbeta),
    ];
    for (name, want, got) in pairs {
        let want: Vec<f64> = c
            .download(want)
            .unwrap()
            .to_f32_vec()
            .iter()
            .map(|&v| v as f64)
            .collect();
        let got = g.download(got).unwrap().to_f32_vec();
        let err = rel_norm_err(&got, &want);
        assert!(
            err < 1e-4,
            "gated_delta_rule {name} at {dims:?}: relative error {err:e}"
        );
    }
}

fn bench(c: &mut Criterion) {
    let Some(g) = common::executor() else { return };
    let shapes: Vec<Dims> = match common::is_real_gpu(&g) {
        true => vec![(8, 1024, 16, 32, 128, 128), (2, 4096, 16, 32, 128, 128)],
        false => vec![(1, 128, 2, 4, 32, 32)],
    };
    let mut group = c.benchmark_group("delta_rule");
    group.sample_size(10);
    for dims in shapes {
        check(&g, dims);
        let (b, t, hk, hv, dk, dv) = dims;
        let x: Vec<_> = inputs(dims).iter().map(|h| g.upload(h).unwrap()).collect();
        let dout = g.upload(&common::rand(6, &[b, t, hv, dv])).unwrap();
        let fwd_flops = 7 * (b * t * hv * dk * dv) as u64;
        let name = format!("B{b}_T{t}_Hk{hk}_Hv{hv}_Dk{dk}_Dv{dv}");
        group.throughput(Throughput::Elements(fwd_flops));
        group.bench_function(format!("fwd_{name}"), |bch| {
            bch.iter(|| {
                let f = g
                    .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None)
                    .unwrap();
                g.synchronize().unwrap();
                f
            })
        });
        let f = g
            .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None)
            .unwrap();
        group.throughput(Throughput::Elements(2 * fwd_flops));
        group.bench_function(format!("bwd_{name}"), |bch| {
            bch.iter(|| {
                let d = g
                    .gated_delta_rule_backward(&x[0], &x[1], &x[2], &x[3], &x[4], &f, &dout)
                    .unwrap();
                g.synchronize().unwrap();
                d
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
