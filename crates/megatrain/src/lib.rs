//! megatrain: the facade crate (Trainer, data, CLI). Filled by the streamed-step and CLI issues.
