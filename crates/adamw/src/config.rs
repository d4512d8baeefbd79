use crate::{AdamWError, Result};

/// The constant hyper-parameters of AdamW, with `torch.optim.AdamW`'s
/// meaning and defaults. The learning rate is not here: the trainer owns the
/// schedule and passes `lr` on every call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    /// Added to `sqrt(v_hat)`, outside the square root, as in PyTorch.
    pub eps: f32,
    /// Decoupled: `p ← p − lr·weight_decay·p`, applied only where the decay
    /// mask says so.
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// Rejects what PyTorch rejects: betas outside [0, 1), negative or
    /// non-finite eps and weight decay.
    pub fn validate(&self) -> Result<()> {
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(AdamWError::InvalidHyper {
                    name,
                    value: b as f64,
                    why: "must lie in [0, 1)",
                });
            }
        }
        for (name, x) in [("eps", self.eps), ("weight_decay", self.weight_decay)] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(AdamWError::InvalidHyper {
                    name,
                    value: x as f64,
                    why: "must be finite and >= 0",
                });
            }
        }
        Ok(())
    }
}
