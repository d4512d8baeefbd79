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

/// A whole download past `DOWNLOAD_SPLIT_BYTES` travels in pieces (each
/// decoded while the next copies): an f32, a bf16 and an f16 tensor of odd
/// sizes, so that pieces are cut inside 16-bit tensors and across tensor
/// boundaries, come back as the CPU executor gives them; two such
/// downloads in flight at once finish in either order; asked in place, a
/// download in pieces comes back for `finish_download`; a destination of
/// the wrong length is refused, and the pool's buffers still serve the
/// next download. The same with `download_pieces: Some(1)` (one piece, as
/// before).
#[test]
fn large_downloads_in_pieces_match_the_cpu_executor() {
    let split = megatrain_gpu::DOWNLOAD_SPLIT_BYTES as usize;
    let shapes: [(usize, DType); 3] = [
        (split / 8 + 3, DType::F32),
        (split / 2 + 1, DType::BF16),
        (1_000_003, DType::F16),
    ];
    let hosts: Vec<HostTensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, d))| {
            HostTensor::from_f32(Shape::new(vec![n]), random_f32(60 + i as u64, n))
                .unwrap()
                .to_dtype(d)
        })
        .collect();
    let bytes: usize = shapes.iter().map(|&(n, d)| n * d.size_in_bytes()).sum();
    assert!(bytes >= split, "{bytes} bytes do not reach the split");
    let c = cpu();
    let ct: Vec<_> = hosts.iter().map(|h| c.upload(h).unwrap()).collect();
    let total: usize = shapes.iter().map(|s| s.0).sum();
    let mut want = vec![0.0f32; total];
    let d = c.begin_download(ct).unwrap();
    c.finish_download(d, &mut want).unwrap();
    let one_piece = ctx().map(|c| {
        GpuExecutor::with_options(
            c,
            GpuOptions {
                download_pieces: Some(1),
                ..Default::default()
            },
        )
    });
    let families = executors().into_iter().map(|g| (true, g));
    for (pieces, g) in families.chain(one_piece.map(|g| (false, g))) {
        let gt: Vec<_> = hosts.iter().map(|h| g.upload(h).unwrap()).collect();
        let first = g.begin_download(gt.clone()).unwrap();
        let second = g.begin_download(gt.clone()).unwrap();
        let (mut a, mut b) = (vec![f32::NAN; total], vec![f32::NAN; total]);
        g.finish_download(second, &mut b).unwrap();
        g.finish_download(first, &mut a).unwrap();
        assert!(
            a == want && b == want,
            "{}: pieces differ from the CPU's",
            g.name()
        );
        let f32_only = g.upload(&hosts[0].to_dtype(DType::F32)).unwrap();
        let big = vec![f32_only.clone(), f32_only.clone(), f32_only.clone(), f32_only];
        let n: usize = big.iter().map(|t| t.numel()).sum();
        let d = g.begin_download(big).unwrap();
        let mut got = vec![f32::NAN; n];
        match (pieces, g.finish_download_in_place(d).unwrap()) {
            (true, Ok(_)) => panic!("{}: a download in pieces landed in one place", g.name()),
            (false, Ok(landed)) => got.copy_from_slice(&landed),
            (_, Err(d)) => g.finish_download(d, &mut got).unwrap(),
        }
        let h0 = hosts[0].to_f32_vec();
        assert!(got.chunks(h0.len()).all(|c| c == h0), "{}: f32 pieces", g.name());
        let d = g.begin_download(gt.clone()).unwrap();
        let err = g.finish_download(d, &mut vec![0.0; total - 1]).unwrap_err();
        assert!(err.to_string().contains("destination"), "{err}");
        let d = g.begin_download(gt).unwrap();
        let mut again = vec![f32::NAN; total];
        g.finish_download(d, &mut again).unwrap();
        assert!(again == want, "{}: after a refused destination", g.name());
    }
}
