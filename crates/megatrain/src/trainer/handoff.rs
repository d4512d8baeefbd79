//! Gradients handed from the executor to the optimizer: each layer's come
//! down in chunks, finished one layer late, and go to the optimizer worker
//! where they landed (or through a staging buffer).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::mpsc::SyncSender;
use std::time::Instant;

use megatrain_tensor::{Download, Executor, Shape, TensorHandle};
use megatrain_tier::LayerSlab;

use super::carry::Carried;
use super::optimizer::{Grads, Job};
use super::upload::check_grads;
use super::{Result, StagingPool, StepMetrics, TrainError, ms};

/// The device side's end of the gradient hand-over, one layer deep: a
/// layer's download starts as soon as its gradients exist (once the layer
/// before it was handed over) and is finished (and the layer sent to the
/// optimizer) only after the next layer's backward has been issued, so
/// the executor computes while bytes travel.
/// Layers are handed over last first, in the order of [`LayerSlab`]s.
///
/// Every layer moves in chunks of at most `chunk` elements, at most
/// `in_flight` of a layer at a time ([`chunks_in_flight`]), so no readback or staging
/// buffer is sized by the largest layer (the embedding or the head, whose
/// size grows with the vocabulary); a layer of one or two chunks moves as
/// a whole layer did. Downloads that are host copies (nothing in flight)
/// are finished at once: deferring them would overlap nothing and keep the
/// layer's gradient tensors alive through the next layer's backward.
pub(super) struct Handoff<'s, 't, E: Executor> {
    ex: &'s E,
    tx: SyncSender<Job<'t>>,
    pool: &'s StagingPool,
    update: bool,
    chunk: usize,
    in_flight: usize,
    /// Whether the last download was a host copy (nothing in flight).
    pub(super) host_copies: bool,
    /// Layers not handed over yet.
    pub(super) remaining: &'t mut [LayerSlab],
    pending: Option<Pending<'t, E::Tensor>>,
    /// These layers (ascending) keep their gradients on the executor for
    /// the next step to apply at this learning rate (`carry.rs`), summed
    /// there over the step's micro-batches.
    carry: (&'s [usize], f32),
    /// Those layers: the sums of the step's earlier micro-batches, which
    /// this one's gradients are added to, or this one's.
    pub(super) carried: Vec<Carried<E::Tensor>>,
    /// This micro-batch ends the step: the carried sums will come down
    /// (in the next step), once, and each carried layer's squares are
    /// summed on the executor for the step's norm.
    last: bool,
}

/// Chunks of one layer's gradients in flight at once, for layers of
/// `numels` elements (table order: the embedding, the blocks, the head):
/// `configured` (`TrainerConfig::chunks_in_flight`), where 0 means all of
/// the largest block's chunks of `chunk` elements; the embedding and the
/// head, larger where the vocabulary is, move as many at a time.
pub(crate) fn chunks_in_flight(configured: usize, numels: &[usize], chunk: usize) -> usize {
    match configured {
        0 => largest_block(numels).div_ceil(chunk.max(1)).max(1),
        n => n,
    }
}

/// The elements of the largest of `layers`, and [`chunks_in_flight`] of
/// them.
pub(super) fn layer_chunks(layers: &[LayerSlab], configured: usize, chunk: usize) -> (usize, usize) {
    let numels: Vec<usize> = layers.iter().map(LayerSlab::numel).collect();
    let largest = numels.iter().copied().max().unwrap_or(0);
    (largest, chunks_in_flight(configured, &numels, chunk))
}

/// Elements of the largest block among layers of `numels` (table order);
/// of the largest layer where the model has no block.
fn largest_block(numels: &[usize]) -> usize {
    let blocks = match numels.len() {
        0..=2 => numels,
        n => &numels[1..n - 1],
    };
    blocks.iter().copied().max().unwrap_or(0)
}

/// Chunk-sized host buffers a step's gradients take at most where the
/// optimizer reads chunks where they landed: `in_flight` of the layer on
/// its way down (a layer's chunks begin once the layer before it was
/// handed over, [`Handoff::push`]), those queued for the optimizer, the
/// one it reads and the one being sent; with several ranks (`dist`) also
/// the one whose reduction is in flight.
pub(crate) fn gradient_chunks_held(optimizer_queue: usize, dist: bool, in_flight: usize) -> usize {
    in_flight + optimizer_queue + 2 + usize::from(dist)
}

impl<'s, 't, E: Executor> Handoff<'s, 't, E> {
    /// Hands `remaining` (every layer, in order) over as their gradients
    /// come: to be updated (`update`) or accumulated.
    pub(super) fn new(
        ex: &'s E,
        tx: SyncSender<Job<'t>>,
        pool: &'s StagingPool,
        update: bool,
        (chunk, in_flight): (usize, usize),
        remaining: &'t mut [LayerSlab],
    ) -> Self {
        Handoff {
            ex,
            tx,
            pool,
            update,
            chunk,
            in_flight,
            host_copies: false,
            remaining,
            pending: None,
            carry: (&[], 0.0),
            carried: Vec::new(),
            last: true,
        }
    }

    /// Keeps the gradients of the layers `set` (ascending) on the executor
    /// instead of handing them over, added to those of the step's earlier
    /// micro-batches (`so_far`), for the next step to apply at learning
    /// rate `lr`. Where this micro-batch is the step's `last`, also the
    /// squares of their sums ([`Carried::squares`]).
    pub(super) fn carrying(
        mut self,
        set: &'s [usize],
        lr: f32,
        so_far: Vec<Carried<E::Tensor>>,
        last: bool,
    ) -> Self {
        self.carry = (set, lr);
        self.carried = so_far;
        self.last = last;
        self
    }

    /// Adds `grads` of carried layer `index` to the step's sum so far,
    /// or starts it.
    fn carry(&mut self, index: usize, grads: Vec<E::Tensor>) -> Result<()> {
        let at = match self.carried.iter().position(|c| c.index == index) {
            Some(at) => {
                let sum = &mut self.carried[at].grads;
                for (acc, g) in sum.iter_mut().zip(&grads) {
                    self.ex.add_assign(acc, g)?;
                }
                at
            }
            None => {
                self.carried.push(Carried {
                    index,
                    grads,
                    lr: self.carry.1,
                    coef: 1.0,
                    squares: None,
                });
                self.carried.len() - 1
            }
        };
        if self.last {
            let c = &mut self.carried[at];
            c.squares = Some(squares_of(self.ex, &c.grads)?);
        }
        Ok(())
    }

    /// Starts the download of the last remaining layer's gradients, then
    /// completes the previous layer's.
    pub(super) fn push(&mut self, grads: Vec<E::Tensor>, m: &mut StepMetrics) -> Result<()> {
        let (slab, rest) = std::mem::take(&mut self.remaining)
            .split_last_mut()
            .ok_or_else(|| TrainError::Internal("no layer left to hand over".into()))?;
        self.remaining = rest;
        let bytes = check_grads(slab, &grads)?;
        let carried = self.carry.0.binary_search(&slab.index()).is_ok();
        // A carried layer's sum comes down once a step.
        if !carried || self.last {
            m.bytes_downloaded += bytes;
        }
        // The previous layer goes to the optimizer before this one's
        // chunks begin, so that the host holds one layer's chunks in flight
        // at a time, not two. Both come before the next layer's backward
        // is queued, so this layer's copies still wait for nothing but the
        // backward that made its gradients.
        if let Some(previous) = self.pending.take() {
            self.drain(previous, m)?;
        }
        if carried {
            return self.carry(slab.index(), grads);
        }
        let mut p = Pending::new(slab, grads, self.in_flight);
        self.begin_more(&mut p, m)?;
        let deferred = p.chunks.in_flight.front().is_some_and(|(_, d)| d.in_flight());
        self.host_copies = !deferred;
        self.pending = Some(p);
        if !deferred {
            self.flush(m)?;
        }
        Ok(())
    }

    /// Completes the last download (end of backward).
    pub(super) fn flush(&mut self, m: &mut StepMetrics) -> Result<()> {
        match self.pending.take() {
            Some(last) => self.drain(last, m),
            None => Ok(()),
        }
    }

    /// Begins the layer's next chunks, up to its `in_flight`.
    fn begin_more(&self, p: &mut Pending<'t, E::Tensor>, m: &mut StepMetrics) -> Result<()> {
        let t = Instant::now();
        p.chunks.begin_more(self.ex, self.chunk)?;
        m.download_ms += ms(t);
        Ok(())
    }

    /// Finishes every chunk of `p` in order, sending each to the optimizer.
    fn drain(&self, mut p: Pending<'t, E::Tensor>, m: &mut StepMetrics) -> Result<()> {
        while let Some((r, d)) = p.chunks.in_flight.pop_front() {
            let t = Instant::now();
            let grads = land_chunk(self.ex, self.pool, d, &p.chunks.grads, r.len());
            m.download_ms += ms(t);
            let grads = grads?;
            self.begin_more(&mut p, m)?;
            let t = Instant::now();
            self.tx
                .send(Job {
                    slab: p.slab.take(),
                    range: r,
                    grads,
                    update: self.update,
                })
                .map_err(|_| TrainError::Internal("optimizer worker stopped".into()))?;
            m.optimizer_wait_ms += ms(t);
        }
        Ok(())
    }
}

/// Σ x² of each row of each of `grads` (one thread group a row on a
/// GPU), joined into one tensor of the executor's: a carried layer's part
/// of the step's norm (clipping's), taken where its gradients are.
fn squares_of<E: Executor>(ex: &E, grads: &[E::Tensor]) -> Result<E::Tensor> {
    let mut rows = grads
        .iter()
        .filter(|g| g.numel() > 0)
        .map(|g| ex.row_dots(g, g))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(match rows.len() {
        0 => ex.zeros(&Shape::from(&[1][..]))?,
        1 => rows.pop().expect("one"),
        _ => ex.concat_last(&rows.iter().collect::<Vec<_>>())?,
    })
}

/// Completes one chunk's download of `len` elements of `grads`: in place
/// where the executor can, else copied into a staging buffer of `pool`.
pub(super) fn land_chunk<E: Executor>(
    ex: &E,
    pool: &StagingPool,
    d: Download<E::Tensor>,
    grads: &[E::Tensor],
    len: usize,
) -> Result<Grads> {
    let d = match ex.finish_download_in_place(d)? {
        Ok(values) if values.len() == len => return Ok(Grads::Landed(values)),
        Ok(values) => {
            return Err(TrainError::Internal(format!(
                "a gradient chunk of {len} elements landed as {}",
                values.len()
            )));
        }
        Err(d) => d,
    };
    let mut staging = pool.take(len);
    match ex.finish_download_range(d, grads, &mut staging) {
        Ok(()) => Ok(Grads::Staged(staging)),
        Err(e) => {
            pool.give(staging);
            Err(e.into())
        }
    }
}

/// A layer whose gradients are coming down in chunks, handed to the
/// optimizer with the layer.
struct Pending<'t, T> {
    /// The layer, until its first chunk is sent with it.
    slab: Option<&'t mut LayerSlab>,
    chunks: Falling<T>,
}

impl<'t, T> Pending<'t, T> {
    fn new(slab: &'t mut LayerSlab, grads: Vec<T>, in_flight: usize) -> Self {
        Pending {
            chunks: Falling::new(slab.numel(), grads, in_flight),
            slab: Some(slab),
        }
    }
}

/// A layer's gradients coming down in chunks: the step's hand-over and
/// the transfer-only mode move them the same way.
pub(super) struct Falling<T> {
    /// The gradient tensors (table order), kept until every chunk is in.
    pub(super) grads: Vec<T>,
    numel: usize,
    /// First element not begun yet.
    next: usize,
    begun_all: bool,
    /// Most chunks in flight at once.
    limit: usize,
    pub(super) in_flight: VecDeque<(Range<usize>, Download<T>)>,
}

impl<T> Falling<T> {
    pub(super) fn new(numel: usize, grads: Vec<T>, limit: usize) -> Self {
        Falling {
            grads,
            numel,
            next: 0,
            begun_all: false,
            limit: limit.max(1),
            in_flight: VecDeque::new(),
        }
    }

    /// Begins the next chunks of at most `chunk` elements, up to the
    /// limit in flight.
    pub(super) fn begin_more<E: Executor<Tensor = T>>(&mut self, ex: &E, chunk: usize) -> Result<()> {
        while self.in_flight.len() < self.limit && !self.begun_all {
            let r = self.next..(self.next + chunk).min(self.numel);
            let d = ex.begin_download_range(&self.grads, r.clone())?;
            self.next = r.end;
            self.begun_all = self.next == self.numel;
            self.in_flight.push_back((r, d));
        }
        Ok(())
    }
}
