// SwiGLU and GELU (tanh approximation), forward and backward.

struct Params {
    n: u32, o1: u32, o2: u32, o3: u32,
    o4: u32, o5: u32, _p0: u32, _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read> C: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read_write> Y2: array<f32>;

const GELU_K: f32 = 0.7978845608028654; // sqrt(2 / pi)
const GELU_A: f32 = 0.044715;

fn flat_id(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// tanh through exp overflows to inf/inf for large |u| on some drivers; the
// clamp keeps it exact to f32 precision (tanh(15) == 1 in f32).
fn tanh_safe(u: f32) -> f32 {
    return tanh(clamp(u, -15.0, 15.0));
}

@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let g = A[p.o1 + i];
        Y[p.o4 + i] = g * sigmoid(g) * B[p.o2 + i];
    }
}

@compute @workgroup_size(256)
fn swiglu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let g = A[p.o1 + i];
        let u = B[p.o2 + i];
        let dy = C[p.o3 + i];
        let s = sigmoid(g);
        Y[p.o4 + i] = dy * u * s * (1.0 + g * (1.0 - s));
        Y2[p.o5 + i] = dy * g * s;
    }
}

@compute @workgroup_size(256)
fn gelu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let x = A[p.o1 + i];
        let t = tanh_safe(GELU_K * (x + GELU_A * x * x * x));
        Y[p.o4 + i] = 0.5 * x * (1.0 + t);
    }
}

@compute @workgroup_size(256)
fn gelu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let x = A[p.o1 + i];
        let dy = B[p.o2 + i];
        let t = tanh_safe(GELU_K * (x + GELU_A * x * x * x));
        let dt = GELU_K * (1.0 + 3.0 * GELU_A * x * x);
        Y[p.o4 + i] = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt);
    }
}
