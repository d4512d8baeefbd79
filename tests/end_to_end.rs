//! The end-to-end tests that cross crates, one module a file beside this
//! one, in one test binary: each binary of its own instantiated the
//! trainer and the executors over again and linked the whole workspace,
//! 288 s of build for these 17 files as binaries, 46.5 s as one
//! (2026-12-02, BENCHMARKS.md, "CI from a cold machine"). The top-level
//! tests that keep binaries of their own say why in Cargo.toml.

mod common;

mod carried_updates;
mod chat_templates;
mod cli_binary;
mod cli_knobs;
mod data;
mod data_parallel_chunks;
mod divergence;
mod embedding_rows;
mod frozen_layers;
mod host_floor;
#[cfg(feature = "mpi")]
mod mpi_data_parallel;
mod run_formats;
mod run_precision;
mod run_resume;
mod spill;
mod tensorboard;
mod trainer_cpu;
