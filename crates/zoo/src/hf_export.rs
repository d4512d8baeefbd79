//! Writing Hugging Face checkpoint directories that `transformers` loads:
//! `config.json` and `model.safetensors` (or shards plus
//! `model.safetensors.index.json`) with HF names, shapes and layouts. Slabs
//! already hold HF layouts (GPT-2 `Conv1D` weights `[in, out]`), so f32
//! tensors are written straight from the slabs without a copy.
//!
//! Every file goes to a temporary name in the target directory, is synced,
//! then renamed.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use megatrain_tensor::{DType, ParamTable, convert};
use safetensors::tensor::{Dtype, View};
use serde_json::json;

use crate::hf_load::{INDEX_FILE, SINGLE_FILE};
use crate::{ModelConfig, Result, ZooError};

#[cfg(target_endian = "big")]
compile_error!("safetensors export writes host-order floats and assumes little-endian");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// Stored dtype of every tensor (rounded to nearest even when narrower).
    pub dtype: DType,
    /// Start a new shard once one reaches this many bytes (whole layers per
    /// shard); `None` writes one `model.safetensors`.
    pub max_shard_bytes: Option<u64>,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: DType::F32,
            max_shard_bytes: None,
        }
    }
}

struct TensorOut<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
}

impl View for TensorOut<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The name `config.json` gives a dtype (`torch_dtype` / `dtype`).
pub fn hf_dtype(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
    }
}

fn tensor_out<'a>(values: &'a [f32], shape: &[usize], dtype: DType) -> TensorOut<'a> {
    let (dtype, data) = match dtype {
        DType::F32 => (Dtype::F32, Cow::Borrowed(bytemuck::cast_slice(values))),
        DType::BF16 => (
            Dtype::BF16,
            Cow::Owned(bytemuck::cast_slice(&convert::f32_to_bf16(values)).to_vec()),
        ),
        DType::F16 => (
            Dtype::F16,
            Cow::Owned(bytemuck::cast_slice(&convert::f32_to_f16(values)).to_vec()),
        ),
    };
    TensorOut {
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// Writes `bytes` to `path` atomically (temp file, fsync, rename).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_name(path);
    std::fs::write(&tmp, bytes).map_err(|e| ZooError::io(&tmp, e))?;
    finish_atomic(&tmp, path)
}

fn tmp_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn finish_atomic(tmp: &Path, path: &Path) -> Result<()> {
    let f = std::fs::File::open(tmp).map_err(|e| ZooError::io(tmp, e))?;
    f.sync_all().map_err(|e| ZooError::io(tmp, e))?;
    std::fs::rename(tmp, path).map_err(|e| ZooError::io(path, e))
}

fn write_safetensors(path: &Path, tensors: Vec<(String, TensorOut<'_>)>) -> Result<()> {
    let tmp = tmp_name(path);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(meta), &tmp).map_err(|e| ZooError::Safetensors {
        file: tmp.clone(),
        detail: e.to_string(),
    })?;
    finish_atomic(&tmp, path)
}

/// A tensor of a mapped safetensors file as it is written again: an f32
/// one narrowed to `to` as it is written, any other as it is.
struct Narrowed<'a> {
    view: safetensors::tensor::TensorView<'a>,
    to: DType,
}

impl Narrowed<'_> {
    fn narrows(&self) -> bool {
        self.view.dtype() == Dtype::F32 && self.to != DType::F32
    }
}

impl View for Narrowed<'_> {
    fn dtype(&self) -> Dtype {
        match (self.narrows(), self.to) {
            (true, DType::BF16) => Dtype::BF16,
            (true, DType::F16) => Dtype::F16,
            _ => self.view.dtype(),
        }
    }
    fn shape(&self) -> &[usize] {
        self.view.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        if !self.narrows() {
            return Cow::Borrowed(self.view.data());
        }
        // The map's bytes need not be 4-aligned for a cast: read them whole.
        let values: Vec<f32> = self
            .view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        tensor_out(&values, self.view.shape(), self.to)
            .data
            .into_owned()
            .into()
    }
    fn data_len(&self) -> usize {
        match self.narrows() {
            true => self.view.data().len() / 4 * self.to.size_in_bytes(),
            false => self.view.data().len(),
        }
    }
}

/// A safetensors file's `__metadata__`.
type Metadata = Option<HashMap<String, String>>;

/// A safetensors file mapped for reading.
struct Mapped {
    path: PathBuf,
    file: std::fs::File,
    map: memmap2::Mmap,
}

impl Mapped {
    fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| ZooError::io(path, e))?;
        // SAFETY: read only; a checkpoint changed by another process while
        // it is read is outside what we can defend against (as when loading).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ZooError::io(path, e))?;
        Ok(Mapped {
            path: path.to_path_buf(),
            file,
            map,
        })
    }

    /// Its tensors in the order of their data (a checkpoint's layer order),
    /// each to be narrowed to `to`, and its metadata.
    fn tensors(&self, to: DType) -> Result<(Vec<(String, Narrowed<'_>)>, Metadata)> {
        let bad = |e: safetensors::SafeTensorError| ZooError::Safetensors {
            file: self.path.clone(),
            detail: e.to_string(),
        };
        let (_, meta) = safetensors::SafeTensors::read_metadata(&self.map).map_err(bad)?;
        let st = safetensors::SafeTensors::deserialize(&self.map).map_err(bad)?;
        let views = meta
            .offset_keys()
            .into_iter()
            .map(|name| {
                let view = st.tensor(&name).map_err(bad)?;
                Ok((name, Narrowed { view, to }))
            })
            .collect::<Result<_>>()?;
        Ok((views, meta.metadata().clone()))
    }

    /// Writes `views` to `dst` atomically.
    fn write(&self, views: Vec<(String, Narrowed<'_>)>, meta: Metadata, dst: &Path) -> Result<()> {
        let tmp = tmp_name(dst);
        safetensors::serialize_to_file(views, meta, &tmp).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            ZooError::Safetensors {
                file: tmp.clone(),
                detail: e.to_string(),
            }
        })?;
        self.persist(&tmp, dst)
    }

    /// Copies the file as it is to `dst` atomically, read through the open
    /// handle: its path may already have been removed.
    fn copy(&self, dst: &Path) -> Result<()> {
        let tmp = tmp_name(dst);
        let copied = std::fs::File::create(&tmp).and_then(|mut to| std::io::copy(&mut &self.file, &mut to));
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&tmp);
            return Err(ZooError::io(&tmp, e));
        }
        self.persist(&tmp, dst)
    }

    /// Renames `tmp` to `dst` readable as the source is (the safetensors
    /// writer makes its file private).
    fn persist(&self, tmp: &Path, dst: &Path) -> Result<()> {
        let mode = self
            .file
            .metadata()
            .map_err(|e| ZooError::io(&self.path, e))?
            .permissions();
        std::fs::set_permissions(tmp, mode).map_err(|e| ZooError::io(tmp, e))?;
        finish_atomic(tmp, dst)
    }
}

/// Writes the safetensors file `src` again as `dst` (atomically) with its
/// f32 tensors stored as `dtype`, rounded to nearest even, and any others
/// as they are: one tensor in memory at a time, so a model larger than
/// RAM converts from its map. The metadata is kept.
pub fn narrow_safetensors(src: &Path, dst: &Path, dtype: DType) -> Result<()> {
    let mapped = Mapped::open(src)?;
    let (views, meta) = mapped.tensors(dtype)?;
    mapped.write(views, meta, dst)
}

/// Writes the safetensors file `src` into `out_dir` as a Hugging Face
/// model's weights, narrowed as [`narrow_safetensors`] does: in shards of at
/// most `max_shard_bytes` of tensor data (a larger tensor alone in its own;
/// tensors in `src`'s order, so a checkpoint's layers stay together) plus
/// `model.safetensors.index.json`, or, with `None` or when all fits one,
/// as `model.safetensors`. Weight files of an earlier export that a loader
/// would mistake for this one are removed first, and the index is written
/// last, so an interrupted export does not load. Returns the files
/// written, the index last.
pub fn reshard_safetensors(
    src: &Path,
    out_dir: &Path,
    dtype: DType,
    max_shard_bytes: Option<u64>,
) -> Result<Vec<PathBuf>> {
    // Mapped before anything is removed: `src` may be in `out_dir`.
    let mapped = Mapped::open(src)?;
    let (views, meta) = mapped.tensors(dtype)?;
    let groups = group_shards(views.iter().map(|(_, v)| v.data_len() as u64), max_shard_bytes);
    std::fs::create_dir_all(out_dir).map_err(|e| ZooError::io(out_dir, e))?;
    remove_stale_weights(out_dir, groups.len() > 1)?;
    if groups.len() == 1 && dtype == DType::F32 {
        // Nothing to narrow: the same tensors and metadata, so the same bytes.
        let dst = out_dir.join(SINGLE_FILE);
        mapped.copy(&dst)?;
        return Ok(vec![dst]);
    }
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    let mut written = Vec::new();
    let mut views = views.into_iter();
    for (i, group) in groups.iter().enumerate() {
        let file = shard_file(i, n);
        let shard: Vec<_> = views.by_ref().take(group.len()).collect();
        for (name, view) in &shard {
            weight_map.insert(name.clone(), file.clone());
            total += view.data_len() as u64;
        }
        let path = out_dir.join(&file);
        mapped.write(shard, meta.clone(), &path)?;
        written.push(path);
    }
    if let Some(index) = write_index(out_dir, n, total, &weight_map)? {
        written.push(index);
    }
    Ok(written)
}

/// Splits tensors (or layers) of `bytes` each, in order, into shards of at
/// most `max` bytes; one larger than `max` gets a shard of its own.
fn group_shards(bytes: impl IntoIterator<Item = u64>, max: Option<u64>) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut group_bytes = 0u64;
    for (i, b) in bytes.into_iter().enumerate() {
        match groups.last_mut() {
            Some(g) if group_bytes == 0 || max.is_none_or(|max| group_bytes + b <= max) => g.end = i + 1,
            _ => {
                groups.push(i..i + 1);
                group_bytes = 0;
            }
        }
        group_bytes += b;
    }
    if groups.is_empty() {
        groups.push(0..0);
    }
    groups
}

/// The name of shard `i` of `n`, as transformers names them.
fn shard_file(i: usize, n: usize) -> String {
    if n == 1 {
        SINGLE_FILE.to_string()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
    }
}

/// Whether `name` is a shard's name (`model-00001-of-00004.safetensors`).
fn is_shard_file(name: &str) -> bool {
    let five_digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .and_then(|r| r.split_once("-of-"))
        .is_some_and(|(i, n)| five_digits(i) && five_digits(n))
}

/// Removes the weight files of an earlier export from `dir` before new
/// ones are written: its index (loaders read it before a single file, and
/// beside new shards of the same names it would load a mix), its shards
/// (of another count they would linger), and for `sharded` its single
/// file. Nothing else is touched.
fn remove_stale_weights(dir: &Path, sharded: bool) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| ZooError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ZooError::io(dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let stale = name == INDEX_FILE || is_shard_file(&name) || (sharded && name == SINGLE_FILE);
        if stale {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(|e| ZooError::io(&path, e))?;
        }
    }
    Ok(())
}

/// With `n` shards, writes the index of `weight_map` (tensor → file) and
/// `total` bytes of tensor data, once the shards are on disk; returns its
/// path. One file has no index.
fn write_index(
    dir: &Path,
    n: usize,
    total: u64,
    weight_map: &BTreeMap<String, String>,
) -> Result<Option<PathBuf>> {
    if n == 1 {
        return Ok(None);
    }
    // The shards' names in the directory before the index that names them.
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ZooError::io(dir, e))?;
    let path = dir.join(INDEX_FILE);
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_atomic(
        &path,
        serde_json::to_string_pretty(&index).expect("json").as_bytes(),
    )?;
    Ok(Some(path))
}

/// Exports a model given as per-layer slabs laid out by `tables` (one per
/// layer, as [`ModelConfig::layer_tables`] makes them).
pub fn export_hf_dir(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    tables: &[ParamTable],
    slabs: &[&[f32]],
    opts: ExportOptions,
) -> Result<()> {
    let dir = dir.as_ref();
    if tables.len() != config.num_layers_total() || slabs.len() != tables.len() {
        return Err(ZooError::invalid(
            "export_hf_dir",
            format!(
                "model has {} layers; got {} tables and {} slabs",
                config.num_layers_total(),
                tables.len(),
                slabs.len()
            ),
        ));
    }
    for (l, (t, s)) in tables.iter().zip(slabs).enumerate() {
        if t.numel() != s.len() {
            return Err(ZooError::invalid(
                "export_hf_dir",
                format!(
                    "layer {l}: slab holds {} elements, table needs {}",
                    s.len(),
                    t.numel()
                ),
            ));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| ZooError::io(dir, e))?;

    // Whole layers per shard.
    let elem = opts.dtype.size_in_bytes() as u64;
    let groups = group_shards(
        tables.iter().map(|t| t.numel() as u64 * elem),
        opts.max_shard_bytes,
    );
    let n = groups.len();
    remove_stale_weights(dir, n > 1)?;
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (gi, layers) in groups.into_iter().enumerate() {
        let file = shard_file(gi, n);
        let mut tensors = Vec::new();
        for l in layers {
            for spec in config.hf_table(&tables[l]).iter() {
                weight_map.insert(spec.name.clone(), file.clone());
                total += spec.numel() as u64 * elem;
                let values = &slabs[l][spec.range()];
                tensors.push((
                    spec.name.clone(),
                    tensor_out(values, spec.shape.dims(), opts.dtype),
                ));
            }
        }
        write_safetensors(&dir.join(&file), tensors)?;
    }
    write_index(dir, n, total, &weight_map)?;
    let cfg = config.to_hf_json(hf_dtype(opts.dtype));
    write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&cfg).expect("json").as_bytes(),
    )
}
