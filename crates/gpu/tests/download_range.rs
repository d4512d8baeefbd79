//! Partial downloads (`begin_download_range`): any range of a layer's
//! tensors — cut inside f32 and 16-bit tensors, at odd elements, across
//! tensor boundaries, empty — comes back as the CPU executor gives it, with
//! several ranges of the same tensors in flight, over both transports.

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions, TransportChoice};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{DType, Executor, HostTensor, Shape};

fn executors() -> Vec<GpuExecutor> {
    let Some(ctx) = ctx() else { return Vec::new() };
    let mapped = ctx.features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    [TransportChoice::Staging, TransportChoice::Mapped]
        .into_iter()
        .filter(|&t| t == TransportChoice::Staging || mapped)
        .map(|transport| {
            GpuExecutor::with_options(
                ctx.clone(),
                GpuOptions {
                    transport,
                    ..Default::default()
                },
            )
        })
        .collect()
}

/// An f32 tensor, a bf16 one, an f16 one and an f32 one, all of odd sizes.
fn host_tensors() -> Vec<HostTensor> {
    let shapes: [(&[usize], DType); 4] = [
        (&[3, 5], DType::F32),
        (&[7, 3], DType::BF16),
        (&[9], DType::F16),
        (&[2, 7], DType::F32),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, (s, d))| {
            let shape = Shape::new(s.to_vec());
            let f = HostTensor::from_f32(shape.clone(), random_f32(40 + i as u64, shape.numel())).unwrap();
            f.to_dtype(*d)
        })
        .collect()
}

#[test]
fn every_range_matches_the_cpu_executor() {
    let hosts = host_tensors();
    let c = cpu();
    let ct: Vec<_> = hosts.iter().map(|h| c.upload(h).unwrap()).collect();
    let total: usize = hosts.iter().map(|h| h.shape().numel()).sum();
    let mut all = vec![0.0f32; total];
    let d = c.begin_download_range(&ct, 0..total).unwrap();
    c.finish_download_range(d, &ct, &mut all).unwrap();
    let mut ranges = Vec::new();
    for start in 0..=total {
        for end in [start, start + 1, start + 2, start + 7, start + 16, total] {
            if end <= total {
                ranges.push(start..end);
            }
        }
    }
    for g in executors() {
        let gt: Vec<_> = hosts.iter().map(|h| g.upload(h).unwrap()).collect();
        // Three ranges in flight at once, finished in the order begun.
        for group in ranges.chunks(3) {
            let begun: Vec<_> = group
                .iter()
                .map(|r| (r.clone(), g.begin_download_range(&gt, r.clone()).unwrap()))
                .collect();
            for (r, d) in begun {
                let mut out = vec![f32::NAN; r.len()];
                g.finish_download_range(d, &gt, &mut out).unwrap();
                assert_eq!(out, all[r.clone()], "range {r:?}");
            }
        }
    }
}

#[test]
fn ranges_past_the_end_are_refused() {
    let hosts = host_tensors();
    let total: usize = hosts.iter().map(|h| h.shape().numel()).sum();
    let c = cpu();
    let ct: Vec<_> = hosts.iter().map(|h| c.upload(h).unwrap()).collect();
    let err = c.begin_download_range(&ct, 3..total + 1).unwrap_err();
    assert!(err.to_string().contains("begin_download_range"), "{err}");
    for g in executors() {
        let gt: Vec<_> = hosts.iter().map(|h| g.upload(h).unwrap()).collect();
        let err = g.begin_download_range(&gt, 0..total + 1).unwrap_err();
        assert!(err.to_string().contains(&format!("{}", total + 1)), "{err}");
        let d = g.begin_download_range(&gt, 2..5).unwrap();
        let err = g.finish_download_range(d, &gt, &mut [0.0; 2]).unwrap_err();
        assert!(err.to_string().contains("destination"), "{err}");
    }
}
