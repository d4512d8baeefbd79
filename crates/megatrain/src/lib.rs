//! megatrain: the facade crate — data loading, learning-rate schedules, the
//! streamed `Trainer`, and the library behind the `megatrain` command
//! ([`run`]: options, run directories, checkpoints, generation, plans).

pub mod data;
pub mod dist;
pub mod run;
pub mod schedule;
pub mod trainer;

pub use trainer::{StepMetrics, TrainError, Trainer, TrainerConfig};
