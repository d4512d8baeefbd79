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
    assert_eq!(ex.memory_stats(), None);
}
