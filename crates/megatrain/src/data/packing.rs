//! Rows of several whole records (`--rows packed`): each row takes the
//! run's next records, in the order rows of one record would take them,
//! as many as fit, and the batch carries where each starts ([`Docs`]), so
//! every record attends and counts positions on its own. A step then
//! computes what it would on the same records one a row, without the
//! padding: on short records most of a row of one record is padding
//! (`train` prints the share).
//!
//! Which records row `g` of the run holds depends on the lengths of every
//! record before it, so it is found by walking the record order from a
//! mark: the first record of every [`STRIDE`]-th row is kept, and the walk
//! goes on from the last row drawn. A resumed run walks once from row 0
//! (a pass over a million records takes well under a second); the draw
//! stays a pure function of the batch number.
//!
//! [`Docs`]: megatrain_tensor::Docs

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::TokenData;
use super::batch::{Batch, Sampling};
use super::records::{Records, pad, push_record, record_of};

/// Rows between kept marks.
const STRIDE: u64 = 1024;

/// Order positions a best-fit window packs together.
const WINDOW: u64 = 1024;

/// How a run's packed rows take their records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// In the drawn order, each row as many of the next records as fit:
    /// a row ends at the first record that does not fit.
    Next,
    /// The drawn order cut into windows of 1024 records, each packed
    /// best fit decreasing (the longest first, each into the row it
    /// leaves the least room in); a window's rows in the order of their
    /// first records. Far less padding, the order still the draw's at the
    /// scale of a window.
    Best,
}

/// Where the walks over the record order stand, for each (row length,
/// sampling) drawn with: a run's training and validation draws, or two
/// ranks' in one process, do not restart each other's walks.
#[derive(Debug, Default)]
pub(super) struct Cursor {
    next: HashMap<(usize, Sampling), Walk>,
    best: HashMap<(usize, Sampling), Windows>,
}

/// A best-fit walk: `rows_before[w]` the rows of the windows before `w`,
/// known for the windows packed so far; `last` the last window packed and
/// its rows (order positions).
#[derive(Debug)]
struct Windows {
    rows_before: Vec<u64>,
    last: Option<(u64, Vec<Vec<u64>>)>,
}

/// marks\[i\] is the order position of row i·STRIDE's first record; `last`
/// a row drawn and its first record's position.
#[derive(Debug)]
struct Walk {
    marks: Vec<u64>,
    last: (u64, u64),
}

/// The inputs record `r` of a stream of `total` tokens takes in a row it
/// shares: all its tokens (its last one's target is not its own).
fn width(records: &Records, r: usize, total: usize) -> usize {
    records.span(r, total).len()
}

impl Cursor {
    /// The order position of the first record of row `g`, and of the first
    /// record after that row.
    fn row(
        &mut self,
        records: &Records,
        total: usize,
        sampling: Sampling,
        g: u64,
        seq_len: usize,
    ) -> (u64, u64) {
        let walk = self.next.entry((seq_len, sampling)).or_insert(Walk {
            marks: vec![0],
            last: (0, 0),
        });
        let next = |k: u64| row_end(records, total, sampling, k, seq_len);
        let mark = ((g / STRIDE) as usize).min(walk.marks.len() - 1);
        let (mut at, mut k) = match walk.last {
            (row, k) if row <= g && row >= mark as u64 * STRIDE => (row, k),
            _ => (mark as u64 * STRIDE, walk.marks[mark]),
        };
        while at < g {
            k = next(k);
            at += 1;
            if at.is_multiple_of(STRIDE) && at / STRIDE == walk.marks.len() as u64 {
                walk.marks.push(k);
            }
        }
        walk.last = (g, k);
        (k, next(k))
    }

    /// The order positions of the records of best-fit row `g`.
    fn best_row(
        &mut self,
        records: &Records,
        total: usize,
        sampling: Sampling,
        g: u64,
        seq_len: usize,
    ) -> Vec<u64> {
        let win = self.best.entry((seq_len, sampling)).or_insert(Windows {
            rows_before: vec![0],
            last: None,
        });
        let pack = |w: u64| pack_window(records, total, sampling, w, seq_len);
        // Every window makes at least one row, so the counts ascend.
        while *win.rows_before.last().expect("starts at 0") <= g {
            let w = win.rows_before.len() as u64 - 1;
            let rows = pack(w);
            win.rows_before
                .push(win.rows_before[w as usize] + rows.len() as u64);
            win.last = Some((w, rows));
        }
        let w = win.rows_before.partition_point(|&r| r <= g) - 1;
        if win.last.as_ref().map(|(at, _)| *at) != Some(w as u64) {
            win.last = Some((w as u64, pack(w as u64)));
        }
        let (_, rows) = win.last.as_ref().expect("packed above");
        rows[(g - win.rows_before[w]) as usize].clone()
    }
}

/// Best-fit window `w`: the records at order positions `w·WINDOW ..` of
/// `sampling`'s draw, packed into rows of `seq_len`.
fn pack_window(records: &Records, total: usize, sampling: Sampling, w: u64, seq_len: usize) -> Vec<Vec<u64>> {
    let n = records.len() as u64;
    let wide = |k: u64| width(records, record_of(sampling, k, n) as usize, total).min(seq_len);
    best_fit(w * WINDOW..(w + 1) * WINDOW, wide, seq_len)
}

/// `items` packed best fit decreasing into rows of `seq_len` (the widest
/// first, each into the row it leaves the least room in, a new row where
/// none has room; one wider than a row alone in one): each row's items
/// ascending, the rows in the order of their first items.
fn best_fit(
    items: impl IntoIterator<Item = u64>,
    wide: impl Fn(u64) -> usize,
    seq_len: usize,
) -> Vec<Vec<u64>> {
    let mut order: Vec<(usize, u64)> = items.into_iter().map(|k| (wide(k), k)).collect();
    order.sort_unstable_by_key(|&(w, k)| (std::cmp::Reverse(w), k));
    let mut rows: Vec<Vec<u64>> = Vec::new();
    // Room left → the rows with that much, the most recently opened last.
    let mut by_room: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (w, k) in order {
        let fit = by_room
            .range_mut(w..)
            .next()
            .map(|(&room, rows)| (room, rows.pop()));
        let (row, room) = match fit {
            Some((room, Some(row))) => {
                if by_room[&room].is_empty() {
                    by_room.remove(&room);
                }
                (row, room)
            }
            _ => {
                rows.push(Vec::new());
                (rows.len() - 1, seq_len)
            }
        };
        rows[row].push(k);
        by_room.entry(room - w).or_default().push(row);
    }
    for row in &mut rows {
        row.sort_unstable();
    }
    rows.sort_unstable_by_key(|row| row[0]);
    rows
}

/// The order position after the last record of the row that starts at
/// position `k`: as many records as fit, the first always (cut if longer).
fn row_end(records: &Records, total: usize, sampling: Sampling, mut k: u64, seq_len: usize) -> u64 {
    let n = records.len() as u64;
    let mut room = seq_len;
    loop {
        let w = width(records, record_of(sampling, k, n) as usize, total);
        if room == seq_len {
            room -= w.min(seq_len);
        } else if w <= room {
            room -= w;
        } else {
            return k;
        }
        k += 1;
        if room == 0 {
            return k;
        }
    }
}

/// Every record of `data` once, packed into rows of `seq_len` best fit
/// decreasing (the longest first, each into the row it leaves the least
/// room in, a new row where none has room; a record longer than a row
/// alone in one, cut), `batch` rows a batch, the last batch's fewer: what
/// an evaluation scores, where the order of the records does not matter
/// and the fewest rows are the fastest (a run's rows keep its drawn order:
/// next fit). Rows come in the stored order of their first records, each
/// holding its records in stored order. Empty where `data` holds no
/// records.
pub fn packed_once(data: &TokenData, batch: usize, seq_len: usize) -> Vec<Batch> {
    let Some(records) = data.records.as_ref().filter(|r| !r.is_empty()) else {
        return Vec::new();
    };
    let wide = |r: u64| width(records, r as usize, data.len()).min(seq_len);
    let rows = best_fit(0..records.len() as u64, wide, seq_len);
    rows.chunks(batch.max(1))
        .map(|chunk| {
            let mut out = Batch::empty(chunk.len(), seq_len);
            let mut rows = Vec::with_capacity(chunk.len());
            for row in chunk {
                let mut starts = Vec::new();
                let mut used = 0;
                for &r in row {
                    starts.push(used);
                    used += push_record(
                        data,
                        records.span(r as usize, data.len()),
                        seq_len - used,
                        &mut out,
                    );
                }
                pad(&mut out, seq_len - used);
                rows.push((used, starts));
            }
            out.finish_rows(rows);
            out
        })
        .collect()
}

/// Appends packed row `g` of the run (batch number · batch + row) to `out`
/// and returns its tokens before padding and where its records start.
pub(super) fn push_packed_row(
    data: &TokenData,
    records: &Records,
    cursor: &Mutex<Cursor>,
    sampling: Sampling,
    g: u64,
    seq_len: usize,
    out: &mut Batch,
) -> (usize, Vec<usize>) {
    let n = records.len() as u64;
    let mut cursor = cursor.lock().unwrap_or_else(|e| e.into_inner());
    let positions = match records.fit() {
        Some(Fit::Best) => cursor.best_row(records, data.len(), sampling, g, seq_len),
        _ => {
            let (first, end) = cursor.row(records, data.len(), sampling, g, seq_len);
            (first..end).collect()
        }
    };
    drop(cursor);
    let mut starts = Vec::new();
    let mut used = 0;
    for k in positions {
        let span = records.span(record_of(sampling, k, n) as usize, data.len());
        starts.push(used);
        used += push_record(data, span, seq_len - used, out);
    }
    (used, starts)
}

/// The share of the rows that is padding when the records of a stream of
/// `total` tokens are packed in their stored order into rows of `seq_len`,
/// as `records` packs (next fit where they are not packed).
pub fn packed_padding_share(records: &Records, total: usize, seq_len: usize) -> f64 {
    match packed_pass(records, total, seq_len) {
        (0, _) => 0.0,
        (rows, used) => 1.0 - used as f64 / (rows as usize * seq_len) as f64,
    }
}

/// The rows one pass over `records` (of a stream of `total` tokens) packs
/// into rows of `seq_len`, in their stored order, as `records` packs (next
/// fit where they are not packed); a pass in a drawn order packs about as
/// many.
pub fn packed_rows(records: &Records, total: usize, seq_len: usize) -> u64 {
    packed_pass(records, total, seq_len).0
}

/// Rows and tokens used of one pass, as [`packed_padding_share`] packs it.
fn packed_pass(records: &Records, total: usize, seq_len: usize) -> (u64, usize) {
    if records.is_empty() || seq_len == 0 {
        return (0, 0);
    }
    let n = records.len() as u64;
    let wide = |k: u64| width(records, k as usize, total).min(seq_len);
    let (mut rows, mut used) = (0u64, 0usize);
    if records.fit() == Some(Fit::Best) {
        for w in 0..n.div_ceil(WINDOW) {
            let packed = best_fit(w * WINDOW..((w + 1) * WINDOW).min(n), wide, seq_len);
            rows += packed.len() as u64;
            used += packed.iter().flatten().map(|&k| wide(k)).sum::<usize>();
        }
    } else {
        let mut cursor = Cursor::default();
        let mut g = 0u64;
        loop {
            let (a, z) = cursor.row(records, total, Sampling::Sequential, g, seq_len);
            if a >= n {
                break;
            }
            rows += 1;
            used += (a..z.min(n)).map(wide).sum::<usize>();
            g += 1;
        }
    }
    (rows, used)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(
        records: &Records,
        total: usize,
        sampling: Sampling,
        seq: usize,
        rows: u64,
    ) -> Vec<(u64, u64)> {
        let mut c = Cursor::default();
        (0..rows)
            .map(|g| c.row(records, total, sampling, g, seq))
            .collect()
    }

    #[test]
    fn rows_take_records_while_they_fit() {
        // Lengths 3, 4, 2, 9, 1: rows of 6 take {3}, {4, 2}, {9 cut}, {1, 3}, …
        let r = Records::new(vec![0, 3, 7, 9, 18]);
        let rows = rows_of(&r, 19, Sampling::Sequential, 6, 5);
        assert_eq!(rows, [(0, 1), (1, 3), (3, 4), (4, 6), (6, 8)]);
    }

    /// The starts of `n` records of lengths 1 ..= `spread` in a fixed
    /// scatter, and a stream that ends 5 tokens into the last.
    fn scattered(n: usize, spread: usize) -> (Vec<usize>, usize) {
        let starts: Vec<usize> = (0..n)
            .scan(0, |s, i| {
                let at = *s;
                *s += 1 + (i * 37 % spread);
                Some(at)
            })
            .collect();
        let total = starts.last().unwrap() + 5;
        (starts, total)
    }

    #[test]
    fn any_row_is_the_same_whichever_row_came_before() {
        let (starts, total) = scattered(500, 23);
        let r = Records::new(starts);
        // One cursor for both orders, each draw of one between the other's.
        let mut c = Cursor::default();
        let orders = [Sampling::Sequential, Sampling::Random { seed: 9 }];
        let walked = orders.map(|s| rows_of(&r, total, s, 40, 3000));
        for g in [2999u64, 5, 1024, 2048, 1023, 0, 2500, 2500] {
            for (s, walked) in orders.iter().zip(&walked) {
                assert_eq!(c.row(&r, total, *s, g, 40), walked[g as usize], "{s:?} row {g}");
            }
        }
        for walked in &walked {
            // Each row starts where the one before it ended.
            assert!(walked.windows(2).all(|w| w[0].1 == w[1].0));
        }
    }

    #[test]
    fn an_evaluation_packs_each_record_once_best_fit() {
        // Lengths 3, 4, 2, 9, 1 (ids their positions) into rows of 6, the
        // longest first: {9 cut}, {4}, {3}; then 2 into the row of 4 and 1
        // into the row of 3, which leave the least room: 3 rows where next
        // fit in stored order takes 4. Rows come in their first records'
        // order: {3, 1}, {4, 2}, {9}.
        let data = TokenData {
            tokens: (0..19).collect::<Vec<u32>>().into(),
            loss_mask: None,
            records: Some(Records::new(vec![0, 3, 7, 9, 18])),
        };
        let batches = packed_once(&data, 2, 6);
        assert_eq!(batches.iter().map(|b| b.batch).collect::<Vec<_>>(), [2, 1]);
        let inputs: Vec<u32> = batches.iter().flat_map(|b| b.inputs.clone()).collect();
        #[rustfmt::skip]
        assert_eq!(inputs, [
            0, 1, 2, 18, 0, 0,
            3, 4, 5, 6, 7, 8,
            9, 10, 11, 12, 13, 14,
        ]);
        // A record's last token has no target, nor has the padding; a cut
        // record keeps the target of its last input.
        assert_eq!(batches[0].targets[..6], [1, 2, -100, -100, -100, -100]);
        assert_eq!(batches[0].targets[6..], [4, 5, 6, -100, 8, -100]);
        assert_eq!(batches[1].targets, [10, 11, 12, 13, 14, 15]);
        assert_eq!(batches[0].lengths, Some(vec![4, 6]));
        let docs = batches[0].docs.as_ref().expect("rows of two records");
        assert_eq!((docs.start(0, 3), docs.start(1, 5), docs.start(1, 3)), (3, 4, 0));
        assert!(packed_once(&data.clone().as_stream(), 3, 6).is_empty());
    }

    /// Every record once, none over a row, and no more rows than next fit
    /// in stored order makes (on lengths that leave it room to lose).
    #[test]
    fn best_fit_rows_hold_every_record_once_in_no_more_rows() {
        let (starts, total) = scattered(400, 29);
        let data = TokenData {
            tokens: (0..total as u32).collect::<Vec<u32>>().into(),
            loss_mask: None,
            records: Some(Records::new(starts)),
        };
        let batches = packed_once(&data, 4, 32);
        let rows: usize = batches.iter().map(|b| b.batch).sum();
        let next_fit = rows_of(
            data.records.as_ref().unwrap(),
            total,
            Sampling::Sequential,
            32,
            2000,
        )
        .iter()
        .take_while(|(first, _)| *first < 400)
        .count();
        assert!(rows < next_fit, "{rows} rows, next fit {next_fit}");
        // Inputs are token positions: each record's scored inputs (all but
        // its last token, or a cut record's first 32) once each.
        let records = data.records.as_ref().unwrap();
        let mut seen: Vec<u32> = batches
            .iter()
            .flat_map(|b| b.inputs.iter().zip(&b.targets))
            .filter(|&(_, &t)| t != -100)
            .map(|(&i, _)| i)
            .collect();
        seen.sort_unstable();
        let want: Vec<u32> = (0..records.len())
            .flat_map(|r| {
                let span = records.span(r, total);
                let scored = match span.len() > 32 {
                    true => 32,
                    false => span.len() - 1,
                };
                (span.start..span.start + scored).map(|i| i as u32)
            })
            .collect();
        assert_eq!(seen, want);
    }

    /// Records of widths 1..=29 (a spread best fit can pack tight).
    fn varied(n: usize) -> (Records, usize) {
        let (starts, total) = scattered(n, 29);
        (Records::new(starts).packed_with(Fit::Best), total)
    }

    /// A best-fit run's rows cover each window's order positions once,
    /// none over a row, in fewer rows than next fit; and row g is the same
    /// whichever rows were drawn before it, by either sampling.
    #[test]
    fn best_fit_rows_are_each_windows_records_once_whatever_the_walk() {
        let (r, total) = varied(3000);
        let n = r.len() as u64;
        for sampling in [Sampling::Sequential, Sampling::Random { seed: 9 }] {
            let mut c = Cursor::default();
            let mut rows = Vec::new();
            let mut g = 0;
            // The first three windows' rows.
            while rows.iter().flatten().count() < 3 * WINDOW as usize {
                rows.push(c.best_row(&r, total, sampling, g, 40));
                g += 1;
            }
            let mut seen: Vec<u64> = rows.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..3 * WINDOW).collect::<Vec<_>>(), "{sampling:?}");
            for row in &rows {
                let wide: usize = row
                    .iter()
                    .map(|&k| width(&r, record_of(sampling, k, n) as usize, total))
                    .sum();
                assert!(wide <= 40 || row.len() == 1, "{row:?} holds {wide}");
            }
            let mut next = Cursor::default();
            let next_fit = (0..)
                .take_while(|&g| next.row(&r, total, sampling, g, 40).0 < 3 * WINDOW)
                .count();
            assert!(rows.len() < next_fit, "{} rows, next fit {next_fit}", rows.len());
            let mut again = Cursor::default();
            for g in [(rows.len() - 1) as u64, 5, 0, 400, 3, 399, 5] {
                assert_eq!(
                    again.best_row(&r, total, sampling, g, 40),
                    rows[g as usize],
                    "row {g}"
                );
            }
        }
        assert!(packed_padding_share(&r, total, 40) < packed_padding_share(&r.clone().packed(), total, 40));
    }

    #[test]
    fn padding_share_of_packed_rows() {
        // Rows of 6: {3}, {4, 2}, {9 → 6}, {1}: 1 − 16 / 24.
        let r = Records::new(vec![0, 3, 7, 9, 18]);
        assert!((packed_padding_share(&r, 19, 6) - (1.0 - 16.0 / 24.0)).abs() < 1e-12);
        assert_eq!(packed_padding_share(&Records::new(vec![]), 0, 6), 0.0);
    }
}
