//! Ranks started with different settings would train different models
//! (or hang in a collective of another size): every rank compares what it
//! was given with rank 0's before the first step, and all fail together.

use serde_json::Value;

use super::{Collective, DistError, Result};

/// Differences between rank 0's `a` and this rank's `b`, as
/// `key: <rank 0's> on rank 0, <ours> on rank r` (nested keys joined by `.`).
fn diffs(prefix: &str, a: &Value, b: &Value, rank: usize, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                diffs(
                    &key,
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    rank,
                    out,
                );
            }
        }
        _ if a != b => out.push(format!("{prefix}: {a} on rank 0, {b} on rank {rank}")),
        _ => {}
    }
}

/// Fails on every rank when any rank's `value` differs from rank 0's. The
/// differing ranks name each differing key; the others say how many ranks
/// differ.
pub fn check_same(comm: &dyn Collective, what: &str, value: &Value) -> Result<()> {
    let ours = serde_json::to_vec(value).expect("JSON serialises");
    let mut root = ours.clone();
    comm.broadcast_bytes(&mut root)?;
    let root: Value = serde_json::from_slice(&root)
        .map_err(|e| DistError::Invalid(format!("rank 0's {what} did not parse: {e}")))?;
    let mut ds = Vec::new();
    diffs("", &root, value, comm.rank(), &mut ds);
    let mut bad = [if ds.is_empty() { 0.0 } else { 1.0 }];
    comm.sum_f64(&mut bad)?;
    let bad = bad[0] as usize;
    if bad == 0 {
        return Ok(());
    }
    Err(DistError::Mismatch(if ds.is_empty() {
        format!(
            "{bad} of {} ranks were started with {what} different from rank 0's (their messages name them)",
            comm.size()
        )
    } else {
        format!(
            "rank {} was started with {what} different from rank 0's: {}",
            comm.rank(),
            ds.join("; ")
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn diffs_name_nested_keys() {
        let mut out = Vec::new();
        diffs(
            "",
            &json!({"a": 1, "b": {"c": "x", "d": 2}}),
            &json!({"a": 1, "b": {"c": "y"}, "e": true}),
            2,
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                "b.c: \"x\" on rank 0, \"y\" on rank 2",
                "b.d: 2 on rank 0, null on rank 2",
                "e: null on rank 0, true on rank 2",
            ]
        );
    }
}
