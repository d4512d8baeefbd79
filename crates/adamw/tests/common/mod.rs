//! The scalar f64 reference: `torch.optim.AdamW` written out line by line.
#![allow(dead_code)]

use megatrain_adamw::{AdamWConfig, DecayMask};
use rand::{Rng, SeedableRng, rngs::StdRng};

#[derive(Debug, Clone)]
pub struct Ref {
    pub p: Vec<f64>,
    pub m: Vec<f64>,
    pub v: Vec<f64>,
    pub t: u64,
}

impl Ref {
    pub fn new(p: &[f32]) -> Self {
        Self::from_state(p, &vec![0.0; p.len()], &vec![0.0; p.len()], 0)
    }

    pub fn from_state(p: &[f32], m: &[f32], v: &[f32], t: u64) -> Self {
        let up = |x: &[f32]| x.iter().map(|&y| y as f64).collect();
        Self {
            p: up(p),
            m: up(m),
            v: up(v),
            t,
        }
    }

    pub fn step(&mut self, c: &AdamWConfig, lr: f64, g: &[f32], grad_scale: f64, mask: &DecayMask) {
        let (b1, b2, eps, wd) = (
            c.beta1 as f64,
            c.beta2 as f64,
            c.eps as f64,
            c.weight_decay as f64,
        );
        self.t += 1;
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2 = 1.0 - b2.powi(self.t as i32);
        for i in 0..self.p.len() {
            let g = g[i] as f64 * grad_scale;
            if mask.decays(i) {
                self.p[i] *= 1.0 - lr * wd;
            }
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g;
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g * g;
            let denom = self.v[i].sqrt() / bc2.sqrt() + eps;
            self.p[i] -= lr / bc1 * self.m[i] / denom;
        }
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Parameters of magnitude 0.5..1.5 with random sign: far enough from zero
/// that relative error is meaningful after 100 steps of lr ≤ 1e-3.
pub fn params(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x: f32 = r.random_range(0.5..1.5);
            if r.random::<bool>() { x } else { -x }
        })
        .collect()
}

/// Gradients spanning several orders of magnitude, both signs.
pub fn grads(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let mag = 10f32.powf(r.random_range(-4.0..1.0));
            if r.random::<bool>() { mag } else { -mag }
        })
        .collect()
}

pub fn rel_err(got: f32, want: f64) -> f64 {
    ((got as f64) - want).abs() / want.abs()
}
