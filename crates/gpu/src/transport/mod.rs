//! Moving layers between host memory and the device (ARCHITECTURE.md,
//! "Moving bytes with wgpu").

use std::str::FromStr;

/// Which transport implementation moves weights and gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Measure both on this adapter and keep the faster.
    #[default]
    Auto,
    /// A ring of mapped staging buffers plus buffer copies.
    Staging,
    /// Weight slots the CPU writes through a mapping
    /// (`MAPPABLE_PRIMARY_BUFFERS`), double-buffered.
    Mapped,
}

impl FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "staging" => Ok(TransportChoice::Staging),
            "mapped" => Ok(TransportChoice::Mapped),
            other => Err(format!(
                "unknown transport '{other}' (expected auto, staging or mapped)"
            )),
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Staging => "staging",
            TransportChoice::Mapped => "mapped",
        })
    }
}
