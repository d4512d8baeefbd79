//! The interior pipelines of the SIMT matmul (`shaders/matmul_interior.wgsl`):
//! whole 128x128 tiles with the operand layouts, the B operand's storage and
//! the compute precision fixed per pipeline, vec4 global loads and double
//! buffering. The M and N edges of a product run on `shaders/matmul.wgsl`.

use crate::kernels::MatmulB;

const BODY: &str = include_str!("../../../shaders/matmul_interior.wgsl");
const EXACT: &str = include_str!("../../../shaders/matmul_exact.wgsl");
const SCALE: &str = include_str!("../../../shaders/matmul_scale.wgsl");
const ROUND16: &str = include_str!("../../../shaders/matmul_round16.wgsl");

/// One interior pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimtInterior {
    /// A is stored [K, M] (op(A) = Aᵀ).
    pub ta: bool,
    /// B is stored [N, K].
    pub tb: bool,
    pub b: MatmulB,
    /// F16 compute precision: operands scaled and rounded to f16.
    pub f16: bool,
    /// With the matmul epilogue (see [`crate::kernels::SimtMatmul::epi`]).
    pub epi: bool,
}

impl SimtInterior {
    /// The output tile (both sides) and the K step.
    pub const TILE: usize = 128;
    pub const BK: usize = 16;

    pub fn all() -> Vec<SimtInterior> {
        let mut v = Vec::new();
        for ta in [false, true] {
            for tb in [false, true] {
                for b in [MatmulB::F32, MatmulB::Bf16, MatmulB::F16] {
                    for f16 in [false, true] {
                        for epi in [false, true] {
                            v.push(SimtInterior { ta, tb, b, f16, epi });
                        }
                    }
                }
            }
        }
        v
    }

    pub fn source(self) -> String {
        let layout = format!("const TA: bool = {};\nconst TB: bool = {};\n", self.ta, self.tb);
        // `load_b4(i)`: elements i..i+4 of B, i a multiple of 4.
        let b = match self.b {
            MatmulB::F32 => {
                "@group(0) @binding(2) var<storage, read> B4: array<vec4<f32>>;\n\
                 fn load_b4(i: u32) -> vec4<f32> {\n    return B4[i >> 2u];\n}\n"
            }
            // Two bf16 per u32, element 2j in the low half; a bf16 is the
            // top half of an f32.
            MatmulB::Bf16 => {
                "@group(0) @binding(2) var<storage, read> B2: array<vec2<u32>>;\n\
                 fn load_b4(i: u32) -> vec4<f32> {\n    let w = B2[i >> 2u];\n    \
                 return vec4(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u), \
                 bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u));\n}\n"
            }
            MatmulB::F16 => {
                "@group(0) @binding(2) var<storage, read> B2: array<vec2<u32>>;\n\
                 fn load_b4(i: u32) -> vec4<f32> {\n    let w = B2[i >> 2u];\n    \
                 return vec4(unpack2x16float(w.x), unpack2x16float(w.y));\n}\n"
            }
        };
        let precision = if self.f16 {
            [SCALE, ROUND16].concat()
        } else {
            EXACT.to_string()
        };
        [
            crate::kernels::MATMUL_PARAMS,
            layout.as_str(),
            b,
            &precision,
            &crate::kernels::epilogue_source(self.epi, self.f16, crate::kernels::FoldScratch::SimtTiles),
            crate::kernels::MATMUL_STORE,
            BODY,
        ]
        .concat()
    }

    /// Bindings in the host's order (A, B, bias, C, the f16 scales, the
    /// epilogue's operands).
    pub fn bindings(self) -> &'static [u32] {
        crate::kernels::matmul_bindings(self.f16, self.epi)
    }
}
