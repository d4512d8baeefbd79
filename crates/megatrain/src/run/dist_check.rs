//! What every rank of a data parallel run must agree on before the first
//! step: the settings, the model, the data and the checkpoint resumed.

use serde_json::{Value, json};

use super::error::Result;
use super::prepare::Prepared;
use crate::data::{Fnv1a, Mix, TokenData};
use crate::dist::{Collective, check_same};

/// FNV-1a over the tokens (by parts, [`crate::data::Tokens::fingerprint`])
/// and the loss mask: ranks that loaded different files (or the same path
/// with other contents) disagree here.
fn fingerprint(d: &TokenData) -> Value {
    let mask = d.loss_mask.iter().flat_map(|m| m.iter()).map(|b| b as u64 + 2);
    let h = Fnv1a::of(std::iter::once(d.tokens.fingerprint()).chain(mask));
    json!({"tokens": d.len(), "fnv1a": format!("{h:016x}")})
}

/// Each source's [`fingerprint`], with the weights they are drawn by.
fn fingerprints(m: &Mix) -> Value {
    json!({"parts": m.parts.iter().map(fingerprint).collect::<Vec<_>>(), "weights": m.weights})
}

/// Fails on every rank, naming the differing settings, when any rank was
/// started with another configuration than rank 0.
pub fn same_everywhere(comm: &dyn Collective, p: &Prepared) -> Result<()> {
    let value = json!({
        "options": serde_json::to_value(&p.opts).expect("options serialise"),
        "model": p.model.to_hf_json("float32"),
        "tokenizer": p.encoder.kind(),
        "train data": fingerprints(&p.train),
        "validation data": p.val.as_ref().map(fingerprints),
        "resumed checkpoint": p.resume.as_ref().map(|(c, s)| json!({"dir": c, "step": s.step})),
    });
    Ok(check_same(comm, "settings", &value)?)
}
