//! Joining a data parallel run when the process was started by an MPI
//! launcher (`mpirun -np N megatrain train ...`).

use std::sync::Arc;

use megatrain::dist::{Collective, launched_by_mpi};

/// The communicator when an MPI launcher started this process; `None` when
/// it runs alone. A build without the `mpi` feature refuses to run under a
/// launcher (N copies would each train alone and overwrite one another's
/// checkpoints).
pub fn join() -> anyhow::Result<Option<Arc<dyn Collective>>> {
    if !launched_by_mpi() {
        return Ok(None);
    }
    #[cfg(feature = "mpi")]
    {
        let comm = megatrain::dist::mpi::MpiComm::init()?
            .ok_or_else(|| anyhow::anyhow!("MPI was initialised twice in one process"))?;
        Ok(Some(Arc::new(comm)))
    }
    #[cfg(not(feature = "mpi"))]
    {
        anyhow::bail!(
            "started by an MPI launcher, but this megatrain was built without MPI support \
             (build it with `--features megatrain/mpi`)"
        )
    }
}
