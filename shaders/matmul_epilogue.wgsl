//// none
// The store of a matmul without an epilogue: C as computed.
fn epilogue(i: u32, v: f32) -> f32 {
    return v;
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
    let kind = (p.flags >> EPI_SHIFT) & EPI_MASK;
    if kind == EPI_GELU_BWD {
        // v = dy; aux0 = the pre-activation; C = its gradient.
        return act_gelu_grad(aux0[i], v);
    }
    if kind == EPI_SWIGLU_BWD {
        // v = ds; aux0 = gate, aux1 = up; C = dgate, aux_out = dup.
        let d = act_swiglu_grads(aux0[i], aux1[i], v);
        aux_out[i] = d.y;
        return d.x;
    }
    if kind == EPI_GELU_FWD {
        // C = the pre-activation v, aux_out = gelu(v).
        aux_out[i] = act_gelu(v);
        return v;
    }
    if kind == EPI_SWIGLU_FWD {
        // v = up; aux0 = gate; C = up, aux_out = silu(gate) · up.
        aux_out[i] = act_swiglu(aux0[i], v);
        return v;
    }
    return v;
}
