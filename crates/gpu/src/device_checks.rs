//! Checks a kernel family passes on a device before `auto` uses it (the
//! tensor-core attention per head dimension, `exec/attention_check.rs`; the
//! tensor-core matmul per tile, `exec/matmul_check.rs`): each run once per
//! key and device, its outcome kept with the context.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Outcomes by key: `Ok`, or why the family was let go.
pub(crate) struct DeviceChecks<K>(Mutex<BTreeMap<K, Result<(), String>>>);

impl<K> Default for DeviceChecks<K> {
    fn default() -> Self {
        DeviceChecks(Mutex::new(BTreeMap::new()))
    }
}

impl<K: Ord + Clone> DeviceChecks<K> {
    /// Whether `key` passed, running `check` on first asking.
    pub(crate) fn passed(&self, key: K, check: impl FnOnce() -> Result<(), String>) -> bool {
        let mut map = self.0.lock().expect("device checks poisoned");
        map.entry(key).or_insert_with(check).is_ok()
    }

    /// The keys that failed, in order, and why.
    pub(crate) fn refused(&self) -> Vec<(K, String)> {
        let map = self.0.lock().expect("device checks poisoned");
        map.iter()
            .filter_map(|(k, r)| r.as_ref().err().map(|e| (k.clone(), e.clone())))
            .collect()
    }
}
