//! The optimizer worker of a data parallel step: gradients are summed
//! across ranks chunk by chunk as they land in host memory (the chunks of
//! [`TrainerConfig::transfer_chunk`](super::TrainerConfig) the device hands
//! down), and each chunk is updated as soon as its sum is in, while the
//! device goes on with earlier layers. No host buffer is sized by a layer:
//! the staging, the receive buffers and the engine's own copies are sized
//! by the chunk, whatever the vocabulary.
//!
//! Per chunk, on the last micro-batch, in layer and chunk order (the same
//! on every rank, which MPI requires of collectives):
//!
//! - replicated optimizer: all-reduce the chunk; AdamW on it;
//! - sharded optimizer (ZeRO-1/2): reduce-scatter the chunk, so this rank
//!   receives the sum over its 1/N range ∩ the chunk only (possibly
//!   nothing: counts follow the shards, see [`chunk_ranges`]); AdamW on
//!   that part of p, m, v and the transport copy; all-gather the chunk of
//!   the transport copy.
//!
//! Where gradients are held (micro-batches, clipping) each chunk is added
//! into the layer's held block and, on the last micro-batch, that block's
//! chunk is what is reduced: no other layer-sized buffer. AdamW is
//! elementwise, so a layer updated chunk by chunk gets the bits of one
//! updated whole; its step count (bias correction) moves once, with the
//! chunk that ends the layer, on every rank alike.
//!
//! Chunk i's reduction is started before chunk i−1's is waited on and
//! updated, and the all-gathers are waited on one chunk late, so a chunk's
//! communication is in flight while the worker updates the one before it
//! and while the device computes earlier layers.
//!
//! Gradients are scaled by 1 / (targets counted by all ranks) in the loss
//! backward, so the cross-rank sum is exactly the gradient of the global
//! batch's mean loss, whatever each rank's share of counted targets.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use megatrain_tier::LayerSlab;
use megatrain_tier::shard::layer_ranges;

use super::optimizer::{Grads, Job, Shared, accumulate};
use super::update::{Part, update_part};
use super::{TrainError, ms};
use crate::dist::{Collective, DistConfig, InFlight, chunk_ranges};

/// A gather of a chunk of a transport copy in flight, and the bytes this
/// rank put into it.
pub(super) type Gather = (Box<dyn InFlight>, u64);

/// A trainer's part in data parallel training: the communicator, and for a
/// sharded optimizer every layer's ranges.
pub(super) struct DistState {
    pub config: DistConfig,
    /// Per layer: every rank's range of the flat slab, in rank order
    /// (on whole pages for a spilled layer, whose rank moves only its own
    /// range through the spill window).
    pub ranges: Vec<Vec<Range<usize>>>,
}

impl DistState {
    pub fn new(config: DistConfig, layers: &[LayerSlab]) -> Self {
        let size = config.comm.size();
        let ranges = layers
            .iter()
            .map(|s| layer_ranges(s.numel(), s.is_spilled(), size))
            .collect();
        DistState { config, ranges }
    }

    pub fn comm(&self) -> &dyn Collective {
        &*self.config.comm
    }

    pub fn own(&self, layer: usize) -> Range<usize> {
        self.ranges[layer][self.config.comm.rank()].clone()
    }

    /// Starts bringing every rank's `parts` of a chunk of a transport copy
    /// (`base` is the chunk's first element) to this rank's copy: an
    /// all-gather, between machines only where their ranks share a copy
    /// (none on one machine). Returns it with the bytes this rank put in.
    ///
    /// # Safety
    /// As [`Collective::start_all_gather`] for `base` and `parts`.
    pub unsafe fn gather_transport(
        &self,
        base: *mut u8,
        elem: crate::dist::Elem,
        parts: &[Range<usize>],
    ) -> Result<Option<Gather>, TrainError> {
        let mine = parts[self.config.comm.rank()].len();
        let bytes = (elem.size() * mine) as u64;
        let err = |e: crate::dist::DistError| TrainError::Internal(e.to_string());
        match &self.config.shared {
            None => {
                let op = unsafe { self.comm().start_all_gather(base, elem, parts) }.map_err(err)?;
                Ok(Some((op, bytes)))
            }
            Some(m) => match &m.cross {
                None => Ok(None),
                Some(cross) => {
                    let peers: Vec<Range<usize>> = m.peers.iter().map(|&r| parts[r].clone()).collect();
                    let op = unsafe { cross.start_all_gather(base, elem, &peers) }.map_err(err)?;
                    Ok(Some((op, bytes)))
                }
            },
        }
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

/// The data parallel worker loop (see the module comment). `last`: this is
/// the step's last micro-batch, so gradients are reduced (and, where a
/// job says so, applied).
pub(super) fn dist_worker(
    rx: Receiver<Job<'_>>,
    sh: Shared<'_>,
    dist: &DistState,
    last: bool,
) -> Result<WorkerReport, TrainError> {
    let mut w = DistWorker {
        sh,
        dist,
        last,
        rep: WorkerReport::default(),
        reducing: None,
        gathering: VecDeque::new(),
        arrivals: Arrivals::default(),
    };
    let mut first_err: Option<TrainError> = None;
    for job in rx {
        if first_err.is_some() {
            job.grads.release(w.sh.pool);
            continue;
        }
        if let Err(e) = w.job(job) {
            first_err = Some(e);
        }
    }
    let tail = (|| -> Result<(), TrainError> {
        if let Some(prev) = w.reducing.take() {
            w.finish(prev)?;
        }
        while let Some(g) = w.gathering.pop_front() {
            wait(g, &mut w.rep)?;
        }
        Ok(())
    })();
    // Dropping in-flight operations waits for them: no buffer is released
    // while the engine still uses it.
    drop(w.reducing.take());
    w.gathering.clear();
    match first_err.or(tail.err()) {
        Some(e) => Err(e),
        None => Ok(w.rep),
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

/// The layers whose chunks have come in this micro-batch. They stay
/// borrowed until the worker ends, so a layer's held gradient and
/// transport copy outlive every collective that reads or writes a chunk of
/// them.
#[derive(Default)]
struct Arrivals<'a> {
    slabs: Vec<&'a mut LayerSlab>,
    /// The newest layer's first element not received yet; `None` once its
    /// last chunk is in.
    next: Option<usize>,
}

impl<'a> Arrivals<'a> {
    /// Takes `slab` (with its layer's first chunk) and checks that `range`
    /// follows the previous chunk. Returns the layer's place in `slabs`
    /// and whether the chunk ends the layer.
    fn accept(
        &mut self,
        slab: Option<&'a mut LayerSlab>,
        range: &Range<usize>,
    ) -> Result<(usize, bool), TrainError> {
        if let Some(s) = slab {
            if self.next.is_some() {
                return Err(TrainError::Internal(format!(
                    "layer {} arrived before the previous layer's last chunk",
                    s.index()
                )));
            }
            self.slabs.push(s);
            self.next = Some(0);
        }
        let (Some(next), Some(slab)) = (self.next, self.slabs.last()) else {
            return Err(TrainError::Internal(
                "a gradient chunk came without its layer".into(),
            ));
        };
        let numel = slab.numel();
        if range.start != next || range.end > numel || range.start > range.end {
            return Err(TrainError::Internal(format!(
                "layer {}: gradient chunk {range:?} does not follow element {next} of {numel}",
                slab.index()
            )));
        }
        let ends = range.end == numel;
        self.next = (!ends).then_some(range.end);
        Ok((self.slabs.len() - 1, ends))
    }
}

/// A chunk whose reduction is in flight.
struct Reducing {
    /// First, so that dropping it (which waits) comes before the buffers go.
    op: Box<dyn InFlight>,
    /// The layer's place in [`Arrivals::slabs`].
    at: usize,
    chunk: Range<usize>,
    /// The chunk ends its layer.
    ends: bool,
    update: bool,
    /// The gradient sent (where it landed, or a staging buffer; `None`
    /// when it is the held block's chunk). Only read: the sum lands in
    /// `recv`.
    send: Option<Grads>,
    /// Where the sum lands: the whole chunk, or this rank's part of it.
    recv: Vec<f32>,
}

struct DistWorker<'a, 's> {
    /// First, so that dropping them (which waits) comes before the rest.
    reducing: Option<Reducing>,
    gathering: VecDeque<Box<dyn InFlight>>,
    sh: Shared<'s>,
    dist: &'s DistState,
    last: bool,
    rep: WorkerReport,
    arrivals: Arrivals<'a>,
}

impl<'a> DistWorker<'a, '_> {
    /// Takes one chunk: accumulated into the held block where gradients
    /// are held; on the last micro-batch its reduction is started and the
    /// previous chunk's finished.
    fn job(&mut self, job: Job<'a>) -> Result<(), TrainError> {
        let Job {
            slab,
            range,
            grads,
            update,
        } = job;
        let (at, ends) = match self.arrivals.accept(slab, &range) {
            Ok(x) => x,
            Err(e) => {
                grads.release(self.sh.pool);
                return Err(e);
            }
        };
        let slab = &mut *self.arrivals.slabs[at];
        let send = match slab.grads_in(range.clone()) {
            Some(held) => {
                let t = Instant::now();
                accumulate(held, &grads);
                self.rep.busy_ms += ms(t);
                grads.release(self.sh.pool);
                None
            }
            // The reduction reads the chunk where it is.
            None => Some(grads),
        };
        if !self.last {
            if let Some(send) = send {
                send.release(self.sh.pool);
                return Err(TrainError::Internal(format!(
                    "layer {}: gradients must be held to accumulate micro-batches",
                    slab.index()
                )));
            }
            return Ok(());
        }
        let started = self.start(at, range, ends, update, send)?;
        if let Some(prev) = self.reducing.replace(started) {
            self.finish(prev)?;
        }
        // One gather in flight besides the newest is enough to overlap.
        while self.gathering.len() > 1 {
            let g = self.gathering.pop_front().expect("more than one");
            wait(g, &mut self.rep)?;
        }
        Ok(())
    }

    /// Every rank's part of `chunk` of layer `index`: this rank's shard cut
    /// to the chunk, re-based (the whole chunk, replicated).
    fn parts(&self, index: usize, chunk: &Range<usize>) -> Vec<Range<usize>> {
        if self.dist.config.shard_optimizer {
            chunk_ranges(&self.dist.ranges[index], chunk)
        } else {
            std::iter::once(0..chunk.len()).collect()
        }
    }

    /// Starts the reduction of a chunk (`send`, or the held block's chunk
    /// when `None`).
    fn start(
        &mut self,
        at: usize,
        chunk: Range<usize>,
        ends: bool,
        update: bool,
        send: Option<Grads>,
    ) -> Result<Reducing, TrainError> {
        let index = self.arrivals.slabs[at].index();
        let comm = self.dist.comm();
        let sharded = self.dist.config.shard_optimizer;
        let parts = self.parts(index, &chunk);
        let n = chunk.len();
        let recv_len = if sharded { parts[comm.rank()].len() } else { n };
        let mut recv = self.sh.pool.take(recv_len);
        let slab = &mut *self.arrivals.slabs[at];
        let src: *const f32 = match (&send, slab.grads_in(chunk.clone())) {
            (Some(g), _) => g.as_ptr(),
            (None, Some(held)) => held.as_ptr(),
            (None, None) => {
                self.sh.pool.give(recv);
                return Err(TrainError::Internal(format!(
                    "layer {index}: a chunk to reduce with neither gradients nor a held block"
                )));
            }
        };
        let t = Instant::now();
        // SAFETY: `send` and `recv` move into the returned `Reducing` with
        // the operation and are neither touched nor dropped before it
        // completes (waited on in `finish`, or on drop). A held block's
        // chunk stays borrowed by `arrivals` until the worker ends, and no
        // reference to it is made meanwhile: later chunks' accumulation and
        // updates reach the block only through `grads_in`/`parts_in` of
        // their own elements, and this chunk is next written in `finish`,
        // after the wait.
        let op = unsafe {
            if sharded {
                comm.start_reduce_scatter(src, recv.as_mut_ptr(), &parts)
            } else {
                comm.start_sum(src, recv.as_mut_ptr(), n)
            }
        };
        self.rep.comm_ms += ms(t);
        let op = match op {
            Ok(op) => op,
            Err(e) => {
                self.sh.pool.give(recv);
                if let Some(send) = send {
                    send.release(self.sh.pool);
                }
                return Err(TrainError::Internal(e.to_string()));
            }
        };
        self.rep.comm_bytes += 4 * n as u64;
        Ok(Reducing {
            op,
            at,
            chunk,
            ends,
            update,
            send,
            recv,
        })
    }

    /// Waits for a chunk's reduction, stores the sum, and updates the
    /// chunk when the job says so (starting the all-gather of its part of
    /// the transport copy).
    fn finish(&mut self, r: Reducing) -> Result<(), TrainError> {
        let Reducing {
            op,
            at,
            chunk,
            ends,
            update,
            send,
            recv,
        } = r;
        let waited = wait(op, &mut self.rep);
        if let Some(send) = send {
            send.release(self.sh.pool);
        }
        if let Err(e) = waited {
            self.sh.pool.give(recv);
            return Err(e);
        }
        let index = self.arrivals.slabs[at].index();
        let sharded = self.dist.config.shard_optimizer;
        let comm = self.dist.comm();
        let parts = self.parts(index, &chunk);
        let mine = &parts[if sharded { comm.rank() } else { 0 }];
        let own = chunk.start + mine.start..chunk.start + mine.end;
        let sh = &self.sh;
        let slab = &mut *self.arrivals.slabs[at];
        let t = Instant::now();
        if !update {
            // Clipping mode: the summed gradient waits in the held block for
            // the global norm; outside this rank's shard it is stale and
            // zeroed.
            if let Some(held) = slab.grads_in(chunk.clone()) {
                held[mine.clone()].copy_from_slice(&recv);
                held[..mine.start].fill(0.0);
                held[mine.end..].fill(0.0);
            }
            sh.pool.give(recv);
            self.rep.busy_ms += ms(t);
            return Ok(());
        }
        let h = sh.hyper(&sh.masks[index]);
        let result = if sharded {
            let part = Part {
                grad: Some(&recv),
                r: own.clone(),
                zero: chunk.clone(),
                ends,
            };
            update_part(slab, part, sh.window, h).map(Some)
        } else {
            // A held block takes the sum and is zeroed by the update's own
            // pass (before a spilled layer's pages are dropped with its
            // last chunk).
            let grad = match slab.grads_in(chunk.clone()) {
                Some(held) => {
                    held.copy_from_slice(&recv);
                    None
                }
                None => Some(&recv[..]),
            };
            let part = Part {
                grad,
                r: chunk.clone(),
                zero: chunk.clone(),
                ends,
            };
            update_part(slab, part, sh.window, h).map(|_| None)
        };
        sh.pool.give(recv);
        self.rep.busy_ms += ms(t);
        if let Some((base, elem)) = result? {
            let t = Instant::now();
            // SAFETY: `base` is the transport copy at `chunk.start` (the
            // update's `zero` is the chunk). The copy belongs to a slab
            // `arrivals` keeps borrowed until the worker ends, after every
            // gather has been waited on, and no reference to this chunk's
            // elements is made again this step: later updates reach the
            // copy only through `parts_in` of their own chunks.
            if let Some((op, bytes)) = unsafe { self.dist.gather_transport(base, elem, &parts) }? {
                self.rep.comm_bytes += bytes;
                self.gathering.push_back(op);
            }
            self.rep.comm_ms += ms(t);
        }
        Ok(())
    }
}
