use half::{bf16, f16};

use crate::kernel::{self, Bf16Sink, Consts, F16Sink, F32Sink, NoSink};
use crate::{AdamWConfig, AdamWError, DecayMask, Result};

/// Elements per rayon task. Large enough that task overhead vanishes
/// (128 KiB per f32 stream), small enough to balance two to a few dozen
/// threads on a layer-sized slab.
pub const DEFAULT_CHUNK_LEN: usize = 32 * 1024;

/// The copy of the updated parameters that travels to the GPU, written in
/// the same pass as the update.
#[derive(Debug)]
pub enum Transport<'a> {
    /// No copy (the trainer converts elsewhere, or f32 master weights are
    /// uploaded directly).
    None,
    /// bf16, rounded to nearest even, bit-identical to `half::bf16::from_f32`.
    Bf16(&'a mut [bf16]),
    /// f16, rounded to nearest even; finite values beyond f16's range
    /// saturate at ±65504 (bit-identical to
    /// `megatrain_tensor::convert::f32_to_f16_sat_bits`).
    F16(&'a mut [f16]),
    /// An f32 copy, identical to the master weights.
    F32(&'a mut [f32]),
}

impl Transport<'_> {
    fn len(&self) -> Option<usize> {
        match self {
            Transport::None => None,
            Transport::Bf16(t) => Some(t.len()),
            Transport::F16(t) => Some(t.len()),
            Transport::F32(t) => Some(t.len()),
        }
    }
}

/// The gradient an update reads.
#[derive(Debug)]
pub enum Grad<'a> {
    /// Read only: where a download left it (a mapped readback buffer),
    /// so it is never copied into a buffer of ours first.
    Read(&'a [f32]),
    /// Ours to write: zeroed in the same pass when [`SlabUpdate::zero_grad`]
    /// asks.
    Mut(&'a mut [f32]),
    /// This many zeros, read from nowhere: the rows of an embedding table
    /// no token of the step looked up, whose update moves p, m and v by
    /// the same bits a gradient of zeros read from memory would.
    Zero(usize),
}

impl Grad<'_> {
    pub fn len(&self) -> usize {
        match self {
            Grad::Read(g) => g.len(),
            Grad::Mut(g) => g.len(),
            Grad::Zero(n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `r`, borrowed as this gradient is (read only or ours).
    pub fn part(&mut self, r: std::ops::Range<usize>) -> Grad<'_> {
        match self {
            Grad::Read(g) => Grad::Read(&g[r]),
            Grad::Mut(g) => Grad::Mut(&mut g[r]),
            Grad::Zero(n) => {
                assert!(r.start <= r.end && r.end <= *n, "{r:?} of {n} zeros");
                Grad::Zero(r.len())
            }
        }
    }
}

impl<'a> Grad<'a> {
    /// The elements before `mid` and from it, each kept as this gradient is.
    fn split_at(self, mid: usize) -> (Grad<'a>, Grad<'a>) {
        match self {
            Grad::Read(g) => {
                let (a, b) = g.split_at(mid);
                (Grad::Read(a), Grad::Read(b))
            }
            Grad::Mut(g) => {
                let (a, b) = g.split_at_mut(mid);
                (Grad::Mut(a), Grad::Mut(b))
            }
            Grad::Zero(n) => {
                assert!(mid <= n, "split at {mid} of {n} zeros");
                (Grad::Zero(mid), Grad::Zero(n - mid))
            }
        }
    }
}

impl<'a> From<&'a [f32]> for Grad<'a> {
    fn from(g: &'a [f32]) -> Self {
        Grad::Read(g)
    }
}

impl<'a> From<&'a mut [f32]> for Grad<'a> {
    fn from(g: &'a mut [f32]) -> Self {
        Grad::Mut(g)
    }
}

impl<'a> From<&'a mut Vec<f32>> for Grad<'a> {
    fn from(g: &'a mut Vec<f32>) -> Self {
        Grad::Mut(g)
    }
}

/// The step count of one slab, for bias correction. Slabs of one model may
/// be at different counts (a layer frozen for a while, a resumed run), so
/// each carries its own. Saved with the moments in checkpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlabState {
    step: u64,
}

impl SlabState {
    /// A slab that has never been updated.
    pub fn new() -> Self {
        Self::default()
    }

    /// A slab restored from a checkpoint after `step` updates.
    pub fn at_step(step: u64) -> Self {
        Self { step }
    }

    /// Updates applied so far.
    pub fn step(&self) -> u64 {
        self.step
    }
}

static DECAY_ALL: DecayMask = DecayMask::All;

/// Everything one update of one slab reads and writes. Build it with
/// [`SlabUpdate::new`] and the builder methods.
#[derive(Debug)]
pub struct SlabUpdate<'a> {
    pub param: &'a mut [f32],
    pub grad: Grad<'a>,
    /// First moment `m`, zero-initialised for a fresh slab.
    pub exp_avg: &'a mut [f32],
    /// Second moment `v`, zero-initialised for a fresh slab.
    pub exp_avg_sq: &'a mut [f32],
    pub transport: Transport<'a>,
    pub decay: &'a DecayMask,
    /// Overwrite the gradient with zeros after reading it (saves the
    /// trainer a separate pass before the next accumulation).
    pub zero_grad: bool,
    /// Multiplies the gradient before use: the clipping coefficient of the
    /// exact global-norm mode, or a loss-scale inverse. 1 means unscaled.
    pub grad_scale: f32,
}

impl<'a> SlabUpdate<'a> {
    /// An update with no transport copy, decay everywhere, the gradient
    /// kept and unscaled.
    pub fn new(
        param: &'a mut [f32],
        grad: impl Into<Grad<'a>>,
        exp_avg: &'a mut [f32],
        exp_avg_sq: &'a mut [f32],
    ) -> Self {
        Self {
            param,
            grad: grad.into(),
            exp_avg,
            exp_avg_sq,
            transport: Transport::None,
            decay: &DECAY_ALL,
            zero_grad: false,
            grad_scale: 1.0,
        }
    }

    pub fn transport(mut self, transport: Transport<'a>) -> Self {
        self.transport = transport;
        self
    }

    pub fn decay(mut self, decay: &'a DecayMask) -> Self {
        self.decay = decay;
        self
    }

    pub fn zero_grad(mut self, zero: bool) -> Self {
        self.zero_grad = zero;
        self
    }

    pub fn grad_scale(mut self, scale: f32) -> Self {
        self.grad_scale = scale;
        self
    }

    fn validate(&self) -> Result<()> {
        let n = self.param.len();
        let lens = [
            ("gradient", self.grad.len()),
            ("exp_avg (m)", self.exp_avg.len()),
            ("exp_avg_sq (v)", self.exp_avg_sq.len()),
        ];
        for (what, got) in lens
            .into_iter()
            .chain(self.transport.len().map(|l| ("transport copy", l)))
        {
            if got != n {
                return Err(AdamWError::LengthMismatch {
                    what,
                    expected: n,
                    got,
                });
            }
        }
        self.decay.check_len(n)?;
        if self.zero_grad && matches!(self.grad, Grad::Read(_)) {
            return Err(AdamWError::ReadOnlyGrad);
        }
        if !self.grad_scale.is_finite() {
            return Err(AdamWError::InvalidHyper {
                name: "grad_scale",
                value: self.grad_scale as f64,
                why: "must be finite",
            });
        }
        Ok(())
    }
}

/// A contiguous window of a slab: the unit rayon splits.
struct Job<'a> {
    offset: usize,
    p: &'a mut [f32],
    g: Grad<'a>,
    m: &'a mut [f32],
    v: &'a mut [f32],
    t: Transport<'a>,
}

impl<'a> Job<'a> {
    fn split_at(self, mid: usize) -> (Job<'a>, Job<'a>) {
        let (p0, p1) = self.p.split_at_mut(mid);
        let (g0, g1) = self.g.split_at(mid);
        let (m0, m1) = self.m.split_at_mut(mid);
        let (v0, v1) = self.v.split_at_mut(mid);
        let (t0, t1) = match self.t {
            Transport::None => (Transport::None, Transport::None),
            Transport::Bf16(t) => {
                let (a, b) = t.split_at_mut(mid);
                (Transport::Bf16(a), Transport::Bf16(b))
            }
            Transport::F16(t) => {
                let (a, b) = t.split_at_mut(mid);
                (Transport::F16(a), Transport::F16(b))
            }
            Transport::F32(t) => {
                let (a, b) = t.split_at_mut(mid);
                (Transport::F32(a), Transport::F32(b))
            }
        };
        let lo = Job {
            offset: self.offset,
            p: p0,
            g: g0,
            m: m0,
            v: v0,
            t: t0,
        };
        let hi = Job {
            offset: self.offset + mid,
            p: p1,
            g: g1,
            m: m1,
            v: v1,
            t: t1,
        };
        (lo, hi)
    }
}

/// Fused AdamW with `torch.optim.AdamW` semantics (amsgrad and maximize
/// are not supported):
///
/// ```text
/// t  ← t + 1
/// p  ← p · (1 − lr·wd)                        (where the decay mask says so)
/// m  ← β1·m + (1 − β1)·g
/// v  ← β2·v + (1 − β2)·g²
/// p  ← p − lr/(1 − β1^t) · m / (sqrt(v)/sqrt(1 − β2^t) + eps)
/// ```
///
/// in one pass over the slab that also writes the transport copy of `p`
/// and optionally zeroes `g`. Runs on the current rayon pool.
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    chunk_len: usize,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            chunk_len: DEFAULT_CHUNK_LEN,
        })
    }

    /// Elements per rayon task (tests use tiny chunks to hit the seams).
    pub fn with_chunk_len(mut self, chunk_len: usize) -> Self {
        self.chunk_len = chunk_len.max(1);
        self
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Which build of the inner loop runs on this CPU ("avx2+fma" or "baseline").
    pub fn simd_path() -> &'static str {
        kernel::simd_path()
    }

    /// Applies one update to a slab at learning rate `lr` and advances its
    /// step count. Nothing is written if the arguments are rejected.
    pub fn step(&self, state: &mut SlabState, lr: f32, update: SlabUpdate<'_>) -> Result<StepStats> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(AdamWError::InvalidHyper {
                name: "lr",
                value: lr as f64,
                why: "must be finite and >= 0",
            });
        }
        update.validate()?;
        let t = state
            .step
            .checked_add(1)
            .ok_or(AdamWError::StepOverflow(state.step))?;

        let c = &self.config;
        // Bias corrections in f64, as PyTorch computes them on the host.
        let bc1 = 1.0 - (c.beta1 as f64).powf(t as f64);
        let bc2 = 1.0 - (c.beta2 as f64).powf(t as f64);
        let base = Consts {
            beta1: c.beta1,
            one_minus_beta1: 1.0 - c.beta1,
            beta2: c.beta2,
            one_minus_beta2: 1.0 - c.beta2,
            eps: c.eps,
            step_size: (lr as f64 / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            decay_factor: 1.0,
            grad_scale: update.grad_scale,
        };
        let decayed = Consts {
            decay_factor: (1.0 - lr as f64 * c.weight_decay as f64) as f32,
            ..base
        };
        let job = Job {
            offset: 0,
            p: update.param,
            g: update.grad,
            m: update.exp_avg,
            v: update.exp_avg_sq,
            t: update.transport,
        };
        let leaf = |job: Job<'_>| run_leaf(job, update.decay, &base, &decayed, update.zero_grad);
        let sum_sq = split_run(job, self.chunk_len, &leaf);
        state.step = t;
        let scale = update.grad_scale as f64;
        Ok(StepStats {
            grad_sq: sum_sq * scale * scale,
        })
    }
}

/// What a step read of its gradient.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Σ (grad_scale · g)² over the slab in f64: the square of the norm of
    /// the gradient the update applied. The chunks' sums are added in an
    /// order fixed by the slab's length and the chunk length, so the same
    /// for any number of threads. NaN or infinite where the gradient is.
    pub grad_sq: f64,
}

/// Runs `leaf` over chunks of `job` in parallel and sums what the leaves
/// return in the order of the split.
fn split_run<F: Fn(Job<'_>) -> f64 + Sync>(job: Job<'_>, chunk_len: usize, leaf: &F) -> f64 {
    let n = job.p.len();
    if n <= chunk_len {
        return leaf(job);
    }
    // Split on a chunk boundary so every leaf but the last is a whole chunk.
    let mid = n.div_ceil(chunk_len) / 2 * chunk_len;
    let (lo, hi) = job.split_at(mid);
    let (a, b) = rayon::join(
        || split_run(lo, chunk_len, leaf),
        || split_run(hi, chunk_len, leaf),
    );
    a + b
}

/// Updates one chunk; returns Σ g² of its unscaled gradient, taken (and
/// the gradient zeroed, with `zero_grad`) right after the update read it,
/// from cache: the same pass before the update, from memory, cost it 17%,
/// and the update's own loop vectorises only without the sum. In f64, not
/// f32 lanes: each square is exact, so pieces cut elsewhere (other chunks,
/// ranks) change the norm in its last bits only.
fn run_leaf(job: Job<'_>, mask: &DecayMask, base: &Consts, decayed: &Consts, zero_grad: bool) -> f64 {
    let Job {
        offset,
        p,
        mut g,
        m,
        v,
        mut t,
    } = job;
    let mut sum_sq = 0.0;
    mask.for_each_piece(offset..offset + p.len(), |r, decays| {
        let k = if decays { decayed } else { base };
        let r = r.start - offset..r.end - offset;
        let (p, m, v) = (&mut p[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
        match &mut g {
            Grad::Mut(g) => {
                let g = &mut g[r.clone()];
                sink_leaf(k, p, g, m, v, &mut t, r);
                sum_sq += kernel::sum_sq(g);
                if zero_grad {
                    g.fill(0.0);
                }
            }
            Grad::Read(g) => {
                let g = &g[r.clone()];
                sink_leaf(k, p, g, m, v, &mut t, r);
                sum_sq += kernel::sum_sq(g);
            }
            // Zeros from a small block that stays in cache: the update's
            // memory traffic is p, m, v and the copy only.
            Grad::Zero(_) => {
                let mut at = 0;
                while at < p.len() {
                    let end = (at + ZEROS.len()).min(p.len());
                    let l = at..end;
                    let t_r = r.start + at..r.start + end;
                    sink_leaf(
                        k,
                        &mut p[l.clone()],
                        &ZEROS[..l.len()],
                        &mut m[l.clone()],
                        &mut v[l],
                        &mut t,
                        t_r,
                    );
                    at = end;
                }
            }
        }
    });
    sum_sq
}

/// What [`Grad::Zero`] reads, a piece at a time.
static ZEROS: [f32; 4096] = [0.0; 4096];

/// One uniform piece, with the transport copy's sink chosen.
fn sink_leaf(
    k: &Consts,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    t: &mut Transport<'_>,
    r: std::ops::Range<usize>,
) {
    match t {
        Transport::None => kernel::dispatch(k, p, g, m, v, NoSink),
        Transport::Bf16(t) => kernel::dispatch(k, p, g, m, v, Bf16Sink(&mut t[r])),
        // The piece (at most a rayon chunk, 128 KiB of p) is still in cache
        // when the hardware conversion reads it back.
        Transport::F16(t) if kernel::has_f16c() => {
            kernel::dispatch(k, p, g, m, v, NoSink);
            kernel::to_f16_sat(p, &mut t[r]);
        }
        Transport::F16(t) => kernel::dispatch(k, p, g, m, v, F16Sink(&mut t[r])),
        Transport::F32(t) => kernel::dispatch(k, p, g, m, v, F32Sink(&mut t[r])),
    }
}
