//! Measures host bytes per parameter of a fully touched tier (params
//! written, transport refreshed, one AdamW-like pass over m and v) as peak
//! RSS, and optionally a checkpoint save and load.
//!
//! cargo run --release -p megatrain-tier --example tier_rss -- \
//!     [params_millions=300] [layers=24] [bf16|f32] [checkpoint_dir|-] [ram_budget_mib]
//!
//! With a RAM budget, layers past it spill to files in the system temp
//! directory and are evicted after their update.

use std::time::Instant;

use megatrain_tensor::ParamTable;
use megatrain_tier::{HostTier, TierConfig, load_checkpoint, plan, rss, save_checkpoint};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let millions: usize = args.first().map_or(Ok(300), |s| s.parse())?;
    let n_layers: usize = args.get(1).map_or(Ok(24), |s| s.parse())?;
    let transport = args.get(2).map_or(Ok(Default::default()), |s| s.parse())?;
    let ckpt = args.get(3).filter(|s| *s != "-").map(std::path::PathBuf::from);
    let budget: Option<u64> = args
        .get(4)
        .map(|s| s.parse::<u64>().map(|m| m << 20))
        .transpose()?;

    // Square weights plus an odd bias, so layers are not page multiples.
    let per_layer = millions * 1_000_000 / n_layers;
    let d = (per_layer as f64).sqrt() as usize;
    let tables: Vec<ParamTable> = (0..n_layers)
        .map(|l| {
            let mut t = ParamTable::new();
            t.push(format!("layers.{l}.w"), [d, d], true).unwrap();
            t.push(format!("layers.{l}.b"), [per_layer - d * d], false)
                .unwrap();
            t
        })
        .collect();
    let config = TierConfig {
        shard: None,
        transport,
        hold_grads: false,
        grads_on_device: Vec::new(),
        ram_budget_bytes: budget,
        spill_dir: budget.map(|_| std::env::temp_dir()),
        shared_transport: None,
    };
    let planned = plan(&tables, &config)?;
    println!("plan:\n{planned}");

    let base = rss::current_rss_bytes().unwrap_or(0);
    rss::reset_peak_rss();
    let t0 = Instant::now();
    let mut tier = HostTier::new(tables, config)?;
    let after_alloc = rss::current_rss_bytes().unwrap_or(0);
    for (l, layer) in tier.layers_mut().iter_mut().enumerate() {
        for (i, p) in layer.params_mut().iter_mut().enumerate() {
            *p = ((i + l) % 1000) as f32 * 1e-3;
        }
        layer.refresh_transport();
        layer.evict()?;
    }
    for layer in tier.layers_mut() {
        let s = layer.parts_mut();
        for ((p, m), v) in s.params.iter_mut().zip(s.m.iter_mut()).zip(s.v.iter_mut()) {
            let g = *p * 0.5;
            *m = 0.1 * g;
            *v = 0.001 * g * g;
            *p -= 1e-3 * *m / (v.sqrt() + 1e-8);
        }
        *s.step += 1;
        layer.refresh_transport();
        layer.evict()?;
    }
    let n = tier.n_params() as f64;
    let peak = rss::peak_rss_bytes().unwrap_or(0);
    println!(
        "{} params: alloc+touch {:.2?}; rss after alloc +{:.1} MiB; peak rss {:.3} B/param above baseline ({:.3} B/param incl. baseline {:.1} MiB); report {:.3} B/param",
        tier.n_params(),
        t0.elapsed(),
        (after_alloc.saturating_sub(base)) as f64 / (1 << 20) as f64,
        peak.saturating_sub(base) as f64 / n,
        peak as f64 / n,
        base as f64 / (1 << 20) as f64,
        tier.report().ram_bytes_per_param(),
    );

    if let Some(dir) = ckpt {
        let t = Instant::now();
        save_checkpoint(&dir, &tier, &serde_json::json!({"example": true}))?;
        let peak_save = rss::peak_rss_bytes().unwrap_or(0);
        println!(
            "save {:.2?}; peak rss {:.3} B/param above baseline",
            t.elapsed(),
            peak_save.saturating_sub(base) as f64 / n
        );
        let t = Instant::now();
        load_checkpoint(&dir, &mut tier)?;
        let peak_load = rss::peak_rss_bytes().unwrap_or(0);
        println!(
            "load {:.2?}; peak rss {:.3} B/param above baseline",
            t.elapsed(),
            peak_load.saturating_sub(base) as f64 / n
        );
    }
    Ok(())
}
