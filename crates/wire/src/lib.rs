//! Byte formats of RDMA over Ethernet, after smoltcp's `wire` module.
//!
//! RoCEv2 carries the InfiniBand transport (BTH and its extension headers, ICRC)
//! over UDP port 4791; iWARP carries RDMAP (RFC 5040) over DDP (RFC 5041) over
//! MPA (RFC 5044, RFC 6581) over TCP. Each header family has a view type over a
//! byte slice (`Header<T: AsRef<[u8]>>`) with a checked constructor, a getter per
//! field and, for mutable buffers, a setter per field; and a `Repr` of plain
//! owned fields with `parse`, `buffer_len` and `emit`.
//!
//! The crate does no I/O, never allocates and has no `unsafe`: every byte string
//! parses into a typed header or into a typed [`Error`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bytes;
mod error;

pub mod aeth;
pub mod atomic;
pub mod bth;
pub mod cm;
pub mod ddp;
pub mod deth;
pub mod grh;
pub mod icrc;
pub mod imm;
pub mod mad;
pub mod mpa;
pub mod opcode;
pub mod packet;
pub mod psn;
pub mod rdmap;
pub mod reth;

pub use error::{Error, Result};
pub use opcode::Opcode;
pub use psn::Psn;

/// UDP destination port of RoCEv2 (IANA).
pub const ROCEV2_UDP_PORT: u16 = 4791;
