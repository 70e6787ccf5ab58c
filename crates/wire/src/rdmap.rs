//! RDMAP (RFC 5040): the RDMA operations carried in DDP segments. The RDMAP
//! control byte (version and opcode) is the DDP header's upper-layer byte; a
//! READ request adds a 28-byte header, a Terminate a control word and copies of
//! the headers that failed.

use core::fmt;

use crate::bytes::{check, get_u16, get_u32, get_u64, set_u16, set_u32, set_u64};
use crate::ddp::{self, Placement, Segment};
use crate::{Error, Result};

/// The RDMAP version of RFC 5040.
pub const VERSION: u8 = 1;
/// Length of the READ request header.
pub const READ_REQUEST_LEN: usize = 28;
/// Length of the Terminate control word.
pub const TERMINATE_CONTROL_LEN: usize = 4;

/// RDMAP opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// RDMA Write (tagged).
    Write = 0,
    /// RDMA Read Request (untagged, queue 1).
    ReadRequest = 1,
    /// RDMA Read Response (tagged).
    ReadResponse = 2,
    /// Send (untagged, queue 0).
    Send = 3,
    /// Send with Invalidate.
    SendInvalidate = 4,
    /// Send with Solicited Event.
    SendSe = 5,
    /// Send with Solicited Event and Invalidate.
    SendSeInvalidate = 6,
    /// Terminate (untagged, queue 2).
    Terminate = 7,
}

impl Opcode {
    /// The opcode of a 4-bit code.
    pub fn from_code(code: u8) -> Result<Opcode> {
        Ok(match code {
            0 => Opcode::Write,
            1 => Opcode::ReadRequest,
            2 => Opcode::ReadResponse,
            3 => Opcode::Send,
            4 => Opcode::SendInvalidate,
            5 => Opcode::SendSe,
            6 => Opcode::SendSeInvalidate,
            7 => Opcode::Terminate,
            c => return Err(Error::UnknownRdmapOpcode(c)),
        })
    }

    /// Sent in tagged DDP segments.
    pub const fn tagged(self) -> bool {
        matches!(self, Opcode::Write | Opcode::ReadResponse)
    }

    /// The untagged queue the opcode uses, if untagged.
    pub const fn queue(self) -> Option<u32> {
        match self {
            Opcode::Write | Opcode::ReadResponse => None,
            Opcode::ReadRequest => Some(ddp::QN_READ_REQUEST),
            Opcode::Terminate => Some(ddp::QN_TERMINATE),
            _ => Some(ddp::QN_SEND),
        }
    }

    /// A Send of some kind.
    pub const fn is_send(self) -> bool {
        matches!(
            self,
            Opcode::Send | Opcode::SendInvalidate | Opcode::SendSe | Opcode::SendSeInvalidate
        )
    }

    /// The control byte for this opcode: version 1 in bits 7-6.
    pub const fn control_byte(self) -> u8 {
        (VERSION << 6) | self as u8
    }

    /// The name RFC 5040 gives it.
    pub const fn name(self) -> &'static str {
        match self {
            Opcode::Write => "RDMA Write",
            Opcode::ReadRequest => "RDMA Read Request",
            Opcode::ReadResponse => "RDMA Read Response",
            Opcode::Send => "Send",
            Opcode::SendInvalidate => "Send with Invalidate",
            Opcode::SendSe => "Send with SE",
            Opcode::SendSeInvalidate => "Send with SE and Invalidate",
            Opcode::Terminate => "Terminate",
        }
    }
}

mod field {
    use crate::bytes::Field;
    pub const SINK_STAG: Field = 0..4;
    pub const SINK_TO: Field = 4..12;
    pub const SIZE: Field = 12..16;
    pub const SRC_STAG: Field = 16..20;
    pub const SRC_TO: Field = 20..28;
}

/// A view of the RDMA Read Request header.
#[derive(Debug, Clone)]
pub struct ReadRequest<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ReadRequest<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> ReadRequest<T> {
        ReadRequest { buffer }
    }
    /// Wraps a buffer that holds a whole Read Request header.
    pub fn new_checked(buffer: T) -> Result<ReadRequest<T>> {
        let r = ReadRequest::new_unchecked(buffer);
        check(
            "RDMA Read Request header",
            r.buffer.as_ref(),
            READ_REQUEST_LEN,
        )?;
        Ok(r)
    }
    /// Data sink STag (where the response goes).
    pub fn sink_stag(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::SINK_STAG)
    }
    /// Data sink tagged offset.
    pub fn sink_offset(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::SINK_TO)
    }
    /// Bytes to read.
    pub fn size(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::SIZE)
    }
    /// Data source STag (what to read).
    pub fn source_stag(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::SRC_STAG)
    }
    /// Data source tagged offset.
    pub fn source_offset(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::SRC_TO)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ReadRequest<T> {
    /// Sets the sink STag.
    pub fn set_sink_stag(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::SINK_STAG, v);
    }
    /// Sets the sink tagged offset.
    pub fn set_sink_offset(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::SINK_TO, v);
    }
    /// Sets the size.
    pub fn set_size(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::SIZE, v);
    }
    /// Sets the source STag.
    pub fn set_source_stag(&mut self, v: u32) {
        set_u32(self.buffer.as_mut(), field::SRC_STAG, v);
    }
    /// Sets the source tagged offset.
    pub fn set_source_offset(&mut self, v: u64) {
        set_u64(self.buffer.as_mut(), field::SRC_TO, v);
    }
}

/// The fields of a Read Request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequestRepr {
    /// Sink STag.
    pub sink_stag: u32,
    /// Sink tagged offset.
    pub sink_offset: u64,
    /// Bytes to read.
    pub size: u32,
    /// Source STag.
    pub source_stag: u32,
    /// Source tagged offset.
    pub source_offset: u64,
}

impl ReadRequestRepr {
    /// Parses the header.
    pub fn parse<T: AsRef<[u8]>>(r: &ReadRequest<T>) -> Result<ReadRequestRepr> {
        check(
            "RDMA Read Request header",
            r.buffer.as_ref(),
            READ_REQUEST_LEN,
        )?;
        Ok(ReadRequestRepr {
            sink_stag: r.sink_stag(),
            sink_offset: r.sink_offset(),
            size: r.size(),
            source_stag: r.source_stag(),
            source_offset: r.source_offset(),
        })
    }
    /// Writes the header.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, r: &mut ReadRequest<T>) {
        r.set_sink_stag(self.sink_stag);
        r.set_sink_offset(self.sink_offset);
        r.set_size(self.size);
        r.set_source_stag(self.source_stag);
        r.set_source_offset(self.source_offset);
    }
}

impl fmt::Display for ReadRequestRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sink stag={:#010x} to={:#x} size={} source stag={:#010x} to={:#x}",
            self.sink_stag, self.sink_offset, self.size, self.source_stag, self.source_offset
        )
    }
}

/// Which layer a Terminate blames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layer {
    /// RDMAP (0).
    Rdmap,
    /// DDP (1).
    Ddp,
    /// The lower layer protocol, MPA (2).
    Llp,
    /// Undefined layer values.
    Other(u8),
}

impl Layer {
    /// The 4-bit code.
    pub const fn code(self) -> u8 {
        match self {
            Layer::Rdmap => 0,
            Layer::Ddp => 1,
            Layer::Llp => 2,
            Layer::Other(c) => c & 0xf,
        }
    }
    /// The layer of a 4-bit code.
    pub const fn from_code(c: u8) -> Layer {
        match c & 0xf {
            0 => Layer::Rdmap,
            1 => Layer::Ddp,
            2 => Layer::Llp,
            c => Layer::Other(c),
        }
    }
}

/// How the sender laid out the Terminate control word. RFC 5040 puts Layer in
/// the high nibble of the first byte and the M/D/R flags at 0x80/0x40/0x20 of
/// the third; Linux siw (C bitfields on a little-endian machine) swaps the two
/// nibbles and puts the flags at 0x01/0x02/0x04.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TermEncoding {
    /// RFC 5040 4.8.
    Rfc,
    /// Linux siw.
    Siw,
}

/// The error a Terminate reports, and which headers it copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TermControl {
    /// Layer.
    pub layer: Layer,
    /// Error type (4 bits).
    pub etype: u8,
    /// Error code.
    pub code: u8,
    /// M: the DDP segment length is valid.
    pub m: bool,
    /// D: the DDP header is included.
    pub d: bool,
    /// R: the RDMAP (Read Request) header is included.
    pub r: bool,
}

const fn valid_layer_etype(layer: u8, etype: u8) -> bool {
    match layer {
        0 | 1 => etype <= 2,
        2 => etype == 0,
        _ => false,
    }
}

impl TermControl {
    /// Decodes the 4-byte control word in the given encoding.
    pub const fn decode(w: [u8; 4], enc: TermEncoding) -> TermControl {
        let (layer, etype, m, d, r) = match enc {
            TermEncoding::Rfc => (w[0] >> 4, w[0] & 0xf, 0x80, 0x40, 0x20),
            TermEncoding::Siw => (w[0] & 0xf, w[0] >> 4, 0x01, 0x02, 0x04),
        };
        TermControl {
            layer: Layer::from_code(layer),
            etype,
            code: w[1],
            m: w[2] & m != 0,
            d: w[2] & d != 0,
            r: w[2] & r != 0,
        }
    }

    /// Encodes the control word.
    pub const fn encode(&self, enc: TermEncoding) -> [u8; 4] {
        let (first, m, d, r) = match enc {
            TermEncoding::Rfc => (
                (self.layer.code() << 4) | (self.etype & 0xf),
                0x80,
                0x40,
                0x20,
            ),
            TermEncoding::Siw => (
                ((self.etype & 0xf) << 4) | self.layer.code(),
                0x01,
                0x02,
                0x04,
            ),
        };
        let mut flags = 0;
        if self.m {
            flags |= m;
        }
        if self.d {
            flags |= d;
        }
        if self.r {
            flags |= r;
        }
        [first, self.code, flags, 0]
    }

    /// Guesses the encoding of a control word: by where flag bits sit, else by
    /// which reading gives a defined layer and error type, then a defined
    /// code (siw's flagless MPA CRC error, 0x02 0x02, reads in the RFC's
    /// layout as an RDMAP remote operation error with no such code); RFC
    /// when both do.
    pub const fn detect(w: [u8; 4]) -> TermEncoding {
        let rfc_flags = w[2] & 0xe0;
        let siw_flags = w[2] & 0x07;
        if siw_flags != 0 && rfc_flags == 0 {
            return TermEncoding::Siw;
        }
        if rfc_flags != 0 {
            return TermEncoding::Rfc;
        }
        let (hi, lo, code) = (w[0] >> 4, w[0] & 0xf, w[1]);
        let rfc_ok = valid_layer_etype(hi, lo);
        let siw_ok = valid_layer_etype(lo, hi);
        if siw_ok && !rfc_ok {
            return TermEncoding::Siw;
        }
        let siw_named = named(Layer::from_code(lo), hi, code).is_some();
        let rfc_named = named(Layer::from_code(hi), lo, code).is_some();
        if siw_ok && siw_named && !rfc_named {
            return TermEncoding::Siw;
        }
        TermEncoding::Rfc
    }

    /// What the error means, per RFC 5040 4.8, RFC 5041 7.2 and RFC 5044 8.
    pub const fn description(&self) -> &'static str {
        if let Some(d) = named(self.layer, self.etype, self.code) {
            return d;
        }
        match (self.layer, self.etype) {
            (Layer::Rdmap, 0) => "RDMAP local catastrophic error",
            (Layer::Rdmap, 1) => "RDMAP remote protection error",
            (Layer::Rdmap, 2) => "RDMAP remote operation error",
            (Layer::Ddp, 0) => "DDP local catastrophic error",
            _ => "undefined error",
        }
    }
}

/// The errors RFC 5040 4.8, RFC 5041 7.2 and RFC 5044 8 (with RFC 6581's
/// additions) define, by layer, error type and code.
const fn named(layer: Layer, etype: u8, code: u8) -> Option<&'static str> {
    Some(match (layer, etype, code) {
        (Layer::Rdmap, 0, 0x00) => "RDMAP local catastrophic error",
        (Layer::Rdmap, 1, 0x00) => "RDMAP invalid STag",
        (Layer::Rdmap, 1, 0x01) => "RDMAP base or bounds violation",
        (Layer::Rdmap, 1, 0x02) => "RDMAP access rights violation",
        (Layer::Rdmap, 1, 0x03) => "RDMAP STag not associated with RDMAP stream",
        (Layer::Rdmap, 1, 0x04) => "RDMAP TO wrap",
        (Layer::Rdmap, 1, 0x09) => "RDMAP STag cannot be invalidated",
        (Layer::Rdmap, 1, 0xff) => "RDMAP remote protection error",
        (Layer::Rdmap, 2, 0x05) => "RDMAP invalid RDMAP version",
        (Layer::Rdmap, 2, 0x06) => "RDMAP unexpected opcode",
        (Layer::Rdmap, 2, 0x07) => "RDMAP catastrophic error, localized to stream",
        (Layer::Rdmap, 2, 0x08) => "RDMAP catastrophic error, global",
        (Layer::Rdmap, 2, 0x09) => "RDMAP STag cannot be invalidated",
        (Layer::Rdmap, 2, 0xff) => "RDMAP remote operation error",
        (Layer::Ddp, 0, 0x00) => "DDP local catastrophic error",
        (Layer::Ddp, 1, 0x00) => "DDP tagged: invalid STag",
        (Layer::Ddp, 1, 0x01) => "DDP tagged: base or bounds violation",
        (Layer::Ddp, 1, 0x02) => "DDP tagged: STag not associated with DDP stream",
        (Layer::Ddp, 1, 0x03) => "DDP tagged: TO wrap",
        (Layer::Ddp, 1, 0x04) => "DDP tagged: invalid DDP version",
        (Layer::Ddp, 2, 0x01) => "DDP untagged: invalid QN",
        (Layer::Ddp, 2, 0x02) => "DDP untagged: invalid MSN, no buffer available",
        (Layer::Ddp, 2, 0x03) => "DDP untagged: invalid MSN range",
        (Layer::Ddp, 2, 0x04) => "DDP untagged: invalid MO",
        (Layer::Ddp, 2, 0x05) => "DDP untagged: message too long for the buffer",
        (Layer::Ddp, 2, 0x06) => "DDP untagged: invalid DDP version",
        (Layer::Llp, 0, 0x01) => "MPA: TCP connection closed, terminated or lost",
        (Layer::Llp, 0, 0x02) => "MPA: CRC error",
        (Layer::Llp, 0, 0x03) => "MPA: marker and ULPDU length mismatch",
        (Layer::Llp, 0, 0x04) => "MPA: invalid request or reply frame",
        (Layer::Llp, 0, 0x05) => "MPA: local catastrophic error",
        (Layer::Llp, 0, 0x06) => "MPA: insufficient IRD resources",
        (Layer::Llp, 0, 0x07) => "MPA: no matching RTR option",
        _ => return None,
    })
}

impl fmt::Display for TermControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (layer {} type {} code {:#04x})",
            self.description(),
            self.layer.code(),
            self.etype,
            self.code
        )?;
        for (on, n) in [(self.m, " M"), (self.d, " D"), (self.r, " R")] {
            if on {
                f.write_str(n)?;
            }
        }
        Ok(())
    }
}

/// The copy of the DDP header of the segment that failed, inside a Terminate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopiedDdpHeader {
    bytes: [u8; ddp::UNTAGGED_HEADER_LEN],
    len: usize,
}

impl CopiedDdpHeader {
    /// Copies a tagged (14-byte) or untagged (18-byte) header, sized by its T bit.
    pub fn from_bytes(b: &[u8]) -> Result<CopiedDdpHeader> {
        let seg = Segment::new_checked(b)?;
        let len = seg.header_len();
        let mut bytes = [0u8; ddp::UNTAGGED_HEADER_LEN];
        bytes[..len].copy_from_slice(&b[..len]);
        Ok(CopiedDdpHeader { bytes, len })
    }
    /// The copied bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
    /// The copied header, parsed.
    pub fn parse(&self) -> Result<ddp::Repr> {
        ddp::Repr::parse(&Segment::new_unchecked(self.as_bytes()))
    }
}

/// The body of a Terminate message (after its untagged DDP header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminateRepr {
    /// The control word's layout.
    pub encoding: TermEncoding,
    /// The error and the copy flags.
    pub control: TermControl,
    /// Length of the failed DDP segment, when included.
    pub ddp_segment_length: Option<u16>,
    /// The failed segment's DDP header, when included.
    pub ddp_header: Option<CopiedDdpHeader>,
    /// The failed Read Request's header, when included.
    pub rdma_header: Option<ReadRequestRepr>,
}

impl TerminateRepr {
    /// Parses a Terminate body. The DDP segment length and header follow when
    /// D (or M) is set; the Read Request header when R is set and its 28 bytes
    /// are there (siw sets R on SEND-with-invalidate errors without it).
    pub fn parse(body: &[u8]) -> Result<TerminateRepr> {
        check("Terminate control", body, TERMINATE_CONTROL_LEN)?;
        let w = [body[0], body[1], body[2], body[3]];
        let encoding = TermControl::detect(w);
        let control = TermControl::decode(w, encoding);
        let mut rest = &body[TERMINATE_CONTROL_LEN..];
        let mut ddp_segment_length = None;
        let mut ddp_header = None;
        let mut rdma_header = None;
        if control.d || control.m {
            check("Terminate DDP segment length", rest, 2)?;
            ddp_segment_length = Some(get_u16(rest, 0..2));
            rest = &rest[2..];
            if control.d {
                let h = CopiedDdpHeader::from_bytes(rest)?;
                rest = &rest[h.len..];
                ddp_header = Some(h);
            }
        }
        if control.r && rest.len() >= READ_REQUEST_LEN {
            rdma_header = Some(ReadRequestRepr::parse(&ReadRequest::new_unchecked(rest))?);
            rest = &rest[READ_REQUEST_LEN..];
        }
        if !rest.is_empty() {
            return Err(Error::InvalidField {
                field: "trailing bytes after a Terminate",
                value: rest.len() as u64,
            });
        }
        Ok(TerminateRepr {
            encoding,
            control,
            ddp_segment_length,
            ddp_header,
            rdma_header,
        })
    }

    /// Bytes of the body.
    pub fn buffer_len(&self) -> usize {
        TERMINATE_CONTROL_LEN
            + self.ddp_segment_length.map_or(0, |_| 2)
            + self.ddp_header.map_or(0, |h| h.len)
            + self.rdma_header.map_or(0, |_| READ_REQUEST_LEN)
    }

    /// Writes the body into the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let n = self.buffer_len();
        check("Terminate buffer", buf, n)?;
        buf[..TERMINATE_CONTROL_LEN].copy_from_slice(&self.control.encode(self.encoding));
        let mut at = TERMINATE_CONTROL_LEN;
        if let Some(l) = self.ddp_segment_length {
            set_u16(buf, at..at + 2, l);
            at += 2;
        }
        if let Some(h) = &self.ddp_header {
            buf[at..at + h.len].copy_from_slice(h.as_bytes());
            at += h.len;
        }
        if let Some(r) = &self.rdma_header {
            r.emit(&mut ReadRequest::new_unchecked(
                &mut buf[at..at + READ_REQUEST_LEN],
            ));
        }
        Ok(n)
    }
}

/// A view of an RDMAP message segment: a whole ULPDU (DDP header, RDMAP
/// headers, payload).
#[derive(Debug, Clone)]
pub struct Message<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Message<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Message<T> {
        Message { buffer }
    }
    /// Wraps a ULPDU whose DDP header and RDMAP headers are all there.
    pub fn new_checked(buffer: T) -> Result<Message<T>> {
        let m = Message::new_unchecked(buffer);
        m.check_len()?;
        Ok(m)
    }
    /// Checks what [`Message::new_checked`] checks.
    pub fn check_len(&self) -> Result<()> {
        let seg = Segment::new_checked(self.buffer.as_ref())?;
        let extra = match Opcode::from_code(seg.rsvd_ulp() & 0xf) {
            Ok(Opcode::ReadRequest) => READ_REQUEST_LEN,
            Ok(Opcode::Terminate) => TERMINATE_CONTROL_LEN,
            _ => 0,
        };
        check(
            "RDMAP header",
            self.buffer.as_ref(),
            seg.header_len() + extra,
        )
    }
    /// The DDP segment view.
    pub fn ddp(&self) -> Segment<&[u8]> {
        Segment::new_unchecked(self.buffer.as_ref())
    }
    /// RDMAP version (bits 7-6 of the control byte).
    pub fn version(&self) -> u8 {
        self.ddp().rsvd_ulp() >> 6
    }
    /// RDMAP opcode.
    pub fn opcode(&self) -> Result<Opcode> {
        Opcode::from_code(self.ddp().rsvd_ulp() & 0xf)
    }
    /// The bytes after the DDP header.
    fn after_ddp(&self) -> &[u8] {
        &self.buffer.as_ref()[self.ddp().header_len()..]
    }
    /// The Read Request header, for a Read Request.
    pub fn read_request(&self) -> Option<ReadRequest<&[u8]>> {
        match self.opcode() {
            Ok(Opcode::ReadRequest) => Some(ReadRequest::new_unchecked(
                &self.after_ddp()[..READ_REQUEST_LEN],
            )),
            _ => None,
        }
    }
    /// The Terminate body, for a Terminate.
    pub fn terminate_body(&self) -> Option<&[u8]> {
        match self.opcode() {
            Ok(Opcode::Terminate) => Some(self.after_ddp()),
            _ => None,
        }
    }
    /// The ULP payload: the data of a Write, Read Response or Send.
    pub fn payload(&self) -> &[u8] {
        match self.opcode() {
            Ok(Opcode::ReadRequest) | Ok(Opcode::Terminate) => &[],
            _ => self.after_ddp(),
        }
    }
}

/// The headers of an RDMAP message segment, and the length of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// The DDP header; its upper-layer byte is the RDMAP control byte of `opcode`.
    pub ddp: ddp::Repr,
    /// The Read Request header.
    pub read_request: Option<ReadRequestRepr>,
    /// The Terminate body.
    pub terminate: Option<TerminateRepr>,
    /// Payload bytes.
    pub payload_len: usize,
}

impl MessageRepr {
    /// Parses a message segment: RDMAP version 1, an opcode in the DDP model and
    /// queue RFC 5040 gives it, single-segment Read Requests and Terminates.
    pub fn parse<T: AsRef<[u8]>>(m: &Message<T>) -> Result<MessageRepr> {
        m.check_len()?;
        let mut ddp = ddp::Repr::parse(&m.ddp())?;
        if m.version() != VERSION {
            return Err(Error::UnsupportedVersion {
                field: "RDMAP version",
                value: m.version(),
            });
        }
        let opcode = m.opcode()?;
        // The control byte's two reserved bits are ignored on receive (RFC 5040 4.1).
        ddp.rsvd_ulp = opcode.control_byte();
        match (opcode.queue(), ddp.placement) {
            (None, Placement::Tagged { .. }) => {}
            (Some(q), Placement::Untagged { queue, .. }) if q == queue => {}
            (_, Placement::Untagged { queue, .. }) => {
                return Err(Error::InvalidField {
                    field: "DDP queue number for the RDMAP opcode",
                    value: queue.into(),
                });
            }
            (Some(_), Placement::Tagged { .. }) => {
                return Err(Error::InvalidField {
                    field: "tagged DDP segment for an untagged RDMAP opcode",
                    value: opcode as u64,
                });
            }
        }
        let (read_request, terminate) = match opcode {
            Opcode::ReadRequest | Opcode::Terminate => {
                if let Placement::Untagged { offset, .. } = ddp.placement
                    && (offset != 0 || !ddp.last)
                {
                    return Err(Error::InvalidField {
                        field: "message offset of a single-segment RDMAP message",
                        value: offset.into(),
                    });
                }
                if opcode == Opcode::ReadRequest {
                    let rest = m.after_ddp();
                    if rest.len() != READ_REQUEST_LEN {
                        return Err(Error::InvalidField {
                            field: "length of an RDMA Read Request",
                            value: rest.len() as u64,
                        });
                    }
                    let rr = ReadRequestRepr::parse(&ReadRequest::new_unchecked(rest))?;
                    (Some(rr), None)
                } else {
                    (None, Some(TerminateRepr::parse(m.after_ddp())?))
                }
            }
            _ => (None, None),
        };
        Ok(MessageRepr {
            opcode,
            ddp,
            read_request,
            terminate,
            payload_len: m.payload().len(),
        })
    }

    /// Bytes of the headers (DDP and RDMAP).
    pub fn header_len(&self) -> usize {
        self.ddp.buffer_len()
            + self.read_request.map_or(0, |_| READ_REQUEST_LEN)
            + self.terminate.map_or(0, |t| t.buffer_len())
    }

    /// Bytes of the whole ULPDU.
    pub fn buffer_len(&self) -> usize {
        self.header_len() + self.payload_len
    }

    /// Writes the headers into the start of `buf`; returns their length.
    pub fn emit_header(&self, buf: &mut [u8]) -> Result<usize> {
        let n = self.header_len();
        check("RDMAP header buffer", buf, n)?;
        if self.opcode.tagged() != self.ddp.tagged()
            || (self.opcode == Opcode::ReadRequest) != self.read_request.is_some()
            || (self.opcode == Opcode::Terminate) != self.terminate.is_some()
        {
            return Err(Error::InvalidField {
                field: "RDMAP headers that do not match the opcode",
                value: self.opcode as u64,
            });
        }
        let mut ddp = self.ddp;
        ddp.rsvd_ulp = self.opcode.control_byte();
        let dlen = ddp.buffer_len();
        ddp.emit(&mut Segment::new_unchecked(&mut buf[..dlen]));
        if let Some(rr) = &self.read_request {
            rr.emit(&mut ReadRequest::new_unchecked(
                &mut buf[dlen..dlen + READ_REQUEST_LEN],
            ));
        }
        if let Some(t) = &self.terminate {
            t.emit(&mut buf[dlen..n])?;
        }
        Ok(n)
    }
}

impl fmt::Display for MessageRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RDMAP {} | {}", self.opcode.name(), self.ddp)?;
        if let Some(rr) = &self.read_request {
            write!(f, " | {rr}")?;
        }
        if let Some(t) = &self.terminate {
            write!(f, " | {}", t.control)?;
            if t.encoding == TermEncoding::Siw {
                f.write_str(" [siw layout]")?;
            }
        }
        if self.payload_len != 0 {
            write!(f, " | payload {}", self.payload_len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // siwcrc_rping.pcap frame 11: RDMA Read Request ULPDU.
    const READ_REQ: [u8; 46] = [
        0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0x7e, 0x9a, 0x5b, 0x00, 0x00,
        0x00, 0x55, 0xdd, 0x7d, 0x19, 0x5b, 0x10, 0x00, 0x00, 0x00, 0x40, 0x2b, 0xe9, 0x6f, 0x00,
        0x00, 0x00, 0x55, 0x7b, 0x4d, 0xc0, 0xfe, 0x30,
    ];

    #[test]
    fn golden_read_request() {
        let m = Message::new_checked(&READ_REQ[..]).unwrap();
        let r = MessageRepr::parse(&m).unwrap();
        assert_eq!(r.opcode, Opcode::ReadRequest);
        assert_eq!(
            r.read_request,
            Some(ReadRequestRepr {
                sink_stag: 0x7e9a_5b00,
                sink_offset: 0x55dd_7d19_5b10,
                size: 64,
                source_stag: 0x2be9_6f00,
                source_offset: 0x557b_4dc0_fe30
            })
        );
        assert_eq!(r.buffer_len(), 46);
        let mut buf = [0u8; 46];
        assert_eq!(r.emit_header(&mut buf).unwrap(), 46);
        assert_eq!(buf, READ_REQ);
        assert_eq!(
            r.to_string(),
            "RDMAP RDMA Read Request | DDP untagged qn=1 msn=1 mo=0 L | sink stag=0x7e9a5b00 to=0x55dd7d195b10 size=64 source stag=0x2be96f00 to=0x557b4dc0fe30"
        );
    }

    #[test]
    fn malformed_messages() {
        assert!(Message::new_checked(&READ_REQ[..45]).is_err());
        let mut bad = READ_REQ;
        bad[1] = 0x48; // opcode 8
        let m = Message::new_unchecked(&bad[..]);
        assert_eq!(MessageRepr::parse(&m), Err(Error::UnknownRdmapOpcode(8)));
        let mut bad = READ_REQ;
        bad[1] = 0x81; // RDMAP version 2
        assert!(matches!(
            MessageRepr::parse(&Message::new_unchecked(&bad[..])),
            Err(Error::UnsupportedVersion { value: 2, .. })
        ));
        let mut bad = READ_REQ;
        bad[9] = 0; // Read Request on queue 0
        assert!(MessageRepr::parse(&Message::new_unchecked(&bad[..])).is_err());
        let mut bad = READ_REQ;
        bad[0] = 0xc1; // tagged Read Request
        assert!(MessageRepr::parse(&Message::new_unchecked(&bad[..])).is_err());
        let mut bad = [0u8; 18];
        bad[..2].copy_from_slice(&[0x41, 0x40]); // untagged Write
        assert!(MessageRepr::parse(&Message::new_unchecked(&bad[..])).is_err());
    }

    #[test]
    fn siw_terminate_layout() {
        // siw's Terminate for an invalid QN (DDP, untagged, code 1), M and D set.
        let w = [0x21, 0x01, 0x03, 0x00];
        assert_eq!(TermControl::detect(w), TermEncoding::Siw);
        let c = TermControl::decode(w, TermEncoding::Siw);
        assert_eq!(c.layer, Layer::Ddp);
        assert_eq!(c.etype, 2);
        assert_eq!(c.code, 1);
        assert!(c.m && c.d && !c.r);
        assert_eq!(c.encode(TermEncoding::Rfc), [0x12, 0x01, 0xc0, 0x00]);
        assert_eq!(
            TermControl::detect([0x12, 0x01, 0xc0, 0x00]),
            TermEncoding::Rfc
        );
        assert_eq!(c.description(), "DDP untagged: invalid QN");
        // Without flags the nibbles decide: DDP untagged in siw's layout reads
        // as an undefined LLP error type in the RFC's.
        assert_eq!(TermControl::detect([0x21, 0x02, 0, 0]), TermEncoding::Siw);
        assert_eq!(TermControl::detect([0x20, 0x02, 0, 0]), TermEncoding::Rfc);
        // Both layers and types defined: the code decides. siw's MPA CRC
        // error is an undefined RDMAP code in the RFC's layout.
        let crc = [0x02, 0x02, 0, 0];
        assert_eq!(TermControl::detect(crc), TermEncoding::Siw);
        assert_eq!(
            TermControl::decode(crc, TermEncoding::Siw).description(),
            "MPA: CRC error"
        );
        // All defined: RDMAP invalid STag in the RFC's, DDP local
        // catastrophic in siw's; taken as RFC.
        assert_eq!(TermControl::detect([0x01, 0x00, 0, 0]), TermEncoding::Rfc);
    }

    #[test]
    fn terminate_message() {
        // A Terminate for a Write to a bad STag, copying the failed tagged header.
        let failed = [0xc1u8, 0x40, 0, 0, 0x12, 0x34, 0, 0, 0, 0, 0, 0, 0x10, 0];
        let t = TerminateRepr {
            encoding: TermEncoding::Rfc,
            control: TermControl {
                layer: Layer::Ddp,
                etype: 1,
                code: 0,
                m: true,
                d: true,
                r: false,
            },
            ddp_segment_length: Some(64),
            ddp_header: Some(CopiedDdpHeader::from_bytes(&failed).unwrap()),
            rdma_header: None,
        };
        let m = MessageRepr {
            opcode: Opcode::Terminate,
            ddp: ddp::Repr {
                last: true,
                rsvd_ulp: 0,
                placement: Placement::Untagged {
                    rsvd_ulp_word: 0,
                    queue: ddp::QN_TERMINATE,
                    msn: 1,
                    offset: 0,
                },
            },
            read_request: None,
            terminate: Some(t),
            payload_len: 0,
        };
        let mut buf = [0u8; 64];
        let n = m.emit_header(&mut buf).unwrap();
        assert_eq!(n, 18 + 4 + 2 + 14);
        let parsed = MessageRepr::parse(&Message::new_checked(&buf[..n]).unwrap()).unwrap();
        let mut want = m;
        want.ddp.rsvd_ulp = Opcode::Terminate.control_byte();
        assert_eq!(parsed, want);
        // Reserved control bits are ignored.
        buf[1] |= 0x30;
        assert_eq!(
            MessageRepr::parse(&Message::new_checked(&buf[..n]).unwrap()).unwrap(),
            want
        );
        assert_eq!(
            parsed
                .terminate
                .unwrap()
                .ddp_header
                .unwrap()
                .parse()
                .unwrap()
                .placement,
            Placement::Tagged {
                stag: 0x1234,
                offset: 0x1000
            }
        );
        // Truncated copies and trailing junk are errors.
        assert!(MessageRepr::parse(&Message::new_unchecked(&buf[..n - 1])).is_err());
        assert!(MessageRepr::parse(&Message::new_unchecked(&buf[..n + 1])).is_err());
    }

    proptest! {
        #[test]
        fn control_word_round_trips(l in 0u8..3, e in 0u8..16, code: u8, m: bool, d: bool, r: bool,
                                    siw: bool) {
            let enc = if siw { TermEncoding::Siw } else { TermEncoding::Rfc };
            let c = TermControl { layer: Layer::from_code(l), etype: e, code, m, d, r };
            prop_assert_eq!(TermControl::decode(c.encode(enc), enc), c);
        }

        #[test]
        fn read_request_round_trip(msn: u32, a: u32, b: u64, size: u32, c: u32, d: u64) {
            let m = MessageRepr {
                opcode: Opcode::ReadRequest,
                ddp: ddp::Repr { last: true, rsvd_ulp: Opcode::ReadRequest.control_byte(),
                    placement: Placement::Untagged { rsvd_ulp_word: 0, queue: 1, msn, offset: 0 } },
                read_request: Some(ReadRequestRepr { sink_stag: a, sink_offset: b, size,
                                                     source_stag: c, source_offset: d }),
                terminate: None, payload_len: 0 };
            let mut buf = vec![0u8; m.buffer_len()];
            m.emit_header(&mut buf).unwrap();
            prop_assert_eq!(MessageRepr::parse(&Message::new_checked(&buf[..]).unwrap()).unwrap(), m);
        }

        #[test]
        fn terminate_round_trip(l in 0u8..3, e in 0u8..3, code: u8, siw: bool,
                                copy in proptest::option::of((any::<u16>(), any::<bool>())),
                                rdma in proptest::option::of(any::<(u32, u64, u32, u32, u64)>())) {
            let encoding = if siw { TermEncoding::Siw } else { TermEncoding::Rfc };
            let ddp_header = copy.map(|(_, tagged)| {
                let mut h = [0u8; 18];
                h[0] = if tagged { 0xc1 } else { 0x41 };
                h[1] = 0x41;
                CopiedDdpHeader::from_bytes(&h).unwrap()
            });
            let control = TermControl { layer: Layer::from_code(l), etype: e, code,
                m: copy.is_some(), d: copy.is_some(), r: rdma.is_some() };
            let t = TerminateRepr {
                encoding, control, ddp_segment_length: copy.map(|c| c.0), ddp_header,
                rdma_header: rdma.map(|(a, b, c, d, e)| ReadRequestRepr { sink_stag: a,
                    sink_offset: b, size: c, source_stag: d, source_offset: e }) };
            let mut buf = vec![0u8; t.buffer_len()];
            t.emit(&mut buf).unwrap();
            let back = TerminateRepr::parse(&buf).unwrap();
            // Without flags an encoding can read both ways; the fields must survive.
            prop_assert_eq!(back.control, TermControl::decode(control.encode(encoding), back.encoding));
            if copy.is_some() || rdma.is_some() {
                prop_assert_eq!(back, t);
            }
        }

        #[test]
        fn send_round_trip(msn: u32, mo: u32, last: bool, payload_len in 0usize..2000, se: bool) {
            let opcode = if se { Opcode::SendSe } else { Opcode::Send };
            let m = MessageRepr {
                opcode,
                ddp: ddp::Repr { last, rsvd_ulp: opcode.control_byte(),
                    placement: Placement::Untagged { rsvd_ulp_word: 0, queue: 0, msn, offset: mo } },
                read_request: None, terminate: None, payload_len };
            let mut buf = vec![0u8; m.buffer_len()];
            m.emit_header(&mut buf).unwrap();
            prop_assert_eq!(MessageRepr::parse(&Message::new_checked(&buf[..]).unwrap()).unwrap(), m);
        }
    }
}
