//! The scalar types the reference kernels are written over: f32 backs the
//! CPU executor, f64 backs finite-difference checks and high-precision
//! references in other crates' tests.

use std::fmt::Debug;
use std::iter::Sum;

use num_traits::Float;

/// A float the reference kernels can compute in, with its GEMM.
pub trait Real: Float + Send + Sync + Debug + Default + Sum + 'static {
    /// Short name, for executor names and messages.
    const NAME: &'static str;

    /// `c = alpha · a · b + beta · c` for an `m×k` by `k×n` product with
    /// arbitrary row/column strides (in elements).
    ///
    /// # Safety
    /// Every element addressed through the pointers and strides must lie in
    /// a live allocation, and `c` must not alias `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );

    /// Nearest value of this type (exact for f64).
    fn from_f64(x: f64) -> Self;
    /// Exact widening to f64.
    fn widen(self) -> f64;
    /// Exact for f32 and every f32-representable value.
    fn from_f32(x: f32) -> Self;
    /// Nearest f32.
    fn narrow_f32(self) -> f32;
    /// self · 2^e, exact wherever the result is a normal value of the type
    /// (for f32 also where 2^e itself is not an f32).
    fn mul_pow2(self, e: i32) -> Self;

    /// The error function, through libm's f64 one (`f32` rounds it once).
    fn erf(self) -> Self {
        Self::from_f64(libm::erf(self.widen()))
    }
}

impl Real for f32 {
    const NAME: &'static str = "f32";

    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded from the caller's contract.
        unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
    }

    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn widen(self) -> f64 {
        self as f64
    }
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn narrow_f32(self) -> f32 {
        self
    }
    fn mul_pow2(self, e: i32) -> f32 {
        crate::mul_pow2(self, e)
    }
}

impl Real for f64 {
    const NAME: &'static str = "f64";

    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f64,
        a: *const f64,
        rsa: isize,
        csa: isize,
        b: *const f64,
        rsb: isize,
        csb: isize,
        beta: f64,
        c: *mut f64,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded from the caller's contract.
        unsafe { matrixmultiply::dgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
    }

    fn from_f64(x: f64) -> f64 {
        x
    }
    fn widen(self) -> f64 {
        self
    }
    fn from_f32(x: f32) -> f64 {
        x as f64
    }
    fn narrow_f32(self) -> f32 {
        self as f32
    }
    fn mul_pow2(self, e: i32) -> f64 {
        // Scale exponents are within ±400, far inside f64's range.
        self * 2f64.powi(e)
    }
}
