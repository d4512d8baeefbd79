//! Per-op GPU time of one Llama-style decoder layer, forward and backward
//! (GPU timestamp queries where the adapter has them, else wall clock).
//! Run: cargo bench -p megatrain-gpu --bench profile

mod common;

use megatrain_tensor::{Executor, MatmulNeeds, Rope, Transpose};

fn main() {
    let Some(g) = common::executor() else { return };
    let big = common::is_real_gpu(&g);
    // (B, T, C, heads, kv heads, ffn)
    let (b, t, c, hq, hkv, f) = if big {
        (4, 1024, 2048, 16, 4, 5632)
    } else {
        (1, 128, 256, 4, 2, 688)
    };
    let d = c / hq;
    let up = |seed, dims: &[usize]| g.upload(&common::rand(seed, dims)).unwrap();
    let x = up(1, &[b, t, c]);
    let wn = up(2, &[c]);
    let wq = up(3, &[hq * d, c]);
    let wk = up(4, &[hkv * d, c]);
    let wv = up(5, &[hkv * d, c]);
    let wo = up(6, &[c, hq * d]);
    let wg = up(7, &[f, c]);
    let wu = up(8, &[f, c]);
    let wd = up(9, &[c, f]);
    let rope = Rope {
        theta: 10000.0,
        offset: 0,
    };
    let step = || {
        let n1 = g.rmsnorm(&x, &wn, 1e-5).unwrap();
        let q = g.matmul(&n1.y, &wq, None, Transpose::NT).unwrap();
        let k = g.matmul(&n1.y, &wk, None, Transpose::NT).unwrap();
        let v = g.matmul(&n1.y, &wv, None, Transpose::NT).unwrap();
        let q = g
            .rope(&g.reshape(&q, &[b, t, hq, d].into()).unwrap(), rope)
            .unwrap();
        let k = g
            .rope(&g.reshape(&k, &[b, t, hkv, d].into()).unwrap(), rope)
            .unwrap();
        let v = g.reshape(&v, &[b, t, hkv, d].into()).unwrap();
        let att = g.attention(&q, &k, &v).unwrap();
        let a2 = g.reshape(&att.out, &[b, t, c].into()).unwrap();
        let o = g.matmul(&a2, &wo, None, Transpose::NT).unwrap();
        let h = g.add(&x, &o).unwrap();
        let gate = g.matmul(&h, &wg, None, Transpose::NT).unwrap();
        let upp = g.matmul(&h, &wu, None, Transpose::NT).unwrap();
        let s = g.swiglu(&gate, &upp).unwrap();
        let y = g.matmul(&s, &wd, None, Transpose::NT).unwrap();
        // Backward with dy = y (any cotangent does for timing).
        let needs = MatmulNeeds {
            da: true,
            db: true,
            dbias: false,
        };
        let gd = g.matmul_backward(&s, &wd, &y, Transpose::NT, needs).unwrap();
        let (dgate, dup) = g.swiglu_backward(&gate, &upp, gd.da.as_ref().unwrap()).unwrap();
        g.matmul_backward(&h, &wg, &dgate, Transpose::NT, needs).unwrap();
        g.matmul_backward(&h, &wu, &dup, Transpose::NT, needs).unwrap();
        let go = g.matmul_backward(&a2, &wo, &h, Transpose::NT, needs).unwrap();
        let dout = g.reshape(go.da.as_ref().unwrap(), &[b, t, hq, d].into()).unwrap();
        let ga = g.attention_backward(&q, &k, &v, &att, &dout).unwrap();
        g.rope_backward(&ga.dq, rope).unwrap();
        g.rope_backward(&ga.dk, rope).unwrap();
        g.rmsnorm_backward(&x, &wn, &n1.rstd, &x).unwrap();
        g.synchronize().unwrap();
    };
    step(); // compile and fill the pool
    g.set_profiling(true);
    for _ in 0..3 {
        step();
    }
    println!(
        "layer B={b} T={t} C={c} Hq={hq} Hkv={hkv} FFN={f}, 3 steps, {}",
        g.context().info
    );
    print!("{}", g.profile_report());
    let m = g.memory();
    println!(
        "device memory: peak {:.1} MiB, pool allocations {}",
        m.peak_bytes as f64 / 1048576.0,
        m.allocations
    );
}
