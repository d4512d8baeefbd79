//! Where a driver puts workgroup variables, seen through cooperative
//! loads. A cooperative load needs a 16-byte-aligned pointer, and Vulkan
//! leaves the placement of separate workgroup variables to the driver, so
//! the tensor-core kernels keep their f16 tiles where alignment does not
//! depend on it: first in one struct (attention_coop.wgsl's `Shared`), or
//! in arrays whose lengths are all multiples of 16 bytes (the matmul's).
//! A product of two fragments from workgroup memory must come out exactly
//! in the struct layout, with B row- or column-major and at A's stride or
//! the attention's (two strides in one array, as there); the same product
//! from a tile declared after two 4-byte atomics (the attention's old
//! layout, which computed garbage on an NVIDIA H200) is reported, not
//! asserted: it tells what this driver does with that layout. And an f32
//! accumulator stored, loaded back (`coopLoadT` of a C matrix: the
//! attention's forward does this to rescale O, the matmul never does) and
//! multiplied into must round-trip exactly. Where the adapter has no
//! cooperative matrices (Debian's lavapipe) nothing runs; Mesa 26's
//! lavapipe (`tools/lavapipe_coop.sh`) and GPUs run them.

mod common;

use wgpu::util::DeviceExt;

/// How a probe lays out and reads its tile.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// The tile first in one struct (else after two atomics, apart).
    in_struct: bool,
    /// B read column-major (K in the attention's S = Q·Kᵀ) or row-major.
    b_col_major: bool,
    /// A's and B's strides in halfs: 72 is the attention's at D = 64 (Q
    /// and K both at it), 32 the matmul's A at K step 32; two strides in
    /// one array as there.
    a_stride: u32,
    b_stride: u32,
}

const A_AT: usize = 0;
const B_AT: usize = 2048;

/// The tile `t` (f16 integers 0..63, exact) and a product of two of its
/// fragments through the tensor cores, stored row-major.
fn kernel(p: Probe) -> String {
    let (decls, t, c, flag, flag2) = if p.in_struct {
        (
            "struct Shared {\n    t: array<f16, 4096>,\n    c: array<f32, 256>,\n    flag: atomic<u32>,\n    flag2: atomic<u32>,\n}\nvar<workgroup> wg: Shared;\n",
            "wg.t",
            "wg.c",
            "wg.flag",
            "wg.flag2",
        )
    } else {
        (
            "var<workgroup> flag: atomic<u32>;\nvar<workgroup> flag2: atomic<u32>;\nvar<workgroup> t: array<f16, 4096>;\nvar<workgroup> c: array<f32, 256>;\n",
            "t",
            "c",
            "flag",
            "flag2",
        )
    };
    let load_b = if p.b_col_major { "coopLoad" } else { "coopLoadT" };
    format!(
        "enable f16;\nenable wgpu_cooperative_matrix;\n\
         @group(0) @binding(0) var<storage, read_write> out: array<f32>;\n{decls}\
         @compute @workgroup_size(32)\n\
         fn main(@builtin(local_invocation_index) li: u32) {{\n\
         \x20   atomicMax(&{flag}, li);\n\
         \x20   atomicMax(&{flag2}, li + 1u);\n\
         \x20   for (var i = li; i < 4096u; i += 32u) {{\n\
         \x20       {t}[i] = f16(f32(i % 64u));\n\
         \x20   }}\n\
         \x20   workgroupBarrier();\n\
         \x20   let sa = {sa}u;\n\
         \x20   let sb = {sb}u;\n\
         \x20   let ia = {A_AT}u;\n\
         \x20   let ib = {B_AT}u;\n\
         \x20   let a = coopLoadT<coop_mat16x16<f16, A>>(&{t}[ia], sa);\n\
         \x20   let b = {load_b}<coop_mat16x16<f16, B>>(&{t}[ib], sb);\n\
         \x20   let z = coopMultiplyAdd(a, b, coop_mat16x16<f32, C>());\n\
         \x20   let at = 0u;\n\
         \x20   let ld = 16u;\n\
         \x20   coopStoreT(z, &{c}[at], ld);\n\
         \x20   workgroupBarrier();\n\
         \x20   for (var i = li; i < 256u; i += 32u) {{\n\
         \x20       out[i] = {c}[i];\n\
         \x20   }}\n\
         \x20   if li == 0u {{\n\
         \x20       out[256] = f32(atomicLoad(&{flag}) + atomicLoad(&{flag2}));\n\
         \x20   }}\n\
         }}\n",
        sa = p.a_stride,
        sb = p.b_stride
    )
}

/// C = A·B with A(m, k) = t[A_AT + m·a_stride + k] and B(k, n) at B_AT + k·stride
/// + n (row-major) or B_AT + n·stride + k (column-major).
fn want(p: Probe) -> Vec<f32> {
    let t = |i: usize| (i % 64) as f32;
    let s = p.b_stride as usize;
    (0..256)
        .map(|e| {
            let (m, n) = (e / 16, e % 16);
            (0..16)
                .map(|k| {
                    let b = if p.b_col_major { n * s + k } else { k * s + n };
                    t(A_AT + p.a_stride as usize * m + k) * t(B_AT + b)
                })
                .sum()
        })
        .collect()
}

/// Runs `src` (one workgroup) and reads back `out`'s first `len` floats.
fn run(ctx: &megatrain_gpu::GpuContext, src: &str, len: usize) -> Vec<f32> {
    let device = &ctx.device;
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("coop layout"),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("coop layout"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bytes = len * 4;
    let out = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("out"),
        contents: &vec![0u8; bytes],
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
    });
    let read = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read"),
        size: bytes as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: out.as_entire_binding(),
        }],
    });
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &group, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&out, 0, &read, 0, bytes as u64);
    ctx.queue.submit([enc.finish()]);
    read.slice(..).map_async(wgpu::MapMode::Read, |r| r.expect("map"));
    device.poll(wgpu::PollType::wait_indefinitely()).expect("poll");
    let view = read.slice(..).get_mapped_range().expect("mapped");
    bytemuck::cast_slice::<u8, f32>(&view).to_vec()
}

/// Products of `want` that came out otherwise.
fn wrong(ctx: &megatrain_gpu::GpuContext, p: Probe) -> usize {
    let got = run(ctx, &kernel(p), 257);
    assert_eq!(got[256], 63.0, "{p:?}: the atomics");
    got[..256].iter().zip(&want(p)).filter(|(a, b)| a != b).count()
}

#[test]
fn tiles_first_in_one_struct_load_exactly() {
    let Some(ctx) = common::ctx() else { return };
    if !ctx.has_cooperative_matrix() {
        eprintln!("no cooperative matrices on {}: NOT tested here", ctx.info);
        return;
    }
    // What the tensor-core kernels rely on: B row- or column-major, at the
    // matmul's strides and the attention's, in the one struct.
    for (b_col_major, a_stride, b_stride) in
        [(false, 32, 32), (true, 32, 32), (false, 72, 72), (true, 72, 72)]
    {
        let p = Probe {
            in_struct: true,
            b_col_major,
            a_stride,
            b_stride,
        };
        assert_eq!(wrong(&ctx, p), 0, "{}: {p:?}", ctx.info);
    }
    let apart = Probe {
        in_struct: false,
        b_col_major: false,
        a_stride: 32,
        b_stride: 32,
    };
    let n = wrong(&ctx, apart);
    eprintln!(
        "{}: tile declared after two 4-byte atomics: {n} of 256 products wrong{}",
        ctx.info,
        if n > 0 {
            " (this driver does not place it on 16 bytes)"
        } else {
            ""
        }
    );
}

/// The attention forward's rescale of O in one workgroup, on exact values:
/// f32 accumulators loaded from an f32 scratch array that follows the f16
/// tile in the struct (`s`: values i % 61), once stored straight back (a
/// round trip) and once as the C of a product of two tile fragments.
/// `out[0..256]` is the round trip of s[0..256], `out[256..512]` is
/// A·B + s[256..512] with A, B as in `kernel` (B row-major, stride 32).
const ACCUMULATOR_PROBE: &str = "enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
struct Shared {
    t: array<f16, 4096>,
    s: array<f32, 1024>,
    flag: atomic<u32>,
}
var<workgroup> wg: Shared;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) li: u32) {
    atomicMax(&wg.flag, li);
    for (var i = li; i < 4096u; i += 32u) {
        wg.t[i] = f16(f32(i % 64u));
    }
    for (var i = li; i < 1024u; i += 32u) {
        wg.s[i] = f32(i % 61u);
    }
    workgroupBarrier();
    let ld = 16u;
    let sa = 32u;
    let i0 = 0u;
    let i1 = 256u;
    let i2 = 512u;
    let i3 = 768u;
    let ia = 0u;
    let ib = 2048u;
    let c0 = coopLoadT<coop_mat16x16<f32, C>>(&wg.s[i0], ld);
    let c1 = coopLoadT<coop_mat16x16<f32, C>>(&wg.s[i1], ld);
    let a = coopLoadT<coop_mat16x16<f16, A>>(&wg.t[ia], sa);
    let b = coopLoadT<coop_mat16x16<f16, B>>(&wg.t[ib], sa);
    let z = coopMultiplyAdd(a, b, c1);
    workgroupBarrier();
    coopStoreT(c0, &wg.s[i2], ld);
    coopStoreT(z, &wg.s[i3], ld);
    workgroupBarrier();
    for (var i = li; i < 512u; i += 32u) {
        out[i] = wg.s[512u + i];
    }
}
";

#[test]
fn accumulators_load_back_exactly() {
    let Some(ctx) = common::ctx() else { return };
    if !ctx.has_cooperative_matrix() {
        eprintln!("no cooperative matrices on {}: NOT tested here", ctx.info);
        return;
    }
    let got = run(&ctx, ACCUMULATOR_PROBE, 512);
    let s = |i: usize| (i % 61) as f32;
    let t = |i: usize| (i % 64) as f32;
    let round_trip: Vec<f32> = (0..256).map(s).collect();
    let product: Vec<f32> = (0..256)
        .map(|e| {
            let (m, n) = (e / 16, e % 16);
            s(256 + e) + (0..16).map(|k| t(32 * m + k) * t(2048 + 32 * k + n)).sum::<f32>()
        })
        .collect();
    let wrong = |got: &[f32], want: &[f32]| got.iter().zip(want).filter(|(a, b)| a != b).count();
    let (w0, w1) = (wrong(&got[..256], &round_trip), wrong(&got[256..], &product));
    eprintln!(
        "{}: accumulators loaded back: round trip {w0} of 256 wrong, as C of a product {w1} of 256 wrong",
        ctx.info
    );
    assert_eq!((w0, w1), (0, 0), "{}: first values {:?}", ctx.info, &got[..8]);
}
