//! The crate's integration tests, one module a file beside this one, in one
//! test binary: a binary a file linked the crate and its dependencies
//! again each time (tests/end_to_end.rs at the top says more).

mod accumulate_into;
mod agreement;
mod determinism;
mod docs;
mod errors;
mod f16_attention;
mod f16_compute;
mod forwards;
mod fused_activations;
mod generation_cache;
mod gradients;
mod loss_golden;
mod provided;
