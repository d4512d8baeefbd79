//! Checkpoints: a directory with
//!
//! - `model.safetensors`: every parameter under its Hugging Face name, f32
//!   (loadable by HF tooling; `__metadata__` has `format: pt`);
//! - `optimizer.safetensors`: `<param>.exp_avg` and `<param>.exp_avg_sq`
//!   (AdamW `m` and `v`, f32) and `megatrain.layer_steps` (u64, one AdamW
//!   step count per layer);
//! - `checkpoint.json`: format tag, layer and parameter counts, the CRC-32
//!   of every tensor of both files ([`crate::crc`]), and the trainer's own
//!   metadata under `extra`. Written last: a directory without it is an
//!   incomplete checkpoint and does not load.
//!
//! Every file goes through a temporary file in the same directory that is
//! synced and renamed ([`crate::atomic`]). Tensors are written layer by
//! layer (`stream.rs`: the header, made by the safetensors crate, lists
//! every offset first), straight from the slabs, so rank 0 of a sharded
//! optimizer gathers one layer at a time ([`save_checkpoint_gathered`])
//! and no second in-memory copy of the model is made; safetensors is
//! little-endian, which is the slabs' native layout on every target we
//! build for (big-endian hosts get a converted copy per tensor).
//!
//! A run directory names its current checkpoint in a `latest` file
//! ([`write_latest`], [`read_latest`]), replaced atomically after the
//! checkpoint is complete.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use megatrain_tensor::ParamTable;
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use serde_json::{Value, json};

use crate::atomic::{sync_dir, write_atomic};
use crate::buf::AlignedBuf;
use crate::crc::{self, Crc32Table, copy_le_f32, copy_le_f32_part, crc32};
use crate::error::{IoContext, Result, TierError};
use crate::slab::LayerSlab;
use crate::stream::{Planned, StreamFile};
use crate::tier::HostTier;

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const META_FILE: &str = "checkpoint.json";
pub const LATEST_FILE: &str = "latest";
pub const STEPS_TENSOR: &str = "megatrain.layer_steps";
const FORMAT: &str = "megatrain-checkpoint";
const VERSION: u64 = 1;

/// What a checkpoint says about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointMeta {
    pub n_layers: usize,
    pub n_params: u64,
    /// AdamW step count per layer (filled by [`load_checkpoint`]; empty from
    /// [`read_checkpoint_meta`], which reads only the JSON).
    pub layer_steps: Vec<u64>,
    /// The trainer's metadata, passed through unchanged.
    pub extra: Value,
}

/// The optimizer-file names of a parameter's moments.
pub fn exp_avg_name(param: &str) -> String {
    format!("{param}.exp_avg")
}

pub fn exp_avg_sq_name(param: &str) -> String {
    format!("{param}.exp_avg_sq")
}

fn le_bytes<T: bytemuck::Pod>(data: &[T], to_le: impl Fn(&T) -> T) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(data))
    } else {
        let v: Vec<T> = data.iter().map(to_le).collect();
        Cow::Owned(bytemuck::cast_slice(&v).to_vec())
    }
}

fn f32_bytes(data: &[f32]) -> Cow<'_, [u8]> {
    le_bytes(data, |x| f32::from_bits(x.to_bits().to_le()))
}

/// Writes a complete checkpoint of `tier` into `dir` (created if needed).
/// `extra` is stored verbatim and returned by [`load_checkpoint`].
///
/// Prefer a fresh directory per checkpoint plus [`write_latest`]: when
/// `dir` already holds a checkpoint, its `checkpoint.json` is removed first,
/// so a crash half-way leaves an incomplete (refused) checkpoint rather
/// than a silent mix of old and new files.
pub fn save_checkpoint(dir: &Path, tier: &HostTier, extra: &Value) -> Result<()> {
    tier.need_params("a checkpoint")?;
    let shape = Shape::of(tier);
    write_checkpoint(dir, shape, extra, |l, put| put(Layer::of(&tier.layers()[l])))
}

/// A layer's p, m and v gathered whole into RAM, for a layer whose slab
/// cannot hold them (a spilled layer whose files hold one rank's range).
pub struct Gathered {
    pub params: AlignedBuf<f32>,
    pub m: AlignedBuf<f32>,
    pub v: AlignedBuf<f32>,
}

/// [`save_checkpoint`] by rank 0 of a sharded optimizer: `gather` brings a
/// layer's p, m and v whole just before the layer is written, into its slab
/// (returning `None`) or into RAM buffers it returns, and
/// [`LayerSlab::settle`] hands back what is not this rank's right after, so
/// the process holds at most one layer whole beyond its share. `gather` is
/// called once per layer, in layer order (the order of the other ranks'
/// side of the collectives).
pub fn save_checkpoint_gathered(
    dir: &Path,
    tier: &mut HostTier,
    extra: &Value,
    gather: &mut dyn FnMut(&mut LayerSlab) -> Result<Option<Gathered>>,
) -> Result<()> {
    tier.need_params("a checkpoint")?;
    let shape = Shape::of(tier);
    write_checkpoint(dir, shape, extra, |l, put| {
        let slab = &mut tier.layers_mut()[l];
        match gather(slab)? {
            Some(g) => put(Layer {
                table: slab.file_table(),
                params: &g.params,
                m: &g.m,
                v: &g.v,
            })?,
            None => put(Layer::of(slab))?,
        }
        slab.settle()
    })
}

/// The whole state of one layer, as the writer reads it.
struct Layer<'a> {
    table: &'a ParamTable,
    params: &'a [f32],
    m: &'a [f32],
    v: &'a [f32],
}

impl<'a> Layer<'a> {
    fn of(slab: &'a LayerSlab) -> Self {
        Layer {
            table: slab.file_table(),
            params: slab.params(),
            m: slab.m(),
            v: slab.v(),
        }
    }
}

/// What a checkpoint's headers and `checkpoint.json` say of a tier.
struct Shape {
    /// Per layer, its tensors: name, shape.
    layers: Vec<Vec<(String, Vec<usize>)>>,
    steps: Vec<u64>,
    n_params: u64,
    transport: String,
}

impl Shape {
    fn of(tier: &HostTier) -> Self {
        Shape {
            layers: tier
                .layers()
                .iter()
                .map(|l| {
                    l.file_table()
                        .iter()
                        .map(|s| (s.name.clone(), s.shape.dims().to_vec()))
                        .collect()
                })
                .collect(),
            steps: tier.layers().iter().map(LayerSlab::step).collect(),
            n_params: tier.n_params(),
            transport: tier.config().transport.to_string(),
        }
    }
}

/// Writes both tensor files layer by layer (`visit(l, put)` hands layer
/// `l`'s state to `put`), then `checkpoint.json`.
fn write_checkpoint(
    dir: &Path,
    shape: Shape,
    extra: &Value,
    mut visit: impl FnMut(usize, &mut dyn FnMut(Layer<'_>) -> Result<()>) -> Result<()>,
) -> Result<()> {
    std::fs::create_dir_all(dir).at(dir)?;
    let meta_path = dir.join(META_FILE);
    match std::fs::remove_file(&meta_path) {
        Ok(()) => sync_dir(dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(TierError::Io {
                path: meta_path,
                cause: e,
            });
        }
    }
    let planned = |name: String, dtype: Dtype, shape: &[usize]| Planned {
        name,
        dtype,
        shape: shape.to_vec(),
    };
    let tensors = shape.layers.iter().flatten();
    let model_plan: Vec<Planned> = tensors
        .clone()
        .map(|(n, s)| planned(n.clone(), Dtype::F32, s))
        .collect();
    // The u64 step counts first: every tensor then starts 8-byte aligned
    // in the data section whatever the f32 counts.
    let optim_plan: Vec<Planned> =
        std::iter::once(planned(STEPS_TENSOR.into(), Dtype::U64, &[shape.steps.len()]))
            .chain(tensors.flat_map(|(n, s)| {
                [
                    planned(exp_avg_name(n), Dtype::F32, s),
                    planned(exp_avg_sq_name(n), Dtype::F32, s),
                ]
            }))
            .collect();
    let st_meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut model = StreamFile::create(&dir.join(MODEL_FILE), &model_plan, st_meta.clone())?;
    let mut optim = StreamFile::create(&dir.join(OPTIMIZER_FILE), &optim_plan, st_meta)?;
    optim.put(STEPS_TENSOR, &le_bytes(&shape.steps, |x| x.to_le()))?;
    for l in 0..shape.layers.len() {
        visit(l, &mut |layer: Layer<'_>| {
            for spec in layer.table.iter() {
                let r = spec.range();
                let parts = [
                    (&layer.params[r.clone()], spec.name.clone()),
                    (&layer.m[r.clone()], exp_avg_name(&spec.name)),
                    (&layer.v[r.clone()], exp_avg_sq_name(&spec.name)),
                ];
                for (x, tensor) in parts {
                    if let Some((index, value)) = first_non_finite(x) {
                        return Err(TierError::NonFinite {
                            dir: dir.to_path_buf(),
                            tensor,
                            index,
                            value,
                        });
                    }
                }
                model.put(&spec.name, &f32_bytes(&layer.params[r.clone()]))?;
                optim.put(&exp_avg_name(&spec.name), &f32_bytes(&layer.m[r.clone()]))?;
                optim.put(&exp_avg_sq_name(&spec.name), &f32_bytes(&layer.v[r]))?;
            }
            Ok(())
        })?;
    }
    let table = Crc32Table::from([
        (MODEL_FILE.to_string(), model.finish()?),
        (OPTIMIZER_FILE.to_string(), optim.finish()?),
    ]);

    let meta = json!({
        "format": FORMAT,
        "version": VERSION,
        "n_layers": shape.layers.len(),
        "n_params": shape.n_params,
        "transport": shape.transport,
        "files": [MODEL_FILE, OPTIMIZER_FILE],
        crc::KEY: crc::to_json(&table),
        "extra": extra,
    });
    let text = serde_json::to_vec_pretty(&meta).expect("a JSON value always serialises");
    write_atomic(&meta_path, &text)
}

/// The first element of `x` that is NaN or infinite, and its index. Blocks
/// are scanned in parallel without branches (an f32 is non-finite where its
/// exponent bits are all set), the bad block's element found after.
fn first_non_finite(x: &[f32]) -> Option<(usize, f32)> {
    const BLOCK: usize = 1 << 14;
    const EXP: u32 = 0x7f80_0000;
    let bad = |b: &[f32]| b.iter().fold(false, |acc, v| acc | (v.to_bits() & EXP == EXP));
    let block = x.par_chunks(BLOCK).position_first(bad)?;
    let start = block * BLOCK;
    let i = start + x[start..].iter().position(|v| !v.is_finite())?;
    Some((i, x[i]))
}

/// Reads `checkpoint.json` only.
pub fn read_checkpoint_meta(dir: &Path) -> Result<CheckpointMeta> {
    read_meta(dir).map(|(meta, _)| meta)
}

/// `checkpoint.json`, with its CRCs where it has them.
pub(crate) fn read_meta(dir: &Path) -> Result<(CheckpointMeta, Option<Crc32Table>)> {
    let path = dir.join(META_FILE);
    let text = std::fs::read(&path).at(&path)?;
    let bad = |detail: String| TierError::Meta {
        file: path.clone(),
        detail,
    };
    let v: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    if v.get("format").and_then(Value::as_str) != Some(FORMAT) {
        return Err(bad(format!("'format' is not \"{FORMAT}\"")));
    }
    match v.get("version").and_then(Value::as_u64) {
        Some(VERSION) => {}
        other => {
            return Err(bad(format!(
                "unsupported version {other:?} (this build reads {VERSION})"
            )));
        }
    }
    let field = |k: &str| {
        v.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(format!("missing '{k}'")))
    };
    let meta = CheckpointMeta {
        n_layers: field("n_layers")? as usize,
        n_params: field("n_params")?,
        layer_steps: Vec::new(),
        extra: v.get("extra").cloned().unwrap_or(Value::Null),
    };
    Ok((meta, crc::from_json(&v).map_err(bad)?))
}

/// An opened, header-validated safetensors file.
pub(crate) struct StFile {
    pub(crate) path: PathBuf,
    map: Mmap,
}

impl StFile {
    pub(crate) fn open(path: PathBuf) -> Result<Self> {
        let file = File::open(&path).at(&path)?;
        // SAFETY: checkpoint files are only ever replaced by rename, never
        // modified in place, so the mapped contents do not change under us.
        let map = unsafe { Mmap::map(&file) }.at(&path)?;
        Ok(StFile { path, map })
    }

    pub(crate) fn parse(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map).map_err(|e| {
            let tensor = match &e {
                SafeTensorError::InvalidOffset(name) | SafeTensorError::TensorNotFound(name) => {
                    Some(name.clone())
                }
                _ => first_truncated_tensor(&self.map),
            };
            TierError::Corrupt {
                file: self.path.clone(),
                tensor,
                detail: e.to_string(),
            }
        })
    }

    /// The tensor, checked against the expected dtype and shape.
    fn expect<'a>(
        &self,
        st: &SafeTensors<'a>,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
    ) -> Result<TensorView<'a>> {
        let t = st.tensor(name).map_err(|_| TierError::MissingTensor {
            file: self.path.clone(),
            tensor: name.to_string(),
        })?;
        if t.dtype() != dtype {
            return Err(TierError::WrongDType {
                file: self.path.clone(),
                tensor: name.to_string(),
                expected: dtype.to_string(),
                got: t.dtype().to_string(),
            });
        }
        if t.shape() != shape {
            return Err(TierError::WrongShape {
                file: self.path.clone(),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                got: t.shape().to_vec(),
            });
        }
        Ok(t)
    }

    fn reject_unexpected(&self, st: &SafeTensors<'_>, expected: &HashSet<String>) -> Result<()> {
        let mut extra: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|n| !expected.contains(*n))
            .collect();
        extra.sort_unstable();
        match extra.first() {
            Some(n) => Err(TierError::UnexpectedTensor {
                file: self.path.clone(),
                tensor: n.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// Lets the kernel drop the mapped pages of a tensor already copied, so
    /// that loading adds at most one tensor's worth of file pages to the
    /// resident set (peak RSS is what the memory budget is measured by).
    pub(crate) fn release(&self, data: &[u8]) {
        crate::rss::release_mapped(&self.map, data);
    }
}

/// For a file whose data section is shorter than its header promises: the
/// tensor (by lowest start offset) that extends past the end.
fn first_truncated_tensor(buf: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(buf.get(8..8usize.checked_add(n)?)?).ok()?;
    let data_len = buf.len() - 8 - n;
    header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .filter_map(|(k, v)| {
            let o = v.get("data_offsets")?.as_array()?;
            let (start, end) = (o.first()?.as_u64()?, o.get(1)?.as_u64()?);
            (end as usize > data_len).then_some((start, k.clone()))
        })
        .min()
        .map(|(_, k)| k)
}

/// Loads the checkpoint in `dir` into `tier`, which must have been built
/// from the same parameter tables. Everything but the data's CRCs is
/// validated (every tensor present, f32, right shape; no unknown tensors;
/// layer and parameter counts; a CRC for each tensor) before the first byte
/// of the tier is overwritten, so such a bad checkpoint leaves the tier as
/// it was. The CRCs are checked as each tensor is copied, which reads the
/// files once rather than twice: after a [`TierError::Corrupt`] naming a
/// tensor whose bytes changed, the tier holds part of the checkpoint and
/// is not to be used. Transport copies are refreshed and spilled layers
/// evicted from the resident set.
pub fn load_checkpoint(dir: &Path, tier: &mut HostTier) -> Result<CheckpointMeta> {
    let (mut meta, crcs) = read_meta(dir)?;
    let meta_path = dir.join(META_FILE);
    if meta.n_layers != tier.len() || meta.n_params != tier.n_params() {
        return Err(TierError::Meta {
            file: meta_path,
            detail: format!(
                "checkpoint has {} layers / {} parameters, the model {} / {}",
                meta.n_layers,
                meta.n_params,
                tier.len(),
                tier.n_params()
            ),
        });
    }
    let model = StFile::open(dir.join(MODEL_FILE))?;
    let optim = StFile::open(dir.join(OPTIMIZER_FILE))?;
    let model_st = model.parse()?;
    let optim_st = optim.parse()?;

    // Validation pass: nothing is written until all of it succeeds.
    let mut model_names = HashSet::new();
    let mut optim_names = HashSet::from([STEPS_TENSOR.to_string()]);
    let mut plan = Vec::new();
    for (l, layer) in tier.layers().iter().enumerate() {
        for spec in layer.file_table().iter() {
            let dims = spec.shape.dims();
            let p = model.expect(&model_st, &spec.name, Dtype::F32, dims)?;
            let (ma, va) = (exp_avg_name(&spec.name), exp_avg_sq_name(&spec.name));
            let m = optim.expect(&optim_st, &ma, Dtype::F32, dims)?;
            let v = optim.expect(&optim_st, &va, Dtype::F32, dims)?;
            model_names.insert(spec.name.clone());
            optim_names.insert(ma);
            optim_names.insert(va);
            plan.push((l, spec.range(), spec.name.clone(), p, m, v));
        }
    }
    model.reject_unexpected(&model_st, &model_names)?;
    optim.reject_unexpected(&optim_st, &optim_names)?;
    let model_crcs = crc::expected(
        crcs.as_ref(),
        &meta_path,
        MODEL_FILE,
        model_names.iter().map(String::as_str),
    )?;
    let optim_crcs = crc::expected(
        crcs.as_ref(),
        &meta_path,
        OPTIMIZER_FILE,
        optim_names.iter().map(String::as_str),
    )?;
    let check = |file: &StFile, crcs: &Option<HashMap<String, u32>>, name: &str, got: u32| match crcs {
        Some(c) if c[name] != got => Err(crc::mismatch(&file.path, name, c[name], got)),
        _ => Ok(()),
    };
    let steps_view = optim.expect(&optim_st, STEPS_TENSOR, Dtype::U64, &[tier.len()])?;
    check(&optim, &optim_crcs, STEPS_TENSOR, crc32(steps_view.data()))?;
    let steps: Vec<u64> = steps_view
        .data()
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8-byte chunk")))
        .collect();

    // Copy pass, each tensor's CRC taken from the bytes as they are copied.
    // A layer is finished (step, transport copy, pages handed back) as soon
    // as its tensors are in. A rank of a sharded optimizer copies only its
    // range of m and v (its parameters go whole into the transport copy),
    // so it never holds more than one layer's parameters beyond its share
    // and writes nothing outside its range of a spilled layer's files.
    let mut plan = plan.into_iter().peekable();
    for (l, &step) in steps.iter().enumerate() {
        let entries: Vec<_> = std::iter::from_fn(|| plan.next_if(|e| e.0 == l)).collect();
        let layer = &mut tier.layers_mut()[l];
        let own = layer.own();
        layer.fill_params(|params: &mut [f32]| {
            for (_, range, name, p, _, _) in &entries {
                let got = copy_le_f32(p.data(), &mut params[range.clone()]);
                model.release(p.data());
                check(&model, &model_crcs, name, got)?;
            }
            Ok::<(), TierError>(())
        })?;
        let parts = layer.parts_mut();
        for (_, range, name, _, m, v) in &entries {
            // The tensor's elements within this rank's range.
            let keep = own.start.clamp(range.start, range.end) - range.start
                ..own.end.clamp(range.start, range.end) - range.start;
            let (pm, pv) = (&mut parts.m[range.clone()], &mut parts.v[range.clone()]);
            for (t, dst, tensor) in [(m, pm, exp_avg_name(name)), (v, pv, exp_avg_sq_name(name))] {
                let got = copy_le_f32_part(t.data(), dst, keep.clone());
                optim.release(t.data());
                check(&optim, &optim_crcs, &tensor, got)?;
            }
        }
        layer.set_step(step);
        layer.settle()?;
    }
    meta.layer_steps = steps;
    Ok(meta)
}

/// Points `run_dir/latest` at `checkpoint` (a directory name inside
/// `run_dir`), atomically. Call after [`save_checkpoint`] returned.
pub fn write_latest(run_dir: &Path, checkpoint: &str) -> Result<()> {
    write_pointer(run_dir, LATEST_FILE, checkpoint)
}

/// The checkpoint directory `run_dir/latest` names, or `None` when the run
/// has no `latest` yet.
pub fn read_latest(run_dir: &Path) -> Result<Option<PathBuf>> {
    read_pointer(run_dir, LATEST_FILE)
}

/// Points `run_dir/<pointer>` at `checkpoint` (a directory name inside
/// `run_dir`), atomically, as [`write_latest`] does `latest`.
pub fn write_pointer(run_dir: &Path, pointer: &str, checkpoint: &str) -> Result<()> {
    let path = run_dir.join(pointer);
    check_pointer_name(&path, checkpoint)?;
    write_atomic(&path, format!("{checkpoint}\n").as_bytes())
}

/// The checkpoint directory `run_dir/<pointer>` names, or `None` where
/// there is no such pointer.
pub fn read_pointer(run_dir: &Path, pointer: &str) -> Result<Option<PathBuf>> {
    let path = run_dir.join(pointer);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TierError::Io { path, cause: e }),
    };
    let name = text.trim_end_matches('\n');
    check_pointer_name(&path, name)?;
    Ok(Some(run_dir.join(name)))
}

/// A pointer names one directory entry of the run directory: no separators,
/// no `..`, not empty.
fn check_pointer_name(path: &Path, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\n', '\0'])
        && !crate::atomic::is_temp_name(name);
    if ok {
        Ok(())
    } else {
        Err(TierError::Meta {
            file: path.to_path_buf(),
            detail: format!(
                "invalid checkpoint name {name:?} (expected a directory name in the run directory)"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::first_non_finite;

    #[test]
    fn the_first_non_finite_element_is_found_past_block_edges() {
        let mut x: Vec<f32> = (0..3 * (1 << 14) + 10).map(|i| i as f32 - 7.5).collect();
        assert_eq!(first_non_finite(&x), None);
        x[3 * (1 << 14) + 9] = f32::NEG_INFINITY;
        assert_eq!(first_non_finite(&x), Some((3 * (1 << 14) + 9, f32::NEG_INFINITY)));
        x[(1 << 14) - 1] = f32::INFINITY;
        x[2 * (1 << 14) + 3] = f32::NAN;
        assert_eq!(first_non_finite(&x), Some(((1 << 14) - 1, f32::INFINITY)));
        x[(1 << 14) - 1] = f32::MAX;
        let (i, v) = first_non_finite(&x).unwrap();
        assert!(i == 2 * (1 << 14) + 3 && v.is_nan());
        assert_eq!(first_non_finite(&[]), None);
    }
}
