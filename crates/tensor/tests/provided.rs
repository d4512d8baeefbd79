//! The Executor trait's provided methods, on the CPU executor.

use megatrain_tensor::{CpuExecutor, DType, Executor, HostSlice, Shape, TensorHandle, bf16};

#[test]
fn upload_slice_keeps_dtype_and_download_into_widens() {
    let ex = CpuExecutor::new();
    let shape = Shape::new([2, 3]);
    let vals = [1.0f32, -2.5, 3.25, 0.0, 7.0, -0.125];
    let t = ex.upload_slice(&shape, HostSlice::F32(&vals)).unwrap();
    assert_eq!(t.dtype(), DType::F32);
    let mut out = [0.0f32; 6];
    ex.download_into(&t, &mut out).unwrap();
    assert_eq!(out, vals);

    let packed: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
    let t = ex.upload_slice(&shape, HostSlice::BF16(&packed)).unwrap();
    assert_eq!(t.dtype(), DType::BF16);
    ex.download_into(&t, &mut out).unwrap();
    assert_eq!(out, vals, "these values are exact in bf16");
}

#[test]
fn shape_and_length_mismatches_are_errors() {
    let ex = CpuExecutor::new();
    let err = ex
        .upload_slice(&Shape::new([2, 2]), HostSlice::F32(&[1.0, 2.0, 3.0]))
        .unwrap_err();
    assert!(err.to_string().contains("[2, 2]"), "{err}");
    let t = ex
        .upload_slice(&Shape::new([3]), HostSlice::F32(&[1.0, 2.0, 3.0]))
        .unwrap();
    let mut short = [0.0f32; 2];
    let err = ex.download_into(&t, &mut short).unwrap_err();
    assert!(err.to_string().contains("download_into"), "{err}");
    // Process-wide counters (other tests run beside this one): at least `t`.
    let stats = ex.memory_stats().expect("the CPU executor counts its tensors");
    assert!(stats.live_bytes >= 12, "{stats:?}");
}

#[test]
fn load_weights_keeps_or_widens_and_downloads_concatenate() {
    use megatrain_tensor::{Download, WeightSlot, WeightUpload};
    let ex = CpuExecutor::new();
    let (sm, sv) = (Shape::new([2, 2]), Shape::new([3]));
    let m: Vec<bf16> = [1.0f32, 2.0, -3.0, 0.5]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let v: Vec<bf16> = [0.25f32, -1.0, 4.0].iter().map(|&x| bf16::from_f32(x)).collect();
    let slot = WeightSlot { kind: 1, index: 0 };
    let ws = ex
        .load_weights(
            slot,
            &[
                WeightUpload {
                    shape: &sm,
                    data: HostSlice::BF16(&m),
                    dtype: DType::BF16,
                },
                WeightUpload {
                    shape: &sv,
                    data: HostSlice::BF16(&v),
                    dtype: DType::F32,
                },
            ],
        )
        .unwrap();
    assert_eq!((ws[0].dtype(), ws[1].dtype()), (DType::BF16, DType::F32));
    let d = ex.begin_download(ws).unwrap();
    let mut out = [0.0f32; 7];
    ex.finish_download(d, &mut out).unwrap();
    assert_eq!(out, [1.0, 2.0, -3.0, 0.5, 0.25, -1.0, 4.0]);

    // Narrowing is not a transport conversion; wrong lengths are errors.
    let f = [1.0f32, 2.0, 3.0];
    let narrow = WeightUpload {
        shape: &sv,
        data: HostSlice::F32(&f),
        dtype: DType::BF16,
    };
    assert!(ex.load_weights(slot, &[narrow]).is_err());
    let short = WeightUpload {
        shape: &sm,
        data: HostSlice::F32(&f),
        dtype: DType::F32,
    };
    assert!(
        ex.load_weights(slot, &[short])
            .unwrap_err()
            .to_string()
            .contains("[2, 2]")
    );
    let d = ex
        .begin_download(
            ex.load_weights(
                slot,
                &[WeightUpload {
                    shape: &sv,
                    data: HostSlice::F32(&f),
                    dtype: DType::F32,
                }],
            )
            .unwrap(),
        )
        .unwrap();
    assert!(ex.finish_download(d, &mut [0.0; 2]).is_err());
    assert!(
        ex.finish_download(Download::Ticket { id: 3, numel: 2 }, &mut [0.0; 2])
            .is_err()
    );
    assert_eq!(ex.prepare_transport(1 << 20, 1 << 21).unwrap(), None);
}

#[test]
fn load_weights_keeps_f16_matrices_and_widens_f16_vectors() {
    use megatrain_tensor::{Transpose, WeightSlot, WeightUpload, f16};
    let ex = CpuExecutor::new();
    let (sm, sv) = (Shape::new([2, 2]), Shape::new([2]));
    // 1 + 2^-10 and 3 + 2^-8 are f16 values that bf16 cannot hold.
    let wide = [1.0 + 2f32.powi(-10), -2.0, 0.5, 3.0 + 2f32.powi(-8)];
    let m: Vec<f16> = wide.iter().map(|&x| f16::from_f32(x)).collect();
    let v: Vec<f16> = [0.25f32, 1e-5].iter().map(|&x| f16::from_f32(x)).collect();
    let ws = ex
        .load_weights(
            WeightSlot { kind: 1, index: 0 },
            &[
                WeightUpload {
                    shape: &sm,
                    data: HostSlice::F16(&m),
                    dtype: DType::F16,
                },
                WeightUpload {
                    shape: &sv,
                    data: HostSlice::F16(&v),
                    dtype: DType::F32,
                },
            ],
        )
        .unwrap();
    assert_eq!((ws[0].dtype(), ws[1].dtype()), (DType::F16, DType::F32));
    assert_eq!(*ws[0].values(), wide);
    assert_eq!(ws[1].data(), [0.25, f16::from_f32(1e-5).to_f32()]);
    // The f16 matrix is a matmul operand like a bf16 one.
    let x = ex
        .upload_slice(&Shape::new([1, 2]), HostSlice::F32(&[1.0, 1.0]))
        .unwrap();
    let y = ex.matmul(&x, &ws[0], Some(&ws[1]), Transpose::NN).unwrap();
    assert_eq!(
        y.data(),
        [wide[0] + wide[2] + 0.25, wide[1] + wide[3] + v[1].to_f32()]
    );
}

/// The fused residual add + norm of the reference executor gives, bit for
/// bit, what the provided defaults (the unfused ops one after another) give,
/// so a model's losses do not move when a block switches to the fused op.
#[test]
fn fused_add_norms_equal_their_compositions_bit_for_bit() {
    use megatrain_tensor::testing::random_tensor;
    use megatrain_tensor::{
        compose_add_layernorm, compose_add_layernorm_backward, compose_add_rmsnorm,
        compose_add_rmsnorm_backward,
    };
    let ex = CpuExecutor::new();
    let r = |seed, shape: &[usize]| ex.upload(&random_tensor(seed, shape.to_vec())).unwrap();
    // 131 rows: more than one of the reference's fixed row blocks.
    let (x, res, dy, dh) = (
        r(1, &[131, 37]),
        r(2, &[131, 37]),
        r(3, &[131, 37]),
        r(4, &[131, 37]),
    );
    let (w, b) = (r(5, &[37]), r(6, &[37]));
    let bits =
        |t: &megatrain_tensor::CpuTensor<f32>| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();

    let f = ex.add_rmsnorm(&x, &res, &w, 1e-5).unwrap();
    let c = compose_add_rmsnorm(&ex, &x, &res, &w, 1e-5).unwrap();
    assert_eq!(bits(&f.h), bits(&c.h));
    assert_eq!(bits(&f.norm.y), bits(&c.norm.y));
    assert_eq!(bits(&f.norm.rstd), bits(&c.norm.rstd));
    let fg = ex.add_rmsnorm_backward(&f.h, &w, &f.norm.rstd, &dy, &dh).unwrap();
    let cg = compose_add_rmsnorm_backward(&ex, &f.h, &w, &f.norm.rstd, &dy, &dh).unwrap();
    assert_eq!(bits(&fg.dx), bits(&cg.dx));
    assert_eq!(bits(&fg.dw), bits(&cg.dw));

    let f = ex.add_layernorm(&x, &res, &w, &b, 1e-5).unwrap();
    let c = compose_add_layernorm(&ex, &x, &res, &w, &b, 1e-5).unwrap();
    assert_eq!(bits(&f.h), bits(&c.h));
    assert_eq!(bits(&f.norm.y), bits(&c.norm.y));
    assert_eq!(
        bits(f.norm.mean.as_ref().unwrap()),
        bits(c.norm.mean.as_ref().unwrap())
    );
    assert_eq!(bits(&f.norm.rstd), bits(&c.norm.rstd));
    let mean = f.norm.mean.as_ref().unwrap();
    let fg = ex
        .add_layernorm_backward(&f.h, &w, mean, &f.norm.rstd, &dy, &dh)
        .unwrap();
    let cg = compose_add_layernorm_backward(&ex, &f.h, &w, mean, &f.norm.rstd, &dy, &dh).unwrap();
    assert_eq!(bits(&fg.dx), bits(&cg.dx));
    assert_eq!(bits(&fg.dw), bits(&cg.dw));
    assert_eq!(bits(fg.db.as_ref().unwrap()), bits(cg.db.as_ref().unwrap()));

    // The defaults refuse a residual gradient of another shape, even one
    // with as many elements (which `add_assign` alone would accept).
    let err = compose_add_rmsnorm_backward(&ex, &f.h, &w, &f.norm.rstd, &dy, &r(7, &[37, 131])).unwrap_err();
    assert!(err.to_string().contains("[37, 131]"), "{err}");
}
