//! megatrain-adamw: AdamW for fp32 master weights kept in host memory.
//!
//! The optimizer runs on every parameter every step, overlapped with the
//! GPU's backward, so it must run at memory bandwidth. [`AdamW::step`] makes
//! one fused pass over a flat slab: it reads p, g, m, v and writes p, m, v,
//! the transport copy of p (bf16, f16 or f32) and, if asked, a zeroed
//! gradient.
//! The pass is split over rayon in chunks; the inner loop is compiled with
//! AVX2+FMA where the CPU has them (chosen at run time) and vectorised by
//! rustc.
//!
//! ```
//! use megatrain_adamw::{AdamW, AdamWConfig, DecayMask, SlabState, SlabUpdate, Transport};
//! # fn main() -> Result<(), megatrain_adamw::AdamWError> {
//! let opt = AdamW::new(AdamWConfig::default())?;
//! let (mut p, mut g) = (vec![1.0f32; 6], vec![0.5f32; 6]);
//! let (mut m, mut v) = (vec![0.0f32; 6], vec![0.0f32; 6]);
//! let mut copy = vec![half::bf16::ZERO; 6];
//! // Decay the 4-element matrix, not the 2-element bias after it.
//! let mask = DecayMask::from_ranges(6, [0..4])?;
//! let mut state = SlabState::new();
//! opt.step(
//!     &mut state,
//!     1e-3,
//!     SlabUpdate::new(&mut p, &mut g, &mut m, &mut v)
//!         .decay(&mask)
//!         .transport(Transport::Bf16(&mut copy))
//!         .zero_grad(true),
//! )?;
//! assert_eq!(state.step(), 1);
//! assert!(g.iter().all(|&x| x == 0.0));
//! # Ok(()) }
//! ```

pub mod bandwidth;
mod bf16;
mod config;
mod decay;
mod error;
mod kernel;
mod norm;
mod optimizer;

pub use bf16::{f32_to_bf16_bits, f32_to_bf16_slice};
pub use config::AdamWConfig;
pub use decay::DecayMask;
pub use error::{AdamWError, Result};
#[doc(hidden)]
pub use kernel::set_plain_copy_stores;
pub use norm::{BlockNorms, NORM_BLOCK, clip_coefficient, global_grad_norm, grad_norm_sq, grad_norms_sq};
pub use optimizer::{AdamW, DEFAULT_CHUNK_LEN, Grad, SlabState, SlabUpdate, StepStats, Transport};
