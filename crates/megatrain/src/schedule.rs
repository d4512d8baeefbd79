//! Learning-rate schedules. The optimizer takes the rate per call; the
//! trainer asks the schedule for it at every step.

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    Constant,
    Cosine,
}

impl FromStr for ScheduleKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "constant" => Ok(ScheduleKind::Constant),
            "cosine" => Ok(ScheduleKind::Cosine),
            _ => Err(format!("unknown schedule '{s}' (expected constant or cosine)")),
        }
    }
}

/// Linear warm-up then constant or cosine decay to `min_lr`, with the same
/// arithmetic as nanoGPT's `get_lr`, so runs are comparable step for step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    /// Step at which the cosine reaches `min_lr` (nanoGPT's `lr_decay_iters`).
    pub decay_steps: u64,
}

impl LrSchedule {
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / (self.warmup + 1) as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Cosine => {
                if step > self.decay_steps || self.decay_steps <= self.warmup {
                    return self.min_lr;
                }
                let ratio = (step - self.warmup) as f64 / (self.decay_steps - self.warmup) as f64;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                self.min_lr + coeff * (self.lr - self.min_lr)
            }
        }
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
        assert!("linear".parse::<ScheduleKind>().is_err());
    }
}
