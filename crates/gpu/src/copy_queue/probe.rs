//! The copy queue's check as the device opens: one round trip through
//! both queues, so that a driver whose second queue stalls or loses bytes
//! is found before a run depends on it (under `auto`, `GpuContext::open`
//! then opens the device again without it).

use std::sync::Arc;
use std::time::Duration;

use super::Failed;
use super::vulkan::Waited;
use crate::GpuContext;
use crate::host_import::HostBuffer;

/// Bytes the round trip moves: two pages, halves swapped on the way.
const BYTES: u64 = 8192;

/// Host memory → a device buffer (copy queue) → a second one with its
/// halves swapped (wgpu's queue, waiting for that copy) → host memory
/// (copy queue, waiting for wgpu's copy), compared with what was sent:
/// every edge between the two queues, imported host memory read and
/// written, and the device's writes made visible to the host, within
/// `bound`.
pub(crate) fn round_trip(ctx: &Arc<GpuContext>, bound: Duration) -> Result<(), Failed> {
    check(ctx, bound, true)
}

/// [`round_trip`]; without `swap`, wgpu's copy keeps the halves in place,
/// so the comparison must fail (its test).
pub(super) fn check(ctx: &Arc<GpuContext>, bound: Duration, swap: bool) -> Result<(), Failed> {
    let q = ctx.copy_queue.as_ref().expect("checked only with a copy queue");
    let host = || {
        HostBuffer::new(ctx, BYTES)
            .ok_or_else(|| Failed::Idle(format!("{BYTES} bytes of host memory could not be imported")))
    };
    let (mut up, down) = (host()?, host()?);
    let sent: Vec<u32> = (0..BYTES as u32 / 4)
        .map(|i| i.wrapping_mul(0x9e37_79b9) ^ 0x5a5a_0f0f)
        .collect();
    up.bytes_mut()[..BYTES as usize].copy_from_slice(bytemuck::cast_slice(&sent));
    let device = || {
        q.create_buffer(&ctx.device, BYTES, "copy queue check")
            .map_err(|e| Failed::Idle(format!("no device memory for the check: {e}")))
    };
    let (a, b) = (device()?, device()?);
    let half = BYTES / 2;
    let queued = (|| {
        q.copy(&up.buffer, &a, &[(0, 0, BYTES)], false, Vec::new())?;
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        let (lo, hi) = if swap { (half, 0) } else { (0, half) };
        enc.copy_buffer_to_buffer(&a, 0, &b, lo, half);
        enc.copy_buffer_to_buffer(&a, half, &b, hi, half);
        q.submit_wgpu(
            &ctx.queue,
            |x| x == &a || x == &b,
            || ctx.queue.submit([enc.finish()]),
        );
        q.copy(&b, &down.buffer, &[(0, 0, BYTES)], true, Vec::new())
    })();
    // Whatever was queued must be over before anything here is freed.
    let waited = q.wait_within(q.last_copy(), bound);
    if let Err(w) = waited {
        // A queue that may still run a copy keeps its memory forever.
        std::mem::forget((up, down, a, b));
        return Err(Failed::Stalled(match w {
            Waited::Stalled => format!("the round trip did not finish in {} s", bound.as_secs_f64()),
            Waited::Failed(e) => format!("waiting for the round trip failed: {e}"),
        }));
    }
    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
    for buf in [&a, &b] {
        q.forget(buf);
        buf.destroy();
    }
    queued.map_err(|e| Failed::Idle(format!("a copy could not be queued: {e}")))?;
    let got: &[u32] = bytemuck::cast_slice(&down.bytes()[..BYTES as usize]);
    let (h, n) = (half as usize / 4, sent.len());
    let want = sent[h..].iter().chain(&sent[..h]);
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None => Ok(()),
        Some(i) => Err(Failed::Idle(format!(
            "word {i} of {n} came back as {:#010x}, sent as {:#010x}",
            got[i],
            sent[(i + h) % n]
        ))),
    }
}

#[cfg(test)]
mod tests {
    use megatrain_tensor::Executor;

    use super::*;
    use crate::copy_queue::{CHECK_BOUND, CopyQueueChoice};

    /// A device whose copy queue runs on wgpu's own queue (lavapipe has
    /// one queue); `None` without host memory import.
    fn shared() -> Option<Arc<GpuContext>> {
        let c = GpuContext::with_copy_queue(CopyQueueChoice::Shared).ok()?;
        c.copy_queue.is_some().then_some(c)
    }

    #[test]
    fn the_check_finds_bytes_that_come_back_in_the_wrong_place() {
        let Some(ctx) = shared() else { return };
        check(&ctx, CHECK_BOUND, true).unwrap();
        match check(&ctx, CHECK_BOUND, false) {
            Err(Failed::Idle(w)) => assert!(w.starts_with("word 0 of 2048 came back as"), "{w}"),
            other => panic!("halves left in place: {other:?}"),
        }
    }

    /// `auto`'s queue is let go, and the transport says why; `shared`,
    /// asked for by name, is an error; a queue that passes is kept.
    #[test]
    fn a_failed_check_lets_the_queue_go_under_auto_and_is_an_error_under_shared() {
        let Some(ctx) = shared() else { return };
        let failed = || Err(Failed::Idle("word 3 of 2048 came back as 0x00000000".into()));
        let c = ctx
            .clone()
            .checked_copy_queue(CopyQueueChoice::Auto, |_| failed())
            .unwrap();
        assert!(c.copy_queue().is_none() && c.copy_queue_stats().is_none());
        let why = c.copy_queue_refused().expect("the reason is kept");
        assert!(why.contains("failed its check"), "{why}");
        assert!(why.ends_with("word 3 of 2048 came back as 0x00000000"), "{why}");
        let g = crate::GpuExecutor::new(c.clone());
        g.reserve_downloads(16, 1).unwrap();
        let reason = g.transport_info().expect("decided").reason;
        assert!(
            reason.ends_with(&format!("{why}, so every copy runs on wgpu's queue")),
            "{reason}"
        );
        let e = ctx
            .clone()
            .checked_copy_queue(CopyQueueChoice::Shared, |_| failed())
            .unwrap_err();
        assert!(e.to_string().contains("failed its check"), "{e}");
        let kept = ctx
            .clone()
            .checked_copy_queue(CopyQueueChoice::Shared, |_| Ok(()))
            .unwrap();
        assert!(Arc::ptr_eq(&kept, &ctx) && kept.copy_queue_refused().is_none());
    }
}
