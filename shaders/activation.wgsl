// SwiGLU (plain and GPT-OSS's clamped one), GeGLU, GELU (the tanh
// approximation and the exact one), Qwen3-Next's sigmoid gate and the
// gated delta rule's gates, forward and backward, one thread per element.
// The functions are activation_fns.wgsl's (put before this), but those of
// the clamped SwiGLU and of the gates, which no matmul epilogue applies.

struct Params {
    n: u32, o1: u32, o2: u32, o3: u32,
    o4: u32, o5: u32,
    // The clamped SwiGLU's constants (0 for the other kernels).
    alpha: f32, limit: f32,
    // The delta gates' further operands (D, E, F, Y3), the width of a's
    // rows (its heads, or heads × key channels) and b's elements, as many
    // as a's or one per head of a's rows (0 for the other kernels).
    o6: u32, o7: u32, o8: u32, o9: u32,
    c: u32, nb: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read> C: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read_write> Y2: array<f32>;
// The delta gates' dt_bias (D), dg (E) and dbeta (F), and dg · g (Y3).
@group(0) @binding(6) var<storage, read> D: array<f32>;
@group(0) @binding(7) var<storage, read> E: array<f32>;
@group(0) @binding(8) var<storage, read> F: array<f32>;
@group(0) @binding(9) var<storage, read_write> Y3: array<f32>;

fn flat_id(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = act_swiglu(A[p.o1 + i], B[p.o2 + i]);
    }
}

@compute @workgroup_size(256)
fn swiglu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let d = act_swiglu_grads(A[p.o1 + i], B[p.o2 + i], C[p.o3 + i]);
        Y[p.o4 + i] = d.x;
        Y2[p.o5 + i] = d.y;
    }
}

@compute @workgroup_size(256)
fn gelu_erf(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = act_gelu_erf(A[p.o1 + i]);
    }
}

@compute @workgroup_size(256)
fn gelu_erf_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = act_gelu_erf_grad(A[p.o1 + i], B[p.o2 + i]);
    }
}

@compute @workgroup_size(256)
fn gelu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = act_gelu(A[p.o1 + i]);
    }
}

@compute @workgroup_size(256)
fn gelu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = act_gelu_grad(A[p.o1 + i], B[p.o2 + i]);
    }
}

@compute @workgroup_size(256)
fn geglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = act_geglu(A[p.o1 + i], B[p.o2 + i]);
    }
}

@compute @workgroup_size(256)
fn geglu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let d = act_geglu_grads(A[p.o1 + i], B[p.o2 + i], C[p.o3 + i]);
        Y[p.o4 + i] = d.x;
        Y2[p.o5 + i] = d.y;
    }
}

// GPT-OSS's clamps: the gate from above only, up both ways. Comparisons
// rather than min/clamp, whose result for a NaN WGSL leaves open: a NaN
// passes through, as it does through torch's clamp (the CPU reference's).
fn clamped_glu_inputs(g: f32, u: f32) -> vec2<f32> {
    let gc = select(g, p.limit, g > p.limit);
    let uc = select(select(u, -p.limit, u < -p.limit), p.limit, u > p.limit);
    return vec2(gc, uc);
}

// GPT-OSS's gate and up come from one product, interleaved (gate at 2i,
// up at 2i + 1): output i reads A[2i], A[2i + 1]. (u + 1) · (g · σ(g · alpha))
// of the clamped g and u, the reference's order.
@compute @workgroup_size(256)
fn swiglu_clamped(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let c = clamped_glu_inputs(A[p.o1 + 2u * i], A[p.o1 + 2u * i + 1u]);
        Y[p.o4 + i] = (c.y + 1.0) * (c.x * sigmoid(c.x * p.alpha));
    }
}

// d(gate, up), interleaved as gate_up: each 0 where its clamp bound the
// input, the bounds themselves passing the gradient (torch's clamp backward).
@compute @workgroup_size(256)
fn swiglu_clamped_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let gate = A[p.o1 + 2u * i];
        let up = A[p.o1 + 2u * i + 1u];
        let dy = B[p.o2 + i];
        let c = clamped_glu_inputs(gate, up);
        let s = sigmoid(c.x * p.alpha);
        let dglu = s + p.alpha * c.x * s * (1.0 - s);
        Y[p.o4 + 2u * i] = select(0.0, dy * (c.y + 1.0) * dglu, gate <= p.limit);
        Y[p.o4 + 2u * i + 1u] = select(0.0, dy * c.x * s, up >= -p.limit && up <= p.limit);
    }
}

// Qwen3-Next's gated attention output: x · σ(gate), gate A, x B.
@compute @workgroup_size(256)
fn sigmoid_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.o4 + i] = B[p.o2 + i] * sigmoid(A[p.o1 + i]);
    }
}

// (dgate, dx) of sigmoid_mul from dy (C).
@compute @workgroup_size(256)
fn sigmoid_mul_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let s = sigmoid(A[p.o1 + i]);
        let dy = C[p.o3 + i];
        Y[p.o4 + i] = dy * B[p.o2 + i] * s * (1.0 - s);
        Y2[p.o5 + i] = dy * s;
    }
}

// ln(1 + u) to f32 precision for small u too (WGSL has no log1p: 1 + u
// rounds u's digits away, and the quotient puts them back; Goldberg's
// trick), so that a decay far below the threshold is not rounded to 0.
fn log1p_small(u: f32) -> f32 {
    let w = 1.0 + u;
    if w == 1.0 {
        return u;
    }
    return log(w) * (u / (w - 1.0));
}

// torch's softplus (beta 1, threshold 20): x itself above the threshold.
fn softplus(x: f32) -> f32 {
    return select(log1p_small(exp(x)), x, x > 20.0);
}

// The chunk starts on a row, so element i's parameters are those of
// i mod c.
fn channel(i: u32) -> u32 {
    return i % p.c;
}

// The gated delta rule's gates of a (A), b (B), A_log (C, [c]) and dt_bias
// (D, [c]): g = −exp(A_log) · softplus(a + dt_bias) into Y, σ(b) into Y2.
// A thread per element of a; b's may be fewer (a rate per head of
// per-channel decays), so b is read by its own count.
@compute @workgroup_size(256)
fn delta_gates(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let cc = channel(i);
        Y[p.o4 + i] = -exp(C[p.o3 + cc]) * softplus(A[p.o1 + i] + D[p.o6 + cc]);
    }
    if i < p.nb {
        Y2[p.o5 + i] = sigmoid(B[p.o2 + i]);
    }
}

// From dg (E) and dbeta (F): da into Y, db into Y2 (b's count, as in the
// forward), and dg · g into Y3, whose column sums (the host's, in order)
// are dA_log as da's are ddt_bias. Softplus's slope is 1 past the
// threshold (torch's backward).
@compute @workgroup_size(256)
fn delta_gates_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let cc = channel(i);
        let x = A[p.o1 + i] + D[p.o6 + cc];
        let e = -exp(C[p.o3 + cc]);
        let dg = E[p.o7 + i];
        Y[p.o4 + i] = dg * e * select(sigmoid(x), 1.0, x > 20.0);
        Y3[p.o9 + i] = dg * (e * softplus(x));
    }
    if i < p.nb {
        let beta = sigmoid(B[p.o2 + i]);
        Y2[p.o5 + i] = F[p.o8 + i] * beta * (1.0 - beta);
    }
}
