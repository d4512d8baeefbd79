//! `megatrain plan`: host bytes by kind (the tier's own arithmetic) and an
//! estimate of device bytes, before anything is allocated.
//!
//! Device estimate (bytes, activations f32):
//!
//! - weights: the embedding (resident from forward to its backward; of a
//!   step that takes its looked-up rows alone, a table of min(B·T, V)
//!   rows, whose gradient is counted so too) + the
//!   head + 2·K block layers (K for the block being recomputed, doubled for
//!   the next upload in flight); matrices in the transport dtype, vectors
//!   f32 (they are widened on upload);
//! - gradients: two layers' f32 gradients, the largest neighbours (a
//!   layer's stay until its download is finished, after the next layer's
//!   backward: the head's beside the last block's, for a large
//!   vocabulary);
//! - hidden: the running activation and its gradient, 2·B·T·C floats;
//! - checkpoints: one block input of B·T·C floats per recomputed group;
//! - recompute: K blocks' saved tensors, each B·T·(6C + 2·q + 2·kv + 3·I)
//!   floats (inputs, norm outputs, q/k/v, attention output, the MLP's
//!   pre-activation, activation and up projection), plus the attention's
//!   per-row softmax statistics B·H·T·2 floats (a Gated DeltaNet's and a
//!   gated attention's their own: `mixer_saved_floats`), and where a model
//!   has Gated DeltaNets, their backward's scratch;
//! - kept: the weights (a slot each) and saved tensors of the blocks kept
//!   from the forward to their backward (`--keep-activations`), with the
//!   saved tensors' f16 copies under f16.
//!   They are freed before any group is recomputed, so `total` counts the
//!   larger of kept and recompute (with its f16 copies), not both;
//! - head: logits and their gradient for one chunk, 2·rows·V floats, and
//!   under f16 the gradient's f16 copy, rows·V halfs;
//! - f16 copies (f16 transport, which computes in f16): the tensor-core
//!   matmuls read f16 copies of their f32 operands, kept while the operand
//!   lives — the K recomputed blocks' matmul inputs, B·T·(2C + q + I)
//!   halfs each (the two norm outputs, the attention output, the MLP
//!   activation);
//! - download staging (a device with a copy queue, `MEGATRAIN_COPY_QUEUE`):
//!   the gradients pass through a ring of up to four buffers of the
//!   download chunk's size on their way down
//!   (`megatrain_gpu::download_staging_bytes`).

use megatrain_tier::{MemoryReport, TierConfig, TransportDType, plan as tier_plan};
use megatrain_zoo::ModelConfig;

use crate::trainer::{CarryOrder, carried_layers};

use super::error::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanInput {
    pub batch: usize,
    pub seq_len: usize,
    pub checkpoint_every: usize,
    /// The last blocks that keep their weights and activations
    /// (`TrainerConfig::keep_activations`).
    pub keep_activations: usize,
    pub chunk_rows: usize,
    pub transport: TransportDType,
    pub hold_grads: bool,
    /// How many layers' gradients stay on the device from the end of one
    /// step into the next one's forward (`TrainerConfig::carry_layers`),
    /// and which (`TrainerConfig::carry_order`).
    pub carry_layers: usize,
    pub carry_order: CarryOrder,
    /// Gradient chunks that may wait for the CPU AdamW
    /// (`TrainerConfig::optimizer_queue`), each one chunk of host staging.
    pub optimizer_queue: usize,
    /// Steps take the embedding's looked-up rows alone
    /// ([`crate::trainer::RowsSetting::applies`]) where the tier holds it
    /// in RAM: the device holds a table of min(B·T, V) rows and its
    /// gradient instead of the whole table's.
    pub embedding_rows: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceBytes {
    pub weights: u64,
    pub gradients: u64,
    pub checkpoints: u64,
    pub hidden: u64,
    pub recompute: u64,
    pub kept: u64,
    pub head: u64,
    pub f16_copies: u64,
    pub download_staging: u64,
    /// The carried layers' f32 gradients (`PlanInput::carry_layers`),
    /// counted as if held through the whole step: they are made at the
    /// end of its backward and go at the next one's forward.
    pub carried: u64,
}

impl DeviceBytes {
    pub fn total(&self) -> u64 {
        self.weights
            + self.gradients
            + self.checkpoints
            + self.hidden
            + self.kept.max(self.recompute + self.f16_copies)
            + self.head
            + self.download_staging
            + self.carried
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub host: MemoryReport,
    /// Gradient chunks on the host, of the trainer's default size for the
    /// model and budget (`plan_ranks::staging_bytes` with one rank): on a
    /// GPU those on their way down and those the optimizer reads where
    /// they landed.
    pub host_staging: u64,
    pub device: DeviceBytes,
    /// The rows of the embedding's table on the device where steps take
    /// its looked-up rows alone ([`PlanInput::embedding_rows`] and the
    /// embedding not spilled); `None`: the whole table.
    pub embedding_rows: Option<u64>,
}

impl Plan {
    /// RAM the run needs: the tier's RAM plus staging.
    pub fn host_total(&self) -> u64 {
        self.host.ram.total() + self.host_staging
    }
}

/// Bytes a layer occupies on the device when uploaded.
pub fn layer_device_bytes(table: &megatrain_tensor::ParamTable, transport: TransportDType) -> u64 {
    let matrix = transport.size_in_bytes() as u64;
    table
        .iter()
        .map(|p| p.numel() as u64 * if p.narrow { matrix } else { 4 })
        .sum()
}

/// Per token, the values a block's MLP saves for its backward and the
/// width of its products' inputs past the norm's (f16 copies under
/// `--precision f16`), the larger block's where dense and routed blocks
/// mix: a dense MLP's gate, up and activation, and its activation; a routed
/// one's for each of the k experts a token visits, with the gathered input
/// and the expert's output besides.
fn mlp_per_token(model: &ModelConfig) -> (u64, u64) {
    let (c, f) = (model.hidden_size as u64, model.intermediate_size as u64);
    let dense = (3 * f, f);
    match &model.moe {
        Some(m) => {
            let (k, e) = (m.top_k as u64, m.expert_size as u64);
            // Qwen2-MoE's shared expert: a dense MLP's, and its output.
            let shared = m.shared_expert.map_or((0, 0), |s| (3 * s as u64 + c, s as u64));
            let routed = (k * (2 * c + 3 * e) + shared.0, k * (c + e) + shared.1);
            match (0..model.num_layers).all(|i| m.routes(i)) {
                true => routed,
                false => (routed.0.max(dense.0), routed.1.max(dense.1)),
            }
        }
        None => dense,
    }
}

/// The f32 values block `layer`'s token mixer saves for its backward at
/// batch `b` × `t` tokens: plain attention's q, k, v (as projected and as
/// rotated) and its per-row softmax statistics; Qwen3.5's gated attention
/// its gate and normed q, k besides; a Gated DeltaNet's mixed q/k/v, q and
/// k before, in and after their l2 norms, v, z, the gates, the rule's
/// output, normed and gated, and the rule's state at every chunk start.
fn mixer_saved_floats(model: &ModelConfig, layer: usize, b: u64, t: u64) -> u64 {
    let (q, kv, heads) = (
        model.q_dim() as u64,
        model.kv_dim() as u64,
        model.num_heads as u64,
    );
    let lse = b * heads * t * 2;
    match &model.linear_attn {
        Some(l) if l.is_linear(layer) => {
            let (kw, vw, hv) = (l.key_width() as u64, l.value_width() as u64, l.value_heads as u64);
            let chunks = t.div_ceil(megatrain_tensor::DELTA_RULE_CHUNK as u64);
            b * t * (l.conv_channels() as u64 + 6 * kw + 5 * vw + 7 * hv)
                + b * hv * chunks * (l.key_dim * l.value_dim) as u64
        }
        _ if model.arch.is_qwen35() => b * t * (6 * q + 4 * kv) + lse,
        _ => b * t * (2 * q + 2 * kv) + lse,
    }
}

/// Bytes the GPU's gated delta rule backward takes beside its operands
/// while it runs (one block at a time; `megatrain_gpu`'s delta_rule.rs):
/// each batch's replayed chunk states, and the per-column-block partials
/// of a time window, which it sizes to one storage binding (at most
/// NVIDIA's 2 GiB here).
fn delta_rule_scratch_bytes(model: &ModelConfig, b: u64, t: u64) -> u64 {
    let Some(l) = model.linear_attn.as_ref().filter(|l| l.layers.iter().any(|&x| x)) else {
        return 0;
    };
    let (hv, dk, c) = (
        l.value_heads as u64,
        l.key_dim as u64,
        megatrain_tensor::DELTA_RULE_CHUNK as u64,
    );
    let blocks = (l.value_dim as u64).div_ceil(32);
    let replay = hv * blocks * 32 * (c * dk + c + dk);
    // Kimi Linear's per-channel decays have a dg partial per key channel.
    let decays = if model.arch == megatrain_zoo::Arch::KimiLinear {
        dk
    } else {
        1
    };
    let partials = t * hv * blocks * (2 * dk + decays + 1);
    4 * b * replay + (4 * b * partials).min(1 << 31)
}

pub fn plan(model: &ModelConfig, input: &PlanInput, tier: &TierConfig) -> Result<Plan> {
    let tables = model.layer_tables();
    let host = tier_plan(&tables, tier)?;
    let max_layer = tables.iter().map(|t| t.numel() as u64).max().unwrap_or(0);
    let n_blocks = model.num_layers as u64;
    let k = input.checkpoint_every.max(1) as u64;
    let (b, t, c) = (input.batch as u64, input.seq_len as u64, model.hidden_size as u64);
    let embedding_rows =
        (input.embedding_rows && host.first_spilled != Some(0)).then(|| (b * t).min(model.vocab_size as u64));
    // The embedding's table on the device: the whole or the step's rows.
    let emb_share = |whole: u64| match embedding_rows {
        Some(r) => whole / model.vocab_size.max(1) as u64 * r,
        None => whole,
    };
    let emb = emb_share(layer_device_bytes(&tables[0], input.transport));
    let numels: Vec<u64> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| match i {
            0 => emb_share(t.numel() as u64),
            _ => t.numel() as u64,
        })
        .collect();
    let head = layer_device_bytes(&tables[tables.len() - 1], input.transport);
    let block_max = tables[1..tables.len() - 1]
        .iter()
        .map(|t| layer_device_bytes(t, input.transport))
        .max()
        .unwrap_or(0);
    let k_eff = k.min(n_blocks.max(1));
    let split =
        crate::trainer::Recompute::new(model.num_layers, input.checkpoint_every, input.keep_activations);
    let (group, kept) = (split.group_len() as u64, split.kept().len() as u64);
    let (mlp_saved, mlp_copied) = mlp_per_token(model);
    let mixer = (0..model.num_layers)
        .map(|l| mixer_saved_floats(model, l, b, t))
        .max()
        .unwrap_or(0);
    let saved_per_block = 4 * (b * t * (6 * c + mlp_saved) + mixer);
    let rows = (input.chunk_rows as u64).min(b * t);
    let copied_per_block = 2 * b * t * (2 * c + model.q_dim() as u64 + mlp_copied);
    let f16 = input.transport == TransportDType::F16;
    // The trainer's chunk: the model's default, aligned to the default
    // spill window where the budget spills layers.
    let mut chunk = crate::trainer::transfer_chunk_for(model.param_count() as u64);
    if host.disk.total() > 0 {
        chunk = crate::trainer::spill_aligned(chunk, megatrain_tier::WindowConfig::default().chunk_elems);
    }
    let chunk = max_layer.min(chunk as u64);
    let queue = input.optimizer_queue;
    let in_flight = super::plan_ranks::default_in_flight(&tables, chunk);
    let chunks = crate::trainer::gradient_chunks_held(queue, false, in_flight);
    let device = DeviceBytes {
        weights: emb + head + 2 * k_eff * block_max,
        gradients: 4 * numels.windows(2).map(|w| w[0] + w[1]).max().unwrap_or(max_layer),
        checkpoints: split.checkpoint_count() as u64 * b * t * c * 4,
        hidden: 2 * b * t * c * 4,
        recompute: group * saved_per_block + delta_rule_scratch_bytes(model, b, t),
        kept: kept * (block_max + saved_per_block + if f16 { copied_per_block } else { 0 }),
        head: 2 * rows * model.vocab_size as u64 * 4
            + if f16 {
                2 * rows * model.vocab_size as u64
            } else {
                0
            },
        f16_copies: if f16 { group * copied_per_block } else { 0 },
        download_staging: megatrain_gpu::download_staging_bytes(4 * chunk, chunks),
        carried: 4 * carried_layers(input.carry_layers, input.carry_order, model.num_layers)
            .iter()
            .map(|&i| tables[i].numel() as u64)
            .sum::<u64>(),
    };
    Ok(Plan {
        host,
        host_staging: super::plan_ranks::staging_bytes(chunk, in_flight, 1, queue),
        device,
        embedding_rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatrain_tier::BytesByKind;

    #[test]
    fn disk_time_is_spilled_bytes_over_bandwidth_both_ways() {
        let host = MemoryReport {
            disk: BytesByKind {
                params: 4_000_000_000,
                moments: 8_000_000_000,
                ..BytesByKind::default()
            },
            ..MemoryReport::default()
        };
        // 1B spilled parameters: 12 GB each way; at 2 GB/s, 6 s + 6 s.
        let e = disk_estimate(&host, 2.0, 2.0);
        assert_eq!((e.read_bytes, e.written_bytes), (12_000_000_000, 12_000_000_000));
        assert!((e.seconds - 12.0).abs() < 1e-9);
        assert_eq!(disk_estimate(&MemoryReport::default(), 1.0, 1.0).seconds, 0.0);
    }

    /// A bf16 step of `batch` × 1024 tokens, every block recomputed, the
    /// default optimizer queue, nothing held, carried or looked up alone.
    fn bf16_input(batch: usize) -> PlanInput {
        PlanInput {
            batch,
            seq_len: 1024,
            checkpoint_every: 1,
            keep_activations: 0,
            chunk_rows: 256,
            transport: TransportDType::BF16,
            hold_grads: false,
            carry_layers: 0,
            carry_order: Default::default(),
            optimizer_queue: crate::trainer::DEFAULT_OPTIMIZER_QUEUE,
            embedding_rows: false,
        }
    }

    /// A step that takes the embedding's looked-up rows alone holds a
    /// table of B·T rows on the device, not the whole (Qwen2.5-7B at
    /// 8×1024 tokens: 8,192 of 152,064 rows); the largest pair of
    /// neighbours' gradients is then the head's and the last block's, as
    /// before. An embedding the budget spills takes the whole table.
    #[test]
    fn the_device_holds_the_embeddings_looked_up_rows_where_steps_take_them() {
        let model = megatrain_zoo::preset("qwen2.5-7b", None).unwrap();
        let input = bf16_input(8);
        let tier = TierConfig {
            transport: TransportDType::BF16,
            ..TierConfig::default()
        };
        let rows_input = PlanInput {
            embedding_rows: true,
            ..input
        };
        let whole = plan(&model, &input, &tier).unwrap();
        let rows = plan(&model, &rows_input, &tier).unwrap();
        assert_eq!((whole.embedding_rows, rows.embedding_rows), (None, Some(8192)));
        let (v, c) = (model.vocab_size as u64, model.hidden_size as u64);
        assert_eq!(whole.device.weights - rows.device.weights, (v - 8192) * c * 2);
        assert_eq!(whole.device.gradients, rows.device.gradients);
        assert_eq!(whole.device.total() - rows.device.total(), (v - 8192) * c * 2);
        // A budget of the transport copies alone spills every layer.
        let spilling = TierConfig {
            ram_budget_bytes: Some(whole.host.ram.transport),
            spill_dir: Some("spill".into()),
            ..tier
        };
        let spilled = plan(&model, &rows_input, &spilling).unwrap();
        assert_eq!(spilled.host.first_spilled, Some(0));
        assert_eq!(spilled.embedding_rows, None);
        assert_eq!(spilled.device.weights, whole.device.weights);
    }

    /// The gradient chunks a GPU run holds on the host are sized by the
    /// model (1/512 of its parameters, 32 MiB from 4.3B parameters up, the
    /// 4 MiB floor but never above the largest layer for small ones), and
    /// counted by its blocks: all of a block's chunks in flight, beside
    /// four (`gradient_chunks_held`). TinyLlama-1.1B: 25 of 8.6 MB, 0.20
    /// B/param; Qwen2.5-7B: 32 of 32 MiB, 0.14.
    #[test]
    fn gradient_chunks_on_the_host_are_sized_by_the_model() {
        use crate::trainer::{
            DEFAULT_TRANSFER_CHUNK, chunks_in_flight, gradient_chunks_held, transfer_chunk_for,
        };
        let queue = crate::trainer::DEFAULT_OPTIMIZER_QUEUE;
        let input = bf16_input(1);
        // Chunks held where chunks are of `chunk` elements: a block's and four.
        let held = |name: &str, chunk: u64| {
            let tables = megatrain_zoo::preset(name, None).unwrap().layer_tables();
            let numels: Vec<usize> = tables.iter().map(|t| t.numel()).collect();
            let in_flight = chunks_in_flight(0, &numels, chunk as usize);
            gradient_chunks_held(queue, false, in_flight) as u64
        };
        let staging = |name: &str| {
            let model = megatrain_zoo::preset(name, None).unwrap();
            let p = plan(&model, &input, &TierConfig::default()).unwrap();
            (
                model.param_count() as u64,
                p.host_staging,
                p.device.download_staging,
            )
        };
        let (n, host, _) = staging("tinyllama-1.1b");
        assert_eq!(held("tinyllama-1.1b", n / 512), 25);
        assert_eq!(host, 25 * 4 * (n / 512));
        let per_param = host as f64 / n as f64;
        assert!((0.19..=0.2).contains(&per_param), "{per_param} B/param");
        // Where layers spill, the trainer rounds the chunk up to the spill
        // window's (32 MiB by default), and so does the plan.
        let spilled = TierConfig {
            ram_budget_bytes: Some(8 << 30),
            spill_dir: Some(std::env::temp_dir()),
            ..TierConfig::default()
        };
        let model = megatrain_zoo::preset("tinyllama-1.1b", None).unwrap();
        let p = plan(&model, &input, &spilled).unwrap();
        assert!(p.host.disk.total() > 0, "{:?}", p.host);
        let chunk = DEFAULT_TRANSFER_CHUNK as u64;
        assert_eq!(p.host_staging, held("tinyllama-1.1b", chunk) * 4 * chunk);
        let (n, host, _) = staging("qwen2.5-7b");
        assert!(n > 512 * chunk);
        assert_eq!(held("qwen2.5-7b", chunk), 32);
        assert_eq!(host, 32 * 4 * chunk);
        // 16 queued for the optimizer (`--optimizer-queue 16`): 14 chunks
        // more, 0.06 B/param, as the H200 measured (14.196 -> 14.255).
        let model = megatrain_zoo::preset("qwen2.5-7b", None).unwrap();
        let deeper = PlanInput {
            optimizer_queue: 16,
            ..input
        };
        let p16 = plan(&model, &deeper, &TierConfig::default()).unwrap();
        assert_eq!(p16.host_staging, host + (16 - queue as u64) * 4 * chunk);
        let more = (p16.host_staging - host) as f64 / n as f64;
        assert!((0.06..0.065).contains(&more), "{more} B/param");
        assert_eq!(transfer_chunk_for(0), DEFAULT_TRANSFER_CHUNK / 8);
        // llama-tiny's largest layer is under the floor: chunks of a layer,
        // one of a block in flight.
        let (_, host, download) = staging("llama-tiny");
        let tables = megatrain_zoo::preset("llama-tiny", None).unwrap().layer_tables();
        let max_layer = tables.iter().map(|t| t.numel() as u64).max().unwrap();
        assert!(max_layer < (DEFAULT_TRANSFER_CHUNK / 8) as u64);
        let held = held("llama-tiny", max_layer);
        assert_eq!(held, gradient_chunks_held(queue, false, 1) as u64);
        assert_eq!(host, held * 4 * max_layer);
        assert_eq!(
            download,
            megatrain_gpu::download_staging_bytes(4 * max_layer, held as usize)
        );
    }
}

/// The most of the last blocks that can keep their weights and activations
/// (`--keep-activations`) with the device estimate's total within
/// `device_mem`, or `None` where no count fits.
pub fn most_kept(
    model: &ModelConfig,
    input: &PlanInput,
    tier: &TierConfig,
    device_mem: u64,
) -> Result<Option<usize>> {
    let mut best = None;
    for keep in 0..=model.num_layers {
        let p = plan(
            model,
            &PlanInput {
                keep_activations: keep,
                ..*input
            },
            tier,
        )?;
        if p.device.total() <= device_mem {
            best = Some(keep);
        }
    }
    Ok(best)
}

/// Disk traffic of a step for the layers past the host budget, and the
/// time it takes at a given bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskEstimate {
    /// Bytes read from spill files per step: every spilled p, m and v once
    /// (and held gradients), as the optimizer's read-ahead moves them.
    pub read_bytes: u64,
    /// The same bytes written back.
    pub written_bytes: u64,
    /// Seconds of disk time per step: reads at `read_gb_s` plus writes at
    /// `write_gb_s` (they share one device).
    pub seconds: f64,
}

/// The disk time of a step of `host` (a tier plan with a budget).
pub fn disk_estimate(host: &MemoryReport, read_gb_s: f64, write_gb_s: f64) -> DiskEstimate {
    let bytes = host.disk.params + host.disk.moments + host.disk.gradients;
    let secs = |gb_s: f64| {
        if gb_s > 0.0 {
            bytes as f64 / (gb_s * 1e9)
        } else {
            f64::INFINITY
        }
    };
    DiskEstimate {
        read_bytes: bytes,
        written_bytes: bytes,
        seconds: secs(read_gb_s) + secs(write_gb_s),
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
