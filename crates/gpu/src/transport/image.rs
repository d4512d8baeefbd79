//! A layer as the bytes of its weight slot, written into mapped memory in
//! large blocks split across a pool of copy threads. One core writing
//! into mapped memory moves bytes at pageable-memory speed (≈ 10–18 GB/s);
//! PCIe Gen5 takes 55 GB/s, so the copy is spread over the cores.

use half::{bf16, f16};
use megatrain_tensor::{DType, HostSlice, WeightUpload};
use rayon::prelude::*;

/// Bytes one copy thread writes at a time: large enough that a block is a
/// long streaming write, small enough that a 32 MiB ring entry feeds 16
/// threads.
pub(crate) const BLOCK: u64 = BLOCK_BYTES as u64;
const BLOCK_BYTES: usize = 1 << 20;

/// Where one tensor's bytes come from.
#[derive(Clone, Copy)]
enum Src<'a> {
    /// Stored as held: copied byte for byte.
    Raw(&'a [u8]),
    /// bf16/f16 held as f32 (norm gains, biases): widened on the way.
    WideBf16(&'a [bf16]),
    WideF16(&'a [f16]),
}

impl Src<'_> {
    fn len(&self) -> u64 {
        match self {
            Src::Raw(b) => b.len() as u64,
            Src::WideBf16(v) => 4 * v.len() as u64,
            Src::WideF16(v) => 4 * v.len() as u64,
        }
    }
}

/// The slot's bytes: tensors at (aligned) offsets; the padding between
/// them is never written.
pub(crate) struct Image<'a> {
    segs: Vec<(u64, Src<'a>)>,
    bytes: u64,
}

impl<'a> Image<'a> {
    /// `params` at `offsets` in a slot of `bytes` bytes.
    pub fn new(params: &[WeightUpload<'a>], offsets: &[u64], bytes: u64) -> Self {
        let segs = params
            .iter()
            .zip(offsets)
            .map(|(p, &at)| {
                let src = match (p.data, p.dtype) {
                    (HostSlice::F32(v), _) => Src::Raw(bytemuck::cast_slice(v)),
                    (HostSlice::BF16(v), DType::BF16) => Src::Raw(bytemuck::cast_slice(v)),
                    (HostSlice::F16(v), DType::F16) => Src::Raw(bytemuck::cast_slice(v)),
                    (HostSlice::BF16(v), _) => Src::WideBf16(v),
                    (HostSlice::F16(v), _) => Src::WideF16(v),
                };
                (at, src)
            })
            .collect();
        Image { segs, bytes }
    }

    /// Bytes of a plain buffer, for tests and benches.
    #[cfg(test)]
    pub fn raw(data: &'a [u8]) -> Self {
        Image {
            segs: vec![(0, Src::Raw(data))],
            bytes: data.len() as u64,
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Writes the image's bytes `at .. at + dst.len()` into `dst`, once and
    /// in order (the mapping may be write-combined: never read it). `at`
    /// and the length are multiples of 4 wherever a widened tensor is cut.
    pub fn write(&self, at: u64, mut dst: wgpu::WriteOnly<'_, [u8]>) {
        let end = at + dst.len() as u64;
        for &(s, src) in &self.segs {
            let e = s + src.len();
            let (a, b) = (s.max(at), e.min(end));
            if a >= b {
                continue;
            }
            let mut out = dst.slice((a - at) as usize..(b - at) as usize);
            let (lo, hi) = ((a - s) as usize, (b - s) as usize);
            match src {
                Src::Raw(v) => out.copy_from_slice(&v[lo..hi]),
                Src::WideBf16(v) => {
                    debug_assert!(lo % 4 == 0 && hi % 4 == 0);
                    out.write_iter(v[lo / 4..hi / 4].iter().flat_map(|x| x.to_f32().to_le_bytes()))
                }
                Src::WideF16(v) => {
                    debug_assert!(lo % 4 == 0 && hi % 4 == 0);
                    out.write_iter(v[lo / 4..hi / 4].iter().flat_map(|x| x.to_f32().to_le_bytes()))
                }
            }
        }
    }

    /// [`Image::write`] split into [`BLOCK`]-sized pieces on `pool`.
    pub fn write_par(&self, pool: &rayon::ThreadPool, at: u64, dst: wgpu::WriteOnly<'_, [u8]>) {
        if dst.len() as u64 <= 2 * BLOCK || pool.current_num_threads() < 2 {
            self.write(at, dst);
            return;
        }
        // Whole blocks as fixed-size arrays: a `WriteOnly` of an array may
        // go to another thread, one of a slice may not.
        let (blocks, rest) = dst.into_chunks::<BLOCK_BYTES>();
        let rest_at = at + blocks.len() as u64 * BLOCK;
        let jobs: Vec<_> = blocks
            .into_iter()
            .enumerate()
            .map(|(i, w)| (at + i as u64 * BLOCK, w))
            .collect();
        pool.install(|| jobs.into_par_iter().for_each(|(o, w)| self.write(o, w.into())));
        self.write(rest_at, rest);
    }
}

/// Widens `bytes` (tensors of `layout`: dtype, elements, byte offset) into
/// `out` on `pool`, each tensor cut into blocks of about [`BLOCK`] bytes.
pub(crate) fn read_par(
    pool: &rayon::ThreadPool,
    bytes: &[u8],
    layout: &[(DType, usize, u64)],
    out: &mut [f32],
) {
    let mut jobs = Vec::new();
    let mut rest = out;
    for &(dtype, n, off) in layout {
        let (mine, tail) = rest.split_at_mut(n);
        rest = tail;
        let size = dtype.size_in_bytes();
        let per = (BLOCK as usize / size).max(1);
        for (i, chunk) in mine.chunks_mut(per).enumerate() {
            let at = off as usize + i * per * size;
            jobs.push((dtype, &bytes[at..at + chunk.len() * size], chunk));
        }
    }
    let run = |(dtype, src, dst): (DType, &[u8], &mut [f32])| crate::tensor::widen_bytes(dtype, src, dst);
    if jobs.len() <= 2 || pool.current_num_threads() < 2 {
        jobs.into_iter().for_each(run);
    } else {
        pool.install(|| jobs.into_par_iter().for_each(run));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_written_apart_equal_the_whole() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<bf16> = (0..23).map(|i| bf16::from_f32(i as f32 * 0.25)).collect();
        let c: Vec<f16> = (0..11).map(|i| f16::from_f32(-(i as f32))).collect();
        let (sa, sb, sc) = (
            megatrain_tensor::Shape::new([37]),
            megatrain_tensor::Shape::new([23]),
            megatrain_tensor::Shape::new([11]),
        );
        let ups = [
            WeightUpload {
                shape: &sa,
                data: HostSlice::F32(&a),
                dtype: DType::F32,
            },
            WeightUpload {
                shape: &sb,
                data: HostSlice::BF16(&b),
                dtype: DType::BF16,
            },
            WeightUpload {
                shape: &sc,
                data: HostSlice::F16(&c),
                dtype: DType::F32,
            },
        ];
        let offsets = [0u64, 256, 512];
        let bytes = 512 + 44;
        let img = Image::new(&ups, &offsets, bytes);
        let mut whole = vec![0u8; bytes as usize];
        img.write(0, wgpu::WriteOnly::from(&mut whole[..]));
        let mut pieces = vec![0u8; bytes as usize];
        for start in (0..bytes).step_by(12) {
            let end = (start + 12).min(bytes);
            img.write(
                start,
                wgpu::WriteOnly::from(&mut pieces[start as usize..end as usize]),
            );
        }
        assert_eq!(whole, pieces);
        assert_eq!(&whole[..148], bytemuck::cast_slice::<f32, u8>(&a));
        assert_eq!(&whole[256..302], bytemuck::cast_slice::<bf16, u8>(&b));
        let wide: Vec<f32> = c.iter().map(|x| x.to_f32()).collect();
        assert_eq!(&whole[512..], bytemuck::cast_slice::<f32, u8>(&wide));
    }

    #[test]
    fn parallel_copies_are_bit_exact() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let n = (5 * BLOCK + 13) as usize;
        let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        let img = Image::raw(&data);
        let mut out = vec![0u8; n];
        img.write_par(&pool, 0, wgpu::WriteOnly::from(&mut out[..]));
        assert_eq!(out, data);
        let mut part = vec![0u8; n - 4096];
        img.write_par(&pool, 4096, wgpu::WriteOnly::from(&mut part[..]));
        assert_eq!(part, data[4096..]);

        let f: Vec<f32> = (0..(3 * BLOCK as usize / 4 + 5)).map(|i| i as f32).collect();
        let h: Vec<bf16> = (0..(BLOCK as usize + 3))
            .map(|i| bf16::from_f32((i % 97) as f32))
            .collect();
        let mut bytes = bytemuck::cast_slice::<f32, u8>(&f).to_vec();
        let h_at = bytes.len().div_ceil(256) * 256;
        bytes.resize(h_at, 0);
        bytes.extend_from_slice(bytemuck::cast_slice(&h));
        let layout = [(DType::F32, f.len(), 0), (DType::BF16, h.len(), h_at as u64)];
        let mut got = vec![f32::NAN; f.len() + h.len()];
        read_par(&pool, &bytes, &layout, &mut got);
        assert_eq!(&got[..f.len()], &f[..]);
        let wide: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
        assert_eq!(&got[f.len()..], &wide[..]);
    }
}
