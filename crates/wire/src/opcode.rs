//! The InfiniBand transport opcodes of RC, UC and UD (and the RoCEv2 CNP), as
//! data: which extension headers each carries, in wire order, whether it has
//! payload, and where it sits in a message. Modelled on the kernel's
//! `rxe_opcode.c` table and IBTA vol. 1 section 9.2.

use core::fmt;

/// An 8-bit BTH opcode: 3 bits of transport class, 5 bits of operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Opcode(pub u8);

/// Transport service class, the opcode's top three bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Reliable connected (0b000).
    Rc,
    /// Unreliable connected (0b001).
    Uc,
    /// Unreliable datagram (0b011).
    Ud,
    /// RoCEv2 congestion notification packet (0x81).
    Cnp,
}

/// What an opcode does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// SEND (with or without immediate or invalidate).
    Send,
    /// RDMA WRITE (with or without immediate).
    RdmaWrite,
    /// RDMA READ request.
    ReadRequest,
    /// RDMA READ response.
    ReadResponse,
    /// ACK or NAK.
    Acknowledge,
    /// Response to an atomic.
    AtomicAcknowledge,
    /// Atomic compare and swap.
    CompareSwap,
    /// Atomic fetch and add.
    FetchAdd,
    /// Congestion notification.
    CongestionNotification,
}

/// Where a packet sits in a multi-packet message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// First of several.
    First,
    /// Neither first nor last.
    Middle,
    /// Last of several.
    Last,
    /// The whole message.
    Only,
}

impl Position {
    /// The packet starts a message.
    pub const fn starts(self) -> bool {
        matches!(self, Position::First | Position::Only)
    }
    /// The packet ends a message.
    pub const fn ends(self) -> bool {
        matches!(self, Position::Last | Position::Only)
    }
}

/// A set of extension headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Headers(u8);

impl Headers {
    /// Datagram extended transport header (8 bytes).
    pub const DETH: Headers = Headers(1 << 0);
    /// RDMA extended transport header (16 bytes).
    pub const RETH: Headers = Headers(1 << 1);
    /// Atomic extended transport header (28 bytes).
    pub const ATOMIC_ETH: Headers = Headers(1 << 2);
    /// ACK extended transport header (4 bytes).
    pub const AETH: Headers = Headers(1 << 3);
    /// Atomic acknowledge extended transport header (8 bytes).
    pub const ATOMIC_ACK_ETH: Headers = Headers(1 << 4);
    /// Immediate data (4 bytes).
    pub const IMM_DT: Headers = Headers(1 << 5);
    /// Invalidate extended transport header (4 bytes).
    pub const IETH: Headers = Headers(1 << 6);
    /// The 16 reserved bytes of a CNP.
    pub const CNP_RESERVED: Headers = Headers(1 << 7);

    /// The empty set.
    pub const NONE: Headers = Headers(0);

    /// Every header of the set, in the order they appear on the wire, with its length.
    pub const WIRE_ORDER: [(Headers, usize); 8] = [
        (Headers::DETH, 8),
        (Headers::RETH, 16),
        (Headers::ATOMIC_ETH, 28),
        (Headers::AETH, 4),
        (Headers::ATOMIC_ACK_ETH, 8),
        (Headers::IMM_DT, 4),
        (Headers::IETH, 4),
        (Headers::CNP_RESERVED, 16),
    ];

    /// The union of two sets.
    pub const fn with(self, other: Headers) -> Headers {
        Headers(self.0 | other.0)
    }

    /// `self` less the headers of `other`.
    pub const fn without(self, other: Headers) -> Headers {
        Headers(self.0 & !other.0)
    }

    /// All of `other` is in `self`.
    pub const fn contains(self, other: Headers) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bytes of all headers in the set.
    pub const fn len(self) -> usize {
        HEADERS_LEN[self.0 as usize] as usize
    }

    /// Bytes of the set's headers, summed one by one (builds [`HEADERS_LEN`]).
    const fn sum_len(self) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < Self::WIRE_ORDER.len() {
            let (h, l) = Self::WIRE_ORDER[i];
            if self.contains(h) {
                n += l;
            }
            i += 1;
        }
        n
    }

    /// The set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Offset of `header` (one header) after the BTH, if the set holds it.
    pub const fn offset_of(self, header: Headers) -> Option<usize> {
        if header.0.count_ones() != 1 || !self.contains(header) {
            return None;
        }
        // The wire order is the order of the bits: what comes before
        // `header` is the set's lower bits.
        Some(Headers(self.0 & (header.0 - 1)).len())
    }
}

/// [`Headers::len`] of every set: looked up per packet, where adding the
/// lengths one by one cost some 140 instructions a packet.
const HEADERS_LEN: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = Headers(i as u8).sum_len() as u8;
        i += 1;
    }
    t
};

/// One row of the opcode table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// The name as the IBTA spells it, e.g. `RDMA_WRITE_FIRST`.
    pub name: &'static str,
    /// Transport class.
    pub transport: Transport,
    /// Operation.
    pub operation: Operation,
    /// Place in the message.
    pub position: Position,
    /// Extension headers after the BTH.
    pub headers: Headers,
    /// The packet may carry payload.
    pub has_payload: bool,
}

impl OpcodeInfo {
    /// BTH plus extension headers, in bytes.
    pub const fn header_len(&self) -> usize {
        crate::bth::HEADER_LEN + self.headers.len()
    }

    /// Sent by a requester (as opposed to a responder's ACK or READ response).
    pub const fn is_request(&self) -> bool {
        !matches!(
            self.operation,
            Operation::ReadResponse | Operation::Acknowledge | Operation::AtomicAcknowledge
        )
    }

    /// The packet carries immediate data.
    pub const fn has_immediate(&self) -> bool {
        self.headers.contains(Headers::IMM_DT)
    }
}

const fn row(
    name: &'static str,
    transport: Transport,
    operation: Operation,
    position: Position,
    headers: Headers,
    has_payload: bool,
) -> Option<OpcodeInfo> {
    Some(OpcodeInfo {
        name,
        transport,
        operation,
        position,
        headers,
        has_payload,
    })
}

use Headers as H;
use Operation as O;
use Position as P;

/// The 32 operation codes shared by RC and UC (UC uses the SEND and WRITE ones).
const fn connected(op: u8, t: Transport) -> Option<OpcodeInfo> {
    let uc = matches!(t, Transport::Uc);
    match op {
        0x00 => row("SEND_FIRST", t, O::Send, P::First, H::NONE, true),
        0x01 => row("SEND_MIDDLE", t, O::Send, P::Middle, H::NONE, true),
        0x02 => row("SEND_LAST", t, O::Send, P::Last, H::NONE, true),
        0x03 => row(
            "SEND_LAST_WITH_IMMEDIATE",
            t,
            O::Send,
            P::Last,
            H::IMM_DT,
            true,
        ),
        0x04 => row("SEND_ONLY", t, O::Send, P::Only, H::NONE, true),
        0x05 => row(
            "SEND_ONLY_WITH_IMMEDIATE",
            t,
            O::Send,
            P::Only,
            H::IMM_DT,
            true,
        ),
        0x06 => row("RDMA_WRITE_FIRST", t, O::RdmaWrite, P::First, H::RETH, true),
        0x07 => row(
            "RDMA_WRITE_MIDDLE",
            t,
            O::RdmaWrite,
            P::Middle,
            H::NONE,
            true,
        ),
        0x08 => row("RDMA_WRITE_LAST", t, O::RdmaWrite, P::Last, H::NONE, true),
        0x09 => row(
            "RDMA_WRITE_LAST_WITH_IMMEDIATE",
            t,
            O::RdmaWrite,
            P::Last,
            H::IMM_DT,
            true,
        ),
        0x0a => row("RDMA_WRITE_ONLY", t, O::RdmaWrite, P::Only, H::RETH, true),
        0x0b => row(
            "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
            t,
            O::RdmaWrite,
            P::Only,
            H::RETH.with(H::IMM_DT),
            true,
        ),
        _ if uc => None,
        0x0c => row(
            "RDMA_READ_REQUEST",
            t,
            O::ReadRequest,
            P::Only,
            H::RETH,
            false,
        ),
        0x0d => row(
            "RDMA_READ_RESPONSE_FIRST",
            t,
            O::ReadResponse,
            P::First,
            H::AETH,
            true,
        ),
        0x0e => row(
            "RDMA_READ_RESPONSE_MIDDLE",
            t,
            O::ReadResponse,
            P::Middle,
            H::NONE,
            true,
        ),
        0x0f => row(
            "RDMA_READ_RESPONSE_LAST",
            t,
            O::ReadResponse,
            P::Last,
            H::AETH,
            true,
        ),
        0x10 => row(
            "RDMA_READ_RESPONSE_ONLY",
            t,
            O::ReadResponse,
            P::Only,
            H::AETH,
            true,
        ),
        0x11 => row("ACKNOWLEDGE", t, O::Acknowledge, P::Only, H::AETH, false),
        0x12 => row(
            "ATOMIC_ACKNOWLEDGE",
            t,
            O::AtomicAcknowledge,
            P::Only,
            H::AETH.with(H::ATOMIC_ACK_ETH),
            false,
        ),
        0x13 => row(
            "COMPARE_SWAP",
            t,
            O::CompareSwap,
            P::Only,
            H::ATOMIC_ETH,
            false,
        ),
        0x14 => row("FETCH_ADD", t, O::FetchAdd, P::Only, H::ATOMIC_ETH, false),
        0x16 => row(
            "SEND_LAST_WITH_INVALIDATE",
            t,
            O::Send,
            P::Last,
            H::IETH,
            true,
        ),
        0x17 => row(
            "SEND_ONLY_WITH_INVALIDATE",
            t,
            O::Send,
            P::Only,
            H::IETH,
            true,
        ),
        _ => None,
    }
}

const fn lookup(code: u8) -> Option<OpcodeInfo> {
    match code >> 5 {
        0b000 => connected(code & 0x1f, Transport::Rc),
        0b001 => connected(code & 0x1f, Transport::Uc),
        0b011 => match code & 0x1f {
            0x04 => row("SEND_ONLY", Transport::Ud, O::Send, P::Only, H::DETH, true),
            0x05 => row(
                "SEND_ONLY_WITH_IMMEDIATE",
                Transport::Ud,
                O::Send,
                P::Only,
                H::DETH.with(H::IMM_DT),
                true,
            ),
            _ => None,
        },
        0b100 if code == 0x81 => row(
            "CNP",
            Transport::Cnp,
            O::CongestionNotification,
            P::Only,
            H::CNP_RESERVED,
            false,
        ),
        _ => None,
    }
}

const fn build_table() -> [Option<OpcodeInfo>; 256] {
    let mut t = [None; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = lookup(i as u8);
        i += 1;
    }
    t
}

/// The opcode table, indexed by opcode.
pub static TABLE: [Option<OpcodeInfo>; 256] = build_table();

impl Opcode {
    /// RC SEND_FIRST.
    pub const RC_SEND_FIRST: Opcode = Opcode(0x00);
    /// RC SEND_MIDDLE.
    pub const RC_SEND_MIDDLE: Opcode = Opcode(0x01);
    /// RC SEND_LAST.
    pub const RC_SEND_LAST: Opcode = Opcode(0x02);
    /// RC SEND_LAST_WITH_IMMEDIATE.
    pub const RC_SEND_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x03);
    /// RC SEND_ONLY.
    pub const RC_SEND_ONLY: Opcode = Opcode(0x04);
    /// RC SEND_ONLY_WITH_IMMEDIATE.
    pub const RC_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x05);
    /// RC RDMA_WRITE_FIRST.
    pub const RC_RDMA_WRITE_FIRST: Opcode = Opcode(0x06);
    /// RC RDMA_WRITE_MIDDLE.
    pub const RC_RDMA_WRITE_MIDDLE: Opcode = Opcode(0x07);
    /// RC RDMA_WRITE_LAST.
    pub const RC_RDMA_WRITE_LAST: Opcode = Opcode(0x08);
    /// RC RDMA_WRITE_LAST_WITH_IMMEDIATE.
    pub const RC_RDMA_WRITE_LAST_WITH_IMMEDIATE: Opcode = Opcode(0x09);
    /// RC RDMA_WRITE_ONLY.
    pub const RC_RDMA_WRITE_ONLY: Opcode = Opcode(0x0a);
    /// RC RDMA_WRITE_ONLY_WITH_IMMEDIATE.
    pub const RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x0b);
    /// RC RDMA_READ_REQUEST.
    pub const RC_RDMA_READ_REQUEST: Opcode = Opcode(0x0c);
    /// RC RDMA_READ_RESPONSE_FIRST.
    pub const RC_RDMA_READ_RESPONSE_FIRST: Opcode = Opcode(0x0d);
    /// RC RDMA_READ_RESPONSE_MIDDLE.
    pub const RC_RDMA_READ_RESPONSE_MIDDLE: Opcode = Opcode(0x0e);
    /// RC RDMA_READ_RESPONSE_LAST.
    pub const RC_RDMA_READ_RESPONSE_LAST: Opcode = Opcode(0x0f);
    /// RC RDMA_READ_RESPONSE_ONLY.
    pub const RC_RDMA_READ_RESPONSE_ONLY: Opcode = Opcode(0x10);
    /// RC ACKNOWLEDGE.
    pub const RC_ACKNOWLEDGE: Opcode = Opcode(0x11);
    /// RC ATOMIC_ACKNOWLEDGE.
    pub const RC_ATOMIC_ACKNOWLEDGE: Opcode = Opcode(0x12);
    /// RC COMPARE_SWAP.
    pub const RC_COMPARE_SWAP: Opcode = Opcode(0x13);
    /// RC FETCH_ADD.
    pub const RC_FETCH_ADD: Opcode = Opcode(0x14);
    /// RC SEND_LAST_WITH_INVALIDATE.
    pub const RC_SEND_LAST_WITH_INVALIDATE: Opcode = Opcode(0x16);
    /// RC SEND_ONLY_WITH_INVALIDATE.
    pub const RC_SEND_ONLY_WITH_INVALIDATE: Opcode = Opcode(0x17);
    /// UD SEND_ONLY.
    pub const UD_SEND_ONLY: Opcode = Opcode(0x64);
    /// UD SEND_ONLY_WITH_IMMEDIATE.
    pub const UD_SEND_ONLY_WITH_IMMEDIATE: Opcode = Opcode(0x65);
    /// RoCEv2 congestion notification packet.
    pub const CNP: Opcode = Opcode(0x81);

    /// The table row, or `None` for an opcode this crate does not know.
    pub fn info(self) -> Option<&'static OpcodeInfo> {
        TABLE[usize::from(self.0)].as_ref()
    }

    /// Every known opcode.
    pub fn all() -> impl Iterator<Item = Opcode> {
        (0..=255u8).map(Opcode).filter(|o| o.info().is_some())
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.info() {
            Some(i) => {
                let class = match i.transport {
                    Transport::Rc => "RC ",
                    Transport::Uc => "UC ",
                    Transport::Ud => "UD ",
                    Transport::Cnp => "",
                };
                write!(f, "{class}{}", i.name)
            }
            None => write!(f, "opcode {:#04x}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lengths_match_rxe() {
        // "len" column of WIRE-NOTES 1.4 (BTH + extension headers).
        let want: &[(u8, usize)] = &[
            (0x00, 12),
            (0x03, 16),
            (0x06, 28),
            (0x0b, 32),
            (0x0c, 28),
            (0x0d, 16),
            (0x0e, 12),
            (0x11, 16),
            (0x12, 24),
            (0x13, 40),
            (0x14, 40),
            (0x16, 16),
            (0x64, 20),
            (0x65, 24),
            (0x81, 28),
        ];
        for &(op, len) in want {
            assert_eq!(Opcode(op).info().unwrap().header_len(), len, "{op:#x}");
        }
    }

    #[test]
    fn classes() {
        assert_eq!(Opcode(0x20).info().unwrap().transport, Transport::Uc);
        assert!(Opcode(0x2c).info().is_none(), "UC has no READ");
        assert!(Opcode(0x15).info().is_none());
        assert!(Opcode(0x60).info().is_none());
        assert!(Opcode(0x40).info().is_none(), "RD is not supported");
        assert_eq!(Opcode::all().count(), 23 + 12 + 2 + 1);
        assert_eq!(
            Opcode(0x0b).to_string(),
            "RC RDMA_WRITE_ONLY_WITH_IMMEDIATE"
        );
        assert_eq!(Opcode(0xff).to_string(), "opcode 0xff");
    }

    #[test]
    fn offsets_follow_wire_order() {
        let h = Opcode(0x0b).info().unwrap().headers;
        assert_eq!(h.offset_of(Headers::RETH), Some(0));
        assert_eq!(h.offset_of(Headers::IMM_DT), Some(16));
        assert_eq!(h.offset_of(Headers::AETH), None);
        let h = Opcode(0x12).info().unwrap().headers;
        assert_eq!(h.offset_of(Headers::ATOMIC_ACK_ETH), Some(4));
        let h = Opcode(0x65).info().unwrap().headers;
        assert_eq!(h.offset_of(Headers::IMM_DT), Some(8));
    }

    #[test]
    fn looked_up_lengths_and_offsets_match_the_wire_order_summed() {
        for set in 0..=255u8 {
            let set = Headers(set);
            let mut at = 0;
            for (h, l) in Headers::WIRE_ORDER {
                let want = set.contains(h).then_some(at);
                assert_eq!(set.offset_of(h), want, "{set:?} {h:?}");
                if set.contains(h) {
                    at += l;
                }
            }
            assert_eq!(set.len(), at, "{set:?}");
            assert_eq!(set.offset_of(Headers::NONE), None);
            assert_eq!(set.offset_of(Headers::RETH.with(Headers::IMM_DT)), None);
        }
    }

    #[test]
    fn requests_and_responses() {
        assert!(Opcode(0x0c).info().unwrap().is_request());
        assert!(!Opcode(0x10).info().unwrap().is_request());
        assert!(!Opcode(0x11).info().unwrap().is_request());
        assert!(Opcode(0x13).info().unwrap().is_request());
    }
}
