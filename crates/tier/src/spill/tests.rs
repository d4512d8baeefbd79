//! The window against real files: order, contents, byte counts, errors.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use super::window::io_bytes;
use super::*;
use crate::buf::{AlignedBuf, PAGE};
use crate::error::TierError;

/// A spilled "layer" of `n` elements with p = i, m = 2i, v = 3i.
fn layer(dir: &Path, index: usize, n: usize) -> (SpilledLayer, [AlignedBuf<f32>; 3]) {
    let mut bufs =
        [0, 1, 2].map(|k| AlignedBuf::<f32>::zeroed_on_disk(n, dir, &format!("t{index}-{k}")).unwrap());
    for (k, b) in bufs.iter_mut().enumerate() {
        for (i, x) in b.iter_mut().enumerate() {
            *x = ((k + 1) * i) as f32 + index as f32 * 1e6;
        }
        b.flush().unwrap();
    }
    let r = |k: usize| bufs[k].spill_region().unwrap().clone();
    let l = SpilledLayer {
        layer: index,
        numel: n,
        p: r(0),
        m: r(1),
        v: r(2),
        range: 0..n,
    };
    (l, bufs)
}

#[test]
fn chunks_come_in_order_and_updates_reach_the_files() {
    let dir = tempfile::tempdir().unwrap();
    // Uneven sizes: several chunks, a short last chunk, a 1-element layer.
    let sizes = [(5, 3 * CHUNK_ALIGN + 17), (3, 1), (1, CHUNK_ALIGN)];
    let mut held = Vec::new();
    let mut layers = Vec::new();
    for &(i, n) in &sizes {
        let (l, b) = layer(dir.path(), i, n);
        layers.push(l);
        held.push(b);
    }
    let config = WindowConfig {
        chunk_elems: CHUNK_ALIGN,
        depth: 3,
    };
    assert_eq!(config.bytes(), 12 * CHUNK_ALIGN as u64 * 3);
    let w = SpillWindow::start(layers, config).unwrap();
    let mut expect_bytes = 0;
    for &(i, n) in &sizes {
        let mut done = 0;
        while done < n {
            let mut c = w.next(i).unwrap();
            assert_eq!(c.layer(), i);
            assert_eq!(c.range().start, done);
            let r = c.range();
            let (p, m, v) = c.parts_mut();
            for (j, e) in r.clone().enumerate() {
                let base = i as f32 * 1e6;
                assert_eq!(p[j], e as f32 + base);
                assert_eq!(m[j], (2 * e) as f32 + base);
                assert_eq!(v[j], (3 * e) as f32 + base);
                p[j] = -p[j];
                m[j] += 1.0;
                v[j] = 0.5;
            }
            expect_bytes += 3 * io_bytes(r.len()) as u64;
            done = r.end;
            w.give_back(c).unwrap();
        }
    }
    let s = w.finish().unwrap();
    assert_eq!((s.bytes_read, s.bytes_written), (expect_bytes, expect_bytes));
    assert!(s.disk_busy_ms > 0.0 && s.gb_per_s() > 0.0);
    assert!(s.disk_busy_ms <= s.read_ms + s.write_ms + 1e-6);
    // The maps see what was written through the files.
    for (&(i, _), b) in sizes.iter().zip(&held) {
        let base = i as f32 * 1e6;
        for (e, ((p, m), v)) in b[0].iter().zip(b[1].iter()).zip(b[2].iter()).enumerate() {
            assert_eq!(*p, -(e as f32 + base));
            assert_eq!(*m, (2 * e) as f32 + base + 1.0);
            assert_eq!(*v, 0.5);
        }
    }
}

/// A rank of a sharded optimizer moves only its range of each layer: the
/// chunks start where the range does, are cut on the window's grid (where
/// the trainer's transfer chunks are cut), read and write only that range,
/// and leave the rest of the files as they were. An empty range moves
/// nothing; a range off a page is refused.
#[test]
fn a_range_of_a_layer_moves_alone_on_the_grid() {
    let dir = tempfile::tempdir().unwrap();
    let n = 3 * CHUNK_ALIGN + 17;
    let page = PAGE / 4;
    let cases = [
        (4, CHUNK_ALIGN + 5 * page..n),
        (2, 7 * page..CHUNK_ALIGN - page),
        (0, 0..0),
    ];
    let mut held = Vec::new();
    let mut layers = Vec::new();
    for (i, r) in &cases {
        let (l, b) = layer(dir.path(), *i, n);
        layers.push(l.only(r.clone()).unwrap());
        held.push(b);
    }
    let config = WindowConfig {
        chunk_elems: CHUNK_ALIGN,
        depth: 2,
    };
    let w = SpillWindow::start(layers, config).unwrap();
    let mut bytes = 0;
    for (i, r) in &cases {
        let mut cuts = Vec::new();
        let mut done = r.start;
        while done < r.end {
            let mut c = w.next(*i).unwrap();
            let got = c.range();
            assert_eq!(got.start, done);
            cuts.push(got.clone());
            let (p, _, _) = c.parts_mut();
            for (j, e) in got.clone().enumerate() {
                assert_eq!(p[j], e as f32 + *i as f32 * 1e6);
                p[j] = -1.0;
            }
            bytes += 3 * io_bytes(got.len()) as u64;
            done = got.end;
            w.give_back(c).unwrap();
        }
        for c in &cuts[..cuts.len().saturating_sub(1)] {
            assert_eq!(c.end % CHUNK_ALIGN, 0, "layer {i}: {cuts:?}");
        }
    }
    let s = w.finish().unwrap();
    assert_eq!((s.bytes_read, s.bytes_written), (bytes, bytes));
    for ((i, r), b) in cases.iter().zip(&held) {
        for (e, p) in b[0].iter().enumerate() {
            let want = if r.contains(&e) {
                -1.0
            } else {
                e as f32 + *i as f32 * 1e6
            };
            assert_eq!(*p, want, "layer {i} element {e}");
        }
    }
    let (l, _h) = layer(dir.path(), 9, n);
    let err = l.clone().only(3..page).unwrap_err().to_string();
    assert!(err.contains("layer 9") && err.contains("3..1024"), "{err}");
    assert!(l.only(0..n + 1).is_err());
}

#[test]
fn a_consumer_out_of_order_is_an_error_and_drop_stops_the_threads() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _ha) = layer(dir.path(), 2, 100);
    let (b, _hb) = layer(dir.path(), 1, 100);
    let w = SpillWindow::start(vec![a.clone(), b.clone()], WindowConfig::default()).unwrap();
    let err = w.next(1).unwrap_err().to_string();
    assert!(
        err.contains("asked for layer 1") && err.contains("layer 2 next"),
        "{err}"
    );
    drop(w);
    // A chunk read ahead but never updated is reported by finish.
    let w = SpillWindow::start(vec![a, b], WindowConfig::default()).unwrap();
    let c = w.next(2).unwrap();
    w.give_back(c).unwrap();
    let err = w.finish().unwrap_err().to_string();
    assert!(err.contains("layer 1 was read ahead but never updated"), "{err}");
}

#[test]
fn a_truncated_file_and_a_failing_write_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (l, _h) = layer(dir.path(), 0, 5000);
    l.m.file().set_len(4096).unwrap();
    let w = SpillWindow::start(vec![l.clone()], WindowConfig::default()).unwrap();
    let err = w.next(0).unwrap_err();
    assert!(matches!(err, TierError::SpillLength { got: 4096, .. }), "{err}");
    l.m.file().set_len(l.m.bytes()).unwrap();

    // Writes to a descriptor opened read-only fail; the error comes out
    // of finish (the writer never panics or blocks the reader).
    let ro_path = dir.path().join("ro.bin");
    std::fs::write(&ro_path, vec![0u8; l.v.bytes() as usize]).unwrap();
    let ro = File::open(&ro_path).unwrap();
    let bad = SpilledLayer {
        v: SpillRegion::new(Arc::new(ro), ro_path.clone(), l.v.bytes(), false),
        ..l
    };
    let w = SpillWindow::start(vec![bad], WindowConfig::default()).unwrap();
    let c = w.next(0).unwrap();
    w.give_back(c).unwrap();
    let err = w.finish().unwrap_err().to_string();
    assert!(err.contains("ro.bin"), "{err}");
}

#[test]
fn full_disk_errors_are_named_as_such() {
    for code in [libc::ENOSPC, libc::EFBIG, libc::EDQUOT] {
        let e = TierError::io("/x/spill", std::io::Error::from_raw_os_error(code));
        assert!(e.is_disk_full(), "{code}");
        assert!(e.to_string().contains("the disk is full"), "{e}");
        assert!(e.to_string().starts_with("/x/spill: "), "{e}");
    }
    let e = TierError::io("/x", std::io::Error::from_raw_os_error(libc::EACCES));
    assert!(!e.is_disk_full());
}

#[test]
fn disk_probe_measures_both_directions_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let bw = measure_disk_bandwidth(dir.path(), 1).unwrap();
    assert_eq!(bw.bytes, 32 << 20);
    assert!(bw.read_gb_s > 0.0 && bw.write_gb_s > 0.0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn window_sizes_round_to_the_chunk_alignment() {
    let c = WindowConfig::from_bytes(1 << 30, 4);
    assert_eq!(c.chunk_elems % CHUNK_ALIGN, 0);
    assert!(c.bytes() <= 1 << 30 && c.bytes() > (1 << 30) - 12 * 4 * CHUNK_ALIGN as u64);
    assert_eq!(WindowConfig::from_bytes(1, 1).chunk_elems, CHUNK_ALIGN);
}
