//! Choosing the executor once, at the top; the rest is generic over it.

use megatrain::run::DeviceChoice;
use megatrain_gpu::{GpuContext, GpuExecutor, GpuOptions, TransportChoice};
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
/// `transport` is how a GPU executor moves layers (ignored on the CPU).
/// Ranks of a data parallel run on one machine each take their own adapter
/// (by local rank) unless `MEGATRAIN_ADAPTER` names one.
pub fn open(choice: DeviceChoice, transport: TransportChoice, quiet: bool) -> anyhow::Result<Exec> {
    let context = || {
        let wanted = std::env::var(megatrain_gpu::ADAPTER_ENV)
            .ok()
            .filter(|s| !s.is_empty());
        GpuContext::with_adapter_choice(wanted.as_deref(), megatrain::dist::local_rank().unwrap_or(0))
    };
    let gpu = |ctx| {
        GpuExecutor::with_options(
            ctx,
            GpuOptions {
                transport,
                ..GpuOptions::default()
            },
        )
    };
    let say = |m: String| {
        if !quiet {
            eprintln!("{m}");
        }
    };
    match choice {
        DeviceChoice::Cpu => {
            say("device: CPU".into());
            Ok(Exec::Cpu(CpuExecutor::new()))
        }
        DeviceChoice::Gpu => {
            let ctx = context().map_err(|e| anyhow::anyhow!("--device gpu: {e}"))?;
            say(format!("device: {}", ctx.info));
            Ok(Exec::Gpu(gpu(ctx)))
        }
        DeviceChoice::Auto => match context() {
            Ok(ctx) if ctx.info.device_type != "Cpu" => {
                say(format!("device: {}", ctx.info));
                Ok(Exec::Gpu(gpu(ctx)))
            }
            Ok(ctx) => {
                eprintln!(
                    "warning: the only GPU adapter is a software one ({}); running on the CPU \
                     (--device gpu uses it anyway)",
                    ctx.info.name
                );
                Ok(Exec::Cpu(CpuExecutor::new()))
            }
            Err(e) => {
                eprintln!("warning: no GPU adapter ({e}); running on the CPU");
                Ok(Exec::Cpu(CpuExecutor::new()))
            }
        },
    }
}
