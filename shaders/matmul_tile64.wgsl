// 64x64 tiles, 4x4 outputs per thread, K step 16: small and medium products.
const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;
