//! Parameter tables: where each named tensor of a layer lives in that
//! layer's flat fp32 slab. The zoo produces them; the tier, the optimizer and
//! checkpoint I/O consume them.

use crate::{Error, Result, Shape};

#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Hugging Face tensor name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Shape,
    /// Offset in elements from the start of the layer's slab.
    pub offset: usize,
    /// Whether AdamW weight decay applies (matrices and embeddings yes, norm
    /// gains and biases no).
    pub decay: bool,
    /// Held on the executor in a 16-bit transport's width: the operands
    /// executors read in 16 bits, matmul operands and embedding tables
    /// (every tensor of rank ≥ 2 unless pushed with
    /// [`ParamTable::push_f32`]). Others are widened to f32 on load.
    pub narrow: bool,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParamTable {
    params: Vec<ParamSpec>,
    numel: usize,
}

impl ParamTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a parameter at the end of the slab; names must be unique.
    pub fn push(
        &mut self,
        name: impl Into<String>,
        shape: impl Into<Shape>,
        decay: bool,
    ) -> Result<&ParamSpec> {
        let shape = shape.into();
        let narrow = shape.rank() >= 2;
        self.push_held(name.into(), shape, decay, narrow)
    }

    /// [`ParamTable::push`] of a tensor of any rank that the executor holds
    /// as f32 whatever the transport: one that only f32 ops read (a causal
    /// convolution's kernels `[C, 1, K]`, a per-head vector stored 4-D).
    pub fn push_f32(
        &mut self,
        name: impl Into<String>,
        shape: impl Into<Shape>,
        decay: bool,
    ) -> Result<&ParamSpec> {
        self.push_held(name.into(), shape.into(), decay, false)
    }

    fn push_held(&mut self, name: String, shape: Shape, decay: bool, narrow: bool) -> Result<&ParamSpec> {
        if self.get(&name).is_some() {
            return Err(Error::invalid(
                "ParamTable::push",
                format!("duplicate parameter '{name}'"),
            ));
        }
        let offset = self.numel;
        self.numel += shape.numel();
        self.params.push(ParamSpec {
            name,
            shape,
            offset,
            decay,
            narrow,
        });
        Ok(self.params.last().expect("just pushed"))
    }

    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    pub fn iter(&self) -> std::slice::Iter<'_, ParamSpec> {
        self.params.iter()
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Total elements of the slab.
    pub fn numel(&self) -> usize {
        self.numel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_consecutive_and_names_unique() {
        let mut t = ParamTable::new();
        t.push("a.weight", [3, 5], true).unwrap();
        t.push("a.bias", [5], false).unwrap();
        assert_eq!(t.get("a.bias").unwrap().range(), 15..20);
        assert_eq!(t.numel(), 20);
        assert!(t.push("a.bias", [1], false).is_err());
        t.push_f32("a.conv", [5, 1, 4], true).unwrap();
        let narrow: Vec<bool> = t.iter().map(|p| p.narrow).collect();
        assert_eq!(narrow, [true, false, false]);
    }
}
