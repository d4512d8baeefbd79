//! Device buffer arena: buffers are recycled by size class, so a training
//! step that asks for the same shapes every time allocates nothing after the
//! first. Accounting is in bytes of real device allocations.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Rounds a request up to its size class: 256 B minimum, then four classes per
/// power of two, so at most 25% of a buffer is slack.
pub fn size_class(bytes: u64) -> u64 {
    let b = bytes.max(256);
    let pow = 63 - b.leading_zeros() as u64; // floor(log2 b)
    if pow < 2 {
        return 256;
    }
    let step = 1u64 << (pow - 2);
    b.div_ceil(step) * step
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes held by live tensors.
    pub live_bytes: u64,
    /// Highest `live_bytes` seen since the last `reset_peak`.
    pub peak_bytes: u64,
    /// Bytes sitting in the free pool, ready for reuse.
    pub pooled_bytes: u64,
    /// Number of device allocations made so far (pool misses).
    pub allocations: u64,
}

/// Free buffers by size class, each class ordered by creation: a request
/// takes the oldest free buffer, so a step that makes the same requests as
/// the last one gets the same buffers (and the cached bind groups over
/// them) — a LIFO pool would hand them out in a new order every step.
#[derive(Default)]
struct State {
    free: HashMap<u64, BTreeMap<u64, wgpu::Buffer>>,
    stats: ArenaStats,
    next_serial: u64,
}

pub struct Arena {
    device: wgpu::Device,
    state: Mutex<State>,
    /// Allocations still to be refused as if the device were out of memory
    /// ([`Arena::fail_next_allocations`]).
    fail_next: AtomicU64,
}

/// A device buffer on loan from the arena; it goes back to the pool on drop.
/// Adopted buffers (weight slots, whose usage differs from the pool's) are
/// counted the same way but released on drop instead of pooled.
pub struct PooledBuffer {
    buffer: Option<wgpu::Buffer>,
    serial: u64,
    class: u64,
    arena: Arc<Arena>,
    pooled: bool,
    /// Bumped by every write into the buffer after its first use
    /// ([`PooledBuffer::note_write`]): what the maxima and f16 copies
    /// remembered with its tensors are checked against
    /// (`crate::tensor::Derived`).
    generation: AtomicU64,
}

impl PooledBuffer {
    /// The number of in-place writes noted so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Notes that the buffer's contents are about to change (an in-place op,
    /// a weight reload): every max and f16 copy remembered for any tensor
    /// over it is stale from now on.
    pub fn note_write(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("buffer present until drop")
    }

    pub fn class_bytes(&self) -> u64 {
        self.class
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            let mut st = self.arena.state.lock().expect("arena poisoned");
            st.stats.live_bytes -= self.class;
            if self.pooled {
                st.stats.pooled_bytes += self.class;
                st.free.entry(self.class).or_default().insert(self.serial, b);
            } else {
                drop(st);
                b.destroy();
            }
        }
    }
}

impl Arena {
    pub fn new(device: wgpu::Device) -> Arc<Self> {
        Arc::new(Arena {
            device,
            state: Mutex::new(State::default()),
            fail_next: AtomicU64::new(0),
        })
    }

    /// A buffer of at least `bytes` bytes; its contents are unspecified.
    /// `Err(class)`: the device had no memory for a new buffer of that
    /// size class and none of it was free in the pool. The pool's buffers
    /// of other classes are device memory too, but cached bind groups may
    /// hold them: the executor, which owns those, trims and asks again.
    pub fn alloc(self: &Arc<Self>, bytes: u64) -> Result<PooledBuffer, u64> {
        let class = size_class(bytes);
        let reused = {
            let mut st = self.state.lock().expect("arena poisoned");
            let reused = st.free.get_mut(&class).and_then(BTreeMap::pop_first);
            if reused.is_some() {
                st.stats.pooled_bytes -= class;
            }
            reused
        };
        let (serial, buffer) = match reused {
            Some(b) => b,
            None => {
                // Made outside the lock: a device error is reported while
                // it is made, and no panic may leave the pool poisoned.
                let b = self.create(class).ok_or(class)?;
                let mut st = self.state.lock().expect("arena poisoned");
                st.stats.allocations += 1;
                st.next_serial += 1;
                (st.next_serial, b)
            }
        };
        let mut st = self.state.lock().expect("arena poisoned");
        st.stats.live_bytes += class;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.live_bytes);
        Ok(PooledBuffer {
            buffer: Some(buffer),
            serial,
            class,
            arena: self.clone(),
            pooled: true,
            generation: AtomicU64::new(0),
        })
    }

    /// A new buffer of `class` bytes, or `None` where the device is out of
    /// memory (or a refusal was injected).
    fn create(&self, class: u64) -> Option<wgpu::Buffer> {
        let injected = self
            .fail_next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if injected {
            return None;
        }
        create_buffer_checked(
            &self.device,
            &wgpu::BufferDescriptor {
                label: Some("arena"),
                size: class,
                usage: USAGE,
                mapped_at_creation: false,
            },
        )
    }

    /// The next `n` new buffers are refused as if the device were out of
    /// memory (buffers reused from the pool are not): for testing what a
    /// run does when the device is full, which no software adapter is.
    pub fn fail_next_allocations(&self, n: u64) {
        self.fail_next.store(n, Ordering::Release);
    }

    /// Accounts a buffer made elsewhere as live device memory until dropped.
    pub fn adopt(self: &Arc<Self>, buffer: wgpu::Buffer) -> PooledBuffer {
        let class = buffer.size();
        let mut st = self.state.lock().expect("arena poisoned");
        st.stats.allocations += 1;
        st.stats.live_bytes += class;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.live_bytes);
        st.next_serial += 1;
        PooledBuffer {
            buffer: Some(buffer),
            serial: st.next_serial,
            class,
            arena: self.clone(),
            pooled: false,
            generation: AtomicU64::new(0),
        }
    }

    pub fn stats(&self) -> ArenaStats {
        self.state.lock().expect("arena poisoned").stats
    }

    pub fn reset_peak(&self) {
        let mut st = self.state.lock().expect("arena poisoned");
        st.stats.peak_bytes = st.stats.live_bytes;
    }

    /// Frees every pooled buffer.
    pub fn trim(&self) {
        let mut st = self.state.lock().expect("arena poisoned");
        for (_, v) in st.free.drain() {
            for b in v.into_values() {
                b.destroy();
            }
        }
        st.stats.pooled_bytes = 0;
    }
}

/// A new buffer, or `None` where the device is out of memory: caught by an
/// error scope, which wgpu would otherwise hand to its uncaptured-error
/// handler (a panic by default).
pub(crate) fn create_buffer_checked(
    device: &wgpu::Device,
    desc: &wgpu::BufferDescriptor<'_>,
) -> Option<wgpu::Buffer> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let b = device.create_buffer(desc);
    match pollster::block_on(scope.pop()) {
        None => Some(b),
        Some(_) => {
            b.destroy();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_bound_slack() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 320);
        assert_eq!(size_class(1024), 1024);
        assert_eq!(size_class(1025), 1280);
        for b in (1..5000u64).chain([1 << 20, (1 << 20) + 1, 123_456_789]) {
            let c = size_class(b);
            assert!(c >= b && c.is_multiple_of(4), "{b} -> {c}");
            assert!(c <= 256.max(b + b / 4 + 4), "{b} -> {c} too much slack");
        }
    }
}
