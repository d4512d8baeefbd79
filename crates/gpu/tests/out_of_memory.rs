//! A device with no memory left for a new buffer: the executor gives its
//! free pool back and asks again, and where that is not enough returns an
//! error that says what was refused, instead of wgpu's default handler
//! panicking (which, inside the arena's lock, aborted the process: a
//! Qwen2.5-7B bench run on the H200 in session 47). No software adapter
//! runs out, so the refusals are injected (`fail_next_allocations`).

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions};
use megatrain_tensor::{Executor, HostTensor, Shape};

#[test]
fn a_full_device_gives_back_its_pool_then_says_what_it_refused() {
    let Some(c) = ctx() else { return };
    let g = GpuExecutor::with_options(c, GpuOptions::default());
    // A buffer made and dropped goes to the free pool.
    drop(g.zeros(&Shape::new([1000])).unwrap());
    let pooled = g.memory().pooled_bytes;
    assert!(pooled >= 4000, "{:?}", g.memory());
    // A request of its size class takes it back without a new buffer, so
    // a refusal waiting for the next new one is not spent.
    let before = g.memory().allocations;
    g.fail_next_allocations(1);
    let reused = g.zeros(&Shape::new([1000])).unwrap();
    assert_eq!(g.memory().allocations, before);
    drop(reused);
    // It refuses a new class: the pool is given back, the second try
    // succeeds, and the tensor holds what was written.
    let x = HostTensor::from_f32(Shape::new([3000]), (0..3000).map(|i| i as f32).collect()).unwrap();
    let up = g.upload(&x).unwrap();
    assert_eq!(g.memory().pooled_bytes, 0, "{:?}", g.memory());
    assert_eq!(g.memory().allocations, before + 1);
    assert_eq!(g.download(&up).unwrap().to_f32_vec(), x.to_f32_vec());
    // Two: an error naming the size refused, and nothing leaked.
    let live = g.memory().live_bytes;
    g.fail_next_allocations(2);
    let e = g.zeros(&Shape::new([250_000])).unwrap_err().to_string();
    assert!(
        e.contains("out of device memory")
            && e.contains("a 1048576-byte buffer refused")
            && e.contains(&format!("{live} bytes held by tensors"))
            && e.contains("--keep-activations"),
        "{e}"
    );
    assert_eq!(g.memory().live_bytes, live);
    // The executor goes on: the next request is made.
    let z = g.zeros(&Shape::new([250_000])).unwrap();
    assert!(g.download(&z).unwrap().to_f32_vec().iter().all(|&v| v == 0.0));
}
