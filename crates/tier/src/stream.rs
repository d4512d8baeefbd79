//! A safetensors file written one tensor at a time, in an order of our
//! choosing: the header (built and serialised by the safetensors crate's
//! own [`Metadata`], so readers see exactly its format) lists every
//! tensor's offsets up front, then the tensors follow in that order. A
//! checkpoint can then be written layer by layer, and a rank that gathers
//! a sharded layer just before writing it never holds more than that
//! layer whole. Each tensor's CRC-32 is taken from the bytes it writes.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

use crate::atomic::{persist, temp_path};
use crate::crc::crc32;
use crate::error::{IoContext, Result, TierError};

/// The header's length field, and the alignment its JSON is padded to.
const N_LEN: usize = 8;

/// A tensor the file will hold: name, dtype, shape.
pub(crate) struct Planned {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// The file under construction: a temporary file beside `path`, renamed
/// to it by [`StreamFile::finish`] (removed if dropped before).
pub(crate) struct StreamFile {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    /// Names and byte lengths still to come, in order.
    order: Vec<(String, usize)>,
    next: usize,
    crcs: BTreeMap<String, u32>,
}

impl StreamFile {
    /// Creates the temporary file and writes the header for `tensors`, in
    /// that order.
    pub fn create(path: &Path, tensors: &[Planned], meta: HashMap<String, String>) -> Result<Self> {
        let mut offset = 0;
        let mut infos = Vec::with_capacity(tensors.len());
        let mut order = Vec::with_capacity(tensors.len());
        for t in tensors {
            let len = t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8;
            infos.push((
                t.name.clone(),
                TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + len),
                },
            ));
            order.push((t.name.clone(), len));
            offset += len;
        }
        let header = Metadata::new(Some(meta), infos).map_err(|e| TierError::Serialize {
            file: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        let mut json = serde_json::to_vec(&header).map_err(|e| TierError::Serialize {
            file: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        json.resize(json.len().next_multiple_of(N_LEN), b' ');
        let tmp = temp_path(path);
        let mut file = StreamFile {
            path: path.to_path_buf(),
            out: Some(BufWriter::with_capacity(
                4 << 20,
                File::create_new(&tmp).at(&tmp)?,
            )),
            tmp,
            order,
            next: 0,
            crcs: BTreeMap::new(),
        };
        file.write(&(json.len() as u64).to_le_bytes())?;
        file.write(&json)?;
        Ok(file)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let out = self.out.as_mut().expect("open until finished");
        out.write_all(bytes).map_err(|e| TierError::io(&self.path, e))
    }

    /// Writes the next tensor, which must be `name`, from its
    /// little-endian bytes.
    pub fn put(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        match self.order.get(self.next) {
            Some((n, len)) if n == name && *len == bytes.len() => {}
            other => {
                return Err(TierError::Serialize {
                    file: self.path.clone(),
                    detail: format!(
                        "tensor {name} ({} bytes) written where the header has {other:?}",
                        bytes.len()
                    ),
                });
            }
        }
        self.write(bytes)?;
        self.crcs.insert(name.to_string(), crc32(bytes));
        self.next += 1;
        Ok(())
    }

    /// Flushes, syncs and renames the file into place once every tensor is
    /// in; returns each tensor's CRC-32.
    pub fn finish(mut self) -> Result<BTreeMap<String, u32>> {
        if self.next != self.order.len() {
            return Err(TierError::Serialize {
                file: self.path.clone(),
                detail: format!("{} of {} tensors written", self.next, self.order.len()),
            });
        }
        let out = self.out.take().expect("open until finished");
        out.into_inner()
            .map_err(|e| TierError::io(&self.path, e.into_error()))?;
        persist(&self.tmp, &self.path)?;
        Ok(std::mem::take(&mut self.crcs))
    }
}

impl Drop for StreamFile {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}
