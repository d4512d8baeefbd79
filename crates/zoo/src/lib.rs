//! megatrain-zoo: see ARCHITECTURE.md. Filled by its own issue.
