//! A QP's own send socket, connected to its peer.
//!
//! An unconnected UDP send looks the route up every time; a connected
//! socket keeps it, which saves 0.35–0.55 µs of a busy-poll half round trip
//! here (docs/performance.md, eighteenth session). The catch is the IPv4
//! ID, which the ICRC covers: an unconnected socket with DF set sends ID 0,
//! a connected one counts from a random start that no socket option shows.
//!
//! The count can be read all the same. A datagram sent with a software
//! transmit timestamp comes back on the socket's error queue with its
//! headers (unless `net.core.tstamp_allow_data` is 0). A connected UDP socket
//! may still name another destination in a send, and the count moves for
//! that too; so the probe is an empty datagram to the socket's own address,
//! which no socket takes and the peer never sees. After the probe, each send
//! moves the count by a step the socket is calibrated for when made. A
//! datagram and a GSO send moved it by one each on the kernels tried (a GSO
//! send's segments take the IDs from its own on). A failed send may or may
//! not have moved it, so the next send probes again.
//!
//! Where any of this fails, the QP sends from the device's unconnected
//! sockets as before.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;

use nix::sys::socket::{
    ControlMessage, MsgFlags, SockaddrIn, TimestampingFlag, recvmsg, sendmsg, sendto, setsockopt,
    sockopt,
};

/// A QP's connected send socket, once tried.
#[derive(Debug, Default)]
pub(crate) enum SendSocket {
    /// Not made yet: made at the QP's first send to its peer.
    #[default]
    Untried,
    Ready(ConnectedSend),
    /// Making or calibrating it failed: the device's sockets send.
    Unusable,
}

impl SendSocket {
    /// The socket connected to `peer`, made (or made again, for a new
    /// peer) from `local_ip`; `None` if it cannot be, for good.
    pub(crate) fn connected_to(
        &mut self,
        local_ip: Ipv4Addr,
        peer: SocketAddrV4,
        gso: bool,
    ) -> Option<&mut ConnectedSend> {
        if let SendSocket::Ready(c) = self
            && c.peer != peer
        {
            *self = SendSocket::Untried;
        }
        if let SendSocket::Untried = self {
            *self = match ConnectedSend::open(local_ip, peer, gso) {
                Ok(c) => SendSocket::Ready(c),
                Err(_) => SendSocket::Unusable,
            };
        }
        match self {
            SendSocket::Ready(c) => Some(c),
            _ => None,
        }
    }
}

/// A send socket connected to one peer, with the IPv4 ID of its next send.
#[derive(Debug)]
pub(crate) struct ConnectedSend {
    socket: UdpSocket,
    /// Its own address (the source port goes into the ICRC).
    local: SocketAddrV4,
    peer: SocketAddrV4,
    /// The ID the next datagram (a GSO send's first segment) goes out with;
    /// `None` after a failed send, until a probe reads it again.
    next_ident: Option<u16>,
    /// How far a datagram and a GSO send move the count.
    plain_step: u16,
    gso_step: Option<u16>,
}

impl ConnectedSend {
    fn open(local_ip: Ipv4Addr, peer: SocketAddrV4, gso: bool) -> io::Result<ConnectedSend> {
        if local_ip.is_unspecified() {
            return Err(io::Error::other("the device has no address of its own"));
        }
        let socket = super::roce_socket(SocketAddrV4::new(local_ip, 0), false)?;
        socket.connect(peer)?;
        let local = match socket.local_addr()? {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(_) => return Err(io::Error::other("an IPv6 address")),
        };
        let mut c = ConnectedSend {
            socket,
            local,
            peer,
            next_ident: None,
            plain_step: 0,
            gso_step: None,
        };
        c.calibrate(gso)?;
        Ok(c)
    }

    /// Reads the count three times: twice in a row (a datagram's step),
    /// then after a GSO send of three segments (a GSO send's step).
    fn calibrate(&mut self, gso: bool) -> io::Result<()> {
        self.timestamping(true)?;
        let steps = (|| {
            let first = self.probe()?;
            let second = self.probe()?;
            let plain_step = second.wrapping_sub(first);
            let gso_step = if gso {
                let own = SockaddrIn::from(self.local);
                let segment = 1u16;
                sendmsg(
                    self.socket.as_raw_fd(),
                    &[IoSlice::new(&[0u8; 3])],
                    &[ControlMessage::UdpGsoSegments(&segment)],
                    MsgFlags::empty(),
                    Some(&own),
                )?;
                let third = self.probe()?;
                Some(third.wrapping_sub(second).wrapping_sub(plain_step))
            } else {
                None
            };
            Ok::<_, io::Error>((plain_step, gso_step, self.probe()?))
        })();
        self.timestamping(false)?;
        let (plain_step, gso_step, last) = steps?;
        // One per datagram, and per GSO send one or one per segment: what
        // Linux does. Anything else is a counter this code does not know.
        if plain_step != 1 || gso_step.is_some_and(|s| s != 1 && s != 3) {
            return Err(io::Error::other(format!(
                "the IPv4 ID moved by {plain_step} a datagram and {gso_step:?} a GSO send of 3"
            )));
        }
        self.plain_step = plain_step;
        // A step per segment is one the sender must count: kept as 0, "per
        // segment".
        self.gso_step = gso_step.map(|s| if s == 1 { 1 } else { 0 });
        self.next_ident = Some(last.wrapping_add(plain_step));
        Ok(())
    }

    fn timestamping(&self, on: bool) -> io::Result<()> {
        let flags = if on {
            TimestampingFlag::SOF_TIMESTAMPING_TX_SOFTWARE
                | TimestampingFlag::SOF_TIMESTAMPING_SOFTWARE
        } else {
            TimestampingFlag::empty()
        };
        setsockopt(&self.socket, sockopt::Timestamping, &flags).map_err(io::Error::from)
    }

    /// Sends an empty datagram to the socket's own address (timestamping
    /// on) and reads the ID it went out with from its looped-back headers.
    fn probe(&self) -> io::Result<u16> {
        let fd = self.socket.as_raw_fd();
        sendto(fd, &[], &SockaddrIn::from(self.local), MsgFlags::empty())?;
        let mut found = None;
        // The copy is queued as the packet leaves (within the send on
        // loopback); a queue on the device could take a little longer.
        for _ in 0..1000 {
            let mut buf = [0u8; 96];
            match recvmsg::<()>(
                fd,
                &mut [IoSliceMut::new(&mut buf)],
                None,
                MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(m) => {
                    let n = m.bytes.min(buf.len());
                    if let Some(id) = looped_ident(&buf[..n], self.local) {
                        found = Some(id);
                    }
                }
                Err(nix::errno::Errno::EAGAIN) if found.is_some() => break,
                Err(nix::errno::Errno::EAGAIN) => {
                    std::thread::sleep(std::time::Duration::from_micros(1))
                }
                Err(e) => return Err(e.into()),
            }
        }
        found.ok_or_else(|| {
            io::Error::other("no copy of the probe came back (net.core.tstamp_allow_data = 0?)")
        })
    }

    /// Its own address.
    pub(crate) fn local(&self) -> SocketAddrV4 {
        self.local
    }

    pub(crate) fn socket(&self) -> &UdpSocket {
        &self.socket
    }

    /// The ID the next send's first datagram goes out with, probed again
    /// after a failed send; `None` if the probe fails (send unconnected).
    pub(crate) fn next_ident(&mut self) -> Option<u16> {
        if self.next_ident.is_none() {
            let probed = self.timestamping(true).and_then(|()| {
                let id = self.probe();
                self.timestamping(false).and(id)
            });
            // A failed probe sends this one unconnected and probes again
            // at the next.
            if let Ok(id) = probed {
                self.next_ident = Some(id.wrapping_add(self.plain_step));
            }
        }
        self.next_ident
    }

    /// Whether a GSO send can go out here.
    pub(crate) fn takes_gso(&self) -> bool {
        self.gso_step.is_some()
    }

    /// A send of `segments` datagrams (GSO if more than one) went out.
    pub(crate) fn sent(&mut self, segments: usize) {
        let step = match self.gso_step {
            Some(0) if segments > 1 => segments as u16,
            Some(s) if segments > 1 => s,
            _ => self.plain_step,
        };
        self.next_ident = self.next_ident.map(|id| id.wrapping_add(step));
    }

    /// A send failed: the count may or may not have moved.
    pub(crate) fn failed(&mut self) {
        self.next_ident = None;
    }
}

/// The IPv4 ID of the probe in `data`, a looped-back copy from the link
/// header (Ethernet's 14 bytes, or none) on: an empty UDP datagram from
/// `own` to `own`.
fn looped_ident(data: &[u8], own: SocketAddrV4) -> Option<u16> {
    [0, 14].into_iter().find_map(|at| {
        let ip = data.get(at..at + 28)?;
        let ours = ip[0] == 0x45
            && ip[9] == 17
            && ip[12..16] == own.ip().octets()
            && ip[16..20] == own.ip().octets()
            && ip[20..22] == own.port().to_be_bytes()
            && ip[22..24] == own.port().to_be_bytes()
            && ip[24..26] == 8u16.to_be_bytes();
        ours.then(|| u16::from_be_bytes([ip[4], ip[5]]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_reads_the_count_and_sends_move_it_by_the_steps() {
        let peer = UdpSocket::bind("127.0.0.95:0").unwrap();
        let SocketAddr::V4(to) = peer.local_addr().unwrap() else {
            unreachable!()
        };
        let mut c = ConnectedSend::open(Ipv4Addr::new(127, 0, 0, 96), to, true).unwrap();
        assert_eq!(c.plain_step, 1);
        let before = c.next_ident().unwrap();
        let fd = c.socket.as_raw_fd();
        nix::sys::socket::send(fd, &[1, 2, 3], MsgFlags::empty()).unwrap();
        c.sent(1);
        let segment = 2u16;
        sendmsg::<()>(
            fd,
            &[IoSlice::new(&[0u8; 5])],
            &[ControlMessage::UdpGsoSegments(&segment)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        c.sent(3);
        let predicted = c.next_ident().unwrap();
        assert_ne!(predicted, before);
        c.failed();
        // A fresh probe goes out under the predicted ID.
        assert_eq!(c.next_ident(), Some(predicted.wrapping_add(1)));
        // The peer got the two sends and no probe.
        let mut buf = [0u8; 16];
        peer.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        while let Ok(n) = peer.recv(&mut buf) {
            got.push(n);
        }
        assert_eq!(got, [3, 2, 2, 1]);
    }

    #[test]
    fn only_the_probe_is_taken_for_one() {
        let own: SocketAddrV4 = "127.0.0.96:40000".parse().unwrap();
        let mut frame = [0u8; 42];
        frame[12..14].copy_from_slice(&[8, 0]);
        let ip = &mut frame[14..];
        ip[0] = 0x45;
        ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        ip[9] = 17;
        ip[12..16].copy_from_slice(&own.ip().octets());
        ip[16..20].copy_from_slice(&own.ip().octets());
        ip[20..22].copy_from_slice(&own.port().to_be_bytes());
        ip[22..24].copy_from_slice(&own.port().to_be_bytes());
        ip[24..26].copy_from_slice(&8u16.to_be_bytes());
        assert_eq!(looped_ident(&frame, own), Some(0x1234));
        assert_eq!(looped_ident(&frame[14..], own), Some(0x1234));
        assert_eq!(looped_ident(&frame[..41], own), None);
        let mut other = frame;
        other[14 + 22] ^= 1;
        assert_eq!(looped_ident(&other, own), None, "another port");
        let mut long = frame;
        long[14 + 25] = 9;
        assert_eq!(looped_ident(&long, own), None, "not empty");
    }
}
