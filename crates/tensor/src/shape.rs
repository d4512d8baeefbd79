use std::fmt;

/// A row-major tensor shape. The last dimension is contiguous.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// The last dimension (1 for a scalar).
    pub fn last(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }

    /// Product of all dimensions but the last: the number of rows when the
    /// tensor is read as a matrix `[rows, last]`.
    pub fn rows(&self) -> usize {
        if self.0.is_empty() {
            1
        } else {
            self.0[..self.0.len() - 1].iter().product()
        }
    }

    /// The dimensions with the last one replaced.
    pub fn with_last(&self, last: usize) -> Shape {
        let mut d = self.0.clone();
        match d.last_mut() {
            Some(l) => *l = last,
            None => d.push(last),
        }
        Shape(d)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}
