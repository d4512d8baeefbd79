//! The two layer transports: weight slots (tensors at offsets in one
//! buffer), gradient downloads in flight, the per-adapter choice, and reuse
//! of bind groups across steps.

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions, TransportChoice};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{
    DType, Download, Executor, HostSlice, HostTensor, Shape, TensorHandle, Transpose, WeightSlot,
    WeightUpload, bf16, f16,
};

fn executor(t: TransportChoice, small_bindings: bool) -> Option<GpuExecutor> {
    let ctx = ctx()?;
    let mapped_ok = ctx.features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    if t == TransportChoice::Mapped && !mapped_ok {
        eprintln!("adapter lacks MAPPABLE_PRIMARY_BUFFERS: mapped transport not tested");
        return None;
    }
    Some(GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            transport: t,
            max_binding_bytes: small_bindings.then_some(4096),
            ..Default::default()
        },
    ))
}

fn both() -> Vec<(TransportChoice, GpuExecutor)> {
    [TransportChoice::Staging, TransportChoice::Mapped]
        .into_iter()
        .filter_map(|t| executor(t, false).map(|e| (t, e)))
        .collect()
}

/// A layer like a bf16 transport copy: an f32 matrix, a bf16 matrix of odd
/// size, a bf16 vector widened to f32.
struct Layer {
    shapes: [Shape; 3],
    a: Vec<f32>,
    b: Vec<bf16>,
    c: Vec<bf16>,
}

impl Layer {
    fn new(seed: u64) -> Self {
        let shapes = [Shape::new([5, 7]), Shape::new([3, 11]), Shape::new([13])];
        let b = random_f32(seed ^ 1, 33)
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        let c = random_f32(seed ^ 2, 13)
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        Layer {
            a: random_f32(seed, 35),
            b,
            c,
            shapes,
        }
    }

    fn uploads(&self) -> Vec<WeightUpload<'_>> {
        vec![
            WeightUpload {
                shape: &self.shapes[0],
                data: HostSlice::F32(&self.a),
                dtype: DType::F32,
            },
            WeightUpload {
                shape: &self.shapes[1],
                data: HostSlice::BF16(&self.b),
                dtype: DType::BF16,
            },
            WeightUpload {
                shape: &self.shapes[2],
                data: HostSlice::BF16(&self.c),
                dtype: DType::F32,
            },
        ]
    }

    fn expected(&self) -> Vec<f32> {
        let mut v = self.a.clone();
        v.extend(self.b.iter().map(|x| x.to_f32()));
        v.extend(self.c.iter().map(|x| x.to_f32()));
        v
    }
}

const SLOT: WeightSlot = WeightSlot { kind: 1, index: 0 };

#[test]
fn slots_hold_what_was_loaded_and_reloading_replaces_it() {
    for (t, g) in both() {
        let l1 = Layer::new(1);
        let w = g.load_weights(SLOT, &l1.uploads()).unwrap();
        assert_eq!(
            w.iter().map(|x| x.dtype()).collect::<Vec<_>>(),
            [DType::F32, DType::BF16, DType::F32]
        );
        assert!(
            w[1].offset() > 0 && w[2].offset() > w[1].offset(),
            "{t}: one buffer, tensors at offsets"
        );
        let d = g.begin_download(w.clone()).unwrap();
        let mut out = vec![0.0; 81];
        g.finish_download(d, &mut out).unwrap();
        assert_eq!(out, l1.expected(), "{t}");

        let live = g.memory().live_bytes;
        let l2 = Layer::new(2);
        let w2 = g.load_weights(SLOT, &l2.uploads()).unwrap();
        assert_eq!(
            g.memory().live_bytes,
            live,
            "{t}: the same slot buffer is rewritten"
        );
        for (old, new) in w.iter().zip(&w2) {
            let (mut a, mut b) = (vec![0.0; old.numel()], vec![0.0; new.numel()]);
            g.download_into(old, &mut a).unwrap();
            g.download_into(new, &mut b).unwrap();
            assert_eq!(a, b, "{t}: earlier handles of a slot read its new weights");
        }
        let d = g.begin_download(w2).unwrap();
        g.finish_download(d, &mut out).unwrap();
        assert_eq!(out, l2.expected(), "{t}");

        // Another slot of the same kind is another buffer.
        let other = WeightSlot { kind: 1, index: 1 };
        let w3 = g.load_weights(other, &l1.uploads()).unwrap();
        let d = g.begin_download(w3).unwrap();
        g.finish_download(d, &mut out).unwrap();
        assert_eq!(out, l1.expected(), "{t}");
        assert!(g.memory().live_bytes > live, "{t}: slot bytes are device bytes");

        // A different table in the same slot gets a buffer of its own layout.
        let s = Shape::new([2, 3]);
        let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w4 = g
            .load_weights(
                SLOT,
                &[WeightUpload {
                    shape: &s,
                    data: HostSlice::F32(&v),
                    dtype: DType::F32,
                }],
            )
            .unwrap();
        let mut o = [0.0; 6];
        g.download_into(&w4[0], &mut o).unwrap();
        assert_eq!(o, v, "{t}");
    }
}

#[test]
fn ops_read_slot_tensors_at_their_offsets() {
    for small in [false, true] {
        for t in [TransportChoice::Staging, TransportChoice::Mapped] {
            let Some(g) = executor(t, small) else { continue };
            let (m, k, n) = (9usize, 37usize, 29usize);
            let x = HostTensor::from_f32([m, k], random_f32(5, m * k)).unwrap();
            let bias: Vec<f32> = random_f32(6, n);
            let wf = random_f32(7, n * k);
            let wb: Vec<bf16> = random_f32(8, n * k).iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = random_f32(9, n * k).iter().map(|&v| f16::from_f32(v)).collect();
            let (sw, sb) = (Shape::new([n, k]), Shape::new([n]));
            let ws = g
                .load_weights(
                    SLOT,
                    &[
                        WeightUpload {
                            shape: &sb,
                            data: HostSlice::F32(&bias),
                            dtype: DType::F32,
                        },
                        WeightUpload {
                            shape: &sw,
                            data: HostSlice::F32(&wf),
                            dtype: DType::F32,
                        },
                        WeightUpload {
                            shape: &sw,
                            data: HostSlice::BF16(&wb),
                            dtype: DType::BF16,
                        },
                        WeightUpload {
                            shape: &sw,
                            data: HostSlice::F16(&wh),
                            dtype: DType::F16,
                        },
                    ],
                )
                .unwrap();
            let gx = g.upload(&x).unwrap();
            let c = cpu();
            let cx = c.upload(&x).unwrap();
            let cb = c.upload_slice(&sb, HostSlice::F32(&bias)).unwrap();
            for (i, data) in [
                (1, HostSlice::F32(&wf)),
                (2, HostSlice::BF16(&wb)),
                (3, HostSlice::F16(&wh)),
            ] {
                let cw = c.upload_slice(&sw, data).unwrap();
                let want = c.matmul(&cx, &cw, Some(&cb), Transpose::NT).unwrap();
                let got = g.matmul(&gx, &ws[i], Some(&ws[0]), Transpose::NT).unwrap();
                assert_close(
                    &format!("{t} small={small} weight {i}"),
                    &down(&g, &got),
                    &down_cpu(&c, &want),
                    TOL_F32,
                );
            }
        }
    }
}

#[test]
fn downloads_overlap_and_finish_in_any_order() {
    for (t, g) in both() {
        let hs: Vec<HostTensor> = (0..3)
            .map(|i| HostTensor::from_f32([4 + i, 3], random_f32(i as u64, 12 + 3 * i)).unwrap())
            .collect();
        let ts: Vec<_> = hs.iter().map(|h| g.upload(h).unwrap()).collect();
        let started: Vec<_> = ts
            .iter()
            .map(|x| g.begin_download(vec![x.clone(), x.clone()]).unwrap())
            .collect();
        for (i, d) in started.into_iter().enumerate().rev() {
            let mut out = vec![0.0; 2 * hs[i].numel()];
            g.finish_download(d, &mut out).unwrap();
            let want = hs[i].to_f32_vec();
            assert_eq!(&out[..want.len()], &want[..], "{t} download {i}");
            assert_eq!(&out[want.len()..], &want[..], "{t} download {i}");
        }
        // A wrong destination is an error and does not lose the buffer.
        let d = g.begin_download(vec![ts[0].clone()]).unwrap();
        let Download::Ticket { id, numel } = d else {
            panic!("{t}: the GPU issues tickets")
        };
        assert_eq!(numel, 12);
        let err = g
            .finish_download(Download::Ticket { id, numel }, &mut [0.0; 5])
            .unwrap_err();
        assert!(err.to_string().contains("12 elements"), "{t}: {err}");
        let err = g
            .finish_download(Download::Ticket { id, numel }, &mut [0.0; 12])
            .unwrap_err();
        assert!(
            err.to_string().contains("unknown or already finished"),
            "{t}: {err}"
        );
        let d = g.begin_download(vec![ts[0].clone()]).unwrap();
        let mut out = [0.0; 12];
        g.finish_download(d, &mut out).unwrap();
        assert_eq!(out.to_vec(), hs[0].to_f32_vec(), "{t}");
        // Tensors handed over as such are plain downloads.
        let mut out = [0.0; 12];
        g.finish_download(Download::Tensors(vec![ts[0].clone()]), &mut out)
            .unwrap();
        assert_eq!(out.to_vec(), hs[0].to_f32_vec(), "{t}");
        assert!(
            g.finish_download(Download::Tensors(vec![ts[0].clone()]), &mut [0.0; 3])
                .is_err()
        );
    }
}

#[test]
fn auto_measures_both_transports_and_keeps_the_faster() {
    let Some(g) = executor(TransportChoice::Auto, false) else {
        return;
    };
    let info = g.prepare_transport(1 << 20, 1 << 20).unwrap().unwrap();
    eprintln!("{info:?}");
    let has_mapped = g
        .context()
        .features
        .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
    if has_mapped {
        assert_eq!(info.measured_ms.len(), 2, "{info:?}");
        let best = info
            .measured_ms
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap();
        assert_eq!(info.name, best.0, "{info:?}");
        assert!(info.measured_ms.iter().all(|(_, ms)| *ms > 0.0));
    } else {
        assert_eq!(info.name, "staging");
    }
    assert_eq!(g.transport_info(), Some(info.clone()));
    // Nor does it leave host-visible buffers behind: its staging ring and
    // the readback buffers of its whole downloads (1 MiB each; on the
    // H200 a TinyLlama run held ~45 MB of them through every step).
    assert_eq!(g.transport_host_bytes(), 0, "after the calibration");
    // The calibration's slots are gone; the chosen transport works.
    let l = Layer::new(3);
    let w = g.load_weights(SLOT, &l.uploads()).unwrap();
    let mut out = vec![0.0; 81];
    let d = g.begin_download(w).unwrap();
    g.finish_download(d, &mut out).unwrap();
    assert_eq!(out, l.expected());

    let forced = executor(TransportChoice::Staging, false).unwrap();
    let info = forced.prepare_transport(1 << 20, 1 << 20).unwrap().unwrap();
    assert_eq!((info.name.as_str(), info.measured_ms.len()), ("staging", 0));
    assert!(info.reason.contains("--transport"), "{info:?}");
}

#[test]
fn a_repeated_step_makes_no_new_bind_groups() {
    for (t, g) in both() {
        let step = |seed: u64| {
            let l = Layer::new(seed);
            let w = g
                .load_weights(
                    WeightSlot {
                        kind: 1,
                        index: (seed % 2) as usize,
                    },
                    &l.uploads(),
                )
                .unwrap();
            let x = g
                .upload(&HostTensor::from_f32([6, 7], random_f32(seed, 42)).unwrap())
                .unwrap();
            let y = g.matmul(&x, &w[0], None, Transpose::NT).unwrap();
            let s = g.scale(&y, 0.5).unwrap();
            let d = g.begin_download(vec![s, w[2].clone()]).unwrap();
            let mut out = vec![0.0; 30 + 13];
            g.finish_download(d, &mut out).unwrap();
            out
        };
        for seed in 0..4 {
            step(seed);
        }
        let before = g.bind_group_stats();
        let a = step(10);
        let b = step(11);
        let after = g.bind_group_stats();
        assert_eq!(after.made, before.made, "{t}: {before:?} -> {after:?}");
        assert!(after.reused > before.reused, "{t}");
        assert_ne!(a, b);
    }
}
