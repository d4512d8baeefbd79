//! `--eval-every`, `--save-every` and `--sample-every`: a number of steps,
//! or `epoch`, the step that ends each pass over the training data
//! (transformers' `eval_strategy="epoch"`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How often something recurring in a run happens (besides at its end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Every {
    /// Each N-th step (0: none; evaluations and checkpoints still come at
    /// the run's end, samples then do not).
    Steps(u64),
    /// The step in which each pass over the training data ends: the first
    /// whose rows reach the pass's last row.
    Epoch,
}

/// A run's steps against its passes: rows a step takes (every rank's, all
/// micro-batches) and rows one pass holds ([`crate::data::Mix::rows_per_pass`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passes {
    pub rows_per_step: u64,
    pub rows_per_pass: u64,
}

impl Passes {
    /// Passes completed after `step` steps.
    pub fn completed(self, step: u64) -> u64 {
        let rows = step as u128 * self.rows_per_step as u128;
        (rows / self.rows_per_pass.max(1) as u128) as u64
    }
}

impl Every {
    /// No step (`0`).
    pub const NEVER: Every = Every::Steps(0);

    pub fn is_never(self) -> bool {
        self == Every::NEVER
    }

    /// Whether step `step` (counted from 1) is one of them.
    pub fn due(self, step: u64, passes: Passes) -> bool {
        match self {
            Every::Steps(n) => n > 0 && step.is_multiple_of(n),
            Every::Epoch => step > 0 && passes.completed(step) > passes.completed(step - 1),
        }
    }
}

impl fmt::Display for Every {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Every::Steps(n) => write!(f, "{n}"),
            Every::Epoch => f.write_str("epoch"),
        }
    }
}

impl FromStr for Every {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "epoch" => Ok(Every::Epoch),
            n => n
                .parse()
                .map(Every::Steps)
                .map_err(|_| format!("'{s}': expected a number of steps or `epoch`")),
        }
    }
}

/// Steps as an integer, `epoch` as a string (as TOML and the run's
/// options file hold them).
impl Serialize for Every {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Every::Steps(n) => s.serialize_u64(*n),
            Every::Epoch => s.serialize_str("epoch"),
        }
    }
}

impl<'de> Deserialize<'de> for Every {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Steps(u64),
            Name(String),
        }
        match Raw::deserialize(d)? {
            Raw::Steps(n) => Ok(Every::Steps(n)),
            Raw::Name(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_epoch_parse_print_and_read_back() {
        for (s, e) in [
            ("0", Every::NEVER),
            ("250", Every::Steps(250)),
            ("epoch", Every::Epoch),
        ] {
            assert_eq!(s.parse::<Every>().unwrap(), e);
            assert_eq!(e.to_string(), s);
            let json = serde_json::to_string(&e).unwrap();
            assert_eq!(serde_json::from_str::<Every>(&json).unwrap(), e);
        }
        assert_eq!(serde_json::to_string(&Every::Steps(7)).unwrap(), "7");
        for bad in ["", "-1", "epochs", "2.5"] {
            let e = bad.parse::<Every>().unwrap_err();
            assert!(e.contains(bad) && e.contains("`epoch`"), "{e}");
        }
        #[derive(Deserialize)]
        struct O {
            every: Every,
        }
        let o: O = toml::from_str("every = \"epoch\"").unwrap();
        assert_eq!(o.every, Every::Epoch);
        let o: O = toml::from_str("every = 12").unwrap();
        assert_eq!(o.every, Every::Steps(12));
        assert!(toml::from_str::<O>("every = \"daily\"").is_err());
    }

    #[test]
    fn each_pass_ends_in_one_step() {
        // 8 rows a step, 100 a pass: passes end in steps 13 (rows 97..104),
        // 25 (193..200, exactly) and 38 (297..304).
        let p = Passes {
            rows_per_step: 8,
            rows_per_pass: 100,
        };
        let due: Vec<u64> = (1..=40).filter(|&s| Every::Epoch.due(s, p)).collect();
        assert_eq!(due, [13, 25, 38]);
        assert!(!Every::Epoch.due(0, p));
        // Steps longer than a pass: each ends at least one.
        let big = Passes {
            rows_per_step: 7,
            rows_per_pass: 3,
        };
        assert!((1..10).all(|s| Every::Epoch.due(s, big)));
        let steps: Vec<u64> = (1..=9).filter(|&s| Every::Steps(3).due(s, p)).collect();
        assert_eq!(steps, [3, 6, 9]);
        assert!((1..100).all(|s| !Every::NEVER.due(s, p)));
    }
}
