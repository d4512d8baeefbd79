//! megatrain-adamw: see ARCHITECTURE.md. Filled by its own issue.
