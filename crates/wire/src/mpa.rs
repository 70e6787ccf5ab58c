//! MPA (RFC 5044, with the RFC 6581 enhancements): the framing that carries DDP
//! segments over a TCP byte stream.
//!
//! A connection starts with an MPA Request frame from the initiator and a Reply
//! frame from the responder ([`StartFrame`]); after them each direction is a
//! sequence of FPDUs ([`Fpdu`]): a 2-byte ULPDU length, the ULPDU (a DDP
//! segment), 0-3 pad bytes to a multiple of 4, and a CRC32c (zero when CRC was
//! not negotiated). Markers, when a peer asks for them, sit every 512 bytes of
//! the stream ([`emit_marked`], [`unmark`]); Linux siw never uses them.

use core::fmt;

use crate::bytes::{check, get_u16, set_u16};
use crate::{Error, Result};

/// Key of the Request frame.
pub const REQUEST_KEY: &[u8; 16] = b"MPA ID Req Frame";
/// Key of the Reply frame.
pub const REPLY_KEY: &[u8; 16] = b"MPA ID Rep Frame";
/// Request/Reply frame header: key, flags, revision, private data length.
pub const START_FRAME_HEADER_LEN: usize = 20;
/// Largest private data an MPA frame may carry (RFC 5044 7.1.1).
pub const MAX_PRIVATE_DATA: usize = 512;
/// Length of the RFC 6581 IRD/ORD block.
pub const IRD_ORD_LEN: usize = 4;
/// Length of the ULPDU length field.
pub const LENGTH_FIELD_LEN: usize = 2;
/// Length of the CRC field.
pub const CRC_LEN: usize = 4;
/// The largest ULPDU softrdma frames: the 16-bit length field's maximum,
/// less room for pad and CRC.
pub const MAX_ULPDU: usize = u16::MAX as usize - 8;
/// Markers sit this many stream bytes apart (counting the markers themselves).
pub const MARKER_INTERVAL: usize = 512;
/// Length of a marker.
pub const MARKER_LEN: usize = 4;

/// Markers required in the peer's FPDUs.
pub const FLAG_MARKERS: u8 = 0x80;
/// CRC32c wanted.
pub const FLAG_CRC: u8 = 0x40;
/// Connection rejected (Reply only).
pub const FLAG_REJECT: u8 = 0x20;
/// RFC 6581 enhanced connection establishment: private data starts with IRD/ORD.
pub const FLAG_ENHANCED: u8 = 0x10;
/// The four reserved flag bits (siw uses 0x08 privately for "GSO allowed").
pub const FLAG_RESERVED: u8 = 0x0f;
/// siw's private "GSO" flag (MPA_RR_FLAG_GSO_EXP): the sender takes FPDUs
/// larger than a TCP segment. siw's Reply echoes the Request's flags, so in
/// a Reply it may only be an echo.
pub const FLAG_GSO: u8 = 0x08;
/// softrdma's private flag, in a Reply beside [`FLAG_GSO`]: the responder
/// takes large FPDUs itself (siw's echo never sets it).
pub const FLAG_GSO_OWN: u8 = 0x04;

mod field {
    use crate::bytes::Field;
    pub const KEY: Field = 0..16;
    pub const FLAGS: usize = 16;
    pub const REVISION: usize = 17;
    pub const PD_LEN: Field = 18..20;
}

/// Which start frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// "MPA ID Req Frame", sent by the initiator.
    Request,
    /// "MPA ID Rep Frame", sent by the responder.
    Reply,
}

/// A view of an MPA Request or Reply frame.
#[derive(Debug, Clone)]
pub struct StartFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> StartFrame<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> StartFrame<T> {
        StartFrame { buffer }
    }
    /// Wraps a buffer that holds the frame header and all its private data.
    pub fn new_checked(buffer: T) -> Result<StartFrame<T>> {
        let f = StartFrame::new_unchecked(buffer);
        f.check_len()?;
        Ok(f)
    }
    /// Fails unless the header and the private data it announces are all there.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check("MPA start frame", b, START_FRAME_HEADER_LEN)?;
        check("MPA private data", b, self.frame_len())
    }
    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }
    /// The 16-byte key.
    pub fn key(&self) -> &[u8] {
        &self.buffer.as_ref()[field::KEY]
    }
    /// Request or Reply, by the key.
    pub fn kind(&self) -> Result<Kind> {
        match self.key() {
            k if k == REQUEST_KEY => Ok(Kind::Request),
            k if k == REPLY_KEY => Ok(Kind::Reply),
            _ => Err(Error::BadMpaKey),
        }
    }
    /// The flags byte.
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    /// Revision.
    pub fn revision(&self) -> u8 {
        self.buffer.as_ref()[field::REVISION]
    }
    /// Private data length.
    pub fn private_data_len(&self) -> u16 {
        get_u16(self.buffer.as_ref(), field::PD_LEN)
    }
    /// Header plus private data.
    pub fn frame_len(&self) -> usize {
        START_FRAME_HEADER_LEN + usize::from(self.private_data_len())
    }
    /// The private data (with the IRD/ORD block first in enhanced mode).
    pub fn private_data(&self) -> &[u8] {
        &self.buffer.as_ref()[START_FRAME_HEADER_LEN..self.frame_len()]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> StartFrame<T> {
    /// Sets the key.
    pub fn set_kind(&mut self, kind: Kind) {
        let key = match kind {
            Kind::Request => REQUEST_KEY,
            Kind::Reply => REPLY_KEY,
        };
        self.buffer.as_mut()[field::KEY].copy_from_slice(key);
    }
    /// Sets the flags byte.
    pub fn set_flags(&mut self, v: u8) {
        self.buffer.as_mut()[field::FLAGS] = v;
    }
    /// Sets the revision.
    pub fn set_revision(&mut self, v: u8) {
        self.buffer.as_mut()[field::REVISION] = v;
    }
    /// Sets the private data length.
    pub fn set_private_data_len(&mut self, v: u16) {
        set_u16(self.buffer.as_mut(), field::PD_LEN, v);
    }
    /// The private data, writable.
    pub fn private_data_mut(&mut self) -> &mut [u8] {
        let end = self.frame_len();
        &mut self.buffer.as_mut()[START_FRAME_HEADER_LEN..end]
    }
}

/// The RFC 6581 block at the start of enhanced private data: inbound and
/// outbound READ limits, peer-to-peer mode and the "ready to receive" message
/// types the sender can send or accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IrdOrd {
    /// Peer-to-peer connection model (an RTR message ends establishment).
    pub peer_to_peer: bool,
    /// A zero-length SEND may serve as the RTR message.
    pub send_rtr: bool,
    /// Inbound RDMA READ queue depth (14 bits).
    pub ird: u16,
    /// A zero-length RDMA WRITE may serve as the RTR message.
    pub write_rtr: bool,
    /// A zero-length RDMA READ may serve as the RTR message.
    pub read_rtr: bool,
    /// Outbound RDMA READ queue depth (14 bits).
    pub ord: u16,
}

impl IrdOrd {
    /// IRD or ORD value meaning "not negotiated here; the application does it".
    pub const NOT_NEGOTIATED: u16 = 0x3fff;

    /// Decodes the 4-byte block.
    pub fn from_bytes(b: [u8; 4]) -> IrdOrd {
        let hi = u16::from_be_bytes([b[0], b[1]]);
        let lo = u16::from_be_bytes([b[2], b[3]]);
        IrdOrd {
            peer_to_peer: hi & 0x8000 != 0,
            send_rtr: hi & 0x4000 != 0,
            ird: hi & 0x3fff,
            write_rtr: lo & 0x8000 != 0,
            read_rtr: lo & 0x4000 != 0,
            ord: lo & 0x3fff,
        }
    }

    /// Encodes the 4-byte block.
    pub fn to_bytes(self) -> [u8; 4] {
        let hi = (u16::from(self.peer_to_peer) << 15)
            | (u16::from(self.send_rtr) << 14)
            | (self.ird & 0x3fff);
        let lo = (u16::from(self.write_rtr) << 15)
            | (u16::from(self.read_rtr) << 14)
            | (self.ord & 0x3fff);
        let [a, b] = hi.to_be_bytes();
        let [c, d] = lo.to_be_bytes();
        [a, b, c, d]
    }
}

/// The fields of an MPA Request or Reply frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartFrameRepr {
    /// Request or Reply.
    pub kind: Kind,
    /// Markers required in the peer's FPDUs.
    pub markers: bool,
    /// CRC32c wanted.
    pub crc: bool,
    /// Rejected (Reply).
    pub reject: bool,
    /// The four reserved flag bits, as sent.
    pub reserved_flags: u8,
    /// Revision: 1 (RFC 5044) or 2 (RFC 6581).
    pub revision: u8,
    /// The RFC 6581 block, present when the enhanced flag is set.
    pub ird_ord: Option<IrdOrd>,
    /// Bytes of the application's private data (after the IRD/ORD block).
    pub ulp_private_data_len: usize,
}

impl StartFrameRepr {
    /// Parses a Request or Reply. Accepts revisions 1 and 2; in revision 2 the
    /// enhanced flag needs at least the 4-byte IRD/ORD block.
    pub fn parse<T: AsRef<[u8]>>(f: &StartFrame<T>) -> Result<StartFrameRepr> {
        check("MPA start frame", f.buffer.as_ref(), START_FRAME_HEADER_LEN)?;
        let kind = f.kind()?;
        let revision = f.revision();
        if !(1..=2).contains(&revision) {
            return Err(Error::UnsupportedVersion {
                field: "MPA revision",
                value: revision,
            });
        }
        let pd_len = usize::from(f.private_data_len());
        if pd_len > MAX_PRIVATE_DATA {
            return Err(Error::InvalidField {
                field: "MPA private data length",
                value: pd_len as u64,
            });
        }
        f.check_len()?;
        let flags = f.flags();
        // Revision 1 reserves the bit: ignored on receipt (RFC 5044 7.1).
        let enhanced = revision >= 2 && flags & FLAG_ENHANCED != 0;
        let ird_ord = if enhanced {
            if pd_len < IRD_ORD_LEN {
                return Err(Error::InvalidField {
                    field: "MPA enhanced flag without an IRD/ORD block",
                    value: pd_len as u64,
                });
            }
            let pd = f.private_data();
            Some(IrdOrd::from_bytes([pd[0], pd[1], pd[2], pd[3]]))
        } else {
            None
        };
        Ok(StartFrameRepr {
            kind,
            markers: flags & FLAG_MARKERS != 0,
            crc: flags & FLAG_CRC != 0,
            reject: flags & FLAG_REJECT != 0,
            reserved_flags: flags & FLAG_RESERVED,
            revision,
            ird_ord,
            ulp_private_data_len: pd_len - if enhanced { IRD_ORD_LEN } else { 0 },
        })
    }

    /// Bytes of the whole frame.
    pub fn buffer_len(&self) -> usize {
        START_FRAME_HEADER_LEN + self.ird_ord.map_or(0, |_| IRD_ORD_LEN) + self.ulp_private_data_len
    }

    /// Writes the frame with `ulp_private_data` (whose length must match).
    /// An IRD/ORD block needs revision 2 (revision 1 has no enhanced flag).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(
        &self,
        f: &mut StartFrame<T>,
        ulp_private_data: &[u8],
    ) -> Result<()> {
        if self.ird_ord.is_some() && self.revision < 2 {
            return Err(Error::InvalidField {
                field: "MPA IRD/ORD block below revision 2",
                value: self.revision.into(),
            });
        }
        let pd_len = self.buffer_len() - START_FRAME_HEADER_LEN;
        if ulp_private_data.len() != self.ulp_private_data_len || pd_len > MAX_PRIVATE_DATA {
            return Err(Error::InvalidField {
                field: "MPA private data length",
                value: ulp_private_data.len() as u64,
            });
        }
        check("MPA start frame", f.buffer.as_ref(), self.buffer_len())?;
        f.set_kind(self.kind);
        let mut flags = self.reserved_flags & FLAG_RESERVED;
        for (on, bit) in [
            (self.markers, FLAG_MARKERS),
            (self.crc, FLAG_CRC),
            (self.reject, FLAG_REJECT),
            (self.ird_ord.is_some(), FLAG_ENHANCED),
        ] {
            if on {
                flags |= bit;
            }
        }
        f.set_flags(flags);
        f.set_revision(self.revision);
        f.set_private_data_len(pd_len as u16);
        let pd = f.private_data_mut();
        let ulp = match self.ird_ord {
            Some(io) => {
                pd[..IRD_ORD_LEN].copy_from_slice(&io.to_bytes());
                &mut pd[IRD_ORD_LEN..]
            }
            None => pd,
        };
        ulp.copy_from_slice(ulp_private_data);
        Ok(())
    }
}

impl fmt::Display for StartFrameRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.kind {
            Kind::Request => "MPA Request",
            Kind::Reply => "MPA Reply",
        };
        write!(f, "{name} rev={}", self.revision)?;
        for (on, n) in [
            (self.markers, " M"),
            (self.crc, " CRC"),
            (self.reject, " REJECT"),
        ] {
            if on {
                f.write_str(n)?;
            }
        }
        if let Some(io) = self.ird_ord {
            write!(f, " ird={} ord={}", io.ird, io.ord)?;
            if io.peer_to_peer {
                f.write_str(" p2p")?;
                for (on, n) in [
                    (io.send_rtr, " send-rtr"),
                    (io.write_rtr, " write-rtr"),
                    (io.read_rtr, " read-rtr"),
                ] {
                    if on {
                        f.write_str(n)?;
                    }
                }
            }
        }
        if self.ulp_private_data_len != 0 {
            write!(f, " private={}", self.ulp_private_data_len)?;
        }
        Ok(())
    }
}

/// Pad bytes after a ULPDU of `ulpdu_len` bytes.
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (LENGTH_FIELD_LEN + ulpdu_len).wrapping_neg() & 3
}

/// Bytes of an FPDU (without markers) carrying a ULPDU of `ulpdu_len` bytes.
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    LENGTH_FIELD_LEN + ulpdu_len + pad_len(ulpdu_len) + CRC_LEN
}

/// A CRC32c computed in pieces (Castagnoli, as iSCSI; sent least significant
/// byte first).
#[derive(Debug, Clone, Copy, Default)]
pub struct Crc32c(u32);

impl Crc32c {
    /// A fresh CRC.
    pub const fn new() -> Crc32c {
        Crc32c(0)
    }
    /// Adds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0 = crc32c::crc32c_append(self.0, bytes);
    }
    /// The CRC value.
    pub const fn finish(self) -> u32 {
        self.0
    }
}

/// A view of an FPDU without markers: ULPDU length, ULPDU, pad, CRC.
#[derive(Debug, Clone)]
pub struct Fpdu<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Fpdu<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Fpdu<T> {
        Fpdu { buffer }
    }
    /// Wraps a buffer that starts with a whole FPDU (it may hold more after it).
    pub fn new_checked(buffer: T) -> Result<Fpdu<T>> {
        let f = Fpdu::new_unchecked(buffer);
        f.check_len()?;
        Ok(f)
    }
    /// Fails unless the FPDU the length field announces is all there.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        check("MPA FPDU length", b, LENGTH_FIELD_LEN)?;
        check("MPA FPDU", b, self.total_len())
    }
    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }
    /// ULPDU length.
    pub fn ulpdu_len(&self) -> u16 {
        get_u16(self.buffer.as_ref(), 0..2)
    }
    /// Bytes of the whole FPDU.
    pub fn total_len(&self) -> usize {
        fpdu_len(usize::from(self.ulpdu_len()))
    }
    /// The ULPDU (a DDP segment).
    pub fn ulpdu(&self) -> &[u8] {
        let n = usize::from(self.ulpdu_len());
        &self.buffer.as_ref()[LENGTH_FIELD_LEN..LENGTH_FIELD_LEN + n]
    }
    /// The pad bytes.
    pub fn pad(&self) -> &[u8] {
        let n = usize::from(self.ulpdu_len());
        let start = LENGTH_FIELD_LEN + n;
        &self.buffer.as_ref()[start..start + pad_len(n)]
    }
    /// The bytes the CRC covers: length, ULPDU, pad.
    pub fn covered(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.total_len() - CRC_LEN]
    }
    /// The CRC field (zero when CRC was not negotiated).
    pub fn crc(&self) -> u32 {
        let end = self.total_len();
        let mut v = [0u8; 4];
        v.copy_from_slice(&self.buffer.as_ref()[end - CRC_LEN..end]);
        u32::from_le_bytes(v)
    }
    /// The CRC32c the FPDU should carry.
    pub fn compute_crc(&self) -> u32 {
        crc32c::crc32c(self.covered())
    }
    /// Checks the CRC field: against the CRC32c when CRC is on; unchecked when
    /// off (RFC 5044 says it "MUST NOT be checked").
    pub fn check_crc(&self, crc_enabled: bool) -> Result<()> {
        if !crc_enabled {
            return Ok(());
        }
        let (computed, carried) = (self.compute_crc(), self.crc());
        if computed == carried {
            Ok(())
        } else {
            Err(Error::BadCrc32c { computed, carried })
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Fpdu<T> {
    /// The pad bytes, writable.
    pub fn pad_mut(&mut self) -> &mut [u8] {
        let n = usize::from(self.ulpdu_len());
        let start = LENGTH_FIELD_LEN + n;
        &mut self.buffer.as_mut()[start..start + pad_len(n)]
    }
    /// Sets the CRC field.
    pub fn set_crc(&mut self, crc: u32) {
        let end = self.total_len();
        self.buffer.as_mut()[end - CRC_LEN..end].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Writes an FPDU carrying `ulpdu` into the start of `buf`, with a CRC32c when
/// `crc` is on and a zero CRC field when off; returns its length.
pub fn emit(buf: &mut [u8], ulpdu: &[u8], crc: bool) -> Result<usize> {
    let n = ulpdu.len();
    let ulpdu_len = u16::try_from(n).map_err(|_| Error::InvalidField {
        field: "ULPDU length",
        value: n as u64,
    })?;
    let total = fpdu_len(n);
    check("FPDU buffer", buf, total)?;
    set_u16(buf, 0..2, ulpdu_len);
    buf[LENGTH_FIELD_LEN..LENGTH_FIELD_LEN + n].copy_from_slice(ulpdu);
    buf[LENGTH_FIELD_LEN + n..total].fill(0);
    if crc {
        let c = crc32c::crc32c(&buf[..total - CRC_LEN]);
        buf[total - CRC_LEN..total].copy_from_slice(&c.to_le_bytes());
    }
    Ok(total)
}

const fn marker_due(stream_pos: usize) -> bool {
    stream_pos.is_multiple_of(MARKER_INTERVAL)
}

/// Writes an FPDU carrying `ulpdu` with markers into `buf`, for a sender whose
/// FPDU starts `stream_pos` bytes after the start of its full-operation stream
/// (where the first marker sits). The CRC covers the markers. Returns the bytes
/// written.
pub fn emit_marked(buf: &mut [u8], stream_pos: usize, ulpdu: &[u8], crc: bool) -> Result<usize> {
    if !stream_pos.is_multiple_of(4) {
        return Err(Error::InvalidField {
            field: "FPDU stream position (FPDUs are 4-byte aligned)",
            value: stream_pos as u64,
        });
    }
    let n = ulpdu.len();
    let ulpdu_len = u16::try_from(n).map_err(|_| Error::InvalidField {
        field: "ULPDU length",
        value: n as u64,
    })?;
    let plain = fpdu_len(n);
    // The plain FPDU as 4-byte chunks; the last chunk is the CRC.
    let plain_byte = |i: usize| -> u8 {
        match i {
            0 | 1 => ulpdu_len.to_be_bytes()[i],
            i if i < LENGTH_FIELD_LEN + n => ulpdu[i - LENGTH_FIELD_LEN],
            _ => 0,
        }
    };
    let mut out = 0;
    let mut pos = stream_pos;
    let mut len_field_pos = None;
    let mut hasher = Crc32c::new();
    for chunk in 0..plain / 4 {
        if marker_due(pos) {
            let ptr = match len_field_pos {
                None => 0,
                Some(at) => pos - at,
            };
            let ptr = u16::try_from(ptr).map_err(|_| Error::InvalidField {
                field: "FPDU too long for a marker pointer",
                value: ptr as u64,
            })?;
            check("marked FPDU buffer", buf, out + MARKER_LEN)?;
            let m = &mut buf[out..out + MARKER_LEN];
            m[..2].fill(0);
            m[2..].copy_from_slice(&ptr.to_be_bytes());
            hasher.update(&buf[out..out + MARKER_LEN]);
            out += MARKER_LEN;
            pos += MARKER_LEN;
        }
        if len_field_pos.is_none() {
            len_field_pos = Some(pos);
        }
        check("marked FPDU buffer", buf, out + 4)?;
        let is_crc = chunk == plain / 4 - 1;
        if is_crc {
            let c = if crc { hasher.finish() } else { 0 };
            buf[out..out + 4].copy_from_slice(&c.to_le_bytes());
        } else {
            for k in 0..4 {
                buf[out + k] = plain_byte(chunk * 4 + k);
            }
            hasher.update(&buf[out..out + 4]);
        }
        out += 4;
        pos += 4;
    }
    Ok(out)
}

/// What [`unmark`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unmarked {
    /// Stream bytes the FPDU took, markers included.
    pub consumed: usize,
    /// Bytes of the plain FPDU written to the output.
    pub written: usize,
    /// Markers removed.
    pub markers: usize,
    /// The CRC32c over the marked bytes, as the FPDU should carry it.
    pub computed_crc: u32,
}

/// Reads one marked FPDU that starts `stream_pos` bytes into the peer's
/// full-operation stream (a marker may come first) and writes the plain FPDU
/// to `out`. Each marker's FPDU pointer is checked.
pub fn unmark(input: &[u8], stream_pos: usize, out: &mut [u8]) -> Result<Unmarked> {
    if !stream_pos.is_multiple_of(4) {
        return Err(Error::InvalidField {
            field: "FPDU stream position (FPDUs are 4-byte aligned)",
            value: stream_pos as u64,
        });
    }
    let mut i = 0;
    let mut pos = stream_pos;
    let mut written = 0;
    let mut markers = 0;
    let mut len_field_pos = None;
    let mut plain = usize::MAX;
    let mut hasher = Crc32c::new();
    while written < plain {
        if marker_due(pos) {
            check("marked FPDU", input, i + MARKER_LEN)?;
            let ptr = usize::from(get_u16(input, i + 2..i + 4));
            let want = len_field_pos.map_or(0, |at| pos - at);
            if ptr != want {
                return Err(Error::InvalidField {
                    field: "MPA marker FPDU pointer",
                    value: ptr as u64,
                });
            }
            // A marker is covered by the CRC of the FPDU it belongs to, even
            // one right before the CRC field.
            hasher.update(&input[i..i + MARKER_LEN]);
            i += MARKER_LEN;
            pos += MARKER_LEN;
            markers += 1;
        }
        if len_field_pos.is_none() {
            len_field_pos = Some(pos);
        }
        check("marked FPDU", input, i + 4)?;
        check("unmarked FPDU buffer", out, written + 4)?;
        let chunk = &input[i..i + 4];
        out[written..written + 4].copy_from_slice(chunk);
        if plain == usize::MAX {
            plain = fpdu_len(usize::from(get_u16(chunk, 0..2)));
        }
        if written + CRC_LEN != plain {
            hasher.update(chunk);
        }
        i += 4;
        pos += 4;
        written += 4;
    }
    Ok(Unmarked {
        consumed: i,
        written,
        markers,
        computed_crc: hasher.finish(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // siwcrc_rping.pcap frame 6 (Request) and siw_rping.pcap frame 8 (Reply).
    const REQ_CRC: [u8; 24] = *b"MPA ID Req Frame\x50\x02\x00\x04\x00\x01\x00\x01";
    const REP: [u8; 24] = *b"MPA ID Rep Frame\x10\x02\x00\x04\x00\x01\x00\x01";

    #[test]
    fn golden_start_frames() {
        let f = StartFrame::new_checked(&REQ_CRC[..]).unwrap();
        let r = StartFrameRepr::parse(&f).unwrap();
        assert_eq!(r.kind, Kind::Request);
        assert!(r.crc && !r.markers && !r.reject);
        assert_eq!(r.revision, 2);
        assert_eq!(
            r.ird_ord,
            Some(IrdOrd {
                ird: 1,
                ord: 1,
                ..IrdOrd::default()
            })
        );
        assert_eq!(r.ulp_private_data_len, 0);
        assert_eq!(r.to_string(), "MPA Request rev=2 CRC ird=1 ord=1");
        let mut buf = [0u8; 24];
        r.emit(&mut StartFrame::new_unchecked(&mut buf[..]), &[])
            .unwrap();
        assert_eq!(buf, REQ_CRC);

        let r = StartFrameRepr::parse(&StartFrame::new_checked(&REP[..]).unwrap()).unwrap();
        assert_eq!(r.kind, Kind::Reply);
        assert!(!r.crc);
    }

    #[test]
    fn malformed_start_frames() {
        let mut bad = REP;
        bad[0] = b'X';
        assert_eq!(
            StartFrameRepr::parse(&StartFrame::new_unchecked(&bad[..])),
            Err(Error::BadMpaKey)
        );
        let mut bad = REP;
        bad[17] = 3;
        assert!(matches!(
            StartFrameRepr::parse(&StartFrame::new_unchecked(&bad[..])),
            Err(Error::UnsupportedVersion { value: 3, .. })
        ));
        let mut bad = REP;
        bad[19] = 5; // five bytes announced, four there
        assert!(matches!(
            StartFrame::new_checked(&bad[..]),
            Err(Error::Truncated { .. })
        ));
        let mut bad = [0u8; 20 + 513];
        bad[..20].copy_from_slice(&REP[..20]);
        bad[18..20].copy_from_slice(&513u16.to_be_bytes());
        assert!(matches!(
            StartFrameRepr::parse(&StartFrame::new_unchecked(&bad[..])),
            Err(Error::InvalidField { .. })
        ));
        // Revision 1 reserves the enhanced bit: ignored, as siw does; the
        // four bytes are the application's.
        let mut rev1 = REP;
        rev1[17] = 1;
        let r = StartFrameRepr::parse(&StartFrame::new_unchecked(&rev1[..])).unwrap();
        assert_eq!((r.ird_ord, r.ulp_private_data_len), (None, 4));
        // Nor is one written with the flag.
        let mut r1 = StartFrameRepr::parse(&StartFrame::new_unchecked(&REP[..])).unwrap();
        r1.revision = 1;
        let mut buf = [0u8; 24];
        assert!(
            r1.emit(&mut StartFrame::new_unchecked(&mut buf[..]), &[])
                .is_err()
        );
        // Revision 2 with the flag but no room for the block.
        let mut bad = REP;
        bad[19] = 3;
        assert!(matches!(
            StartFrameRepr::parse(&StartFrame::new_unchecked(&bad[..23])),
            Err(Error::InvalidField { .. })
        ));
        assert!(StartFrame::new_checked(&REP[..19]).is_err());
    }

    #[test]
    fn ird_ord_bits() {
        let io = IrdOrd {
            peer_to_peer: true,
            send_rtr: false,
            ird: 128,
            write_rtr: true,
            read_rtr: true,
            ord: IrdOrd::NOT_NEGOTIATED,
        };
        assert_eq!(io.to_bytes(), [0x80, 0x80, 0xff, 0xff]);
        assert_eq!(IrdOrd::from_bytes(io.to_bytes()), io);
    }

    // siwcrc_rping.pcap frame 10: a Send FPDU with CRC32c.
    const SEND_FPDU: [u8; 40] = [
        0x00, 0x22, 0x41, 0x43, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x55, 0x7b, 0x4d, 0xc0, 0xfe, 0x30, 0x2b, 0xe9,
        0x6f, 0x00, 0x00, 0x00, 0x00, 0x40, 0x8c, 0x15, 0x3b, 0xcc,
    ];

    #[test]
    fn golden_fpdu() {
        let f = Fpdu::new_checked(&SEND_FPDU[..]).unwrap();
        assert_eq!(f.ulpdu_len(), 34);
        assert_eq!(f.total_len(), 40);
        assert_eq!(f.pad(), &[] as &[u8]);
        assert_eq!(f.crc(), 0xcc3b_158c);
        f.check_crc(true).unwrap();
        let mut out = [0u8; 40];
        assert_eq!(emit(&mut out, f.ulpdu(), true).unwrap(), 40);
        assert_eq!(out, SEND_FPDU);
        let mut bad = SEND_FPDU;
        bad[20] ^= 0x80;
        let f = Fpdu::new_checked(&bad[..]).unwrap();
        assert!(matches!(f.check_crc(true), Err(Error::BadCrc32c { .. })));
        assert!(f.check_crc(false).is_ok());
        assert!(Fpdu::new_checked(&SEND_FPDU[..39]).is_err());
        assert!(Fpdu::new_checked(&SEND_FPDU[..1]).is_err());
    }

    #[test]
    fn pads() {
        assert_eq!(pad_len(34), 0);
        assert_eq!(pad_len(16), 2);
        assert_eq!(pad_len(1442), 0);
        assert_eq!(fpdu_len(16), 24);
    }

    fn rfc_send_ulpdu(msn: u8) -> [u8; 42] {
        let mut u = [0u8; 42];
        u[0] = 0x41;
        u[1] = 0x43;
        u[13] = msn; // MSN, ULPDU bytes 10..14
        u
    }

    #[test]
    fn rfc5044_figure5_first_fpdu_with_marker() {
        let mut buf = [0u8; 64];
        let n = emit_marked(&mut buf, 0, &rfc_send_ulpdu(1), true).unwrap();
        assert_eq!(n, 52);
        assert_eq!(&buf[..8], &[0, 0, 0, 0, 0x00, 0x2a, 0x41, 0x43]);
        assert_eq!(&buf[48..52], &[0x52, 0x23, 0x99, 0x83]);
        let mut plain = [0u8; 48];
        let u = unmark(&buf[..n], 0, &mut plain).unwrap();
        assert_eq!(u.consumed, 52);
        assert_eq!(u.written, 48);
        assert_eq!(u.markers, 1);
        assert_eq!(u.computed_crc, 0x8399_2352);
        assert_eq!(
            Fpdu::new_checked(&plain[..]).unwrap().ulpdu(),
            &rfc_send_ulpdu(1)
        );
    }

    #[test]
    fn rfc5044_figure6_marker_inside_fpdu() {
        let mut buf = [0u8; 64];
        let n = emit_marked(&mut buf, 0x1ec, &rfc_send_ulpdu(2), true).unwrap();
        assert_eq!(n, 52);
        assert_eq!(&buf[20..24], &[0, 0, 0, 0x14]);
        assert_eq!(&buf[48..52], &[0x84, 0x92, 0x58, 0x98]);
        let mut plain = [0u8; 48];
        let u = unmark(&buf[..n], 0x1ec, &mut plain).unwrap();
        assert_eq!(u.markers, 1);
        assert_eq!(u.computed_crc, 0x9858_9284);
        // A wrong pointer is caught.
        buf[23] = 0x10;
        assert!(unmark(&buf[..n], 0x1ec, &mut plain).is_err());
        // So is a misaligned position.
        assert!(unmark(&buf[..n], 0x1ed, &mut plain).is_err());
        assert!(emit_marked(&mut buf, 2, &[], true).is_err());
        // And a truncated input.
        assert!(unmark(&buf[..n - 1], 0x1ec, &mut plain).is_err());
    }

    proptest! {
        #[test]
        fn marked_round_trip(pos in (0usize..4096).prop_map(|p| p * 4),
                             ulpdu in proptest::collection::vec(any::<u8>(), 0..1500),
                             crc: bool) {
            let mut marked = vec![0u8; 4096];
            let n = emit_marked(&mut marked, pos, &ulpdu, crc).unwrap();
            let mut plain = vec![0u8; 4096];
            let u = unmark(&marked[..n], pos, &mut plain).unwrap();
            prop_assert_eq!(u.consumed, n);
            prop_assert_eq!(u.written, fpdu_len(ulpdu.len()));
            prop_assert_eq!(n, u.written + 4 * u.markers);
            let f = Fpdu::new_checked(&plain[..u.written]).unwrap();
            prop_assert_eq!(f.ulpdu(), &ulpdu[..]);
            if crc {
                prop_assert_eq!(f.crc(), u.computed_crc);
            } else {
                prop_assert_eq!(f.crc(), 0);
            }
        }

        #[test]
        fn start_frame_round_trip(reply: bool, m: bool, c: bool, r: bool, res in 0u8..16,
                                  rev in 1u8..3, io: Option<(bool, bool, u16, bool, bool, u16)>,
                                  ulp in proptest::collection::vec(any::<u8>(), 0..500)) {
            let ird_ord = io.filter(|_| rev == 2).map(|(p, s, i, w, rd, o)| IrdOrd {
                peer_to_peer: p, send_rtr: s, ird: i & 0x3fff, write_rtr: w, read_rtr: rd,
                ord: o & 0x3fff });
            let repr = StartFrameRepr {
                kind: if reply { Kind::Reply } else { Kind::Request },
                markers: m, crc: c, reject: r, reserved_flags: res, revision: rev, ird_ord,
                ulp_private_data_len: ulp.len(),
            };
            let mut buf = vec![0u8; repr.buffer_len()];
            repr.emit(&mut StartFrame::new_unchecked(&mut buf[..]), &ulp).unwrap();
            let f = StartFrame::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(StartFrameRepr::parse(&f).unwrap(), repr);
            let pd = f.private_data();
            prop_assert_eq!(&pd[pd.len() - ulp.len()..], &ulp[..]);
        }

        #[test]
        fn plain_round_trip(ulpdu in proptest::collection::vec(any::<u8>(), 0..1500)) {
            let mut buf = vec![0u8; 2048];
            let n = emit(&mut buf, &ulpdu, true).unwrap();
            let f = Fpdu::new_checked(&buf[..n]).unwrap();
            prop_assert_eq!(f.ulpdu(), &ulpdu[..]);
            prop_assert!(f.check_crc(true).is_ok());
        }
    }
}
