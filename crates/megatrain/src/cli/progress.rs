//! Progress: an indicatif bar on a terminal, plain lines elsewhere or with
//! `--quiet` (evaluations and saves only).

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use megatrain::run::Progress;
use megatrain_tensor::TransportInfo;
use serde_json::Value;

pub struct CliProgress {
    bar: Option<ProgressBar>,
    total: u64,
    log_every: u64,
    quiet: bool,
    start: std::time::Instant,
    first: u64,
}

impl CliProgress {
    pub fn new(total: u64, log_every: u64, quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
                )
                .expect("valid template"),
            );
            b
        });
        CliProgress {
            bar,
            total,
            log_every: log_every.max(1),
            quiet,
            start: std::time::Instant::now(),
            first: 0,
        }
    }

    fn line(&self, msg: String) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
    }
}

fn num(r: &Value, k: &str) -> f64 {
    r.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// `transport: mapped (<reason>) [staging 1.20 ms, mapped 0.80 ms per layer up, read and down]`.
/// The run's start line on activations kept from forward to backward.
pub fn activations_line(kept: usize, blocks: usize, why: &str) -> String {
    match kept {
        0 => format!("activations: recomputed for every block from its checkpoint ({why})"),
        k if k == blocks => {
            format!("activations: kept for every block from forward to backward, none recomputed ({why})")
        }
        k => format!(
            "activations: kept for the last {k} of {blocks} blocks from forward to backward, the others recomputed ({why})"
        ),
    }
}

pub fn transport_line(info: &TransportInfo) -> String {
    let measured: Vec<String> = info
        .measured_ms
        .iter()
        .map(|(name, ms)| format!("{name} {ms:.2} ms"))
        .collect();
    let measured = if measured.is_empty() {
        String::new()
    } else {
        format!(" [{} per layer up, read and down]", measured.join(", "))
    };
    format!("transport: {} ({}){measured}", info.name, info.reason)
}

impl Progress for CliProgress {
    fn transport(&mut self, info: &TransportInfo) {
        if !self.quiet {
            self.line(transport_line(info));
        }
    }

    fn shared_transport(&mut self, shared: Result<(usize, &Path), &str>) {
        if !self.quiet {
            self.line(match shared {
                Ok((n, dir)) => format!(
                    "transport copies: one per machine, mapped by its {n} ranks (in {})",
                    dir.display()
                ),
                Err(why) => format!("transport copies: one per rank ({why})"),
            });
        }
    }

    fn activations(&mut self, kept: usize, blocks: usize, why: &str) {
        if !self.quiet {
            self.line(activations_line(kept, blocks, why));
        }
    }

    fn begin(&mut self, start: u64, _total: u64) {
        self.first = start;
        self.start = std::time::Instant::now();
        if let Some(b) = &self.bar {
            b.set_position(start);
            b.reset_eta();
        }
    }

    fn step(&mut self, r: &Value) {
        let step = r.get("step").and_then(Value::as_u64).unwrap_or(0);
        let (loss, tps) = (num(r, "loss"), num(r, "tokens_per_s"));
        if let Some(b) = &self.bar {
            b.set_position(step);
            b.set_message(format!("loss {loss:.4} | {:.0} tok/s", tps));
            return;
        }
        if self.quiet || (!step.is_multiple_of(self.log_every) && step != self.total) {
            return;
        }
        let done = step.saturating_sub(self.first).max(1) as f64;
        let eta = self.start.elapsed().as_secs_f64() / done * self.total.saturating_sub(step) as f64;
        let spill = num(r, "spill_read_bytes") + num(r, "spill_written_bytes");
        let disk = if spill > 0.0 {
            format!(
                " | disk {:.2} GB at {:.2} GB/s, waited {:.1} s",
                spill / 1e9,
                num(r, "spill_gb_s"),
                num(r, "spill_wait_ms") / 1e3
            )
        } else {
            String::new()
        };
        let norm = match r.get("grad_norm").and_then(Value::as_f64) {
            Some(n) => format!(" | grad norm {n:.3}"),
            None => String::new(),
        };
        self.line(format!(
            "step {step}/{} | loss {loss:.4}{norm} | lr {:.3e} | {:.0} tok/s | {:.1} ms/step | eta {:.0} s{disk}",
            self.total,
            num(r, "lr"),
            tps,
            num(r, "step_ms"),
            eta
        ));
    }

    fn eval(&mut self, step: u64, val_loss: f64) {
        self.line(format!("step {step}: validation loss {val_loss:.4}"));
    }

    fn sample(&mut self, step: u64, text: &str) {
        self.line(format!("step {step}: sample:\n{text}"));
    }

    fn saved(&mut self, step: u64, dir: &Path) {
        if !self.quiet {
            self.line(format!("step {step}: saved {}", dir.display()));
        }
    }

    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_line_says_how_many_are_kept_and_why() {
        assert_eq!(
            activations_line(0, 4, "auto: none (x)"),
            "activations: recomputed for every block from its checkpoint (auto: none (x))"
        );
        assert_eq!(
            activations_line(4, 4, "--keep-activations all"),
            "activations: kept for every block from forward to backward, none recomputed (--keep-activations all)"
        );
        assert_eq!(
            activations_line(3, 28, "why"),
            "activations: kept for the last 3 of 28 blocks from forward to backward, the others recomputed (why)"
        );
    }

    #[test]
    fn transport_line_names_choice_reason_and_measurements() {
        let info = TransportInfo {
            name: "mapped".into(),
            reason: "measured faster".into(),
            measured_ms: vec![("staging".into(), 1.2), ("mapped".into(), 0.8)],
        };
        assert_eq!(
            transport_line(&info),
            "transport: mapped (measured faster) [staging 1.20 ms, mapped 0.80 ms per layer up, read and down]"
        );
        let forced = TransportInfo {
            name: "staging".into(),
            reason: "--transport staging".into(),
            measured_ms: Vec::new(),
        };
        assert_eq!(
            transport_line(&forced),
            "transport: staging (--transport staging)"
        );
    }
}
