//! softrdma: the RDMA verbs model over RoCEv2, iWARP and shared memory, and
//! on RDMA NICs (RoCE) through rdma-core's libibverbs. The layers, bottom up:
//! [`wire`] (byte formats), [`memory`] (registered regions), [`engine`]
//! (sans-I/O transports), [`provider`] (sockets and progress threads; the
//! libibverbs device), [`verbs`] (the public API), [`cm`]
//! (connection set-up). [`capture`] reads and decodes packet captures.

#![warn(missing_docs)]

pub mod capture;
pub mod cm;
pub mod engine;
pub mod memory;
pub mod provider;
pub mod verbs;

pub use softrdma_wire as wire;
