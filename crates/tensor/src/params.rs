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
        let name = name.into();
        if self.get(&name).is_some() {
            return Err(Error::invalid(
                "ParamTable::push",
                format!("duplicate parameter '{name}'"),
            ));
        }
        let shape = shape.into();
        let offset = self.numel;
        self.numel += shape.numel();
        self.params.push(ParamSpec {
            name,
            shape,
            offset,
            decay,
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
    }
}
