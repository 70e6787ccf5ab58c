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

/// Connects a Unix seqpacket socket, waiting at most `wait` while the
/// listener's backlog is full (`TimedOut` then: a listener stopped, or a
/// process holding an abstract name that never accepts); a signal is no
/// reason to fail. The socket is left with no send timeout.
pub(crate) fn connect_unix_within(
    fd: &std::os::fd::OwnedFd,
    name: &rustix::net::SocketAddrUnix,
    wait: std::time::Duration,
) -> std::io::Result<()> {
    use rustix::net::sockopt::{Timeout, set_socket_timeout};
    let give_up = std::time::Instant::now() + wait;
    loop {
        let left = give_up.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        // A blocking Unix connect waits for room by the send timeout (a
        // zero one would mean none).
        let left = left.max(std::time::Duration::from_millis(1));
        set_socket_timeout(fd, Timeout::Send, Some(left))?;
        match rustix::net::connect(fd, name) {
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => return Err(std::io::ErrorKind::TimedOut.into()),
            r => break r?,
        }
    }
    set_socket_timeout(fd, Timeout::Send, None)?;
    Ok(())
}

/// `d` as a poll or timer timeout.
pub(crate) fn timespec(d: std::time::Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    }
}
