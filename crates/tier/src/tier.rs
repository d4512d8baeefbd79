//! All layers' slabs, placed in RAM or on disk by a byte budget.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;

use megatrain_tensor::{ParamSpec, ParamTable};

use crate::buf::{Backing, reserved_span};
use crate::error::{Result, TierError};
use crate::report::{BytesByKind, MemoryReport};
use crate::shard::{Shard, layer_ranges, resident_block_bytes};
use crate::shared::{SharedTransport, shared_layout};
use crate::slab::{LayerSlab, TransportDType, layer_bytes};

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TierConfig {
    pub transport: TransportDType,
    /// Keep an fp32 gradient block per layer (gradient accumulation over
    /// micro-batches, exact global-norm clipping).
    pub hold_grads: bool,
    /// These layers (indices, ascending) get no gradient block even where
    /// `hold_grads` is set: their gradients stay on the device, summed
    /// there over micro-batches (the trainer's carried layers).
    pub grads_on_device: Vec<usize>,
    /// Most bytes of RAM the tier may reserve, transport copies included.
    /// `None`: everything in RAM.
    pub ram_budget_bytes: Option<u64>,
    /// Where spilled layers' memory-mapped files go. Needed only when the
    /// budget is smaller than the model.
    pub spill_dir: Option<PathBuf>,
    /// This process is one rank of a sharded optimizer: it keeps only its
    /// range of every RAM layer's p, m and v resident, and the budget
    /// counts the largest rank's share of them (the same placement on
    /// every rank). `None`: whole layers.
    pub shard: Option<Shard>,
    /// The transport copies are one file the machine's ranks map together
    /// ([`crate::shared`]), and the budget counts this rank's share of
    /// them. `None`: a copy of its own.
    pub shared_transport: Option<SharedTransport>,
}

impl TierConfig {
    /// Whether layer `i` gets a gradient block.
    pub fn holds_grads(&self, i: usize) -> bool {
        self.hold_grads && self.grads_on_device.binary_search(&i).is_err()
    }

    /// The transport copies' bytes this rank counts: all of them, or its
    /// share of a machine's.
    fn transport_share(&self, bytes: u64) -> u64 {
        match &self.shared_transport {
            Some(s) => bytes.div_ceil(s.local.max(1) as u64),
            None => bytes,
        }
    }
}

/// Decides placement and counts bytes without allocating anything.
///
/// Transport copies always stay in RAM (they are read by every forward and
/// backward upload; p, m, v and gradients are touched once per step by the
/// optimizer, sequentially, which suits a memory-mapped file). Layers keep
/// their p/m/v (and gradients) in RAM in order until the next layer would
/// exceed the budget; that layer and all later ones spill. A prefix rule
/// keeps placement predictable: which layers are on disk depends only on
/// the budget, never on layer sizes further along. With a sharded
/// optimizer a layer in RAM counts the largest rank's share of its p, m
/// and v (held gradients stay whole); a spilled layer's files hold the
/// rank's range; transport copies a machine shares count its share.
pub fn plan(tables: &[ParamTable], config: &TierConfig) -> Result<MemoryReport> {
    let per_layer: Vec<BytesByKind> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| layer_bytes(t.numel(), config.transport, config.holds_grads(i)))
        .collect();
    let ranks = config.shard.map_or(1, |s| s.ranks);
    let mut report = MemoryReport {
        n_params: tables.iter().map(|t| t.numel() as u64).sum(),
        n_layers: tables.len(),
        ..MemoryReport::default()
    };
    report.ram.transport = config.transport_share(per_layer.iter().map(|b| b.transport).sum());
    let budget = config.ram_budget_bytes.unwrap_or(u64::MAX);
    if report.ram.transport > budget {
        return Err(TierError::TransportOverBudget {
            needed: report.ram.transport,
            budget,
        });
    }
    for (i, (b, t)) in per_layer.iter().zip(tables).enumerate() {
        let movable = BytesByKind { transport: 0, ..*b };
        let resident = resident_share(movable, t.numel(), ranks);
        let fits = report.first_spilled.is_none() && report.ram.total() + resident.total() <= budget;
        if fits {
            report.ram += resident;
        } else {
            report.first_spilled.get_or_insert(i);
            let (_, reserved) = shard_of(t.numel(), true, config.shard);
            report.disk += spilled_bytes(movable, reserved, t.numel());
        }
    }
    if report.first_spilled.is_some() && config.spill_dir.is_none() {
        return Err(TierError::BudgetExceeded {
            needed: report.ram.total() + report.disk.total(),
            budget,
            detail: format!(
                "no spill directory; layers {}.. do not fit",
                report.first_spilled.unwrap_or(0)
            ),
        });
    }
    Ok(report)
}

/// Opens the file of a machine's shared transport copies, checking that it
/// was made for these layers, and each layer's offset in it.
fn open_shared(
    s: &SharedTransport,
    tables: &[ParamTable],
    config: &TierConfig,
) -> Result<(std::fs::File, Vec<u64>)> {
    let bad = |detail: String| TierError::Shared {
        path: s.path.clone(),
        detail,
    };
    if let Some(sh) = config.shard.filter(|sh| sh.ranks != s.ranks) {
        return Err(bad(format!(
            "cut for {} ranks, but the optimizer is sharded over {}",
            s.ranks, sh.ranks
        )));
    }
    if let Some(&r) = s.writes.iter().find(|&&r| r >= s.ranks) {
        return Err(bad(format!("rank {r} of {} ranks", s.ranks)));
    }
    let file = match &s.file {
        Some(f) => f.try_clone(),
        None => std::fs::OpenOptions::new().read(true).write(true).open(&s.path),
    }
    .map_err(|e| TierError::io(&s.path, e))?;
    let (offsets, bytes) = shared_layout(tables, config.transport);
    let got = file.metadata().map_err(|e| TierError::io(&s.path, e))?.len();
    if got != bytes {
        return Err(bad(format!(
            "{got} bytes, but this model's {} copies need {bytes}",
            config.transport
        )));
    }
    Ok((file, offsets))
}

/// The elements of a layer of `n` elements that a rank keeps (its range)
/// and that its spill files hold: its range too where the layer is spilled
/// (rank 0 gathers a spilled layer for a checkpoint into RAM, one layer at
/// a time), else the whole layer.
fn shard_of(n: usize, spilled: bool, shard: Option<Shard>) -> (Range<usize>, Range<usize>) {
    let Some(sh) = shard else { return (0..n, 0..n) };
    let own = layer_ranges(n, spilled, sh.ranks)[sh.rank].clone();
    let reserved = if spilled { own.clone() } else { 0..n };
    (own, reserved)
}

/// Bytes of a spilled layer's p, m and v files that hold blocks: the pages
/// of elements `reserved` of each.
fn spilled_bytes(b: BytesByKind, reserved: Range<usize>, numel: usize) -> BytesByKind {
    let span = reserved_span(numel, 4, reserved);
    let block = span.end - span.start;
    BytesByKind {
        params: block,
        moments: 2 * block,
        ..b
    }
}

/// What a RAM layer whose p, m, v bytes are `b` keeps resident on the
/// busiest of `ranks` ranks of a sharded optimizer.
fn resident_share(b: BytesByKind, numel: usize, ranks: usize) -> BytesByKind {
    if ranks <= 1 {
        return b;
    }
    let block = resident_block_bytes(numel, ranks);
    BytesByKind {
        params: block,
        moments: 2 * block,
        ..b
    }
}

/// The host tier: one [`LayerSlab`] per layer.
#[derive(Debug)]
pub struct HostTier {
    config: TierConfig,
    layers: Vec<LayerSlab>,
    /// Parameter name → layer index.
    index: HashMap<String, usize>,
    /// The spill directory, when this tier created it (removed on drop if
    /// empty).
    created_dir: Option<PathBuf>,
    /// Only the transport copies are kept ([`HostTier::keep_transport_only`]).
    transport_only: bool,
}

impl HostTier {
    /// Allocates every layer's slab (zeroed: fill params before use, then
    /// [`HostTier::refresh_all_transport`]). Parameter names must be unique
    /// across layers, since checkpoints key tensors by name.
    pub fn new(tables: Vec<ParamTable>, config: TierConfig) -> Result<Self> {
        let mut index = HashMap::new();
        for (l, t) in tables.iter().enumerate() {
            for p in t.iter() {
                if let Some(first) = index.insert(p.name.clone(), l) {
                    return Err(TierError::DuplicateParam {
                        name: p.name.clone(),
                        first,
                        second: l,
                    });
                }
            }
        }
        let report = plan(&tables, &config)?;
        let shared = match &config.shared_transport {
            Some(s) => Some((s, open_shared(s, &tables, &config)?)),
            None => None,
        };
        let spill = config.spill_dir.clone().map(Backing::Disk);
        let mut created_dir = None;
        if let (Some(dir), Some(_)) = (&config.spill_dir, report.first_spilled)
            && !dir.is_dir()
        {
            std::fs::create_dir_all(dir).map_err(|e| TierError::io(dir, e))?;
            created_dir = Some(dir.clone());
        }
        let mut layers = Vec::with_capacity(tables.len());
        for (i, table) in tables.into_iter().enumerate() {
            let backing = match (&spill, report.first_spilled) {
                (Some(disk), Some(f)) if i >= f => disk,
                _ => &Backing::Ram,
            };
            let n = table.numel();
            let (own, reserved) = shard_of(n, matches!(backing, Backing::Disk(_)), config.shard);
            let spilled = matches!(backing, Backing::Disk(_));
            let slab = LayerSlab::new_shard(
                i,
                table,
                config.transport,
                config.holds_grads(i),
                backing,
                own,
                reserved,
            )
            .and_then(|mut slab| {
                if let Some((s, (file, offsets))) = &shared {
                    let writes = s.layer_writes(n, spilled);
                    slab.share_transport(file, offsets[i], &s.path, writes)?;
                }
                Ok(slab)
            });
            match slab {
                Ok(s) => layers.push(s),
                Err(e) => {
                    drop(layers);
                    if let Some(d) = &created_dir {
                        let _ = std::fs::remove_dir(d);
                    }
                    return Err(e);
                }
            }
        }
        Ok(HostTier {
            config,
            layers,
            index,
            created_dir,
            transport_only: false,
        })
    }

    pub fn config(&self) -> &TierConfig {
        &self.config
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    pub fn n_params(&self) -> u64 {
        self.layers.iter().map(|l| l.numel() as u64).sum()
    }

    pub fn layers(&self) -> &[LayerSlab] {
        &self.layers
    }

    /// Names each layer's elements in checkpoint files by `files` (one
    /// table per layer; see [`LayerSlab::set_file_table`]).
    pub fn set_file_tables(&mut self, files: Vec<ParamTable>) -> Result<()> {
        if files.len() != self.layers.len() {
            return Err(TierError::FileTables {
                got: files.len(),
                layers: self.layers.len(),
            });
        }
        for (slab, file) in self.layers.iter_mut().zip(files) {
            slab.set_file_table(file)?;
        }
        Ok(())
    }

    /// Mutable slabs; disjoint borrows of several layers (e.g. one updated
    /// by the optimizer while another is uploaded) via `split_at_mut`.
    pub fn layers_mut(&mut self) -> &mut [LayerSlab] {
        &mut self.layers
    }

    pub fn layer(&self, i: usize) -> Result<&LayerSlab> {
        let len = self.layers.len();
        self.layers
            .get(i)
            .ok_or(TierError::LayerOutOfRange { index: i, len })
    }

    pub fn layer_mut(&mut self, i: usize) -> Result<&mut LayerSlab> {
        let len = self.layers.len();
        self.layers
            .get_mut(i)
            .ok_or(TierError::LayerOutOfRange { index: i, len })
    }

    /// The layer holding a named parameter, and its spec.
    pub fn find_param(&self, name: &str) -> Option<(usize, &ParamSpec)> {
        let &l = self.index.get(name)?;
        Some((l, self.layers[l].table().get(name)?))
    }

    /// The spilled layers' files in the order the optimizer meets them
    /// in a streamed step: last layer first.
    pub fn spilled_backward(&self) -> Vec<crate::SpilledLayer> {
        self.layers.iter().rev().filter_map(LayerSlab::spilled).collect()
    }

    /// Whether any layer is on disk.
    pub fn has_spill(&self) -> bool {
        self.layers.iter().any(LayerSlab::is_spilled)
    }

    pub fn refresh_all_transport(&mut self) {
        self.layers.iter_mut().for_each(LayerSlab::refresh_transport);
    }

    /// Keeps the transport copies alone: every layer's fp32 params and
    /// moments hand their pages back, so a tier read only through its
    /// copies (an evaluation, generation) holds those bytes and no more:
    /// 2 a parameter with bf16 transport instead of 6 (and its moments,
    /// never written, were never resident). The params read as zeros from
    /// then on, so a checkpoint of the tier is refused
    /// ([`TierError::TransportOnly`]), as is a training step.
    pub fn keep_transport_only(&mut self) -> Result<()> {
        for slab in &mut self.layers {
            slab.release_outside(0..0)?;
        }
        self.transport_only = true;
        Ok(())
    }

    /// Whether [`HostTier::keep_transport_only`] was called.
    pub fn is_transport_only(&self) -> bool {
        self.transport_only
    }

    /// Refuses `what` on a tier that keeps its transport copies alone.
    pub(crate) fn need_params(&self, what: &'static str) -> Result<()> {
        match self.transport_only {
            true => Err(TierError::TransportOnly { what }),
            false => Ok(()),
        }
    }

    /// Bytes actually reserved, by kind and place.
    pub fn report(&self) -> MemoryReport {
        let mut r = MemoryReport {
            n_params: self.n_params(),
            n_layers: self.layers.len(),
            ..MemoryReport::default()
        };
        let ranks = self.config.shard.map_or(1, |s| s.ranks);
        for l in &self.layers {
            let (ram, disk) = l.bytes();
            r.ram += match l.is_spilled() {
                true => ram,
                false => resident_share(ram, l.numel(), ranks),
            };
            r.disk += disk;
            if l.is_spilled() && r.first_spilled.is_none() {
                r.first_spilled = Some(l.index());
            }
        }
        r.ram.transport = self.config.transport_share(r.ram.transport);
        r
    }
}

impl Drop for HostTier {
    fn drop(&mut self) {
        self.layers.clear();
        if let Some(d) = self.created_dir.take() {
            // Only succeeds when empty: never removes someone else's files.
            let _ = std::fs::remove_dir(d);
        }
    }
}
