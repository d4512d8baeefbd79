//! Which tokens of an instruction stream the loss counts: held as
//! `.jsonl` records are tokenized, or read from the flag bit of the words
//! of their cached ids ([`super::cache`]), so that a mapped stream's mask
//! costs no memory and is read from the pages its ids are read from.

use std::fmt;

use super::Tokens;

#[derive(Clone)]
pub struct Mask(Repr);

#[derive(Clone)]
enum Repr {
    Owned(Vec<bool>),
    /// Token `i` counts where word `i` of a flagged stream has no flag.
    InIds(Tokens),
}

impl Mask {
    /// The mask a flagged stream's words carry (see [`Tokens::flagged`]).
    pub(crate) fn in_ids(ids: Tokens) -> Mask {
        Mask(Repr::InIds(ids))
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Owned(v) => v.len(),
            Repr::InIds(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the loss counts token `i`; panics past the end, like a slice.
    pub fn get(&self, i: usize) -> bool {
        match &self.0 {
            Repr::Owned(v) => v[i],
            Repr::InIds(t) => !t.flagged(i),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = bool> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Keeps `..at` and returns `at..` (as `Vec::split_off`).
    pub fn split_off(&mut self, at: usize) -> Mask {
        match &mut self.0 {
            Repr::Owned(v) => Mask(Repr::Owned(v.split_off(at))),
            Repr::InIds(t) => Mask(Repr::InIds(t.split_off(at))),
        }
    }
}

impl From<Vec<bool>> for Mask {
    fn from(v: Vec<bool>) -> Self {
        Mask(Repr::Owned(v))
    }
}

impl PartialEq for Mask {
    fn eq(&self, other: &Mask) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Mask {}

impl fmt::Debug for Mask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let counted = self.iter().filter(|&c| c).count();
        write!(f, "Mask({} tokens, {counted} counted)", self.len())
    }
}
