//! The optimizer side of the step: a worker thread that receives each
//! layer's gradients as soon as they reach the host and updates that layer
//! (p, m, v and its transport copy) while the device goes on with earlier
//! layers.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use megatrain_adamw::{AdamW, DecayMask, SlabState, SlabUpdate, Transport};
use megatrain_tier::{LayerSlab, SpillWindow, TransportMut};
use rayon::prelude::*;

use super::TrainError;
use super::spill_window::update_any;

/// One layer's gradients, handed from the step to the optimizer.
pub(super) struct Job<'a> {
    pub slab: &'a mut LayerSlab,
    /// Freshly downloaded gradients (a pooled staging buffer).
    pub grads: Vec<f32>,
    /// Run AdamW after accumulating (last micro-batch, no clipping).
    pub update: bool,
}

/// What every job shares.
pub(super) struct Shared<'a> {
    pub adamw: &'a AdamW,
    pub masks: &'a [DecayMask],
    pub lr: f32,
    pub pool: &'a StagingPool,
    /// Read-ahead / write-behind for spilled layers (on the updating
    /// micro-batch of a tier that spills).
    pub window: Option<&'a SpillWindow>,
}

/// Reused gradient staging buffers: one per layer in flight, never one per
/// layer per step.
#[derive(Debug, Default)]
pub struct StagingPool(Mutex<Vec<Vec<f32>>>);

impl StagingPool {
    /// A buffer of exactly `len` elements (contents unspecified).
    pub fn take(&self, len: usize) -> Vec<f32> {
        let mut v = self
            .0
            .lock()
            .expect("staging pool poisoned")
            .pop()
            .unwrap_or_default();
        v.resize(len, 0.0);
        v
    }

    pub fn give(&self, v: Vec<f32>) {
        self.0.lock().expect("staging pool poisoned").push(v);
    }

    /// Bytes the pool holds (host staging, for the memory report).
    pub fn bytes(&self) -> u64 {
        let pool = self.0.lock().expect("staging pool poisoned");
        pool.iter().map(|v| 4 * v.capacity() as u64).sum()
    }
}

/// `acc += x`, in parallel for large layers.
pub(super) fn accumulate(acc: &mut [f32], x: &[f32]) {
    const CHUNK: usize = 1 << 15;
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| a.iter_mut().zip(x).for_each(|(a, x)| *a += x));
}

/// The gradient an update applies: the one given, else the slab's held
/// one, which the update then zeroes (the `bool`) for the next step.
pub(super) fn chosen_grad<'a>(
    index: usize,
    given: Option<&'a mut [f32]>,
    held: Option<&'a mut [f32]>,
) -> Result<(&'a mut [f32], bool), TrainError> {
    match (given, held) {
        (Some(g), _) => Ok((g, false)),
        (None, Some(h)) => Ok((h, true)),
        (None, None) => Err(TrainError::Internal(format!(
            "layer {index}: no gradient to apply"
        ))),
    }
}

/// Elements `r` of a transport copy, as the fused AdamW pass writes them.
pub(super) fn adamw_transport<'a>(t: &'a mut TransportMut<'_>, r: Range<usize>) -> Transport<'a> {
    match t {
        TransportMut::F32(t) => Transport::F32(&mut t[r]),
        TransportMut::BF16(t) => Transport::Bf16(&mut t[r]),
        TransportMut::F16(t) => Transport::F16(&mut t[r]),
    }
}

/// AdamW on one slab with gradient `grad`, writing the transport copy in the
/// same pass.
pub(super) fn update_slab(
    slab: &mut LayerSlab,
    grad: Option<&mut [f32]>,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<(), TrainError> {
    let index = slab.index();
    let numel = slab.numel();
    let parts = slab.parts_mut();
    let (grad, zero) = chosen_grad(index, grad, parts.grads)?;
    let mut transport = parts.transport;
    let transport = adamw_transport(&mut transport, 0..numel);
    let mut state = SlabState::at_step(*parts.step);
    let update = SlabUpdate::new(parts.params, grad, parts.m, parts.v)
        .decay(mask)
        .transport(transport)
        .zero_grad(zero)
        .grad_scale(grad_scale);
    adamw.step(&mut state, lr, update)?;
    *parts.step = state.step();
    // A spilled layer's pages would otherwise stay resident and break the
    // RAM budget; the next step maps them back in.
    slab.evict()?;
    Ok(())
}

fn run_job(job: Job<'_>, sh: &Shared<'_>) -> Result<(), TrainError> {
    let Job {
        slab,
        mut grads,
        update,
    } = job;
    let index = slab.index();
    let mask = &sh.masks[index];
    let result = match slab.grads_mut() {
        Some(held) => {
            accumulate(held, &grads);
            if update {
                update_any(slab, None, sh.window, sh.adamw, mask, sh.lr, 1.0)
            } else {
                Ok(())
            }
        }
        None if update => update_any(slab, Some(&mut grads), sh.window, sh.adamw, mask, sh.lr, 1.0),
        None => Err(TrainError::Internal(format!(
            "layer {index}: gradients must be held to accumulate micro-batches"
        ))),
    };
    sh.pool.give(grads);
    result
}

/// The worker loop: runs jobs until the sender hangs up. Returns its busy
/// time in milliseconds. After an error it keeps draining (so the sender
/// never blocks on a full queue) and reports the first error.
pub(super) fn worker(rx: Receiver<Job<'_>>, sh: Shared<'_>) -> Result<f64, TrainError> {
    let mut busy = 0.0;
    let mut first_err = None;
    for job in rx {
        if first_err.is_some() {
            sh.pool.give(job.grads);
            continue;
        }
        let t = Instant::now();
        if let Err(e) = run_job(job, &sh) {
            first_err = Some(e);
        }
        busy += t.elapsed().as_secs_f64() * 1e3;
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(busy),
    }
}
