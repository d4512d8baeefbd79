//! megatrain: the facade crate — data loading, learning-rate schedules, the
//! streamed `Trainer` and the `megatrain` command.

pub mod data;
pub mod schedule;
pub mod trainer;

pub use trainer::{StepMetrics, TrainError, Trainer, TrainerConfig};
