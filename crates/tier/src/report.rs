//! Byte accounting by kind, shared by the live tier and the allocation-free
//! plan so that the two cannot disagree.

use std::fmt;

/// Bytes by what they hold. Every figure is whole pages actually reserved
/// (see [`crate::padded_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BytesByKind {
    /// fp32 master weights.
    pub params: u64,
    /// fp32 AdamW `m` and `v` together.
    pub moments: u64,
    /// The copy uploaded to the GPU (bf16 or f32).
    pub transport: u64,
    /// Held fp32 gradients (0 unless the tier holds them).
    pub gradients: u64,
    /// Staging buffers. The tier has none; the GPU transport adds its own.
    pub staging: u64,
}

impl BytesByKind {
    pub fn total(&self) -> u64 {
        self.params + self.moments + self.transport + self.gradients + self.staging
    }
}

impl std::ops::AddAssign for BytesByKind {
    fn add_assign(&mut self, o: Self) {
        self.params += o.params;
        self.moments += o.moments;
        self.transport += o.transport;
        self.gradients += o.gradients;
        self.staging += o.staging;
    }
}

/// What the tier holds and where.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MemoryReport {
    pub ram: BytesByKind,
    /// Bytes in memory-mapped spill files (the page cache may hold some of
    /// them; the kernel can drop clean ones and write back dirty ones).
    pub disk: BytesByKind,
    pub n_params: u64,
    pub n_layers: usize,
    /// Index of the first layer whose p/m/v live on disk; layers before it
    /// are wholly in RAM, layers from it on are spilled. `None`: no spill.
    pub first_spilled: Option<usize>,
}

impl MemoryReport {
    /// RAM bytes per parameter (the 14 / 16 B/param figure of the design).
    pub fn ram_bytes_per_param(&self) -> f64 {
        if self.n_params == 0 {
            0.0
        } else {
            self.ram.total() as f64 / self.n_params as f64
        }
    }

    pub fn layers_spilled(&self) -> usize {
        self.first_spilled.map_or(0, |f| self.n_layers - f)
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} parameters in {} layers", self.n_params, self.n_layers)?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, r: u64, d: u64| {
            writeln!(
                f,
                "  {name:<10} {:>12.3} GiB RAM {:>12.3} GiB disk",
                gib(r),
                gib(d)
            )
        };
        row(f, "params", self.ram.params, self.disk.params)?;
        row(f, "moments", self.ram.moments, self.disk.moments)?;
        row(f, "transport", self.ram.transport, self.disk.transport)?;
        row(f, "gradients", self.ram.gradients, self.disk.gradients)?;
        row(f, "staging", self.ram.staging, self.disk.staging)?;
        row(f, "total", self.ram.total(), self.disk.total())?;
        write!(
            f,
            "  {:.2} bytes of RAM per parameter",
            self.ram_bytes_per_param()
        )?;
        if self.first_spilled.is_some() {
            write!(
                f,
                "; layers {}.. spilled to disk",
                self.first_spilled.unwrap_or(0)
            )?;
        }
        Ok(())
    }
}
