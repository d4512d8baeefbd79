//! Uploads the device copies from registered host memory
//! (`VK_EXT_external_memory_host`): what lands in the slot, which tensors
//! take that way and which are copied by the host, and the end of a
//! registration. lavapipe has the extension, so CI runs these for real.

mod common;

use std::alloc::{Layout, alloc_zeroed, dealloc};

use std::sync::Arc;

use common::ctx;
use megatrain_gpu::{
    CopyQueueChoice, CopyQueueStats, GpuContext, GpuExecutor, GpuOptions, Uploads, download_staging_bytes,
};
use megatrain_tensor::{DType, Executor, HostSlice, HostTensor, Shape, WeightSlot, WeightUpload, bf16, f16};

const PAGE: usize = 4096;

/// Zeroed, page-aligned host memory, as the tier's buffers are.
struct Pages {
    ptr: *mut u8,
    len: usize,
}

impl Pages {
    fn new(pages: usize) -> Self {
        let len = pages * PAGE;
        // SAFETY: a non-zero size and a power-of-two alignment.
        let ptr = unsafe { alloc_zeroed(Layout::from_size_align(len, PAGE).unwrap()) };
        assert!(!ptr.is_null());
        Pages { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated and zeroed in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn at<T: bytemuck::Pod>(&self, byte: usize, n: usize) -> &[T] {
        bytemuck::cast_slice(&self.bytes()[byte..byte + n * size_of::<T>()])
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.len, PAGE).unwrap()) }
    }
}

/// The test layer in the pages: byte offset, shape, stored and held dtype.
/// The device copies an f32 matrix, an odd-length bf16 matrix and an f16
/// matrix across a page boundary; the host widens a bf16 vector to f32 and
/// copies a bf16 matrix at 2 mod 4.
const LAYOUT: [(usize, &[usize], DType, DType); 5] = [
    (0, &[5, 7], DType::F32, DType::F32),
    (256, &[3, 11], DType::BF16, DType::BF16),
    (512, &[13], DType::BF16, DType::F32),
    (770, &[2, 5], DType::BF16, DType::BF16),
    (4000, &[8, 25], DType::F16, DType::F16),
];

/// Writes each tensor of [`LAYOUT`], its values a function of `seed`.
fn fill(p: &mut Pages, seed: f32) {
    let b = p.bytes_mut();
    for (t, &(at, dims, stored, _)) in LAYOUT.iter().enumerate() {
        let n: usize = dims.iter().product();
        let x = |j: usize| seed * (t + 1) as f32 - j as f32 * 0.25;
        let bytes: Vec<u8> = match stored {
            DType::F32 => (0..n).flat_map(|j| x(j).to_le_bytes()).collect(),
            DType::BF16 => (0..n).flat_map(|j| bf16::from_f32(x(j)).to_le_bytes()).collect(),
            DType::F16 => (0..n).flat_map(|j| f16::from_f32(x(j)).to_le_bytes()).collect(),
        };
        b[at..at + bytes.len()].copy_from_slice(&bytes);
    }
}

/// [`LAYOUT`]'s tensors as they lie in `p`, stored dtype, with their shapes.
fn slices<'a>(p: &'a Pages, shapes: &'a [Shape]) -> Vec<(HostSlice<'a>, &'a Shape, DType)> {
    LAYOUT
        .iter()
        .zip(shapes)
        .map(|(&(at, _, stored, held), shape)| {
            let n = shape.numel();
            let data = match stored {
                DType::F32 => HostSlice::F32(p.at(at, n)),
                DType::BF16 => HostSlice::BF16(p.at(at, n)),
                DType::F16 => HostSlice::F16(p.at(at, n)),
            };
            (data, shape, held)
        })
        .collect()
}

fn shapes() -> Vec<Shape> {
    LAYOUT
        .iter()
        .map(|&(_, dims, _, _)| Shape::new(dims.to_vec()))
        .collect()
}

fn uploads<'a>(p: &'a Pages, shapes: &'a [Shape]) -> Vec<WeightUpload<'a>> {
    slices(p, shapes)
        .into_iter()
        .map(|(data, shape, dtype)| WeightUpload { shape, data, dtype })
        .collect()
}

/// Bytes of the tensors the device copies itself: the f32, the odd bf16
/// and the f16 matrix.
const DIRECT_BYTES: u64 = 35 * 4 + 33 * 2 + 200 * 2;

fn expected(p: &Pages, shapes: &[Shape]) -> Vec<f32> {
    let mut v = Vec::new();
    for (data, shape, _) in slices(p, shapes) {
        let mut wide = vec![0.0; shape.numel()];
        data.widen_into(&mut wide);
        v.extend(wide);
    }
    v
}

fn loaded(g: &GpuExecutor, slot: WeightSlot, shapes: &[Shape], p: &Pages) -> Vec<f32> {
    let w = g.load_weights(slot, &uploads(p, shapes)).unwrap();
    let d = g.begin_download(w).unwrap();
    let mut out = vec![f32::NAN; 291];
    g.finish_download(d, &mut out).unwrap();
    out
}

const SLOT: WeightSlot = WeightSlot { kind: 1, index: 0 };

/// A device whose copies from registered memory run on a copy queue: a
/// queue of their own where the device has a second one, else wgpu's own
/// (lavapipe: the synchronization runs, nothing overlaps). `None` without
/// host memory import.
fn copy_queue_ctx() -> Option<Arc<GpuContext>> {
    ctx()?;
    let c = GpuContext::with_some_copy_queue().unwrap();
    c.copy_queue().is_some().then_some(c)
}

#[test]
fn registered_host_memory_is_copied_by_the_device_and_only_where_it_can_be() {
    let Some(ctx) = ctx() else { return };
    direct_uploads(ctx);
}

/// Which queue each choice opens: lavapipe has one queue (family 0,
/// count 1), so `auto` finds none there and `shared` takes wgpu's own.
#[test]
fn each_copy_queue_choice_opens_the_queue_it_names() {
    let Some(ctx) = ctx() else { return };
    if !ctx.info.name.contains("llvmpipe") || !ctx.can_import_host_memory() {
        eprintln!("{}: not lavapipe; choices not pinned here", ctx.info);
        return;
    }
    for (choice, want) in [
        (CopyQueueChoice::Auto, None),
        (CopyQueueChoice::Off, None),
        (CopyQueueChoice::Shared, Some(false)),
    ] {
        let c = GpuContext::with_copy_queue(choice).unwrap();
        assert_eq!(c.copy_queue().map(|(_, overlaps)| overlaps), want, "{choice}");
        assert_eq!(c.copy_queue_refused(), None, "{choice}");
        // A queue is checked as the device opens: a copy up, wgpu's copy
        // waiting for it, and a copy down after that.
        let checked = CopyQueueStats {
            copies: 2,
            copies_after_use: 1,
            submissions_waiting: 1,
        };
        assert_eq!(c.copy_queue_stats(), want.map(|_| checked), "{choice}");
    }
}

/// Downloads on the copy queue stage through a ring of device buffers:
/// device memory the executor counts, as much as `megatrain plan` adds for
/// it, made when downloads are reserved and not again.
#[test]
fn the_download_staging_ring_is_the_device_memory_the_plan_counts() {
    let Some(ctx) = copy_queue_ctx() else { return };
    let g = GpuExecutor::new(ctx);
    // A buffer a download reserved, in three size classes and counts.
    for (elems, count) in [(1021, 2), (300_001, 9), (5000, 60)] {
        let before = g.memory().live_bytes;
        g.reserve_downloads(elems, count).unwrap();
        let ring = g.memory().live_bytes - before;
        assert_eq!(
            ring,
            download_staging_bytes(4 * elems as u64, count),
            "{elems} × {count}"
        );
        g.reserve_downloads(elems, count).unwrap();
        assert_eq!(g.memory().live_bytes - before, ring, "{elems} × {count} again");
    }
    assert_eq!(download_staging_bytes(4 * 300_001, 9), 9 * 1_310_720);
    assert_eq!(download_staging_bytes(4 * 300_001, 60), 60 * 1_310_720);
}

/// The same on the copy queue.
#[test]
fn registered_host_memory_is_copied_on_the_copy_queue() {
    let Some(ctx) = copy_queue_ctx() else { return };
    let (what, _) = ctx.copy_queue().expect("opened with one");
    eprintln!("copy queue: {what}");
    // Where `auto` let a queue go as the device opened, why (a GPU
    // session reads this first).
    let auto = GpuContext::with_copy_queue(CopyQueueChoice::Auto).unwrap();
    if let Some(why) = auto.copy_queue_refused() {
        eprintln!("auto: {why}");
    }
    direct_uploads(ctx);
}

fn direct_uploads(ctx: Arc<GpuContext>) {
    let copy_env = std::env::var(megatrain_gpu::UPLOADS_ENV).is_ok_and(|v| v == "copy");
    if ctx.info.name.contains("llvmpipe") && !copy_env {
        assert!(
            ctx.can_import_host_memory(),
            "lavapipe has VK_EXT_external_memory_host: the device must have been opened with it"
        );
    }
    if !ctx.can_import_host_memory() {
        eprintln!("{}: no host memory import; not tested", ctx.info);
        return;
    }
    let g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            uploads: Uploads::Direct,
            ..Default::default()
        },
    );
    let shapes = shapes();
    let mut pages = Pages::new(2);
    fill(&mut pages, 1.0);
    // Before registering: every byte copied by the host.
    let s0 = g.transport_stats();
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages, &shapes));
    assert_eq!(g.transport_stats().since(&s0).bytes_up_direct, 0);

    // SAFETY: `pages` outlives the registration (dropped below first), and
    // it is rewritten only after a download queued after each load.
    let reg = unsafe { g.register_host(pages.bytes()) }.unwrap();
    let reg = reg.expect("the device imports page-aligned host memory");
    let again = unsafe { g.register_host(pages.bytes()) }.unwrap_err();
    assert!(again.to_string().contains("already registered"), "{again}");

    let s0 = g.transport_stats();
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages, &shapes));
    let s = g.transport_stats().since(&s0);
    assert_eq!(s.bytes_up_direct, DIRECT_BYTES, "A, B and E only");
    assert_eq!(s.uploads, 1);

    // New contents are read at the next load: nothing is cached.
    fill(&mut pages, -3.0);
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages, &shapes));

    // Two slots loaded before either is read.
    let other = WeightSlot { kind: 1, index: 1 };
    let w1 = g.load_weights(SLOT, &uploads(&pages, &shapes)).unwrap();
    let w2 = g.load_weights(other, &uploads(&pages, &shapes)).unwrap();
    for w in [w1, w2] {
        let d = g.begin_download(w).unwrap();
        let mut out = vec![f32::NAN; 291];
        g.finish_download(d, &mut out).unwrap();
        assert_eq!(out, expected(&pages, &shapes));
    }

    // Ended: the host copies again.
    drop(reg);
    fill(&mut pages, 7.0);
    let s0 = g.transport_stats();
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages, &shapes));
    assert_eq!(g.transport_stats().since(&s0).bytes_up_direct, 0);

    // Less than a page holds no whole page: nothing to import.
    let inner = &pages.bytes()[16..PAGE + 16];
    assert!(unsafe { g.register_host(inner) }.unwrap().is_none());
}

/// `Copy` never registers; `Auto` registers except on a CPU adapter.
#[test]
fn copy_uploads_never_register_and_auto_only_off_the_cpu() {
    let Some(ctx) = ctx() else { return };
    let pages = Pages::new(1);
    for uploads in [Uploads::Copy, Uploads::Auto] {
        let g = GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                uploads,
                ..Default::default()
            },
        );
        let want = match uploads {
            Uploads::Auto => ctx.can_import_host_memory() && ctx.info.device_type != "Cpu",
            _ => false,
        };
        let r = unsafe { g.register_host(pages.bytes()) }.unwrap();
        assert_eq!(r.is_some(), want, "{uploads}");
    }
}

/// The copy queue overwrites a slot only after the kernels queued before
/// that read it, and kernels and downloads queued after a copy see it.
/// Two registered page sets, so the host never writes memory a copy may
/// still be reading.
#[test]
fn the_copy_queue_orders_its_copies_with_the_kernels_around_them() {
    let Some(ctx) = copy_queue_ctx() else { return };
    let g = GpuExecutor::with_options(
        ctx.clone(),
        GpuOptions {
            poison_outputs: true,
            uploads: Uploads::Direct,
            ..Default::default()
        },
    );
    let shapes = shapes();
    let (mut a, mut b) = (Pages::new(2), Pages::new(2));
    fill(&mut a, 1.0);
    fill(&mut b, -2.5);
    // SAFETY: both outlive their registrations (dropped first below) and
    // are not written while registered.
    let ra = unsafe { g.register_host(a.bytes()) }
        .unwrap()
        .expect("page-aligned");
    let rb = unsafe { g.register_host(b.bytes()) }
        .unwrap()
        .expect("page-aligned");
    let s0 = g.transport_stats();
    let q0 = ctx.copy_queue_stats().unwrap();
    let mut queued = Vec::new();
    for round in 0..3 {
        for (p, src) in [(&a, 'a'), (&b, 'b')] {
            // Into the same slot each time: each copy must wait for the
            // kernel queued just before it, which reads the slot.
            let w = g.load_weights(SLOT, &uploads(p, &shapes)).unwrap();
            // The f32 matrix comes by the copy queue, the vector (widened
            // by the host) by wgpu's queue.
            let doubled = g.scale(&w[0], 2.0).unwrap();
            let tripled = g.scale(&w[2], 3.0).unwrap();
            queued.push((round, src, doubled, tripled));
        }
    }
    // The last load, read by a download straight from the slot.
    let w = g.load_weights(SLOT, &uploads(&a, &shapes)).unwrap();
    let d = g.begin_download(w).unwrap();
    let mut out = vec![f32::NAN; 291];
    g.finish_download(d, &mut out).unwrap();
    assert_eq!(out, expected(&a, &shapes));
    // Seven uploads, each but the first overwriting a slot a kernel read,
    // and the download's copy out of the staging wgpu's queue filled;
    // each batch of kernels after an upload waited for it, and the
    // download's copy into staging for the last one.
    let q = ctx.copy_queue_stats().unwrap();
    assert_eq!(q.copies - q0.copies, 7 + 1);
    assert_eq!(q.copies_after_use - q0.copies_after_use, 6 + 1);
    assert_eq!(q.submissions_waiting - q0.submissions_waiting, 7);
    for (round, src, doubled, tripled) in queued {
        let p = if src == 'a' { &a } else { &b };
        let want = expected(p, &shapes);
        let got = g.download(&doubled).unwrap();
        let twice: Vec<f32> = want[..35].iter().map(|x| 2.0 * x).collect();
        assert_eq!(
            got.as_f32().unwrap(),
            twice,
            "round {round}, pages {src}: the copied matrix"
        );
        let got = g.download(&tripled).unwrap();
        let thrice: Vec<f32> = want[68..81].iter().map(|x| 3.0 * x).collect();
        assert_eq!(
            got.as_f32().unwrap(),
            thrice,
            "round {round}, pages {src}: the widened vector"
        );
    }
    let s = g.transport_stats().since(&s0);
    assert_eq!(s.bytes_up_direct, 7 * DIRECT_BYTES);
    drop((ra, rb));
    assert_eq!(ctx.registered_host_ranges(), 0);
}

/// `DownloadStaging::Layer`: a layer's chunks come from one device copy of
/// the whole layer, made as its first chunk is begun, and the copy queue
/// takes each chunk from there. Begun as the trainer begins them (two of
/// layer A, two of layer B, then the rest of A, then a new step's A in the
/// same buffers with new values, then the rest of B), every chunk holds
/// its own layer's values of the moment its layer's first chunk was begun,
/// and the copies are device memory (one buffer per layer in flight).
#[test]
fn a_layers_chunks_come_from_one_copy_of_the_layer() {
    let Some(ctx) = copy_queue_ctx() else { return };
    let opts = GpuOptions {
        download_staging: megatrain_gpu::DownloadStaging::Layer,
        ..Default::default()
    };
    let g = GpuExecutor::with_options(ctx, opts);
    let values = |seed: f32, n: usize| -> Vec<f32> { (0..n).map(|i| seed + i as f32 * 0.25).collect() };
    let layer = |seed: f32| -> (Vec<megatrain_gpu::GpuTensor>, Vec<f32>) {
        // Awkward sizes, two tensors: chunks cross from one to the other.
        let (a, b) = (values(seed, 3001), values(seed + 1e4, 1999));
        let t = vec![
            g.upload(&HostTensor::from_f32(Shape::new([3001]), a.clone()).unwrap())
                .unwrap(),
            g.upload(&HostTensor::from_f32(Shape::new([1999]), b.clone()).unwrap())
                .unwrap(),
        ];
        (t, [a, b].concat())
    };
    let chunk = 1021;
    let ranges: Vec<_> = (0..5000usize.div_ceil(chunk))
        .map(|c| c * chunk..((c + 1) * chunk).min(5000))
        .collect();
    let take = |d: megatrain_tensor::Download<megatrain_gpu::GpuTensor>| -> Vec<f32> {
        match g.finish_download_in_place(d).unwrap() {
            Ok(landed) => landed.to_vec(),
            Err(_) => panic!("a copy-queue download lands in place"),
        }
    };
    let (a, a_want) = layer(1.0);
    let (b, b_want) = layer(-7.0);
    let before = g.memory().live_bytes;
    let mut a_first: Vec<_> = ranges[..2]
        .iter()
        .map(|r| g.begin_download_range(&a, r.clone()).unwrap())
        .collect();
    let b_first: Vec<_> = ranges[..2]
        .iter()
        .map(|r| g.begin_download_range(&b, r.clone()).unwrap())
        .collect();
    let copies = g.memory().live_bytes - before;
    assert!(
        copies >= 2 * 5000 * 4,
        "two layers copied on the device: {copies} B"
    );
    for r in &ranges[2..] {
        a_first.push(g.begin_download_range(&a, r.clone()).unwrap());
    }
    let got_a: Vec<f32> = a_first.into_iter().flat_map(take).collect();
    assert_eq!(got_a, a_want, "layer A");
    // A new step's gradients in A's buffers: its first chunk copies anew.
    let a2_want = values(5.0, 5000);
    let a2 = vec![
        g.upload(&HostTensor::from_f32(Shape::new([3001]), a2_want[..3001].to_vec()).unwrap())
            .unwrap(),
        g.upload(&HostTensor::from_f32(Shape::new([1999]), a2_want[3001..].to_vec()).unwrap())
            .unwrap(),
    ];
    let a2_got: Vec<f32> = ranges
        .iter()
        .map(|r| g.begin_download_range(&a2, r.clone()).unwrap())
        .collect::<Vec<_>>()
        .into_iter()
        .flat_map(take)
        .collect();
    assert_eq!(a2_got, a2_want, "layer A again");
    let mut b_all = b_first;
    for r in &ranges[2..] {
        b_all.push(g.begin_download_range(&b, r.clone()).unwrap());
    }
    let got_b: Vec<f32> = b_all.into_iter().flat_map(take).collect();
    assert_eq!(got_b, b_want, "layer B, begun before A's rest and A's next step");
}
