//! Uploads the device copies from registered host memory
//! (`VK_EXT_external_memory_host`): what lands in the slot, which tensors
//! take that way and which are copied by the host, and the end of a
//! registration. lavapipe has the extension, so CI runs these for real.

mod common;

use std::alloc::{Layout, alloc_zeroed, dealloc};

use common::ctx;
use megatrain_gpu::{GpuExecutor, GpuOptions, Uploads};
use megatrain_tensor::{DType, Executor, HostSlice, Shape, WeightSlot, WeightUpload, bf16, f16};

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

/// Where each tensor of the test layer sits in the pages, in bytes.
const A_AT: usize = 0; // f32 [5, 7]: copied by the device
const B_AT: usize = 256; // bf16 [3, 11], odd length: copied by the device
const C_AT: usize = 512; // bf16 [13] held as f32: widened by the host
const D_AT: usize = 770; // bf16 [2, 5] at 2 mod 4: copied by the host
const E_AT: usize = 4000; // f16 [8, 25] across a page boundary: by the device

fn fill(p: &mut Pages, seed: f32) {
    let b = p.bytes_mut();
    let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
    let a: Vec<f32> = (0..35).map(|i| seed + i as f32 * 0.5).collect();
    put(A_AT, bytemuck::cast_slice(&a));
    let v: Vec<bf16> = (0..33).map(|i| bf16::from_f32(seed - i as f32)).collect();
    put(B_AT, bytemuck::cast_slice(&v));
    let v: Vec<bf16> = (0..13).map(|i| bf16::from_f32(seed * 2.0 + i as f32)).collect();
    put(C_AT, bytemuck::cast_slice(&v));
    let v: Vec<bf16> = (0..10).map(|i| bf16::from_f32(-seed + i as f32 * 0.25)).collect();
    put(D_AT, bytemuck::cast_slice(&v));
    let v: Vec<f16> = (0..200).map(|i| f16::from_f32(seed + i as f32 * 0.125)).collect();
    put(E_AT, bytemuck::cast_slice(&v));
}

struct Shapes([Shape; 5]);

impl Shapes {
    fn new() -> Self {
        Shapes([
            Shape::new([5, 7]),
            Shape::new([3, 11]),
            Shape::new([13]),
            Shape::new([2, 5]),
            Shape::new([8, 25]),
        ])
    }

    fn uploads<'a>(&'a self, p: &'a Pages) -> Vec<WeightUpload<'a>> {
        let s = &self.0;
        vec![
            WeightUpload {
                shape: &s[0],
                data: HostSlice::F32(p.at(A_AT, 35)),
                dtype: DType::F32,
            },
            WeightUpload {
                shape: &s[1],
                data: HostSlice::BF16(p.at(B_AT, 33)),
                dtype: DType::BF16,
            },
            WeightUpload {
                shape: &s[2],
                data: HostSlice::BF16(p.at(C_AT, 13)),
                dtype: DType::F32,
            },
            WeightUpload {
                shape: &s[3],
                data: HostSlice::BF16(p.at(D_AT, 10)),
                dtype: DType::BF16,
            },
            WeightUpload {
                shape: &s[4],
                data: HostSlice::F16(p.at(E_AT, 200)),
                dtype: DType::F16,
            },
        ]
    }
}

/// Bytes of the tensors the device copies itself: A, B and E.
const DIRECT_BYTES: u64 = 35 * 4 + 33 * 2 + 200 * 2;

fn expected(p: &Pages) -> Vec<f32> {
    let mut v: Vec<f32> = p.at::<f32>(A_AT, 35).to_vec();
    v.extend(p.at::<bf16>(B_AT, 33).iter().map(|x| x.to_f32()));
    v.extend(p.at::<bf16>(C_AT, 13).iter().map(|x| x.to_f32()));
    v.extend(p.at::<bf16>(D_AT, 10).iter().map(|x| x.to_f32()));
    v.extend(p.at::<f16>(E_AT, 200).iter().map(|x| x.to_f32()));
    v
}

fn loaded(g: &GpuExecutor, slot: WeightSlot, shapes: &Shapes, p: &Pages) -> Vec<f32> {
    let w = g.load_weights(slot, &shapes.uploads(p)).unwrap();
    let d = g.begin_download(w).unwrap();
    let mut out = vec![f32::NAN; 291];
    g.finish_download(d, &mut out).unwrap();
    out
}

const SLOT: WeightSlot = WeightSlot { kind: 1, index: 0 };

#[test]
fn registered_host_memory_is_copied_by_the_device_and_only_where_it_can_be() {
    let Some(ctx) = ctx() else { return };
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
    let shapes = Shapes::new();
    let mut pages = Pages::new(2);
    fill(&mut pages, 1.0);
    // Before registering: every byte copied by the host.
    let s0 = g.transport_stats();
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages));
    assert_eq!(g.transport_stats().since(&s0).bytes_up_direct, 0);

    // SAFETY: `pages` outlives the registration (dropped below first), and
    // it is rewritten only after a download queued after each load.
    let reg = unsafe { g.register_host(pages.bytes()) }.unwrap();
    let reg = reg.expect("the device imports page-aligned host memory");
    let again = unsafe { g.register_host(pages.bytes()) }.unwrap_err();
    assert!(again.to_string().contains("already registered"), "{again}");

    let s0 = g.transport_stats();
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages));
    let s = g.transport_stats().since(&s0);
    assert_eq!(s.bytes_up_direct, DIRECT_BYTES, "A, B and E only");
    assert_eq!(s.uploads, 1);

    // New contents are read at the next load: nothing is cached.
    fill(&mut pages, -3.0);
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages));

    // Two slots loaded before either is read.
    let other = WeightSlot { kind: 1, index: 1 };
    let w1 = g.load_weights(SLOT, &shapes.uploads(&pages)).unwrap();
    let w2 = g.load_weights(other, &shapes.uploads(&pages)).unwrap();
    for w in [w1, w2] {
        let d = g.begin_download(w).unwrap();
        let mut out = vec![f32::NAN; 291];
        g.finish_download(d, &mut out).unwrap();
        assert_eq!(out, expected(&pages));
    }

    // Ended: the host copies again.
    drop(reg);
    fill(&mut pages, 7.0);
    let s0 = g.transport_stats();
    assert_eq!(loaded(&g, SLOT, &shapes, &pages), expected(&pages));
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
