//! [`Collective`] over MPI (rsmpi for initialisation and finalisation, its
//! raw bindings for the non-blocking collectives, whose buffers rsmpi ties
//! to a lexical scope that a per-chunk pipeline cannot keep).
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED`: the trainer calls
//! collectives from its main thread and from the optimizer worker, never
//! at the same time (the worker exists only inside a micro-batch, and the
//! main thread calls none then). Errors keep MPI's default handler
//! (`MPI_ERRORS_ARE_FATAL`): a failed call ends the job with MPI's own
//! message rather than leaving ranks waiting.

use std::ffi::c_int;
use std::ops::Range;
use std::sync::Arc;

use mpi::environment::{Threading, Universe};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};

use super::{Collective, DistError, Elem, InFlight, Result};

const ENGINE: &str = "MPI";

/// Sleep between polls of a collective in flight: short beside a layer's
/// compute, long enough to leave the core to the device thread.
const POLL: std::time::Duration = std::time::Duration::from_micros(50);

pub struct MpiComm {
    /// The run's ranks, or a part of them ([`Collective::split`]).
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    // Finalises MPI when the last communicator is dropped; declared last so
    // that this one is freed first.
    _universe: Arc<Universe>,
}

// SAFETY: MPI handles are plain integers or pointers into the MPI library,
// valid from any thread; MPI_THREAD_SERIALIZED (checked in `init`) makes
// calls from several threads legal as long as they do not overlap, which
// the trainer guarantees (see the module comment).
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

fn check(call: &'static str, code: c_int) -> Result<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(DistError::Engine {
            engine: ENGINE,
            call,
            code,
        })
    }
}

fn count(what: impl Fn() -> String, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| DistError::TooLarge {
        engine: ENGINE,
        what: what(),
        count: n,
        max: c_int::MAX as usize,
    })
}

fn counts_displs(ranges: &[Range<usize>]) -> Result<(Vec<c_int>, Vec<c_int>)> {
    let what = || "a layer shard".to_string();
    let counts = ranges
        .iter()
        .map(|r| count(what, r.len()))
        .collect::<Result<_>>()?;
    let displs = ranges
        .iter()
        .map(|r| count(what, r.start))
        .collect::<Result<_>>()?;
    Ok((counts, displs))
}

/// One request and whatever it must keep alive until it completes.
struct Request {
    req: ffi::MPI_Request,
    call: &'static str,
    _keep: Vec<Vec<c_int>>,
    _own: Vec<u8>,
    done: bool,
}

// SAFETY: an MPI request handle may be completed from another thread under
// MPI_THREAD_SERIALIZED (calls do not overlap: see the module comment).
unsafe impl Send for Request {}

impl Request {
    fn wait_inner(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        // MPI_Wait spins on a core; the thread that waits here shares the
        // machine with the device thread (all of it with the CPU executor),
        // so poll and sleep between polls instead. Each poll also drives
        // the progress of the collective.
        let mut flag: c_int = 0;
        loop {
            // SAFETY: `req` came from a successful non-blocking call.
            check(self.call, unsafe {
                ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE)
            })?;
            if flag != 0 {
                return Ok(());
            }
            std::thread::sleep(POLL);
        }
    }
}

impl InFlight for Request {
    fn wait(mut self: Box<Self>) -> Result<()> {
        self.wait_inner()
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // The caller's buffers must not be released while MPI still uses them.
        let _ = self.wait_inner();
    }
}

impl MpiComm {
    /// Initialises MPI (once per process). `None` when it already was.
    pub fn init() -> Result<Option<Self>> {
        let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Serialized) else {
            return Ok(None);
        };
        if threading < Threading::Serialized {
            return Err(DistError::Invalid(format!(
                "the MPI library offers thread level {threading:?}; megatrain needs Serialized"
            )));
        }
        let world = universe.world();
        Ok(Some(Self::over(world, Arc::new(universe))))
    }

    fn over(world: SimpleCommunicator, universe: Arc<Universe>) -> Self {
        MpiComm {
            rank: world.rank() as usize,
            size: world.size() as usize,
            world,
            _universe: universe,
        }
    }

    fn part(&self, comm: SimpleCommunicator) -> Arc<dyn Collective> {
        Arc::new(Self::over(comm, self._universe.clone()))
    }

    fn comm(&self) -> ffi::MPI_Comm {
        self.world.as_raw()
    }

    fn request(
        call: &'static str,
        keep: Vec<Vec<c_int>>,
        own: Vec<u8>,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> Result<Box<dyn InFlight>> {
        // SAFETY: RSMPI_REQUEST_NULL is an initialised constant of the library.
        let mut r = Box::new(Request {
            req: unsafe { ffi::RSMPI_REQUEST_NULL },
            call,
            _keep: keep,
            _own: own,
            done: true,
        });
        check(call, start(&mut r.req))?;
        r.done = false;
        Ok(r)
    }
}

fn datatype(e: Elem) -> ffi::MPI_Datatype {
    // SAFETY: constants of the library, initialised before `init` returns.
    unsafe {
        match e {
            Elem::F32 => ffi::RSMPI_FLOAT,
            Elem::U16 => ffi::RSMPI_UINT16_T,
        }
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn engine(&self) -> &'static str {
        ENGINE
    }

    fn sum_f64(&self, x: &mut [f64]) -> Result<()> {
        let send = x.to_vec();
        let n = count(|| "a sum of scalars".into(), x.len())?;
        // SAFETY: both buffers hold `n` doubles for the whole blocking call.
        check("MPI_Allreduce", unsafe {
            ffi::MPI_Allreduce(
                send.as_ptr().cast(),
                x.as_mut_ptr().cast(),
                n,
                ffi::RSMPI_DOUBLE,
                ffi::RSMPI_SUM,
                self.comm(),
            )
        })
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<()> {
        let mut len = [bytes.len() as u64];
        // SAFETY: one u64 (8 bytes) in a buffer of that size.
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(len.as_mut_ptr().cast(), 8, ffi::RSMPI_UINT8_T, 0, self.comm())
        })?;
        bytes.resize(len[0] as usize, 0);
        if bytes.is_empty() {
            // An empty Vec's pointer is 1, which is MPI_IN_PLACE to Open MPI.
            return Ok(());
        }
        let n = count(|| "a broadcast".into(), bytes.len())?;
        // SAFETY: `bytes` holds `n` bytes on every rank for the blocking call.
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(bytes.as_mut_ptr().cast(), n, ffi::RSMPI_UINT8_T, 0, self.comm())
        })
    }

    fn barrier(&self) -> Result<()> {
        // MPI orders the barrier's memory effects in the library; the fences
        // keep the compiler from moving this rank's writes across it.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: a blocking collective on a valid communicator.
        check("MPI_Barrier", unsafe { ffi::MPI_Barrier(self.comm()) })?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Collective>> {
        let color = c_int::try_from(color)
            .map_err(|_| DistError::Invalid(format!("split colour {color} out of range")))?;
        let part = self
            .world
            .split_by_color(Color::with_value(color))
            .ok_or_else(|| DistError::Invalid("MPI_Comm_split gave no communicator".into()))?;
        Ok(self.part(part))
    }

    fn split_machine(&self) -> Result<Arc<dyn Collective>> {
        Ok(self.part(self.world.split_shared(self.rank as c_int)))
    }

    fn gather_f32_to_root(&self, buf: &mut [f32], ranges: &[Range<usize>]) -> Result<()> {
        let (counts, displs) = counts_displs(ranges)?;
        // MPI forbids the send and receive buffers to overlap on the root.
        let own = buf[ranges[self.rank].clone()].to_vec();
        // SAFETY: `own` holds counts[rank] floats; on the root `buf` covers
        // every range (the caller's contract); the call is blocking.
        check("MPI_Gatherv", unsafe {
            ffi::MPI_Gatherv(
                own.as_ptr().cast(),
                counts[self.rank],
                ffi::RSMPI_FLOAT,
                buf.as_mut_ptr().cast(),
                counts.as_ptr(),
                displs.as_ptr(),
                ffi::RSMPI_FLOAT,
                0,
                self.comm(),
            )
        })
    }

    unsafe fn start_sum(&self, send: *const f32, recv: *mut f32, len: usize) -> Result<Box<dyn InFlight>> {
        let n = count(|| "a chunk of gradients".into(), len)?;
        Self::request("MPI_Iallreduce", Vec::new(), Vec::new(), |req| unsafe {
            ffi::MPI_Iallreduce(
                send.cast(),
                recv.cast(),
                n,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                self.comm(),
                req,
            )
        })
    }

    unsafe fn start_reduce_scatter(
        &self,
        send: *const f32,
        recv: *mut f32,
        ranges: &[Range<usize>],
    ) -> Result<Box<dyn InFlight>> {
        let (counts, _) = counts_displs(ranges)?;
        let counts_ptr = counts.as_ptr();
        Self::request("MPI_Ireduce_scatter", vec![counts], Vec::new(), |req| unsafe {
            ffi::MPI_Ireduce_scatter(
                send.cast(),
                recv.cast(),
                counts_ptr,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                self.comm(),
                req,
            )
        })
    }

    unsafe fn start_all_gather(
        &self,
        buf: *mut u8,
        elem: Elem,
        ranges: &[Range<usize>],
    ) -> Result<Box<dyn InFlight>> {
        let (counts, displs) = counts_displs(ranges)?;
        let own_range = &ranges[self.rank];
        let size = elem.size();
        // A copy of our own range: MPI forbids overlapping send and receive
        // buffers, and MPI_IN_PLACE has no portable binding in rsmpi.
        let own =
            unsafe { std::slice::from_raw_parts(buf.add(own_range.start * size), own_range.len() * size) }
                .to_vec();
        let (own_ptr, own_n) = (own.as_ptr(), counts[self.rank]);
        let (counts_ptr, displs_ptr) = (counts.as_ptr(), displs.as_ptr());
        let dt = datatype(elem);
        Self::request("MPI_Iallgatherv", vec![counts, displs], own, |req| unsafe {
            ffi::MPI_Iallgatherv(
                own_ptr.cast(),
                own_n,
                dt,
                buf.cast(),
                counts_ptr,
                displs_ptr,
                dt,
                self.comm(),
                req,
            )
        })
    }

    fn abort(&self, code: i32) -> ! {
        // SAFETY: aborting is valid at any time after initialisation.
        unsafe {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
        }
        std::process::exit(code)
    }
}
