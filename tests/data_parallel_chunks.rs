//! Data parallel gradients are reduced chunk by chunk as they come down:
//! the results do not depend on the chunk, bit for bit, with chunks of an
//! awkward size (1021 elements: prime, smaller than every layer, so chunks
//! straddle the shard boundaries and some ranks own nothing of a chunk),
//! on 2 and 3 ranks, replicated and sharded optimizer, with held gradients
//! (micro-batches, clipping) and without; the ranks together train what
//! one process with the global batch trains; and no rank's host staging is
//! sized by a layer. Ranks are threads here ([`LocalComm`], sums in rank
//! order); `tests/mpi_data_parallel.rs` runs the same under `mpirun`.

use crate::common;

use std::path::Path;
use std::sync::Arc;

use megatrain::data::Batch;
use megatrain::dist::local::{LocalComm, local_group, local_machines};
use megatrain::dist::{Collective, DistConfig, Shared, share_transport};
use megatrain::trainer::{TrainError, Trainer, TrainerConfig};
use megatrain_tensor::CpuExecutor;
use megatrain_tier::{
    CHUNK_ALIGN, HostTier, Shard, SharedTransport, TierConfig, TransportDType, WindowConfig, load_checkpoint,
    save_checkpoint_gathered,
};
use megatrain_zoo::ModelConfig;

/// Smaller than every layer of the test models, and prime.
const CHUNK: usize = 1021;
/// Larger than every layer: each is reduced whole.
const WHOLE: usize = usize::MAX / 8;
/// Rows per rank and micro-batch.
const ROWS: usize = 2;
const STEPS: u64 = 3;

#[derive(Clone, Copy, Debug)]
struct Case {
    ranks: usize,
    shard: bool,
    transport: TransportDType,
    /// Micro-batches per step (more than one holds gradients).
    micro: usize,
    clip: Option<f64>,
    /// Every layer but the embedding spills to disk (a sharded optimizer
    /// then moves each rank's page-aligned shard through the spill window).
    spill: bool,
    /// Ranks per machine that map one transport copy (sharded only);
    /// `None`: a copy per rank.
    machine: Option<usize>,
    /// The first layers not trained (`TrainerConfig::frozen_layers`).
    frozen: usize,
    /// Clipped updates after the backward, not in the next forward
    /// (`TrainerConfig::defer_clipped_updates` off).
    after_backward: bool,
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for ranks in [2, 3] {
        for shard in [false, true] {
            for (transport, micro, clip) in [
                (TransportDType::F32, 1, None),
                (TransportDType::BF16, 1, None),
                (TransportDType::F32, 2, None),
                (TransportDType::F32, 1, Some(0.05)),
                (TransportDType::BF16, 2, Some(0.05)),
            ] {
                v.push(Case {
                    ranks,
                    shard,
                    transport,
                    micro,
                    clip,
                    spill: false,
                    machine: None,
                    frozen: 0,
                    after_backward: false,
                });
            }
        }
    }
    v
}

/// The trainer of one rank (`shard`: a sharded rank's tier, which keeps
/// only its share of p, m, v; `None` on one process).
fn trainer(
    model: &ModelConfig,
    case: Case,
    chunk: usize,
    dir: &Path,
    shard: Option<Shard>,
    shared: Option<SharedTransport>,
) -> Trainer<CpuExecutor> {
    let hold_grads = case.micro > 1 || case.clip.is_some();
    let tier = TierConfig {
        shard,
        transport: case.transport,
        hold_grads,
        grads_on_device: Vec::new(),
        ram_budget_bytes: case
            .spill
            .then(|| common::spill_all_but_embedding(model, case.transport, hold_grads)),
        spill_dir: case.spill.then(|| dir.join("spill")),
        shared_transport: shared,
    };
    let config = TrainerConfig {
        transfer_chunk: chunk,
        frozen_layers: case.frozen,
        defer_clipped_updates: !case.after_backward,
        ..common::k2_config(case.clip)
    };
    let mut t = common::trainer(CpuExecutor::new(), model, tier, 5, config);
    assert_eq!(t.tier().has_spill(), case.spill);
    // Window chunks of CHUNK_ALIGN elements: the transfer chunk (rounded
    // up to them) stays smaller than every layer.
    t.set_spill_window(WindowConfig {
        chunk_elems: CHUNK_ALIGN,
        depth: 3,
    });
    t
}

/// What a run ends with: the losses, every layer's parameters (whole, on
/// rank 0), every rank's transport copies, every rank's staging peak.
#[derive(Debug)]
struct Run {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
    transport: Vec<Vec<Vec<u8>>>,
    staging: Vec<u64>,
    /// Per rank: bytes read from spill files over the run.
    spill_read: Vec<u64>,
    /// Per rank: bytes put into collectives over the run.
    comm_bytes: Vec<u64>,
}

/// One rank's trainer after `STEPS` steps (its spill files in `dir`), its
/// losses and the bytes it read from spill files.
fn train_rank(
    model: &ModelConfig,
    case: Case,
    chunk: usize,
    comm: Option<LocalComm>,
    dir: &Path,
) -> (Trainer<CpuExecutor>, Vec<f64>, u64, u64) {
    let (rank, ranks) = comm.as_ref().map_or((0, 1), |c| (c.rank(), case.ranks));
    let shard = comm.as_ref().filter(|_| case.shard).map(|c| Shard {
        rank: c.rank(),
        ranks: c.size(),
    });
    let sharing = match (&comm, case.machine) {
        (Some(c), Some(_)) => {
            let s = share_transport(c, dir, &model.layer_tables(), case.transport, true).unwrap();
            // Every rank has opened the copies: the creator's file is gone.
            let left = std::fs::read_dir(dir).unwrap().flatten();
            assert_eq!(
                left.filter(|e| e.file_name().to_string_lossy().contains("transport"))
                    .count(),
                0
            );
            match s {
                Shared::Yes(s) => Some(s),
                Shared::No(why) => panic!("{case:?}: {why}"),
            }
        }
        _ => None,
    };
    let mut t = trainer(
        model,
        case,
        chunk,
        dir,
        shard,
        sharing.as_ref().map(|s| s.tier.clone()),
    );
    if let Some(c) = comm {
        t.set_distributed(DistConfig {
            comm: Arc::new(c),
            shard_optimizer: case.shard,
            shared: sharing.as_ref().map(|s| s.machines.clone()),
        })
        .unwrap();
    }

    let global = ROWS * case.ranks;
    let rows = rank * global / ranks..(rank + 1) * global / ranks;
    let mut losses = Vec::new();
    let mut spill_read = 0;
    let mut comm_bytes = 0;
    for step in 0..STEPS {
        let micro: Vec<Batch> = (0..case.micro)
            .map(|k| {
                common::CHUNK_STREAM.rows(model.vocab_size, step * 10 + k as u64, global, rows.clone(), 9)
            })
            .collect();
        let m = t.step(&micro, 3e-3).unwrap();
        losses.push(m.loss);
        spill_read += m.spill_read_bytes;
        comm_bytes += m.comm_bytes;
    }
    (t, losses, spill_read, comm_bytes)
}

fn rank_run(model: &ModelConfig, case: Case, chunk: usize, comm: Option<LocalComm>) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, losses, spill_read, comm_bytes) = train_rank(model, case, chunk, comm, dir.path());
    t.gather_state().unwrap();
    let layers = t.tier().layers();
    Run {
        losses,
        params: layers.iter().map(|s| s.params().to_vec()).collect(),
        transport: vec![layers.iter().map(|s| s.transport().as_bytes().to_vec()).collect()],
        staging: vec![t.staging_bytes()],
        spill_read: vec![spill_read],
        comm_bytes: vec![comm_bytes],
    }
}

/// `case.ranks` ranks, as threads.
fn run(model: &ModelConfig, case: Case, chunk: usize) -> Run {
    let comms = match case.machine {
        Some(per) => local_machines(case.ranks, per),
        None => local_group(case.ranks),
    };
    let mut runs: Vec<Run> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || rank_run(model, case, chunk, Some(c))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &runs[1..] {
        assert_eq!(r.losses, runs[0].losses, "{case:?}: ranks disagree on the loss");
    }
    let mut all = runs.remove(0);
    for r in runs {
        all.transport.extend(r.transport);
        all.staging.extend(r.staging);
        all.spill_read.extend(r.spill_read);
        all.comm_bytes.extend(r.comm_bytes);
    }
    all
}

/// Relative L2 distance over the whole model.
fn rel_l2(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            diff += (*p as f64 - *q as f64).powi(2);
            norm += (*p as f64).powi(2);
        }
    }
    (diff / norm).sqrt()
}

fn check(model: &ModelConfig, cases: Vec<Case>) {
    for case in cases {
        let what = format!("{:?} {case:?}", model.arch);
        let whole = run(model, case, WHOLE);
        let chunked = run(model, case, CHUNK);
        assert!(
            whole.losses.iter().all(|l| l.is_finite()),
            "{what}: {:?}",
            whole.losses
        );
        assert_eq!(whole.losses, chunked.losses, "{what}: losses");
        assert!(whole.params == chunked.params, "{what}: parameters differ");
        assert!(
            whole.transport == chunked.transport,
            "{what}: transport copies differ"
        );
        // Every rank ends with the same (whole) transport copies.
        assert!(
            chunked.transport.iter().all(|t| *t == chunked.transport[0]),
            "{what}: ranks' copies differ"
        );
        // One process with the global batch: the same to rounding (the
        // gradient is summed in another order). A bf16 copy can turn a
        // master weight's rounding difference into a bf16 step (2^-8).
        let alone = rank_run(model, case, CHUNK, None);
        let (tol, param_tol) = match case.transport {
            TransportDType::F32 => (1e-6, 1e-5),
            _ => (1e-4, 1e-4),
        };
        for (a, b) in alone.losses.iter().zip(&chunked.losses) {
            assert!(
                (a - b).abs() <= tol * a.abs(),
                "{what}: loss alone {a}, on ranks {b}"
            );
        }
        let rel = rel_l2(&alone.params, &chunked.params);
        assert!(
            rel <= param_tol,
            "{what}: parameters differ from one process's by {rel:.2e}"
        );
    }
}

#[test]
fn llama_chunks_change_no_result_across_ranks() {
    check(&common::llama_tiny(2), cases());
}

#[test]
fn gpt2_chunks_change_no_result_across_ranks() {
    check(&common::gpt2_two_blocks(), cases());
}

/// Each rank routes its own tokens; a token's experts do not depend on the
/// others', so the ranks together train as one process with their batch.
#[test]
fn mixtral_chunks_change_no_result_across_ranks() {
    check(&common::mixtral_tiny(2), cases());
}

/// An optimizer over a tier that spills: each chunk's sum goes through the
/// spill window (chunks on the window's boundaries). Replicated, every
/// rank reads and writes whole layers; sharded, each its own page-aligned
/// range of them, which straddles the transfer chunks (layers of 30–40 Ki
/// elements, chunks of 32 Ki).
#[test]
fn spilled_layers_reduce_in_chunks() {
    let mut v = Vec::new();
    for shard in [false, true] {
        for (ranks, transport, micro, clip) in [
            (2, TransportDType::BF16, 1, None),
            (3, TransportDType::BF16, 2, None),
            (2, TransportDType::BF16, 1, Some(0.05)),
            (3, TransportDType::F32, 1, Some(0.05)),
        ] {
            v.push(Case {
                ranks,
                shard,
                transport,
                micro,
                clip,
                spill: true,
                machine: None,
                frozen: 0,
                after_backward: false,
            });
        }
    }
    check(&common::llama_tiny(2), v.clone());
    // Sharded, the ranks together read what one replicated rank reads,
    // each a part of it.
    for case in v.into_iter().filter(|c| c.shard) {
        let sharded = run(&common::llama_tiny(2), case, CHUNK).spill_read;
        let whole = run(&common::llama_tiny(2), Case { shard: false, ..case }, CHUNK).spill_read[0];
        assert!(whole > 0, "{case:?}");
        assert_eq!(sharded.iter().sum::<u64>(), whole, "{case:?}: {sharded:?}");
        assert!(
            sharded.iter().all(|&b| 0 < b && b < whole),
            "{case:?}: {sharded:?} of {whole}"
        );
    }
}

/// A machine's ranks mapping one transport copy train what ranks holding
/// a copy each train, bit for bit, and see the same whole copy after every
/// run: on one machine (nothing of the copy moves between ranks), and on
/// two machines of two ranks (sharded, the ranks with the same index
/// all-gather into their machine's copy; replicated, each writes its
/// peers' ranges too), with held gradients, clipping and spilled layers.
#[test]
fn ranks_sharing_transport_copies_train_as_ranks_holding_their_own() {
    let model = common::llama_tiny(2);
    let whole: Vec<usize> = model.layer_tables().iter().map(|t| t.numel()).collect();
    for (ranks, per, shard, transport, micro, clip, spill) in [
        (2, 2, true, TransportDType::BF16, 1, None, false),
        (3, 3, true, TransportDType::F32, 2, None, false),
        (3, 3, true, TransportDType::BF16, 1, Some(0.05), true),
        (4, 2, true, TransportDType::BF16, 1, None, false),
        (4, 2, true, TransportDType::F32, 2, Some(0.05), true),
        (2, 2, false, TransportDType::BF16, 1, None, false),
        (3, 3, false, TransportDType::F32, 2, Some(0.05), true),
        (4, 2, false, TransportDType::BF16, 2, None, true),
    ] {
        let own = Case {
            ranks,
            shard,
            transport,
            micro,
            clip,
            spill,
            machine: None,
            frozen: 0,
            after_backward: false,
        };
        let shared = Case {
            machine: Some(per),
            ..own
        };
        let (a, b) = (run(&model, own, CHUNK), run(&model, shared, CHUNK));
        assert_eq!(a.losses, b.losses, "{shared:?}: losses");
        assert!(a.params == b.params, "{shared:?}: parameters differ");
        assert!(
            b.transport.iter().all(|t| *t == a.transport[0]),
            "{shared:?}: a rank's copy differs"
        );
        if !shard {
            // Replicated: no copy was ever gathered; each rank writes its
            // share of the machine's copy instead of all of it.
            assert_eq!(a.comm_bytes, b.comm_bytes, "{shared:?}");
        } else if per == ranks {
            // One machine: the ranks moved only gradients, each as many
            // bytes fewer as its ranges of the copy hold, every step (the
            // last step's clipped updates are gathered by the settling
            // after the run, which no step counts).
            let counted = if clip.is_some() { STEPS - 1 } else { STEPS };
            for (rank, (x, y)) in a.comm_bytes.iter().zip(&b.comm_bytes).enumerate() {
                let ranges: u64 = whole
                    .iter()
                    .enumerate()
                    .map(|(l, &n)| {
                        let spilled = spill && l > 0;
                        megatrain_tier::shard::layer_ranges(n, spilled, ranks)[rank].len() as u64
                    })
                    .sum();
                let gathered = counted * ranges * transport.size_in_bytes() as u64;
                assert_eq!(x - y, gathered, "{shared:?} rank {rank}: {x} vs {y} bytes");
            }
        }
    }
}

/// Every rank's staging holds chunk-sized buffers only: the one being
/// filled, those queued, and per reduction in flight (this chunk's and the
/// previous one's) its gradient and its receive buffer; never a layer.
#[test]
fn rank_staging_is_sized_by_the_chunk() {
    let model = common::llama_tiny(2);
    let largest = model.layer_tables().iter().map(|t| t.numel()).max().unwrap();
    let queue = TrainerConfig::default().optimizer_queue;
    let bound = 4 * CHUNK as u64 * (queue as u64 + 5);
    assert!(
        4 * largest as u64 > 2 * bound,
        "the test needs layers of many chunks"
    );
    for ranks in [2, 3] {
        for shard in [false, true] {
            for micro in [1, 2] {
                let case = Case {
                    ranks,
                    shard,
                    transport: TransportDType::BF16,
                    micro,
                    clip: None,
                    spill: false,
                    machine: None,
                    frozen: 0,
                    after_backward: false,
                };
                let r = run(&model, case, CHUNK);
                for (rank, &peak) in r.staging.iter().enumerate() {
                    assert!(
                        peak > 0 && peak <= bound,
                        "{case:?} rank {rank}: staging peak {peak} B, bound {bound} B (a whole layer is {} B)",
                        4 * largest
                    );
                }
            }
        }
    }
}

/// Rank 0 writes a sharded run's checkpoint layer by layer, gathering each
/// layer just before writing it and handing back what is not its own right
/// after: the checkpoint holds what the ranks trained (the parameters
/// `gather_state` brings to rank 0, bit for bit), and afterwards rank 0's
/// RAM layers keep only their share resident (whole pages outside it read
/// as zero, as handed-back anonymous pages do) and its spill files still
/// hold blocks for its range only (a spilled layer is gathered into RAM).
#[test]
fn rank_0_writes_a_sharded_checkpoint_layer_by_layer() {
    let model = common::llama_tiny(2);
    for (ranks, spill) in [(2, false), (3, false), (2, true)] {
        let case = Case {
            ranks,
            shard: true,
            transport: TransportDType::BF16,
            micro: 1,
            clip: None,
            spill,
            machine: None,
            frozen: 0,
            after_backward: false,
        };
        let want = run(&model, case, CHUNK).params;
        let ckpt = tempfile::tempdir().unwrap();
        let model = &model;
        let ckpt_dir = ckpt.path();
        std::thread::scope(|s| {
            for c in local_group(ranks) {
                s.spawn(move || {
                    let rank = c.rank();
                    let dir = tempfile::tempdir().unwrap();
                    let (mut t, ..) = train_rank(model, case, CHUNK, Some(c), dir.path());
                    let saved = t
                        .save_on_rank0(|tier, gather| {
                            save_checkpoint_gathered(ckpt_dir, tier, &serde_json::Value::Null, gather)
                                .map_err(TrainError::from)
                        })
                        .unwrap();
                    assert_eq!(saved.is_some(), rank == 0);
                    for slab in t.tier().layers().iter().filter(|s| s.is_spilled()) {
                        let own = slab.own();
                        let pages = ((own.end * 4).div_ceil(4096) - own.start * 4 / 4096) as u64;
                        let files = slab.spilled().unwrap();
                        for f in [&files.p, &files.m, &files.v] {
                            let got = f.allocated_bytes().unwrap();
                            assert!(
                                got <= pages * 4096,
                                "{case:?} rank {rank} layer {}: {got} bytes on disk for {own:?}",
                                slab.index()
                            );
                        }
                    }
                    for slab in t.tier().layers().iter().filter(|s| !s.is_spilled()) {
                        let (own, p) = (slab.own(), slab.params());
                        let before = own.start / 1024 * 1024;
                        let after = (own.end.div_ceil(1024) * 1024).min(p.len());
                        assert!(
                            p[..before].iter().chain(&p[after..]).all(|&x| x == 0.0),
                            "{case:?} rank {rank} layer {}: kept more than {own:?}",
                            slab.index()
                        );
                    }
                });
            }
        });
        let mut tier = HostTier::new(
            model.layer_tables(),
            TierConfig {
                transport: TransportDType::BF16,
                ..TierConfig::default()
            },
        )
        .unwrap();
        load_checkpoint(ckpt_dir, &mut tier).unwrap();
        let got: Vec<Vec<f32>> = tier.layers().iter().map(|s| s.params().to_vec()).collect();
        assert!(
            got == want,
            "{case:?}: the checkpoint differs from the gathered state"
        );
    }
}

/// Frozen layers on ranks: each rank's backward ends at the first trained
/// layer, nothing of the frozen ones is reduced or updated, and the ranks
/// train what one process with the same layers frozen trains; replicated
/// and sharded, with clipping and micro-batches, and over spilled layers
/// (a frozen one among them, which the spill window then skips).
#[test]
fn frozen_layers_train_across_ranks() {
    let model = common::llama_tiny(2);
    let mut v = Vec::new();
    for shard in [false, true] {
        for (ranks, micro, clip, spill) in [
            (2, 1, None, false),
            (3, 2, Some(0.05), false),
            (2, 1, Some(0.05), true),
            (3, 1, None, true),
        ] {
            v.push(Case {
                ranks,
                shard,
                transport: TransportDType::BF16,
                micro,
                clip,
                spill,
                machine: None,
                frozen: 2,
                after_backward: false,
            });
        }
    }
    check(&model, v.clone());
    let dir = tempfile::tempdir().unwrap();
    let start = trainer(&model, v[0], CHUNK, dir.path(), None, None);
    let initial: Vec<Vec<f32>> = start.tier().layers()[..2]
        .iter()
        .map(|s| s.params().to_vec())
        .collect();
    drop(start);
    for case in v {
        let r = run(&model, case, CHUNK);
        assert!(r.params[..2] == initial[..], "{case:?}: a frozen layer moved");
        assert!(r.params[2..] != initial[..], "{case:?}");
    }
}

/// Ranks defer clipped updates into the next forward as one process does:
/// a replicated rank updates every layer from the same sums, a sharded one
/// its range and then all-gathers the layer's transport copy, and ranks
/// sharing their copies meet before each load; on one machine and on two,
/// with micro-batches, frozen layers and layers spilled to disk. The same bits as updating after
/// the backward, and every trained layer one update behind between steps.
/// Spilled layers' updates read ahead in the forward's order (a sharded
/// rank's page-aligned range of them).
#[test]
fn ranks_defer_clipped_updates() {
    let model = common::llama_tiny(2);
    for (ranks, shard, machine, micro, frozen, spill) in [
        (2, false, None, 1, 0, false),
        (3, false, None, 2, 0, false),
        (2, true, None, 1, 0, false),
        (3, true, None, 2, 2, false),
        (3, true, Some(3), 1, 0, false),
        (4, true, Some(2), 2, 0, false),
        (3, false, Some(3), 1, 1, false),
        (4, false, Some(2), 1, 0, false),
        (2, false, None, 1, 0, true),
        (3, true, None, 1, 1, true),
        (4, true, Some(2), 2, 0, true),
    ] {
        let case = Case {
            ranks,
            shard,
            transport: TransportDType::BF16,
            micro,
            clip: Some(0.05),
            spill,
            machine,
            frozen,
            after_backward: false,
        };
        let deferred = run(&model, case, CHUNK);
        let after = run(
            &model,
            Case {
                after_backward: true,
                ..case
            },
            CHUNK,
        );
        assert_eq!(deferred.losses, after.losses, "{case:?}");
        assert!(deferred.params == after.params, "{case:?}: parameters differ");
        assert!(
            deferred.transport.iter().all(|t| *t == after.transport[0]),
            "{case:?}: transport copies differ"
        );
    }
    // Between steps every trained layer waits for the next forward, on
    // every rank; settling applies them (a sharded rank's together with
    // the others').
    for (shard, frozen) in [(false, 0), (true, 0), (true, 1)] {
        std::thread::scope(|s| {
            for c in local_group(2) {
                let model = &model;
                s.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    let case = Case {
                        ranks: 2,
                        shard,
                        transport: TransportDType::F32,
                        micro: 1,
                        clip: Some(0.05),
                        spill: false,
                        machine: None,
                        frozen,
                        after_backward: false,
                    };
                    let rank = c.rank();
                    let placed = shard.then_some(Shard { rank, ranks: 2 });
                    let mut t = trainer(model, case, CHUNK, dir.path(), placed, None);
                    t.set_distributed(DistConfig {
                        comm: Arc::new(c),
                        shard_optimizer: shard,
                        shared: None,
                    })
                    .unwrap();
                    let batch = common::CHUNK_STREAM.rows(model.vocab_size, 0, 4, rank * 2..rank * 2 + 2, 9);
                    let copies = |t: &Trainer<CpuExecutor>| -> Vec<Vec<u8>> {
                        let layers = t.tier().layers();
                        layers.iter().map(|s| s.transport().as_bytes().to_vec()).collect()
                    };
                    let before = copies(&t);
                    t.step(std::slice::from_ref(&batch), 1e-3).unwrap();
                    assert_eq!(t.carried_layers(), model.num_layers + 2 - frozen);
                    assert!(
                        copies(&t) == before,
                        "shard {shard}: a copy moved before the next forward"
                    );
                    t.settle().unwrap();
                    assert_eq!(t.carried_layers(), 0);
                    for (l, s) in t.tier().layers().iter().enumerate() {
                        let moved = s.transport().as_bytes() != before[l].as_slice();
                        assert_eq!(moved, l >= frozen, "shard {shard}: layer {l} after settling");
                    }
                });
            }
        });
    }
}
