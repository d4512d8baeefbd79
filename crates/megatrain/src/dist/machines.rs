//! The ranks of a run grouped by machine, and the transport copies each
//! machine's ranks share ([`megatrain_tier::shared`]).
//!
//! Each rank writes its range of every layer's transport copy after its
//! update (the range a sharded optimizer updates, or its share of the
//! whole layer a replicated one updates). Ranks of one machine map one
//! copy, so nothing moves between them: a barrier of the machine's ranks at
//! the end of a step orders every rank's writes before the next step's
//! uploads. Where the run spans machines, each rank also writes the ranges
//! of the ranks with its index on the other machines (sharded, it receives
//! them by an all-gather among those ranks; replicated, it has computed
//! them), which asks every machine for the same number of ranks; otherwise
//! every rank keeps a copy of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use megatrain_tensor::ParamTable;
use megatrain_tier::{SharedTransport, TransportDType, create_shared_transport};

use super::{Collective, DistError, Result};

/// Set to split ranks into machines of this many consecutive ranks instead
/// of by the memory they can share: exercises the multi-machine path on
/// one machine (tests), nothing else.
pub const RANKS_PER_MACHINE_ENV: &str = "MEGATRAIN_RANKS_PER_MACHINE";

/// The ranks of this rank's machine, and its peers on the others.
#[derive(Clone)]
pub struct Machines {
    /// The ranks of this machine (they can map one file together).
    pub node: Arc<dyn Collective>,
    /// The ranks with this rank's index on every machine, one each, in
    /// rank order; `None` when one machine holds every rank.
    pub cross: Option<Arc<dyn Collective>>,
    /// The run's rank of each member of `cross`, in its order (this
    /// rank's alone on one machine).
    pub peers: Vec<usize>,
}

impl std::fmt::Debug for Machines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machines")
            .field("local", &(self.node.rank(), self.node.size()))
            .field("peers", &self.peers)
            .finish()
    }
}

impl Machines {
    /// Groups `comm`'s ranks by machine (a collective: every rank calls
    /// it). `None` when no machine holds more than one rank, or machines
    /// hold different numbers of ranks (nothing to share, or no peer on
    /// some machine to receive a range into its copy).
    pub fn of(comm: &dyn Collective) -> Result<Option<Self>> {
        let per = match std::env::var(RANKS_PER_MACHINE_ENV) {
            Ok(v) => Some(v.parse::<usize>().ok().filter(|&k| k > 0).ok_or_else(|| {
                DistError::Invalid(format!("{RANKS_PER_MACHINE_ENV}={v}: expected a positive count"))
            })?),
            Err(_) => None,
        };
        let node = match per {
            Some(k) => comm.split(comm.rank() / k)?,
            None => comm.split_machine()?,
        };
        let (size, rank) = (comm.size(), comm.rank());
        // Every rank's index on its machine and its machine's size.
        let mut local = vec![0.0; 2 * size];
        local[2 * rank] = node.rank() as f64;
        local[2 * rank + 1] = node.size() as f64;
        comm.sum_f64(&mut local)?;
        let sizes: Vec<usize> = (0..size).map(|r| local[2 * r + 1] as usize).collect();
        let uniform = sizes.iter().all(|&s| s == sizes[0]);
        // Every rank splits again, so that none waits for ever in it.
        let cross = comm.split(node.rank())?;
        if !uniform || sizes[0] < 2 {
            return Ok(None);
        }
        let peers: Vec<usize> = (0..size)
            .filter(|&r| local[2 * r] as usize == node.rank())
            .collect();
        Ok(Some(Machines {
            node,
            cross: (peers.len() > 1).then_some(cross),
            peers,
        }))
    }

    /// Ranks whose ranges of every layer this rank writes in its machine's
    /// copy: its own, which it updates, and its peers', which it receives.
    pub fn writes(&self) -> Vec<usize> {
        self.peers.clone()
    }
}

/// A machine's shared transport copies as one rank takes part in them.
pub struct Sharing {
    pub machines: Machines,
    /// What the tier maps ([`megatrain_tier::TierConfig::shared_transport`]):
    /// the file, opened, its name already gone.
    pub tier: SharedTransport,
}

/// What [`share_transport`] came to, the same on every rank.
pub enum Shared {
    /// The ranks of each machine map one copy.
    Yes(Sharing),
    /// Every rank holds a copy of its own, for this reason.
    No(String),
}

/// Creates (on one rank of each machine) the file of the transport copies
/// the machine's ranks share, in `dir`, and opens it on every rank: a
/// collective. The file's name is gone when this returns, on every rank
/// and whatever failed, so no exit from here on leaves a file behind.
///
/// Where it cannot be done anywhere (machines with unequal numbers of
/// ranks, no room in `dir`, a rank that cannot open the file), every rank
/// of the run holds a copy of its own ([`Shared::No`]: the ranks must agree,
/// for their collectives to match), or, when `required`, every rank
/// returns an error: its own, or one that names the failure elsewhere.
pub fn share_transport(
    comm: &dyn Collective,
    dir: &Path,
    tables: &[ParamTable],
    transport: TransportDType,
    required: bool,
) -> crate::run::Result<Shared> {
    let refuse = |why: String| match required {
        true => Err(DistError::Invalid(format!("{why} (--share-transport true)")).into()),
        false => Ok(Shared::No(why)),
    };
    let Some(machines) = Machines::of(comm)? else {
        return refuse(
            "no machine holds more than one rank, or machines hold different numbers of ranks".into(),
        );
    };
    let node = &*machines.node;
    let made = match node.rank() {
        0 => create_shared_transport(dir, tables, transport).map(Some),
        _ => Ok(None),
    };
    // A failure to create reaches the others as an empty name.
    let mut name = match &made {
        Ok(Some(f)) => f.path().as_os_str().as_encoded_bytes().to_vec(),
        _ => Vec::new(),
    };
    node.broadcast_bytes(&mut name)?;
    #[cfg(unix)]
    let path = PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(
        name,
    ));
    #[cfg(not(unix))]
    let path = PathBuf::from(String::from_utf8_lossy(&name).into_owned());
    let (guard, made) = match made {
        Ok(guard) => (guard, None),
        Err(e) => (None, Some(e)),
    };
    // This rank's failure, if any: its own error where it has one.
    let opened: crate::run::Result<std::fs::File> = match (made, path.as_os_str().is_empty()) {
        (Some(e), _) => Err(e.into()),
        (None, true) => Err(DistError::Invalid(format!(
            "rank 0 of this machine could not create the shared transport copies in --shm-dir {} \
             (rank 0 says why)",
            dir.display()
        ))
        .into()),
        (None, false) => open(&path).map_err(Into::into),
    };
    // Every rank of the run says whether it opened the file before any
    // name goes (and all fall back together).
    let mut failed = [opened.is_err() as u8 as f64];
    comm.sum_f64(&mut failed)?;
    drop(guard);
    match opened {
        Ok(file) if failed[0] == 0.0 => {
            let tier = SharedTransport {
                path,
                file: Some(Arc::new(file)),
                writes: machines.writes(),
                ranks: comm.size(),
                local: node.size(),
            };
            Ok(Shared::Yes(Sharing { machines, tier }))
        }
        Err(e) if required => Err(e),
        Err(e) => Ok(Shared::No(e.to_string())),
        Ok(_) => refuse(format!(
            "{} of {} ranks could not map shared transport copies (in {} on their machines)",
            failed[0],
            comm.size(),
            dir.display()
        )),
    }
}

fn open(path: &Path) -> megatrain_tier::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| megatrain_tier::TierError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::local::local_machines;

    /// Per rank: its index and machine size, whether it has peers on other
    /// machines, and their ranks.
    type Seen = Option<(usize, usize, bool, Vec<usize>)>;

    fn on(size: usize, per: usize) -> Vec<Seen> {
        let comms = local_machines(size, per);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        Machines::of(c)
                            .unwrap()
                            .map(|m| (m.node.rank(), m.node.size(), m.cross.is_some(), m.peers))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ranks_group_by_machine_with_peers_of_the_same_index() {
        assert_eq!(
            on(3, 3),
            [
                Some((0, 3, false, vec![0])),
                Some((1, 3, false, vec![1])),
                Some((2, 3, false, vec![2]))
            ]
        );
        assert_eq!(
            on(4, 2),
            [
                Some((0, 2, true, vec![0, 2])),
                Some((1, 2, true, vec![1, 3])),
                Some((0, 2, true, vec![0, 2])),
                Some((1, 2, true, vec![1, 3]))
            ]
        );
        // Nothing to share, or a machine short of a peer.
        assert_eq!(on(2, 1), [None, None]);
        assert_eq!(on(3, 2), [None, None, None]);
    }
}
