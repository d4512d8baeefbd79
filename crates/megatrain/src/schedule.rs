//! Learning-rate schedules. The optimizer takes the rate per call; the
//! trainer asks the schedule for it at every step.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    Constant,
    Cosine,
    /// Straight down from `lr` after warm-up to `min_lr` at `decay_steps`.
    Linear,
    /// Warm-up, stable at `lr`, then a linear cooldown to `min_lr` over the
    /// last `cooldown` steps before `decay_steps` (MiniCPM's
    /// warmup-stable-decay).
    Wsd,
    /// [`ScheduleKind::Wsd`] with the cooldown shaped `1 − √t` (Hägele et
    /// al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
    /// Training Durations": it matches a cosine's final loss).
    WsdSqrt,
}

impl FromStr for ScheduleKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "constant" => Ok(ScheduleKind::Constant),
            "cosine" => Ok(ScheduleKind::Cosine),
            "linear" => Ok(ScheduleKind::Linear),
            "wsd" => Ok(ScheduleKind::Wsd),
            "wsd-sqrt" => Ok(ScheduleKind::WsdSqrt),
            _ => Err(format!(
                "unknown schedule '{s}' (expected constant, cosine, linear, wsd or wsd-sqrt)"
            )),
        }
    }
}

/// Linear warm-up then constant, cosine, linear or warmup-stable-decay to
/// `min_lr`, with the same arithmetic as nanoGPT's `get_lr` for the first
/// two, so runs are comparable step for step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    /// Step at which the decay reaches `min_lr` (nanoGPT's `lr_decay_iters`).
    pub decay_steps: u64,
    /// The warmup-stable-decay schedules' decay: the last this many steps
    /// before `decay_steps` (none of the others read it).
    pub cooldown: u64,
}

impl LrSchedule {
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / (self.warmup + 1) as f64;
        }
        // The decay's first step: the warm-up's end, or the cooldown's start.
        let start = match self.kind {
            ScheduleKind::Constant => return self.lr,
            ScheduleKind::Wsd | ScheduleKind::WsdSqrt => {
                self.decay_steps.saturating_sub(self.cooldown).max(self.warmup)
            }
            ScheduleKind::Cosine | ScheduleKind::Linear => self.warmup,
        };
        if step < start {
            return self.lr;
        }
        if step > self.decay_steps || self.decay_steps <= start {
            return self.min_lr;
        }
        let ratio = (step - start) as f64 / (self.decay_steps - start) as f64;
        let coeff = match self.kind {
            ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()),
            ScheduleKind::Linear | ScheduleKind::Wsd => 1.0 - ratio,
            ScheduleKind::WsdSqrt => 1.0 - ratio.sqrt(),
            ScheduleKind::Constant => unreachable!("returned above"),
        };
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine() -> LrSchedule {
        LrSchedule {
            kind: ScheduleKind::Cosine,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup: 100,
            decay_steps: 2000,
            cooldown: 0,
        }
    }

    #[test]
    fn warmup_is_linear_from_one_step() {
        let s = cosine();
        assert!((s.at(0) - 1e-3 / 101.0).abs() < 1e-15);
        assert!((s.at(99) - 1e-3 * 100.0 / 101.0).abs() < 1e-15);
    }

    #[test]
    fn cosine_hits_peak_middle_and_floor() {
        let s = cosine();
        assert!((s.at(100) - 1e-3).abs() < 1e-15);
        assert!((s.at(1050) - 5.5e-4).abs() < 1e-12);
        assert!((s.at(2000) - 1e-4).abs() < 1e-15);
        assert_eq!(s.at(5000), 1e-4);
        let mut prev = f64::INFINITY;
        for step in 100..=2000 {
            let lr = s.at(step);
            assert!(lr <= prev + 1e-18, "cosine must not increase after warm-up");
            prev = lr;
        }
    }

    #[test]
    fn constant_after_warmup() {
        let s = LrSchedule {
            kind: ScheduleKind::Constant,
            ..cosine()
        };
        assert_eq!(s.at(100), 1e-3);
        assert_eq!(s.at(10_000), 1e-3);
        assert!("wsd_sqrt".parse::<ScheduleKind>().is_err());
    }

    #[test]
    fn linear_falls_straight_to_the_floor() {
        let s = LrSchedule {
            kind: ScheduleKind::Linear,
            ..cosine()
        };
        assert_eq!(s.at(100), 1e-3);
        assert!((s.at(1050) - 5.5e-4).abs() < 1e-15);
        assert!((s.at(1525) - 3.25e-4).abs() < 1e-15);
        assert_eq!(s.at(2000), 1e-4);
        assert_eq!(s.at(2001), 1e-4);
    }

    /// Stable at the peak until the cooldown's first step, then down to the
    /// floor at `decay_steps`: straight, or as 1 − √t (below the straight
    /// line, and steepest at the start).
    #[test]
    fn wsd_holds_the_peak_then_cools_down() {
        let wsd = LrSchedule {
            kind: ScheduleKind::Wsd,
            cooldown: 400,
            ..cosine()
        };
        let sqrt = LrSchedule {
            kind: ScheduleKind::WsdSqrt,
            ..wsd
        };
        for s in [wsd, sqrt] {
            assert!(
                (s.at(50) - cosine().at(50)).abs() < 1e-18,
                "the warm-up is the same"
            );
            assert_eq!(s.at(100), 1e-3);
            assert_eq!(s.at(1600), 1e-3);
            assert_eq!(s.at(2000), 1e-4);
            assert_eq!(s.at(9999), 1e-4);
        }
        assert!((wsd.at(1800) - 5.5e-4).abs() < 1e-15);
        // 1 − √½ of the way from the floor to the peak.
        let want = 1e-4 + (1.0 - 0.5f64.sqrt()) * 9e-4;
        assert!((sqrt.at(1800) - want).abs() < 1e-15);
        for step in 1601..2000 {
            assert!(sqrt.at(step) < wsd.at(step), "step {step}");
            assert!(wsd.at(step) < wsd.at(step - 1) && sqrt.at(step) < sqrt.at(step - 1));
        }
        // A cooldown longer than the steps after warm-up starts at its end.
        let long = LrSchedule {
            cooldown: 5000,
            ..wsd
        };
        assert_eq!(long.at(100), 1e-3);
        assert!((long.at(1050) - 5.5e-4).abs() < 1e-15);
    }
}
