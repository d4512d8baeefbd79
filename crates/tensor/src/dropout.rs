//! Dropout masks drawn from a counter-based hash, not from RNG state: an
//! element's fate is a function of `(key, row, column)`, so a recomputed
//! forward (checkpointing) and the backward draw exactly the forward's mask
//! without storing it, every executor draws the same one (the GPU kernels
//! run [`mix`] and [`Dropout::keeps`] as written here,
//! `shaders/dropout_mask.wgsl`), and a batch split
//! over ranks or micro-batches draws what the whole batch would: rows are
//! counted from the batch's first row ([`Dropout::batch0`]).

use crate::{Error, Result, Shape};

/// 2³²: the threshold's scale.
const ONE: f64 = 4_294_967_296.0;

/// The largest probability a dropout takes: at 1 every element is dropped
/// and `1 / (1 − p)` is infinite.
pub const MAX_DROPOUT: f64 = 0.99;

/// One dropout site of one step: each element is kept with probability
/// `1 − p` and scaled by `1 / (1 − p)`, or zeroed. Its backward is the same
/// op on the output's gradient (the mask and the scale are the forward's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dropout {
    /// An element is kept where its hash is at least this: `p · 2³²`.
    threshold: u32,
    key: [u32; 2],
    /// The first batch row of the tensor in the whole batch it was drawn
    /// for: row `r` of a tensor is row `batch0 + r` of the batch.
    batch0: u32,
}

/// lowbias32 (Chris Wellons' integer hash search): a bijection of u32 whose
/// every input bit flips each output bit with probability close to ½.
pub fn mix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^ (h >> 16)
}

/// Folds the 64-bit words of a key into one (splitmix64's finaliser): the
/// trainer derives a site's key from its seed, step, micro-batch and site.
pub fn mix64(words: &[u64]) -> u64 {
    words.iter().fold(0x9e37_79b9_7f4a_7c15u64, |acc, &w| {
        let mut z = acc ^ w.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

impl Dropout {
    /// Dropout with probability `p` under `key`; `None` where `p` is 0.
    /// Refuses `p` outside `[0, MAX_DROPOUT]`, naming `op`.
    pub fn new(p: f64, key: u64, op: &'static str) -> Result<Option<Dropout>> {
        if !(0.0..=MAX_DROPOUT).contains(&p) {
            return Err(Error::invalid(
                op,
                format!("a dropout probability must lie in [0, {MAX_DROPOUT}], not {p}"),
            ));
        }
        let threshold = (p * ONE).round() as u32;
        Ok((threshold > 0).then_some(Dropout {
            threshold,
            key: [key as u32, (key >> 32) as u32],
            batch0: 0,
        }))
    }

    /// The same mask for a tensor whose first row is row `batch0` of the
    /// batch.
    pub fn at_batch_row(self, batch0: usize) -> Dropout {
        Dropout {
            batch0: batch0 as u32,
            ..self
        }
    }

    /// The probability of dropping, as the mask draws it (`p` rounded to a
    /// multiple of 2⁻³²).
    pub fn p(&self) -> f64 {
        f64::from(self.threshold) / ONE
    }

    /// The factor kept elements are scaled by, `1 / (1 − p)`, rounded once
    /// from f64 (the GPU kernels take it as this f32).
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.p())
    }

    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    pub fn key(&self) -> [u32; 2] {
        self.key
    }

    pub fn batch0(&self) -> u32 {
        self.batch0
    }

    /// The row index of row `r` of batch row `b` for tensors with `rows`
    /// rows per batch row, as the mask counts it (wrapping past 2³²).
    pub fn row(&self, b: usize, rows: usize, r: usize) -> u32 {
        mask_row(self.batch0, b, rows, r)
    }

    /// Whether element `col` of mask row `row` ([`Dropout::row`]) is kept.
    pub fn keeps(&self, row: u32, col: u32) -> bool {
        hash(self.key, row, col) >= self.threshold
    }

    /// `x` (`batch` rows of `rows × cols` elements) dropped in place: what
    /// [`Executor::dropout`](crate::Executor::dropout) computes, with
    /// `scale` the executor's rounding of [`Dropout::scale`].
    pub fn apply<F: Copy + Default + std::ops::Mul<Output = F>>(
        &self,
        x: &mut [F],
        rows: usize,
        cols: usize,
        scale: F,
    ) {
        each_element(self.batch0, x, (rows, cols), |r, c, v| {
            *v = if self.keeps(r, c) {
                *v * scale
            } else {
                F::default()
            };
        });
    }
}

/// `f(mask row, column, element)` for each element of `x`, `batch` rows of
/// `rows × cols` elements, mask rows counted from batch row `batch0`.
fn each_element<F>(batch0: u32, x: &mut [F], (rows, cols): (usize, usize), f: impl Fn(u32, u32, &mut F)) {
    assert!(
        rows > 0 && cols > 0 && x.len().is_multiple_of(rows * cols),
        "mask layout"
    );
    for (i, row) in x.chunks_mut(cols).enumerate() {
        let r = mask_row(batch0, i / rows, rows, i % rows);
        for (c, v) in row.iter_mut().enumerate() {
            f(r, c as u32, v);
        }
    }
}

/// Row `r` of batch row `b` of a tensor of `rows` rows per batch row whose
/// first batch row is the batch's `batch0`, as masks count rows.
fn mask_row(batch0: u32, b: usize, rows: usize, r: usize) -> u32 {
    (batch0.wrapping_add(b as u32))
        .wrapping_mul(rows as u32)
        .wrapping_add(r as u32)
}

/// The hash of element `col` of mask row `row` under `key`.
fn hash(key: [u32; 2], row: u32, col: u32) -> u32 {
    mix(mix(mix(key[0] ^ row) ^ col) ^ key[1])
}

/// 2⁻²³: a 24-bit hash times this is exact in f32.
const ULP24: f32 = 1.0 / 8_388_608.0;

/// Uniform noise added to a tensor: element `col` of mask row `row` (rows
/// counted as [`Dropout::row`] counts them) gets `magnitude · u`, `u` in
/// [−1, 1) from the top 24 bits of the dropout hash of `(key, row, col)`,
/// exact in f32 on every executor (`shaders/dropout_mask.wgsl` computes it
/// as written here). NEFTune (Jain et al. 2023; transformers'
/// `neftune_noise_alpha`) adds it to the embedding's output in training,
/// `magnitude = α / √(T·C)`. Its backward passes the gradient unchanged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Noise {
    magnitude: f32,
    key: [u32; 2],
    batch0: u32,
}

impl Noise {
    /// Noise of `magnitude` under `key`; `None` where it is 0. Refuses a
    /// magnitude that is negative or not finite (in f32), naming `op`.
    pub fn new(magnitude: f64, key: u64, op: &'static str) -> Result<Option<Noise>> {
        let m = magnitude as f32;
        if !(m.is_finite() && m >= 0.0) {
            return Err(Error::invalid(
                op,
                format!("a noise magnitude must be finite and >= 0, not {magnitude}"),
            ));
        }
        Ok((m > 0.0).then_some(Noise {
            magnitude: m,
            key: [key as u32, (key >> 32) as u32],
            batch0: 0,
        }))
    }

    /// The same noise for a tensor whose first row is row `batch0` of the
    /// batch.
    pub fn at_batch_row(self, batch0: usize) -> Noise {
        Noise {
            batch0: batch0 as u32,
            ..self
        }
    }

    pub fn magnitude(&self) -> f32 {
        self.magnitude
    }

    pub fn key(&self) -> [u32; 2] {
        self.key
    }

    pub fn batch0(&self) -> u32 {
        self.batch0
    }

    /// The row index of row `r` of batch row `b`, as [`Dropout::row`].
    pub fn row(&self, b: usize, rows: usize, r: usize) -> u32 {
        mask_row(self.batch0, b, rows, r)
    }

    /// The noise of element `col` of mask row `row`.
    pub fn value(&self, row: u32, col: u32) -> f32 {
        let u = (hash(self.key, row, col) >> 8) as f32 * ULP24 - 1.0;
        u * self.magnitude
    }

    /// `x` (`batch` rows of `rows × cols` elements) with the noise added in
    /// place: what [`Executor::add_noise`](crate::Executor::add_noise)
    /// computes, the sum in `F`.
    pub fn apply<F: Copy + std::ops::Add<Output = F>>(
        &self,
        x: &mut [F],
        rows: usize,
        cols: usize,
        widen: impl Fn(f32) -> F,
    ) {
        each_element(self.batch0, x, (rows, cols), |r, c, v| {
            *v = *v + widen(self.value(r, c));
        });
    }
}

/// `(batch, rows, cols)` of a tensor [`Executor::dropout`](crate::Executor::dropout)
/// takes (`[B, …, C]`, rank ≥ 2: rows are the middle dimensions' product),
/// or an error naming `op` and the shape.
pub fn dropout_layout(op: &'static str, shape: &Shape) -> Result<(usize, usize, usize)> {
    let d = shape.dims();
    if d.len() < 2 {
        return Err(Error::shape(op, format!("x {shape} must be [B, …, C]")));
    }
    Ok((d[0], d[1..d.len() - 1].iter().product(), d[d.len() - 1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_none_and_out_of_range_is_refused() {
        assert!(Dropout::new(0.0, 7, "t").unwrap().is_none());
        for p in [-0.1, 1.0, f64::NAN, 2.0] {
            let e = Dropout::new(p, 7, "t").unwrap_err().to_string();
            assert!(e.contains("dropout probability") && e.contains("0.99"), "{e}");
        }
        let d = Dropout::new(0.25, 7, "t").unwrap().unwrap();
        assert_eq!(d.p(), 0.25);
        assert_eq!(d.scale(), 1.0 / 0.75);
    }

    #[test]
    fn noise_is_uniform_in_its_magnitude_with_no_pattern() {
        assert!(Noise::new(0.0, 7, "t").unwrap().is_none());
        for m in [-0.1, f64::NAN, f64::INFINITY, 1e39] {
            let e = Noise::new(m, 7, "t").unwrap_err().to_string();
            assert!(e.contains("noise magnitude") && e.contains(&m.to_string()), "{e}");
        }
        let d = Noise::new(0.5, 0x1234_5678_9abc_def0, "t").unwrap().unwrap();
        let (rows, cols) = (512u32, 384u32);
        let v: Vec<f64> = (0..rows)
            .flat_map(|r| (0..cols).map(move |c| (r, c)))
            .map(|(r, c)| f64::from(d.value(r, c)))
            .collect();
        let n = v.len() as f64;
        assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
        // U(−m, m): mean 0 and variance m²/3, its sigma over 196,608 draws
        // about 6.5e-4 and 3.4e-4.
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| x * x).sum::<f64>() / n - mean * mean;
        assert!(mean.abs() < 3e-3, "mean {mean}");
        assert!((var - 0.25 / 3.0).abs() < 2e-3, "variance {var}");
        // A quarter in each quarter of the range.
        for q in 0..4 {
            let lo = -0.5 + 0.25 * q as f64;
            let share = v.iter().filter(|x| (lo..lo + 0.25).contains(*x)).count() as f64 / n;
            assert!((share - 0.25).abs() < 0.005, "quarter {q}: {share}");
        }
        // Neighbours along a row and down a column are uncorrelated.
        for step in [1, cols as usize] {
            let c = (0..v.len() - step).map(|i| v[i] * v[i + step]).sum::<f64>() / (n - step as f64);
            assert!(c.abs() < 3e-3, "step {step}: {c}");
        }
        // Its rows are counted from batch0 as a dropout mask's.
        let at = d.at_batch_row(3);
        assert_eq!(at.value(at.row(0, 5, 2), 7), d.value(d.row(3, 5, 2), 7));
    }

    #[test]
    fn keeps_the_asked_share_with_no_pattern() {
        let d = Dropout::new(0.3, 0x1234_5678_9abc_def0, "t").unwrap().unwrap();
        let (rows, cols) = (512u32, 384u32);
        let n = f64::from(rows * cols);
        let kept: Vec<bool> = (0..rows)
            .flat_map(|r| (0..cols).map(move |c| (r, c)))
            .map(|(r, c)| d.keeps(r, c))
            .collect();
        let share = kept.iter().filter(|&&k| k).count() as f64 / n;
        // 196,608 draws: the binomial's sigma is about 0.001.
        assert!((share - 0.7).abs() < 0.005, "kept {share}");
        // Neighbours along a row and down a column are independent: both
        // kept at 0.49, within a few sigmas.
        let pairs = |step: usize| {
            let both = (0..kept.len() - step)
                .filter(|&i| kept[i] && kept[i + step])
                .count();
            both as f64 / (kept.len() - step) as f64
        };
        for step in [1, cols as usize] {
            assert!((pairs(step) - 0.49).abs() < 0.006, "step {step}: {}", pairs(step));
        }
        // Another key draws another mask.
        let e = Dropout::new(0.3, 0x1234_5678_9abc_def1, "t").unwrap().unwrap();
        let same = (0..rows * cols).filter(|&i| d.keeps(i / cols, i % cols) == e.keeps(i / cols, i % cols));
        let agree = same.count() as f64 / n;
        assert!((agree - 0.58).abs() < 0.006, "agree {agree}");
    }

    #[test]
    fn rows_count_from_the_first_batch_row() {
        let d = Dropout::new(0.5, 99, "t").unwrap().unwrap();
        let whole: Vec<f32> = {
            let mut x = vec![1.0f32; 4 * 3 * 5];
            d.apply(&mut x, 3, 5, 2.0);
            x
        };
        let mut tail = vec![1.0f32; 2 * 3 * 5];
        d.at_batch_row(2).apply(&mut tail, 3, 5, 2.0);
        assert_eq!(&whole[2 * 15..], &tail[..]);
        assert!(whole.iter().all(|&v| v == 0.0 || v == 2.0));
        assert!(whole.contains(&0.0) && whole.contains(&2.0));
    }
}
