//! Ops batched into shared submissions compute exactly what ops submitted
//! one by one compute: a queue write into a buffer a pending op reads waits
//! for the op, reads and transfers see every op recorded before them, full
//! batches and full parameter buffers start new submissions, and a step of
//! many ops costs few submissions.

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions};
use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{
    DType, Executor, HostSlice, HostTensor, MatmulNeeds, Shape, Transpose, WeightSlot, WeightUpload,
};

fn executor(batch_ops: usize, max_binding_bytes: Option<u64>) -> Option<GpuExecutor> {
    Some(GpuExecutor::with_options(
        ctx()?,
        GpuOptions {
            batch_ops: Some(batch_ops),
            max_binding_bytes,
            ..Default::default()
        },
    ))
}

fn host(seed: u64, dims: &[usize]) -> HostTensor {
    let n = dims.iter().product();
    HostTensor::from_f32(Shape::new(dims.to_vec()), random_f32(seed, n)).unwrap()
}

fn values(ex: &GpuExecutor, t: &megatrain_gpu::GpuTensor) -> Vec<f32> {
    ex.download(t).unwrap().to_f32_vec()
}

#[test]
fn an_upload_into_a_buffer_a_pending_op_reads_waits_for_the_op() {
    let Some(ex) = executor(10_000, None) else { return };
    let a_host = host(1, &[4099]);
    let a = ex.upload(&a_host).unwrap();
    let a_buf = a.buffer().clone();
    let doubled = ex.scale(&a, 2.0).unwrap();
    let before = ex.submit_stats();
    // `a` goes back to the pool while the op reading it is still recorded,
    // not submitted; the next upload of its size gets the same buffer.
    drop(a);
    let c = ex.upload(&host(2, &[4099])).unwrap();
    assert!(
        c.buffer() == &a_buf,
        "the pool did not hand the freed buffer out again: the test would prove nothing"
    );
    let after = ex.submit_stats();
    let want: Vec<f32> = a_host.to_f32_vec().iter().map(|x| 2.0 * x).collect();
    assert_eq!(values(&ex, &doubled), want, "the op read the upload's data");
    assert_eq!(
        after.op_submissions,
        before.op_submissions + 1,
        "the upload must submit the pending op before its queue write"
    );
}

#[test]
fn an_upload_into_a_buffer_no_pending_op_uses_does_not_submit() {
    let Some(ex) = executor(10_000, None) else { return };
    let a = ex.upload(&host(3, &[513])).unwrap();
    let _b = ex.scale(&a, 3.0).unwrap();
    let before = ex.submit_stats();
    let _c = ex.upload(&host(4, &[70_001])).unwrap();
    assert_eq!(ex.submit_stats().op_submissions, before.op_submissions);
}

/// A chain of dependent ops of every kind the trainer's blocks use, long
/// enough to cross batch and parameter-buffer boundaries.
fn chain(ex: &GpuExecutor) -> Vec<Vec<f32>> {
    let (r, c) = (37, 67);
    let mut x = ex.upload(&host(10, &[r, c])).unwrap();
    let w = ex.upload(&host(11, &[c, c])).unwrap();
    let nw = ex.upload(&host(12, &[c])).unwrap();
    let mut outs = Vec::new();
    for i in 0..40 {
        let n = ex.rmsnorm(&x, &nw, 1e-5).unwrap();
        let y = ex.matmul(&n.y, &w, None, Transpose::NT).unwrap();
        let g = ex.gelu(&y).unwrap();
        let needs = MatmulNeeds {
            da: true,
            db: true,
            dbias: false,
        };
        let gr = ex.matmul_backward(&n.y, &w, &g, Transpose::NT, needs).unwrap();
        let mut h = ex.add(&x, &ex.scale(&g, 0.25).unwrap()).unwrap();
        ex.add_assign(&mut h, &ex.scale(gr.da.as_ref().unwrap(), 1e-3).unwrap())
            .unwrap();
        x = h;
        if i % 13 == 0 {
            outs.push(values(ex, gr.db.as_ref().unwrap()));
        }
    }
    outs.push(values(ex, &x));
    outs
}

#[test]
fn batches_of_any_size_compute_what_op_by_op_submission_computes() {
    let Some(one) = executor(1, None) else { return };
    let want = chain(&one);
    let s = one.submit_stats();
    assert_eq!(s.op_submissions, s.ops, "batch_ops = 1 submits every op alone");
    for n in [2, 7, 10_000] {
        let ex = executor(n, None).unwrap();
        assert_eq!(chain(&ex), want, "batch_ops = {n}");
        let s = ex.submit_stats();
        assert!(s.ops > 300, "the chain records {} ops", s.ops);
        assert!(
            s.op_submissions <= s.ops.div_ceil(n as u64) + 8,
            "batch_ops = {n}: {} submissions for {} ops",
            s.op_submissions,
            s.ops
        );
    }
}

#[test]
fn more_parameter_blocks_than_the_shared_buffer_holds() {
    // 64-element bindings: an add over 150,000 elements is ~2,300 dispatches,
    // more than one op's share of the shared parameter buffer; then many
    // such ops in one batch keep filling it.
    let Some(ex) = executor(10_000, Some(256)) else {
        return;
    };
    let a_host = host(20, &[150_001]);
    let b_host = host(21, &[150_001]);
    let a = ex.upload(&a_host).unwrap();
    let b = ex.upload(&b_host).unwrap();
    let mut acc = ex.add(&a, &b).unwrap();
    for _ in 0..3 {
        ex.add_assign(&mut acc, &a).unwrap();
    }
    let want: Vec<f32> = a_host
        .to_f32_vec()
        .iter()
        .zip(b_host.to_f32_vec())
        .map(|(x, y)| x + y + x + x + x)
        .collect();
    assert_eq!(values(&ex, &acc), want);
}

#[test]
fn a_layer_loaded_into_a_slot_a_pending_op_reads_waits_for_the_op() {
    let Some(ex) = executor(10_000, None) else { return };
    let shape = Shape::new(vec![31, 17]);
    let first = random_f32(30, 31 * 17);
    let second = random_f32(31, 31 * 17);
    let load = |data: &[f32]| {
        let up = WeightUpload {
            shape: &shape,
            data: HostSlice::F32(data),
            dtype: DType::F32,
        };
        let slot = WeightSlot { kind: 5, index: 0 };
        ex.load_weights(slot, &[up]).unwrap().remove(0)
    };
    let w = load(&first);
    let out = ex.scale(&w, -1.0).unwrap();
    drop(w);
    // The same slot, new weights: the op above must still see the old ones.
    let w2 = load(&second);
    let neg: Vec<f32> = first.iter().map(|x| -x).collect();
    assert_eq!(values(&ex, &out), neg);
    assert_eq!(values(&ex, &w2), second);
}
