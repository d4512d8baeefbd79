//! Bind groups cached by what they bind: after the first steps a streamed
//! step finds every group here and makes none.

use std::sync::atomic::Ordering;

use crate::kernels::Kernel;

/// What a bind group binds: equal keys may share one group.
#[derive(PartialEq, Eq, Hash)]
pub(crate) struct GroupKey {
    pub kernel: Kernel,
    pub uniform: (u64, u64),
    pub views: Vec<(wgpu::Buffer, u64, u64)>,
}

/// Most bind groups kept; past it the cache starts over (a workload whose
/// buffers never repeat must not grow it without bound).
const BIND_GROUP_CACHE_MAX: usize = 1 << 14;

/// Bind groups by what they bind, with counts of made and reused groups.
#[derive(Default)]
pub(crate) struct BindGroupCache {
    map: std::sync::Mutex<std::collections::HashMap<GroupKey, wgpu::BindGroup>>,
    made: std::sync::atomic::AtomicU64,
    reused: std::sync::atomic::AtomicU64,
}

impl BindGroupCache {
    pub(crate) fn get_or_make(
        &self,
        key: GroupKey,
        make: impl FnOnce(&GroupKey) -> wgpu::BindGroup,
    ) -> wgpu::BindGroup {
        let mut map = self.map.lock().expect("bind group cache poisoned");
        if let Some(g) = map.get(&key) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            return g.clone();
        }
        if map.len() >= BIND_GROUP_CACHE_MAX {
            map.clear();
        }
        self.made.fetch_add(1, Ordering::Relaxed);
        let g = make(&key);
        map.insert(key, g.clone());
        g
    }

    /// Drops every group (they keep their buffers alive).
    pub(crate) fn clear(&self) {
        self.map.lock().expect("bind group cache poisoned").clear();
    }

    pub(crate) fn stats(&self) -> BindGroupStats {
        BindGroupStats {
            made: self.made.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            cached: self.map.lock().expect("bind group cache poisoned").len() as u64,
        }
    }
}

/// Bind groups created and reused since the executor was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BindGroupStats {
    pub made: u64,
    pub reused: u64,
    pub cached: u64,
}
