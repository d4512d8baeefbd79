//! Ops recorded into one command encoder and submitted together.
//!
//! A submission costs the host tens of microseconds on a real driver (wgpu's
//! validation and tracking, then `vkQueueSubmit`), so a step of small ops
//! submitted one by one spends more time submitting than computing. Ops are
//! therefore appended to a pending encoder and go to the queue together when
//! something needs them there: a transfer, a read, a wait, a queue write into
//! a buffer a pending op uses, or a full batch. Queue order is program order
//! either way, because every path that reaches the queue flushes the batch
//! first.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::copy_queue::CopyQueue;
use crate::tensor::GpuTensor;

/// Bytes of parameter blocks one batch may hold in the shared uniform buffer
/// (1024 dispatches at the usual 256-byte alignment).
pub(crate) const UNIFORM_RING_BYTES: u64 = 256 << 10;

/// Ops per submission when the options do not say.
pub(crate) const DEFAULT_BATCH_OPS: usize = 256;

/// What is recorded and not yet submitted.
#[derive(Default)]
pub(crate) struct Batch {
    pub enc: Option<wgpu::CommandEncoder>,
    /// Parameter blocks of the batch's dispatches, written to the shared
    /// uniform buffer just before the batch is submitted.
    pub params: Vec<u8>,
    /// Temporaries the recorded commands read: they must not go back to the
    /// pool before the commands are on the queue.
    pub keep: Vec<GpuTensor>,
    /// Buffers the recorded commands use: a queue write into one of them
    /// must wait for the batch, or it would land before the commands.
    pub touched: HashSet<wgpu::Buffer>,
    pub ops: usize,
    /// Dispatches and compute passes of the batch's ops.
    pub dispatches: usize,
    pub passes: usize,
}

impl Batch {
    pub fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.enc.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("op batch"),
            })
        })
    }
}

/// Submissions and ops since the executor was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubmitStats {
    /// Ops recorded (each may hold several dispatches, copies and clears).
    pub ops: u64,
    /// Compute dispatches of those ops, and the compute passes holding
    /// them (an op's consecutive dispatches share one pass).
    pub dispatches: u64,
    pub passes: u64,
    /// Queue submissions of op batches.
    pub op_submissions: u64,
    /// Queue submissions of transfers (uploads, readbacks, their marks).
    pub transfer_submissions: u64,
    /// Points where the host waits for the device (a poll that waits for
    /// a submission, a wait for a mapping), counted whether or not the
    /// device was already there: on a GPU each may stall the host, and
    /// the device idles until the host submits again.
    pub waits: u64,
}

impl std::ops::Sub for SubmitStats {
    type Output = SubmitStats;

    /// The counts between two snapshots.
    fn sub(self, b: SubmitStats) -> SubmitStats {
        SubmitStats {
            ops: self.ops - b.ops,
            dispatches: self.dispatches - b.dispatches,
            passes: self.passes - b.passes,
            op_submissions: self.op_submissions - b.op_submissions,
            transfer_submissions: self.transfer_submissions - b.transfer_submissions,
            waits: self.waits - b.waits,
        }
    }
}

/// The pending batch, the uniform buffer its parameter blocks go to, and
/// the only way onto the queue.
pub(crate) struct Submitter {
    batch: Mutex<Batch>,
    pub uniforms: wgpu::Buffer,
    pub max_ops: usize,
    ops: AtomicU64,
    dispatches: AtomicU64,
    passes: AtomicU64,
    op_submissions: AtomicU64,
    transfer_submissions: AtomicU64,
    waits: AtomicU64,
    /// The device's copy queue, whose copies some submissions wait for.
    side: Option<Arc<CopyQueue>>,
}

impl Submitter {
    pub fn new(device: &wgpu::Device, max_ops: usize, side: Option<Arc<CopyQueue>>) -> Self {
        Submitter {
            batch: Mutex::new(Batch::default()),
            uniforms: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("op parameters"),
                size: UNIFORM_RING_BYTES,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            max_ops: max_ops.max(1),
            ops: AtomicU64::new(0),
            dispatches: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            op_submissions: AtomicU64::new(0),
            transfer_submissions: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            side,
        }
    }

    /// Every submission goes through here: with a copy queue, it waits
    /// for the copies into the buffers it `uses`, and marks its end for
    /// the copies that will overwrite them.
    fn submit(
        &self,
        queue: &wgpu::Queue,
        cmds: impl IntoIterator<Item = wgpu::CommandBuffer>,
        uses: impl Fn(&wgpu::Buffer) -> bool,
    ) -> wgpu::SubmissionIndex {
        match &self.side {
            Some(q) => q.submit_wgpu(queue, uses, || queue.submit(cmds)),
            None => queue.submit(cmds),
        }
    }

    /// An empty submission: a mark that the work before it is queued.
    pub fn submit_mark(&self, queue: &wgpu::Queue) -> wgpu::SubmissionIndex {
        self.submit(queue, [], |_| false)
    }

    pub fn lock(&self) -> MutexGuard<'_, Batch> {
        self.batch.lock().expect("op batch poisoned")
    }

    /// Puts the pending batch on the queue (nothing when it is empty).
    pub fn flush_locked(&self, b: &mut Batch, queue: &wgpu::Queue) {
        let Some(enc) = b.enc.take() else { return };
        if !b.params.is_empty() {
            queue.write_buffer(&self.uniforms, 0, &b.params);
        }
        self.submit(queue, [enc.finish()], |buf| b.touched.contains(buf));
        self.ops.fetch_add(b.ops as u64, Ordering::Relaxed);
        self.dispatches.fetch_add(b.dispatches as u64, Ordering::Relaxed);
        self.passes.fetch_add(b.passes as u64, Ordering::Relaxed);
        self.op_submissions.fetch_add(1, Ordering::Relaxed);
        b.params.clear();
        b.touched.clear();
        b.keep.clear();
        b.ops = 0;
        b.dispatches = 0;
        b.passes = 0;
    }

    pub fn flush(&self, queue: &wgpu::Queue) {
        let mut b = self.lock();
        self.flush_locked(&mut b, queue);
    }

    /// Submits `cmds`, which use the buffers `uses` names, after the
    /// pending batch.
    pub fn submit_after_batch(
        &self,
        queue: &wgpu::Queue,
        cmds: impl IntoIterator<Item = wgpu::CommandBuffer>,
        uses: &[&wgpu::Buffer],
    ) -> wgpu::SubmissionIndex {
        let mut b = self.lock();
        self.flush_locked(&mut b, queue);
        self.transfer_submissions.fetch_add(1, Ordering::Relaxed);
        self.submit(queue, cmds, |buf| uses.contains(&buf))
    }

    /// Submits a transfer's commands, which use the buffers `uses` names;
    /// the caller flushed the batch under the same lock.
    pub fn submit_transfer_locked(
        &self,
        queue: &wgpu::Queue,
        cmd: wgpu::CommandBuffer,
        uses: &[&wgpu::Buffer],
    ) -> wgpu::SubmissionIndex {
        self.transfer_submissions.fetch_add(1, Ordering::Relaxed);
        self.submit(queue, [cmd], |buf| uses.contains(&buf))
    }

    /// `queue.write_buffer`, after the batch if a pending op uses `buf`
    /// (a queue write lands before the next submission's commands).
    pub fn write_buffer(&self, queue: &wgpu::Queue, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        let mut b = self.lock();
        if b.touched.contains(buf) {
            self.flush_locked(&mut b, queue);
        }
        queue.write_buffer(buf, offset, data);
    }

    /// Counts a time the host blocks on the device.
    pub fn note_wait(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> SubmitStats {
        let (pending, pending_dispatches, pending_passes) = {
            let b = self.lock();
            (b.ops as u64, b.dispatches as u64, b.passes as u64)
        };
        SubmitStats {
            ops: self.ops.load(Ordering::Relaxed) + pending,
            dispatches: self.dispatches.load(Ordering::Relaxed) + pending_dispatches,
            passes: self.passes.load(Ordering::Relaxed) + pending_passes,
            op_submissions: self.op_submissions.load(Ordering::Relaxed),
            transfer_submissions: self.transfer_submissions.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
        }
    }
}
