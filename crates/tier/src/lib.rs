//! megatrain-tier: see ARCHITECTURE.md. Filled by its own issue.
