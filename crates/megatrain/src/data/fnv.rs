//! FNV-1a, 64-bit: the fingerprints this build alone compares (the data
//! every rank loaded, the names of cached token ids).

#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub fn word(&mut self, x: u64) {
        self.0 = (self.0 ^ x).wrapping_mul(0x0100_0000_01b3);
    }

    /// Each byte as a word.
    pub fn bytes(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|&b| self.word(b as u64));
    }

    pub fn finish(self) -> u64 {
        self.0
    }

    /// The hash of `words`.
    pub fn of(words: impl IntoIterator<Item = u64>) -> u64 {
        let mut h = Fnv1a::default();
        words.into_iter().for_each(|x| h.word(x));
        h.finish()
    }
}
