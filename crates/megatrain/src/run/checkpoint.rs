//! A run directory: `ckpt-<step>/` checkpoints (HF-loadable `config.json` +
//! `model.safetensors` + tokenizer, and `optimizer.safetensors`,
//! `train_state.json`, `checkpoint.json` for resuming), `metrics.jsonl`,
//! `loss.svg`, and the `latest` pointer.
//!
//! Order of writes for a checkpoint: the directory's own files, each
//! atomically (config, tokenizer, train state, model, optimizer), then
//! `checkpoint.json` (the tier writes it last; a directory without it never
//! loads), and only then `latest`. A kill at any point leaves `latest`
//! naming the previous complete checkpoint.

use std::path::{Path, PathBuf};

use megatrain_tier::{
    Gathered, HostTier, LayerSlab, atomic::write_atomic, read_checkpoint_meta, read_latest, read_pointer,
    write_latest, write_pointer,
};
use megatrain_zoo::ModelConfig;
use serde::{Deserialize, Serialize};

use super::encoder::Encoder;
use super::error::{Result, RunError};
use super::options::TrainOptions;

pub const STATE_FILE: &str = "train_state.json";
pub const CONFIG_FILE: &str = "config.json";
const STATE_FORMAT: &str = "megatrain-train-state";

/// What a resumed run needs besides the tier: the step, the settings, and
/// the data position. There is no RNG state: batches are a pure function of
/// (seed, batch index) and the data position is the step number
/// (`step · grad_accum` micro-batches drawn), so this is all of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub format: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Input tokens processed so far.
    pub tokens: u64,
    /// Training wall time so far (seconds, summed over resumes).
    pub train_s: f64,
    /// The data position: `step · grad_accum` plus the micro-batches
    /// skipped (`skip_batches`).
    pub data_position: u64,
    /// `hf`, `char` or `byte`.
    pub tokenizer: String,
    pub options: TrainOptions,
    pub note: String,
    /// The validation loss evaluated at this step, where one was (what
    /// `best` is chosen by).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The lowest validation loss so far and the evaluations since it,
    /// where there was one (what `--early-stop` counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patience: Option<Patience>,
}

/// The lowest validation loss of a run so far, and how many evaluations
/// since have not gone below it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Patience {
    pub best: f64,
    pub since: u64,
}

impl Patience {
    /// After an evaluation of `val_loss`: a lower one is the new best, any
    /// other (a NaN too) one more evaluation since it. Nothing before a
    /// first finite one.
    pub fn after(p: Option<Patience>, val_loss: f64) -> Option<Patience> {
        match p {
            Some(p) if val_loss < p.best => Some(Patience {
                best: val_loss,
                since: 0,
            }),
            Some(p) => Some(Patience {
                since: p.since + 1,
                ..p
            }),
            None if val_loss.is_finite() => Some(Patience {
                best: val_loss,
                since: 0,
            }),
            None => None,
        }
    }
}

impl TrainState {
    pub fn new(step: u64, tokens: u64, train_s: f64, tokenizer: &str, options: &TrainOptions) -> Self {
        TrainState {
            format: STATE_FORMAT.into(),
            step,
            tokens,
            train_s,
            data_position: step * options.grad_accum as u64 + options.skip_batches,
            tokenizer: tokenizer.into(),
            options: options.clone(),
            note: "batch i is drawn from (seed, i) by a counter-based hash: no RNG state is saved".into(),
            val_loss: None,
            patience: None,
        }
    }
}

/// The pointer to the run's checkpoint of the lowest validation loss.
pub const BEST_FILE: &str = "best";

/// Which checkpoint of a run `--step` picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Step(u64),
    /// The one `best` names.
    Best,
}

impl std::str::FromStr for Pick {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "best" => Ok(Pick::Best),
            _ => s
                .parse()
                .map(Pick::Step)
                .map_err(|_| format!("'{s}' is neither a step nor 'best'")),
        }
    }
}

/// The checkpoint `best` names and its validation loss; `None` where the
/// run has no `best`.
pub fn best_checkpoint(run: &Path) -> Result<Option<(PathBuf, f64)>> {
    let Some(dir) = read_pointer(run, BEST_FILE)? else {
        return Ok(None);
    };
    match read_train_state(&dir)?.val_loss {
        Some(v) => Ok(Some((dir, v))),
        None => Err(RunError::file(
            &dir,
            "'best' names a checkpoint without a validation loss",
        )),
    }
}

/// Points `best` at `dir` (just saved, with `val_loss` evaluated at its
/// step) where no checkpoint of a lower validation loss is kept: where the
/// one `best` names has a higher one, or is gone or unreadable. A NaN is
/// never the best. Returns whether it did.
pub fn note_best(run: &Path, dir: &Path, val_loss: f64) -> Result<bool> {
    let kept = best_checkpoint(run).ok().flatten();
    let better = val_loss.is_finite() && kept.as_ref().is_none_or(|(_, v)| val_loss < *v);
    if better {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        write_pointer(run, BEST_FILE, &name)?;
    }
    Ok(better)
}

pub fn checkpoint_name(step: u64) -> String {
    format!("ckpt-{step}")
}

/// The step of a checkpoint directory's name, as [`checkpoint_name`] writes
/// it (so `ckpt-007` is not one).
fn checkpoint_step(name: &str) -> Option<u64> {
    let step = name.strip_prefix("ckpt-")?.parse().ok()?;
    (checkpoint_name(step) == name).then_some(step)
}

/// Marks a checkpoint directory being removed: out of the `ckpt-<step>`
/// names, so a kill midway leaves no half-removed checkpoint under one.
const REMOVING: &str = ".removing";

/// Removes the checkpoints of `run` older than the newest `keep` (≥ 1) up
/// to the one `latest` names, but never the one `best` names; any past
/// `latest` were never pointed at and are replaced as the run reaches
/// them. Each is renamed away before it is deleted, and what a kill left
/// of an earlier removal goes too. Returns the checkpoints removed.
pub fn prune_checkpoints(run: &Path, keep: u64) -> Result<Vec<PathBuf>> {
    assert!(keep >= 1, "keep_checkpoints 0 keeps all and never prunes");
    let Some(latest) = read_latest(run)? else {
        return Ok(Vec::new());
    };
    let Some(latest) = latest
        .file_name()
        .and_then(|n| checkpoint_step(&n.to_string_lossy()))
    else {
        return Ok(Vec::new());
    };
    let mut steps = Vec::new();
    for entry in std::fs::read_dir(run).map_err(RunError::io(run))? {
        let entry = entry.map_err(RunError::io(run))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".ckpt-") && name.ends_with(REMOVING) {
            std::fs::remove_dir_all(entry.path()).map_err(RunError::io(entry.path()))?;
        } else if let Some(step) = checkpoint_step(&name).filter(|&s| s <= latest)
            && entry.path().is_dir()
        {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    let best = read_pointer(run, BEST_FILE)?
        .and_then(|b| b.file_name().and_then(|n| checkpoint_step(&n.to_string_lossy())));
    let stale = &steps[..steps.len().saturating_sub(keep as usize)];
    let mut removed = Vec::new();
    for &step in stale.iter().filter(|&&s| Some(s) != best) {
        let dir = run.join(checkpoint_name(step));
        let away = run.join(format!(".{}{REMOVING}", checkpoint_name(step)));
        std::fs::rename(&dir, &away).map_err(RunError::io(&dir))?;
        std::fs::remove_dir_all(&away).map_err(RunError::io(&away))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Writes checkpoint `ckpt-<step>` of `run` and then points `latest` at it.
/// `gather` is called on each layer, in order, just before it is written
/// (rank 0 of a sharded optimizer gathers the layer there; see
/// `Trainer::save_on_rank0`); a checkpoint that exists already is not
/// written again, and `gather` is then not called.
pub fn save_run_checkpoint(
    run: &Path,
    tier: &mut HostTier,
    gather: &mut dyn FnMut(&mut LayerSlab) -> megatrain_tier::Result<Option<Gathered>>,
    model: &ModelConfig,
    encoder: &Encoder,
    state: &TrainState,
) -> Result<PathBuf> {
    let name = checkpoint_name(state.step);
    let dir = run.join(&name);
    if read_latest(run)?.as_deref() == Some(dir.as_path()) {
        // Already the current checkpoint (a resume at a save step): the
        // same bytes; rewriting would open a window with no valid latest.
        return Ok(dir);
    }
    if dir.exists() {
        // Left over from a run killed while saving; never pointed at.
        std::fs::remove_dir_all(&dir).map_err(RunError::io(&dir))?;
    }
    let previous = read_latest(run)?;
    write_checkpoint_files(run, &dir, tier, gather, model, encoder, state).map_err(|e| {
        // Never pointed at: remove what was written (on a full disk this
        // frees the space again) and say which checkpoint still stands.
        if read_latest(run).ok().flatten().as_deref() != Some(dir.as_path()) {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let kept = match &previous {
            Some(p) => format!("'latest' still names {}", p.display()),
            None => "there is no earlier checkpoint".into(),
        };
        match e {
            // Names the checkpoint itself.
            RunError::Tier(e @ megatrain_tier::TierError::NonFinite { .. }) => {
                RunError::Config(format!("{e}; {kept}"))
            }
            e => RunError::Config(format!("saving checkpoint {}: {e}; {kept}", dir.display())),
        }
    })?;
    Ok(dir)
}

fn write_checkpoint_files(
    run: &Path,
    dir: &Path,
    tier: &mut HostTier,
    gather: &mut dyn FnMut(&mut LayerSlab) -> megatrain_tier::Result<Option<Gathered>>,
    model: &ModelConfig,
    encoder: &Encoder,
    state: &TrainState,
) -> Result<()> {
    let name = checkpoint_name(state.step);
    std::fs::create_dir_all(dir).map_err(RunError::io(dir))?;
    let config = serde_json::to_vec_pretty(&model.to_hf_json("float32")).expect("JSON value");
    write_atomic(&dir.join(CONFIG_FILE), &config)?;
    encoder.save_to(dir)?;
    let state_json = serde_json::to_value(state).expect("state serialises");
    let text = serde_json::to_vec_pretty(&state_json).expect("JSON value");
    write_atomic(&dir.join(STATE_FILE), &text)?;
    let extra = serde_json::json!({ "train_state": state_json });
    megatrain_tier::save_checkpoint_gathered(dir, tier, &extra, gather)?;
    write_latest(run, &name)?;
    Ok(())
}

/// The `--chat-template` a command on model directory `dir` renders with:
/// `given`, else the one the run trained with where `dir` is a run's
/// checkpoint, else `auto`.
pub fn chat_template_spec(dir: &Path, given: Option<&str>) -> String {
    match given {
        Some(spec) => spec.to_string(),
        None => read_train_state(dir).map_or_else(|_| "auto".into(), |s| s.options.chat_template),
    }
}

/// The train state of a complete checkpoint (from `checkpoint.json`, which
/// exists only once every file is in place).
pub fn read_train_state(ckpt: &Path) -> Result<TrainState> {
    let meta = read_checkpoint_meta(ckpt)?;
    let v = meta.extra.get("train_state").cloned().ok_or_else(|| {
        RunError::file(
            ckpt.join(megatrain_tier::META_FILE),
            "no 'train_state' in 'extra'",
        )
    })?;
    let state: TrainState = serde_json::from_value(v)
        .map_err(|e| RunError::file(ckpt.join(megatrain_tier::META_FILE), format!("train_state: {e}")))?;
    if state.format != STATE_FORMAT {
        return Err(RunError::file(
            ckpt.join(megatrain_tier::META_FILE),
            format!("train_state format '{}' is not '{STATE_FORMAT}'", state.format),
        ));
    }
    Ok(state)
}

/// The latest complete checkpoint of a run directory.
pub fn latest_checkpoint(run: &Path) -> Result<PathBuf> {
    if !run.is_dir() {
        return Err(RunError::file(run, "no such run directory"));
    }
    read_latest(run)?.ok_or_else(|| {
        RunError::file(
            run,
            "has no 'latest' checkpoint (was the run stopped before its first save?)",
        )
    })
}

/// A model directory from what the user named: a run directory (its
/// `latest` checkpoint, or `ckpt-<step>` with `step`), a checkpoint
/// directory, or a Hugging Face model directory. A checkpoint's weights are
/// checked against the CRCs it was written with before anything reads them.
pub fn resolve_model_dir(path: &Path, step: Option<Pick>) -> Result<PathBuf> {
    let dir = find_model_dir(path, step)?;
    if dir.join(megatrain_tier::META_FILE).exists() {
        megatrain_tier::verify_checkpoint_file(&dir, megatrain_tier::MODEL_FILE)?;
    }
    Ok(dir)
}

fn find_model_dir(path: &Path, step: Option<Pick>) -> Result<PathBuf> {
    if !path.exists() {
        return Err(RunError::file(path, "no such file or directory"));
    }
    let is_run = path.join(megatrain_tier::LATEST_FILE).exists();
    match step {
        Some(Pick::Best) => {
            let Some(dir) = read_pointer(path, BEST_FILE)? else {
                return Err(RunError::file(
                    path,
                    "has no 'best' checkpoint: none was saved at a step with an evaluation (make --save-every a multiple of --eval-every)",
                ));
            };
            if !dir.join(megatrain_tier::META_FILE).exists() {
                return Err(RunError::file(&dir, "'best' names no complete checkpoint"));
            }
            Ok(dir)
        }
        Some(Pick::Step(s)) => {
            let dir = path.join(checkpoint_name(s));
            if !dir.join(megatrain_tier::META_FILE).exists() {
                return Err(RunError::file(
                    &dir,
                    format!("no complete checkpoint for step {s}"),
                ));
            }
            Ok(dir)
        }
        None if is_run => latest_checkpoint(path),
        None => {
            if !path.join(CONFIG_FILE).exists() {
                return Err(RunError::file(
                    path,
                    "is neither a run directory (no 'latest') nor a model directory (no config.json)",
                ));
            }
            Ok(path.to_path_buf())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pruning_keeps_the_newest_up_to_latest_and_nothing_else_it_does_not_own() {
        let run = tempfile::tempdir().unwrap();
        let run = run.path();
        for name in [
            "ckpt-1",
            "ckpt-2",
            "ckpt-3",
            "ckpt-5",
            "ckpt-007",
            ".ckpt-9.removing",
        ] {
            std::fs::create_dir(run.join(name)).unwrap();
            std::fs::write(run.join(name).join("model.safetensors"), b"x").unwrap();
        }
        std::fs::write(run.join("ckpt-4"), b"a file, not a checkpoint").unwrap();
        assert!(
            prune_checkpoints(run, 2).unwrap().is_empty(),
            "no latest: nothing to go by"
        );
        write_latest(run, "ckpt-3").unwrap();
        assert_eq!(prune_checkpoints(run, 2).unwrap(), vec![run.join("ckpt-1")]);
        let mut left: Vec<String> = std::fs::read_dir(run)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        // ckpt-5 is past latest (never pointed at); ckpt-007 is not a name
        // this run writes; the leftover of a killed removal is gone.
        assert_eq!(
            left,
            ["ckpt-007", "ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5", "latest"]
        );
        assert_eq!(prune_checkpoints(run, 1).unwrap(), vec![run.join("ckpt-2")]);
        assert!(prune_checkpoints(run, 1).unwrap().is_empty());
        assert!(run.join("ckpt-3").is_dir());
    }

    /// `ckpt-<step>/` whose `checkpoint.json` holds a train state of
    /// `val_loss` (and no tensors).
    fn fake(run: &Path, step: u64, val_loss: Option<f64>) -> PathBuf {
        let dir = run.join(checkpoint_name(step));
        std::fs::create_dir_all(&dir).unwrap();
        let mut st = TrainState::new(step, 0, 0.0, "char", &TrainOptions::default());
        st.val_loss = val_loss;
        let meta = serde_json::json!({"format": "megatrain-checkpoint", "version": 1, "n_layers": 0,
            "n_params": 0, "extra": {"train_state": st}});
        std::fs::write(dir.join(megatrain_tier::META_FILE), meta.to_string()).unwrap();
        dir
    }

    #[test]
    fn best_moves_only_to_a_lower_loss_and_pruning_spares_it() {
        let run = tempfile::tempdir().unwrap();
        let run = run.path();
        assert_eq!(best_checkpoint(run).unwrap(), None);
        let saved = |step, v: Option<f64>| {
            let dir = fake(run, step, v);
            write_latest(run, &checkpoint_name(step)).unwrap();
            let noted = v.map(|v| note_best(run, &dir, v).unwrap());
            prune_checkpoints(run, 1).unwrap();
            noted
        };
        assert_eq!(saved(1, Some(2.0)), Some(true));
        assert_eq!(saved(2, Some(1.5)), Some(true));
        assert_eq!(saved(3, Some(1.7)), Some(false));
        assert_eq!(saved(4, None), None);
        assert_eq!(saved(5, Some(f64::NAN)), Some(false));
        assert_eq!(saved(6, Some(1.5)), Some(false), "a tie keeps the earlier");
        let mut left: Vec<String> = std::fs::read_dir(run)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["best", "ckpt-2", "ckpt-6", "latest"]);
        assert_eq!(best_checkpoint(run).unwrap(), Some((run.join("ckpt-2"), 1.5)));
        // The best moves on, and the one it leaves is pruned like any other.
        assert_eq!(saved(7, Some(1.0)), Some(true));
        assert!(!run.join("ckpt-2").exists() && run.join("ckpt-7").is_dir());
        // A best the user removed is replaced by the next evaluation saved.
        std::fs::remove_dir_all(run.join("ckpt-7")).unwrap();
        assert!(best_checkpoint(run).is_err());
        assert_eq!(saved(8, Some(3.0)), Some(true));
        assert_eq!(best_checkpoint(run).unwrap(), Some((run.join("ckpt-8"), 3.0)));
    }

    #[test]
    fn a_pick_is_a_step_or_best() {
        assert_eq!("12".parse::<Pick>(), Ok(Pick::Step(12)));
        assert_eq!("best".parse::<Pick>(), Ok(Pick::Best));
        assert_eq!(
            "latest".parse::<Pick>(),
            Err("'latest' is neither a step nor 'best'".into())
        );
    }

    #[test]
    fn patience_counts_evaluations_since_the_lowest_loss() {
        let p = Patience::after(None, f64::NAN);
        assert_eq!(p, None, "nothing to beat before a finite loss");
        let p = Patience::after(p, 2.0);
        assert_eq!(p, Some(Patience { best: 2.0, since: 0 }));
        let p = Patience::after(p, 2.0);
        assert_eq!(
            p,
            Some(Patience { best: 2.0, since: 1 }),
            "a tie is no improvement"
        );
        let p = Patience::after(p, f64::NAN);
        assert_eq!(p, Some(Patience { best: 2.0, since: 2 }));
        let p = Patience::after(p, 1.5);
        assert_eq!(p, Some(Patience { best: 1.5, since: 0 }));
    }
}
