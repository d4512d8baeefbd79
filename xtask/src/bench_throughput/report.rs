//! Markdown tables and the sweep's SVG plot.

use std::fmt::Write;

use serde_json::Value;

use super::record::Record;

fn mb(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".into(), |x| format!("{x:.digits$}"))
}

fn params(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2}B", n as f64 / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else {
        format!("{:.0}k", n as f64 / 1e3)
    }
}

/// The peer's tokens/s for `mode`, if it ran and its device kind matches
/// ours (CPU with CPU, CUDA with our GPU executor).
pub fn peer_tokens_per_s(r: &Record, mode: &str) -> Option<f64> {
    let peer = r.peer.as_ref()?.iter().find(|p| p["mode"] == mode)?;
    let on_cpu = peer["device"].as_str()? == "cpu";
    if on_cpu != (r.spec.device == "cpu") {
        return None;
    }
    peer["tokens_per_s"].as_f64()
}

/// Throughput, split, bus, memory and overlap: two tables, one row per record.
pub fn tables(records: &[Record], failures: &[(String, String)]) -> String {
    let mut s = String::new();
    s.push_str(
        "| config | device | prec | N | B×T | tok/s | model TFLOP/s | hw TFLOP/s | step ms | \
         vs torch mem | vs torch streamed | loss first→last |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records {
        let ratio = |mode| peer_tokens_per_s(r, mode).map(|p| r.tokens_per_s / p);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {}×{} | {:.0} | {:.5} | {:.5} | {:.1} | {} | {} | {:.3}→{:.3} |",
            r.spec.label,
            r.spec.device,
            r.spec.precision,
            params(r.n_params),
            r.spec.batch,
            r.spec.seq_len,
            r.tokens_per_s,
            r.model_tflops,
            r.hardware_tflops,
            r.step_ms,
            opt(ratio("memory"), 2) + if ratio("memory").is_some() { "×" } else { "" },
            opt(ratio("streamed"), 2) + if ratio("streamed").is_some() { "×" } else { "" },
            r.loss_first,
            r.loss_last,
        );
    }
    s.push('\n');
    s.push_str(
        "| config | device | fwd ms (carried) | loss ms | bwd ms | opt wait ms (after bwd) | upload ms | download ms | \
         bus MB/step | bus GB/s | opt busy ms | opt hidden | device peak MB | host B/param | compute-only ms | \
         transfer-only ms | transfer-only GB/s | optimizer-only ms | overlap (step ÷ max) |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records {
        let m = r.modes.as_ref();
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} ({:.1}) | {:.1} | {:.1} | {:.1} ({:.1}) | {:.1} | {:.1} | {} | {:.2} | {:.1} | {:.0}% | {} | {:.2} | {} | {} | {} | {} | {} |",
            r.spec.label,
            r.spec.device,
            r.forward_ms,
            r.carried_ms,
            r.loss_ms,
            r.backward_ms,
            r.optimizer_wait_ms,
            r.optimizer_tail_ms,
            r.upload_ms,
            r.download_ms,
            mb(r.bus_bytes_per_step),
            r.bus_gb_s,
            r.optimizer_busy_ms,
            100.0 * r.optimizer_hidden,
            r.device_peak_bytes.map_or("–".into(), mb),
            r.host_bytes_per_param,
            opt(m.map(|m| m.compute_only_ms), 1),
            opt(m.map(|m| m.transfer_only_ms), 1),
            opt(m.map(|m| m.transfer_only_gb_s), 2),
            opt(m.map(|m| m.optimizer_only_ms), 1),
            opt(r.overlap_efficiency, 2),
        );
    }
    let mut seen = std::collections::HashSet::new();
    let peers: Vec<String> = records
        .iter()
        .filter(|r| seen.insert((r.spec.label.clone(), r.spec.batch, r.spec.seq_len)))
        .flat_map(|r| r.peer.iter().flatten().map(move |p| (r, p)))
        .map(|(r, p)| match p.get("error") {
            Some(e) => format!("- peer {} {}: error: {e}", r.spec.label, p["mode"]),
            None => format!(
                "- peer {} {} on {} (torch {}, {} threads{}): {:.0} tok/s, step {:.1} ms, peak RSS {} MB",
                r.spec.label,
                p["mode"].as_str().unwrap_or("?"),
                p["device"].as_str().unwrap_or("?"),
                p["torch"].as_str().unwrap_or("?"),
                p["threads"],
                p["autocast"]
                    .as_str()
                    .map_or(String::new(), |a| format!(", {a} autocast")),
                p["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
                p["step_ms_median"].as_f64().unwrap_or(f64::NAN),
                mb(p["peak_rss_bytes"].as_u64().unwrap_or(0)),
            ),
        })
        .collect();
    if !peers.is_empty() {
        s.push('\n');
        s.push_str(&peers.join("\n"));
        s.push('\n');
    }
    let mut seen = std::collections::HashSet::new();
    for r in records.iter().filter(|r| seen.insert(r.spec.label.clone())) {
        if let Some(line) = peer_check(r) {
            let _ = writeln!(s, "- peer check {}: {line}", r.spec.label);
        }
    }
    for r in records {
        if let Some(h) = &r.host_peak {
            let n = r.n_params.max(1) as f64;
            let kinds: Vec<String> = h
                .kinds()
                .iter()
                .map(|(k, b)| format!("{k} {:.1} MB ({:.3} B/param)", *b as f64 / 1e6, *b as f64 / n))
                .collect();
            let _ = writeln!(
                s,
                "- host peak {} {} {}: {:.1} MB = {:.3} B/param: {}",
                r.spec.label,
                r.spec.device,
                r.spec.precision,
                h.peak_rss as f64 / 1e6,
                h.peak_rss as f64 / n,
                kinds.join(", ")
            );
            if let Some(p) = h.phases {
                let _ = writeln!(
                    s,
                    "- host peak by phase {}: setup {:.3}, warm-up (pipelines compiled) {:.3}, timed steps {:.3} B/param",
                    r.spec.label,
                    p.setup as f64 / n,
                    p.warmup as f64 / n,
                    p.steps as f64 / n
                );
            }
        }
    }
    for r in records {
        if let Some(why) = &r.modes_error {
            let _ = writeln!(s, "- isolated modes of {}: not measured: {why}", r.spec.label);
        }
    }
    for (label, why) in failures {
        let _ = writeln!(s, "- {label}: not run: {why}");
    }
    s
}

/// Faithfulness of the peer: the same parameter count as ours, and its two
/// modes (same init, same batches) giving the same losses.
pub fn peer_check(r: &Record) -> Option<String> {
    let peer = r.peer.as_ref()?;
    let ok: Vec<&Value> = peer.iter().filter(|p| p.get("error").is_none()).collect();
    if ok.is_empty() {
        return None;
    }
    let mut notes = Vec::new();
    for p in &ok {
        let n = p["n_params"].as_u64().unwrap_or(0);
        if n != r.n_params {
            notes.push(format!("{} has {n} parameters, ours {}", p["mode"], r.n_params));
        }
    }
    if notes.is_empty() {
        notes.push(format!("same parameter count ({})", r.n_params));
    }
    let losses = |p: &Value| -> Vec<f64> {
        p["loss"]
            .as_array()
            .map_or_else(Vec::new, |a| a.iter().filter_map(Value::as_f64).collect())
    };
    if let [a, b] = ok[..] {
        let (la, lb) = (losses(a), losses(b));
        let diff = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        notes.push(format!(
            "its two modes' losses differ by at most {diff:.2e} over {} steps",
            la.len()
        ));
    }
    Some(notes.join("; "))
}

/// The sweep: how step time grows with depth and batch.
pub fn sweep_table(records: &[Record]) -> String {
    let mut s = String::from(
        "| device | layers | B×T | N | step ms | tok/s | hw TFLOP/s | ms per (layer·1k tokens) | \
         overlap (step ÷ max) |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records {
        let per = r.step_ms / (r.num_layers as f64 * r.tokens_per_step as f64 / 1e3);
        let _ = writeln!(
            s,
            "| {} | {} | {}×{} | {} | {:.1} | {:.0} | {:.5} | {:.2} | {} |",
            r.spec.device,
            r.num_layers,
            r.spec.batch,
            r.spec.seq_len,
            params(r.n_params),
            r.step_ms,
            r.tokens_per_s,
            r.hardware_tflops,
            per,
            opt(r.overlap_efficiency, 2),
        );
    }
    s
}

/// Step time against work (layers × tokens), one polyline per device and
/// batch size.
pub fn sweep_svg(records: &[Record]) -> String {
    let (w, h, pad) = (640.0, 420.0, 60.0);
    let pts: Vec<(String, f64, f64)> = records
        .iter()
        .map(|r| {
            (
                format!("{} B={}", r.spec.device, r.spec.batch),
                (r.num_layers as u64 * r.tokens_per_step) as f64,
                r.step_ms,
            )
        })
        .collect();
    let xmax = pts.iter().map(|p| p.1).fold(1.0, f64::max);
    let ymax = pts.iter().map(|p| p.2).fold(1.0, f64::max);
    let x = |v: f64| pad + v / xmax * (w - 2.0 * pad);
    let y = |v: f64| h - pad - v / ymax * (h - 2.0 * pad);
    let mut series: Vec<String> = pts.iter().map(|p| p.0.clone()).collect();
    series.dedup();
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">layers × tokens per step (max {xmax:.0})</text>\n\
         <text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\">step ms (max {ymax:.0})</text>\n",
        h - pad,
        w - pad,
        h - pad,
        h - pad,
        w / 2.0,
        h - 20.0,
        h / 2.0,
        h / 2.0,
    );
    for (i, name) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let mut line: Vec<(f64, f64)> = pts.iter().filter(|p| &p.0 == name).map(|p| (p.1, p.2)).collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        let poly: Vec<String> = line
            .iter()
            .map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            poly.join(" ")
        );
        for (a, b) in &line {
            let _ = writeln!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"/>",
                x(*a),
                y(*b)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{name}</text>",
            pad + 10.0,
            pad + 15.0 * (i as f64 + 1.0)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Spilled runs against their all-RAM twins (same label before " @"), with
/// the disk's sequential bandwidth measured in the same invocation.
/// "of sequential" is the time the spill's bytes would take at the
/// sequential read and write bandwidth, ÷ the disk-busy time they took.
pub fn spill_table(records: &[Record], bw: &megatrain_tier::DiskBandwidth) -> String {
    let mut s = format!(
        "disk sequential bandwidth (same run, {:.1} GiB scratch file{}): read {:.2} GB/s, write {:.2} GB/s\n\n",
        bw.bytes as f64 / (1u64 << 30) as f64,
        if bw.direct { ", O_DIRECT" } else { "" },
        bw.read_gb_s,
        bw.write_gb_s
    );
    s.push_str(
        "| config | device | all-RAM step ms | spilled step ms | slowdown | params on disk | \
         spill GB read / written per step | disk busy s | spill GB/s | of sequential | \
         optimizer disk wait s | peak RSS GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records.iter().filter(|r| r.spec.host_budget.is_some()) {
        let base = r
            .spec
            .label
            .rsplit_once(" @")
            .map_or(r.spec.label.as_str(), |(b, _)| b);
        let ram = records
            .iter()
            .find(|o| o.spec.host_budget.is_none() && o.spec.label == base && o.spec.device == r.spec.device);
        let secs = r.spill_disk_ms / 1e3;
        let ideal = r.spill_read_bytes_per_step as f64 / (bw.read_gb_s * 1e9)
            + r.spill_written_bytes_per_step as f64 / (bw.write_gb_s * 1e9);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {} | {} | {:.2} / {:.2} | {:.1} | {:.2} | {} | {:.1} | {:.2} |",
            r.spec.label,
            r.spec.device,
            ram.map_or("–".into(), |o| format!("{:.1}", o.step_ms)),
            r.step_ms,
            ram.map_or("–".into(), |o| format!("{:.2}×", r.step_ms / o.step_ms)),
            params(r.spilled_params),
            r.spill_read_bytes_per_step as f64 / 1e9,
            r.spill_written_bytes_per_step as f64 / 1e9,
            secs,
            r.spill_gb_s,
            if secs > 0.0 {
                format!("{:.2}", ideal / secs)
            } else {
                "–".into()
            },
            r.spill_wait_ms / 1e3,
            r.peak_rss_bytes as f64 / (1u64 << 30) as f64,
        );
    }
    s
}

/// Records as one JSON document.
pub fn json(records: &[Record], failures: &[(String, String)], command: &str) -> Value {
    serde_json::json!({
        "command": command,
        "records": records,
        "failures": failures.iter().map(|(l, w)| serde_json::json!({"label": l, "error": w})).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::bench_throughput::child;
    use crate::bench_throughput::spec::{Spec, test_spec};

    fn record() -> Record {
        let spec = Spec {
            label: "tiny".into(),
            layers: Some(1),
            hidden: None,
            seq_len: 4,
            batch: 1,
            steps: 1,
            warmup: 0,
            peer: true,
            ..test_spec()
        };
        child::run(&spec).unwrap()
    }

    #[test]
    fn peer_ratio_only_against_the_same_device_kind_and_checks_are_reported() {
        let mut r = record();
        let n = r.n_params;
        r.peer = Some(vec![
            json!({"mode": "memory", "device": "cpu", "tokens_per_s": r.tokens_per_s / 2.0,
                   "n_params": n, "loss": [1.0, 2.0]}),
            json!({"mode": "streamed", "device": "NVIDIA H100", "tokens_per_s": 1.0,
                   "n_params": n + 1, "loss": [1.0, 2.5], "autocast": "bf16"}),
        ]);
        assert_eq!(peer_tokens_per_s(&r, "memory"), Some(r.tokens_per_s / 2.0));
        assert_eq!(peer_tokens_per_s(&r, "streamed"), None);
        let t = tables(
            std::slice::from_ref(&r),
            &[("x on gpu".into(), "no adapter".into())],
        );
        assert!(t.contains("| 2.00× | – |"), "{t}");
        assert!(t.contains(&format!("has {} parameters, ours {n}", n + 1)), "{t}");
        assert!(t.contains("differ by at most 5.00e-1"), "{t}");
        assert!(t.contains("- x on gpu: not run: no adapter"), "{t}");
        assert!(!t.contains("isolated modes of"), "{t}");
        // Modes that failed (compute-only out of device memory) leave the
        // steps' rows and say why, in the table and in the JSON.
        r.modes_error = Some("out of device memory".into());
        let t = tables(std::slice::from_ref(&r), &[]);
        assert!(
            t.contains("- isolated modes of tiny: not measured: out of device memory"),
            "{t}"
        );
        let back: Record = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(back.modes_error, r.modes_error);
        assert!(
            t.contains("streamed on NVIDIA H100 (torch ?, null threads, bf16 autocast)"),
            "{t}"
        );
    }

    #[test]
    fn a_spilled_twin_reports_its_disk_traffic_against_the_all_ram_run() {
        let ram = record();
        let dir = std::env::temp_dir().join(format!("bench-spill-test-{}", std::process::id()));
        let spec = Spec {
            label: "tiny @0.0G".into(),
            host_budget: Some(600 << 10),
            spill_dir: Some(dir.clone()),
            ..ram.spec.clone()
        };
        let r = child::run(&spec).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(r.first_spilled.is_some() && r.spilled_params > 0);
        assert_eq!(r.spill_read_bytes_per_step, r.spill_written_bytes_per_step);
        assert!(r.spill_read_bytes_per_step >= 12 * r.spilled_params);
        assert!(r.spill_gb_s > 0.0);
        let bw = megatrain_tier::DiskBandwidth {
            read_gb_s: 1.0,
            write_gb_s: 1.0,
            bytes: 1 << 30,
            direct: true,
        };
        let t = spill_table(&[ram, r], &bw);
        assert!(t.contains("read 1.00 GB/s, write 1.00 GB/s"), "{t}");
        let row = t
            .lines()
            .find(|l| l.starts_with("| tiny @0.0G | cpu |"))
            .expect(&t);
        assert!(row.contains('×'), "the all-RAM twin is found: {row}");
    }

    #[test]
    fn sweep_outputs_name_every_record() {
        let r = record();
        assert_eq!(sweep_table(std::slice::from_ref(&r)).lines().count(), 3);
        let svg = sweep_svg(&[r]);
        assert!(svg.starts_with("<svg") && svg.contains("cpu B=1") && svg.trim_end().ends_with("</svg>"));
    }
}
