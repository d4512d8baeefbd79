//! megatrain-gpu: see ARCHITECTURE.md. Filled by its own issue.
