//! Reductions over rows must not depend on how rayon splits the work:
//! exact resume and reproducible runs compare parameters bit for bit.

use megatrain_tensor::cpu::reference::{layernorm, layernorm_backward, rmsnorm, rmsnorm_backward};
use megatrain_tensor::testing::random_f32;

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn norm_weight_gradients_are_identical_for_any_thread_count() {
    // 1000 rows: many blocks of rows, an uneven last block.
    let (rows, c) = (1000, 37);
    let x = random_f32(1, rows * c);
    let dy = random_f32(2, rows * c);
    let (w, b) = (random_f32(3, c), random_f32(4, c));
    let run = || {
        let (_, rstd) = rmsnorm(&x, &w, 1e-5);
        let (rdx, rdw) = rmsnorm_backward(&x, &w, &rstd, &dy);
        let (_, mean, rstd) = layernorm(&x, &w, &b, 1e-5);
        let (ldx, ldw, ldb) = layernorm_backward(&x, &w, &mean, &rstd, &dy);
        (rdx, rdw, ldx, ldw, ldb)
    };
    let one = in_pool(1, run);
    for threads in [2, 3, 7] {
        assert!(
            in_pool(threads, run) == one,
            "norm backward differs with {threads} threads"
        );
    }
}
