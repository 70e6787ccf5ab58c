//! Connection set-up: two sides exchange what each needs of the other over a
//! TCP connection, then bring their RC QPs to RTS.
//!
//! The exchange is one line of text each way, client first:
//!
//! ```text
//! softrdma-rc v1 addr=127.0.0.1:4791 qpn=0x000011 psn=0x3a5c21 mtu=4096 rkey=0x9f3e0a11 va=0x7f3a00000000 len=1048576
//! ```
//!
//! `addr` is the device's IPv4 address and UDP port (how a peer learns a port
//! other than 4791); `rkey`, `va` and `len` advertise one memory region (zero
//! when none). rdma-core's and perftest's own exchanges live with the tools
//! (`softrdma ping`, `softrdma perf`); [`mpa`] is iWARP's establishment
//! ([`iwarp`] connects as rdma_cm does there), [`roce`] is rdma_cm's over
//! RoCEv2 (the IB connection manager), [`roce_ud`] its UD mode (SIDR),
//! [`shm`] connects shared-memory QPs.

mod backlog;
pub mod iwarp;
pub mod mpa;
pub mod roce;
pub mod roce_ud;
pub mod shm;

use std::io::{self, Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::verbs::{Access, AddressVector, Mr, Mtu, Qp, QpAttr, QpState, Result, VerbsError};

/// What one side tells the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfo {
    /// The device's address and UDP port.
    pub addr: SocketAddrV4,
    /// QP number.
    pub qpn: u32,
    /// First PSN this side sends.
    pub psn: u32,
    /// Largest path MTU this side's port allows.
    pub mtu: Mtu,
    /// Remote key of the advertised region (0 if none).
    pub rkey: u32,
    /// Address of the advertised region.
    pub va: u64,
    /// Length of the advertised region.
    pub len: u64,
}

impl ConnInfo {
    /// This side's info for `qp`, advertising `mr` if given. The PSN is random.
    pub fn local(qp: &Qp, mr: Option<&Mr>) -> Result<ConnInfo> {
        let port = qp.context().query_port();
        let psn = getrandom::u32()
            .map_err(|e| VerbsError::Invalid(format!("no randomness: {e}")))?
            & 0xff_ffff;
        Ok(ConnInfo {
            addr: qp.context().local_addr(),
            qpn: qp.qpn(),
            psn,
            mtu: port.active_mtu,
            rkey: mr.map_or(0, Mr::rkey),
            va: mr.map_or(0, Mr::addr),
            len: mr.map_or(0, |m| m.len() as u64),
        })
    }

    /// The line sent on the wire (without the newline).
    pub fn to_line(&self) -> String {
        format!(
            "softrdma-rc v1 addr={} qpn={:#08x} psn={:#08x} mtu={} rkey={:#010x} va={:#x} len={}",
            self.addr,
            self.qpn,
            self.psn,
            self.mtu.bytes(),
            self.rkey,
            self.va,
            self.len
        )
    }
}

fn bad(what: &str) -> VerbsError {
    VerbsError::Invalid(format!("bad connection info from the peer: {what}"))
}

fn num(v: &str) -> Option<u64> {
    match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse().ok(),
    }
}

impl FromStr for ConnInfo {
    type Err = VerbsError;

    fn from_str(line: &str) -> Result<ConnInfo> {
        let mut words = line.split_whitespace();
        if words.next() != Some("softrdma-rc") || words.next() != Some("v1") {
            return Err(bad("not a softrdma-rc v1 line"));
        }
        let (mut addr, mut qpn, mut psn, mut mtu, mut rkey, mut va, mut len) =
            (None, None, None, None, None, None, None);
        for w in words {
            let (k, v) = w.split_once('=').ok_or_else(|| bad(w))?;
            match k {
                "addr" => addr = v.parse::<SocketAddrV4>().ok(),
                "qpn" => qpn = num(v).filter(|&q| q <= 0xff_ffff && q > 1),
                "psn" => psn = num(v).filter(|&p| p <= 0xff_ffff),
                "mtu" => mtu = num(v).and_then(|m| Mtu::from_bytes(m as usize)),
                "rkey" => rkey = num(v).filter(|&k| k <= u64::from(u32::MAX)),
                "va" => va = num(v),
                "len" => len = num(v),
                _ => {}
            }
        }
        Ok(ConnInfo {
            addr: addr.ok_or_else(|| bad("addr"))?,
            qpn: qpn.ok_or_else(|| bad("qpn"))? as u32,
            psn: psn.ok_or_else(|| bad("psn"))? as u32,
            mtu: mtu.ok_or_else(|| bad("mtu"))?,
            rkey: rkey.ok_or_else(|| bad("rkey"))? as u32,
            va: va.ok_or_else(|| bad("va"))?,
            len: len.ok_or_else(|| bad("len"))?,
        })
    }
}

/// How long [`exchange`] waits for the peer's line when the stream has no
/// read timeout of its own.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest line [`exchange`] takes.
const MAX_LINE: usize = 512;

/// Sends `local` and reads the peer's info over `stream` (either side may go
/// first: both write, then both read). The stream's read timeout (else
/// [`EXCHANGE_TIMEOUT`]) bounds the whole line; nothing after it is read,
/// so the stream can carry on (a "done" message, say).
pub fn exchange(stream: &mut TcpStream, local: &ConnInfo) -> Result<ConnInfo> {
    let io = |e| VerbsError::Io {
        what: "connection info exchange".into(),
        source: e,
    };
    stream
        .write_all(format!("{}\n", local.to_line()).as_bytes())
        .map_err(io)?;
    let own_timeout = stream.read_timeout().map_err(io)?;
    let deadline = crate::verbs::deadline_after(own_timeout.unwrap_or(EXCHANGE_TIMEOUT));
    let line = read_line_by(stream, deadline);
    stream.set_read_timeout(own_timeout).map_err(io)?;
    let line = line.map_err(io)?;
    if line.is_empty() {
        return Err(bad("the peer closed the connection"));
    }
    String::from_utf8_lossy(&line).trim_end().parse()
}

/// Reads up to and including the first newline (or the end of the stream),
/// a byte at a time so as not to read past it, by `deadline`.
fn read_line_by(stream: &mut TcpStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        if line.len() >= MAX_LINE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("no end of line in the peer's first {MAX_LINE} bytes"),
            ));
        }
        match read_by(stream, &mut byte, deadline) {
            Ok(0) => break,
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not send its connection info in time",
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(line)
}

/// One read from `stream` by `deadline` (TimedOut after it): a read
/// timeout alone bounds each read, and a peer that dribbles its bytes would
/// hold an exchange for as long as it liked.
pub(crate) fn read_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> io::Result<usize> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::ErrorKind::TimedOut.into());
            }
            r => return r,
        }
    }
}

/// Options for bringing an RC QP up.
#[derive(Debug, Clone, Copy)]
pub struct RcOptions {
    /// Remote access the QP allows.
    pub access: Access,
    /// Local ACK timeout code (4.096 us * 2^timeout).
    pub timeout: u8,
    /// Retransmissions before giving up.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RNR timer code this side asks for.
    pub min_rnr_timer: u8,
    /// Outstanding READs/atomics this side issues.
    pub max_rd_atomic: u8,
    /// READs/atomics this side serves at once.
    pub max_dest_rd_atomic: u8,
}

impl Default for RcOptions {
    /// As the rdma-core tools set them, with room for 16 READs/atomics.
    fn default() -> Self {
        RcOptions {
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
        }
    }
}

/// Brings a UD QP from RESET to RTS with Q_Key `qkey` (port 1, P_Key
/// index 0), sending from `sq_psn`: all a UD QP needs, since its peers are
/// named per send.
pub fn ready_ud(qp: &Qp, qkey: u32, sq_psn: u32) -> Result<()> {
    for attr in [
        QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            qkey: Some(qkey),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rtr),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(sq_psn),
            ..QpAttr::default()
        },
    ] {
        qp.modify(&attr, None)?;
    }
    Ok(())
}

/// Brings `qp` from RESET to RTS towards the peer described by `remote`.
pub fn connect(qp: &Qp, local: &ConnInfo, remote: &ConnInfo, o: &RcOptions) -> Result<()> {
    qp.modify(
        &QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(o.access),
            ..QpAttr::default()
        },
        None,
    )?;
    qp.modify(
        &QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(local.mtu.min(remote.mtu)),
            dest_qp: Some(remote.qpn),
            rq_psn: Some(remote.psn),
            max_dest_rd_atomic: Some(o.max_dest_rd_atomic),
            min_rnr_timer: Some(o.min_rnr_timer),
            ..QpAttr::default()
        },
        Some(AddressVector { addr: remote.addr }),
    )?;
    qp.modify(
        &QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(local.psn),
            timeout: Some(o.timeout),
            retry_cnt: Some(o.retry_cnt),
            rnr_retry: Some(o.rnr_retry),
            max_rd_atomic: Some(o.max_rd_atomic),
            ..QpAttr::default()
        },
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(qpn: u32) -> ConnInfo {
        ConnInfo {
            addr: "127.0.0.1:4791".parse().unwrap(),
            qpn,
            psn: 1,
            mtu: Mtu::Mtu1024,
            rkey: 0,
            va: 0,
            len: 0,
        }
    }

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (c, l.accept().unwrap().0)
    }

    #[test]
    fn exchange_reads_no_further_than_the_line() {
        let (mut a, mut b) = tcp_pair();
        // The peer's line and what it sends next, in one segment.
        let mut burst = format!("{}\n", info(0x22).to_line()).into_bytes();
        burst.extend_from_slice(b"done");
        b.write_all(&burst).unwrap();
        assert_eq!(exchange(&mut a, &info(0x11)).unwrap(), info(0x22));
        let mut next = [0u8; 4];
        a.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"done");
        assert_eq!(a.read_timeout().unwrap(), None, "the stream's own timeout");
    }

    #[test]
    fn exchange_with_a_dribbling_or_silent_peer_ends_at_the_streams_timeout() {
        let (mut a, mut b) = tcp_pair();
        let limit = Duration::from_millis(300);
        a.set_read_timeout(Some(limit)).unwrap();
        let dribbler = std::thread::spawn(move || {
            let line = format!("{}\n", info(0x22).to_line());
            for byte in line.bytes() {
                if b.write_all(&[byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let t = Instant::now();
        let e = exchange(&mut a, &info(0x11)).unwrap_err();
        assert!(e.to_string().contains("in time"), "{e}");
        assert!(
            t.elapsed() < Duration::from_millis(700),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(a.read_timeout().unwrap(), Some(limit));
        drop(a);
        dribbler.join().unwrap();
        // A line without an end is refused once it is too long.
        let (mut a, mut b) = tcp_pair();
        b.write_all(&[b'x'; 600]).unwrap();
        let e = exchange(&mut a, &info(0x11)).unwrap_err();
        assert!(e.to_string().contains("no end of line"), "{e}");
    }

    #[test]
    fn line_round_trips_and_rejects_garbage() {
        let c = ConnInfo {
            addr: "127.0.0.1:4791".parse().unwrap(),
            qpn: 0x11,
            psn: 0x3a_5c21,
            mtu: Mtu::Mtu4096,
            rkey: 0x9f3e_0a11,
            va: 0x7f3a_0000_0000,
            len: 1 << 20,
        };
        assert_eq!(c.to_line().parse::<ConnInfo>().unwrap(), c);
        for bad in [
            "",
            "hello",
            "softrdma-rc v2 addr=1.2.3.4:1",
            "softrdma-rc v1 addr=1.2.3.4:1 qpn=0x1000000 psn=0 mtu=1024 rkey=0 va=0 len=0",
            "softrdma-rc v1 addr=1.2.3.4:1 qpn=0x11 psn=0 mtu=1000 rkey=0 va=0 len=0",
            "softrdma-rc v1 addr=nope qpn=0x11 psn=0 mtu=1024 rkey=0 va=0 len=0",
            "softrdma-rc v1 qpn",
        ] {
            assert!(bad.parse::<ConnInfo>().is_err(), "{bad}");
        }
    }
}
