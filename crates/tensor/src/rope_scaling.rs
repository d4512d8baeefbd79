//! RoPE frequency scaling as Hugging Face's `rope_type`s define it
//! (`transformers.modeling_rope_utils`): the per-pair inverse frequencies
//! and the factor on cos and sin. Llama 3.x ships with `llama3`, long-context
//! Qwen and DeepSeek distillations with `yarn`, Phi-3's 128k models and
//! Phi-3.5 with `longrope`.
//!
//! Everything is formed in f64; transformers forms the frequencies in f32,
//! so the two agree to f32 rounding (`tools/make_golden.py` checks that
//! before writing its float64 references with these formulas).

use std::f64::consts::PI;
use std::sync::Arc;

/// How the frequencies of a rotary embedding are scaled. Every variant's
/// numbers are the config's, resolved (defaults filled in) by the loader.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum RopeScaling {
    /// θ^(−2i/d): `default`.
    #[default]
    None,
    /// Dynamic NTK (`dynamic`): θ^(−2i/d) while the positions end within
    /// `max_positions`; past it, for positions ending at `end`, the base
    /// θ·(factor·end/max_positions − (factor − 1))^(d/(d−2)). transformers
    /// keeps the longest forward's frequencies until a forward fits the
    /// original context again; here every forward takes its own, which is
    /// the same for a run at one sequence length.
    Dynamic { factor: f64, max_positions: f64 },
    /// Positions divided by `factor` (`linear`).
    Linear { factor: f64 },
    /// Llama 3.1: long wavelengths divided by `factor`, short ones kept,
    /// the band between interpolated.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_positions: f64,
    },
    /// YaRN: the frequencies blended between interpolated (÷ `factor`) and
    /// kept across a ramp set by `beta_fast`/`beta_slow` rotations over
    /// the original context; cos and sin multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_positions: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Whether the ramp's ends are rounded out to whole pairs.
        truncate: bool,
        attention_factor: f64,
    },
    /// LongRoPE (Phi-3's 128k models, Phi-3.5): each pair's frequency
    /// divided by a factor of its own, from `short` while the positions
    /// stay within the original context and from `long` past it; cos and
    /// sin multiplied by `attention_factor`.
    LongRope {
        short: Arc<[f64]>,
        long: Arc<[f64]>,
        original_max_positions: f64,
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// The inverse frequency of each of the `d / 2` pairs of a head of `d`
    /// dimensions with base `theta`, for a call whose positions end before
    /// `end` (LongRoPE's factors depend on it, as transformers picks them
    /// by the largest position of a forward).
    pub fn inv_freq(&self, theta: f64, d: usize, end: usize) -> Vec<f64> {
        let half = d / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| theta.powf(-((2 * i) as f64) / d as f64))
            .collect();
        match *self {
            RopeScaling::None => base,
            RopeScaling::Dynamic {
                factor,
                max_positions,
            } => match end as f64 > max_positions {
                false => base,
                true => {
                    let dn = d as f64;
                    let theta =
                        theta * (factor * end as f64 / max_positions - (factor - 1.0)).powf(dn / (dn - 2.0));
                    (0..half).map(|i| theta.powf(-((2 * i) as f64) / dn)).collect()
                }
            },
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_positions: old,
            } => base
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen < old / high {
                        f
                    } else if wavelen > old / low {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect(),
            RopeScaling::Yarn {
                factor,
                original_max_positions: old,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // The pair index at which `rotations` whole turns fit in the
                // original context.
                let dim_of =
                    |rotations: f64| d as f64 * (old / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
                let (mut lo, mut hi) = (dim_of(beta_fast), dim_of(beta_slow));
                if truncate {
                    (lo, hi) = (lo.floor(), hi.ceil());
                }
                let (lo, mut hi) = (lo.max(0.0), hi.min(d as f64 - 1.0));
                if lo == hi {
                    hi += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        f / factor * (1.0 - keep) + f * keep
                    })
                    .collect()
            }
            RopeScaling::LongRope { .. } => {
                let factors = self.long_rope_factors(end).expect("long rope");
                // A config's lists are checked against its head_dim on load.
                assert!(
                    factors.len() >= half,
                    "{} LongRoPE factors for {half} pairs",
                    factors.len()
                );
                base.iter().zip(factors.iter()).map(|(f, x)| f / x).collect()
            }
        }
    }

    /// LongRoPE's factors for positions ending before `end`.
    fn long_rope_factors(&self, end: usize) -> Option<&Arc<[f64]>> {
        match self {
            RopeScaling::LongRope {
                short,
                long,
                original_max_positions,
                ..
            } => Some(if end as f64 > *original_max_positions {
                long
            } else {
                short
            }),
            _ => None,
        }
    }

    /// The factor on cos and sin (YaRN's attention temperature; 1 else).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { attention_factor, .. } | RopeScaling::LongRope { attention_factor, .. } => {
                attention_factor
            }
            _ => 1.0,
        }
    }

    /// The scaling's numbers as bits, for a call whose positions end
    /// before `end`: a key for tables built from it.
    pub fn key(&self, end: usize) -> [u64; 7] {
        let b = f64::to_bits;
        match *self {
            RopeScaling::None => [0; 7],
            // Past its context, every end its own frequencies.
            RopeScaling::Dynamic {
                factor,
                max_positions,
            } => {
                let past = if end as f64 > max_positions { end as u64 } else { 0 };
                [5, b(factor), b(max_positions), past, 0, 0, 0]
            }
            RopeScaling::Linear { factor } => [1, b(factor), 0, 0, 0, 0, 0],
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => [
                2,
                b(factor),
                b(low_freq_factor),
                b(high_freq_factor),
                b(original_max_positions),
                0,
                0,
            ],
            RopeScaling::Yarn {
                factor,
                original_max_positions,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => [
                3 | ((truncate as u64) << 8),
                b(factor),
                b(original_max_positions),
                b(beta_fast),
                b(beta_slow),
                b(attention_factor),
                0,
            ],
            RopeScaling::LongRope { attention_factor, .. } => {
                let factors = self.long_rope_factors(end).expect("long rope");
                // FNV-1a over the factors in use.
                let h = factors.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
                    (h ^ x.to_bits()).wrapping_mul(0x0000_0100_0000_01b3)
                });
                [4, h, factors.len() as u64, b(attention_factor), 0, 0, 0]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-15 * y.abs(), "pair {i}: {x} vs {y}");
        }
    }

    #[test]
    fn linear_divides_every_frequency() {
        let base = RopeScaling::None.inv_freq(10000.0, 16, 8);
        let lin = RopeScaling::Linear { factor: 4.0 }.inv_freq(10000.0, 16, 8);
        close(&lin, &base.iter().map(|f| f / 4.0).collect::<Vec<_>>());
        assert_eq!(base[0], 1.0);
    }

    #[test]
    fn llama3_keeps_short_waves_divides_long_ones_and_blends_between() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 64.0,
        };
        let base = RopeScaling::None.inv_freq(10000.0, 16, 8);
        let got = s.inv_freq(10000.0, 16, 8);
        let wavelen = |f: f64| 2.0 * PI / f;
        let (mut kept, mut divided, mut blended) = (0, 0, 0);
        for (&g, &f) in got.iter().zip(&base) {
            if wavelen(f) < 16.0 {
                assert_eq!(g, f);
                kept += 1;
            } else if wavelen(f) > 64.0 {
                assert_eq!(g, f / 8.0);
                divided += 1;
            } else {
                assert!(f / 8.0 < g && g < f, "{g} between {} and {f}", f / 8.0);
                blended += 1;
            }
        }
        assert!(
            kept > 0 && divided > 0 && blended > 0,
            "{kept} {divided} {blended}"
        );
    }

    #[test]
    fn yarn_keeps_the_fastest_pairs_and_interpolates_the_slowest() {
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max_positions: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.1386,
        };
        let base = RopeScaling::None.inv_freq(10000.0, 128, 8);
        let got = s.inv_freq(10000.0, 128, 8);
        assert_eq!(got[0], base[0]);
        assert_eq!(got[63], base[63] / 4.0);
        assert!(got.windows(2).all(|w| w[1] < w[0]), "still decreasing");
        assert_eq!(s.attention_factor(), 1.1386);
        assert_eq!(RopeScaling::None.attention_factor(), 1.0);
    }

    #[test]
    fn keys_tell_scalings_apart() {
        let a = RopeScaling::Linear { factor: 2.0 };
        let b = RopeScaling::Linear { factor: 2.5 };
        assert_ne!(a.key(8), b.key(8));
        assert_ne!(a.key(8), RopeScaling::None.key(8));
        assert_eq!(a.key(8), a.key(8));
    }

    #[test]
    fn long_rope_divides_by_the_short_factors_within_the_context_and_the_long_past_it() {
        let s = RopeScaling::LongRope {
            short: vec![1.0, 2.0, 3.0, 4.0].into(),
            long: vec![5.0, 6.0, 7.0, 8.0].into(),
            original_max_positions: 64.0,
            attention_factor: 1.2,
        };
        let base = RopeScaling::None.inv_freq(10000.0, 8, 8);
        let want = |x: [f64; 4]| base.iter().zip(x).map(|(f, x)| f / x).collect::<Vec<_>>();
        assert_eq!(s.inv_freq(10000.0, 8, 64), want([1.0, 2.0, 3.0, 4.0]));
        assert_eq!(s.inv_freq(10000.0, 8, 65), want([5.0, 6.0, 7.0, 8.0]));
        assert_eq!(s.attention_factor(), 1.2);
        assert_eq!(s.key(10), s.key(64));
        assert_ne!(s.key(64), s.key(65));
    }
}
