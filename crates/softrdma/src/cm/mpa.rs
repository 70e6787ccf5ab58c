//! iWARP connection establishment: the MPA Request/Reply exchange (RFC 5044)
//! with the RFC 6581 enhancements (IRD/ORD, peer-to-peer mode), on a TCP
//! stream that has just connected. What rdma_cm does on iWARP, and what
//! Linux siw answers (`../shared/WIRE-NOTES.md` 5.1, 5.2).
//!
//! The negotiation decides the revision, whether FPDUs carry CRC32c, the READ
//! limits and, in peer-to-peer mode, which zero-length message ("RTR") the
//! initiator sends first; that message itself is the first FPDU of the
//! stream, sent and awaited by the iWARP transport, not here.

use std::io::{self, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use softrdma_wire::mpa::{
    FLAG_ENHANCED, FLAG_GSO, FLAG_GSO_OWN, IrdOrd, Kind, MAX_PRIVATE_DATA, START_FRAME_HEADER_LEN,
    StartFrame, StartFrameRepr,
};

/// How a side stands on CRC32c.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrcPolicy {
    /// Off unless the peer asks for it (siw's default).
    #[default]
    IfAsked,
    /// Ask for it; a peer that answers without it gets the connection
    /// closed.
    Required,
}

pub use crate::engine::iwarp::Rtr;

/// This side's offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaConfig {
    /// 1 (RFC 5044) or 2 (RFC 6581, with IRD/ORD).
    pub revision: u8,
    /// CRC32c.
    pub crc: CrcPolicy,
    /// Inbound RDMA READs this side serves at once.
    pub ird: u16,
    /// Outbound RDMA READs this side issues at once.
    pub ord: u16,
    /// Peer-to-peer mode, with the RTR messages this side can use (first
    /// preferred); empty: the client/server model (no RTR message).
    pub p2p: Vec<Rtr>,
    /// The application's private data (rdma_cm's conn_param private data).
    pub private_data: Vec<u8>,
    /// How long to wait for the peer's frame.
    pub timeout: Duration,
    /// IP type of service of the TCP connection (rdma_cm's
    /// RDMA_OPTION_ID_TOS); None leaves the system's.
    pub tos: Option<u8>,
    /// Offer FPDUs larger than a TCP segment (siw's private "GSO" flag):
    /// used when both sides take them, which a siw responder cannot confirm
    /// (see [`MpaOutcome::large_fpdus`]).
    pub large_fpdus: bool,
}

impl Default for MpaConfig {
    /// siw's defaults (revision 2, CRC if asked, IRD = ORD = 1, no P2P),
    /// and large FPDUs offered.
    fn default() -> Self {
        MpaConfig {
            revision: 2,
            crc: CrcPolicy::IfAsked,
            ird: 1,
            ord: 1,
            p2p: Vec::new(),
            private_data: Vec::new(),
            timeout: Duration::from_secs(10),
            tos: None,
            large_fpdus: true,
        }
    }
}

/// What was agreed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaOutcome {
    /// The revision in use.
    pub revision: u8,
    /// Whether FPDUs carry CRC32c (both directions).
    pub crc: bool,
    /// The peer's IRD and ORD (None with revision 1: left to the application).
    pub peer_ird_ord: Option<(u16, u16)>,
    /// READs this side may have outstanding: its ORD, at most the peer's IRD.
    pub ord: u16,
    /// READs this side serves at once.
    pub ird: u16,
    /// Peer-to-peer mode and its RTR message, if negotiated.
    pub rtr: Option<Rtr>,
    /// This side sent the MPA Request (and so sends the RTR message).
    pub initiator: bool,
    /// The peer's private data (after the IRD/ORD block).
    pub peer_private_data: Vec<u8>,
    /// This side may send FPDUs larger than a TCP segment: both offered
    /// them. A responder learns it from the Request's siw "GSO" flag; an
    /// initiator only from a Reply that also carries softrdma's own flag,
    /// since siw's Reply echoes the Request's flags (so towards siw in its
    /// default mode, FPDUs stay within the MSS, as siw's own are).
    pub large_fpdus: bool,
    /// Initiator: the Reply carried softrdma's own flag, so the responder is
    /// softrdma (which reads its socket from the Reply on: no need to wait
    /// for it as for siw). Always `false` for a responder.
    pub peer_is_softrdma: bool,
    /// Negotiated by the device's kernel driver through rdma_cm (an RNIC
    /// of the ibverbs provider): the kernel does not report the revision,
    /// CRC, RTR or FPDU size, which read 0, false, None and false.
    pub through_kernel: bool,
}

/// Why establishment failed.
#[derive(Debug, thiserror::Error)]
pub enum MpaError {
    /// The peer rejected the connection.
    #[error("the peer rejected the connection (MPA Reply with the reject flag{})", pd_note(.private_data))]
    Rejected {
        /// What the peer said with it.
        private_data: Vec<u8>,
    },
    /// This side rejected it (the peer was told).
    #[error("connection rejected here: {reason}")]
    RejectedHere {
        /// Why.
        reason: String,
    },
    /// The peer asked for markers, which softrdma (like siw) does not do.
    #[error("the peer asks for MPA markers, which softrdma does not support (as siw)")]
    Markers,
    /// The peer's frame is not an MPA frame softrdma understands.
    #[error("bad MPA frame from the peer: {0}")]
    Protocol(String),
    /// CRC was required here and the peer declined it.
    #[error("CRC32c is required here and the peer's Reply declines it")]
    CrcDeclined,
    /// No MPA frame from the peer in time: it made or took the TCP
    /// connection but sent nothing whole on it.
    #[error(
        "no MPA {awaited} from the peer within {} s: {}",
        .waited.as_secs_f64(),
        if *.awaited == "Reply" {
            "it accepted the TCP connection but never answered"
        } else {
            "it connected but never sent a whole one"
        }
    )]
    Silent {
        /// The frame waited for: "Request" or "Reply".
        awaited: &'static str,
        /// How long.
        waited: Duration,
    },
    /// The TCP connection failed or closed.
    #[error("MPA exchange: {0}")]
    Io(#[from] io::Error),
}

fn pd_note(pd: &[u8]) -> String {
    if pd.is_empty() {
        String::new()
    } else {
        format!(", private data {:?}", String::from_utf8_lossy(pd))
    }
}

/// The peer's Request, as the accepting side sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaRequest {
    /// Its revision.
    pub revision: u8,
    /// It asks for CRC32c.
    pub crc: bool,
    /// Its IRD and ORD (revision 2).
    pub ird_ord: Option<IrdOrd>,
    /// Its private data (after the IRD/ORD block).
    pub private_data: Vec<u8>,
}

/// What the accepting side answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Accept (with this side's offer's private data).
    Accept,
    /// Reject, telling the peer this.
    Reject(Vec<u8>),
}

/// Fills `buf` by `deadline`, however the peer dribbles the bytes.
fn read_exact_by(stream: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        match super::read_by(stream, buf, deadline)? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// Reads the peer's start frame, which must be a `want`, whole within
/// `waited`.
fn read_frame(
    stream: &mut TcpStream,
    want: Kind,
    waited: Duration,
) -> Result<(StartFrameRepr, Vec<u8>), MpaError> {
    let deadline = crate::verbs::deadline_after(waited);
    let silent = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => MpaError::Silent {
            awaited: match want {
                Kind::Request => "Request",
                Kind::Reply => "Reply",
            },
            waited,
        },
        _ => MpaError::Io(e),
    };
    let mut head = [0u8; START_FRAME_HEADER_LEN];
    read_exact_by(stream, &mut head, deadline).map_err(silent)?;
    let len = u16::from_be_bytes([head[18], head[19]]) as usize;
    if len > MAX_PRIVATE_DATA {
        return Err(MpaError::Protocol(format!(
            "{len} bytes of private data (at most {MAX_PRIVATE_DATA})"
        )));
    }
    let mut frame = head.to_vec();
    frame.resize(START_FRAME_HEADER_LEN + len, 0);
    read_exact_by(stream, &mut frame[START_FRAME_HEADER_LEN..], deadline).map_err(silent)?;
    let view =
        StartFrame::new_checked(&frame[..]).map_err(|e| MpaError::Protocol(e.to_string()))?;
    let repr = match StartFrameRepr::parse(&view) {
        Ok(repr) => repr,
        Err(e) => {
            // A revision-2 Request whose enhanced flag has no IRD/ORD block
            // behind it is answered with a reject, as siw does; other bad
            // frames are not MPA enough to answer.
            if want == Kind::Request
                && view.kind() == Ok(Kind::Request)
                && view.revision() == 2
                && view.flags() & FLAG_ENHANCED != 0
            {
                reject_reply(stream, 2, b"enhanced flag without an IRD/ORD block")?;
            }
            return Err(MpaError::Protocol(e.to_string()));
        }
    };
    if repr.kind != want {
        return Err(MpaError::Protocol(format!(
            "an MPA {:?} where a {want:?} belongs",
            repr.kind
        )));
    }
    let ulp = frame[frame.len() - repr.ulp_private_data_len..].to_vec();
    Ok((repr, ulp))
}

/// Answers a Request with a reject Reply carrying `why`.
fn reject_reply(stream: &mut TcpStream, revision: u8, why: &[u8]) -> io::Result<()> {
    let reply = StartFrameRepr {
        kind: Kind::Reply,
        markers: false,
        crc: false,
        reject: true,
        reserved_flags: 0,
        revision,
        // siw answers with an all-zero block.
        ird_ord: (revision >= 2).then(IrdOrd::default),
        ulp_private_data_len: why.len(),
    };
    stream.write_all(&frame_bytes(&reply, why))
}

fn frame_bytes(repr: &StartFrameRepr, ulp: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; repr.buffer_len()];
    let mut view = StartFrame::new_checked(&mut buf[..]).expect("sized for the frame");
    repr.emit(&mut view, ulp).expect("private data checked");
    buf
}

fn offer_block(cfg: &MpaConfig, rtr: &[Rtr]) -> IrdOrd {
    IrdOrd {
        peer_to_peer: !rtr.is_empty(),
        send_rtr: false,
        ird: cfg.ird.min(IrdOrd::NOT_NEGOTIATED),
        write_rtr: rtr.contains(&Rtr::Write),
        read_rtr: rtr.contains(&Rtr::Read),
        ord: cfg.ord.min(IrdOrd::NOT_NEGOTIATED),
    }
}

pub(crate) fn check_cfg(cfg: &MpaConfig) -> Result<(), MpaError> {
    let room = MAX_PRIVATE_DATA - if cfg.revision >= 2 { 4 } else { 0 };
    if !(1..=2).contains(&cfg.revision) {
        return Err(MpaError::Protocol(format!(
            "MPA revision {} (softrdma speaks 1 and 2)",
            cfg.revision
        )));
    }
    let most = u16::from(crate::engine::qp::MAX_RD_ATOMIC);
    if cfg.ird > most || cfg.ord > most {
        return Err(MpaError::Protocol(format!(
            "IRD {} and ORD {}: at most {most} each (siw's and rxe's limit)",
            cfg.ird, cfg.ord
        )));
    }
    if cfg.private_data.len() > room {
        return Err(MpaError::Protocol(format!(
            "{} bytes of private data: at most {room} fit",
            cfg.private_data.len()
        )));
    }
    Ok(())
}

/// The initiator's side: sends the Request, reads the Reply.
pub fn connect(stream: &mut TcpStream, cfg: &MpaConfig) -> Result<MpaOutcome, MpaError> {
    check_cfg(cfg)?;
    let request = StartFrameRepr {
        kind: Kind::Request,
        markers: false,
        crc: cfg.crc == CrcPolicy::Required,
        reject: false,
        reserved_flags: if cfg.large_fpdus { FLAG_GSO } else { 0 },
        revision: cfg.revision,
        ird_ord: (cfg.revision >= 2).then(|| offer_block(cfg, &cfg.p2p)),
        ulp_private_data_len: cfg.private_data.len(),
    };
    stream.write_all(&frame_bytes(&request, &cfg.private_data))?;
    let (reply, pd) = read_frame(stream, Kind::Reply, cfg.timeout)?;
    if reply.reject {
        return Err(MpaError::Rejected { private_data: pd });
    }
    if reply.markers {
        return Err(MpaError::Markers);
    }
    if reply.revision > cfg.revision {
        return Err(MpaError::Protocol(format!(
            "a revision {} Reply to a revision {} Request",
            reply.revision, cfg.revision
        )));
    }
    if cfg.crc == CrcPolicy::Required && !reply.crc {
        return Err(MpaError::CrcDeclined);
    }
    let peer = reply.ird_ord;
    let rtr = match peer {
        Some(p) if p.peer_to_peer && !cfg.p2p.is_empty() => {
            // The responder names the one RTR message it chose.
            match (p.write_rtr, p.read_rtr) {
                (true, false) if cfg.p2p.contains(&Rtr::Write) => Some(Rtr::Write),
                (false, true) if cfg.p2p.contains(&Rtr::Read) => Some(Rtr::Read),
                _ => {
                    return Err(MpaError::Protocol(
                        "the Reply's peer-to-peer RTR choice is not one offered".into(),
                    ));
                }
            }
        }
        _ => None,
    };
    stream.set_read_timeout(None)?;
    Ok(MpaOutcome {
        through_kernel: false,
        revision: reply.revision,
        crc: reply.crc,
        peer_ird_ord: peer.map(|p| (p.ird, p.ord)),
        ord: peer.map_or(cfg.ord, |p| cfg.ord.min(p.ird)),
        ird: cfg.ird,
        rtr,
        initiator: true,
        peer_private_data: pd,
        large_fpdus: cfg.large_fpdus
            && reply.reserved_flags & (FLAG_GSO | FLAG_GSO_OWN) == FLAG_GSO | FLAG_GSO_OWN,
        peer_is_softrdma: reply.reserved_flags & FLAG_GSO_OWN != 0,
    })
}

/// The responder's side: reads the Request, lets `decide` accept or reject
/// it, answers.
pub fn accept(
    stream: &mut TcpStream,
    cfg: &MpaConfig,
    decide: impl FnOnce(&MpaRequest) -> Decision,
) -> Result<MpaOutcome, MpaError> {
    check_cfg(cfg)?;
    let request = read_request(stream, cfg.timeout)?;
    answer(stream, cfg, request, decide)
}

/// An MPA Request as it came, not yet answered.
#[derive(Debug)]
pub(crate) struct ArrivedRequest {
    frame: StartFrameRepr,
    private_data: Vec<u8>,
}

/// Reads the initiator's Request, whole within `waited`. A frame that is
/// not an MPA Request (bad key, revision 3) is an error that gets no Reply,
/// as from siw: the caller drops the connection.
pub(crate) fn read_request(
    stream: &mut TcpStream,
    waited: Duration,
) -> Result<ArrivedRequest, MpaError> {
    let (frame, private_data) = read_frame(stream, Kind::Request, waited)?;
    Ok(ArrivedRequest {
        frame,
        private_data,
    })
}

/// Lets `decide` accept or reject a Request read by [`read_request`], and
/// answers it (`cfg` checked by [`check_cfg`]).
pub(crate) fn answer(
    stream: &mut TcpStream,
    cfg: &MpaConfig,
    arrived: ArrivedRequest,
    decide: impl FnOnce(&MpaRequest) -> Decision,
) -> Result<MpaOutcome, MpaError> {
    let ArrivedRequest {
        frame: req,
        private_data: pd,
    } = arrived;
    let revision = req.revision.min(cfg.revision);
    let reject = |stream: &mut TcpStream, why: &[u8]| reject_reply(stream, revision, why);
    if req.markers {
        reject(stream, b"markers not supported")?;
        return Err(MpaError::Markers);
    }
    let request = MpaRequest {
        revision: req.revision,
        crc: req.crc,
        ird_ord: req.ird_ord,
        private_data: pd,
    };
    // Peer-to-peer: the first RTR message both sides can use. A responder
    // not set up for it still honours an initiator that asks (awaiting the
    // RTR costs nothing), WRITE first, as siw's does: siw's initiator fails
    // a Reply that picks none.
    let ours: &[Rtr] = if cfg.p2p.is_empty() {
        &[Rtr::Write, Rtr::Read]
    } else {
        &cfg.p2p
    };
    let rtr = match req.ird_ord {
        Some(p) if p.peer_to_peer => {
            let theirs = |r: &Rtr| match r {
                Rtr::Write => p.write_rtr,
                Rtr::Read => p.read_rtr,
            };
            match ours.iter().copied().find(|r| theirs(r)) {
                Some(r) => Some(r),
                None => {
                    let why = b"no common peer-to-peer RTR message";
                    reject(stream, why)?;
                    return Err(MpaError::RejectedHere {
                        reason: String::from_utf8_lossy(why).into(),
                    });
                }
            }
        }
        _ => None,
    };
    if let Decision::Reject(why) = decide(&request) {
        let why = &why[..why.len().min(MAX_PRIVATE_DATA - 4)];
        reject(stream, why)?;
        return Err(MpaError::RejectedHere {
            reason: format!("by the application ({} bytes to the peer)", why.len()),
        });
    }
    let peer = req.ird_ord.filter(|_| revision >= 2);
    let ord = peer.map_or(cfg.ord, |p| cfg.ord.min(p.ird));
    // CRC if the initiator asks, or if this side requires it.
    let crc = req.crc || cfg.crc == CrcPolicy::Required;
    let large_fpdus = cfg.large_fpdus && req.reserved_flags & FLAG_GSO != 0;
    let reply = StartFrameRepr {
        kind: Kind::Reply,
        markers: false,
        crc,
        reject: false,
        reserved_flags: if large_fpdus {
            FLAG_GSO | FLAG_GSO_OWN
        } else {
            0
        },
        revision,
        ird_ord: (revision >= 2).then(|| IrdOrd {
            // The ORD this side will use: no more READs than the peer serves.
            ord: ord.min(IrdOrd::NOT_NEGOTIATED),
            ..offer_block(cfg, rtr.as_slice())
        }),
        ulp_private_data_len: cfg.private_data.len(),
    };
    stream.write_all(&frame_bytes(&reply, &cfg.private_data))?;
    stream.set_read_timeout(None)?;
    Ok(MpaOutcome {
        through_kernel: false,
        revision,
        crc,
        peer_ird_ord: peer.map(|p| (p.ird, p.ord)),
        ord,
        ird: cfg.ird,
        rtr,
        initiator: false,
        peer_private_data: request.private_data,
        large_fpdus,
        peer_is_softrdma: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    /// Runs `connect` and `accept` over loopback.
    fn pair(
        client: MpaConfig,
        server: MpaConfig,
        decide: fn(&MpaRequest) -> Decision,
    ) -> (Result<MpaOutcome, MpaError>, Result<MpaOutcome, MpaError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, &server, decide)
        });
        let mut c = TcpStream::connect(at).unwrap();
        let r = connect(&mut c, &client);
        drop(c);
        (r, t.join().unwrap())
    }

    fn yes(_: &MpaRequest) -> Decision {
        Decision::Accept
    }

    #[test]
    fn the_request_is_byte_for_byte_siws() {
        // siw_rping.pcap frame 6: revision 2, IRD 1, ORD 1, no CRC; what
        // `connect` sends with large FPDUs not offered.
        let cfg = MpaConfig {
            large_fpdus: false,
            ..MpaConfig::default()
        };
        let (req, _) = connect_to_a_reply_with(0x10, cfg);
        assert_eq!(
            &req[..],
            b"MPA ID Req Frame\x10\x02\x00\x04\x00\x01\x00\x01"
        );
    }

    #[test]
    fn defaults_agree_on_siws_terms() {
        let (c, s) = pair(MpaConfig::default(), MpaConfig::default(), yes);
        let (c, s) = (c.unwrap(), s.unwrap());
        assert_eq!((c.revision, c.crc, c.rtr), (2, false, None));
        assert_eq!(c.peer_ird_ord, Some((1, 1)));
        assert_eq!(s.peer_ird_ord, Some((1, 1)));
    }

    #[test]
    fn crc_is_used_when_either_side_requires_it() {
        let req = MpaConfig {
            crc: CrcPolicy::Required,
            ..MpaConfig::default()
        };
        let (c, s) = pair(req.clone(), MpaConfig::default(), yes);
        assert!(c.unwrap().crc && s.unwrap().crc);
        let (c, s) = pair(MpaConfig::default(), req, yes);
        assert!(c.unwrap().crc && s.unwrap().crc);
    }

    #[test]
    fn private_data_and_read_limits_travel() {
        let client = MpaConfig {
            ird: 16,
            ord: 128,
            private_data: b"hello from the client".to_vec(),
            ..MpaConfig::default()
        };
        let server = MpaConfig {
            ird: 4,
            ord: 8,
            private_data: b"and back".to_vec(),
            ..MpaConfig::default()
        };
        let (c, s) = pair(client, server, |r| {
            assert_eq!(r.private_data, b"hello from the client");
            Decision::Accept
        });
        let (c, s) = (c.unwrap(), s.unwrap());
        assert_eq!(c.peer_private_data, b"and back");
        assert_eq!(s.peer_private_data, b"hello from the client");
        // The client may have at most the server's IRD outstanding.
        assert_eq!((c.ord, c.ird), (4, 16));
        assert_eq!((s.ord, s.ird), (8, 4));
    }

    #[test]
    fn revision_1_has_no_ird_ord() {
        let old = MpaConfig {
            revision: 1,
            ..MpaConfig::default()
        };
        let (c, s) = pair(MpaConfig::default(), old.clone(), yes);
        let (c, s) = (c.unwrap(), s.unwrap());
        assert_eq!((c.revision, s.revision), (1, 1));
        assert_eq!(c.peer_ird_ord, None);
        let (c, _) = pair(old, MpaConfig::default(), yes);
        assert_eq!(c.unwrap().revision, 1);
    }

    #[test]
    fn a_rejection_is_an_error_on_both_sides() {
        let (c, s) = pair(MpaConfig::default(), MpaConfig::default(), |_| {
            Decision::Reject(b"no room".to_vec())
        });
        match c.unwrap_err() {
            MpaError::Rejected { private_data } => assert_eq!(private_data, b"no room"),
            e => panic!("{e}"),
        }
        assert!(matches!(s.unwrap_err(), MpaError::RejectedHere { .. }));
    }

    #[test]
    fn peer_to_peer_picks_a_common_rtr_message() {
        let client = MpaConfig {
            p2p: vec![Rtr::Read, Rtr::Write],
            ..MpaConfig::default()
        };
        let server = MpaConfig {
            p2p: vec![Rtr::Write],
            ..MpaConfig::default()
        };
        let (c, s) = pair(client.clone(), server, yes);
        assert_eq!(c.unwrap().rtr, Some(Rtr::Write));
        assert_eq!(s.unwrap().rtr, Some(Rtr::Write));
        // A responder not set up for P2P honours it, WRITE first (as siw).
        let (c, s) = pair(client.clone(), MpaConfig::default(), yes);
        assert_eq!(
            (c.unwrap().rtr, s.unwrap().rtr),
            (Some(Rtr::Write), Some(Rtr::Write))
        );
        // No common message: rejected.
        let (c, s) = pair(
            MpaConfig {
                p2p: vec![Rtr::Read],
                ..MpaConfig::default()
            },
            MpaConfig {
                p2p: vec![Rtr::Write],
                ..MpaConfig::default()
            },
            yes,
        );
        assert!(matches!(c.unwrap_err(), MpaError::Rejected { .. }));
        assert!(matches!(s.unwrap_err(), MpaError::RejectedHere { .. }));
    }

    #[test]
    fn markers_and_garbage_are_refused() {
        // A Request asking for markers: rejected, as siw does.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let r = accept(&mut s, &MpaConfig::default(), yes);
            let (mut s2, _) = l.accept().unwrap();
            (r, accept(&mut s2, &MpaConfig::default(), yes))
        });
        let mut c = TcpStream::connect(at).unwrap();
        c.write_all(b"MPA ID Req Frame\x90\x02\x00\x04\x00\x01\x00\x01")
            .unwrap();
        let mut reply = [0u8; 24];
        c.read_exact(&mut reply).unwrap();
        assert_eq!(&reply[..16], b"MPA ID Rep Frame");
        assert_eq!(reply[16] & 0x20, 0x20, "the reject flag");
        let mut c2 = TcpStream::connect(at).unwrap();
        c2.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let (markers, garbage) = t.join().unwrap();
        assert!(matches!(markers.unwrap_err(), MpaError::Markers));
        assert!(matches!(garbage.unwrap_err(), MpaError::Protocol(_)));
        // Revision 2, enhanced, two bytes of private data: no room for the
        // IRD/ORD block, rejected as siw does.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, &MpaConfig::default(), yes)
        });
        let mut c3 = TcpStream::connect(at).unwrap();
        c3.write_all(b"MPA ID Req Frame\x10\x02\x00\x02\x00\x01")
            .unwrap();
        let mut reply = [0u8; 16 + 4];
        c3.read_exact(&mut reply).unwrap();
        assert_eq!(&reply[..16], b"MPA ID Rep Frame");
        assert_eq!(reply[16] & 0x20, 0x20, "the reject flag");
        assert!(matches!(
            t.join().unwrap().unwrap_err(),
            MpaError::Protocol(_)
        ));
    }

    #[test]
    fn large_fpdus_are_used_only_when_both_sides_offer_them() {
        let off = MpaConfig {
            large_fpdus: false,
            ..MpaConfig::default()
        };
        let (c, s) = pair(MpaConfig::default(), MpaConfig::default(), yes);
        assert!(c.unwrap().large_fpdus && s.unwrap().large_fpdus);
        for (client, server) in [
            (off.clone(), MpaConfig::default()),
            (MpaConfig::default(), off),
        ] {
            let (c, s) = pair(client, server, yes);
            assert!(!c.unwrap().large_fpdus && !s.unwrap().large_fpdus);
        }
    }

    /// Our Request read by a stand-in responder that answers `flags`.
    fn connect_to_a_reply_with(flags: u8, cfg: MpaConfig) -> (Vec<u8>, MpaOutcome) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = vec![0u8; 24];
            s.read_exact(&mut req).unwrap();
            let mut reply = b"MPA ID Rep Frame\x00\x02\x00\x04\x00\x01\x00\x01".to_vec();
            reply[16] = flags;
            s.write_all(&reply).unwrap();
            req
        });
        let mut c = TcpStream::connect(at).unwrap();
        let out = connect(&mut c, &cfg).unwrap();
        (t.join().unwrap(), out)
    }

    #[test]
    fn a_reply_that_only_echoes_the_gso_flag_keeps_fpdus_within_a_segment() {
        // The Request is siw's with its GSO flag (siw with try_gso sends
        // the same).
        let (req, out) = connect_to_a_reply_with(0x18, MpaConfig::default());
        assert_eq!(
            &req[..],
            b"MPA ID Req Frame\x18\x02\x00\x04\x00\x01\x00\x01"
        );
        // siw's Reply copies the Request's flags: no proof it was read.
        assert!(!out.large_fpdus && !out.peer_is_softrdma);
        let (_, out) = connect_to_a_reply_with(0x10, MpaConfig::default());
        assert!(!out.large_fpdus && !out.peer_is_softrdma);
        let (_, out) = connect_to_a_reply_with(0x1c, MpaConfig::default());
        assert!(out.large_fpdus && out.peer_is_softrdma);
    }

    /// The flags byte of our Reply to `request`, and the outcome.
    fn accept_a_request(request: &'static [u8]) -> (u8, MpaOutcome) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, &MpaConfig::default(), yes).unwrap()
        });
        let mut c = TcpStream::connect(at).unwrap();
        c.write_all(request).unwrap();
        let mut reply = [0u8; 24];
        c.read_exact(&mut reply).unwrap();
        (reply[16], t.join().unwrap())
    }

    #[test]
    fn a_request_with_the_gso_flag_gets_large_fpdus_and_a_reply_that_says_so() {
        // siw with try_gso: it sends large FPDUs itself when our Reply has
        // the flag, and takes ours.
        let (flags, out) = accept_a_request(b"MPA ID Req Frame\x18\x02\x00\x04\x00\x01\x00\x01");
        assert_eq!(flags, 0x1c);
        assert!(out.large_fpdus);
        // siw's default Request: the Reply is siw's, byte for byte.
        let (flags, out) = accept_a_request(b"MPA ID Req Frame\x10\x02\x00\x04\x00\x01\x00\x01");
        assert_eq!(flags, 0x10);
        assert!(!out.large_fpdus);
    }

    #[test]
    fn a_peer_that_dribbles_its_reply_times_out_all_the_same() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        // A byte every 50 ms: each read comes well within the timeout, the
        // whole Reply (20 bytes) would not.
        let dribbler = std::thread::spawn(move || {
            for b in b"MPA ID Rep Frame\x00\x02\x00\x00" {
                if s.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let cfg = MpaConfig {
            timeout: Duration::from_millis(300),
            ..MpaConfig::default()
        };
        let t = Instant::now();
        let e = connect(&mut c, &cfg).unwrap_err();
        assert!(
            matches!(
                e,
                MpaError::Silent {
                    awaited: "Reply",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            t.elapsed() < Duration::from_millis(700),
            "{:?}",
            t.elapsed()
        );
        drop(c);
        dribbler.join().unwrap();
        // Waiting forever is a long timeout, not a panic.
        let cfg = MpaConfig {
            timeout: Duration::MAX,
            ..MpaConfig::default()
        };
        let (mut c, mut s) = {
            let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (c, l.accept().unwrap().0)
        };
        let server = std::thread::spawn(move || accept(&mut s, &cfg, |_| Decision::Accept));
        connect(&mut c, &MpaConfig::default()).unwrap();
        server.join().unwrap().unwrap();
    }

    #[test]
    fn a_silent_peer_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let _keep = l.accept().unwrap();
        let cfg = MpaConfig {
            timeout: Duration::from_millis(100),
            ..MpaConfig::default()
        };
        let e = connect(&mut c, &cfg).unwrap_err();
        assert!(
            matches!(e, MpaError::Silent { awaited: "Reply", waited } if waited == cfg.timeout),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "no MPA Reply from the peer within 0.1 s: it accepted the TCP connection but never answered"
        );
    }
}
