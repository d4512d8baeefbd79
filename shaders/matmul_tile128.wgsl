// 128x128 tiles, 8x8 outputs per thread, K step 8: large products, where
// twice the FMAs per workgroup-memory load pays for fewer, fatter workgroups.
const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 8u;
