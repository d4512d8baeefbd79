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

/// Writes the safetensors file `src` again as `dst` (atomically) with its
/// f32 tensors stored as `dtype`, rounded to nearest even, and any others
/// as they are: one tensor in memory at a time, so a model larger than
/// RAM converts from its map. The metadata is kept.
pub fn narrow_safetensors(src: &Path, dst: &Path, dtype: DType) -> Result<()> {
    let file = std::fs::File::open(src).map_err(|e| ZooError::io(src, e))?;
    // SAFETY: read only; a checkpoint changed by another process while it
    // is read is outside what we can defend against (as when loading).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ZooError::io(src, e))?;
    let bad = |e: safetensors::SafeTensorError| ZooError::Safetensors {
        file: src.to_path_buf(),
        detail: e.to_string(),
    };
    let (_, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(bad)?;
    let st = safetensors::SafeTensors::deserialize(&map).map_err(bad)?;
    let views: Vec<(String, Narrowed<'_>)> = st
        .iter()
        .map(|(name, view)| (name.to_string(), Narrowed { view, to: dtype }))
        .collect();
    let tmp = tmp_name(dst);
    safetensors::serialize_to_file(views, meta.metadata().clone(), &tmp).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ZooError::Safetensors {
            file: tmp.clone(),
            detail: e.to_string(),
        }
    })?;
    // Readable as the source is (the writer makes its file private).
    let mode = file.metadata().map_err(|e| ZooError::io(src, e))?.permissions();
    std::fs::set_permissions(&tmp, mode).map_err(|e| ZooError::io(&tmp, e))?;
    finish_atomic(&tmp, dst)
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

    // Group whole layers into shards.
    let elem = opts.dtype.size_in_bytes() as u64;
    let mut groups: Vec<Vec<usize>> = vec![vec![]];
    let mut group_bytes = 0u64;
    for (l, t) in tables.iter().enumerate() {
        let bytes = t.numel() as u64 * elem;
        if let Some(max) = opts.max_shard_bytes
            && group_bytes > 0
            && group_bytes + bytes > max
        {
            groups.push(vec![]);
            group_bytes = 0;
        }
        groups.last_mut().expect("non-empty").push(l);
        group_bytes += bytes;
    }

    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (gi, layers) in groups.iter().enumerate() {
        let file = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", gi + 1, n)
        };
        let mut tensors = Vec::new();
        for &l in layers {
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
    let index_path = dir.join(INDEX_FILE);
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_atomic(
            &index_path,
            serde_json::to_string_pretty(&index).expect("json").as_bytes(),
        )?;
    } else if index_path.exists() {
        // A stale index would make loaders ignore the single file.
        std::fs::remove_file(&index_path).map_err(|e| ZooError::io(&index_path, e))?;
    }
    let cfg = config.to_hf_json(hf_dtype(opts.dtype));
    write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&cfg).expect("json").as_bytes(),
    )
}
