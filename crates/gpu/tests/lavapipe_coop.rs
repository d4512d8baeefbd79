//! `MEGATRAIN_LAVAPIPE_COOP=1` (its own test binary: it sets the variable
//! for the whole process). On lavapipe with cooperative matrices (Mesa 26,
//! `tools/lavapipe_coop.sh`) the device opens with the tensor-core kernels
//! and the workgroup memory of the largest; where the adapter has none
//! (Debian 12's Mesa 22, CI's normal run) opening fails and says why,
//! rather than running the tests it was asked for without them. CI runs
//! it under `tools/lavapipe_coop.sh` too.

use megatrain_gpu::{GpuContext, GpuError, LAVAPIPE_COOP_ENV};

#[test]
fn asking_for_lavapipes_tensor_cores_opens_them_or_says_why_not() {
    // SAFETY: the only test of this binary; nothing else reads the
    // environment concurrently.
    unsafe { std::env::set_var(LAVAPIPE_COOP_ENV, "1") };
    match GpuContext::new() {
        Ok(c) => {
            assert!(c.is_lavapipe_coop(), "{}", c.info);
            assert!(c.has_cooperative_matrix());
            assert!(c.workgroup_bytes() >= 48 << 10);
            // Mesa 26 imports host memory, so the device opened through
            // wgpu-hal (as on NVIDIA, for uploads from the tier), and the
            // tensor-core runs in CI test that device, not wgpu's own.
            assert!(c.can_import_host_memory(), "{}", c.info);
        }
        Err(e @ GpuError::LavapipeCoop { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("MEGATRAIN_LAVAPIPE_COOP=1"), "{msg}");
            eprintln!("refused as it should be here: {msg}");
        }
        Err(GpuError::NoAdapter { .. }) if std::env::var("CI").is_err() => {
            eprintln!("skipping: no adapter");
        }
        Err(e) => panic!("{e}"),
    }
}
