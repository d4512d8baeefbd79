//! Criterion bench of a checkpoint of 32M parameters (384 MiB of p, m and
//! v): saving it (written, synced and renamed, with each tensor's CRC-32),
//! loading it (the CRCs taken as the data is copied) and checking the
//! model file's CRCs alone, as `export`, `sample` and `eval` do. The files
//! go to `MEGATRAIN_BENCH_DIR` (default: the system's temporary directory),
//! so the disk there is part of what `save` measures; `load` and `verify`
//! read files the page cache holds.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use megatrain_tensor::ParamTable;
use megatrain_tier::{
    HostTier, MODEL_FILE, TierConfig, TransportDType, load_checkpoint, save_checkpoint,
    verify_checkpoint_file,
};

const LAYERS: usize = 8;
const ROWS: usize = 4096;
const COLS: usize = 1024;

fn tier() -> HostTier {
    let tables = (0..LAYERS)
        .map(|l| {
            let mut t = ParamTable::new();
            t.push(format!("layers.{l}.w"), [ROWS, COLS], true).unwrap();
            t.push(format!("layers.{l}.b"), [COLS], false).unwrap();
            t
        })
        .collect();
    let cfg = TierConfig {
        shard: None,
        transport: TransportDType::BF16,
        hold_grads: false,
        grads_on_device: Vec::new(),
        ram_budget_bytes: None,
        spill_dir: None,
        shared_transport: None,
    };
    let mut tier = HostTier::new(tables, cfg).unwrap();
    for layer in tier.layers_mut() {
        let parts = layer.parts_mut();
        for (i, x) in parts.params.iter_mut().enumerate() {
            *x = (i % 1000) as f32 * 1e-3;
        }
        for (i, x) in parts.m.iter_mut().enumerate() {
            *x = (i % 777) as f32 * 1e-5;
        }
    }
    tier
}

fn bench(c: &mut Criterion) {
    let root = std::env::var_os("MEGATRAIN_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let dir = tempfile::tempdir_in(root).unwrap();
    let ckpt = dir.path().join("ckpt");
    let mut tier = tier();
    let n = tier.n_params();

    let mut group = c.benchmark_group("checkpoint_32M");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(12 * n));
    group.bench_function("save", |b| {
        b.iter(|| save_checkpoint(&ckpt, &tier, &serde_json::Value::Null).unwrap())
    });
    group.bench_function("load", |b| b.iter(|| load_checkpoint(&ckpt, &mut tier).unwrap()));
    group.throughput(Throughput::Bytes(4 * n));
    group.bench_function("verify_model", |b| {
        b.iter(|| verify_checkpoint_file(&ckpt, MODEL_FILE).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
