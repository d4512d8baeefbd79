//! Reading Hugging Face safetensors checkpoints into per-layer fp32 slabs.
//!
//! Files are memory-mapped and each tensor is converted straight from the
//! mapping into its place in the layer's slab, so loading never holds a
//! second full copy of the model; a trainer can load one layer at a time
//! with [`HfCheckpoint::read_layer_into`].

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use megatrain_tensor::{ParamSpec, ParamTable, release_mapped};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};
use serde_json::Value;

use crate::{Arch, ModelConfig, Result, ZooError, mxfp4};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

struct Shard {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// An opened checkpoint directory: `config.json` plus `model.safetensors` or
/// the shards listed in `model.safetensors.index.json`.
pub struct HfCheckpoint {
    pub config: ModelConfig,
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name → shard.
    where_: HashMap<String, usize>,
}

/// A whole model in memory: one fp32 slab per layer, laid out by its table.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    pub config: ModelConfig,
    pub tables: Vec<ParamTable>,
    pub slabs: Vec<Vec<f32>>,
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = File::open(path).map_err(|e| ZooError::io(path, e))?;
    // SAFETY: the mapping is read-only; a checkpoint modified by another
    // process while we read it is outside what we can defend against.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| ZooError::io(path, e))?;
    let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| describe_bad_file(path, &map, e))?;
    let tensors = meta.tensors().into_iter().map(|(k, v)| (k, v.clone())).collect();
    Ok(Shard {
        path: path.to_path_buf(),
        data_start: 8 + n,
        map,
        tensors,
    })
}

/// Names the first tensor whose bytes lie past the end of a truncated file.
fn describe_bad_file(path: &Path, buf: &[u8], err: safetensors::SafeTensorError) -> ZooError {
    let mut detail = format!("{err}");
    if let Some(header_len) = buf
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        && let Some(header) = buf.get(8..8usize.saturating_add(header_len))
        && let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(header)
    {
        let available = buf.len() - 8 - header_len;
        let mut past: Vec<(u64, &str)> = m
            .iter()
            .filter_map(|(name, v)| {
                let end = v.get("data_offsets")?.get(1)?.as_u64()?;
                (end as usize > available).then_some((end, name.as_str()))
            })
            .collect();
        past.sort();
        if let Some((end, name)) = past.first() {
            detail = format!(
                "truncated: tensor '{name}' ends at data byte {end} but the file holds only {available} \
                 data bytes ({} tensors affected)",
                past.len()
            );
        }
    } else if buf.len() < 8 {
        detail = format!(
            "truncated: {} bytes, shorter than the 8-byte header length",
            buf.len()
        );
    }
    ZooError::Safetensors {
        file: path.to_path_buf(),
        detail,
    }
}

impl HfCheckpoint {
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_dir(dir)?;
        let index_path = dir.join(INDEX_FILE);
        let mut shards = Vec::new();
        let mut where_ = HashMap::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ZooError::io(&index_path, e))?;
            let index: Value = serde_json::from_str(&text).map_err(|cause| ZooError::Json {
                path: index_path.clone(),
                cause,
            })?;
            let map = index
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ZooError::MissingField {
                    path: index_path.clone(),
                    field: "weight_map",
                })?;
            let mut file_ids: HashMap<&str, usize> = HashMap::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| ZooError::BadField {
                    path: index_path.clone(),
                    field: format!("weight_map.{tensor}"),
                    detail: format!("expected a file name, got {file}"),
                })?;
                if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                    return Err(ZooError::BadField {
                        path: index_path.clone(),
                        field: format!("weight_map.{tensor}"),
                        detail: format!("'{file}' is not a plain file name"),
                    });
                }
                let id = match file_ids.get(file) {
                    Some(&id) => id,
                    None => {
                        shards.push(open_shard(&dir.join(file))?);
                        file_ids.insert(file, shards.len() - 1);
                        shards.len() - 1
                    }
                };
                where_.insert(tensor.clone(), id);
            }
        } else {
            let shard = open_shard(&dir.join(SINGLE_FILE))?;
            where_ = shard.tensors.keys().map(|k| (k.clone(), 0)).collect();
            shards.push(shard);
        }
        Ok(HfCheckpoint {
            config,
            dir: dir.to_path_buf(),
            shards,
            where_,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file a missing tensor was expected in, for error messages.
    fn expected_file(&self) -> PathBuf {
        if self.shards.len() == 1 && !self.dir.join(INDEX_FILE).exists() {
            self.shards[0].path.clone()
        } else {
            self.dir.join(INDEX_FILE)
        }
    }

    /// The names a tensor may have in this checkpoint: its HF name; for
    /// GPT-2 also without the `transformer.` prefix (the original OpenAI
    /// conversion); for a multimodal model's text stack, its places in the
    /// multimodal checkpoint.
    fn candidates(&self, name: &str) -> Vec<String> {
        if self.config.text_of.is_some() {
            return crate::config::checkpoint_names(name);
        }
        let mut candidates = vec![name.to_string()];
        if let Some(stripped) = name.strip_prefix("transformer.") {
            candidates.push(stripped.to_string());
        }
        candidates
    }

    /// The tensor, its shard and the name it has there.
    fn find(&self, name: &str) -> Option<(&Shard, &TensorInfo, String)> {
        self.candidates(name).into_iter().find_map(|n| {
            let shard = &self.shards[*self.where_.get(&n)?];
            shard.tensors.get(&n).map(|info| (shard, info, n))
        })
    }

    /// Reads one tensor into `out` (fp32, `spec.numel()` elements).
    pub fn read_tensor_into(&self, spec: &ParamSpec, out: &mut [f32]) -> Result<()> {
        let (shard, info, tensor) = match self.find(&spec.name) {
            Some(found) => found,
            None if self.config.arch == Arch::GptOss
                && self.find(&format!("{}_blocks", spec.name)).is_some() =>
            {
                return self.read_mxfp4_into(spec, out);
            }
            None => {
                // Named as the checkpoint would hold it.
                let tensor = self.candidates(&spec.name).swap_remove(0);
                let file = self
                    .where_
                    .get(&tensor)
                    .map(|&i| self.shards[i].path.clone())
                    .unwrap_or_else(|| self.expected_file());
                return Err(ZooError::MissingTensor { file, tensor });
            }
        };
        if info.shape != spec.shape.dims() {
            return Err(ZooError::TensorShape {
                file: shard.path.clone(),
                tensor,
                expected: spec.shape.dims().to_vec(),
                got: info.shape.clone(),
            });
        }
        let bytes =
            &shard.map[shard.data_start + info.data_offsets.0..shard.data_start + info.data_offsets.1];
        let n = spec.numel();
        debug_assert_eq!(out.len(), n);
        match info.dtype {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes(b.try_into().expect("2 bytes"))).to_f32();
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes(b.try_into().expect("2 bytes"))).to_f32();
                }
            }
            other => {
                return Err(ZooError::TensorDType {
                    file: shard.path.clone(),
                    tensor,
                    got: format!("{other:?}"),
                });
            }
        }
        // The pages read go back: a model is read once, into a tier or
        // the executor, and mapped pages count as resident until then.
        release_mapped(&shard.map, bytes);
        Ok(())
    }

    /// GPT-OSS's expert tensor `spec` (`[E, C, R]`) from its MXFP4
    /// `_blocks` and `_scales` ([`crate::mxfp4`]).
    fn read_mxfp4_into(&self, spec: &ParamSpec, out: &mut [f32]) -> Result<()> {
        let dims = spec.shape.dims();
        let [e, c, r] = *dims else {
            return Err(ZooError::invalid(
                "read_mxfp4_into",
                format!(
                    "'{}' {:?} is not an experts' [E, in, out] tensor",
                    spec.name, dims
                ),
            ));
        };
        let g = c / mxfp4::BLOCK;
        let mut parts = Vec::new();
        for (suffix, shapes) in [
            ("_blocks", vec![vec![e, r, g, 16], vec![e, r, c / 2]]),
            ("_scales", vec![vec![e, r, g]]),
        ] {
            let (shard, info, tensor) =
                self.find(&format!("{}{suffix}", spec.name))
                    .ok_or_else(|| ZooError::MissingTensor {
                        file: self.expected_file(),
                        tensor: format!("{}{suffix}", spec.name),
                    })?;
            if info.dtype != Dtype::U8 {
                return Err(ZooError::TensorDType {
                    file: shard.path.clone(),
                    tensor,
                    got: format!("{:?} (MXFP4 parts are U8)", info.dtype),
                });
            }
            if !c.is_multiple_of(mxfp4::BLOCK) || !shapes.contains(&info.shape) {
                return Err(ZooError::TensorShape {
                    file: shard.path.clone(),
                    tensor,
                    expected: shapes[0].clone(),
                    got: info.shape.clone(),
                });
            }
            parts.push(
                &shard.map[shard.data_start + info.data_offsets.0..shard.data_start + info.data_offsets.1],
            );
        }
        mxfp4::widen_into(parts[0], parts[1], [e, r, c], out);
        Ok(())
    }

    /// Fills one layer's slab, laid out by `table`, from the checkpoint's
    /// tensors ([`ModelConfig::hf_table`]).
    pub fn read_layer_into(&self, table: &ParamTable, slab: &mut [f32]) -> Result<()> {
        if slab.len() != table.numel() {
            return Err(ZooError::invalid(
                "read_layer_into",
                format!(
                    "slab holds {} elements, table needs {}",
                    slab.len(),
                    table.numel()
                ),
            ));
        }
        for spec in self.config.hf_table(table).iter() {
            self.read_tensor_into(spec, &mut slab[spec.range()])?;
        }
        Ok(())
    }

    pub fn read_layer(&self, layer: usize) -> Result<(ParamTable, Vec<f32>)> {
        let table = self.config.layer_table(layer)?;
        let mut slab = vec![0.0; table.numel()];
        self.read_layer_into(&table, &mut slab)?;
        Ok((table, slab))
    }

    /// Loads every layer.
    pub fn load(&self) -> Result<LoadedModel> {
        let mut tables = Vec::new();
        let mut slabs = Vec::new();
        for layer in 0..self.config.num_layers_total() {
            let (t, s) = self.read_layer(layer)?;
            tables.push(t);
            slabs.push(s);
        }
        Ok(LoadedModel {
            config: self.config.clone(),
            tables,
            slabs,
        })
    }
}

/// Opens `dir` and loads the whole model.
pub fn load_hf_dir(dir: impl AsRef<Path>) -> Result<LoadedModel> {
    HfCheckpoint::open(dir)?.load()
}
