//! The optimizer side of the step: a worker thread that receives each
//! layer's gradients as soon as they reach the host and updates that layer
//! (p, m, v and its transport copy) while the device goes on with earlier
//! layers.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use megatrain_adamw::{AdamW, DecayMask};
use megatrain_tensor::Landed;
use megatrain_tier::{LayerSlab, SpillWindow};
use rayon::prelude::*;

use super::TrainError;
use super::update::{GradSquares, HeldNorms, Hyper, Part, update_part};

/// One chunk of a layer's gradients, handed from the step to the
/// optimizer. A layer's chunks come in order, the first one with the layer
/// itself; the layer is done when a chunk ends at its last element.
pub(super) struct Job<'a> {
    /// The layer, with its first chunk (`None` on the later ones).
    pub slab: Option<&'a mut LayerSlab>,
    /// The layer's elements these gradients are.
    pub range: Range<usize>,
    /// Freshly downloaded gradients, the chunk's size, never the layer's.
    pub grads: Grads,
    /// Run AdamW after accumulating (last micro-batch, no clipping).
    pub update: bool,
}

/// A chunk's gradients as they reached the host.
pub(super) enum Grads {
    /// Copied into a pooled staging buffer.
    Staged(Vec<f32>),
    /// Read where the download left them (a mapped readback buffer, given
    /// back to the executor when dropped): no host copy.
    Landed(Landed),
}

impl std::ops::Deref for Grads {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Grads::Staged(v) => v,
            Grads::Landed(l) => l,
        }
    }
}

impl Grads {
    /// Gives a staging buffer back to `pool`; a landed buffer goes back to
    /// its executor.
    pub fn release(self, pool: &StagingPool) {
        if let Grads::Staged(v) = self {
            pool.give(v);
        }
    }
}

/// The layer whose chunks a worker is receiving.
#[derive(Default)]
pub(super) struct Current<'a> {
    slab: Option<&'a mut LayerSlab>,
    /// The first element not received yet.
    next: usize,
}

impl<'a> Current<'a> {
    /// Takes `job`'s layer (on its first chunk) and checks that the chunk
    /// follows the previous one. Returns the layer and whether this chunk
    /// completes it.
    pub fn accept(
        &mut self,
        slab: Option<&'a mut LayerSlab>,
        range: &Range<usize>,
    ) -> Result<bool, TrainError> {
        if let Some(s) = slab {
            if self.slab.is_some() {
                return Err(TrainError::Internal(format!(
                    "layer {} arrived before the previous layer's last chunk",
                    s.index()
                )));
            }
            self.slab = Some(s);
            self.next = 0;
        }
        let slab = self
            .slab
            .as_deref()
            .ok_or_else(|| TrainError::Internal("a gradient chunk came without its layer".into()))?;
        if range.start != self.next || range.end > slab.numel() || range.start > range.end {
            return Err(TrainError::Internal(format!(
                "layer {}: gradient chunk {range:?} does not follow element {} of {}",
                slab.index(),
                self.next,
                slab.numel()
            )));
        }
        self.next = range.end;
        Ok(range.end == slab.numel())
    }

    pub fn slab(&mut self) -> &mut LayerSlab {
        self.slab.as_deref_mut().expect("accepted a chunk first")
    }

    /// Hands the completed layer out.
    pub fn take(&mut self) -> Option<&'a mut LayerSlab> {
        self.next = 0;
        self.slab.take()
    }
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
    pub grad_sq: &'a GradSquares,
    /// Where the held gradients' squares are summed as their last chunks
    /// are added in (the last micro-batch of a clipping step).
    pub held_norms: Option<&'a HeldNorms>,
}

impl Shared<'_> {
    /// The step's hyperparameters for a layer whose decay mask is `mask`.
    pub fn hyper<'m>(&'m self, mask: &'m DecayMask) -> Hyper<'m> {
        Hyper {
            adamw: self.adamw,
            mask,
            lr: self.lr,
            grad_scale: 1.0,
            grad_sq: Some(self.grad_sq),
        }
    }
}

/// Reused gradient staging buffers: one per chunk in flight, never one per
/// layer per step.
#[derive(Debug, Default)]
pub struct StagingPool(Mutex<PoolState>);

#[derive(Debug, Default)]
struct PoolState {
    free: Vec<Vec<f32>>,
    /// Bytes of every buffer the pool made, in it or handed out.
    owned: u64,
    peak: u64,
}

impl StagingPool {
    /// A buffer of exactly `len` elements (contents unspecified).
    pub fn take(&self, len: usize) -> Vec<f32> {
        let mut st = self.0.lock().expect("staging pool poisoned");
        let mut v = st.free.pop().unwrap_or_default();
        let before = v.capacity();
        // Exactly `len`: a grown buffer must not double (chunks of a layer's
        // tail are smaller than the rest).
        v.reserve_exact(len.saturating_sub(v.len()));
        v.resize(len, 0.0);
        st.owned += 4 * (v.capacity() - before) as u64;
        st.peak = st.peak.max(st.owned);
        v
    }

    pub fn give(&self, v: Vec<f32>) {
        self.0.lock().expect("staging pool poisoned").free.push(v);
    }

    /// Bytes the pool holds now (host staging, for the memory report).
    pub fn bytes(&self) -> u64 {
        let st = self.0.lock().expect("staging pool poisoned");
        st.free.iter().map(|v| 4 * v.capacity() as u64).sum()
    }

    /// Most bytes the pool's buffers took at once (in it or handed out).
    pub fn peak_bytes(&self) -> u64 {
        self.0.lock().expect("staging pool poisoned").peak
    }

    /// Frees the buffers in the pool.
    pub fn release(&self) {
        let mut st = self.0.lock().expect("staging pool poisoned");
        let freed: u64 = st.free.iter().map(|v| 4 * v.capacity() as u64).sum();
        st.owned -= freed.min(st.owned);
        st.free = Vec::new();
    }
}

/// `acc += x`, in parallel for large layers.
pub(super) fn accumulate(acc: &mut [f32], x: &[f32]) {
    const CHUNK: usize = 1 << 15;
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| a.iter_mut().zip(x).for_each(|(a, x)| *a += x));
}

/// The decay mask of elements `r` of a slab of `numel` elements whose mask
/// is `mask`: `mask` itself for the whole slab, else [`sub_mask`].
pub(super) fn part_mask(
    mask: &DecayMask,
    r: Range<usize>,
    numel: usize,
) -> Result<Cow<'_, DecayMask>, TrainError> {
    match r == (0..numel) {
        true => Ok(Cow::Borrowed(mask)),
        false => sub_mask(mask, r).map(Cow::Owned),
    }
}

/// The decay mask of elements `r` of a slab, re-based to 0.
pub(super) fn sub_mask(mask: &DecayMask, r: Range<usize>) -> Result<DecayMask, TrainError> {
    Ok(match mask {
        DecayMask::All => DecayMask::All,
        DecayMask::None => DecayMask::None,
        DecayMask::Ranges { ranges, .. } => DecayMask::from_ranges(
            r.len(),
            ranges
                .iter()
                .map(|d| d.start.max(r.start)..d.end.min(r.end))
                .filter(|d| d.start < d.end)
                .map(|d| d.start - r.start..d.end - r.start),
        )?,
    })
}

/// Gradients `grads` of elements `range` of `slab` (chunks of a layer come
/// in order): accumulated where the tier holds gradients, the whole layer
/// then updated with the last chunk when `update`; else that part updated
/// at once.
pub(super) fn apply_chunk(
    slab: &mut LayerSlab,
    range: Range<usize>,
    grads: &[f32],
    update: bool,
    window: Option<&SpillWindow>,
    h: Hyper<'_>,
) -> Result<(), TrainError> {
    let numel = slab.numel();
    let last = range.end == numel;
    match slab.grads_in(range.clone()) {
        Some(held) => {
            accumulate(held, grads);
            if update && last {
                let all = Part::of(numel, None, 0..numel);
                update_part(slab, all, window, h).map(drop)
            } else {
                Ok(())
            }
        }
        None if update => update_part(slab, Part::of(numel, Some(grads), range), window, h).map(drop),
        None => Err(TrainError::Internal(format!(
            "layer {}: gradients must be held to accumulate micro-batches",
            slab.index()
        ))),
    }
}

fn run_job<'a>(job: Job<'a>, current: &mut Current<'a>, sh: &Shared<'_>) -> Result<(), TrainError> {
    let Job {
        slab,
        range,
        grads,
        update,
    } = job;
    let result = (|| {
        let last = current.accept(slab, &range)?;
        let slab = current.slab();
        let mask = &sh.masks[slab.index()];
        let mut result = apply_chunk(slab, range.clone(), &grads, update, sh.window, sh.hyper(mask));
        if let (Ok(()), Some(n)) = (&result, sh.held_norms) {
            match slab.grads() {
                Some(g) => n.note(slab.index(), g, range),
                None => {
                    result = Err(TrainError::Internal(format!(
                        "layer {}: a clipping step without held gradients",
                        slab.index()
                    )))
                }
            }
        }
        if last {
            current.take();
        }
        result
    })();
    grads.release(sh.pool);
    result
}

/// The worker loop: runs jobs until the sender hangs up. Returns its busy
/// time in milliseconds. After an error it keeps draining (so the sender
/// never blocks on a full queue) and reports the first error.
pub(super) fn worker(rx: Receiver<Job<'_>>, sh: Shared<'_>) -> Result<f64, TrainError> {
    let mut busy = 0.0;
    let mut first_err = None;
    let mut current = Current::default();
    for job in rx {
        if first_err.is_some() {
            job.grads.release(sh.pool);
            continue;
        }
        let t = Instant::now();
        if let Err(e) = run_job(job, &mut current, &sh) {
            first_err = Some(e);
        }
        busy += t.elapsed().as_secs_f64() * 1e3;
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(busy),
    }
}
