//! One layer's host state: fp32 params, AdamW `m` and `v`, the transport
//! copy, and optionally held gradients, all laid out by the layer's
//! [`ParamTable`].

use half::{bf16, f16};
use megatrain_tensor::{DType, HostRegistration, ParamSpec, ParamTable, convert};
use rayon::prelude::*;

use crate::buf::{AlignedBuf, Backing, padded_bytes};
use crate::error::{Result, TierError};
use crate::report::BytesByKind;

/// Element type of the copy that is uploaded to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportDType {
    #[default]
    F32,
    BF16,
    /// f16, rounded to nearest even, finite values beyond ±65504 saturated
    /// there (see [`convert::f32_to_f16_sat_bits`]).
    F16,
}

impl TransportDType {
    pub const fn size_in_bytes(self) -> usize {
        match self {
            TransportDType::F32 => 4,
            TransportDType::BF16 | TransportDType::F16 => 2,
        }
    }

    pub const fn dtype(self) -> DType {
        match self {
            TransportDType::F32 => DType::F32,
            TransportDType::BF16 => DType::BF16,
            TransportDType::F16 => DType::F16,
        }
    }
}

impl TryFrom<DType> for TransportDType {
    type Error = megatrain_tensor::Error;
    fn try_from(d: DType) -> Result<Self, Self::Error> {
        match d {
            DType::F32 => Ok(TransportDType::F32),
            DType::BF16 => Ok(TransportDType::BF16),
            DType::F16 => Ok(TransportDType::F16),
        }
    }
}

impl std::fmt::Display for TransportDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.dtype().fmt(f)
    }
}

impl std::str::FromStr for TransportDType {
    type Err = megatrain_tensor::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse::<DType>()?.try_into()
    }
}

/// The transport copy of a layer.
#[derive(Debug)]
pub enum Transport {
    F32(AlignedBuf<f32>),
    BF16(AlignedBuf<bf16>),
    F16(AlignedBuf<f16>),
}

/// Borrowed transport copy.
#[derive(Debug, Clone, Copy)]
pub enum TransportRef<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// Mutably borrowed transport copy (the optimizer rewrites it).
#[derive(Debug)]
pub enum TransportMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl<'a> TransportMut<'a> {
    /// The copy before element `mid` and from it, each borrowed for as
    /// long as this was (an update's disjoint pieces).
    pub fn split_at_mut(self, mid: usize) -> (TransportMut<'a>, TransportMut<'a>) {
        match self {
            TransportMut::F32(t) => {
                let (a, b) = t.split_at_mut(mid);
                (TransportMut::F32(a), TransportMut::F32(b))
            }
            TransportMut::BF16(t) => {
                let (a, b) = t.split_at_mut(mid);
                (TransportMut::BF16(a), TransportMut::BF16(b))
            }
            TransportMut::F16(t) => {
                let (a, b) = t.split_at_mut(mid);
                (TransportMut::F16(a), TransportMut::F16(b))
            }
        }
    }
}

impl TransportRef<'_> {
    /// Native-endian bytes, as the GPU upload wants them.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TransportRef::F32(s) => bytemuck::cast_slice(s),
            TransportRef::BF16(s) => bytemuck::cast_slice(s),
            TransportRef::F16(s) => bytemuck::cast_slice(s),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TransportRef::F32(s) => s.len(),
            TransportRef::BF16(s) => s.len(),
            TransportRef::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// All of a layer's blocks borrowed at once, for the fused optimizer pass.
#[derive(Debug)]
pub struct SlabMut<'a> {
    pub table: &'a ParamTable,
    pub params: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    pub transport: TransportMut<'a>,
    /// `Some` only when the tier holds gradients.
    pub grads: Option<&'a mut [f32]>,
    /// AdamW step count of this layer (for bias correction).
    pub step: &'a mut u64,
}

/// Below this many elements a plain copy beats waking rayon.
const PAR_MIN: usize = 1 << 16;
const CHUNK: usize = 1 << 14;

/// `dst = src` for the f32 transport, parallel for large layers.
fn copy_f32(src: &[f32], dst: &mut [f32]) {
    if src.len() < PAR_MIN {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

/// Writes the transport copy from the fp32 params (bf16 and f16: round to
/// nearest, ties to even; f16 saturates finite values at ±65504, as the
/// optimizer's fused pass does). The optimizer crate can call this on a
/// [`SlabMut`] too.
pub fn refresh_transport(params: &[f32], transport: &mut TransportMut<'_>) {
    match transport {
        TransportMut::F32(t) => copy_f32(params, t),
        TransportMut::BF16(t) => convert::f32_to_bf16_into(params, t),
        TransportMut::F16(t) => convert::f32_to_f16_sat_into(params, t),
    }
}

/// [`refresh_transport`] of elements `ranges` only, each written through
/// a slice of its own (see [`AlignedBuf::range_mut`]): where the copy is
/// shared, other processes write the rest meanwhile.
fn refresh_ranges(params: &[f32], transport: &mut Transport, ranges: &[std::ops::Range<usize>]) {
    for r in ranges {
        let src = &params[r.clone()];
        match transport {
            Transport::F32(t) => copy_f32(src, t.range_mut(r.clone())),
            Transport::BF16(t) => convert::f32_to_bf16_into(src, t.range_mut(r.clone())),
            Transport::F16(t) => convert::f32_to_f16_sat_into(src, t.range_mut(r.clone())),
        }
    }
}

/// Reserved bytes of one layer by kind, for a given placement. The single
/// formula behind both [`LayerSlab::bytes`] and [`crate::plan`].
pub(crate) fn layer_bytes(numel: usize, transport: TransportDType, hold_grads: bool) -> BytesByKind {
    let f = padded_bytes(numel, 4);
    BytesByKind {
        params: f,
        moments: 2 * f,
        transport: padded_bytes(numel, transport.size_in_bytes()),
        gradients: if hold_grads { f } else { 0 },
        staging: 0,
    }
}

/// One layer's host state.
#[derive(Debug)]
pub struct LayerSlab {
    index: usize,
    table: ParamTable,
    /// The tensors a checkpoint file holds, where they are not the
    /// table's own (Phi-3's fused projections): the same elements, in
    /// the same order, cut into other tensors.
    file_table: Option<ParamTable>,
    params: AlignedBuf<f32>,
    m: AlignedBuf<f32>,
    v: AlignedBuf<f32>,
    /// The executor's registration of the transport copy: declared before
    /// it so that it is dropped first (its drop waits until the device no
    /// longer reads the pages).
    registration: Option<HostRegistration>,
    transport: Transport,
    grads: Option<AlignedBuf<f32>>,
    step: u64,
    /// The elements of p, m and v this process keeps (a rank of a sharded
    /// optimizer owns a range; otherwise the whole layer).
    own: std::ops::Range<usize>,
    /// The elements of p, m and v whose blocks a spilled layer's files
    /// hold: the whole layer, or a sharded rank's range (nothing is ever
    /// written through the maps outside it).
    reserved: std::ops::Range<usize>,
    /// The elements of the transport copy this process writes when it
    /// rewrites the copy from the params: the whole layer, or, where the
    /// machine's ranks share the copy, its ranks' ranges
    /// ([`crate::SharedTransport::writes`]).
    transport_writes: Vec<std::ops::Range<usize>>,
}

impl LayerSlab {
    /// Allocates a zeroed slab. `backing` applies to params, moments and
    /// gradients; the transport copy is always in RAM (it is read on every
    /// forward and backward, the others once per step by the optimizer).
    /// `index` is the layer's position in the model (used in errors and in
    /// spill file names).
    pub fn new(
        index: usize,
        table: ParamTable,
        transport: TransportDType,
        hold_grads: bool,
        backing: &Backing,
    ) -> Result<Self> {
        let n = table.numel();
        Self::new_shard(index, table, transport, hold_grads, backing, 0..n, 0..n)
    }

    /// [`LayerSlab::new`] for a rank of a sharded optimizer that keeps
    /// elements `own` of p, m and v, and whose spill files reserve blocks
    /// for elements `reserved` only (its range, for a spilled layer). Held
    /// gradients are whole.
    pub fn new_shard(
        index: usize,
        table: ParamTable,
        transport: TransportDType,
        hold_grads: bool,
        backing: &Backing,
        own: std::ops::Range<usize>,
        reserved: std::ops::Range<usize>,
    ) -> Result<Self> {
        let n = table.numel();
        assert!(own.end <= n && reserved.end <= n, "{own:?} {reserved:?} of {n}");
        let label = format!("layer{index}");
        let block =
            |kind: &str| AlignedBuf::new_reserving(n, backing, &format!("{label}-{kind}"), reserved.clone());
        let params = block("params")?;
        let m = block("m")?;
        let v = block("v")?;
        let grads = if hold_grads {
            Some(AlignedBuf::new(n, backing, &format!("{label}-grads"))?)
        } else {
            None
        };
        let transport = match transport {
            TransportDType::F32 => Transport::F32(AlignedBuf::zeroed(n)?),
            TransportDType::BF16 => Transport::BF16(AlignedBuf::zeroed(n)?),
            TransportDType::F16 => Transport::F16(AlignedBuf::zeroed(n)?),
        };
        Ok(LayerSlab {
            index,
            table,
            file_table: None,
            params,
            m,
            v,
            registration: None,
            transport,
            grads,
            step: 0,
            own,
            reserved,
            transport_writes: std::iter::once(0..n).collect(),
        })
    }

    /// Maps the transport copy from bytes `offset..` of `file`, which the
    /// machine's other ranks map too, and from now on rewrites only the
    /// elements `writes` of it from the params. Call before an executor
    /// registers the copy.
    pub fn share_transport(
        &mut self,
        file: &std::fs::File,
        offset: u64,
        path: &std::path::Path,
        writes: Vec<std::ops::Range<usize>>,
    ) -> Result<()> {
        assert!(
            self.registration.is_none(),
            "layer {}: shared after registration",
            self.index
        );
        let n = self.numel();
        self.transport = match self.transport {
            Transport::F32(_) => Transport::F32(AlignedBuf::shared(n, file, offset, path)?),
            Transport::BF16(_) => Transport::BF16(AlignedBuf::shared(n, file, offset, path)?),
            Transport::F16(_) => Transport::F16(AlignedBuf::shared(n, file, offset, path)?),
        };
        self.transport_writes = writes;
        Ok(())
    }

    /// The elements of the transport copy this process writes (see
    /// [`LayerSlab::share_transport`]).
    pub fn transport_writes(&self) -> &[std::ops::Range<usize>] {
        &self.transport_writes
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub fn table(&self) -> &ParamTable {
        &self.table
    }

    /// The tensors of this layer in a checkpoint file: [`Self::table`],
    /// or what [`Self::set_file_table`] gave.
    pub fn file_table(&self) -> &ParamTable {
        self.file_table.as_ref().unwrap_or(&self.table)
    }

    /// Names the layer's elements in checkpoint files by `file` instead of
    /// the table: `file` lays out the same elements in the same order (its
    /// tensors may join consecutive entries of the table).
    pub fn set_file_table(&mut self, file: ParamTable) -> Result<()> {
        if file.numel() != self.table.numel() {
            return Err(TierError::FileTable {
                layer: self.index,
                file: file.numel(),
                table: self.table.numel(),
            });
        }
        self.file_table = Some(file);
        Ok(())
    }

    pub fn numel(&self) -> usize {
        self.table.numel()
    }

    pub fn is_spilled(&self) -> bool {
        self.params.is_on_disk()
    }

    pub fn transport_dtype(&self) -> TransportDType {
        match self.transport {
            Transport::F32(_) => TransportDType::F32,
            Transport::BF16(_) => TransportDType::BF16,
            Transport::F16(_) => TransportDType::F16,
        }
    }

    pub fn holds_grads(&self) -> bool {
        self.grads.is_some()
    }

    pub fn params(&self) -> &[f32] {
        &self.params
    }

    pub fn params_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    pub fn m(&self) -> &[f32] {
        &self.m
    }

    pub fn m_mut(&mut self) -> &mut [f32] {
        &mut self.m
    }

    pub fn v(&self) -> &[f32] {
        &self.v
    }

    pub fn v_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }

    pub fn grads(&self) -> Option<&[f32]> {
        self.grads.as_deref()
    }

    pub fn grads_mut(&mut self) -> Option<&mut [f32]> {
        self.grads.as_deref_mut()
    }

    pub fn transport(&self) -> TransportRef<'_> {
        match &self.transport {
            Transport::F32(b) => TransportRef::F32(b),
            Transport::BF16(b) => TransportRef::BF16(b),
            Transport::F16(b) => TransportRef::F16(b),
        }
    }

    /// The whole pages the transport copy occupies (the copy, then zeros
    /// to the page's end): what an executor registers to read it by itself.
    pub fn transport_pages(&self) -> &[u8] {
        match &self.transport {
            Transport::F32(b) => b.pages(),
            Transport::BF16(b) => b.pages(),
            Transport::F16(b) => b.pages(),
        }
    }

    /// Keeps an executor's registration of [`LayerSlab::transport_pages`]
    /// for as long as the pages live (replacing an earlier one).
    pub fn keep_registration(&mut self, r: HostRegistration) {
        self.registration = Some(r);
    }

    /// Whether an executor reads the transport copy by itself.
    pub fn is_registered(&self) -> bool {
        self.registration.is_some()
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    fn spec(&self, name: &str) -> Result<&ParamSpec> {
        self.table.get(name).ok_or_else(|| TierError::UnknownParam {
            layer: self.index,
            name: name.to_string(),
        })
    }

    /// The fp32 values of one named parameter.
    pub fn param(&self, name: &str) -> Result<&[f32]> {
        let r = self.spec(name)?.range();
        Ok(&self.params[r])
    }

    pub fn param_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        let r = self.spec(name)?.range();
        Ok(&mut self.params[r])
    }

    /// Every block borrowed at once (disjoint fields, so no copies and no
    /// unsafe code).
    pub fn parts_mut(&mut self) -> SlabMut<'_> {
        SlabMut {
            table: &self.table,
            params: &mut self.params,
            m: &mut self.m,
            v: &mut self.v,
            transport: match &mut self.transport {
                Transport::F32(b) => TransportMut::F32(b),
                Transport::BF16(b) => TransportMut::BF16(b),
                Transport::F16(b) => TransportMut::F16(b),
            },
            grads: self.grads.as_deref_mut(),
            step: &mut self.step,
        }
    }

    /// Elements `r` of every block (element 0 of each slice is the layer's
    /// element `r.start`; `table` is still the whole layer's), made without
    /// a reference to the elements outside `r` (see
    /// [`AlignedBuf::range_mut`]): for updating one chunk while a
    /// collective reads or writes another through a raw pointer.
    pub fn parts_in(&mut self, r: std::ops::Range<usize>) -> SlabMut<'_> {
        SlabMut {
            table: &self.table,
            params: self.params.range_mut(r.clone()),
            m: self.m.range_mut(r.clone()),
            v: self.v.range_mut(r.clone()),
            transport: match &mut self.transport {
                Transport::F32(b) => TransportMut::F32(b.range_mut(r.clone())),
                Transport::BF16(b) => TransportMut::BF16(b.range_mut(r.clone())),
                Transport::F16(b) => TransportMut::F16(b.range_mut(r.clone())),
            },
            grads: self.grads.as_mut().map(|g| g.range_mut(r)),
            step: &mut self.step,
        }
    }

    /// Elements `r` of the held gradient, as [`LayerSlab::parts_in`] makes
    /// them; `None` when the tier holds no gradients.
    pub fn grads_in(&mut self, r: std::ops::Range<usize>) -> Option<&mut [f32]> {
        self.grads.as_mut().map(|g| g.range_mut(r))
    }

    /// For a spilled layer, drops its p/m/v/gradient pages from the
    /// resident set (see [`AlignedBuf::evict`]); call after the optimizer
    /// has updated it. A no-op for layers in RAM.
    pub fn evict(&mut self) -> Result<()> {
        self.params.evict()?;
        self.m.evict()?;
        self.v.evict()?;
        if let Some(g) = &mut self.grads {
            g.evict()?;
        }
        Ok(())
    }

    /// The files behind a spilled layer's p, m and v, for
    /// [`crate::SpillWindow`], moving [`LayerSlab::own`]; `None` for a
    /// layer in RAM.
    pub fn spilled(&self) -> Option<crate::SpilledLayer> {
        Some(crate::SpilledLayer {
            layer: self.index,
            numel: self.numel(),
            p: self.params.spill_region()?.clone(),
            m: self.m.spill_region()?.clone(),
            v: self.v.spill_region()?.clone(),
            range: self.own.clone(),
        })
    }

    /// The elements of p, m and v this process keeps resident.
    pub fn own(&self) -> std::ops::Range<usize> {
        self.own.clone()
    }

    /// The elements of p, m and v whose blocks this slab's spill files
    /// hold (see [`LayerSlab::new_shard`]).
    pub fn reserved(&self) -> std::ops::Range<usize> {
        self.reserved.clone()
    }

    /// Lets the whole layer be written: a spilled layer's files that hold
    /// this rank's range only reserve the rest too.
    pub fn reserve_all(&mut self) -> Result<()> {
        if self.reserved != (0..self.numel()) {
            self.params.reserve_all()?;
            self.m.reserve_all()?;
            self.v.reserve_all()?;
            self.reserved = 0..self.numel();
        }
        Ok(())
    }

    /// Writes the whole layer's parameters with `fill` and rewrites the
    /// transport copy from them. Where the spill files hold only this
    /// rank's range, `fill` writes into a RAM buffer of the layer instead,
    /// whose own range is then copied in: nothing is written into the
    /// files' holes. Call [`LayerSlab::settle`] after.
    pub fn fill_params<E: From<TierError>>(
        &mut self,
        fill: impl FnOnce(&mut [f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let n = self.numel();
        if self.reserved == (0..n) {
            fill(self.params.as_mut_slice())?;
            self.refresh_transport();
            return Ok(());
        }
        let mut whole = AlignedBuf::<f32>::zeroed(n)?;
        fill(whole.as_mut_slice())?;
        let own = self.own.clone();
        refresh_ranges(&whole, &mut self.transport, &self.transport_writes);
        self.params[own.clone()].copy_from_slice(&whole[own]);
        Ok(())
    }

    /// After the layer was written whole (loaded, initialised, gathered for
    /// a checkpoint): a spilled layer's pages all go back (see
    /// [`LayerSlab::evict`]), a RAM layer's outside [`LayerSlab::own`].
    pub fn settle(&mut self) -> Result<()> {
        if self.is_spilled() {
            self.evict()
        } else if self.own != (0..self.numel()) {
            self.release_outside(self.own.clone())
        } else {
            Ok(())
        }
    }

    /// Releases the resident pages of params, `m` and `v` outside `keep`
    /// (a rank of a sharded optimizer owns only `keep`); their contents
    /// become unspecified until written again.
    pub fn release_outside(&mut self, keep: std::ops::Range<usize>) -> Result<()> {
        let n = self.numel();
        for b in [&mut self.params, &mut self.m, &mut self.v] {
            b.release(0..keep.start)?;
            b.release(keep.end..n)?;
        }
        Ok(())
    }

    /// Rewrites the transport copy from the fp32 params (where the copy is
    /// shared, the elements this process writes).
    pub fn refresh_transport(&mut self) {
        refresh_ranges(&self.params, &mut self.transport, &self.transport_writes);
    }

    /// Reserved bytes by kind: `(ram, disk)`.
    pub fn bytes(&self) -> (BytesByKind, BytesByKind) {
        let mut ram = BytesByKind::default();
        let mut disk = BytesByKind::default();
        let mut add = |on_disk: bool, f: &mut dyn FnMut(&mut BytesByKind)| {
            f(if on_disk { &mut disk } else { &mut ram });
        };
        add(self.params.is_on_disk(), &mut |b| {
            b.params += self.params.reserved_bytes()
        });
        add(self.m.is_on_disk(), &mut |b| b.moments += self.m.reserved_bytes());
        add(self.v.is_on_disk(), &mut |b| b.moments += self.v.reserved_bytes());
        if let Some(g) = &self.grads {
            add(g.is_on_disk(), &mut |b| b.gradients += g.reserved_bytes());
        }
        match &self.transport {
            Transport::F32(t) => add(t.is_on_disk(), &mut |b| b.transport += t.reserved_bytes()),
            Transport::BF16(t) => add(t.is_on_disk(), &mut |b| b.transport += t.reserved_bytes()),
            Transport::F16(t) => add(t.is_on_disk(), &mut |b| b.transport += t.reserved_bytes()),
        }
        (ram, disk)
    }
}
