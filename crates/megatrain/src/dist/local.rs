//! [`Collective`] between threads of one process: each rank is a thread
//! with its own trainer. It moves no bytes between machines; it exists so
//! data parallel training can be tested without MPI (and with sums whose
//! order never depends on a message's size: every element is summed in
//! rank order, so results are reproducible to the bit whatever the chunks).
//!
//! An operation completes when every rank has waited on it: the first
//! wait blocks until every rank has started it, each rank then reads the
//! others' buffers and writes its own, and no rank returns (so no buffer
//! is released or written) until every rank has done so. Every rank calls
//! the same operations in the same order, as with MPI.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{Collective, DistError, Elem, InFlight, Result};

/// One rank of a group made by [`local_group`].
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
    /// Sequence number of this rank's next operation.
    next: Mutex<u64>,
}

/// Ranks `0..size` of one group, to be moved into one thread each: one
/// machine, as far as [`Collective::split_machine`] tells.
pub fn local_group(size: usize) -> Vec<LocalComm> {
    local_machines(size, size)
}

/// [`local_group`] on machines of `per_machine` consecutive ranks each (the
/// last may hold fewer), for [`Collective::split_machine`].
pub fn local_machines(size: usize, per_machine: usize) -> Vec<LocalComm> {
    let group = Group::new(size, per_machine.max(1));
    (0..size)
        .map(|rank| LocalComm::new(rank, group.clone()))
        .collect()
}

struct Group {
    size: usize,
    per_machine: usize,
    state: Mutex<State>,
    cv: Condvar,
    /// Groups made by splitting this one, by the split's operation
    /// number and colour: the first rank to get there makes it.
    parts: Mutex<HashMap<(u64, usize), Arc<Group>>>,
}

impl Group {
    fn new(size: usize, per_machine: usize) -> Arc<Self> {
        Arc::new(Group {
            size,
            per_machine,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            parts: Mutex::new(HashMap::new()),
        })
    }
}

#[derive(Default)]
struct State {
    ops: HashMap<u64, Op>,
    aborted: bool,
}

/// One operation: every rank's part, and how many ranks are done with it.
#[derive(Default)]
struct Op {
    posts: Vec<Option<Post>>,
    done: usize,
    left: usize,
}

/// A rank's buffers (addresses: the caller keeps them valid, see the
/// `Collective` contracts) and what to do with them.
#[derive(Clone)]
enum Post {
    Sum {
        send: usize,
        recv: usize,
        len: usize,
    },
    ReduceScatter {
        send: usize,
        recv: usize,
        ranges: Vec<Range<usize>>,
    },
    AllGather {
        buf: usize,
        elem: Elem,
        ranges: Vec<Range<usize>>,
    },
}

fn lock(g: &Group) -> MutexGuard<'_, State> {
    g.state.lock().unwrap_or_else(|e| e.into_inner())
}

fn aborted() -> DistError {
    DistError::Invalid("another rank of the local group aborted".into())
}

/// An operation this rank has started.
struct Pending {
    group: Arc<Group>,
    rank: usize,
    seq: u64,
    done: bool,
}

impl Pending {
    fn wait_inner(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let g = &*self.group;
        let mut st = lock(g);
        let posts = loop {
            if st.aborted {
                return Err(aborted());
            }
            let op = st.ops.get(&self.seq).expect("posted before waiting");
            if op.posts.iter().all(Option::is_some) {
                break op
                    .posts
                    .iter()
                    .map(|p| p.clone().expect("all posted"))
                    .collect::<Vec<_>>();
            }
            st = g.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        };
        drop(st);
        // SAFETY: every rank's buffers stay valid until every rank has
        // passed the second barrier below (each rank's `wait` or drop);
        // each rank writes only its own receive buffer, and in place only
        // outside its own range, which no other rank writes.
        unsafe { complete(&posts, self.rank) };
        let mut st = lock(g);
        st.ops.get_mut(&self.seq).expect("still there").done += 1;
        g.cv.notify_all();
        loop {
            if st.aborted {
                return Err(aborted());
            }
            let op = st.ops.get(&self.seq).expect("still there");
            if op.done == g.size {
                break;
            }
            st = g.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        let op = st.ops.get_mut(&self.seq).expect("still there");
        op.left += 1;
        if op.left == g.size {
            st.ops.remove(&self.seq);
        }
        Ok(())
    }
}

impl InFlight for Pending {
    fn wait(mut self: Box<Self>) -> Result<()> {
        self.wait_inner()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let _ = self.wait_inner();
    }
}

/// This rank's result of an operation whose every part is `posts`.
///
/// # Safety
/// The addresses in `posts` must be valid for what each names.
unsafe fn complete(posts: &[Post], rank: usize) {
    match &posts[rank] {
        Post::Sum { recv, len, .. } => unsafe { sum_into(*recv as *mut f32, *len, posts, 0) },
        Post::ReduceScatter { recv, ranges, .. } => {
            let r = ranges[rank].clone();
            unsafe { sum_into(*recv as *mut f32, r.len(), posts, r.start) }
        }
        Post::AllGather { buf, elem, ranges } => {
            let size = elem.size();
            for (k, p) in posts.iter().enumerate() {
                let Post::AllGather { buf: theirs, .. } = p else {
                    unreachable!("checked in `post`")
                };
                if k == rank || ranges[k].is_empty() {
                    continue;
                }
                let (at, n) = (ranges[k].start * size, ranges[k].len() * size);
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (*theirs as *const u8).add(at),
                        (*buf as *mut u8).add(at),
                        n,
                    )
                };
            }
        }
    }
}

/// `out[i] = Σ_k send_k[at + i]` for `i < len`, added in rank order.
///
/// # Safety
/// `out` must be valid for `len` writes and every send for `at + len` reads.
unsafe fn sum_into(out: *mut f32, len: usize, posts: &[Post], at: usize) {
    let out = unsafe { std::slice::from_raw_parts_mut(out, len) };
    out.fill(0.0);
    for p in posts {
        let send = match p {
            Post::Sum { send, .. } | Post::ReduceScatter { send, .. } => *send as *const f32,
            Post::AllGather { .. } => unreachable!("checked in `post`"),
        };
        let send = unsafe { std::slice::from_raw_parts(send.add(at), len) };
        for (o, x) in out.iter_mut().zip(send) {
            *o += x;
        }
    }
}

impl LocalComm {
    fn new(rank: usize, group: Arc<Group>) -> Self {
        LocalComm {
            rank,
            group,
            next: Mutex::new(0),
        }
    }

    /// Posts this rank's part of its next operation.
    fn post(&self, post: Post) -> Result<Box<dyn InFlight>> {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let seq = *next;
        *next += 1;
        let g = &*self.group;
        let mut st = lock(g);
        if st.aborted {
            return Err(aborted());
        }
        let op = st.ops.entry(seq).or_insert_with(|| Op {
            posts: vec![None; g.size],
            ..Op::default()
        });
        if let Some(other) = op.posts.iter().flatten().next()
            && std::mem::discriminant(other) != std::mem::discriminant(&post)
        {
            return Err(DistError::Invalid(format!(
                "rank {}: operation {seq} is not the one the other ranks started",
                self.rank
            )));
        }
        op.posts[self.rank] = Some(post);
        g.cv.notify_all();
        Ok(Box::new(Pending {
            group: self.group.clone(),
            rank: self.rank,
            seq,
            done: false,
        }))
    }
}

impl Collective for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn engine(&self) -> &'static str {
        "local threads"
    }

    fn sum_f64(&self, x: &mut [f64]) -> Result<()> {
        // Every rank's values are all-gathered as bytes (16-bit words) and
        // added in rank order: an f64 sum must not round through f32.
        let (size, n) = (self.size(), x.len());
        let mut all = vec![0u8; 8 * n * size];
        for (i, v) in x.iter().enumerate() {
            let at = 8 * (n * self.rank + i);
            all[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        let ranges: Vec<Range<usize>> = (0..size).map(|k| 4 * n * k..4 * n * (k + 1)).collect();
        // SAFETY: `all` outlives the blocking wait.
        unsafe { self.start_all_gather(all.as_mut_ptr(), Elem::U16, &ranges) }?.wait()?;
        for (i, v) in x.iter_mut().enumerate() {
            *v = (0..size)
                .map(|k| {
                    let at = 8 * (n * k + i);
                    f64::from_le_bytes(all[at..at + 8].try_into().expect("8 bytes"))
                })
                .sum();
        }
        Ok(())
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<()> {
        let mut len = [if self.rank == 0 { bytes.len() as f64 } else { 0.0 }];
        self.sum_f64(&mut len)?;
        let n = len[0] as usize;
        // An all-gather of 16-bit words of which rank 0 owns every one.
        let words = n.div_ceil(2);
        let mut buf = vec![0u8; 2 * words];
        if self.rank == 0 {
            buf[..n].copy_from_slice(bytes);
        }
        let mut ranges = vec![words..words; self.size()];
        ranges[0] = 0..words;
        // SAFETY: `buf` outlives the blocking wait.
        unsafe { self.start_all_gather(buf.as_mut_ptr(), Elem::U16, &ranges) }?.wait()?;
        buf.truncate(n);
        *bytes = buf;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        // An operation completes when every rank has waited on it.
        let ranges = vec![0..0; self.size()];
        // SAFETY: no rank's range holds an element, so no byte is read or
        // written.
        unsafe { self.start_all_gather(std::ptr::NonNull::dangling().as_ptr(), Elem::U16, &ranges) }?.wait()
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Collective>> {
        let seq = *self.next.lock().unwrap_or_else(|e| e.into_inner());
        let mut colors = vec![0.0; self.size()];
        colors[self.rank] = color as f64;
        self.sum_f64(&mut colors)?;
        let same: Vec<usize> = (0..self.size()).filter(|&r| colors[r] == color as f64).collect();
        let rank = same
            .iter()
            .position(|&r| r == self.rank)
            .expect("this rank has its colour");
        let group = self
            .group
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((seq, color))
            .or_insert_with(|| Group::new(same.len(), same.len()))
            .clone();
        Ok(Arc::new(LocalComm::new(rank, group)))
    }

    fn split_machine(&self) -> Result<Arc<dyn Collective>> {
        self.split(self.rank / self.group.per_machine)
    }

    fn gather_f32_to_root(&self, buf: &mut [f32], ranges: &[Range<usize>]) -> Result<()> {
        // An all-gather, of which only rank 0's result is kept.
        let mut copy = buf.to_vec();
        // SAFETY: `copy` outlives the blocking wait.
        unsafe { self.start_all_gather(copy.as_mut_ptr().cast(), Elem::F32, ranges) }?.wait()?;
        if self.rank == 0 {
            buf.copy_from_slice(&copy);
        }
        Ok(())
    }

    unsafe fn start_sum(&self, send: *const f32, recv: *mut f32, len: usize) -> Result<Box<dyn InFlight>> {
        self.post(Post::Sum {
            send: send as usize,
            recv: recv as usize,
            len,
        })
    }

    unsafe fn start_reduce_scatter(
        &self,
        send: *const f32,
        recv: *mut f32,
        ranges: &[Range<usize>],
    ) -> Result<Box<dyn InFlight>> {
        self.post(Post::ReduceScatter {
            send: send as usize,
            recv: recv as usize,
            ranges: ranges.to_vec(),
        })
    }

    unsafe fn start_all_gather(
        &self,
        buf: *mut u8,
        elem: Elem,
        ranges: &[Range<usize>],
    ) -> Result<Box<dyn InFlight>> {
        self.post(Post::AllGather {
            buf: buf as usize,
            elem,
            ranges: ranges.to_vec(),
        })
    }

    fn abort(&self, code: i32) -> ! {
        lock(&self.group).aborted = true;
        self.group.cv.notify_all();
        panic!("rank {} of a local group aborted (code {code})", self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ranks<T: Send>(size: usize, f: impl Fn(&LocalComm) -> T + Sync) -> Vec<T> {
        let comms = local_group(size);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn sums_scatter_and_gather_in_rank_order() {
        let out = on_ranks(3, |c| {
            let r = c.rank() as f32;
            let send: Vec<f32> = (0..7).map(|i| r * 10.0 + i as f32).collect();
            let mut sum = vec![0.0f32; 7];
            let ranges = [0..3, 3..3, 3..7];
            let mut part = vec![0.0f32; ranges[c.rank()].len()];
            let mut buf: Vec<u16> = vec![u16::MAX; 7];
            for i in ranges[c.rank()].clone() {
                buf[i] = (100 * c.rank() + i) as u16;
            }
            // SAFETY: every buffer outlives its operation's wait below.
            unsafe {
                let a = c.start_sum(send.as_ptr(), sum.as_mut_ptr(), 7).unwrap();
                let b = c
                    .start_reduce_scatter(send.as_ptr(), part.as_mut_ptr(), &ranges)
                    .unwrap();
                let g = c
                    .start_all_gather(buf.as_mut_ptr().cast(), Elem::U16, &ranges)
                    .unwrap();
                // Waited out of order: completes all the same.
                g.wait().unwrap();
                b.wait().unwrap();
                a.wait().unwrap();
            }
            let mut x = [c.rank() as f64 + 0.5];
            c.sum_f64(&mut x).unwrap();
            let mut bytes = if c.rank() == 0 {
                b"hello".to_vec()
            } else {
                Vec::new()
            };
            c.broadcast_bytes(&mut bytes).unwrap();
            (sum, part, buf, x[0], bytes)
        });
        let want: Vec<f32> = (0..7).map(|i| 30.0 + 3.0 * i as f32).collect();
        for (rank, (sum, part, buf, x, bytes)) in out.into_iter().enumerate() {
            assert_eq!(sum, want);
            let r = [0..3, 3..3, 3..7][rank].clone();
            assert_eq!(part, want[r].to_vec());
            assert_eq!(buf, [0, 1, 2, 203, 204, 205, 206]);
            assert_eq!(x, 4.5);
            assert_eq!(bytes, b"hello");
        }
    }

    #[test]
    fn splits_group_ranks_by_colour_and_machine() {
        let comms = local_machines(5, 2);
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let m = c.split_machine().unwrap();
                        let odd = c.split(c.rank() % 2).unwrap();
                        // Each part sums on its own.
                        let mut x = [c.rank() as f64];
                        odd.sum_f64(&mut x).unwrap();
                        m.barrier().unwrap();
                        c.barrier().unwrap();
                        (m.rank(), m.size(), odd.rank(), odd.size(), x[0])
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            out,
            [
                (0, 2, 0, 3, 6.0),
                (1, 2, 0, 2, 4.0),
                (0, 2, 1, 3, 6.0),
                (1, 2, 1, 2, 4.0),
                (0, 1, 2, 3, 6.0)
            ]
        );
    }

    #[test]
    fn a_barrier_waits_for_every_rank() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let arrived = AtomicUsize::new(0);
        let seen = on_ranks(3, |c| {
            if c.rank() == 2 {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            arrived.fetch_add(1, Ordering::SeqCst);
            c.barrier().unwrap();
            arrived.load(Ordering::SeqCst)
        });
        assert_eq!(seen, [3, 3, 3]);
    }

    #[test]
    fn gather_to_root_fills_rank_zero_only() {
        let out = on_ranks(2, |c| {
            let ranges = [0..2, 2..5];
            let mut buf = vec![-1.0f32; 5];
            for i in ranges[c.rank()].clone() {
                buf[i] = (c.rank() * 10 + i) as f32;
            }
            c.gather_f32_to_root(&mut buf, &ranges).unwrap();
            buf
        });
        assert_eq!(out[0], [0.0, 1.0, 12.0, 13.0, 14.0]);
        assert_eq!(out[1], [-1.0, -1.0, 12.0, 13.0, 14.0]);
    }
}
