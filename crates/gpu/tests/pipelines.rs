//! Every kernel of `Kernel::ALL` compiles into a pipeline on this adapter.

mod common;

#[test]
fn every_pipeline_compiles() {
    let Some(gpu) = common::gpu() else { return };
    gpu.warm_up();
}
