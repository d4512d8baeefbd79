//! `--keep-activations`: how many of the last blocks keep what their
//! forward saved until their backward instead of being recomputed
//! (`TrainerConfig::keep_activations`). Shared by `megatrain train`,
//! `megatrain plan` and `cargo xtask bench-throughput`.

use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::{Result, RunError};

/// A count of blocks, or all of the model's. A device option: it changes
/// no result, only device memory and time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepActivations {
    /// The last N blocks (0, the default: every block is recomputed from
    /// its checkpoint).
    Blocks(usize),
    /// Every block: the backward recomputes nothing.
    All,
}

impl Default for KeepActivations {
    fn default() -> Self {
        KeepActivations::NONE
    }
}

impl KeepActivations {
    pub const NONE: KeepActivations = KeepActivations::Blocks(0);

    /// The block count for a model of `num_layers` blocks; a count past
    /// them is refused, naming both.
    pub fn blocks(self, num_layers: usize) -> Result<usize> {
        match self {
            KeepActivations::All => Ok(num_layers),
            KeepActivations::Blocks(n) if n <= num_layers => Ok(n),
            KeepActivations::Blocks(n) => Err(RunError::option(
                "keep-activations",
                n,
                format!("the model has {num_layers} blocks (`all` keeps every one)"),
            )),
        }
    }
}

impl std::fmt::Display for KeepActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeepActivations::Blocks(n) => write!(f, "{n}"),
            KeepActivations::All => f.write_str("all"),
        }
    }
}

impl FromStr for KeepActivations {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(KeepActivations::All),
            n => n
                .parse()
                .map(KeepActivations::Blocks)
                .map_err(|_| format!("'{s}': expected a number of blocks or `all`")),
        }
    }
}

/// A count as a TOML integer, `all` as a string (either is read back).
impl Serialize for KeepActivations {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KeepActivations::Blocks(n) => s.serialize_u64(*n as u64),
            KeepActivations::All => s.serialize_str("all"),
        }
    }
}

impl<'de> Deserialize<'de> for KeepActivations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u64),
            Name(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(n) => Ok(KeepActivations::Blocks(n as usize)),
            Raw::Name(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_all_parse_print_and_resolve_against_the_model() {
        for (s, k) in [
            ("0", KeepActivations::NONE),
            ("3", KeepActivations::Blocks(3)),
            ("all", KeepActivations::All),
        ] {
            assert_eq!(s.parse::<KeepActivations>().unwrap(), k);
            assert_eq!(k.to_string(), s);
        }
        for bad in ["", "-1", "some", "2.5"] {
            let e = bad.parse::<KeepActivations>().unwrap_err();
            assert!(e.contains("`all`"), "{e}");
        }
        assert_eq!(KeepActivations::All.blocks(22).unwrap(), 22);
        assert_eq!(KeepActivations::Blocks(22).blocks(22).unwrap(), 22);
        let e = KeepActivations::Blocks(23).blocks(22).unwrap_err().to_string();
        assert!(
            e.contains("keep-activations") && e.contains("23") && e.contains("22 blocks"),
            "{e}"
        );
    }

    #[test]
    fn toml_takes_a_count_or_all() {
        #[derive(Deserialize, Serialize, PartialEq, Debug)]
        struct O {
            keep: KeepActivations,
        }
        for (text, k) in [
            ("keep = 4", KeepActivations::Blocks(4)),
            ("keep = \"all\"", KeepActivations::All),
        ] {
            let o: O = toml::from_str(text).unwrap();
            assert_eq!(o.keep, k);
            assert_eq!(toml::to_string(&o).unwrap().trim(), text);
        }
        let e = toml::from_str::<O>("keep = \"most\"").unwrap_err().to_string();
        assert!(e.contains("`all`"), "{e}");
    }
}
