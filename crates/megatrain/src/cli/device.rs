//! Choosing the executor once, at the top; the rest is generic over it.

use megatrain::run::{DeviceChoice, TransportKnobs};
use megatrain_gpu::{GpuContext, GpuExecutor, TransportChoice};
use megatrain_tensor::CpuExecutor;

// Built once per command; boxing would only hide the executor type.
#[allow(clippy::large_enum_variant)]
pub enum Exec {
    Cpu(CpuExecutor),
    Gpu(GpuExecutor),
}

/// Runs `$body` with `$ex` bound to whichever executor `$exec` holds.
macro_rules! on_executor {
    ($exec:expr, $ex:ident => $body:expr) => {
        match $exec {
            $crate::cli::device::Exec::Cpu($ex) => $body,
            $crate::cli::device::Exec::Gpu($ex) => $body,
        }
    };
}
pub(crate) use on_executor;

/// `auto`: a hardware GPU adapter if there is one, else the CPU with a
/// warning (a software adapter such as lavapipe is slower than the CPU
/// executor); `gpu`: any adapter, lavapipe included; `cpu`: the CPU.
/// `transport` and `knobs` are how a GPU executor moves layers (refused
/// with `cpu`, ignored with a warning where `auto` falls back to the CPU).
/// Ranks of a data parallel run on one machine each take their own adapter
/// (by local rank) unless `MEGATRAIN_ADAPTER` names one.
pub fn open(
    choice: DeviceChoice,
    transport: TransportChoice,
    knobs: TransportKnobs,
    quiet: bool,
) -> anyhow::Result<Exec> {
    knobs.validate()?;
    let context = || {
        let wanted = std::env::var(megatrain_gpu::ADAPTER_ENV)
            .ok()
            .filter(|s| !s.is_empty());
        GpuContext::with_adapter_choice(wanted.as_deref(), megatrain::dist::local_rank().unwrap_or(0))
    };
    let gpu = |ctx: std::sync::Arc<GpuContext>| -> anyhow::Result<Exec> {
        knobs.check_adapter(ctx.limits.max_buffer_size)?;
        let mut options = knobs.gpu_options(transport).with_env()?;
        // The node's ranks take its GPUs in turn: a device several of them
        // share gives each its part (`--keep-activations auto` sizes by it).
        options.device_ranks = megatrain::dist::ranks_per_device(
            megatrain::dist::local_rank().unwrap_or(0),
            megatrain::dist::local_size().unwrap_or(1),
            ctx.peers,
        );
        Ok(Exec::Gpu(GpuExecutor::with_options(ctx, options)))
    };
    let cpu_fallback = || {
        if knobs.is_set() {
            eprintln!(
                "warning: {} ignored on the CPU (no transport)",
                knobs.flags_set().join(", ")
            );
        }
        Exec::Cpu(CpuExecutor::new())
    };
    let say = |m: String| {
        if !quiet {
            eprintln!("{m}");
        }
    };
    match choice {
        DeviceChoice::Cpu => {
            knobs.refuse_on_cpu()?;
            say("device: CPU".into());
            Ok(Exec::Cpu(CpuExecutor::new()))
        }
        DeviceChoice::Gpu => {
            let ctx = context().map_err(|e| anyhow::anyhow!("--device gpu: {e}"))?;
            say(format!("device: {}", ctx.info));
            gpu(ctx)
        }
        DeviceChoice::Auto => match context() {
            Ok(ctx) if ctx.info.device_type != "Cpu" => {
                say(format!("device: {}", ctx.info));
                gpu(ctx)
            }
            Ok(ctx) => {
                eprintln!(
                    "warning: the only GPU adapter is a software one ({}); running on the CPU \
                     (--device gpu uses it anyway)",
                    ctx.info.name
                );
                Ok(cpu_fallback())
            }
            Err(e) => {
                eprintln!("warning: no GPU adapter ({e}); running on the CPU");
                Ok(cpu_fallback())
            }
        },
    }
}
