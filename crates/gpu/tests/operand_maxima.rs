//! The f16 operand maxima, and the tensor-core kernels' f16 operand copies,
//! remembered with their tensors: a tensor used in an f16 product is
//! scanned (and copied) once, or not scanned at all where the product that
//! stored it folded its max while storing; and every way of changing a
//! tensor's contents in place (add_assign, write_rows, the accumulating
//! backwards, embedding_backward, a weight slot's reload) makes the next
//! product scan (and copy) it again, unless the change itself folded the
//! new max (a product accumulating into it). Each change multiplies the
//! magnitudes by about 2^10, so a stale max would scale the operand by the
//! wrong power of two (and overflow f16), and a stale copy would be the old
//! operand; the product must have the bits of the same product on a fresh
//! upload of the new contents. Each check runs on the SIMT kernel (maxima)
//! and on a tensor-core tile, emulated so that it runs anywhere (maxima and
//! copies).

mod common;

use common::*;
use megatrain_gpu::{
    CoopTile, F16Attention, F16Matmul, F16Maxima, GpuExecutor, GpuOptions, GpuTensor, TransportChoice,
};
use megatrain_tensor::{
    AttnMask, ComputePrecision, DType, Executor, HostSlice, HostTensor, LossTerms, MatmulNeeds, Rope, Shape,
    Transpose, WeightSlot, WeightUpload,
};

const FAMILIES: [F16Matmul; 2] = [F16Matmul::Simt, F16Matmul::CoopEmulated(CoopTile::Small16x64)];

fn f16_executor(family: F16Matmul, transport: TransportChoice) -> Option<GpuExecutor> {
    let mut g = GpuExecutor::with_options(
        ctx()?,
        GpuOptions {
            poison_outputs: true,
            f16_matmul: family,
            transport,
            ..Default::default()
        },
    );
    g.set_compute_precision(ComputePrecision::F16).unwrap();
    Some(g)
}

fn big_host(seed: u64, shape: &[usize]) -> HostTensor {
    let h = rand_host(seed, shape);
    let v: Vec<f32> = h.to_f32_vec().iter().map(|x| x * 1024.0).collect();
    HostTensor::from_f32(shape.to_vec(), v).unwrap()
}

fn bits(g: &GpuExecutor, t: &GpuTensor) -> Vec<u32> {
    down(g, t).iter().map(|x| x.to_bits()).collect()
}

/// A fresh tensor with `t`'s contents (nothing remembered).
fn copy(g: &GpuExecutor, t: &GpuTensor) -> GpuTensor {
    g.upload(&g.download(t).unwrap()).unwrap()
}

/// `x @ w` (both f32), and the operand scans and f16 copies it recorded.
fn product_counted(g: &GpuExecutor, x: &GpuTensor, w: &GpuTensor) -> (Vec<u32>, u64, u64) {
    let (scans, copies) = (g.operand_max_scans(), g.operand_f16_copies());
    let y = g.matmul(x, w, None, Transpose::NN).unwrap();
    let scans = g.operand_max_scans() - scans;
    let copies = g.operand_f16_copies() - copies;
    (bits(g, &y), scans, copies)
}

fn is_coop(g: &GpuExecutor) -> bool {
    matches!(g.f16_matmul_kernel(), F16Matmul::CoopEmulated(_))
}

/// `x @ w` (both f32: both scanned, and copied for the tensor-core
/// kernels), and the scans it recorded.
fn product(g: &GpuExecutor, x: &GpuTensor, w: &GpuTensor) -> (Vec<u32>, u64) {
    let (y, scans, copies) = product_counted(g, x, w);
    // Every operand here is f32 and none was stored by a product: the
    // tensor-core kernels copy what is scanned, the SIMT kernel copies
    // nothing.
    assert_eq!(
        copies,
        if is_coop(g) { scans } else { 0 },
        "copies beside {scans} scans"
    );
    (y, scans)
}

/// `x` (`[r, c]`) remembers its max (and copy) through a product; `change`
/// rewrites it in place; the next product has the bits of the product on
/// a fresh upload, and scans `x` again (`rescans` 1) unless the change
/// folded x's new max itself (0: a product accumulating into it).
fn check_x(
    what: &str,
    rows: usize,
    cols: usize,
    rescans: u64,
    change: impl Fn(&GpuExecutor, &mut GpuTensor),
) {
    for family in FAMILIES {
        let Some(g) = f16_executor(family, TransportChoice::Auto) else {
            return;
        };
        let what = format!("{what} ({family})");
        let mut x = g.upload(&rand_host(1, &[rows, cols])).unwrap();
        let w = g.upload(&rand_host(2, &[cols, 19])).unwrap();
        assert_eq!(product(&g, &x, &w).1, 2, "{what}: first use scans x and w");
        assert_eq!(product(&g, &x, &w).1, 0, "{what}: second use scans nothing");
        change(&g, &mut x);
        let (got, scans, copies) = product_counted(&g, &x, &w);
        let (want, _) = product(&g, &copy(&g, &x), &w);
        assert!(
            got == want,
            "{what}: product after the change differs from a fresh upload's"
        );
        assert_eq!(scans, rescans, "{what}: scans of the changed x");
        assert_eq!(copies, is_coop(&g) as u64, "{what}: copies of the changed x");
    }
}

#[test]
fn add_assign_invalidates() {
    check_x("add_assign", 21, 33, 1, |g, x| {
        g.add_assign(x, &g.upload(&big_host(3, &[21, 33])).unwrap())
            .unwrap();
    });
}

#[test]
fn write_rows_invalidates() {
    check_x("write_rows", 21, 33, 1, |g, x| {
        g.write_rows(x, 5, &g.upload(&big_host(3, &[4, 33])).unwrap())
            .unwrap();
    });
}

#[test]
fn embedding_backward_invalidates() {
    check_x("embedding_backward", 21, 33, 1, |g, x| {
        let dout = g.upload(&big_host(3, &[3, 33])).unwrap();
        g.embedding_backward(&[4, 0, 20], &dout, x).unwrap();
    });
}

#[test]
fn accumulating_da_invalidates() {
    // x is the accumulator of a's gradient (a [21, 33], b [17, 33] as NT):
    // the product stores x's new contents whole and folds their max.
    check_x("matmul_backward_da_into", 21, 33, 0, |g, x| {
        let a = g.upload(&rand_host(3, &[21, 33])).unwrap();
        let b = g.upload(&big_host(4, &[17, 33])).unwrap();
        let dout = g.upload(&big_host(5, &[21, 17])).unwrap();
        let needs = MatmulNeeds {
            da: true,
            db: false,
            dbias: false,
        };
        g.matmul_backward_da_into(&a, &b, &dout, Transpose::NT, needs, x)
            .unwrap();
    });
}

#[test]
fn accumulating_db_invalidates() {
    // x is the accumulator of b's gradient: b [21, 33] read as NN.
    check_x("matmul_backward_into", 21, 33, 1, |g, x| {
        let a = g.upload(&big_host(3, &[9, 21])).unwrap();
        let b = g.upload(&rand_host(4, &[21, 33])).unwrap();
        let dout = g.upload(&big_host(5, &[9, 33])).unwrap();
        let needs = MatmulNeeds {
            da: false,
            db: true,
            dbias: false,
        };
        g.matmul_backward_into(&a, &b, &dout, Transpose::NN, needs, x)
            .unwrap();
    });
}

/// A handle sharing x's contents (a reshape) keeps them, and its max and
/// f16 copy, when x is changed (x is copied first); x's next product scans
/// only x.
#[test]
fn a_shared_handle_keeps_its_contents_and_max() {
    for family in FAMILIES {
        shared_handle(family);
    }
}

fn shared_handle(family: F16Matmul) {
    let Some(g) = f16_executor(family, TransportChoice::Auto) else {
        return;
    };
    let mut x = g.upload(&rand_host(1, &[21, 33])).unwrap();
    let w = g.upload(&rand_host(2, &[33, 19])).unwrap();
    let y = g.reshape(&x, &Shape::new([21, 33])).unwrap();
    assert_eq!(product(&g, &x, &w).1, 2);
    assert_eq!(product(&g, &y, &w).1, 0, "a reshape shares the max");
    g.add_assign(&mut x, &g.upload(&big_host(3, &[21, 33])).unwrap())
        .unwrap();
    let (got_y, scans) = product(&g, &y, &w);
    assert_eq!(scans, 0, "the reshape's contents did not change");
    assert!(
        got_y == product(&g, &copy(&g, &y), &w).0,
        "reshape after x changed"
    );
    let (got_x, scans) = product(&g, &x, &w);
    assert_eq!(scans, 1);
    assert!(got_x == product(&g, &copy(&g, &x), &w).0, "x after its change");
    // An f16 copy remembered through x comes back through a reshape, in the
    // shape it is asked in.
    g.f16_operand(&x).unwrap();
    let z = g.reshape(&x, &Shape::new([33, 21])).unwrap();
    let made = g.operand_f16_copies();
    let half = g.f16_operand(&z).unwrap();
    assert_eq!(g.operand_f16_copies(), made, "a reshape shares the copy");
    assert_eq!(half.dims(), [33, 21]);
}

/// f32 weights reloaded into the same slot: the new tensors, and the old
/// handles over the same buffer, are scanned (and copied) again.
#[test]
fn weight_reload_invalidates() {
    for family in FAMILIES {
        weight_reload(family);
    }
}

fn weight_reload(family: F16Matmul) {
    const SLOT: WeightSlot = WeightSlot { kind: 7, index: 0 };
    for t in [TransportChoice::Staging, TransportChoice::Mapped] {
        let Some(g) = f16_executor(family, t) else { return };
        if t == TransportChoice::Mapped
            && !g
                .context()
                .features
                .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS)
        {
            eprintln!("no MAPPABLE_PRIMARY_BUFFERS: mapped reload not tested");
            continue;
        }
        let shape = Shape::new([33, 19]);
        let x = g.upload(&rand_host(1, &[21, 33])).unwrap();
        let layer = |h: &HostTensor| {
            let v = h.to_f32_vec();
            g.load_weights(
                SLOT,
                &[WeightUpload {
                    shape: &shape,
                    data: HostSlice::F32(&v),
                    dtype: DType::F32,
                }],
            )
            .unwrap()
        };
        let (h1, h2) = (rand_host(2, &[33, 19]), big_host(3, &[33, 19]));
        let old = layer(&h1);
        assert_eq!(
            product(&g, &x, &old[0]).1,
            2,
            "{t:?}: x and the weight are scanned"
        );
        assert_eq!(product(&g, &x, &old[0]).1, 0, "{t:?}: once");
        let new = layer(&h2);
        assert_eq!(
            new[0].buffer(),
            old[0].buffer(),
            "{t:?}: the slot's buffer is reused"
        );
        let want = product(&g, &x, &g.upload(&h2).unwrap()).0;
        let (got, scans) = product(&g, &x, &new[0]);
        assert!(got == want, "{t:?}: product with the reloaded weight");
        assert_eq!(scans, 1, "{t:?}: the reloaded weight is scanned again");
        let (got, scans) = product(&g, &x, &old[0]);
        assert_eq!(scans, 0, "{t:?}: the old handle shares the new max");
        assert!(got == want, "{t:?}: product through the old handle");
    }
}

/// Scans (and copies) counted per use when the maxima are not remembered.
#[test]
fn recompute_option_scans_every_use() {
    let Some(ctx) = ctx() else { return };
    for family in FAMILIES {
        let mut g = GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                recompute_operand_maxima: true,
                f16_matmul: family,
                ..Default::default()
            },
        );
        g.set_compute_precision(ComputePrecision::F16).unwrap();
        let x = g.upload(&rand_host(1, &[21, 33])).unwrap();
        let w = g.upload(&rand_host(2, &[33, 19])).unwrap();
        let (a, n1) = product(&g, &x, &w);
        let (b, n2) = product(&g, &x, &w);
        assert_eq!((n1, n2), (2, 2), "{family}");
        assert!(a == b, "{family}");
    }
}

/// max|x| of `t` as the host finds it.
fn host_max(g: &GpuExecutor, t: &GpuTensor) -> f32 {
    down(g, t).iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// `[r, c]` random values with row `spike` (when in range) scaled by 2^10,
/// so that the product's largest magnitudes lie in that row's tile.
fn spiked(seed: u64, r: usize, c: usize, spike: usize) -> HostTensor {
    let mut v = rand_host(seed, &[r, c]).to_f32_vec();
    if spike < r {
        v[spike * c..(spike + 1) * c]
            .iter_mut()
            .for_each(|x| *x *= 1024.0);
    }
    HostTensor::from_f32(vec![r, c], v).unwrap()
}

/// Under F16 a product keeps its workgroups' max|C| as it stores C (where
/// it stores each element once, with its final value), remembered with C
/// and folded by the first f16 product that reads C: the f32 a scan
/// finds, before the fold (folded on the host) and after it, and that
/// product scans only its other operand. Forward products in each layout, a backward's `da` (fresh,
/// stored transposed, and accumulated) but not its `db` (weight gradients
/// are not read by products); the spike puts the largest output in the
/// first, an interior or the last tile row. On the SIMT kernel (64 tile;
/// 128 tile with interior pipelines), an emulated tensor-core tile and,
/// where the adapter has them, the hardware tiles; the first and the
/// emulated tile again with operands bound as a grid of sub-blocks, where
/// a product whose K is split over dispatches (storing partial sums)
/// folds nothing and its output is scanned when read. `F16Maxima::Scan`
/// folds nothing and gives the same bits.
#[test]
fn products_fold_their_outputs_maxima() {
    let small = GpuOptions {
        max_binding_bytes: Some(4096),
        ..Default::default()
    };
    let big = GpuOptions {
        matmul_tile: Some(128),
        ..Default::default()
    };
    let families = [
        (F16Matmul::Simt, GpuOptions::default()),
        (F16Matmul::Simt, big),
        (F16Matmul::Simt, small.clone()),
        (FAMILIES[1], GpuOptions::default()),
        (FAMILIES[1], small),
    ];
    let mut executors = Vec::new();
    for (family, opts) in families {
        let opts = GpuOptions {
            f16_matmul: family,
            ..opts
        };
        let Some(g) = gpu_with(opts.clone(), ComputePrecision::F16) else {
            return;
        };
        executors.push((g, opts));
    }
    for (tile, g) in hardware_tiles("output maxima") {
        let opts = GpuOptions {
            f16_matmul: F16Matmul::Coop(tile),
            ..Default::default()
        };
        executors.push((g, opts));
    }
    for (mut g, opts) in executors {
        let family = opts.f16_matmul;
        let blocks = opts.max_binding_bytes.is_some();
        let what = format!("{family}, 4 KiB bindings {blocks}, tile {:?}", opts.matmul_tile);
        let mut folded = 0;
        // The max remembered for `t`: exact, and present unless the
        // product ran in blocks (where K may have been split).
        let mut check = |g: &GpuExecutor, what: &str, t: &GpuTensor| -> bool {
            let got = g.remembered_max(t).unwrap();
            assert!(got.is_some() || blocks, "{what}: no max remembered");
            if let Some(got) = got {
                assert_eq!(got, host_max(g, t), "{what}: remembered max");
                folded += 1;
            }
            got.is_some()
        };
        // (m, k, n): edges everywhere; whole tiles (the interior pipelines)
        // beside edges on the tile the family has.
        let whole = match (family, opts.matmul_tile) {
            (F16Matmul::Simt, Some(_)) => Some((256, 64, 256)),
            (F16Matmul::Simt, None) => None,
            (F16Matmul::Coop(_), _) => Some((256, 64, 256)),
            _ => Some((37, 48, 70)),
        };
        for (m, k, n) in [(37, 45, 70)].into_iter().chain(whole) {
            for spike in [0, m / 2 + 3, m - 1] {
                let what = format!("{what}, {m}x{k}x{n}, spike in row {spike}");
                let x = g.upload(&spiked(spike as u64, m, k, spike)).unwrap();
                let w_nn = g.upload(&rand_host(2, &[k, n])).unwrap();
                let w_nt = g.upload(&rand_host(3, &[n, k])).unwrap();
                for (t, w) in [(Transpose::NN, &w_nn), (Transpose::NT, &w_nt)] {
                    let y = g.matmul(&x, w, None, t).unwrap();
                    let remembered = check(&g, &format!("{what}: {t:?} y"), &y);
                    let w2 = g.upload(&rand_host(4, &[n, 5])).unwrap();
                    let scans = g.operand_max_scans();
                    let z = g.matmul(&y, &w2, None, Transpose::NN).unwrap();
                    let want_scans = if remembered { 1 } else { 2 };
                    assert_eq!(g.operand_max_scans() - scans, want_scans, "{what}: {t:?} scans");
                    let fresh = g.matmul(&copy(&g, &y), &w2, None, Transpose::NN).unwrap();
                    assert!(bits(&g, &z) == bits(&g, &fresh), "{what}: {t:?} product of y");
                    // Now as absmax.wgsl folded the stored maxima for z.
                    check(&g, &format!("{what}: {t:?} y, folded"), &y);
                }
                let dout = g.upload(&spiked(5, m, n, spike)).unwrap();
                for (t, w) in [(Transpose::NN, &w_nn), (Transpose::NT, &w_nt)] {
                    let r = g.matmul_backward(&x, w, &dout, t, MatmulNeeds::ALL).unwrap();
                    check(&g, &format!("{what}: {t:?} da"), r.da.as_ref().unwrap());
                    let db = r.db.as_ref().unwrap();
                    assert_eq!(g.remembered_max(db).unwrap(), None, "{what}: {t:?} db");
                }
                // a stored [k, m] and read transposed (TN): its gradient is
                // stored transposed (the kernels' TRANS_C).
                let xt = g.upload(&spiked(6, k, m, k - 1)).unwrap();
                let r = g
                    .matmul_backward(&xt, &w_nn, &dout, Transpose::TN, MatmulNeeds::ALL)
                    .unwrap();
                check(&g, &format!("{what}: TN da"), r.da.as_ref().unwrap());
                // Accumulated: the max of what the accumulator then holds.
                let mut acc = g.upload(&rand_host(7, &[m, k])).unwrap();
                let needs = MatmulNeeds {
                    da: true,
                    db: false,
                    dbias: false,
                };
                g.matmul_backward_da_into(&x, &w_nn, &dout, Transpose::NN, needs, &mut acc)
                    .unwrap();
                check(&g, &format!("{what}: da_into"), &acc);
            }
        }
        assert!(folded > 0, "{what}: no product folded its maxima");
        // Left to the scans: nothing folded, the same bits.
        let scan = gpu_with(
            GpuOptions {
                f16_maxima: F16Maxima::Scan,
                ..opts.clone()
            },
            ComputePrecision::F16,
        )
        .unwrap();
        let (x, w) = (spiked(1, 37, 45, 36), rand_host(2, &[45, 70]));
        let w2 = rand_host(4, &[70, 5]);
        let z = |g: &GpuExecutor| {
            let y = g
                .matmul(
                    &g.upload(&x).unwrap(),
                    &g.upload(&w).unwrap(),
                    None,
                    Transpose::NN,
                )
                .unwrap();
            let scans = g.operand_max_scans();
            let z = g
                .matmul(&y, &g.upload(&w2).unwrap(), None, Transpose::NN)
                .unwrap();
            (
                bits(g, &z),
                g.operand_max_scans() - scans,
                g.remembered_max(&y).unwrap().is_some(),
            )
        };
        let (zs, zf) = (z(&scan), z(&g));
        assert_eq!((zs.1, zs.2), (2, true), "{what}: scan leaves y to the scan");
        assert!(
            zs.0 == zf.0,
            "{what}: scanned and folded maxima give the same bits"
        );
        // Under F32 nothing is folded (no binding for it).
        g.set_compute_precision(ComputePrecision::F32).unwrap();
        let x = g.upload(&rand_host(1, &[9, 7])).unwrap();
        let y = g
            .matmul(
                &x,
                &g.upload(&rand_host(2, &[7, 5])).unwrap(),
                None,
                Transpose::NN,
            )
            .unwrap();
        assert_eq!(g.remembered_max(&y).unwrap(), None, "{what}: F32");
    }
}

/// An f16 executor on the SIMT kernel with `bindings` (bytes, `None`: the
/// adapter's) and `maxima`, and a `[cols, 5]` weight it has scanned: the
/// product that reads an output `[rows, cols]` then scans at most that.
fn f16_reader(bindings: Option<u64>, maxima: F16Maxima, cols: usize) -> Option<(GpuExecutor, GpuTensor)> {
    let opts = GpuOptions {
        max_binding_bytes: bindings,
        f16_maxima: maxima,
        ..Default::default()
    };
    f16_reader_with(opts, cols)
}

/// [`f16_reader`] with `opts` (its f16 matmuls on the SIMT kernel).
fn f16_reader_with(opts: GpuOptions, cols: usize) -> Option<(GpuExecutor, GpuTensor)> {
    let opts = GpuOptions {
        f16_matmul: F16Matmul::Simt,
        ..opts
    };
    let g = gpu_with(opts, ComputePrecision::F16)?;
    let w = g.upload(&rand_host(9, &[cols, 5])).unwrap();
    let probe = g.upload(&rand_host(8, &[3, cols])).unwrap();
    g.matmul(&probe, &w, None, Transpose::NN).unwrap();
    Some((g, w))
}

/// `y` (`[rows, cols]` as `flat`) as its producer left it under `maxima`:
/// its max remembered exactly (`Fold`) or not at all (`Scan`); the product
/// reading it scans nothing or y; then y's max is exact either way.
fn check_stored_max(
    g: &GpuExecutor,
    what: &str,
    y: &GpuTensor,
    flat: &GpuTensor,
    w: &GpuTensor,
    maxima: F16Maxima,
) {
    let fold = maxima == F16Maxima::Fold;
    let want = host_max(g, y);
    assert_eq!(
        g.remembered_max(y).unwrap(),
        fold.then_some(want),
        "{what}: stored"
    );
    let scans = g.operand_max_scans();
    g.matmul(flat, w, None, Transpose::NN).unwrap();
    assert_eq!(g.operand_max_scans() - scans, u64::from(!fold), "{what}: scans");
    assert_eq!(g.remembered_max(y).unwrap(), Some(want), "{what}: read");
}

/// The norms' outputs (y forward, dx backward) are f16 products' operands
/// too: under F16 each row's max is folded as the row is stored and the
/// rows' maxima into the output's, remembered as a scan's would be, with
/// the spike (one element, in column 200 of 300: a thread of the upper half
/// of the row's workgroup) in the first, a middle or the last row, on one
/// binding and on row chunks of 4 KiB bindings; `F16Maxima::Scan` leaves
/// them to scans.
#[test]
fn norms_fold_their_outputs_maxima() {
    let (rows, c, eps) = (37, 300, 1e-5);
    let spiked_at = |seed: u64, spike: usize| {
        let mut h = spiked(seed, rows, c, usize::MAX).to_f32_vec();
        h[spike * c + 200] *= 1024.0;
        HostTensor::from_f32(vec![rows, c], h).unwrap()
    };
    // Weights in [0.5, 1.5]: the spike stays the output's largest element.
    let weight = |seed| {
        let v = rand_host(seed, &[c])
            .to_f32_vec()
            .iter()
            .map(|x| 1.0 + 0.5 * x)
            .collect();
        HostTensor::from_f32(vec![c], v).unwrap()
    };
    for bindings in [None, Some(4096)] {
        for maxima in [F16Maxima::Fold, F16Maxima::Scan] {
            let Some((g, w16)) = f16_reader(bindings, maxima, c) else {
                return;
            };
            for spike in [0, rows / 2, rows - 1] {
                let what = format!("{maxima}, bindings {bindings:?}, spike in row {spike}");
                let up = |seed: u64| g.upload(&spiked_at(seed, spike)).unwrap();
                let (x, r, dy, dh) = (up(1), up(2), up(3), up(4));
                let (w, b) = (g.upload(&weight(5)).unwrap(), g.upload(&weight(6)).unwrap());
                let rms = g.rmsnorm(&x, &w, eps).unwrap();
                let ln = g.layernorm(&x, &w, &b, eps).unwrap();
                let arms = g.add_rmsnorm(&x, &r, &w, eps).unwrap();
                let aln = g.add_layernorm(&x, &r, &w, &b, eps).unwrap();
                let ln_mean = ln.mean.as_ref().unwrap();
                let aln_mean = aln.norm.mean.as_ref().unwrap();
                let outputs = [
                    ("rmsnorm y", rms.y.clone()),
                    ("layernorm y", ln.y.clone()),
                    ("add_rmsnorm y", arms.norm.y.clone()),
                    ("add_layernorm y", aln.norm.y.clone()),
                    (
                        "rmsnorm dx",
                        g.rmsnorm_backward(&x, &w, &rms.rstd, &dy).unwrap().dx,
                    ),
                    (
                        "layernorm dx",
                        g.layernorm_backward(&x, &w, ln_mean, &ln.rstd, &dy).unwrap().dx,
                    ),
                    (
                        "add_rmsnorm dx",
                        g.add_rmsnorm_backward(&arms.h, &w, &arms.norm.rstd, &dy, &dh)
                            .unwrap()
                            .dx,
                    ),
                    (
                        "add_layernorm dx",
                        g.add_layernorm_backward(&aln.h, &w, aln_mean, &aln.norm.rstd, &dy, &dh)
                            .unwrap()
                            .dx,
                    ),
                ];
                for (name, t) in outputs {
                    check_stored_max(&g, &format!("{what}: {name}"), &t, &t, &w16, maxima);
                }
            }
        }
    }
}

/// RoPE's outputs (q and k rotated, and their gradients through the
/// backward) are attention's and the projections' operands: under F16
/// each workgroup keeps its max, folded when a product reads them; spikes
/// in the first, a middle or the last (batch, position, head) row, at
/// offset 0 and 5, on one binding and on row chunks; rotating the whole
/// head and its first 10 entries, the largest then one passed through;
/// `Scan` scans.
#[test]
fn rope_folds_its_outputs_maxima() {
    let (b, t, h, d) = (2, 9, 3, 16);
    let rows = b * t * h;
    for bindings in [None, Some(1024)] {
        for maxima in [F16Maxima::Fold, F16Maxima::Scan] {
            let Some((g, w)) = f16_reader(bindings, maxima, d) else {
                return;
            };
            for spike in [0, rows / 2, rows - 1] {
                for (offset, rotary_dim) in [(0, None), (5, None), (5, Some(10))] {
                    let what = format!(
                        "{maxima}, bindings {bindings:?}, spike in row {spike}, offset {offset}, rotating {rotary_dim:?}"
                    );
                    let mut x = spiked(spike as u64, rows, d, spike).to_f32_vec();
                    if rotary_dim.is_some() {
                        x[spike * d + d - 1] = 4096.0;
                    }
                    let x = g
                        .upload(&HostTensor::from_f32(vec![b, t, h, d], x).unwrap())
                        .unwrap();
                    let rope = Rope {
                        rotary_dim,
                        ..Rope::plain(10000.0, offset)
                    };
                    for (name, y) in [
                        ("rope", g.rope(&x, rope.clone()).unwrap()),
                        ("rope_backward", g.rope_backward(&x, rope.clone()).unwrap()),
                    ] {
                        let flat = g.reshape(&y, &Shape::new([rows, d])).unwrap();
                        check_stored_max(&g, &format!("{what}: {name}"), &y, &flat, &w, maxima);
                    }
                }
            }
        }
    }
}

/// Attention's out (forward) and dv (backward) are the output and V
/// projections' operands: under F16 each workgroup of the pass that stores
/// them (the last, where the SIMT kernels split the streamed side) keeps
/// its max, folded when a product reads them. The SIMT kernels and the
/// tensor-core family (emulated everywhere, real where the adapter has
/// cooperative matrices); T = 70 (a partial last block), GQA 4/2; spikes
/// in V and dO at the first, a middle or the last position of the second
/// batch, on one binding and on batch chunks (and, for SIMT, key and
/// query ranges); `Scan` scans.
#[test]
fn attention_folds_its_outputs_maxima() {
    let (b, t, hq, hkv, d) = (2, 70, 4, 2, 64);
    let cases = [
        (F16Attention::Simt, None, None),
        // One batch per chunk; three key ranges and several query ranges.
        (F16Attention::Simt, Some(80 << 10), Some(6000)),
        (F16Attention::CoopEmulated, None, None),
        (F16Attention::CoopEmulated, Some(80 << 10), None),
        (F16Attention::Coop, None, None),
    ];
    for (kind, bindings, loop_budget) in cases {
        if kind == F16Attention::Coop && !ctx().is_some_and(|c| c.has_cooperative_matrix()) {
            eprintln!("no cooperative matrices here: the tensor-core attention's maxima NOT tested");
            continue;
        }
        for maxima in [F16Maxima::Fold, F16Maxima::Scan] {
            let opts = GpuOptions {
                max_binding_bytes: bindings,
                loop_budget,
                f16_attention: kind,
                f16_maxima: maxima,
                ..Default::default()
            };
            let Some((g, w)) = f16_reader_with(opts, d) else {
                return;
            };
            for spike in [0, t / 2, t - 1] {
                let what = format!("{kind:?}, {maxima}, bindings {bindings:?}, spike at {spike}");
                let up = |seed: u64, h: usize, spike_head: Option<usize>| {
                    let row = spike_head.map_or(usize::MAX, |hh| (t + spike) * h + hh);
                    let x = spiked(seed, b * t * h, d, row);
                    g.upload(&HostTensor::from_f32(vec![b, t, h, d], x.to_f32_vec()).unwrap())
                        .unwrap()
                };
                let (q, k) = (up(1, hq, None), up(2, hkv, None));
                let (v, dout) = (up(3, hkv, Some(1)), up(4, hq, Some(3)));
                let fwd = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
                let flat = g.reshape(&fwd.out, &Shape::new([b * t * hq, d])).unwrap();
                check_stored_max(&g, &format!("{what}: out"), &fwd.out, &flat, &w, maxima);
                let grads = g.attention_backward(&q, &k, &v, &fwd, &dout).unwrap();
                let flat = g.reshape(&grads.dv, &Shape::new([b * t * hkv, d])).unwrap();
                check_stored_max(&g, &format!("{what}: dv"), &grads.dv, &flat, &w, maxima);
                for (name, x) in [("dq", &grads.dq), ("dk", &grads.dk)] {
                    assert_eq!(g.remembered_max(x).unwrap(), None, "{what}: {name}");
                }
            }
        }
    }
}

/// The logits' gradient from the fused cross-entropy is the head's f16
/// products' operand: under F16 each row's workgroup keeps its max (0 for
/// an ignored row), folded when a product reads it; rows with the largest
/// gradient first, in the middle or last, on one binding and on row
/// chunks; `Scan` scans.
#[test]
fn cross_entropy_folds_its_gradients_maxima() {
    let (n, v) = (37, 300);
    for bindings in [None, Some(8192)] {
        for maxima in [F16Maxima::Fold, F16Maxima::Scan] {
            let Some((g, w)) = f16_reader(bindings, maxima, v) else {
                return;
            };
            for spike in [0, n / 2, n - 1] {
                let what = format!("{maxima}, bindings {bindings:?}, spike in row {spike}");
                // The spiked row's gradient is the largest: its target's
                // logit (column 200: a thread of the upper half of the
                // row's workgroup) far below the others'.
                let mut x = rand_host(1, &[n, v]).to_f32_vec();
                x[spike * v + 200] = -30.0;
                let logits = g.upload(&HostTensor::from_f32(vec![n, v], x).unwrap()).unwrap();
                let targets: Vec<i32> = (0..n)
                    .map(|r| {
                        if r == 5 {
                            -100
                        } else if r == spike {
                            200
                        } else {
                            (r * 13 % v) as i32
                        }
                    })
                    .collect();
                let out = g
                    .cross_entropy(&logits, &targets, -100, 1.0 / n as f32, LossTerms::NONE)
                    .unwrap();
                check_stored_max(
                    &g,
                    &format!("{what}: dlogits"),
                    &out.dlogits,
                    &out.dlogits,
                    &w,
                    maxima,
                );
            }
        }
    }
}
