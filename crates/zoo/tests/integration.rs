//! The crate's integration tests, one module a file beside this one, in one
//! test binary: a binary a file linked the crate and its dependencies
//! again each time (tests/end_to_end.rs at the top says more).

mod common;

mod checkpoint_io;
mod config;
mod dropout;
mod golden;
mod layers;
mod packing;
mod presets;
mod rope_scaling;
mod tokenizers;
