//! `--keep-activations`: how many of the last blocks keep their weights
//! and what their forward saved until their backward instead of being
//! uploaded again and recomputed (`TrainerConfig::keep_activations`). Shared by `megatrain train`,
//! `megatrain plan` and `cargo xtask bench-throughput`.

use std::str::FromStr;

use megatrain_tensor::TensorMemory;
use megatrain_tier::TierConfig;
use megatrain_zoo::ModelConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::{Result, RunError};
use super::plan::{PlanInput, mem_available, most_kept};

/// A count of blocks, all of the model's, or as many as fit. A device
/// option: it changes no result, only memory and time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepActivations {
    /// The last N blocks (0: every block is recomputed from its
    /// checkpoint).
    Blocks(usize),
    /// Every block: the backward recomputes nothing.
    All,
    /// As many of the last blocks as `megatrain plan`'s estimate of the
    /// executor's memory fits in [`DEVICE_SHARE`] of a device's own memory
    /// or [`HOST_SHARE`] of the host's available memory ([`Room`]).
    Auto,
}

/// The share of a device's own memory `auto` lets the plan's whole
/// estimate take. On an H200 the estimate fell 7 % short of the measured
/// peak with no block kept (session 28, Qwen2.5-7B at 8×1024), and
/// exceeded it with blocks kept, which is what `auto` sizes: by 3 % with
/// all 28 of Qwen2.5-7B's (107.3 GiB estimated, 111.5 GB measured) and 9 %
/// with all 22 of TinyLlama-1.1B's (31.9 GiB, 31.3 GB; session 47). So an
/// estimate within 80 % peaks under 86 % of the device even where it fell
/// short, leaving the rest to the driver, a display or another process.
pub const DEVICE_SHARE: f64 = 0.8;

/// The share of the host's available memory `auto` lets the plan's whole
/// estimate take where the executor's tensors live there (the CPU,
/// lavapipe): half, since the tier's pages, the page cache and the rest of
/// the machine live beside them.
pub const HOST_SHARE: f64 = 0.5;

/// What `auto` may fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Room {
    /// A device's own memory of this many bytes.
    Device(u64),
    /// Host memory the executor's tensors share with the rest of the
    /// process: this many bytes available now (after the tier).
    Host(u64),
    /// Nothing to size by, and why (auto keeps none).
    Unknown(String),
}

impl Room {
    /// The room of an executor whose tensors live in `memory`: a device's
    /// own memory (the executor's share of it, where data parallel ranks
    /// share the device: `GpuOptions::device_ranks`), or the host's
    /// available memory where they live there (read now: after the tier is
    /// made, it is what is left). Unknown for the host with several `ranks`
    /// (they share it, and make their tiers at the same time) or a host
    /// budget (the host's memory is the tier's).
    pub fn of(memory: TensorMemory, ranks: usize, host_budget: bool) -> Room {
        match memory {
            TensorMemory::Device(Some(b)) => Room::Device(b),
            TensorMemory::Host if ranks > 1 => {
                Room::Unknown("several ranks share this machine's memory".into())
            }
            TensorMemory::Device(None) => Room::Unknown("the device does not report its memory".into()),
            TensorMemory::Host if host_budget => {
                Room::Unknown("--host-budget: the host's memory is the tier's".into())
            }
            TensorMemory::Host => match mem_available() {
                Some(b) => Room::Host(b),
                None => Room::Unknown("the host's available memory is unknown".into()),
            },
        }
    }
}

/// What a run keeps, and why (the line a run prints at its start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub blocks: usize,
    pub why: String,
}

/// None: `bench-throughput`'s default, the streamed step as designed
/// (`train` and `plan` default to `auto`).
impl Default for KeepActivations {
    fn default() -> Self {
        KeepActivations::NONE
    }
}

impl KeepActivations {
    pub const NONE: KeepActivations = KeepActivations::Blocks(0);

    /// The block count for a model of `num_layers` blocks; a count past
    /// them is refused, naming both. `auto` is decided later, by
    /// [`KeepActivations::resolve`]: here it counts as none.
    pub fn blocks(self, num_layers: usize) -> Result<usize> {
        match self {
            KeepActivations::All => Ok(num_layers),
            KeepActivations::Auto => Ok(0),
            KeepActivations::Blocks(n) if n <= num_layers => Ok(n),
            KeepActivations::Blocks(n) => Err(RunError::option(
                "keep-activations",
                n,
                format!("the model has {num_layers} blocks (`all` keeps every one)"),
            )),
        }
    }

    /// The blocks a run of `model` shaped as `input` keeps (its own
    /// `keep_activations` is ignored), `auto` sized by `room`.
    pub fn resolve(self, model: &ModelConfig, input: &PlanInput, room: &Room) -> Result<Kept> {
        let n = model.num_layers;
        let (space, share, what) = match (self, room) {
            (KeepActivations::Auto, Room::Device(b)) => (*b, DEVICE_SHARE, "the device's"),
            (KeepActivations::Auto, Room::Host(b)) => (*b, HOST_SHARE, "the host's available"),
            (KeepActivations::Auto, Room::Unknown(why)) => {
                return Ok(Kept {
                    blocks: 0,
                    why: format!("auto: none ({why})"),
                });
            }
            (k, _) => {
                return Ok(Kept {
                    blocks: k.blocks(n)?,
                    why: format!("--keep-activations {k}"),
                });
            }
        };
        let tier = TierConfig {
            transport: input.transport,
            ..TierConfig::default()
        };
        let budget = (space as f64 * share) as u64;
        let blocks = most_kept(model, input, &tier, budget)?.unwrap_or(0);
        Ok(Kept {
            blocks,
            why: format!(
                "auto: what `megatrain plan` estimates fits in {:.0} % of {what} {:.1} GiB",
                share * 100.0,
                space as f64 / (1u64 << 30) as f64
            ),
        })
    }
}

impl std::fmt::Display for KeepActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeepActivations::Blocks(n) => write!(f, "{n}"),
            KeepActivations::All => f.write_str("all"),
            KeepActivations::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for KeepActivations {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(KeepActivations::All),
            "auto" => Ok(KeepActivations::Auto),
            n => n
                .parse()
                .map(KeepActivations::Blocks)
                .map_err(|_| format!("'{s}': expected a number of blocks, `all` or `auto`")),
        }
    }
}

/// A count as a TOML integer, `all` and `auto` as strings (each is read
/// back).
impl Serialize for KeepActivations {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KeepActivations::Blocks(n) => s.serialize_u64(*n as u64),
            KeepActivations::All => s.serialize_str("all"),
            KeepActivations::Auto => s.serialize_str("auto"),
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
            ("auto", KeepActivations::Auto),
        ] {
            assert_eq!(s.parse::<KeepActivations>().unwrap(), k);
            assert_eq!(k.to_string(), s);
        }
        for bad in ["", "-1", "some", "2.5"] {
            let e = bad.parse::<KeepActivations>().unwrap_err();
            assert!(e.contains("`all` or `auto`"), "{e}");
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
    fn toml_takes_a_count_all_or_auto() {
        #[derive(Deserialize, Serialize, PartialEq, Debug)]
        struct O {
            keep: KeepActivations,
        }
        for (text, k) in [
            ("keep = 4", KeepActivations::Blocks(4)),
            ("keep = \"all\"", KeepActivations::All),
            ("keep = \"auto\"", KeepActivations::Auto),
        ] {
            let o: O = toml::from_str(text).unwrap();
            assert_eq!(o.keep, k);
            assert_eq!(toml::to_string(&o).unwrap().trim(), text);
        }
        let e = toml::from_str::<O>("keep = \"most\"").unwrap_err().to_string();
        assert!(e.contains("`all`"), "{e}");
    }

    /// `auto` keeps the most blocks whose plan fits half the room, none
    /// where there is no room to size by; a count or `all` ignores the
    /// room.
    #[test]
    fn auto_keeps_what_the_plan_fits_in_its_share_of_the_room() {
        use megatrain_tensor::TensorMemory;
        use megatrain_tier::TransportDType;
        let mut model = megatrain_zoo::preset("llama-tiny", None).unwrap();
        model.num_layers = 4;
        let input = PlanInput {
            batch: 2,
            seq_len: 8,
            checkpoint_every: 1,
            keep_activations: 0,
            chunk_rows: 256,
            transport: TransportDType::F32,
            hold_grads: false,
            carry_layers: 0,
            carry_order: Default::default(),
            optimizer_queue: crate::trainer::DEFAULT_OPTIMIZER_QUEUE,
            embedding_rows: false,
        };
        let total = |keep| {
            let i = PlanInput {
                keep_activations: keep,
                ..input
            };
            super::super::plan::plan(&model, &i, &TierConfig::default())
                .unwrap()
                .device
                .total()
        };
        let auto = |room: Room| KeepActivations::Auto.resolve(&model, &input, &room).unwrap();
        // The room whose share is `bytes` (give or take a byte).
        let room = |bytes: u64, share: f64| (bytes as f64 / share).ceil() as u64 + 1;
        // Each count's estimate grows by more than the rounding.
        assert!(total(3) + 8 < total(4) && total(2) + 8 < total(3));
        assert_eq!(auto(Room::Device(room(total(4), DEVICE_SHARE))).blocks, 4);
        assert_eq!(auto(Room::Device(room(total(2), DEVICE_SHARE))).blocks, 2);
        assert_eq!(auto(Room::Host(room(total(3), HOST_SHARE))).blocks, 3);
        // The host's half of the same room keeps fewer than a device's 80 %.
        assert!(auto(Room::Host(room(total(3), DEVICE_SHARE))).blocks < 3);
        let k = auto(Room::Device(room(total(4), DEVICE_SHARE) - 4));
        assert_eq!(k.blocks, 3, "{k:?}");
        assert!(
            k.why.starts_with("auto:") && k.why.contains("80 % of the device's"),
            "{}",
            k.why
        );
        assert_eq!(auto(Room::Device(1)).blocks, 0);
        let none = auto(Room::Unknown("no room".into()));
        assert_eq!((none.blocks, none.why.as_str()), (0, "auto: none (no room)"));
        let tiny = Room::Device(1);
        assert_eq!(
            KeepActivations::All
                .resolve(&model, &input, &tiny)
                .unwrap()
                .blocks,
            4
        );
        assert_eq!(
            KeepActivations::Blocks(2)
                .resolve(&model, &input, &tiny)
                .unwrap()
                .blocks,
            2
        );
        assert!(KeepActivations::Blocks(5).resolve(&model, &input, &tiny).is_err());
        // Several ranks on the host, or a host budget, leave nothing to
        // size by; a device reports the rank's share of itself.
        assert!(matches!(Room::of(TensorMemory::Host, 2, false), Room::Unknown(_)));
        assert_eq!(Room::of(TensorMemory::Device(Some(8)), 2, false), Room::Device(8));
        assert!(matches!(Room::of(TensorMemory::Host, 1, true), Room::Unknown(_)));
        assert_eq!(Room::of(TensorMemory::Device(Some(8)), 1, false), Room::Device(8));
        assert!(matches!(
            Room::of(TensorMemory::Device(None), 1, false),
            Room::Unknown(_)
        ));
    }
}
