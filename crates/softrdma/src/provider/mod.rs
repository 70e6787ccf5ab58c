//! Providers own the I/O: sockets, batching, timers and the progress thread
//! that drives the engine. A provider never re-implements transport rules.
//! `ibverbs` is the exception that has no engine: there a NIC (or the
//! kernel's rxe) is the transport, reached through rdma-core's libibverbs.

pub(crate) mod gsi;
pub mod hostd;
pub mod ibverbs;
pub mod netdev;
mod pcap;
pub(crate) mod shm;
pub mod tcp;
pub mod udp;

/// A Unix seqpacket socket (close-on-exec, plus `flags`): hostd's uplinks
/// and shm connections.
pub(crate) fn unix_seqpacket(
    flags: rustix::net::SocketFlags,
) -> std::io::Result<std::os::fd::OwnedFd> {
    Ok(rustix::net::socket_with(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC | flags,
        None,
    )?)
}

/// `d` as a poll or timer timeout.
pub(crate) fn timespec(d: std::time::Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    }
}
