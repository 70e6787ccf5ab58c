//! Providers own the I/O: sockets, batching, timers and the progress thread
//! that drives the engine. A provider never re-implements transport rules.

pub mod hostd;
pub mod netdev;
mod pcap;
pub(crate) mod shm;
pub mod tcp;
pub mod udp;
