// SwiGLU, GeGLU, GELU (the tanh approximation and the exact one), forward
// and backward, one thread
// per element. The functions are activation_fns.wgsl's (put before this).

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
