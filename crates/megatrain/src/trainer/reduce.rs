//! The optimizer worker of a data parallel step: each layer's gradients are
//! summed across ranks as they land in host memory, then the layer is
//! updated, while the device goes on with earlier layers.
//!
//! Per layer, on the last micro-batch, in layer order (the same on every
//! rank, which MPI requires of collectives):
//!
//! - replicated optimizer: all-reduce the gradient; AdamW on the whole layer;
//! - sharded optimizer (ZeRO-1/2): reduce-scatter the gradient, so this
//!   rank receives the sum of its 1/N range only; AdamW on that range of
//!   p, m, v and the transport copy; all-gather the transport copy.
//!
//! Layer i's reduction is started before layer i+1's (the previous one)
//! is waited on and updated, and the all-gathers are waited on one layer
//! late, so a layer's communication is in flight while the worker updates
//! the one before it and while the device computes earlier layers.
//!
//! Gradients are scaled by 1 / (targets counted by all ranks) in the loss
//! backward, so the cross-rank sum is exactly the gradient of the global
//! batch's mean loss, whatever each rank's share of counted targets.

use std::ops::Range;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use megatrain_adamw::{AdamW, DecayMask, SlabState, SlabUpdate, Transport};
use megatrain_tier::{LayerSlab, TransportMut};

use super::optimizer::{Current, Job, Shared, accumulate};
use super::spill_window::update_any;
use super::{TrainError, ms};
use crate::dist::{Collective, DistConfig, Elem, InFlight, shard_mask, shard_ranges};

/// A trainer's part in data parallel training: the communicator, and for a
/// sharded optimizer every layer's ranges and this rank's decay masks.
pub(super) struct DistState {
    pub config: DistConfig,
    /// Per layer: every rank's range of the flat slab, in rank order.
    pub ranges: Vec<Vec<Range<usize>>>,
    /// Per layer: the decay mask of this rank's range.
    pub masks: Vec<DecayMask>,
}

impl DistState {
    pub fn new(config: DistConfig, numels: &[usize], masks: &[DecayMask]) -> Self {
        let (rank, size) = (config.comm.rank(), config.comm.size());
        let ranges: Vec<Vec<Range<usize>>> = numels.iter().map(|&n| shard_ranges(n, size)).collect();
        let masks = ranges
            .iter()
            .zip(masks)
            .map(|(r, m)| shard_mask(m, &r[rank]))
            .collect();
        DistState {
            config,
            ranges,
            masks,
        }
    }

    pub fn comm(&self) -> &dyn Collective {
        &*self.config.comm
    }

    pub fn own(&self, layer: usize) -> Range<usize> {
        self.ranges[layer][self.config.comm.rank()].clone()
    }
}

/// What the worker did besides AdamW.
#[derive(Debug, Default)]
pub(super) struct WorkerReport {
    /// AdamW and accumulation, milliseconds.
    pub busy_ms: f64,
    /// Starting and waiting on collectives, milliseconds.
    pub comm_ms: f64,
    /// Payload bytes this rank put into collectives.
    pub comm_bytes: u64,
    /// When the worker was blocked waiting on a collective.
    pub waits: Vec<(Instant, Instant)>,
}

impl WorkerReport {
    /// Time of `waits` after `from`: how long communication held the step
    /// up once the device side had nothing left to do.
    pub fn waited_after(&self, from: Instant) -> f64 {
        self.waits
            .iter()
            .map(|&(s, e)| {
                if e > from {
                    (e - s.max(from)).as_secs_f64() * 1e3
                } else {
                    0.0
                }
            })
            .sum()
    }
}

/// A layer whose reduction is in flight.
struct Reducing<'a> {
    slab: &'a mut LayerSlab,
    update: bool,
    /// The gradient sent (a staging buffer, or empty when it is the held one).
    send: Vec<f32>,
    /// Where the sum lands: the whole layer, or this rank's range.
    recv: Vec<f32>,
    op: Box<dyn InFlight>,
}

/// A layer whose transport copy is being all-gathered; the borrow keeps the
/// buffer alive and untouched until the gather completes.
struct Gathering<'a> {
    _slab: &'a mut LayerSlab,
    op: Box<dyn InFlight>,
}

/// The transport copy's range `r` as the optimizer writes it, and the whole
/// copy as the gather moves it.
fn transport_parts(t: TransportMut<'_>, r: Range<usize>) -> (Transport<'_>, *mut u8, Elem) {
    match t {
        TransportMut::F32(t) => {
            let p = t.as_mut_ptr().cast();
            (Transport::F32(&mut t[r]), p, Elem::F32)
        }
        TransportMut::BF16(t) => {
            let p = t.as_mut_ptr().cast();
            (Transport::Bf16(&mut t[r]), p, Elem::U16)
        }
        TransportMut::F16(t) => {
            let p = t.as_mut_ptr().cast();
            (Transport::F16(&mut t[r]), p, Elem::U16)
        }
    }
}

/// AdamW on range `r` of `slab` with the summed gradient of that range
/// (`grad`, or the held gradient's range when `None`); every held gradient
/// is zeroed for the next step. Returns the transport copy's base pointer.
pub(super) fn update_range(
    slab: &mut LayerSlab,
    grad: Option<&mut [f32]>,
    r: Range<usize>,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<(*mut u8, Elem), TrainError> {
    let index = slab.index();
    let parts = slab.parts_mut();
    let mut held = parts.grads;
    let (transport, base, elem) = transport_parts(parts.transport, r.clone());
    let mut state = SlabState::at_step(*parts.step);
    if r.is_empty() {
        // Fewer elements than ranks: nothing to update here, but the step
        // count (bias correction) moves with every other rank's.
        *parts.step += 1;
    } else {
        let grad = match (grad, held.as_deref_mut()) {
            (Some(g), _) => g,
            (None, Some(h)) => &mut h[r.clone()],
            (None, None) => {
                return Err(TrainError::Internal(format!(
                    "layer {index}: no gradient to apply"
                )));
            }
        };
        let update = SlabUpdate::new(
            &mut parts.params[r.clone()],
            grad,
            &mut parts.m[r.clone()],
            &mut parts.v[r.clone()],
        )
        .decay(mask)
        .transport(transport)
        .grad_scale(grad_scale);
        adamw.step(&mut state, lr, update)?;
        *parts.step = state.step();
    }
    if let Some(h) = held {
        h.fill(0.0);
    }
    slab.evict()?;
    Ok((base, elem))
}

/// The data parallel worker loop (see the module comment). `last`: this is
/// the step's last micro-batch, so gradients are reduced (and, where a
/// job says so, applied).
pub(super) fn dist_worker(
    rx: Receiver<Job<'_>>,
    sh: Shared<'_>,
    dist: &DistState,
    last: bool,
) -> Result<WorkerReport, TrainError> {
    let mut rep = WorkerReport::default();
    let mut first_err: Option<TrainError> = None;
    let mut reducing: Option<Reducing<'_>> = None;
    let mut gathering: Vec<Gathering<'_>> = Vec::new();
    let mut assembly = Assembly::default();
    for job in rx {
        if first_err.is_some() {
            sh.pool.give(job.grads);
            continue;
        }
        let step = (|| -> Result<(), TrainError> {
            let t = Instant::now();
            let whole = assembly.add(job, &sh);
            rep.busy_ms += ms(t);
            let Some(whole) = whole? else {
                return Ok(());
            };
            let started = start(whole, &sh, dist, last, &mut rep)?;
            if let Some(prev) = std::mem::replace(&mut reducing, started) {
                finish(prev, &sh, dist, &mut rep, &mut gathering)?;
            }
            // One gather in flight besides the newest is enough to overlap.
            while gathering.len() > 1 {
                let g = gathering.remove(0);
                wait(g.op, &mut rep)?;
            }
            Ok(())
        })();
        if let Err(e) = step {
            first_err = Some(e);
        }
    }
    let tail = (|| -> Result<(), TrainError> {
        if let Some(prev) = reducing.take() {
            finish(prev, &sh, dist, &mut rep, &mut gathering)?;
        }
        for g in gathering.drain(..) {
            wait(g.op, &mut rep)?;
        }
        Ok(())
    })();
    // Dropping in-flight operations waits for them: no buffer is released
    // while the engine still uses it.
    drop(reducing);
    drop(gathering);
    match first_err.or(tail.err()) {
        Some(e) => Err(e),
        None => Ok(rep),
    }
}

fn wait(op: Box<dyn InFlight>, rep: &mut WorkerReport) -> Result<(), TrainError> {
    let t = Instant::now();
    let r = op.wait();
    let end = Instant::now();
    rep.comm_ms += (end - t).as_secs_f64() * 1e3;
    rep.waits.push((t, end));
    r.map_err(|e| TrainError::Internal(e.to_string()))
}

/// A whole layer's gradients: the collectives move layers, so a data
/// parallel worker gathers a layer's chunks first (its host staging is
/// still layer-sized; the device side moves chunks).
struct Whole<'a> {
    slab: &'a mut LayerSlab,
    /// The gradient to reduce, or empty when it was accumulated into the
    /// held block.
    grads: Vec<f32>,
    update: bool,
}

/// The layer whose chunks are arriving.
#[derive(Default)]
struct Assembly<'a> {
    current: Current<'a>,
    buf: Vec<f32>,
}

impl<'a> Assembly<'a> {
    /// Accumulates a chunk where gradients are held, else copies it into
    /// the layer's buffer; returns the layer once its last chunk is in.
    fn add(&mut self, job: Job<'a>, sh: &Shared<'_>) -> Result<Option<Whole<'a>>, TrainError> {
        let Job {
            slab,
            range,
            grads,
            update,
        } = job;
        let last = match self.current.accept(slab, &range) {
            Ok(last) => last,
            Err(e) => {
                sh.pool.give(grads);
                return Err(e);
            }
        };
        let slab = self.current.slab();
        if let Some(held) = slab.grads_mut() {
            accumulate(&mut held[range.clone()], &grads);
        } else {
            if range.start == 0 {
                self.buf = sh.pool.take(slab.numel());
            }
            self.buf[range].copy_from_slice(&grads);
        }
        sh.pool.give(grads);
        if !last {
            return Ok(None);
        }
        let slab = self.current.take().expect("accepted above");
        Ok(Some(Whole {
            slab,
            grads: std::mem::take(&mut self.buf),
            update,
        }))
    }
}

/// On the last micro-batch, starts the reduction of a layer's gradients
/// (accumulated into the held block by [`Assembly::add`] where held).
fn start<'a>(
    job: Whole<'a>,
    sh: &Shared<'_>,
    dist: &DistState,
    last: bool,
    rep: &mut WorkerReport,
) -> Result<Option<Reducing<'a>>, TrainError> {
    let Whole { slab, grads, update } = job;
    let index = slab.index();
    let n = slab.numel();
    let send = grads;
    if !last {
        if !send.is_empty() {
            sh.pool.give(send);
            return Err(TrainError::Internal(format!(
                "layer {index}: gradients must be held to accumulate micro-batches"
            )));
        }
        return Ok(None);
    }
    let comm = dist.comm();
    let ranges = &dist.ranges[index];
    let sharded = dist.config.shard_optimizer;
    let mut recv = sh.pool.take(if sharded { ranges[comm.rank()].len() } else { n });
    let src: *const f32 = if send.is_empty() {
        slab.grads().expect("held above").as_ptr()
    } else {
        send.as_ptr()
    };
    let t = Instant::now();
    // SAFETY: `send` (or the held gradient, reachable only through `slab`)
    // and `recv` move into the returned `Reducing` with the operation and
    // are neither touched nor dropped before it completes (waited on in
    // `finish`, or on drop).
    let op = unsafe {
        if sharded {
            comm.start_reduce_scatter(src, recv.as_mut_ptr(), ranges)
        } else {
            comm.start_sum(src, recv.as_mut_ptr(), n)
        }
    };
    rep.comm_ms += ms(t);
    let op = match op {
        Ok(op) => op,
        Err(e) => {
            sh.pool.give(recv);
            if !send.is_empty() {
                sh.pool.give(send);
            }
            return Err(TrainError::Internal(e.to_string()));
        }
    };
    rep.comm_bytes += 4 * n as u64;
    Ok(Some(Reducing {
        slab,
        update,
        send,
        recv,
        op,
    }))
}

/// Waits for a layer's reduction, stores the sum, and updates the layer
/// when the job says so (starting the all-gather of its transport copy).
fn finish<'a>(
    r: Reducing<'a>,
    sh: &Shared<'_>,
    dist: &DistState,
    rep: &mut WorkerReport,
    gathering: &mut Vec<Gathering<'a>>,
) -> Result<(), TrainError> {
    let Reducing {
        slab,
        update,
        send,
        mut recv,
        op,
    } = r;
    let waited = wait(op, rep);
    if !send.is_empty() {
        sh.pool.give(send);
    }
    if let Err(e) = waited {
        sh.pool.give(recv);
        return Err(e);
    }
    let index = slab.index();
    let sharded = dist.config.shard_optimizer;
    let own = if sharded { dist.own(index) } else { 0..slab.numel() };
    let t = Instant::now();
    if !update {
        // Clipping mode: the summed gradient waits in the held block for the
        // global norm; outside this rank's range it is stale and zeroed.
        if let Some(held) = slab.grads_mut() {
            held[own.clone()].copy_from_slice(&recv);
            held[..own.start].fill(0.0);
            held[own.end..].fill(0.0);
        }
        sh.pool.give(recv);
        rep.busy_ms += ms(t);
        return Ok(());
    }
    let result = if sharded {
        update_range(
            slab,
            Some(&mut recv),
            own,
            sh.adamw,
            &dist.masks[index],
            sh.lr,
            1.0,
        )
        .map(Some)
    } else {
        let mask = &sh.masks[index];
        let all = 0..slab.numel();
        let r = update_any(slab, Some(&mut recv), all, sh.window, sh.adamw, mask, sh.lr, 1.0);
        if let Some(held) = slab.grads_mut() {
            held.fill(0.0);
        }
        r.map(|()| None)
    };
    sh.pool.give(recv);
    rep.busy_ms += ms(t);
    if let Some((base, elem)) = result? {
        let ranges = &dist.ranges[index];
        let t = Instant::now();
        // SAFETY: the transport copy belongs to `slab`, whose exclusive
        // borrow moves into the `Gathering` and lives until the gather has
        // been waited on.
        let op = unsafe { dist.comm().start_all_gather(base, elem, ranges) }
            .map_err(|e| TrainError::Internal(e.to_string()))?;
        rep.comm_ms += ms(t);
        rep.comm_bytes += (elem.size() * ranges[dist.comm().rank()].len()) as u64;
        gathering.push(Gathering { _slab: slab, op });
    }
    Ok(())
}
