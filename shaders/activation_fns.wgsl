// The activation functions themselves, shared by the standalone kernels
// (activation.wgsl) and the matmul epilogues that apply them where a
// product is stored (matmul_epilogue.wgsl), so that fused and unfused
// paths run the same f32 operations.

const GELU_K: f32 = 0.7978845608028654; // sqrt(2 / pi)
const GELU_A: f32 = 0.044715;

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// tanh through exp overflows to inf/inf for large |u| on some drivers; the
// clamp keeps it exact to f32 precision (tanh(15) == 1 in f32).
fn tanh_safe(u: f32) -> f32 {
    return tanh(clamp(u, -15.0, 15.0));
}

// silu(g) · u.
fn act_swiglu(g: f32, u: f32) -> f32 {
    return g * sigmoid(g) * u;
}

// (dgate, dup) of silu(g) · u for the gradient dy.
fn act_swiglu_grads(g: f32, u: f32, dy: f32) -> vec2<f32> {
    let s = sigmoid(g);
    return vec2(dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s);
}

fn act_gelu(x: f32) -> f32 {
    let t = tanh_safe(GELU_K * (x + GELU_A * x * x * x));
    return 0.5 * x * (1.0 + t);
}

// The gradient of gelu at x for the gradient dy.
fn act_gelu_grad(x: f32, dy: f32) -> f32 {
    let t = tanh_safe(GELU_K * (x + GELU_A * x * x * x));
    let dt = GELU_K * (1.0 + 3.0 * GELU_A * x * x);
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt);
}

// gelu(g) · u (GeGLU).
fn act_geglu(g: f32, u: f32) -> f32 {
    return act_gelu(g) * u;
}

// (dgate, dup) of gelu(g) · u for the gradient dy.
fn act_geglu_grads(g: f32, u: f32, dy: f32) -> vec2<f32> {
    return vec2(act_gelu_grad(g, dy * u), dy * act_gelu(g));
}
