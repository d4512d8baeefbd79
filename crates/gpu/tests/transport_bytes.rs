//! Bytes through the transports: payloads of awkward sizes (odd element
//! counts, not multiples of 4, 256 or the copy block, larger than one ring
//! entry) cross intact both ways with several transfers in flight; buffers
//! are reused once warm; the transport's counters add up.

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions, TransportChoice};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{
    DType, Executor, HostSlice, HostTensor, Landed, Shape, WeightSlot, WeightUpload, bf16, f16,
};

/// Staging entries of 1 KiB (every layer crosses in many pieces, the ring
/// wraps several times per layer) or the default 32 MiB; 3 copy threads.
fn executor(t: TransportChoice, tiny_chunks: bool) -> Option<GpuExecutor> {
    let ctx = ctx()?;
    if t == TransportChoice::Mapped && !ctx.features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS) {
        eprintln!("adapter lacks MAPPABLE_PRIMARY_BUFFERS: mapped transport not tested");
        return None;
    }
    Some(GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            transport: t,
            staging_depth: Some(3),
            staging_chunk_bytes: tiny_chunks.then_some(1000),
            copy_threads: Some(3),
            ..Default::default()
        },
    ))
}

/// Each transport with tiny and default entries, and the largest element
/// count to use with it (a layer crosses a 1 KiB ring in pieces of 1 KiB:
/// the largest tiny-chunk layer is 28 pieces, not thousands).
fn all() -> Vec<(String, GpuExecutor, usize)> {
    let mut v = Vec::new();
    for t in [TransportChoice::Staging, TransportChoice::Mapped] {
        for tiny in [true, false] {
            if let Some(g) = executor(t, tiny) {
                v.push((
                    format!("{t} tiny_chunks={tiny}"),
                    g,
                    if tiny { 2_049 } else { 700_001 },
                ));
            }
        }
    }
    v
}

/// A layer of awkward tensors: f32, bf16 kept as bf16, f16 kept as f16,
/// bf16 widened to f32 — element counts `n`, `n + 1`, `2n + 3`, `n + 5`.
struct Layer {
    shapes: Vec<Shape>,
    f: Vec<f32>,
    b: Vec<bf16>,
    h: Vec<f16>,
    w: Vec<bf16>,
}

impl Layer {
    fn new(seed: u64, n: usize) -> Self {
        let bf = |s, k| random_f32(s, k).iter().map(|&x| bf16::from_f32(x)).collect();
        Layer {
            shapes: vec![
                Shape::new([n]),
                Shape::new([n + 1]),
                Shape::new([2 * n + 3]),
                Shape::new([n + 5]),
            ],
            f: random_f32(seed, n),
            b: bf(seed ^ 1, n + 1),
            h: random_f32(seed ^ 2, 2 * n + 3)
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect(),
            w: bf(seed ^ 3, n + 5),
        }
    }

    fn uploads(&self) -> Vec<WeightUpload<'_>> {
        let s = &self.shapes;
        vec![
            WeightUpload {
                shape: &s[0],
                data: HostSlice::F32(&self.f),
                dtype: DType::F32,
            },
            WeightUpload {
                shape: &s[1],
                data: HostSlice::BF16(&self.b),
                dtype: DType::BF16,
            },
            WeightUpload {
                shape: &s[2],
                data: HostSlice::F16(&self.h),
                dtype: DType::F16,
            },
            WeightUpload {
                shape: &s[3],
                data: HostSlice::BF16(&self.w),
                dtype: DType::F32,
            },
        ]
    }

    fn expected_bits(&self) -> Vec<u32> {
        let mut v: Vec<f32> = self.f.clone();
        v.extend(self.b.iter().map(|x| x.to_f32()));
        v.extend(self.h.iter().map(|x| x.to_f32()));
        v.extend(self.w.iter().map(|x| x.to_f32()));
        v.into_iter().map(f32::to_bits).collect()
    }

    fn numel(&self) -> usize {
        self.shapes.iter().map(Shape::numel).sum()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Element counts: tiny, around 256 bytes, past one 1 KiB entry, past the
/// 1 MiB copy block several times over (the parallel copies).
const SIZES: [usize; 5] = [1, 63, 301, 2_049, 700_001];

#[test]
fn awkward_payloads_cross_intact_with_several_in_flight() {
    for (name, g, max) in all() {
        for n in SIZES.into_iter().filter(|&n| n <= max) {
            // Gradients already on the device, downloads begun before the
            // uploads and finished after them: both directions in flight.
            let grads: Vec<HostTensor> = (0..3)
                .map(|i| {
                    HostTensor::from_f32([n + 2 * i + 1], random_f32(100 + i as u64, n + 2 * i + 1)).unwrap()
                })
                .collect();
            let on_dev: Vec<_> = grads.iter().map(|h| g.upload(h).unwrap()).collect();
            let early: Vec<_> = on_dev
                .iter()
                .map(|t| g.begin_download(vec![t.clone(), t.clone()]).unwrap())
                .collect();
            // More layers in flight than ring entries, each in its own slot.
            let layers: Vec<Layer> = (0..5).map(|i| Layer::new(10 * n as u64 + i, n)).collect();
            let loaded: Vec<_> = layers
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    g.load_weights(WeightSlot { kind: 7, index: i }, &l.uploads())
                        .unwrap()
                })
                .collect();
            let back: Vec<_> = loaded
                .iter()
                .map(|w| g.begin_download(w.clone()).unwrap())
                .collect();
            for (i, d) in early.into_iter().enumerate().rev() {
                let mut out = vec![f32::NAN; 2 * grads[i].numel()];
                g.finish_download(d, &mut out).unwrap();
                let want = bits(&grads[i].to_f32_vec());
                assert_eq!(bits(&out[..want.len()]), want, "{name} n={n}: gradient {i}");
                assert_eq!(
                    bits(&out[want.len()..]),
                    want,
                    "{name} n={n}: gradient {i}, second copy"
                );
            }
            for (i, d) in back.into_iter().enumerate().rev() {
                let mut out = vec![f32::NAN; layers[i].numel()];
                g.finish_download(d, &mut out).unwrap();
                assert!(
                    bits(&out) == layers[i].expected_bits(),
                    "{name} n={n}: layer {i} changed on the way"
                );
            }
        }
    }
}

#[test]
fn buffers_are_reused_once_warm() {
    for (name, g, max) in all() {
        let layers: Vec<Layer> = [301usize, max].iter().map(|&n| Layer::new(n as u64, n)).collect();
        let grads = g
            .upload(&HostTensor::from_f32([1_000_003], random_f32(9, 1_000_003)).unwrap())
            .unwrap();
        let mut out = vec![0.0f32; 1_000_003];
        let round = |r: usize, out: &mut [f32]| {
            for (i, l) in layers.iter().enumerate() {
                let d = g.begin_download(vec![grads.clone()]).unwrap();
                let w = g
                    .load_weights(
                        WeightSlot {
                            kind: 3,
                            index: (r + i) % 2,
                        },
                        &l.uploads(),
                    )
                    .unwrap();
                g.finish_download(d, out).unwrap();
                let mut back = vec![0.0f32; l.numel()];
                let d = g.begin_download(w).unwrap();
                g.finish_download(d, &mut back).unwrap();
                assert!(bits(&back) == l.expected_bits(), "{name}: round {r} layer {i}");
            }
        };
        for r in 0..3 {
            round(r, &mut out);
        }
        let (before, host) = (g.transport_stats(), g.transport_host_bytes());
        let live = g.memory().live_bytes;
        for r in 3..6 {
            round(r, &mut out);
        }
        let d = g.transport_stats().since(&before);
        assert_eq!(
            d.buffers_created, 0,
            "{name}: new staging/readback buffers once warm: {d:?}"
        );
        assert_eq!(g.transport_host_bytes(), host, "{name}: host-visible bytes grew");
        assert_eq!(g.memory().live_bytes, live, "{name}: device bytes grew");
        assert_eq!((d.uploads, d.downloads), (6, 12), "{name}: {d:?}");
    }
}

#[test]
fn counters_add_up() {
    for (name, g, n) in all() {
        let l = Layer::new(5, n);
        let s0 = g.transport_stats();
        let w = g
            .load_weights(WeightSlot { kind: 2, index: 0 }, &l.uploads())
            .unwrap();
        g.synchronize().unwrap();
        let s1 = g.transport_stats();
        let d = g.begin_download(w).unwrap();
        let mut out = vec![0.0; l.numel()];
        g.finish_download(d, &mut out).unwrap();
        let up = s1.since(&s0);
        let down = g.transport_stats().since(&s1);
        // The slot's bytes: tensors at 4-byte-rounded, aligned offsets.
        let held: u64 = l.uploads().iter().map(|u| u.held_bytes()).sum();
        assert!(
            up.bytes_up >= held && up.bytes_up < held + 4 * 1024,
            "{name}: {up:?}"
        );
        assert_eq!((up.uploads, up.downloads), (1, 0), "{name}");
        assert!(up.up_fill_ns > 0 && up.up_submit_ns > 0, "{name}: {up:?}");
        assert_eq!(down.downloads, 1, "{name}");
        let exact = (4 * n + 2 * (n + 1) + 2 * (2 * n + 3) + 4 * (n + 5)) as u64;
        assert!(
            down.bytes_down >= exact && down.bytes_down < exact + 16,
            "{name}: {down:?}"
        );
        assert!(
            down.down_read_ns > 0 && down.down_wait_copy_ns > 0,
            "{name}: {down:?}"
        );
        assert!(down.down_bus_ms() > 0.0 && up.up_bus_ms() > 0.0);
        assert!(bits(&out) == l.expected_bits(), "{name}");
    }
}

/// Range downloads of f32 tensors are handed over where they landed: the
/// bits a copying finish gives, chunks crossing from one tensor into the
/// next, several held at once and dropped on another thread. Their buffers
/// go back to the pool (once reserved, none is made) and count as the
/// transport's while lent. A range holding 16-bit tensors comes back
/// unfinished and finishes by copy.
#[test]
fn f32_downloads_are_read_in_place() {
    for (name, g, max) in all() {
        let (a, b) = (random_f32(11, max), random_f32(12, max + 3));
        let want: Vec<f32> = a.iter().chain(&b).copied().collect();
        let tensors = vec![
            g.upload(&HostTensor::from_f32([max], a).unwrap()).unwrap(),
            g.upload(&HostTensor::from_f32([max + 3], b).unwrap()).unwrap(),
        ];
        let total = want.len();
        let chunk = total / 3 + 7;
        let ranges: Vec<_> = (0..total)
            .step_by(chunk)
            .map(|s| s..(s + chunk).min(total))
            .collect();
        g.reserve_downloads(chunk, 2 * ranges.len()).unwrap();
        let (s0, host) = (g.transport_stats(), g.transport_host_bytes());
        for round in 0..3 {
            let begun: Vec<_> = ranges
                .iter()
                .map(|r| g.begin_download_range(&tensors, r.clone()).unwrap())
                .collect();
            let landed: Vec<Landed> = begun
                .into_iter()
                .map(|d| {
                    g.finish_download_in_place(d)
                        .unwrap()
                        .expect("f32 lands in place")
                })
                .collect();
            for (r, l) in ranges.iter().zip(&landed) {
                assert!(bits(l) == bits(&want[r.clone()]), "{name} round {round}: {r:?}");
            }
            assert_eq!(g.transport_host_bytes(), host, "{name}: lent buffers are counted");
            std::thread::spawn(move || drop(landed)).join().unwrap();
        }
        let d = g.transport_stats().since(&s0);
        assert_eq!(d.buffers_created, 0, "{name}: {d:?}");
        assert_eq!(d.downloads_in_place, 3 * ranges.len() as u64, "{name}: {d:?}");
        assert_eq!(d.down_read_ns, 0, "{name}: nothing read on the host: {d:?}");

        let l = Layer::new(7, 1001);
        let w = g
            .load_weights(WeightSlot { kind: 4, index: 0 }, &l.uploads())
            .unwrap();
        let d = g.begin_download_range(&w, 0..l.numel()).unwrap();
        let d = g
            .finish_download_in_place(d)
            .unwrap()
            .expect_err("16-bit tensors are widened on the host");
        let mut out = vec![0.0; l.numel()];
        g.finish_download_range(d, &w, &mut out).unwrap();
        assert!(bits(&out) == l.expected_bits(), "{name}");
    }
}
