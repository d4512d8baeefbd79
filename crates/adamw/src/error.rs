/// Everything the optimizer can refuse. Each variant names the slice or the
/// value at fault so a trainer can report which slab went wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdamWError {
    #[error("adamw: {what} has {got} elements but the parameter slab has {expected}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("adamw: invalid {name} = {value}: {why}")]
    InvalidHyper {
        name: &'static str,
        value: f64,
        why: &'static str,
    },
    #[error("adamw: decay range {start}..{end} is {why} (slab length {len})")]
    DecayRange {
        start: usize,
        end: usize,
        len: usize,
        why: &'static str,
    },
    #[error("adamw: decay mask covers {mask_len} elements but the parameter slab has {slab_len}")]
    DecayMaskLength { mask_len: usize, slab_len: usize },
    #[error("adamw: a read-only gradient cannot be zeroed (zero_grad needs Grad::Mut)")]
    ReadOnlyGrad,
    #[error("adamw: step count {0} would overflow")]
    StepOverflow(u64),
}

pub type Result<T, E = AdamWError> = std::result::Result<T, E>;
