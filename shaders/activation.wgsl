// SwiGLU (plain and GPT-OSS's clamped one), GeGLU, GELU (the tanh
// approximation and the exact one), forward and backward, one thread per
// element. The functions are activation_fns.wgsl's (put before this), but
// the clamped SwiGLU's, which no matmul epilogue applies.

struct Params {
    n: u32, o1: u32, o2: u32, o3: u32,
    o4: u32, o5: u32,
    // The clamped SwiGLU's constants (0 for the other kernels).
    alpha: f32, limit: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read> C: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read_write> Y2: array<f32>;

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
