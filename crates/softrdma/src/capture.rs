//! Reading packet captures (pcap and pcapng) and decoding the RoCEv2 and iWARP
//! traffic in them: what `softrdma decode` prints and what the golden tests check.
//!
//! Works on a capture already in memory; the caller does the file I/O.
//! RoCEv2 packets are recognised by their UDP destination port (4791, plus any
//! the caller adds). iWARP is found on TCP streams that begin with an MPA
//! Request or Reply frame; each direction is reassembled and cut into FPDUs.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use etherparse::{EtherType, NetSlice, SlicedPacket, TransportSlice};
use pcap_parser::nom;
use pcap_parser::pcap::{
    parse_pcap_frame, parse_pcap_frame_be, parse_pcap_frame_modified, parse_pcap_header,
};
use pcap_parser::pcapng::Block;
use pcap_parser::{PcapBlockOwned, PcapError, PcapNGSlice};
use softrdma_wire::{self as wire, mad, mpa, packet, rdmap};

/// Why a capture cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptureError {
    /// Neither a pcap nor a pcapng file.
    #[error("not a pcap or pcapng capture (unknown magic number {0:#010x})")]
    NotACapture(u32),
    /// The file is shorter than its header.
    #[error("not a capture: the file is only {0} bytes long")]
    TooShort(usize),
    /// The file ends in the middle of a record.
    #[error("capture truncated: frame {frame} is incomplete (the file ends inside it)")]
    Truncated {
        /// Number of the incomplete frame.
        frame: u64,
    },
    /// A record that cannot be parsed.
    #[error("malformed capture before frame {frame}: {reason}")]
    Malformed {
        /// Number the next frame would have had.
        frame: u64,
        /// What is wrong.
        reason: String,
    },
}

/// One captured frame.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// 1-based number, as tshark counts.
    pub number: u64,
    /// Seconds since the Unix epoch.
    pub time: f64,
    /// pcap link type of the data.
    pub linktype: i32,
    /// The captured bytes.
    pub data: &'a [u8],
    /// Length on the wire (more than `data.len()` when the capture cut it).
    pub original_len: u32,
}

/// Iterates over the frames of a pcap or pcapng capture held in memory.
#[derive(Debug)]
pub struct Frames<'a> {
    inner: FramesInner<'a>,
    number: u64,
    done: bool,
}

enum FramesInner<'a> {
    Legacy {
        rest: &'a [u8],
        big_endian: bool,
        modified: bool,
        nanos: bool,
        linktype: i32,
    },
    Ng {
        blocks: PcapNGSlice<'a>,
        // (link type, timestamp units per second, offset) per interface
        interfaces: Vec<(i32, u64, i64)>,
        /// What ends the well-framed blocks `blocks` holds, if not the file's end.
        stop: Option<NgStop>,
    },
}

/// Why the blocks of a pcapng file stop before its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NgStop {
    /// The last block runs past the end of the file.
    Truncated,
    /// The block at this byte declares a length no block can have.
    BadLength { at: usize, len: u32 },
    /// The section header at this byte has no byte-order magic.
    BadByteOrder { at: usize },
}

const NG_SECTION_HEADER: u32 = 0x0a0d_0d0a;

/// How many leading bytes of a pcapng file are whole blocks of sane lengths,
/// and what stops them. pcap-parser 0.17 takes a block's length less 12
/// unchecked (a panic with overflow checks, a wrapped length without), so it
/// is given only blocks that passed this.
fn ng_framing(file: &[u8]) -> (usize, Option<NgStop>) {
    let u32_at = |at: usize, big: bool| {
        let b = [file[at], file[at + 1], file[at + 2], file[at + 3]];
        if big {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    };
    let (mut at, mut big) = (0, false);
    while at < file.len() {
        let left = file.len() - at;
        if left < 12 {
            return (at, Some(NgStop::Truncated));
        }
        if u32_at(at, false) == NG_SECTION_HEADER {
            // The section's byte order, from its header's magic.
            big = match u32_at(at + 8, false) {
                0x1a2b_3c4d => false,
                0x4d3c_2b1a => true,
                _ => return (at, Some(NgStop::BadByteOrder { at })),
            };
        }
        let len = u32_at(at + 4, big);
        if len < 12 || !len.is_multiple_of(4) {
            return (at, Some(NgStop::BadLength { at, len }));
        }
        if len as usize > left {
            return (at, Some(NgStop::Truncated));
        }
        at += len as usize;
    }
    (at, None)
}

impl fmt::Debug for FramesInner<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FramesInner::Legacy { linktype, .. } => write!(f, "pcap, link type {linktype}"),
            FramesInner::Ng { interfaces, .. } => {
                write!(f, "pcapng, {} interfaces", interfaces.len())
            }
        }
    }
}

/// Opens a capture held in memory.
pub fn frames(file: &[u8]) -> Result<Frames<'_>, CaptureError> {
    if file.len() < 4 {
        return Err(CaptureError::TooShort(file.len()));
    }
    let magic = u32::from_le_bytes([file[0], file[1], file[2], file[3]]);
    let inner = if magic == NG_SECTION_HEADER {
        let (whole, stop) = ng_framing(file);
        if whole == 0 {
            return Err(match stop {
                Some(NgStop::Truncated) | None => CaptureError::TooShort(file.len()),
                Some(s) => s.into_error(1),
            });
        }
        let blocks =
            PcapNGSlice::from_slice(&file[..whole]).map_err(|e| CaptureError::Malformed {
                frame: 1,
                reason: format!("bad pcapng section header: {e:?}"),
            })?;
        FramesInner::Ng {
            blocks,
            interfaces: Vec::new(),
            stop,
        }
    } else {
        let (rest, h) = parse_pcap_header(file).map_err(|e| match e {
            nom::Err::Incomplete(_) => CaptureError::TooShort(file.len()),
            _ => CaptureError::NotACapture(magic),
        })?;
        FramesInner::Legacy {
            rest,
            big_endian: h.is_bigendian(),
            modified: h.is_modified_format(),
            nanos: h.is_nanosecond_precision(),
            linktype: h.network.0,
        }
    };
    Ok(Frames {
        inner,
        number: 0,
        done: false,
    })
}

impl<'a> Iterator for Frames<'a> {
    type Item = Result<Frame<'a>, CaptureError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let r = self.next_frame();
        if !matches!(r, Some(Ok(_))) {
            self.done = true;
        }
        r
    }
}

impl<'a> Frames<'a> {
    fn next_frame(&mut self) -> Option<Result<Frame<'a>, CaptureError>> {
        let number = self.number + 1;
        match &mut self.inner {
            FramesInner::Legacy {
                rest,
                big_endian,
                modified,
                nanos,
                linktype,
            } => {
                if rest.is_empty() {
                    return None;
                }
                let parsed = if *modified {
                    parse_pcap_frame_modified(rest)
                } else if *big_endian {
                    parse_pcap_frame_be(rest)
                } else {
                    parse_pcap_frame(rest)
                };
                match parsed {
                    Ok((r, b)) => {
                        let scale = if *nanos { 1e-9 } else { 1e-6 };
                        let frame = Frame {
                            number,
                            time: f64::from(b.ts_sec) + f64::from(b.ts_usec) * scale,
                            linktype: *linktype,
                            data: b.data,
                            original_len: b.origlen,
                        };
                        *rest = r;
                        self.number = number;
                        Some(Ok(frame))
                    }
                    Err(nom::Err::Incomplete(_)) => {
                        Some(Err(CaptureError::Truncated { frame: number }))
                    }
                    Err(e) => Some(Err(CaptureError::Malformed {
                        frame: number,
                        reason: format!("{e:?}"),
                    })),
                }
            }
            FramesInner::Ng {
                blocks,
                interfaces,
                stop,
            } => loop {
                let Some(next) = blocks.next() else {
                    return stop.take().map(|s| Err(s.into_error(number)));
                };
                let block = match next {
                    Ok(b) => b,
                    Err(nom::Err::Incomplete(_))
                    | Err(nom::Err::Error(PcapError::Incomplete(_)))
                    | Err(nom::Err::Failure(PcapError::Incomplete(_))) => {
                        return Some(Err(CaptureError::Truncated { frame: number }));
                    }
                    Err(e) => {
                        return Some(Err(CaptureError::Malformed {
                            frame: number,
                            reason: format!("{e:?}"),
                        }));
                    }
                };
                let PcapBlockOwned::NG(block) = block else {
                    continue;
                };
                match block {
                    Block::SectionHeader(_) => interfaces.clear(),
                    Block::InterfaceDescription(idb) => {
                        let units = if idb.if_tsresol & 0x80 != 0 {
                            1u64.checked_shl(u32::from(idb.if_tsresol & 0x7f))
                        } else {
                            10u64.checked_pow(u32::from(idb.if_tsresol))
                        };
                        interfaces.push((
                            idb.linktype.0,
                            units.unwrap_or(1_000_000),
                            idb.if_tsoffset,
                        ));
                    }
                    Block::EnhancedPacket(epb) => {
                        let Some(&(linktype, units, ts_off)) = interfaces.get(epb.if_id as usize)
                        else {
                            return Some(Err(CaptureError::Malformed {
                                frame: number,
                                reason: format!("packet on undeclared interface {}", epb.if_id),
                            }));
                        };
                        let ts = (u64::from(epb.ts_high) << 32) | u64::from(epb.ts_low);
                        self.number = number;
                        return Some(Ok(Frame {
                            number,
                            time: ts as f64 / units as f64 + ts_off as f64,
                            linktype,
                            data: &epb.data[..(epb.caplen as usize).min(epb.data.len())],
                            original_len: epb.origlen,
                        }));
                    }
                    Block::SimplePacket(spb) => {
                        let linktype = interfaces.first().map_or(1, |i| i.0);
                        self.number = number;
                        return Some(Ok(Frame {
                            number,
                            time: 0.0,
                            linktype,
                            data: &spb.data[..(spb.origlen as usize).min(spb.data.len())],
                            original_len: spb.origlen,
                        }));
                    }
                    _ => {}
                }
            },
        }
    }
}

impl NgStop {
    /// The error for frame `frame`, the first the stop keeps from being read.
    fn into_error(self, frame: u64) -> CaptureError {
        let reason = match self {
            NgStop::Truncated => return CaptureError::Truncated { frame },
            NgStop::BadLength { at, len } => format!(
                "the pcapng block at byte {at} declares {len} bytes (at least 12, a multiple of 4)"
            ),
            NgStop::BadByteOrder { at } => {
                format!("the pcapng section header at byte {at} has no byte-order magic")
            }
        };
        CaptureError::Malformed { frame, reason }
    }
}

/// The two ends of a packet or stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoints {
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
}

impl Endpoints {
    fn reversed(self) -> Endpoints {
        Endpoints {
            src: self.dst,
            dst: self.src,
        }
    }
}

impl fmt::Display for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.src, self.dst)
    }
}

/// A RoCEv2 packet found in a frame.
#[derive(Debug, Clone)]
pub struct RocePacket<'a> {
    /// Frame number.
    pub frame: u64,
    /// Capture time (seconds since the epoch).
    pub time: f64,
    /// Addresses and UDP ports.
    pub endpoints: Endpoints,
    /// The IP header as captured.
    pub ip_header: &'a [u8],
    /// The UDP header as captured.
    pub udp_header: &'a [u8],
    /// The InfiniBand packet, BTH through ICRC.
    pub ib: &'a [u8],
    /// The decoded headers, or why they do not decode.
    pub repr: Result<packet::Repr, wire::Error>,
    /// The ICRC check.
    pub icrc: Result<(), wire::Error>,
    /// The MAD header of a packet to QP1 (IB CM).
    pub mad: Option<Result<mad::Repr, wire::Error>>,
}

/// How an FPDU's CRC field fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrcCheck {
    /// CRC32c negotiated and correct.
    Good,
    /// CRC32c negotiated and wrong.
    Bad {
        /// What the FPDU should carry.
        computed: u32,
        /// What it carries.
        carried: u32,
    },
    /// CRC not negotiated: the field (normally zero) is not checked.
    Off {
        /// The field's value.
        field: u32,
    },
}

/// What an iWARP record holds.
#[derive(Debug, Clone)]
pub enum IwarpPdu<'a> {
    /// An MPA Request or Reply frame.
    Start {
        /// The whole frame.
        bytes: &'a [u8],
        /// Its fields.
        repr: Result<mpa::StartFrameRepr, wire::Error>,
    },
    /// An FPDU.
    Fpdu {
        /// The FPDU with any markers removed.
        bytes: &'a [u8],
        /// The RDMAP message segment it carries.
        message: Result<rdmap::MessageRepr, wire::Error>,
        /// Its CRC.
        crc: CrcCheck,
        /// Markers removed from it.
        markers: usize,
    },
}

/// An iWARP protocol data unit found on a TCP stream.
#[derive(Debug, Clone)]
pub struct IwarpRecord<'a> {
    /// The frame in which the unit's last byte arrived.
    pub frame: u64,
    /// Its capture time.
    pub time: f64,
    /// Direction.
    pub endpoints: Endpoints,
    /// The unit.
    pub pdu: IwarpPdu<'a>,
}

/// Something wrong with a frame or stream as a whole.
#[derive(Debug, Clone)]
pub struct Problem {
    /// Frame number.
    pub frame: u64,
    /// Capture time.
    pub time: f64,
    /// Addresses, when known.
    pub endpoints: Option<Endpoints>,
    /// What is wrong.
    pub message: String,
}

/// One decoded unit.
#[derive(Debug, Clone)]
pub enum Record<'a> {
    /// A RoCEv2 packet.
    Roce(RocePacket<'a>),
    /// An iWARP start frame or FPDU.
    Iwarp(IwarpRecord<'a>),
    /// A problem.
    Problem(Problem),
}

impl Record<'_> {
    /// The frame number.
    pub fn frame(&self) -> u64 {
        match self {
            Record::Roce(r) => r.frame,
            Record::Iwarp(r) => r.frame,
            Record::Problem(p) => p.frame,
        }
    }

    /// The capture time.
    pub fn time(&self) -> f64 {
        match self {
            Record::Roce(r) => r.time,
            Record::Iwarp(r) => r.time,
            Record::Problem(p) => p.time,
        }
    }

    /// Errors in the record: decode failures and failed checks.
    pub fn errors(&self) -> Vec<String> {
        let mut e = Vec::new();
        match self {
            Record::Roce(r) => {
                if let Err(x) = &r.repr {
                    e.push(x.to_string());
                }
                if let Err(x) = &r.icrc {
                    e.push(x.to_string());
                }
                if let Some(Err(x)) = &r.mad {
                    e.push(format!("MAD: {x}"));
                }
            }
            Record::Iwarp(r) => match &r.pdu {
                IwarpPdu::Start { repr, .. } => {
                    if let Err(x) = repr {
                        e.push(x.to_string());
                    }
                }
                IwarpPdu::Fpdu { message, crc, .. } => {
                    if let Err(x) = message {
                        e.push(x.to_string());
                    }
                    if let CrcCheck::Bad { computed, carried } = crc {
                        e.push(
                            wire::Error::BadCrc32c {
                                computed: *computed,
                                carried: *carried,
                            }
                            .to_string(),
                        );
                    }
                }
            },
            Record::Problem(p) => e.push(p.message.clone()),
        }
        e
    }

    /// The record's description on one line (without time and addresses).
    pub fn describe(&self) -> String {
        match self {
            Record::Roce(r) => {
                let mut s = match &r.repr {
                    Ok(p) => p.to_string(),
                    Err(_) => format!("RoCEv2 undecodable ({} bytes)", r.ib.len()),
                };
                if let Some(Ok(m)) = &r.mad {
                    s.push_str(&format!(" | {m}"));
                }
                s
            }
            Record::Iwarp(r) => match &r.pdu {
                IwarpPdu::Start { repr, bytes } => match repr {
                    Ok(s) => s.to_string(),
                    Err(_) => format!("MPA start frame undecodable ({} bytes)", bytes.len()),
                },
                IwarpPdu::Fpdu {
                    message,
                    bytes,
                    crc,
                    markers,
                } => {
                    let mut s = match message {
                        Ok(m) => m.to_string(),
                        Err(_) => format!("FPDU undecodable ({} bytes)", bytes.len()),
                    };
                    if *crc == CrcCheck::Good {
                        s.push_str(" | CRC32c ok");
                    }
                    if *markers != 0 {
                        s.push_str(&format!(" | {markers} markers"));
                    }
                    s
                }
            },
            Record::Problem(p) => p.message.clone(),
        }
    }

    /// The addresses.
    pub fn endpoints(&self) -> Option<Endpoints> {
        match self {
            Record::Roce(r) => Some(r.endpoints),
            Record::Iwarp(r) => Some(r.endpoints),
            Record::Problem(p) => p.endpoints,
        }
    }
}

/// Decodes RoCEv2 packets in a frame.
fn decode_roce<'a>(
    frame: &Frame<'_>,
    endpoints: Endpoints,
    ip_header: &'a [u8],
    udp_header: &'a [u8],
    ib: &'a [u8],
) -> RocePacket<'a> {
    let p = packet::Packet::new_checked(ib);
    let repr = p.and_then(|p| packet::Repr::parse(&p));
    let icrc = wire::icrc::verify(ip_header, udp_header, ib);
    let mad = match &repr {
        Ok(r) if r.bth.dest_qp == 1 && r.deth.is_some() => {
            let p = packet::Packet::new_unchecked(ib);
            let payload = p.payload();
            Some(mad::Header::new_checked(payload).and_then(|h| mad::Repr::parse(&h)))
        }
        _ => None,
    };
    RocePacket {
        frame: frame.number,
        time: frame.time,
        endpoints,
        ip_header,
        udp_header,
        ib,
        repr,
        icrc,
        mad,
    }
}

/// Which end of an MPA connection a stream direction belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Initiator,
    Responder,
}

#[derive(Debug)]
enum StreamState {
    /// Waiting for the first bytes to tell whether this is MPA.
    Start,
    /// Not MPA: ignored.
    Ignored,
    /// Cutting FPDUs.
    Fpdus { role: Role, full_op_pos: usize },
    /// Framing lost; nothing more is decoded.
    Failed,
}

#[derive(Debug)]
struct Stream {
    next_seq: u32,
    /// Bytes placed so far: the stream offset of `next_seq`, which, unlike
    /// the sequence number, does not wrap.
    placed: u64,
    /// Contiguous bytes not yet cut into units.
    buf: Vec<u8>,
    /// Segments that arrived ahead of a gap, by stream offset.
    ahead: BTreeMap<u64, Vec<u8>>,
    ahead_bytes: usize,
    state: StreamState,
}

impl Stream {
    /// Appends the next contiguous bytes.
    fn place(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        self.next_seq = self.next_seq.wrapping_add(bytes.len() as u32);
        self.placed += bytes.len() as u64;
    }
}

/// The two MPA start frames of a connection, keyed by the initiator's direction.
#[derive(Debug, Default, Clone, Copy)]
struct Negotiation {
    request: Option<mpa::StartFrameRepr>,
    reply: Option<mpa::StartFrameRepr>,
}

impl Negotiation {
    fn crc(&self) -> bool {
        self.request.is_some_and(|r| r.crc) || self.reply.is_some_and(|r| r.crc)
    }
    /// Markers in the FPDUs this role sends: the peer's start frame asks for them.
    fn markers(&self, sender: Role) -> bool {
        match sender {
            Role::Initiator => self.reply.is_some_and(|r| r.markers),
            Role::Responder => self.request.is_some_and(|r| r.markers),
        }
    }
}

/// Most bytes held ahead of a gap in one TCP direction.
const MAX_AHEAD: usize = 64 << 20;

/// Decodes the frames of a capture, in order.
#[derive(Debug)]
pub struct Decoder {
    roce_ports: Vec<u16>,
    streams: HashMap<Endpoints, Stream>,
    negotiations: HashMap<Endpoints, Negotiation>,
    scratch: Vec<u8>,
    /// Link types met that this decoder cannot read, each reported once.
    unknown_linktypes: Vec<i32>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new()
    }
}

impl Decoder {
    /// A decoder that takes UDP port 4791 as RoCEv2.
    pub fn new() -> Decoder {
        Decoder {
            roce_ports: vec![wire::ROCEV2_UDP_PORT],
            streams: HashMap::new(),
            negotiations: HashMap::new(),
            scratch: Vec::new(),
            unknown_linktypes: Vec::new(),
        }
    }

    /// Also takes UDP datagrams to `port` as RoCEv2 (softrdma devices on other ports).
    pub fn add_roce_port(&mut self, port: u16) {
        if !self.roce_ports.contains(&port) {
            self.roce_ports.push(port);
        }
    }

    /// Decodes one frame, handing each unit found to `emit`.
    pub fn push(&mut self, frame: &Frame<'_>, emit: &mut dyn FnMut(Record<'_>)) {
        let data = frame.data;
        let sliced = match frame.linktype {
            1 => SlicedPacket::from_ethernet(data),
            113 => SlicedPacket::from_linux_sll(data),
            // Linux SLL2: protocol type in the first two bytes of a 20-byte header.
            276 if data.len() >= 20 => SlicedPacket::from_ether_type(
                EtherType(u16::from_be_bytes([data[0], data[1]])),
                &data[20..],
            ),
            // BSD loopback: a 4-byte address family, then IP.
            0 if data.len() >= 4 => SlicedPacket::from_ip(&data[4..]),
            12 | 14 | 101 | 228 | 229 => SlicedPacket::from_ip(data),
            0 | 276 => return,
            other => {
                // Said once, not per frame: the whole capture is unreadable.
                if !self.unknown_linktypes.contains(&other) {
                    self.unknown_linktypes.push(other);
                    emit(Record::Problem(Problem {
                        frame: frame.number,
                        time: frame.time,
                        endpoints: None,
                        message: format!(
                            "link type {other} is not decoded (Ethernet, Linux cooked \
                             capture, BSD loopback and raw IP are): its frames are skipped"
                        ),
                    }));
                }
                return;
            }
        };
        let Ok(sliced) = sliced else {
            if (frame.original_len as usize) > data.len() {
                emit(Record::Problem(Problem {
                    frame: frame.number,
                    time: frame.time,
                    endpoints: None,
                    message: format!(
                        "frame cut by the capture's snap length ({} of {} bytes): not decoded",
                        data.len(),
                        frame.original_len
                    ),
                }));
            }
            return;
        };
        let (ip_header, src_ip, dst_ip, fragmented): (&[u8], IpAddr, IpAddr, bool) =
            match &sliced.net {
                Some(NetSlice::Ipv4(v4)) => {
                    let h = v4.header();
                    let (s, d) = (h.source_addr(), h.destination_addr());
                    (h.slice(), s.into(), d.into(), v4.is_payload_fragmented())
                }
                Some(NetSlice::Ipv6(v6)) => {
                    let h = v6.header();
                    (
                        h.slice(),
                        h.source_addr().into(),
                        h.destination_addr().into(),
                        v6.is_payload_fragmented(),
                    )
                }
                _ => return,
            };
        if fragmented {
            return;
        }
        match &sliced.transport {
            Some(TransportSlice::Udp(udp)) if self.roce_ports.contains(&udp.destination_port()) => {
                let endpoints = Endpoints {
                    src: SocketAddr::new(src_ip, udp.source_port()),
                    dst: SocketAddr::new(dst_ip, udp.destination_port()),
                };
                let r = decode_roce(
                    frame,
                    endpoints,
                    ip_header,
                    udp.header_slice(),
                    udp.payload(),
                );
                emit(Record::Roce(r));
            }
            Some(TransportSlice::Tcp(tcp)) => {
                let endpoints = Endpoints {
                    src: SocketAddr::new(src_ip, tcp.source_port()),
                    dst: SocketAddr::new(dst_ip, tcp.destination_port()),
                };
                self.tcp_segment(
                    frame,
                    endpoints,
                    tcp.sequence_number(),
                    tcp.syn(),
                    tcp.payload(),
                    emit,
                );
            }
            _ => {}
        }
    }

    /// Reports what is left over at the end of the capture: data held ahead of
    /// a gap that never filled.
    pub fn finish(&mut self, last_frame: u64, emit: &mut dyn FnMut(Record<'_>)) {
        let mut gaps: Vec<_> = self
            .streams
            .iter()
            .filter(|(_, s)| matches!(s.state, StreamState::Fpdus { .. }) && s.ahead_bytes != 0)
            .map(|(e, s)| (*e, s.ahead_bytes))
            .collect();
        gaps.sort_by_key(|(e, _)| (e.src, e.dst));
        for (endpoints, bytes) in gaps {
            emit(Record::Problem(Problem {
                frame: last_frame,
                time: 0.0,
                endpoints: Some(endpoints),
                message: format!(
                    "iWARP stream has a gap that never filled: {bytes} bytes after it not decoded"
                ),
            }));
        }
    }

    fn tcp_segment(
        &mut self,
        frame: &Frame<'_>,
        endpoints: Endpoints,
        seq: u32,
        syn: bool,
        payload: &[u8],
        emit: &mut dyn FnMut(Record<'_>),
    ) {
        let first_seq = if syn { seq.wrapping_add(1) } else { seq };
        let stream = self.streams.entry(endpoints).or_insert_with(|| Stream {
            next_seq: first_seq,
            placed: 0,
            buf: Vec::new(),
            ahead: BTreeMap::new(),
            ahead_bytes: 0,
            state: StreamState::Start,
        });
        if matches!(stream.state, StreamState::Ignored | StreamState::Failed) || payload.is_empty()
        {
            return;
        }
        // Place the segment: trim what was seen, hold what is ahead of a gap.
        let rel = seq.wrapping_sub(stream.next_seq) as i32;
        if rel > 0 {
            if stream.ahead_bytes + payload.len() > MAX_AHEAD {
                stream.state = StreamState::Failed;
                emit(Record::Problem(Problem {
                    frame: frame.number,
                    time: frame.time,
                    endpoints: Some(endpoints),
                    message: "TCP segments missing from the capture: stream no longer decoded"
                        .into(),
                }));
                return;
            }
            // A retransmission of a held segment is counted once; a longer
            // one replaces it, so that its extra bytes are not lost.
            match stream.ahead.entry(stream.placed + rel as u64) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    stream.ahead_bytes += payload.len();
                    v.insert(payload.to_vec());
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    if payload.len() > o.get().len() {
                        stream.ahead_bytes += payload.len() - o.get().len();
                        *o.get_mut() = payload.to_vec();
                    }
                }
            }
            return;
        }
        let skip = rel.unsigned_abs() as usize;
        if skip < payload.len() {
            stream.place(&payload[skip..]);
        }
        // Segments that the new bytes made contiguous, by stream offset (by
        // sequence number, segments held on both sides of its wrap came in
        // the wrong order and the stream stalled).
        while let Some(entry) = stream.ahead.first_entry() {
            let at = *entry.key();
            if at > stream.placed {
                break;
            }
            let seg = entry.remove();
            stream.ahead_bytes -= seg.len();
            let skip = (stream.placed - at) as usize;
            if skip < seg.len() {
                stream.place(&seg[skip..]);
            }
        }
        self.cut_units(frame, endpoints, emit);
    }

    fn cut_units(
        &mut self,
        frame: &Frame<'_>,
        endpoints: Endpoints,
        emit: &mut dyn FnMut(Record<'_>),
    ) {
        let stream = self.streams.get_mut(&endpoints).expect("stream exists");
        let mut consumed = 0;
        loop {
            let buf = &stream.buf[consumed..];
            match stream.state {
                StreamState::Ignored | StreamState::Failed => {
                    consumed = stream.buf.len();
                    break;
                }
                StreamState::Start => {
                    let n = buf.len().min(16);
                    let role = if buf[..n] == mpa::REQUEST_KEY[..n] {
                        Role::Initiator
                    } else if buf[..n] == mpa::REPLY_KEY[..n] {
                        Role::Responder
                    } else {
                        stream.state = StreamState::Ignored;
                        continue;
                    };
                    let Ok(f) = mpa::StartFrame::new_checked(buf) else {
                        if buf.len() >= mpa::START_FRAME_HEADER_LEN
                            && usize::from(mpa::StartFrame::new_unchecked(buf).private_data_len())
                                > mpa::MAX_PRIVATE_DATA
                        {
                            emit(Record::Iwarp(IwarpRecord {
                                frame: frame.number,
                                time: frame.time,
                                endpoints,
                                pdu: IwarpPdu::Start {
                                    bytes: buf,
                                    repr: mpa::StartFrameRepr::parse(
                                        &mpa::StartFrame::new_unchecked(buf),
                                    ),
                                },
                            }));
                            stream.state = StreamState::Failed;
                            continue;
                        }
                        break; // wait for the rest of the frame
                    };
                    let len = f.frame_len();
                    let repr = mpa::StartFrameRepr::parse(&f);
                    let key = match role {
                        Role::Initiator => endpoints,
                        Role::Responder => endpoints.reversed(),
                    };
                    let neg = self.negotiations.entry(key).or_default();
                    if let Ok(r) = repr {
                        match role {
                            Role::Initiator => neg.request = Some(r),
                            Role::Responder => neg.reply = Some(r),
                        }
                    }
                    let failed = repr.is_err();
                    emit(Record::Iwarp(IwarpRecord {
                        frame: frame.number,
                        time: frame.time,
                        endpoints,
                        pdu: IwarpPdu::Start {
                            bytes: &buf[..len],
                            repr,
                        },
                    }));
                    consumed += len;
                    stream.state = if failed {
                        StreamState::Failed
                    } else {
                        StreamState::Fpdus {
                            role,
                            full_op_pos: 0,
                        }
                    };
                }
                StreamState::Fpdus { role, full_op_pos } => {
                    let key = match role {
                        Role::Initiator => endpoints,
                        Role::Responder => endpoints.reversed(),
                    };
                    let neg = self.negotiations.get(&key).copied().unwrap_or_default();
                    let (plain, used, markers, marked_crc) = if neg.markers(role) {
                        self.scratch.resize(mpa::fpdu_len(usize::from(u16::MAX)), 0);
                        match mpa::unmark(buf, full_op_pos, &mut self.scratch) {
                            Ok(u) => (
                                &self.scratch[..u.written],
                                u.consumed,
                                u.markers,
                                Some(u.computed_crc),
                            ),
                            Err(wire::Error::Truncated {
                                header: "marked FPDU",
                                ..
                            }) => {
                                break;
                            }
                            Err(e) => {
                                emit(Record::Problem(Problem {
                                    frame: frame.number,
                                    time: frame.time,
                                    endpoints: Some(endpoints),
                                    message: format!("MPA framing lost: {e}"),
                                }));
                                stream.state = StreamState::Failed;
                                continue;
                            }
                        }
                    } else {
                        let Ok(f) = mpa::Fpdu::new_checked(buf) else {
                            break; // wait for the rest of the FPDU
                        };
                        let n = f.total_len();
                        (&buf[..n], n, 0, None)
                    };
                    let f = mpa::Fpdu::new_unchecked(plain);
                    let crc = if neg.crc() {
                        let computed = marked_crc.unwrap_or_else(|| f.compute_crc());
                        if computed == f.crc() {
                            CrcCheck::Good
                        } else {
                            CrcCheck::Bad {
                                computed,
                                carried: f.crc(),
                            }
                        }
                    } else {
                        CrcCheck::Off { field: f.crc() }
                    };
                    let message = rdmap::Message::new_checked(f.ulpdu())
                        .and_then(|m| rdmap::MessageRepr::parse(&m));
                    emit(Record::Iwarp(IwarpRecord {
                        frame: frame.number,
                        time: frame.time,
                        endpoints,
                        pdu: IwarpPdu::Fpdu {
                            bytes: plain,
                            message,
                            crc,
                            markers,
                        },
                    }));
                    consumed += used;
                    stream.state = StreamState::Fpdus {
                        role,
                        full_op_pos: full_op_pos + used,
                    };
                }
            }
            if consumed == stream.buf.len() {
                break;
            }
        }
        stream.buf.drain(..consumed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PCAP: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/rxe_rc_pingpong.pcap"
    ));

    /// `v` in the section's byte order.
    fn u32b(big: bool, v: u32) -> [u8; 4] {
        if big {
            v.to_be_bytes()
        } else {
            v.to_le_bytes()
        }
    }

    fn u16b(big: bool, v: u16) -> [u8; 2] {
        if big {
            v.to_be_bytes()
        } else {
            v.to_le_bytes()
        }
    }

    /// A pcapng block: type, length, body padded to 4 bytes, length again.
    fn block(out: &mut Vec<u8>, big: bool, kind: u32, body: &[u8]) {
        let padded = body.len().next_multiple_of(4);
        let len = 12 + padded as u32;
        out.extend_from_slice(&u32b(big, kind));
        out.extend_from_slice(&u32b(big, len));
        out.extend_from_slice(body);
        out.resize(out.len() + padded - body.len(), 0);
        out.extend_from_slice(&u32b(big, len));
    }

    /// The legacy capture's frames as pcapng (section header, one Ethernet
    /// interface in microseconds, an enhanced packet block per frame).
    fn as_pcapng(big: bool) -> Vec<u8> {
        let u16b = |v: u16| u16b(big, v);
        let u32b = |v: u32| u32b(big, v);
        let mut out = Vec::new();
        let mut shb = u32b(0x1a2b_3c4d).to_vec();
        shb.extend_from_slice(&u16b(1));
        shb.extend_from_slice(&u16b(0));
        shb.extend_from_slice(&[0xff; 8]);
        block(&mut out, big, NG_SECTION_HEADER, &shb);
        let mut idb = u16b(1).to_vec();
        idb.extend_from_slice(&u16b(0));
        idb.extend_from_slice(&u32b(65535));
        block(&mut out, big, 1, &idb);
        for f in frames(PCAP).unwrap() {
            let f = f.unwrap();
            let us = (f.time * 1e6).round() as u64;
            let mut epb = u32b(0).to_vec();
            epb.extend_from_slice(&u32b((us >> 32) as u32));
            epb.extend_from_slice(&u32b(us as u32));
            epb.extend_from_slice(&u32b(f.data.len() as u32));
            epb.extend_from_slice(&u32b(f.original_len));
            epb.extend_from_slice(f.data);
            block(&mut out, big, 6, &epb);
        }
        out
    }

    #[test]
    fn pcapng_in_either_byte_order_gives_the_pcap_frames() {
        let want: Vec<_> = frames(PCAP).unwrap().map(|f| f.unwrap()).collect();
        assert!(want.len() > 2);
        for big in [false, true] {
            let ng = as_pcapng(big);
            let got: Vec<_> = frames(&ng).unwrap().map(|f| f.unwrap()).collect();
            assert_eq!(got.len(), want.len(), "big endian: {big}");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(
                    (g.number, g.data, g.linktype),
                    (w.number, w.data, w.linktype)
                );
                assert!((g.time - w.time).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn a_pcapng_block_cut_short_is_a_truncated_frame_after_the_whole_ones() {
        let ng = as_pcapng(false);
        let n = frames(PCAP).unwrap().count() as u64;
        let got: Vec<_> = frames(&ng[..ng.len() - 10]).unwrap().collect();
        assert_eq!(got.len() as u64, n);
        assert!(got[..got.len() - 1].iter().all(|f| f.is_ok()));
        assert_eq!(
            got.last().unwrap().as_ref().unwrap_err(),
            &CaptureError::Truncated { frame: n }
        );
    }

    #[test]
    fn a_pcapng_block_shorter_than_its_frame_is_malformed_not_a_panic() {
        // Found by the capture fuzzer: pcap-parser subtracted 12 from the
        // second block's length of 6 (a panic with overflow checks on).
        let crash = [
            0x0a, 0x0d, 0x0d, 0x0a, 0, 0, 0, 0x1c, 0x1a, 0x2b, 0x3c, 0x4d, 0xa1, 0xb2, 0x39, 0x4d,
            0xd4, 0xc3, 0xb2, 0x02, 0, 0, 0x54, 0, 0, 0, 0, 0, 0x80, 0, 0, 1, 0, 0, 0, 6, 0, 0, 0,
            0,
        ];
        let got: Vec<_> = frames(&crash).unwrap().collect();
        assert_eq!(got.len(), 1);
        let Err(CaptureError::Malformed { frame: 1, reason }) = &got[0] else {
            panic!("{got:?}");
        };
        assert!(reason.contains("at byte 28 declares 6 bytes"), "{reason}");
        // The same length in the first block.
        let mut first = crash[..12].to_vec();
        first[7] = 6;
        assert!(matches!(
            frames(&first).unwrap_err(),
            CaptureError::Malformed { frame: 1, .. }
        ));
        // A section header with no byte-order magic.
        let mut ng = as_pcapng(false);
        ng[8..12].copy_from_slice(&[1, 2, 3, 4]);
        let e = frames(&ng).unwrap_err().to_string();
        assert!(e.contains("no byte-order magic"), "{e}");
    }
}
