//! The anchor runs of issue 17: the models and batches every GPU record is
//! measured at, each beside the PyTorch peer of the same run.

/// One anchor: a preset trained at B×T tokens per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    pub name: &'static str,
    pub preset: &'static str,
    pub batch: usize,
    pub seq_len: usize,
}

/// TinyLlama-1.1B (PyTorch holds it whole on an H100) and Qwen2.5-7B
/// (MegaTrain's published figure), at 8×1024 (the target batch)
/// and 16×2048.
pub const ANCHORS: &[Anchor] = &[
    Anchor {
        name: "tinyllama-8x1024",
        preset: "tinyllama-1.1b",
        batch: 8,
        seq_len: 1024,
    },
    Anchor {
        name: "tinyllama-16x2048",
        preset: "tinyllama-1.1b",
        batch: 16,
        seq_len: 2048,
    },
    Anchor {
        name: "qwen2.5-7b-8x1024",
        preset: "qwen2.5-7b",
        batch: 8,
        seq_len: 1024,
    },
    Anchor {
        name: "qwen2.5-7b-16x2048",
        preset: "qwen2.5-7b",
        batch: 16,
        seq_len: 2048,
    },
];

/// The anchors `name` selects: one by name, or `all`.
pub fn select(name: &str) -> Result<Vec<Anchor>, String> {
    if name == "all" {
        return Ok(ANCHORS.to_vec());
    }
    ANCHORS
        .iter()
        .find(|a| a.name == name)
        .map(|a| vec![*a])
        .ok_or_else(|| {
            let names: Vec<&str> = ANCHORS.iter().map(|a| a.name).collect();
            format!("unknown anchor '{name}' (one of {}, or all)", names.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_anchor_is_a_preset_that_takes_its_sequence_length() {
        for a in ANCHORS {
            let cfg = megatrain_zoo::preset(a.preset, None).unwrap();
            cfg.check_seq_len(a.seq_len).unwrap();
        }
        assert_eq!(select("all").unwrap().len(), 4);
        assert_eq!(select("qwen2.5-7b-8x1024").unwrap()[0].batch, 8);
        let e = select("qwen-7b").unwrap_err();
        assert!(
            e.contains("unknown anchor 'qwen-7b'") && e.contains("tinyllama-8x1024"),
            "{e}"
        );
    }
}
