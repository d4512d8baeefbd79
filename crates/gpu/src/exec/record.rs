//! Recording an op's dispatches, copies and clears, and appending them to
//! the pending batch (see `batch.rs`) together with the op's parameter blocks.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use megatrain_tensor::Result;
use wgpu::util::DeviceExt;

use super::batch::UNIFORM_RING_BYTES;
use super::bind_groups::GroupKey;
use super::{GpuExecutor, Timestamps, View};
use crate::kernels::{Kernel, Pipeline};
use crate::tensor::GpuTensor;

/// Passes of one op a profile times one by one (a pair of timestamp
/// queries each; the executor's query set holds twice as many).
pub(crate) const MAX_TIMED_PASSES: usize = 128;

/// Where a dispatch's parameter block lives.
enum Uniform {
    /// At `rel` bytes into the op's blocks in the shared buffer; the op's
    /// place in the batch is known only when it is appended.
    Ring { rel: u64, len: u64 },
    /// More dispatches than the shared buffer holds: a buffer of its own,
    /// bound already.
    Own(wgpu::BindGroup),
}

enum Cmd {
    Dispatch {
        kernel: Kernel,
        pipeline: Arc<Pipeline>,
        uniform: Uniform,
        views: Vec<(wgpu::Buffer, u64, u64)>,
        grid: [u32; 3],
        /// A matmul's M, N and K (its first three parameters), for the
        /// per-kernel profile.
        dims: Option<[u32; 3]>,
    },
    Copy {
        src: wgpu::Buffer,
        src_off: u64,
        dst: wgpu::Buffer,
        dst_off: u64,
        bytes: u64,
    },
    Clear {
        buf: wgpu::Buffer,
        bytes: u64,
    },
}

/// The commands of one op, appended to the pending batch by [`Op::finish`].
pub(crate) struct Op<'e> {
    ex: &'e GpuExecutor,
    name: &'static str,
    cmds: Vec<Cmd>,
    /// The op's parameter blocks, destined for the shared uniform buffer.
    params: Vec<u8>,
    /// Temporaries the recorded commands read: they must not go back to the
    /// pool (and be rewritten by a later upload) before the op is submitted.
    keep: Vec<GpuTensor>,
}

fn bind_group(
    device: &wgpu::Device,
    pipeline: &Pipeline,
    ubuf: &wgpu::Buffer,
    uoff: u64,
    ulen: u64,
    views: &[(wgpu::Buffer, u64, u64)],
) -> wgpu::BindGroup {
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: ubuf,
            offset: uoff,
            size: wgpu::BufferSize::new(ulen),
        }),
    }];
    for (b, (buf, offset, size)) in pipeline.bindings.iter().zip(views) {
        entries.push(wgpu::BindGroupEntry {
            binding: *b,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: buf,
                offset: *offset,
                size: wgpu::BufferSize::new(*size),
            }),
        });
    }
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(pipeline.entry),
        layout: &pipeline.layout,
        entries: &entries,
    })
}

impl<'e> Op<'e> {
    pub fn keep(&mut self, t: GpuTensor) {
        self.keep.push(t);
    }

    pub fn dispatch(&mut self, k: Kernel, params: &[u32], views: &[View<'_>], grid: [u32; 3]) {
        let ex = self.ex;
        let pipeline = ex.kernels.get(&ex.ctx.device, k);
        debug_assert_eq!(pipeline.bindings.len(), views.len(), "{:?} binding count", k);
        if grid.contains(&0) {
            return;
        }
        let mut bytes: Vec<u8> = bytemuck::cast_slice(params).to_vec();
        bytes.resize(bytes.len().div_ceil(16).max(1) * 16, 0);
        let views: Vec<_> = views.iter().map(|v| (v.buf.clone(), v.offset, v.size)).collect();
        let rel = (self.params.len() as u64).div_ceil(ex.uniform_align) * ex.uniform_align;
        let len = bytes.len() as u64;
        let uniform = if rel + len <= UNIFORM_RING_BYTES {
            self.params.resize(rel as usize, 0);
            self.params.extend_from_slice(&bytes);
            Uniform::Ring { rel, len }
        } else {
            let own = ex
                .ctx
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("params"),
                    contents: &bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            Uniform::Own(bind_group(&ex.ctx.device, &pipeline, &own, 0, len, &views))
        };
        let matmul = matches!(
            k,
            Kernel::Matmul(_) | Kernel::MatmulInterior(_) | Kernel::MatmulCoop(_)
        );
        self.cmds.push(Cmd::Dispatch {
            kernel: k,
            pipeline,
            uniform,
            views,
            grid,
            dims: matmul.then(|| [0, 1, 2].map(|i| params.get(i).copied().unwrap_or(0))),
        });
    }
    pub fn copy(&mut self, src: &wgpu::Buffer, src_off: u64, dst: &wgpu::Buffer, dst_off: u64, bytes: u64) {
        if bytes > 0 {
            self.cmds.push(Cmd::Copy {
                src: src.clone(),
                src_off,
                dst: dst.clone(),
                dst_off,
                bytes,
            });
        }
    }

    pub fn clear(&mut self, buf: &wgpu::Buffer, bytes: u64) {
        if bytes > 0 {
            self.cmds.push(Cmd::Clear {
                buf: buf.clone(),
                bytes,
            });
        }
    }

    /// Appends the op to the pending batch; submits the batch when it is
    /// full, and at once (then waits, and times the op) when profiling.
    pub fn finish(self) -> Result<()> {
        let ex = self.ex;
        let sub = &ex.submitter;
        let queue = &ex.ctx.queue;
        let device = &ex.ctx.device;
        if self.cmds.is_empty() {
            return Ok(());
        }
        let profile = ex.profiling.load(Ordering::Relaxed);
        let ts = if profile { ex.timestamps.as_ref() } else { None };
        let n_dispatch_runs = count_pass_runs(&self.cmds);
        let n_dispatches = self
            .cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Dispatch { .. }))
            .count();
        let start = Instant::now();
        let mut b = sub.lock();
        if profile {
            // Timed alone: nothing of earlier ops in its submission.
            sub.flush_locked(&mut b, queue);
        }
        let mut base = (b.params.len() as u64).div_ceil(ex.uniform_align) * ex.uniform_align;
        if base + self.params.len() as u64 > UNIFORM_RING_BYTES {
            sub.flush_locked(&mut b, queue);
            base = 0;
        }
        if !self.params.is_empty() {
            b.params.resize(base as usize, 0);
            b.params.extend_from_slice(&self.params);
        }
        for cmd in &self.cmds {
            match cmd {
                Cmd::Dispatch { views, .. } => b.touched.extend(views.iter().map(|v| v.0.clone())),
                Cmd::Copy { src, dst, .. } => {
                    b.touched.insert(src.clone());
                    b.touched.insert(dst.clone());
                }
                Cmd::Clear { buf, .. } => {
                    b.touched.insert(buf.clone());
                }
            }
        }
        // Parameter blocks sit at the same offsets every time an op runs at
        // the same place in a batch, and weight slots and pooled activations
        // are the same buffers every step: so after the first step every
        // group is found here and nothing is created per layer per step.
        let group_of = |kernel: Kernel,
                        pipeline: &Pipeline,
                        uniform: Uniform,
                        views: Vec<(wgpu::Buffer, u64, u64)>| match uniform {
            Uniform::Own(g) => g,
            Uniform::Ring { rel, len } => {
                let uoff = base + rel;
                let key = GroupKey {
                    kernel,
                    uniform: (uoff, len),
                    views,
                };
                ex.bind_groups.get_or_make(key, |k| {
                    bind_group(device, pipeline, &sub.uniforms, uoff, len, &k.views)
                })
            }
        };
        let enc = b.encoder(device);
        // Profiling with timestamps, each dispatch is a pass of its own with
        // its own pair of queries (up to MAX_TIMED_PASSES; an op with more
        // is timed whole, its consecutive dispatches in one pass as always).
        let split = ts.is_some() && n_dispatches > 0 && n_dispatches <= MAX_TIMED_PASSES;
        let n_passes = if split { n_dispatches } else { n_dispatch_runs };
        // An op of clears and copies alone has no pass to carry its
        // queries: empty passes before and after bracket it, so it is timed
        // on the device too, not by the wall clock around a submit and a
        // wait (which put a 14 KB clear at ~0.8 ms on the H200).
        let bare = ts.filter(|_| n_dispatches == 0);
        let bracket = |enc: &mut wgpu::CommandEncoder, t: &Timestamps, first: bool| {
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(self.name),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &t.set,
                    beginning_of_pass_write_index: first.then_some(0),
                    end_of_pass_write_index: (!first).then_some(1),
                }),
            });
        };
        if let Some(t) = bare {
            bracket(enc, t, true);
        }
        let mut timed = Vec::new();
        let mut cmds = self.cmds.into_iter().peekable();
        let mut run = 0;
        while let Some(cmd) = cmds.next() {
            match cmd {
                Cmd::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    bytes,
                } => enc.copy_buffer_to_buffer(&src, src_off, &dst, dst_off, bytes),
                Cmd::Clear { buf, bytes } => enc.clear_buffer(&buf, 0, Some(bytes)),
                Cmd::Dispatch {
                    kernel,
                    pipeline,
                    uniform,
                    views,
                    grid,
                    dims,
                } => {
                    let q = run as u32;
                    let timestamp_writes = ts.map(|t| wgpu::ComputePassTimestampWrites {
                        query_set: &t.set,
                        beginning_of_pass_write_index: match split {
                            true => Some(2 * q),
                            false => (run == 0).then_some(0),
                        },
                        end_of_pass_write_index: match split {
                            true => Some(2 * q + 1),
                            false => (run + 1 == n_dispatch_runs).then_some(1),
                        },
                    });
                    if split {
                        timed.push((kernel, grid, dims));
                    }
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some(self.name),
                        timestamp_writes,
                    });
                    let group = group_of(kernel, &pipeline, uniform, views);
                    pass.set_pipeline(&pipeline.pipeline);
                    pass.set_bind_group(0, &group, &[]);
                    pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
                    while let (false, Some(Cmd::Dispatch { .. })) = (split, cmds.peek()) {
                        if let Some(Cmd::Dispatch {
                            kernel,
                            pipeline,
                            uniform,
                            views,
                            grid,
                            ..
                        }) = cmds.next()
                        {
                            let group = group_of(kernel, &pipeline, uniform, views);
                            pass.set_pipeline(&pipeline.pipeline);
                            pass.set_bind_group(0, &group, &[]);
                            pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
                        }
                    }
                    run += 1;
                }
            }
        }
        if let Some(t) = bare {
            bracket(enc, t, false);
        }
        let use_ts = ts.filter(|_| n_passes > 0 || bare.is_some());
        // The queries written: a pair per pass, or the op's one pair.
        let n_queries = if split { 2 * n_passes } else { 2 };
        if let Some(t) = use_ts {
            enc.resolve_query_set(&t.set, 0..n_queries as u32, &t.resolve, 0);
            enc.copy_buffer_to_buffer(&t.resolve, 0, &t.read, 0, 8 * n_queries as u64);
        }
        b.keep.extend(self.keep);
        b.ops += 1;
        b.dispatches += n_dispatches;
        b.passes += n_passes;
        if profile || b.ops >= sub.max_ops {
            sub.flush_locked(&mut b, queue);
        }
        drop(b);
        if profile {
            ex.ctx.wait()?;
            let wall = start.elapsed().as_nanos() as u64;
            let ns = match use_ts {
                Some(t) => {
                    let words = ex.read_buffer(&t.read, 0, 8 * n_queries as u64)?;
                    let v: Vec<u64> = bytemuck::pod_collect_to_vec(&words);
                    let span = |a: usize, b: usize| (v[b].saturating_sub(v[a]) as f64 * t.period_ns) as u64;
                    // A matmul is named by its M×N×K too; the grid stands for
                    // the rest's shape (an elementwise kernel's blocks of
                    // elements), and for how a matmul's tiles were split
                    // between interior and edge kernels.
                    for (p, (kernel, [x, y, z], dims)) in timed.iter().enumerate() {
                        let shape = dims.map_or(String::new(), |[m, n, k]| format!(" {m}x{n}x{k}"));
                        let name = format!("{}{shape} [{x}x{y}x{z}]", kernel.profile_name());
                        ex.profiler
                            .record_kernel(self.name, &name, span(2 * p, 2 * p + 1));
                    }
                    if bare.is_some() {
                        ex.profiler.record_kernel(self.name, "ClearOrCopy", span(0, 1));
                    }
                    span(0, n_queries - 1)
                }
                None => wall,
            };
            ex.profiler.record(self.name, ns);
        }
        Ok(())
    }
}

fn count_pass_runs(cmds: &[Cmd]) -> usize {
    let mut runs = 0;
    let mut prev_dispatch = false;
    for c in cmds {
        let d = matches!(c, Cmd::Dispatch { .. });
        if d && !prev_dispatch {
            runs += 1;
        }
        prev_dispatch = d;
    }
    runs
}

/// Workgroup grid for `n` workgroups: 2-D when one dimension is not enough
/// (kernels rebuild the linear id from `num_workgroups`).
pub(crate) fn grid_for(n: usize) -> [u32; 3] {
    const MAX: usize = 65535;
    if n <= MAX {
        [n as u32, 1, 1]
    } else {
        [MAX as u32, n.div_ceil(MAX) as u32, 1]
    }
}

impl GpuExecutor {
    pub(crate) fn op(&self, name: &'static str) -> Op<'_> {
        Op {
            ex: self,
            name,
            cmds: Vec::new(),
            params: Vec::new(),
            keep: Vec::new(),
        }
    }
}
