//// none
// The store of a matmul without an epilogue: C as computed.
fn epilogue(i: u32, v: f32) -> f32 {
    note_c(v);
    return v;
}

// No operands: a store's prefetch of them loads nothing.
fn epilogue_operands(i: u32) -> vec2<f32> {
    return vec2<f32>(0.0);
}

fn epilogue_with(i: u32, v: f32, x: vec2<f32>) -> f32 {
    return epilogue(i, v);
}

//// fused
// A matmul whose store applies an activation (activation_fns.wgsl, the
// standalone kernels' functions) to the finished element v = op(A) @ op(B)
// (+ bias) of C: the kind is in the flags (EPI_* in matmul_params.wgsl).
// The extra operands have C's shape and layout and are bound over C's
// range, so element i of C is element i of each: aux0 and aux1 are read,
// aux_out written. The host never sets ACCUMULATE with an epilogue and
// never splits K: v is the whole sum.
@group(0) @binding(6) var<storage, read> aux0: array<f32>;
@group(0) @binding(7) var<storage, read> aux1: array<f32>;
@group(0) @binding(8) var<storage, read_write> aux_out: array<f32>;

fn epilogue(i: u32, v: f32) -> f32 {
    return epilogue_with(i, v, epilogue_operands(i));
}

// aux0[i] and aux1[i] where the kind reads them, zero where it does not
// (their bindings are then the dummy): loaded apart from epilogue_with so
// that a store can have them in flight before it has its values (the
// tensor-core kernels' store_fragment).
fn epilogue_operands(i: u32) -> vec2<f32> {
    let kind = (p.flags >> EPI_SHIFT) & EPI_MASK;
    var x = vec2<f32>(0.0);
    let glu_bwd = kind == EPI_SWIGLU_BWD || kind == EPI_GEGLU_BWD;
    if glu_bwd || kind == EPI_GELU_BWD || kind == EPI_SWIGLU_FWD || kind == EPI_GEGLU_FWD {
        x.x = aux0[i];
    }
    if glu_bwd {
        x.y = aux1[i];
    }
    return x;
}

// Element i of C from the product's v and the operands x
// (epilogue_operands(i)).
fn epilogue_with(i: u32, v: f32, x: vec2<f32>) -> f32 {
    let c = epilogue_value(i, v, x);
    note_c(c);
    return c;
}

fn put_aux(i: u32, x: f32) {
    aux_out[i] = x;
    note_aux(x);
}

fn epilogue_value(i: u32, v: f32, x: vec2<f32>) -> f32 {
    let kind = (p.flags >> EPI_SHIFT) & EPI_MASK;
    if kind == EPI_GELU_BWD {
        // v = dy; x.x = the pre-activation; C = its gradient.
        return act_gelu_grad(x.x, v);
    }
    if kind == EPI_SWIGLU_BWD {
        // v = ds; x = (gate, up); C = dgate, aux_out = dup.
        let d = act_swiglu_grads(x.x, x.y, v);
        put_aux(i, d.y);
        return d.x;
    }
    if kind == EPI_GELU_FWD {
        // C = the pre-activation v, aux_out = gelu(v).
        put_aux(i, act_gelu(v));
        return v;
    }
    if kind == EPI_SWIGLU_FWD {
        // v = up; x.x = gate; C = up, aux_out = silu(gate) · up.
        put_aux(i, act_swiglu(x.x, v));
        return v;
    }
    if kind == EPI_GEGLU_BWD {
        // As EPI_SWIGLU_BWD for gelu(gate) · up.
        let d = act_geglu_grads(x.x, x.y, v);
        put_aux(i, d.y);
        return d.x;
    }
    if kind == EPI_GEGLU_FWD {
        // As EPI_SWIGLU_FWD: aux_out = gelu(gate) · up.
        put_aux(i, act_geglu(x.x, v));
        return v;
    }
    return v;
}

//// maxima
// max|x| of what a product stores, C and the epilogue's aux_out, for the
// f16 products that read them next: with STORE_MAX in the flags (set only
// where each element is stored once, with its final value) the product
// leaves what an absmax.wgsl scan of its output would find, and that scan
// is not run. Each invocation keeps the largest max_bits (max_bits.wgsl)
// of what it stored, the workgroup folds them, and one invocation stores
// the workgroup's in slots of its own, which absmax.wgsl folds when an f16
// product first reads the output. (No atomics here: under the Vulkan
// memory model that naga declares for the tensor-core kernels a
// device-scope atomic needs a capability naga does not declare, and
// spirv-val refuses it.)
var<private> c_max: u32;
var<private> aux_max: u32;

//// maxima_out
// Workgroup wg of the dispatch stores C's max at out_max[max_base + wg],
// aux_out's max_total slots further on (max_total: the product's
// workgroups over all its dispatches).
@group(0) @binding(9) var<storage, read_write> out_max: array<u32>;

fn store_maxima(wg: u32, m: vec2<u32>) {
    out_max[p.max_base + wg] = m.x;
    out_max[p.max_total + p.max_base + wg] = m.y;
}

fn note_c(v: f32) {
    c_max = max(c_max, max_bits(v));
}

fn note_aux(v: f32) {
    aux_max = max(aux_max, max_bits(v));
}

//// maxima_none
// f32 products never set STORE_MAX: nothing noted, nothing to store to
// (their stores are as they were before there were maxima).
fn store_maxima(wg: u32, m: vec2<u32>) {}

fn note_c(v: f32) {}

fn note_aux(v: f32) {}

//// maxima_fold
// Called by every invocation after its last store (uniform control flow:
// the flags are the same for the whole dispatch). The invocations' maxima
// are folded pairwise through workgroup memory the kernel no longer
// needs (`fold_put`/`fold_get` below: the tuned kernels have no bytes to
// spare), as u32 bits stored in f32 slots, unchanged: they are never NaN.
fn fold_maxima(li: u32, wid: vec3<u32>, nwg: vec3<u32>) {
    if (p.flags & STORE_MAX) == 0u {
        return;
    }
    workgroupBarrier();
    fold_put(li, vec2<u32>(c_max, aux_max));
    workgroupBarrier();
    for (var n = FOLD_THREADS; n > 1u; n = (n + 1u) / 2u) {
        let h = (n + 1u) / 2u;
        if li + h < n {
            fold_put(li, max(fold_get(li), fold_get(li + h)));
        }
        workgroupBarrier();
    }
    if li == 0u {
        store_maxima((wid.z * nwg.y + wid.y) * nwg.x + wid.x, fold_get(0u));
    }
}

//// fold_simt
// The SIMT kernels' A tile: at least 256 vec4 slots.
const FOLD_THREADS: u32 = 256u;

fn fold_put(i: u32, v: vec2<u32>) {
    As[i] = bitcast<vec4<f32>>(vec4<u32>(v, 0u, 0u));
}

fn fold_get(i: u32) -> vec2<u32> {
    return bitcast<vec4<u32>>(As[i]).xy;
}

//// fold_coop
// The tensor-core kernels' outgoing fragments: 8 f32 slots per invocation.
const FOLD_THREADS: u32 = THREADS;

fn fold_put(i: u32, v: vec2<u32>) {
    c_s[2u * i] = bitcast<f32>(v.x);
    c_s[2u * i + 1u] = bitcast<f32>(v.y);
}

fn fold_get(i: u32) -> vec2<u32> {
    return vec2<u32>(bitcast<u32>(c_s[2u * i]), bitcast<u32>(c_s[2u * i + 1u]));
}
