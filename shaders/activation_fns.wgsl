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

// tanh within about 2 ulps of itself everywhere (1.6 at worst on lavapipe,
// tests/ops.rs), and never NaN. tanh_safe keeps the driver's tanh finite,
// but a tanh through (e^2u − 1) / (e^2u + 1), as lavapipe's is, loses its
// leading digits near 0 (absolute error ~1e-7, so relative ~1e-7 / |u|),
// which a soft cap of 50 (Gemma 2's attention scores) turns into errors of
// ~5e-6 in every score. Cephes' tanhf: an odd polynomial below 0.625,
// 1 − 2 / (e^2|u| + 1) above (clamped where exp would overflow; 1 there
// anyway), picked by a select so that neighbouring invocations do not
// diverge.
fn tanh_precise(u: f32) -> f32 {
    let a = min(abs(u), 15.0);
    let z = u * u;
    let poly = u + u * z * ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z
        - 5.37397155531e-2) * z + 1.33314422036e-1) * z - 3.33332819422e-1);
    let tail = sign(u) * (1.0 - 2.0 / (exp(2.0 * a) + 1.0));
    return select(tail, poly, a < 0.625);
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

// erf through erfc's Chebyshev fit (Numerical Recipes' erfcc: fractional
// error under 1.2e-7), which stays accurate in the tails where 1 − erf is
// what matters; exp underflows to 0 there rather than overflowing.
fn erf_fit(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
        + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
        + t * (-0.82215223 + t * 0.17087277))))))));
    let erfc = t * exp(-z * z + poly);
    return sign(x) * (1.0 - erfc);
}

const FRAC_1_SQRT_2: f32 = 0.7071067811865476;
const FRAC_1_SQRT_2PI: f32 = 0.3989422804014327;

// The exact GELU, 0.5 · x · (1 + erf(x / √2)) (GPT-NeoX's `gelu`).
fn act_gelu_erf(x: f32) -> f32 {
    return 0.5 * x * (1.0 + erf_fit(x * FRAC_1_SQRT_2));
}

// dy · (Φ(x) + x · φ(x)).
fn act_gelu_erf_grad(x: f32, dy: f32) -> f32 {
    let cdf = 0.5 * (1.0 + erf_fit(x * FRAC_1_SQRT_2));
    return dy * (cdf + x * FRAC_1_SQRT_2PI * exp(-0.5 * x * x));
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
