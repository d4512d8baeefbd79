//! The CPU executor keeps bf16/f16 tensors (the 16-bit transport copies of
//! weights) in 2 bytes per element and widens them a panel or a row at a
//! time where an op reads them. Every such op must give, bit for bit, what
//! it gives on the same values uploaded widened to f32.

use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, CpuTensor, DType, Executor, F64Executor, HostSlice, HostTensor,
    MatmulNeeds, Shape, TensorHandle, Transpose, WeightSlot, WeightUpload, bf16, f16,
};

const ALL_T: [Transpose; 4] = [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT];
const PRECISIONS: [ComputePrecision; 2] = [ComputePrecision::F32, ComputePrecision::F16];
const DTYPES: [DType; 2] = [DType::BF16, DType::F16];

/// `shape` filled with random values rounded to `dtype`: the tensor stored
/// in `dtype`, and the same values stored as f32.
fn pair(ex: &CpuExecutor, seed: u64, shape: &[usize], dtype: DType) -> (CpuTensor<f32>, CpuTensor<f32>) {
    let host = HostTensor::from_f32(shape.to_vec(), random_f32(seed, shape.iter().product()))
        .unwrap()
        .to_dtype(dtype);
    let wide = HostTensor::from_f32(shape.to_vec(), host.to_f32_vec()).unwrap();
    let (p, w) = (ex.upload(&host).unwrap(), ex.upload(&wide).unwrap());
    assert_eq!((p.dtype(), w.dtype()), (dtype, DType::F32));
    (p, w)
}

fn up(ex: &CpuExecutor, seed: u64, shape: &[usize]) -> CpuTensor<f32> {
    ex.upload(&HostTensor::from_f32(shape.to_vec(), random_f32(seed, shape.iter().product())).unwrap())
        .unwrap()
}

fn bits(t: &CpuTensor<f32>) -> Vec<u32> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

/// One product: `a` of `lead + [m, k]` (transposed per `t`), `b` of `[k, n]`
/// or, when `b_lead`, `lead + [k, n]`.
fn check_matmul(lead: &[usize], m: usize, k: usize, n: usize, b_lead: bool) {
    let mut seed = 1;
    for dtype in DTYPES {
        for precision in PRECISIONS {
            let ex = CpuExecutor::with_precision(precision);
            for t in ALL_T {
                let what =
                    format!("{dtype} {precision:?} {t:?} lead {lead:?} m {m} k {k} n {n} b_lead {b_lead}");
                seed += 10;
                let mut ashape = lead.to_vec();
                ashape.extend(if t.a { [k, m] } else { [m, k] });
                let mut bshape = if b_lead { lead.to_vec() } else { vec![] };
                bshape.extend(if t.b { [n, k] } else { [k, n] });
                let mut oshape = lead.to_vec();
                oshape.extend([m, n]);
                let a = up(&ex, seed, &ashape);
                let (bp, bw) = pair(&ex, seed + 1, &bshape, dtype);
                let bias = up(&ex, seed + 2, &[n]);
                let dout = up(&ex, seed + 3, &oshape);

                for bias in [None, Some(&bias)] {
                    let yp = ex.matmul(&a, &bp, bias, t).unwrap();
                    let yw = ex.matmul(&a, &bw, bias, t).unwrap();
                    assert_eq!(bits(&yp), bits(&yw), "matmul {what} bias {}", bias.is_some());
                }
                let gp = ex.matmul_backward(&a, &bp, &dout, t, MatmulNeeds::ALL).unwrap();
                let gw = ex.matmul_backward(&a, &bw, &dout, t, MatmulNeeds::ALL).unwrap();
                assert_eq!(
                    bits(gp.da.as_ref().unwrap()),
                    bits(gw.da.as_ref().unwrap()),
                    "da {what}"
                );
                assert_eq!(
                    bits(gp.db.as_ref().unwrap()),
                    bits(gw.db.as_ref().unwrap()),
                    "db {what}"
                );
                assert_eq!(gp.db.as_ref().unwrap().dtype(), DType::F32, "{what}");
                assert_eq!(
                    bits(gp.dbias.as_ref().unwrap()),
                    bits(gw.dbias.as_ref().unwrap()),
                    "dbias {what}"
                );
                // Each gradient alone, as the layers ask for them.
                let only_da = MatmulNeeds {
                    da: true,
                    db: false,
                    dbias: false,
                };
                let g = ex.matmul_backward(&a, &bp, &dout, t, only_da).unwrap();
                assert_eq!(
                    bits(g.da.as_ref().unwrap()),
                    bits(gw.da.as_ref().unwrap()),
                    "da only {what}"
                );
                assert!(g.db.is_none() && g.dbias.is_none());
            }
        }
    }
}

#[test]
fn matmul_with_a_16_bit_b_equals_it_on_the_widened_b() {
    check_matmul(&[], 7, 13, 11, false);
    check_matmul(&[], 1, 1, 1, false);
    check_matmul(&[2, 3], 5, 9, 6, false);
    check_matmul(&[3], 4, 5, 7, true);
}

/// Past one widening panel (2^22 elements of b, or 256 columns where the
/// inner dimension is long) in both directions: the forward's panels split
/// n, the backward's split k, all with a short last panel.
#[test]
fn matmul_over_several_panels_equals_it_on_the_widened_b() {
    check_matmul(&[], 3, 129, 33_000, false);
    check_matmul(&[2], 2, 33_000, 131, false);
    // da in 256-column panels (2^22 / 16,500 is fewer).
    check_matmul(&[], 2, 300, 16_500, false);
}

#[test]
fn f64_executor_reads_16_bit_operands_exactly_too() {
    let ex = F64Executor::new();
    for dtype in DTYPES {
        let vals = random_f32(5, 6 * 5);
        let host = HostTensor::from_f32([6, 5], vals).unwrap().to_dtype(dtype);
        let wide: Vec<f64> = host.to_f32_vec().iter().map(|&x| x as f64).collect();
        let bp = ex.upload(&host).unwrap();
        let bw = CpuTensor::from_vec([6, 5], wide).unwrap();
        let a = CpuTensor::from_vec([3, 5], random_f32(6, 15).iter().map(|&x| x as f64).collect()).unwrap();
        let (yp, yw) = (
            ex.matmul(&a, &bp, None, Transpose::NT).unwrap(),
            ex.matmul(&a, &bw, None, Transpose::NT).unwrap(),
        );
        assert_eq!(yp.data(), yw.data(), "{dtype}");
        let ids = [5, 0, 3];
        assert_eq!(
            ex.embedding(&ids, &bp).unwrap().data(),
            ex.embedding(&ids, &bw).unwrap().data(),
            "{dtype}"
        );
    }
}

#[test]
fn embedding_gathers_16_bit_rows_exactly() {
    let ex = CpuExecutor::new();
    for dtype in DTYPES {
        let (tp, tw) = pair(&ex, 40, &[37, 19], dtype);
        let ids = [36, 0, 5, 5, 17];
        let (gp, gw) = (ex.embedding(&ids, &tp).unwrap(), ex.embedding(&ids, &tw).unwrap());
        assert_eq!(gp.dtype(), DType::F32);
        assert_eq!(bits(&gp), bits(&gw), "{dtype}");
        let err = ex.embedding(&[3, 37], &tp).unwrap_err().to_string();
        assert!(err.contains("37"), "{err}");
    }
}

/// Data movement keeps a 16-bit tensor 16-bit, and downloads give back the
/// stored values.
#[test]
fn layout_ops_and_downloads_keep_16_bit_tensors_as_stored() {
    let ex = CpuExecutor::new();
    for dtype in DTYPES {
        let (p, w) = pair(&ex, 50, &[6, 10], dtype);
        let wv = w.data().to_vec();
        let same = |t: &CpuTensor<f32>, want: &[f32], what: &str| {
            assert_eq!(t.dtype(), dtype, "{what} {dtype}");
            assert_eq!(t.stored_bytes(), 2 * t.numel() as u64, "{what} {dtype}");
            assert_eq!(*t.values(), *want, "{what} {dtype}");
        };
        same(&ex.reshape(&p, &Shape::new([3, 20])).unwrap(), &wv, "reshape");
        same(&ex.slice_rows(&p, 2, 3).unwrap(), &wv[20..50], "slice_rows");
        let parts = ex.split_last(&p, &[3, 7]).unwrap();
        let left: Vec<f32> = wv.chunks(10).flat_map(|r| r[..3].to_vec()).collect();
        same(&parts[0], &left, "split_last");
        same(
            &ex.concat_last(&[&parts[0], &parts[1]]).unwrap(),
            &wv,
            "concat_last",
        );
        let mut dst = ex.reshape(&p, p.shape()).unwrap();
        let src = ex.slice_rows(&p, 0, 2).unwrap();
        ex.write_rows(&mut dst, 4, &src).unwrap();
        let mut want = wv.clone();
        want.copy_within(0..20, 40);
        same(&dst, &want, "write_rows");
        assert!(
            ex.write_rows(&mut dst, 0, &ex.slice_rows(&w, 0, 1).unwrap())
                .is_err()
        );
        assert!(ex.concat_last(&[&p, &w]).is_err());
        assert!(
            ex.add(&p, &w).is_err(),
            "only matmul b and embedding tables may be 16-bit"
        );

        let host = ex.download(&p).unwrap();
        assert_eq!(host.dtype(), dtype);
        assert_eq!(host.to_f32_vec(), wv);
        let mut out = vec![0.0f32; 60];
        ex.download_into(&p, &mut out).unwrap();
        assert_eq!(out, wv);
        let mut part = vec![0.0f32; 33];
        ex.download_range_into(&p, 17..50, &mut part).unwrap();
        assert_eq!(part, wv[17..50]);
    }
}

/// A 16-bit tensor takes 2 bytes per element in RAM, and the executor's
/// byte count (its "device" memory) says so.
#[test]
fn a_16_bit_tensor_takes_2_bytes_per_element() {
    let ex = CpuExecutor::new();
    let shape = Shape::new([33, 17]);
    let n = shape.numel();
    let vals = random_f32(60, n);
    let b: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
    let h: Vec<f16> = vals.iter().map(|&x| f16::from_f32(x)).collect();
    let tb = ex.upload_slice(&shape, HostSlice::BF16(&b)).unwrap();
    let th = ex.upload_slice(&shape, HostSlice::F16(&h)).unwrap();
    let tf = ex.upload_slice(&shape, HostSlice::F32(&vals)).unwrap();
    assert_eq!(tb.stored_bytes(), 2 * n as u64);
    assert_eq!(th.stored_bytes(), 2 * n as u64);
    assert_eq!(tf.stored_bytes(), 4 * n as u64);
    let hb = HostTensor::new(shape.clone(), megatrain_tensor::HostData::BF16(b.clone())).unwrap();
    assert_eq!(ex.upload(&hb).unwrap().stored_bytes(), 2 * n as u64);

    // Weights loaded as the trainer loads them, bf16 transport.
    let ws = ex
        .load_weights(
            WeightSlot { kind: 0, index: 0 },
            &[WeightUpload {
                shape: &shape,
                data: HostSlice::BF16(&b),
                dtype: DType::BF16,
            }],
        )
        .unwrap();
    assert_eq!((ws[0].dtype(), ws[0].stored_bytes()), (DType::BF16, 2 * n as u64));

    // The process-wide count moves by the stored bytes; other tests in this
    // binary allocate concurrently, so the check allows for them through a
    // large tensor whose 2 vs 4 bytes per element nothing else could mimic.
    let big = 1 << 24;
    let zeros = vec![bf16::ZERO; big];
    let before = ex.memory_stats().unwrap().live_bytes as i64;
    let t = ex
        .upload_slice(&Shape::new([big]), HostSlice::BF16(&zeros))
        .unwrap();
    let grew = ex.memory_stats().unwrap().live_bytes as i64 - before;
    assert!(
        (grew - 2 * big as i64).abs() < big as i64 / 2,
        "live bytes grew by {grew} for {big} bf16 elements"
    );
    drop(t);
}
