//! The layer transports on this adapter, at the rate of the bus.
//!
//! `cargo bench -p megatrain-gpu --bench transport -- [--reps N] [--max-mib M]
//! [--sizes 16,64,256,1024] [--transport staging|mapped] [--overlap] [--no-torch]
//! [--depth N] [--chunk-mib M] [--threads N] [--download-pieces N]` (the
//! staging ring's entries and their size, the copy threads; defaults 4, 32,
//! cores ≤ 16; and the most pieces a whole download of 16 MiB or more
//! travels in, each decoded while the next copies: default 8, 1 as before)
//!
//! For each transport and payload (f32 bytes, 16 MiB .. 1 GiB; on a CPU
//! adapter up to 256 MiB, which RAM holds five times over): GB/s of an
//! upload (`load_weights` into alternating slots, until the device holds
//! it), a download (`begin_download` + `finish_download`: copied out of the
//! readback buffer, widened), a download read in place as the step's
//! optimizer reads gradients (`begin_download_range` +
//! `finish_download_in_place`: the bytes in host memory, no host copy,
//! which is what PyTorch's pinned `copy_` also ends with) and both at once
//! (a download in flight while the next layer is written), medians of
//! `--reps`; then where each transfer's time went, from the transport's
//! own counters (`TransportStats`): the CPU's writes into mapped memory,
//! unmap/submit, waits on compute queued before a copy, waits on the copy
//! itself, and the CPU's reads out of mapped memory. Where the device
//! imports host memory (`VK_EXT_external_memory_host`), a `direct` row
//! uploads from registered, page-aligned host memory as the step does from
//! its tier: the device copies it, the CPU writes nothing (its downloads
//! are the staging transport's). Beside it PyTorch's
//! pinned `copy_` of the same sizes (`benches/torch_copy.py`) where torch
//! with CUDA imports.
//!
//! `--overlap` answers whether the driver runs a copy and a dispatch at the
//! same time on wgpu's one queue: a host-to-device copy alone, a long
//! matmul alone, then both submitted back to back (each order); 100%
//! overlap means together they take the longer of the two, 0% their sum.
//! Where the device imports host memory, the same for the step's upload
//! (`load_weights` from registered memory), which runs on the copy queue
//! where the device has one (`MEGATRAIN_COPY_QUEUE`, `crate::copy_queue`).

use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use megatrain_gpu::{GpuContext, GpuExecutor, GpuOptions, TransportChoice, Uploads};
use megatrain_tensor::{
    DType, Executor, HostSlice, Shape, TransportStats, Transpose, WeightSlot, WeightUpload,
};

struct Args {
    reps: usize,
    sizes_mib: Option<Vec<u64>>,
    max_mib: Option<u64>,
    transport: Option<TransportChoice>,
    overlap: bool,
    torch: bool,
    depth: Option<usize>,
    chunk_mib: Option<u64>,
    threads: Option<usize>,
    download_pieces: Option<usize>,
}

fn args() -> Args {
    let mut a = Args {
        reps: 5,
        sizes_mib: None,
        max_mib: None,
        transport: None,
        overlap: false,
        torch: true,
        depth: None,
        chunk_mib: None,
        threads: None,
        download_pieces: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(s) = it.next() {
        let mut val = |name: &str| it.next().unwrap_or_else(|| panic!("{name} needs a value"));
        match s.as_str() {
            "--reps" => a.reps = val("--reps").parse().expect("--reps N"),
            "--max-mib" => a.max_mib = Some(val("--max-mib").parse().expect("--max-mib M")),
            "--sizes" => {
                a.sizes_mib = Some(
                    val("--sizes")
                        .split(',')
                        .map(|x| x.trim().parse().expect("--sizes 16,64,..."))
                        .collect(),
                )
            }
            "--transport" => a.transport = Some(val("--transport").parse().expect("--transport")),
            "--depth" => a.depth = Some(val("--depth").parse().expect("--depth N")),
            "--chunk-mib" => a.chunk_mib = Some(val("--chunk-mib").parse().expect("--chunk-mib M")),
            "--threads" => a.threads = Some(val("--threads").parse().expect("--threads N")),
            "--download-pieces" => {
                a.download_pieces = Some(val("--download-pieces").parse().expect("--download-pieces N"))
            }
            "--overlap" => a.overlap = true,
            "--no-torch" => a.torch = false,
            // cargo bench passes --bench; criterion-style filters are ignored.
            _ => {}
        }
    }
    a.reps = a.reps.max(1);
    a
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbs(bytes: u64, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

/// PyTorch's pinned and pageable `copy_` GB/s per size, where it runs.
fn torch(sizes: &[u64], reps: usize) -> Option<Vec<serde_json::Value>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../benches/torch_copy.py");
    let list = sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let out = Command::new("python3")
        .args([script, "--sizes-mib", &list, "--reps", &reps.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "torch peer not run: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("python3 failed")
        );
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    println!("torch peer: torch {} on {}", v["torch"], v["device"]);
    v["sizes"].as_array().cloned()
}

struct Row {
    up: f64,
    down: f64,
    down_in_place: f64,
    both: f64,
    /// Mean wall ms of the timed uploads and downloads (for the rest column).
    up_ms: f64,
    down_ms: f64,
    up_stats: TransportStats,
    down_stats: TransportStats,
}

/// Page-aligned f32s, as the tier's transport copies are (a registration
/// covers whole pages only).
struct PageAligned {
    ptr: *mut f32,
    n: usize,
}

impl PageAligned {
    fn layout(n: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align((4 * n).next_multiple_of(4096).max(4096), 4096).unwrap()
    }

    fn new(n: usize) -> Self {
        // SAFETY: a non-zero size and a power-of-two alignment.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(n)) } as *mut f32;
        assert!(!ptr.is_null(), "out of memory");
        PageAligned { ptr, n }
    }

    fn pages(&self) -> &[u8] {
        // SAFETY: the whole allocation, zeroed at creation.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, Self::layout(self.n).size()) }
    }
}

impl std::ops::Deref for PageAligned {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `n` f32s allocated in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.n) }
    }
}

impl std::ops::DerefMut for PageAligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, through the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.n) }
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr as *mut u8, Self::layout(self.n)) }
    }
}

/// `direct`: the host memory registered, so uploads are copies the device
/// makes from it (the step's tier, `MEGATRAIN_UPLOADS=direct`).
fn measure(g: &GpuExecutor, mib: u64, reps: usize, direct: bool) -> Row {
    let n = (mib << 20) as usize / 4;
    let mut host = PageAligned::new(n);
    host.iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = (i % 4093) as f32);
    // SAFETY: `host` outlives the registration (dropped first, below), and
    // it is never written after the first upload.
    let registration = match direct {
        true => Some(
            unsafe { g.register_host(host.pages()) }
                .unwrap()
                .expect("host memory registers"),
        ),
        false => None,
    };
    let shape = Shape::new([n]);
    let up = |i: usize| {
        g.load_weights(
            WeightSlot {
                kind: 0,
                index: i % 2,
            },
            &[WeightUpload {
                shape: &shape,
                data: HostSlice::F32(&host),
                dtype: DType::F32,
            }],
        )
        .unwrap()
    };
    let grads = g.zeros(&shape).unwrap();
    let mut out = vec![0.0f32; n];
    let bytes = 4 * n as u64;
    let (mut tu, mut td, mut tp, mut tb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut i = 0;
    // Two warm-up rounds (four uploads: every ring entry made, the copy
    // threads started), then the timed reps.
    let mut up_stats = TransportStats::default();
    let mut down_stats = TransportStats::default();
    for rep in 0..reps + 2 {
        let s0 = g.transport_stats();
        let t = Instant::now();
        drop(up(i));
        i += 1;
        g.synchronize().unwrap();
        let t_up = t.elapsed().as_secs_f64();
        let s1 = g.transport_stats();
        let t = Instant::now();
        let d = g.begin_download(vec![grads.clone()]).unwrap();
        g.finish_download(d, &mut out).unwrap();
        let t_down = t.elapsed().as_secs_f64();
        let s2 = g.transport_stats();
        let t = Instant::now();
        let d = g
            .begin_download_range(std::slice::from_ref(&grads), 0..n)
            .unwrap();
        let landed = g
            .finish_download_in_place(d)
            .unwrap()
            .expect("an f32 download lands in place");
        let t_place = t.elapsed().as_secs_f64();
        drop(landed);
        let t = Instant::now();
        let d = g.begin_download(vec![grads.clone()]).unwrap();
        drop(up(i));
        i += 1;
        g.finish_download(d, &mut out).unwrap();
        g.synchronize().unwrap();
        let t_both = t.elapsed().as_secs_f64();
        if rep > 1 {
            tu.push(t_up);
            td.push(t_down);
            tp.push(t_place);
            tb.push(t_both);
            let (u, dn) = (s1.since(&s0), s2.since(&s1));
            up_stats = up_stats.plus(&u);
            down_stats = down_stats.plus(&dn);
        }
    }
    drop(registration);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64 * 1e3;
    Row {
        up_ms: mean(&tu),
        down_ms: mean(&td),
        up: gbs(bytes, median(tu)),
        down: gbs(bytes, median(td)),
        down_in_place: gbs(bytes, median(tp)),
        both: gbs(2 * bytes, median(tb)),
        up_stats,
        down_stats,
    }
}

fn per(ns: u64, n: u64) -> f64 {
    if n == 0 { 0.0 } else { ns as f64 / n as f64 / 1e6 }
}

/// Bytes the overlap measurement copies.
fn overlap_bytes(ctx: &GpuContext) -> u64 {
    if ctx.info.device_type == "Cpu" {
        32 << 20
    } else {
        1 << 30
    }
}

/// A plain buffer copy on wgpu's queue against a matmul.
fn overlap(ctx: &Arc<GpuContext>, g: &GpuExecutor, reps: usize) {
    let bytes = overlap_bytes(ctx);
    let src = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("overlap host"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    });
    src.unmap();
    let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("overlap device"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let copy = || {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&src, 0, &dst, 0, bytes);
        ctx.queue.submit([enc.finish()]);
    };
    overlap_of(ctx, g, reps, &copy, bytes, "a buffer copy on wgpu's one queue");
}

/// The step's upload, `load_weights` from registered host memory, against
/// a matmul: on the copy queue where the device has one
/// (`MEGATRAIN_COPY_QUEUE`), else on wgpu's queue.
fn overlap_direct(ctx: &Arc<GpuContext>, reps: usize) {
    let bytes = overlap_bytes(ctx);
    let g = GpuExecutor::with_options(
        Arc::clone(ctx),
        GpuOptions {
            uploads: Uploads::Direct,
            ..Default::default()
        },
    );
    g.warm_up();
    let n = bytes as usize / 4;
    let host = PageAligned::new(n);
    // SAFETY: `host` outlives the registration (dropped first, below) and
    // is never written.
    let registration = unsafe { g.register_host(host.pages()) }
        .unwrap()
        .expect("host memory registers");
    let shape = Shape::new([n]);
    let load = || {
        drop(
            g.load_weights(
                WeightSlot { kind: 0, index: 0 },
                &[WeightUpload {
                    shape: &shape,
                    data: HostSlice::F32(&host),
                    dtype: DType::F32,
                }],
            )
            .unwrap(),
        )
    };
    let what = match ctx.copy_queue() {
        Some((q, _)) => format!("load_weights from registered memory on the copy queue, {q}"),
        None => "load_weights from registered memory on wgpu's queue (no copy queue)".into(),
    };
    overlap_of(ctx, &g, reps, &load, bytes, &what);
    drop(registration);
}

/// `copy` (of `bytes`) alone, a matmul sized to take about as long alone,
/// then both back to back in each order: 100% overlap means together they
/// take the longer of the two, 0% their sum.
fn overlap_of(ctx: &GpuContext, g: &GpuExecutor, reps: usize, copy: &dyn Fn(), bytes: u64, what: &str) {
    let wait = || g.synchronize().unwrap();
    let time = |f: &dyn Fn()| {
        let mut v = Vec::new();
        for rep in 0..=reps {
            let t = Instant::now();
            f();
            wait();
            if rep > 0 {
                v.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        median(v)
    };
    let t_copy = time(copy);
    // A matmul sized to take about as long as the copy.
    let mut n = if ctx.info.device_type == "Cpu" {
        128usize
    } else {
        2048
    };
    let mut t_kernel;
    loop {
        let a = g.zeros(&Shape::new([n, n])).unwrap();
        let b = g.zeros(&Shape::new([n, n])).unwrap();
        let mm = || {
            drop(g.matmul(&a, &b, None, Transpose::NN).unwrap());
            g.flush();
        };
        t_kernel = time(&mm);
        if t_kernel >= 0.7 * t_copy || n >= 16384 {
            let t_kc = time(&|| {
                mm();
                copy();
            });
            let t_ck = time(&|| {
                copy();
                mm();
            });
            let frac =
                |both: f64| ((t_copy + t_kernel - both) / t_copy.min(t_kernel)).clamp(-1.0, 1.0) * 100.0;
            println!(
                "\noverlap, {what} ({}): copy {} MiB host→device {t_copy:.2} ms alone; \
                 matmul {n}³ {t_kernel:.2} ms alone; kernel then copy {t_kc:.2} ms ({:.0}% overlap); \
                 copy then kernel {t_ck:.2} ms ({:.0}% overlap); 100% = together they take the longer, \
                 0% = their sum",
                ctx.info.name,
                bytes >> 20,
                frac(t_kc),
                frac(t_ck)
            );
            return;
        }
        let grow = (t_copy / t_kernel.max(1e-3)).cbrt().clamp(1.25, 4.0);
        n = ((n as f64 * grow) as usize).div_ceil(64) * 64;
    }
}

fn main() {
    let a = args();
    let Ok(ctx) = GpuContext::new() else {
        eprintln!("no GPU adapter, skipping transport benches");
        return;
    };
    println!("bench device: {}", ctx.info);
    let cpu = ctx.info.device_type == "Cpu";
    let max = a.max_mib.unwrap_or(if cpu { 256 } else { 1024 });
    let sizes: Vec<u64> = a
        .sizes_mib
        .clone()
        .unwrap_or_else(|| vec![16, 64, 256, 1024])
        .into_iter()
        .filter(|&m| m <= max)
        .collect();
    let mut choices = vec![TransportChoice::Staging];
    if ctx.features.contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS) {
        choices.push(TransportChoice::Mapped);
    }
    if let Some(t) = a.transport {
        choices.retain(|&c| c == t);
    }
    let peer = if a.torch { torch(&sizes, a.reps) } else { None };
    let peer_at = |mib: u64, key: &str| -> String {
        peer.as_ref()
            .and_then(|p| p.iter().find(|r| r["mib"].as_u64() == Some(mib)))
            .and_then(|r| r[key].as_f64())
            .map_or("–".into(), |x| format!("{x:.1}"))
    };
    println!(
        "\nGB/s (1e9 B/s), medians of {} after two warm-up rounds; upload = load_weights until resident, \
         download = begin+finish (copied out, widened), in place = the download read where it landed \
         (the step's gradients), both = a download in flight while the next layer is uploaded \
         (2× the bytes). torch = PyTorch copy_ on CUDA, pinned (pageable in brackets).\n",
        a.reps
    );
    println!(
        "| transport | MiB | upload | download | in place | both | torch up | torch down | torch both |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    let mut phases = Vec::new();
    // Direct: the staging transport's downloads, uploads copied by the
    // device from registered host memory.
    let direct = ctx.can_import_host_memory() && a.transport.is_none_or(|t| t == TransportChoice::Staging);
    let rows = choices
        .iter()
        .map(|&t| (t, false))
        .chain(direct.then_some((TransportChoice::Staging, true)));
    for (t, direct) in rows {
        let name = if direct {
            "direct".to_string()
        } else {
            t.to_string()
        };
        let g = GpuExecutor::with_options(
            Arc::clone(&ctx),
            GpuOptions {
                transport: t,
                staging_depth: a.depth,
                staging_chunk_bytes: a.chunk_mib.map(|m| m << 20),
                copy_threads: a.threads,
                download_pieces: a.download_pieces,
                uploads: if direct { Uploads::Direct } else { Uploads::Copy },
                ..Default::default()
            },
        );
        g.warm_up();
        for &mib in &sizes {
            let r = measure(&g, mib, a.reps, direct);
            println!(
                "| {name} | {mib} | {:.2} | {:.2} | {:.2} | {:.2} | {} ({}) | {} ({}) | {} |",
                r.up,
                r.down,
                r.down_in_place,
                r.both,
                peer_at(mib, "up_pinned_gbs"),
                peer_at(mib, "up_pageable_gbs"),
                peer_at(mib, "down_pinned_gbs"),
                peer_at(mib, "down_pageable_gbs"),
                peer_at(mib, "both_pinned_gbs"),
            );
            phases.push((name.clone(), mib, r));
        }
    }
    println!(
        "\nWhere the time went, ms per transfer (means over the timed reps of the upload and \
         download columns; TransportStats): upload = fill (CPU into mapped memory) + submit \
         (unmap, encode, submit, remap request) + wait compute + wait copy; download = submit + \
         wait compute + wait copy (copy and map) + read (CPU out of mapped memory, widened); \
         rest = the transfer's mean wall time outside those (for uploads: the last pieces' copy, \
         waited for by synchronize after load_weights returned). new bufs = staging/readback buffers made during the timed reps (0 once warm).\n"
    );
    println!(
        "| transport | MiB | up fill | up submit | up wait compute | up wait copy | up rest | fill GB/s | \
         down submit | down wait compute | down wait copy | down read | down rest | read GB/s | new bufs |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (t, mib, r) in &phases {
        let (u, d) = (&r.up_stats, &r.down_stats);
        let bytes = mib << 20;
        let fill = per(u.up_fill_ns, u.uploads);
        let read = per(d.down_read_ns, d.downloads);
        let up_parts = [u.up_submit_ns, u.up_wait_compute_ns, u.up_wait_copy_ns].map(|x| per(x, u.uploads));
        let down_parts =
            [d.down_submit_ns, d.down_wait_compute_ns, d.down_wait_copy_ns].map(|x| per(x, d.downloads));
        println!(
            "| {t} | {mib} | {fill:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {read:.2} | {:.2} | {:.1} | {} |",
            up_parts[0],
            up_parts[1],
            up_parts[2],
            r.up_ms - fill - up_parts.iter().sum::<f64>(),
            if fill > 0.0 { gbs(bytes, fill / 1e3) } else { 0.0 },
            down_parts[0],
            down_parts[1],
            down_parts[2],
            r.down_ms - read - down_parts.iter().sum::<f64>(),
            if read > 0.0 { gbs(bytes, read / 1e3) } else { 0.0 },
            u.buffers_created + d.buffers_created,
        );
    }
    if a.overlap {
        let g = GpuExecutor::new(Arc::clone(&ctx));
        g.warm_up();
        overlap(&ctx, &g, a.reps);
        if ctx.can_import_host_memory() {
            overlap_direct(&ctx, a.reps);
        }
    }
}
