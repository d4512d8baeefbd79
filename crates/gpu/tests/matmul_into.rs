//! `matmul_backward_into` and `matmul_backward_da_into` on the GPU: the
//! weight (`db`) or input (`da`) gradient added into an accumulator by the
//! product's own ACCUMULATE store has the bits of `matmul_backward` then
//! `add_assign` on the same executor, in the ops of `matmul_backward`, and
//! agrees with the CPU executor's accumulation within the usual tolerance:
//! on the SIMT checked kernel, the 128-wide interior tiles with their
//! edges, the SIMT f16 kernel and the emulated tensor-core kernel under F16
//! precision, for f32-, bf16- and f16-stored weights, batched rows and
//! transposed operands. Where the product takes several passes (operands
//! bound as several ranges, K past the loop budget) `db`'s partial sums land
//! in the accumulator one by one, so only close, and `da` is composed from
//! the two ops, so the same bits.
//!
//! Each test runs both gradients on its executors in turn: the op counts
//! are read from executor-wide statistics, which a test running beside it
//! on the same executor would disturb.

mod common;

use common::*;
use megatrain_gpu::{CoopTile, F16Matmul, GpuExecutor, GpuOptions};
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, DType, Executor, HostTensor, MatmulGrads, MatmulNeeds, Result, Transpose,
};

/// Which gradient the op under test adds into the accumulator.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Acc {
    /// `matmul_backward_da_into`: the accumulator has `a`'s shape.
    Da,
    /// `matmul_backward_into`: the accumulator has `b`'s shape.
    Db,
}

const BOTH: [Acc; 2] = [Acc::Db, Acc::Da];

/// How the executor accumulates a case.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    /// One pass of the product, its store accumulating: the bits of
    /// compute-then-add, in the ops of `matmul_backward`.
    OnePass,
    /// (`db`) K split over dispatches, each adding its partial sum into the
    /// accumulator: only close, still the ops of `matmul_backward`.
    SplitK,
    /// (`da`) `matmul_backward` then `add_assign`: the same bits, one op
    /// more.
    Composed,
}

impl Acc {
    fn name(self) -> &'static str {
        match self {
            Acc::Da => "da",
            Acc::Db => "db",
        }
    }

    /// What each op returns besides its accumulation: `db`'s without
    /// `dbias`, `da`'s with it, so both ways of the bias are run.
    fn needs(self) -> MatmulNeeds {
        match self {
            Acc::Da => MatmulNeeds {
                da: false,
                db: true,
                dbias: true,
            },
            Acc::Db => MatmulNeeds {
                da: true,
                db: false,
                dbias: false,
            },
        }
    }

    /// [`Self::needs`] and the accumulated gradient: what
    /// `matmul_backward` computes in its place.
    fn backward_needs(self) -> MatmulNeeds {
        match self {
            Acc::Da => MatmulNeeds {
                da: true,
                ..self.needs()
            },
            Acc::Db => MatmulNeeds {
                db: true,
                ..self.needs()
            },
        }
    }

    /// How a product of several passes accumulates.
    fn split(self) -> Path {
        match self {
            Acc::Da => Path::Composed,
            Acc::Db => Path::SplitK,
        }
    }

    fn into<E: Executor>(
        self,
        ex: &E,
        a: &E::Tensor,
        b: &E::Tensor,
        d: &E::Tensor,
        t: Transpose,
        acc: &mut E::Tensor,
    ) -> Result<MatmulGrads<E::Tensor>> {
        match self {
            Acc::Da => ex.matmul_backward_da_into(a, b, d, t, self.needs(), acc),
            Acc::Db => ex.matmul_backward_into(a, b, d, t, self.needs(), acc),
        }
    }

    /// The shapes of the tests, awkward ones next to whole 128-tiles of
    /// the accumulated gradient (with a K that is a multiple of the
    /// interior kernels' K step) and their edge strips.
    fn cases(self) -> Vec<Case> {
        let c = |lead: &[usize], m, k, n, t| Case {
            lead: lead.to_vec(),
            m,
            k,
            n,
            t,
        };
        match self {
            // Rows × C against a weight of V × C (NT) or C × V (NN), or
            // with `a` transposed (TN, 2-D: one sum per element); the second
            // and third have 24 rows.
            Acc::Db => vec![
                c(&[], 37, 45, 70, Transpose::NT),
                c(&[2], 12, 132, 260, Transpose::NT),
                c(&[2], 12, 260, 132, Transpose::NN),
                c(&[], 24, 140, 130, Transpose::TN),
                // A few tiles over 384 rows: K split into 6 parts of 64
                // where the product is f32 (`k_parts`).
                c(&[4], 96, 45, 70, Transpose::NT),
                c(&[], 384, 70, 45, Transpose::NN),
            ],
            // NT (the blocks' layout), NN, `a` transposed (TN, TT: the
            // gradient stored transposed) and a long K. The second to
            // fourth are [2·70, 132] or [140, 132] with a K of 48.
            Acc::Da => vec![
                c(&[], 37, 45, 70, Transpose::NT),
                c(&[2], 70, 132, 48, Transpose::NT),
                c(&[2], 70, 132, 48, Transpose::NN),
                c(&[], 140, 132, 48, Transpose::TN),
                c(&[2], 30, 50, 40, Transpose::TT),
                // K (the product's: n) past a small loop budget's 128.
                c(&[], 37, 45, 150, Transpose::NT),
            ],
        }
    }
}

struct Case {
    lead: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
}

/// `a`, `b`, `dout` and the accumulator's starting value.
fn hosts(acc: Acc, c: &Case, seed: u64, b_dtype: DType) -> [HostTensor; 4] {
    let mut sa = c.lead.clone();
    sa.extend(if c.t.a { [c.k, c.m] } else { [c.m, c.k] });
    let sb = if c.t.b { vec![c.n, c.k] } else { vec![c.k, c.n] };
    let mut sd = c.lead.clone();
    sd.extend([c.m, c.n]);
    let acc0 = rand_host(seed + 3, if acc == Acc::Da { &sa } else { &sb });
    [
        rand_host(seed, &sa),
        rand_host(seed + 1, &sb).to_dtype(b_dtype),
        rand_host(seed + 2, &sd),
        acc0,
    ]
}

/// The three gradients by name.
fn named<T>(g: &MatmulGrads<T>) -> [(&'static str, Option<&T>); 3] {
    [
        ("da", g.da.as_ref()),
        ("db", g.db.as_ref()),
        ("dbias", g.dbias.as_ref()),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `path`: how the executor should accumulate the case.
fn check(g: &GpuExecutor, cpu: &CpuExecutor, what: &str, acc: Acc, path: impl Fn(&Case) -> Path) {
    let mut seed = 0;
    for c in acc.cases() {
        for b_dtype in [DType::F32, DType::BF16, DType::F16] {
            seed += 10;
            let path = path(&c);
            let what = format!(
                "{what} {} lead {:?} m {} k {} n {} {:?} b {b_dtype} ({path:?})",
                acc.name(),
                c.lead,
                c.m,
                c.k,
                c.n,
                c.t
            );
            let [a, b, d, acc0] = hosts(acc, &c, seed, b_dtype);
            let (ga, gb, gd) = (
                g.upload(&a).unwrap(),
                g.upload(&b).unwrap(),
                g.upload(&d).unwrap(),
            );
            let mut gacc = g.upload(&acc0).unwrap();
            let ops = g.submit_stats().ops;
            let gr = acc.into(g, &ga, &gb, &gd, c.t, &mut gacc).unwrap();
            let into_ops = g.submit_stats().ops - ops;
            let got = down(g, &gacc);

            let ops = g.submit_stats().ops;
            let r = g
                .matmul_backward(&ga, &gb, &gd, c.t, acc.backward_needs())
                .unwrap();
            let bw_ops = g.submit_stats().ops - ops;
            let mut accumulated = None;
            for ((name, x), (_, y)) in named(&gr).into_iter().zip(named(&r)) {
                if name == acc.name() {
                    assert!(x.is_none(), "{what}: a {name} was returned");
                    accumulated = y;
                } else if let Some(x) = x {
                    let (x, y) = (down(g, x), down(g, y.unwrap()));
                    assert_close(&format!("{what}: {name}"), &x, &y, 0.0);
                    assert!(bits(&x) == bits(&y), "{what}: {name}");
                }
            }
            let mut want = g.upload(&acc0).unwrap();
            g.add_assign(&mut want, accumulated.unwrap()).unwrap();
            let want = down(g, &want);
            assert_close(&format!("{what}: into vs then-add"), &got, &want, TOL_F32);
            if path != Path::SplitK {
                assert!(
                    bits(&got) == bits(&want),
                    "{what}: accumulated gradient differs from compute + add_assign"
                );
            }
            let extra = if path == Path::Composed { 1 } else { 0 };
            assert_eq!(
                into_ops,
                bw_ops + extra,
                "{what}: ops of the accumulating backward"
            );

            let (ca, cb, cd) = (
                cpu.upload(&a).unwrap(),
                cpu.upload(&b).unwrap(),
                cpu.upload(&d).unwrap(),
            );
            let mut cacc = cpu.upload(&acc0).unwrap();
            acc.into(cpu, &ca, &cb, &cd, c.t, &mut cacc).unwrap();
            assert_close(
                &format!("{what}: GPU vs CPU"),
                &got,
                &down_cpu(cpu, &cacc),
                TOL_F32,
            );
        }
    }
}

#[test]
fn simt_checked_and_interior_tiles_accumulate_exactly() {
    let Some(g) = gpu() else { return };
    for acc in BOTH {
        check(g, &cpu(), "simt64", acc, |_| Path::OnePass);
    }
    let Some(g) = gpu_big_tile() else { return };
    for acc in BOTH {
        check(g, &cpu(), "simt128", acc, |_| Path::OnePass);
    }
}

#[test]
fn f16_kernels_accumulate_exactly() {
    let cpu = CpuExecutor::with_precision(ComputePrecision::F16);
    let Some(g) = simt128_f16() else {
        return;
    };
    for acc in BOTH {
        check(&g, &cpu, "simt f16", acc, |_| Path::OnePass);
    }
    let coop = GpuOptions {
        f16_matmul: F16Matmul::CoopEmulated(CoopTile::Small64),
        ..Default::default()
    };
    let g = gpu_with(coop, ComputePrecision::F16).expect("adapter");
    for acc in BOTH {
        check(&g, &cpu, "emulated tensor cores", acc, |_| Path::OnePass);
    }
    for (tile, g) in hardware_tiles("accumulation") {
        for acc in BOTH {
            check(&g, &cpu, &format!("tensor cores {}", tile.name()), acc, |_| {
                Path::OnePass
            });
        }
    }
}

/// Operands bound as several ranges (every case's exceed 4 KiB), and (for
/// `da`) K split over dispatches by a small loop budget.
#[test]
fn split_products_accumulate_within_tolerance_or_fall_back_to_the_same_bits() {
    let Some(g) = gpu_small_bindings() else { return };
    for acc in BOTH {
        check(g, &cpu(), "small bindings", acc, |_| acc.split());
    }
    let small_budget = GpuOptions {
        loop_budget: Some(100),
        ..Default::default()
    };
    let g = gpu_with(small_budget, ComputePrecision::F32).expect("adapter");
    check(&g, &cpu(), "small loop budget", Acc::Da, |c| {
        if c.n <= 128 { Path::OnePass } else { Path::Composed }
    });
}

/// A weight gradient of a few output tiles summed over many rows runs as
/// partial products over ranges of the rows, then their sum: one dispatch
/// more than where the rows do not split into parts of whole K steps, and
/// both within f32 rounding of the CPU's sums, accumulating or not. In
/// f32, and under F16 (against the CPU's sums of the same f16 operands)
/// on the emulated tensor-core tile and each hardware tile where the
/// adapter has them, whose parts are at least 512 rows.
#[test]
fn few_tiles_over_many_rows_split_the_sum() {
    let Some(g) = gpu() else { return };
    // 768 rows: 12 parts of 64. 760 = 8·95: no part a multiple of 16.
    split_the_sum(g, &cpu(), "f32", [768, 760]);
    // 1024 rows: 2 parts of 512 on the tensor-core tiles. 1016 = 8·127: no
    // part a multiple of 16.
    let cpu16 = CpuExecutor::with_precision(ComputePrecision::F16);
    let rows = [1024, 1016];
    let coop = GpuOptions {
        f16_matmul: F16Matmul::CoopEmulated(CoopTile::Small64),
        ..Default::default()
    };
    let g = gpu_with(coop, ComputePrecision::F16).expect("adapter");
    split_the_sum(&g, &cpu16, "emulated tensor cores", rows);
    for (tile, g) in hardware_tiles("split sums") {
        split_the_sum(&g, &cpu16, &format!("tensor cores {}", tile.name()), rows);
    }
}

/// The weight gradient of a [rows, 45] input to a 70-wide layer: split
/// over `rows[0]` rows, whole over `rows[1]`.
fn split_the_sum(g: &GpuExecutor, cpu: &CpuExecutor, family: &str, rows: [usize; 2]) {
    let mut dispatches = Vec::new();
    for (rows, seed) in [(rows[0], 1), (rows[1], 2)] {
        let c = Case {
            lead: vec![],
            m: rows,
            k: 45,
            n: 70,
            t: Transpose::NT,
        };
        let [a, b, d, acc0] = hosts(Acc::Db, &c, seed, DType::F32);
        let (ga, gb, gd) = (
            g.upload(&a).unwrap(),
            g.upload(&b).unwrap(),
            g.upload(&d).unwrap(),
        );
        let before = g.submit_stats().dispatches;
        let r = g
            .matmul_backward(&ga, &gb, &gd, c.t, Acc::Db.backward_needs())
            .unwrap();
        dispatches.push(g.submit_stats().dispatches - before);
        let (ca, cb, cd) = (
            cpu.upload(&a).unwrap(),
            cpu.upload(&b).unwrap(),
            cpu.upload(&d).unwrap(),
        );
        let want = cpu
            .matmul_backward(&ca, &cb, &cd, c.t, Acc::Db.backward_needs())
            .unwrap();
        let what = format!("{family}, {rows} rows: db");
        assert_close(
            &what,
            &down(g, r.db.as_ref().unwrap()),
            &down_cpu(cpu, want.db.as_ref().unwrap()),
            TOL_F32,
        );
        let mut gacc = g.upload(&acc0).unwrap();
        Acc::Db.into(g, &ga, &gb, &gd, c.t, &mut gacc).unwrap();
        let mut cacc = cpu.upload(&acc0).unwrap();
        Acc::Db.into(cpu, &ca, &cb, &cd, c.t, &mut cacc).unwrap();
        assert_close(
            &format!("{what} accumulated"),
            &down(g, &gacc),
            &down_cpu(cpu, &cacc),
            TOL_F32,
        );
    }
    assert_eq!(
        dispatches[0],
        dispatches[1] + 1,
        "{family}: dispatches ({} rows, {} rows)",
        rows[0],
        rows[1]
    );
}
