//! softrdma: the RDMA verbs model over RoCEv2, iWARP, shared memory and
//! libibverbs. See `DESIGN.md` for the layers.

#![warn(missing_docs)]

pub mod capture;
pub mod engine;
pub mod memory;

pub use softrdma_wire as wire;
