//! The InfiniBand connection manager's messages (IBTA 12.6): the bodies of
//! the CM MADs that rdma_cm exchanges over QP1 on RoCE (REQ, REP, RTU, REJ,
//! MRA, DREQ, DREP, and SIDR_REQ and SIDR_REP for UD). Offsets are from the
//! MAD's start; the layouts are checked against `rxe_rping.pcap`
//! (WIRE-NOTES 4) and, for SIDR, against captures of udaddy between rxe
//! devices.

use crate::bytes::{get_u16, get_u32, get_u64, set_u16, set_u32, set_u64};
use crate::mad::{self, HEADER_LEN, Header, MAD_LEN};
use crate::{Error, Result};

/// MRA attribute ID.
pub const MRA: u16 = 0x0011;
/// REP attribute ID.
pub const REP: u16 = 0x0013;
/// RTU attribute ID.
pub const RTU: u16 = 0x0014;
/// DREQ attribute ID.
pub const DREQ: u16 = 0x0015;
/// DREP attribute ID.
pub const DREP: u16 = 0x0016;
/// SIDR_REQ attribute ID: a UD service's QP asked for.
pub const SIDR_REQ: u16 = 0x0017;
/// SIDR_REP attribute ID: the answer.
pub const SIDR_REP: u16 = 0x0018;

/// Bytes of private data a REQ carries.
pub const REQ_PRIVATE_DATA_LEN: usize = 92;
/// Bytes of private data a REP carries.
pub const REP_PRIVATE_DATA_LEN: usize = 196;
/// Bytes of private data a REJ carries.
pub const REJ_PRIVATE_DATA_LEN: usize = 148;
/// Bytes of private data a SIDR_REQ carries.
pub const SIDR_REQ_PRIVATE_DATA_LEN: usize = 216;
/// Bytes of private data a SIDR_REP carries.
pub const SIDR_REP_PRIVATE_DATA_LEN: usize = 136;
/// SIDR_REP status 0: the QP is valid.
pub const SIDR_VALID: u8 = 0;
/// SIDR_REP status 1: no such service (what Linux's CM answers when
/// nothing listens).
pub const SIDR_UNSUPPORTED: u8 = 1;
/// SIDR_REP status 2: refused by the service's application (`rdma_reject`)
/// or by its rdma_cm (a QP type its port space does not have).
pub const SIDR_REJECT: u8 = 2;
/// REJ reason 4, "timeout": the other side did not answer in time.
pub const REJ_TIMEOUT: u16 = 4;
/// REJ reason 6, "invalid communication ID": a message for no connection.
pub const REJ_INVALID_COMM_ID: u16 = 6;
/// REJ reason 8, "invalid Service ID": no listener for the REQ's service
/// (what Linux's cm.c answers then).
pub const REJ_INVALID_SERVICE_ID: u16 = 8;
/// REJ reason 9, "invalid transport service type" (not RC).
pub const REJ_INVALID_TRANSPORT: u16 = 9;
/// REJ reason 28, "consumer defined": the application said no
/// (`rdma_reject`).
pub const REJ_CONSUMER: u16 = 28;

/// The rdma_cm service ID of a TCP port-space port (RDMA_PS_TCP).
pub fn rdma_cm_service_id(port: u16) -> u64 {
    0x0106_0000 | u64::from(port)
}

/// The rdma_cm port of a TCP port-space service ID, if it is one.
pub fn rdma_cm_port(service_id: u64) -> Option<u16> {
    (service_id >> 16 == 0x0106).then_some(service_id as u16)
}

/// The rdma_cm service ID of a UDP port-space port (RDMA_PS_UDP: UD QPs,
/// found with SIDR).
pub fn rdma_cm_udp_service_id(port: u16) -> u64 {
    0x0111_0000 | u64::from(port)
}

/// The rdma_cm port of a UDP port-space service ID, if it is one.
pub fn rdma_cm_udp_port(service_id: u64) -> Option<u16> {
    (service_id >> 16 == 0x0111).then_some(service_id as u16)
}

/// The Q_Key rdma_cm gives UD QPs of its UDP port space (RDMA_UDP_QKEY).
pub const RDMA_CM_UDP_QKEY: u32 = 0x0123_4567;

/// A CM MAD's header for a message of `attribute`, in transaction `tid`.
fn emit_header(out: &mut [u8], attribute: u16, tid: u64) {
    out[..MAD_LEN].fill(0);
    mad::Repr {
        mgmt_class: mad::CLASS_CM,
        class_version: mad::CM_CLASS_VERSION,
        method: mad::METHOD_SEND,
        status: 0,
        class_specific: 0,
        transaction_id: tid,
        attribute_id: attribute,
        attribute_modifier: 0,
    }
    .emit(&mut Header::new_unchecked(&mut out[..HEADER_LEN]));
}

fn u24(b: &[u8], at: usize) -> u32 {
    get_u32(b, at..at + 4) >> 8
}

fn set_u24(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

/// A received CM message: its transaction ID and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The MAD's transaction ID (one per connection).
    pub tid: u64,
    /// The message.
    pub body: Body,
}

/// The CM messages softrdma speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Connection request.
    Req(Req),
    /// Connection reply.
    Rep(Rep),
    /// Ready to use: the active side took the REP.
    Rtu(Ids),
    /// Reject.
    Rej(Rej),
    /// Message received acknowledgement: the answer comes later.
    Mra(Mra),
    /// Disconnection request.
    Dreq(Dreq),
    /// Disconnection reply.
    Drep(Ids),
    /// Service ID resolution request (UD).
    SidrReq(SidrReq),
    /// Service ID resolution reply.
    SidrRep(SidrRep),
}

impl Message {
    /// Parses a whole CM MAD (class, version and method checked); `None`
    /// for a MAD of another class or a CM message softrdma does not speak
    /// (LAP, APR).
    pub fn parse(m: &[u8]) -> Result<Option<Message>> {
        crate::bytes::check("CM MAD", m, MAD_LEN)?;
        let h = mad::Repr::parse(&Header::new_checked(&m[..HEADER_LEN])?)?;
        if h.mgmt_class != mad::CLASS_CM {
            return Ok(None);
        }
        if h.class_version != mad::CM_CLASS_VERSION {
            return Err(Error::UnsupportedVersion {
                field: "CM class version",
                value: h.class_version,
            });
        }
        if h.method != mad::METHOD_SEND {
            return Ok(None);
        }
        let body = match h.attribute_id {
            mad::CM_REQ => Body::Req(Req::parse(m)),
            REP => Body::Rep(Rep::parse(m)),
            RTU => Body::Rtu(Ids::parse(m)),
            mad::CM_REJ => Body::Rej(Rej::parse(m)),
            MRA => Body::Mra(Mra::parse(m)),
            DREQ => Body::Dreq(Dreq::parse(m)),
            DREP => Body::Drep(Ids::parse(m)),
            SIDR_REQ => Body::SidrReq(SidrReq::parse(m)),
            SIDR_REP => Body::SidrRep(SidrRep::parse(m)),
            _ => return Ok(None),
        };
        Ok(Some(Message {
            tid: h.transaction_id,
            body,
        }))
    }
}

/// The two communication IDs every message after the REQ starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ids {
    /// The sender's.
    pub local: u32,
    /// The receiver's.
    pub remote: u32,
}

impl Ids {
    /// The IDs of a CM MAD (`None` if it is too short to hold them).
    pub fn of(mad: &[u8]) -> Option<Ids> {
        (mad.len() >= 32).then(|| Ids::parse(mad))
    }

    fn parse(m: &[u8]) -> Ids {
        Ids {
            local: get_u32(m, 24..28),
            remote: get_u32(m, 28..32),
        }
    }

    fn emit(&self, m: &mut [u8]) {
        set_u32(m, 24..28, self.local);
        set_u32(m, 28..32, self.remote);
    }

    /// An RTU (`attribute` RTU) or DREP (DREP): the IDs and no private data.
    pub fn emit_as(&self, attribute: u16, tid: u64, out: &mut [u8]) {
        emit_header(out, attribute, tid);
        self.emit(out);
    }
}

/// A REQ's primary path (RoCE: GIDs are IPv4-mapped addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// The sender's GID.
    pub local_gid: [u8; 16],
    /// The receiver's GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// The local ACK timeout (5 bits: 4.096 µs × 2^n).
    pub local_ack_timeout: u8,
}

/// A connection request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Req {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The service asked for (rdma_cm: [`rdma_cm_service_id`]).
    pub service_id: u64,
    /// The sender's CA GUID.
    pub local_ca_guid: u64,
    /// The sender's QP.
    pub local_qpn: u32,
    /// RDMA READs and atomics the sender will serve at once.
    pub responder_resources: u8,
    /// RDMA READs and atomics the sender will have outstanding.
    pub initiator_depth: u8,
    /// How long the sender waits for an answer (5 bits: 4.096 µs × 2^n).
    pub remote_cm_response_timeout: u8,
    /// 0 RC, 1 UC.
    pub transport: u8,
    /// The first PSN the sender sends.
    pub starting_psn: u32,
    /// How long the receiver of a REP may take (5 bits).
    pub local_cm_response_timeout: u8,
    /// Transport retries the passive side should make (3 bits).
    pub retry_count: u8,
    /// P_Key.
    pub pkey: u16,
    /// Path MTU code (1 = 256 ... 5 = 4096).
    pub path_mtu: u8,
    /// RNR retries the passive side should make (3 bits; 7: forever).
    pub rnr_retry_count: u8,
    /// Times the sender will send this REQ (4 bits).
    pub max_cm_retries: u8,
    /// Whether the sender's QP takes receives from an SRQ.
    pub srq: bool,
    /// The primary path.
    pub primary: Path,
    /// Private data (rdma_cm: its header, then the application's).
    pub private_data: [u8; REQ_PRIVATE_DATA_LEN],
}

impl Req {
    fn parse(m: &[u8]) -> Req {
        let gid = |at: usize| {
            let mut g = [0u8; 16];
            g.copy_from_slice(&m[at..at + 16]);
            g
        };
        let primary = Path {
            local_gid: gid(80),
            remote_gid: gid(96),
            flow_label: get_u32(m, 112..116) >> 12,
            traffic_class: m[116],
            hop_limit: m[117],
            sl: m[118] >> 4,
            local_ack_timeout: m[119] >> 3,
        };
        let mut private_data = [0u8; REQ_PRIVATE_DATA_LEN];
        private_data.copy_from_slice(&m[164..MAD_LEN]);
        Req {
            local_comm_id: get_u32(m, 24..28),
            service_id: get_u64(m, 32..40),
            local_ca_guid: get_u64(m, 40..48),
            local_qpn: u24(m, 56),
            responder_resources: m[59],
            initiator_depth: m[63],
            remote_cm_response_timeout: m[67] >> 3,
            transport: (m[67] >> 1) & 3,
            starting_psn: u24(m, 68),
            local_cm_response_timeout: m[71] >> 3,
            retry_count: m[71] & 7,
            pkey: get_u16(m, 72..74),
            path_mtu: m[74] >> 4,
            rnr_retry_count: m[74] & 7,
            max_cm_retries: m[75] >> 4,
            srq: m[75] & 0x08 != 0,
            primary,
            private_data,
        }
    }

    /// Writes the REQ, a whole MAD, into `out`.
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, mad::CM_REQ, tid);
        set_u32(out, 24..28, self.local_comm_id);
        set_u64(out, 32..40, self.service_id);
        set_u64(out, 40..48, self.local_ca_guid);
        set_u24(out, 56, self.local_qpn);
        out[59] = self.responder_resources;
        out[63] = self.initiator_depth;
        out[67] = (self.remote_cm_response_timeout << 3) | ((self.transport & 3) << 1);
        set_u24(out, 68, self.starting_psn);
        out[71] = (self.local_cm_response_timeout << 3) | (self.retry_count & 7);
        set_u16(out, 72..74, self.pkey);
        out[74] = (self.path_mtu << 4) | (self.rnr_retry_count & 7);
        out[75] = (self.max_cm_retries << 4) | (u8::from(self.srq) << 3);
        // Permissive LIDs: RoCE has none.
        set_u16(out, 76..78, 0xffff);
        set_u16(out, 78..80, 0xffff);
        let p = &self.primary;
        out[80..96].copy_from_slice(&p.local_gid);
        out[96..112].copy_from_slice(&p.remote_gid);
        set_u32(out, 112..116, (p.flow_label & 0xf_ffff) << 12);
        out[116] = p.traffic_class;
        out[117] = p.hop_limit;
        out[118] = p.sl << 4;
        out[119] = p.local_ack_timeout << 3;
        out[164..MAD_LEN].copy_from_slice(&self.private_data);
    }
}

/// A connection reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rep {
    /// Its communication IDs (remote: the REQ's local).
    pub ids: Ids,
    /// The sender's QP.
    pub local_qpn: u32,
    /// The first PSN the sender sends.
    pub starting_psn: u32,
    /// RDMA READs and atomics the sender will serve at once.
    pub responder_resources: u8,
    /// RDMA READs and atomics the sender will have outstanding.
    pub initiator_depth: u8,
    /// The sender's ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// RNR retries the active side should make (3 bits).
    pub rnr_retry_count: u8,
    /// Whether the sender's QP takes receives from an SRQ.
    pub srq: bool,
    /// The sender's CA GUID.
    pub local_ca_guid: u64,
    /// Private data.
    pub private_data: [u8; REP_PRIVATE_DATA_LEN],
}

impl Rep {
    fn parse(m: &[u8]) -> Rep {
        let mut private_data = [0u8; REP_PRIVATE_DATA_LEN];
        private_data.copy_from_slice(&m[60..MAD_LEN]);
        Rep {
            ids: Ids::parse(m),
            local_qpn: u24(m, 36),
            starting_psn: u24(m, 44),
            responder_resources: m[48],
            initiator_depth: m[49],
            target_ack_delay: m[50] >> 3,
            rnr_retry_count: m[51] >> 5,
            srq: m[51] & 0x10 != 0,
            local_ca_guid: get_u64(m, 52..60),
            private_data,
        }
    }

    /// Writes the REP, a whole MAD, into `out`.
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, REP, tid);
        self.ids.emit(out);
        set_u24(out, 36, self.local_qpn);
        set_u24(out, 44, self.starting_psn);
        out[48] = self.responder_resources;
        out[49] = self.initiator_depth;
        out[50] = self.target_ack_delay << 3;
        out[51] = (self.rnr_retry_count << 5) | (u8::from(self.srq) << 4);
        set_u64(out, 52..60, self.local_ca_guid);
        out[60..MAD_LEN].copy_from_slice(&self.private_data);
    }
}

/// A reject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    /// Its communication IDs.
    pub ids: Ids,
    /// Which message it rejects: 0 REQ, 1 REP, 2 other.
    pub message_rejected: u8,
    /// Why (IBTA table 112).
    pub reason: u16,
    /// Private data (rdma_cm: the application's, on a consumer reject).
    pub private_data: [u8; REJ_PRIVATE_DATA_LEN],
}

impl Rej {
    fn parse(m: &[u8]) -> Rej {
        let mut private_data = [0u8; REJ_PRIVATE_DATA_LEN];
        private_data.copy_from_slice(&m[108..MAD_LEN]);
        Rej {
            ids: Ids::parse(m),
            message_rejected: m[32] >> 6,
            reason: get_u16(m, 34..36),
            private_data,
        }
    }

    /// The REJ of the REQ from the peer's communication ID `req_local_id`
    /// for `reason`, as Linux's `cm_issue_rej` builds one for a REQ it
    /// cannot match: Local Communication ID 0 (no connection was made),
    /// Message Rejected 0 (the REQ), no ARI, no private data. It goes out
    /// with the REQ's transaction ID.
    pub fn of_req(req_local_id: u32, reason: u16) -> Rej {
        Rej {
            ids: Ids {
                local: 0,
                remote: req_local_id,
            },
            message_rejected: 0,
            reason,
            private_data: [0; REJ_PRIVATE_DATA_LEN],
        }
    }

    /// Writes the REJ, a whole MAD, into `out`.
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, mad::CM_REJ, tid);
        self.ids.emit(out);
        out[32] = self.message_rejected << 6;
        set_u16(out, 34..36, self.reason);
        out[108..MAD_LEN].copy_from_slice(&self.private_data);
    }
}

/// "Message received": the sender needs longer to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mra {
    /// Its communication IDs.
    pub ids: Ids,
    /// Which message it acknowledges: 0 REQ, 1 REP, 2 other.
    pub message_mraed: u8,
    /// How long the answer may take (5 bits: 4.096 µs × 2^n).
    pub service_timeout: u8,
}

impl Mra {
    fn parse(m: &[u8]) -> Mra {
        Mra {
            ids: Ids::parse(m),
            message_mraed: m[32] >> 6,
            service_timeout: m[33] >> 3,
        }
    }

    /// Writes the MRA, a whole MAD, into `out`.
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, MRA, tid);
        self.ids.emit(out);
        out[32] = self.message_mraed << 6;
        out[33] = self.service_timeout << 3;
    }
}

/// A disconnection request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dreq {
    /// Its communication IDs.
    pub ids: Ids,
    /// The receiver's QP.
    pub remote_qpn: u32,
}

impl Dreq {
    fn parse(m: &[u8]) -> Dreq {
        Dreq {
            ids: Ids::parse(m),
            remote_qpn: u24(m, 32),
        }
    }

    /// Writes the DREQ, a whole MAD, into `out`.
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, DREQ, tid);
        self.ids.emit(out);
        set_u24(out, 32, self.remote_qpn);
    }
}

/// A service ID resolution request: which UD QP serves `service_id`?
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrReq {
    /// The sender's ID of the request (the reply echoes it).
    pub request_id: u32,
    /// P_Key.
    pub pkey: u16,
    /// The service asked for (rdma_cm: [`rdma_cm_udp_service_id`]).
    pub service_id: u64,
    /// Private data (rdma_cm: its header, then the application's).
    pub private_data: [u8; SIDR_REQ_PRIVATE_DATA_LEN],
}

impl SidrReq {
    fn parse(m: &[u8]) -> SidrReq {
        let mut private_data = [0u8; SIDR_REQ_PRIVATE_DATA_LEN];
        private_data.copy_from_slice(&m[40..MAD_LEN]);
        SidrReq {
            request_id: get_u32(m, 24..28),
            pkey: get_u16(m, 28..30),
            service_id: get_u64(m, 32..40),
            private_data,
        }
    }

    /// Writes the SIDR_REQ, a whole MAD, into `out`.
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, SIDR_REQ, tid);
        set_u32(out, 24..28, self.request_id);
        set_u16(out, 28..30, self.pkey);
        set_u64(out, 32..40, self.service_id);
        out[40..MAD_LEN].copy_from_slice(&self.private_data);
    }
}

/// A service ID resolution reply: the UD QP and Q_Key of the service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrRep {
    /// The request's ID.
    pub request_id: u32,
    /// [`SIDR_VALID`], [`SIDR_UNSUPPORTED`], [`SIDR_REJECT`] or another
    /// of IBTA table 119.
    pub status: u8,
    /// The service's QP (24 bits).
    pub qpn: u32,
    /// The service ID answered.
    pub service_id: u64,
    /// The Q_Key datagrams to the QP must carry.
    pub qkey: u32,
    /// Private data.
    pub private_data: [u8; SIDR_REP_PRIVATE_DATA_LEN],
}

impl SidrRep {
    fn parse(m: &[u8]) -> SidrRep {
        let mut private_data = [0u8; SIDR_REP_PRIVATE_DATA_LEN];
        private_data.copy_from_slice(&m[120..MAD_LEN]);
        SidrRep {
            request_id: get_u32(m, 24..28),
            status: m[28],
            qpn: u24(m, 32),
            service_id: get_u64(m, 36..44),
            qkey: get_u32(m, 44..48),
            private_data,
        }
    }

    /// The reply to `req` with `status`, QP `qpn` and Q_Key `qkey`, no
    /// private data.
    pub fn answer(req: &SidrReq, status: u8, qpn: u32, qkey: u32) -> SidrRep {
        SidrRep {
            request_id: req.request_id,
            status,
            qpn,
            service_id: req.service_id,
            qkey,
            private_data: [0; SIDR_REP_PRIVATE_DATA_LEN],
        }
    }

    /// The reply to `req` with `status` and no QP, as Linux's CM answers a
    /// request nothing listens for.
    pub fn refusal(req: &SidrReq, status: u8) -> SidrRep {
        SidrRep::answer(req, status, 0, 0)
    }

    /// Writes the SIDR_REP, a whole MAD, into `out` (no additional
    /// information, no ClassPortInfo).
    pub fn emit(&self, tid: u64, out: &mut [u8]) {
        emit_header(out, SIDR_REP, tid);
        set_u32(out, 24..28, self.request_id);
        out[28] = self.status;
        set_u24(out, 32, self.qpn);
        set_u64(out, 36..44, self.service_id);
        set_u32(out, 44..48, self.qkey);
        out[120..MAD_LEN].copy_from_slice(&self.private_data);
    }
}

/// The rdma_cm header at the start of a REQ's private data (the kernel's
/// `cma_hdr`, IPv4 form): version 0, IP version 4, the active side's port,
/// both addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaCmHeader {
    /// The active side's rdma_cm port.
    pub src_port: u16,
    /// The active side's address.
    pub src: [u8; 4],
    /// The passive side's address.
    pub dst: [u8; 4],
}

/// Bytes the rdma_cm header takes of a REQ's private data.
pub const RDMA_CM_HEADER_LEN: usize = 36;

impl RdmaCmHeader {
    /// Parses the header; IPv6 and other versions are refused.
    pub fn parse(pd: &[u8]) -> Result<RdmaCmHeader> {
        crate::bytes::check("rdma_cm header", pd, RDMA_CM_HEADER_LEN)?;
        if pd[0] != 0 {
            return Err(Error::UnsupportedVersion {
                field: "rdma_cm header version",
                value: pd[0],
            });
        }
        if pd[1] >> 4 != 4 {
            return Err(Error::UnsupportedVersion {
                field: "rdma_cm IP version",
                value: pd[1] >> 4,
            });
        }
        let ip = |at: usize| [pd[at], pd[at + 1], pd[at + 2], pd[at + 3]];
        Ok(RdmaCmHeader {
            src_port: get_u16(pd, 2..4),
            src: ip(16),
            dst: ip(32),
        })
    }

    /// Writes the header into the first 36 bytes of `pd`.
    pub fn emit(&self, pd: &mut [u8]) {
        pd[..RDMA_CM_HEADER_LEN].fill(0);
        pd[1] = 4 << 4;
        set_u16(pd, 2..4, self.src_port);
        pd[16..20].copy_from_slice(&self.src);
        pd[32..36].copy_from_slice(&self.dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The MADs of `rxe_rping.pcap` frames 3 (REQ), 4 (REP), 5 (RTU), 42
    /// (DREQ) and 43 (DREP): the UDP payload after BTH and DETH, before
    /// the ICRC.
    fn frame(n: usize) -> Vec<u8> {
        let (prefix, zeros) = match n {
            3 => (
                "01070203000000000000000274b88d6c00100000000000006c8db8740000000000000000\
                 01061c0650540afffe63000300000000000000000000110100000001000000a02d3812a7\
                 ffff37f0ffffffff00000000000000000000ffff0a63000300000000000000000000ffff\
                 0a6300021e4c900000400098000000000000000000000000000000000000000000000000\
                 0000000000000000000000000000000000000000004092dd000000000000000000000000\
                 0a6300030000000000000000000000000a630002",
                56,
            ),
            4 => (
                "01070203000000000000000274b88d6c00130000000000007f566cd56c8db87400000000\
                 000011000000000041479f00010178e050540afffe630002",
                196,
            ),
            5 => (
                "01070203000000000000000274b88d6c00140000000000006c8db8747f566cd5",
                224,
            ),
            42 => (
                "01070203000000000000000274b88d6c00150000000000006c8db8747f566cd5000011",
                221,
            ),
            43 => (
                "01070203000000000000000274b88d6c00160000000000007f566cd56c8db874",
                224,
            ),
            _ => unreachable!(),
        };
        let mut m = hex(prefix);
        m.resize(m.len() + zeros, 0);
        assert_eq!(m.len(), MAD_LEN, "frame {n}");
        m
    }

    const TID: u64 = 0x2_74b8_8d6c;

    #[test]
    fn golden_req() {
        let m = frame(3);
        let msg = Message::parse(&m).unwrap().unwrap();
        assert_eq!(msg.tid, TID);
        let Body::Req(r) = &msg.body else {
            panic!("{msg:?}")
        };
        assert_eq!(r.local_comm_id, 0x6c8d_b874);
        assert_eq!(rdma_cm_port(r.service_id), Some(7174));
        assert_eq!(r.local_ca_guid, 0x5054_0aff_fe63_0003);
        assert_eq!(
            (r.local_qpn, r.responder_resources, r.initiator_depth),
            (0x11, 1, 1)
        );
        assert_eq!((r.remote_cm_response_timeout, r.transport), (20, 0));
        assert_eq!(
            (r.starting_psn, r.local_cm_response_timeout, r.retry_count),
            (0x2d_3812, 20, 7)
        );
        assert_eq!((r.pkey, r.path_mtu, r.rnr_retry_count), (0xffff, 3, 7));
        assert_eq!((r.max_cm_retries, r.srq), (15, false));
        let p = r.primary;
        assert_eq!(p.local_gid[12..], [10, 99, 0, 3]);
        assert_eq!(p.remote_gid[12..], [10, 99, 0, 2]);
        assert_eq!(
            p.local_gid[..12],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
        );
        assert_eq!(
            (p.flow_label, p.traffic_class, p.hop_limit, p.sl),
            (0x1e4c9, 0, 64, 0)
        );
        assert_eq!(p.local_ack_timeout, 19);
        let h = RdmaCmHeader::parse(&r.private_data).unwrap();
        assert_eq!(
            h,
            RdmaCmHeader {
                src_port: 37597,
                src: [10, 99, 0, 3],
                dst: [10, 99, 0, 2],
            }
        );
        let mut out = [0xaau8; MAD_LEN];
        r.emit(msg.tid, &mut out);
        assert_eq!(out[..], m[..]);
        let mut pd = [0xaau8; RDMA_CM_HEADER_LEN];
        h.emit(&mut pd);
        assert_eq!(pd[..], r.private_data[..RDMA_CM_HEADER_LEN]);
    }

    #[test]
    fn golden_rep_rtu_dreq_drep() {
        let m = frame(4);
        let msg = Message::parse(&m).unwrap().unwrap();
        let Body::Rep(r) = &msg.body else {
            panic!("{msg:?}")
        };
        assert_eq!(
            r.ids,
            Ids {
                local: 0x7f56_6cd5,
                remote: 0x6c8d_b874
            }
        );
        assert_eq!((r.local_qpn, r.starting_psn), (0x11, 0x41_479f));
        assert_eq!((r.responder_resources, r.initiator_depth), (1, 1));
        assert_eq!(
            (r.target_ack_delay, r.rnr_retry_count, r.srq),
            (15, 7, false)
        );
        assert_eq!(r.local_ca_guid, 0x5054_0aff_fe63_0002);
        let mut out = [0xaau8; MAD_LEN];
        r.emit(msg.tid, &mut out);
        assert_eq!(out[..], m[..]);

        let rtu = Ids {
            local: 0x6c8d_b874,
            remote: 0x7f56_6cd5,
        };
        let m = frame(5);
        assert_eq!(
            Message::parse(&m).unwrap().unwrap(),
            Message {
                tid: TID,
                body: Body::Rtu(rtu)
            }
        );
        rtu.emit_as(RTU, TID, &mut out);
        assert_eq!(out[..], m[..]);

        let m = frame(42);
        let dreq = Dreq {
            ids: rtu,
            remote_qpn: 0x11,
        };
        assert_eq!(Message::parse(&m).unwrap().unwrap().body, Body::Dreq(dreq));
        dreq.emit(TID, &mut out);
        assert_eq!(out[..], m[..]);

        let m = frame(43);
        let drep = Ids {
            local: 0x7f56_6cd5,
            remote: 0x6c8d_b874,
        };
        assert_eq!(Message::parse(&m).unwrap().unwrap().body, Body::Drep(drep));
        drep.emit_as(DREP, TID, &mut out);
        assert_eq!(out[..], m[..]);
    }

    /// udaddy's SIDR_REQ and SIDR_REP between two rxe devices
    /// (10.99.0.3 asks 10.99.0.2 for port 7174), recorded with the
    /// linux-rdma harness: the MADs, after BTH and DETH, before the ICRC.
    fn sidr_frame(rep: bool) -> Vec<u8> {
        let (prefix, zeros) = if rep {
            (
                "01070203000000000000000283a2fc180018000000000000\
                 18fca28300000000000011000000000001111c0601234567",
                208,
            )
        } else {
            (
                "01070203000000000000000283a2fc180017000000000000\
                 18fca283ffff00000000000001111c0600409aec\
                 0000000000000000000000000a630003\
                 0000000000000000000000000a630002",
                180,
            )
        };
        let mut m = hex(prefix);
        m.resize(m.len() + zeros, 0);
        assert_eq!(m.len(), MAD_LEN);
        m
    }

    #[test]
    fn golden_sidr_req_and_rep() {
        let m = sidr_frame(false);
        let msg = Message::parse(&m).unwrap().unwrap();
        assert_eq!(msg.tid, 0x2_83a2_fc18);
        let Body::SidrReq(r) = &msg.body else {
            panic!("{msg:?}")
        };
        assert_eq!((r.request_id, r.pkey), (0x18fc_a283, 0xffff));
        assert_eq!(r.service_id, rdma_cm_udp_service_id(7174));
        assert_eq!(rdma_cm_udp_port(r.service_id), Some(7174));
        assert_eq!(rdma_cm_port(r.service_id), None);
        assert_eq!(
            RdmaCmHeader::parse(&r.private_data).unwrap(),
            RdmaCmHeader {
                src_port: 39660,
                src: [10, 99, 0, 3],
                dst: [10, 99, 0, 2],
            }
        );
        let mut out = [0xaau8; MAD_LEN];
        r.emit(msg.tid, &mut out);
        assert_eq!(out[..], m[..]);

        let m = sidr_frame(true);
        let msg = Message::parse(&m).unwrap().unwrap();
        assert_eq!(msg.tid, 0x2_83a2_fc18);
        let Body::SidrRep(rep) = &msg.body else {
            panic!("{msg:?}")
        };
        assert_eq!(
            (rep.request_id, rep.status, rep.qpn, rep.qkey),
            (0x18fc_a283, SIDR_VALID, 0x11, RDMA_CM_UDP_QKEY)
        );
        assert_eq!(rep.service_id, r.service_id);
        assert!(rep.private_data.iter().all(|&b| b == 0));
        rep.emit(msg.tid, &mut out);
        assert_eq!(out[..], m[..]);
        // Linux's answer when nothing listens: the request's ID and
        // service, status 1, no QP.
        SidrRep::refusal(r, SIDR_UNSUPPORTED).emit(msg.tid, &mut out);
        let Body::SidrRep(no) = Message::parse(&out).unwrap().unwrap().body else {
            panic!()
        };
        assert_eq!(
            (no.request_id, no.status, no.qpn, no.qkey, no.service_id),
            (r.request_id, SIDR_UNSUPPORTED, 0, 0, r.service_id)
        );
    }

    #[test]
    fn rej_and_mra_round_trip_and_bad_mads_are_refused() {
        let mut pd = [0u8; REJ_PRIVATE_DATA_LEN];
        pd[0] = 7;
        let rej = Rej {
            ids: Ids {
                local: 1,
                remote: 2,
            },
            message_rejected: 0,
            reason: REJ_CONSUMER,
            private_data: pd,
        };
        let mut m = [0u8; MAD_LEN];
        rej.emit(9, &mut m);
        assert_eq!(
            Message::parse(&m).unwrap().unwrap().body,
            Body::Rej(rej.clone())
        );
        // The REJ Linux's CM sends for an unknown service: the REQ's
        // transaction ID, its local ID as the remote one, reason 8.
        let mut req = frame(3);
        let got = Message::parse(&req).unwrap().unwrap();
        let Body::Req(r) = &got.body else { panic!() };
        let mut out = [0xffu8; MAD_LEN];
        Rej::of_req(r.local_comm_id, REJ_INVALID_SERVICE_ID).emit(got.tid, &mut out);
        let parsed = Message::parse(&out).unwrap().unwrap();
        let Body::Rej(rej) = parsed.body else {
            panic!()
        };
        assert_eq!(parsed.tid, got.tid);
        assert_eq!((rej.ids.local, rej.ids.remote), (0, 0x6c8d_b874));
        assert_eq!((rej.message_rejected, rej.reason), (0, 8));
        assert_eq!(&out[32..34], &[0, 0], "no ARI");
        assert!(out[36..].iter().all(|&b| b == 0), "no private data");

        let mut mra = [0u8; MAD_LEN];
        emit_header(&mut mra, MRA, 3);
        mra[28..32].copy_from_slice(&5u32.to_be_bytes());
        mra[33] = 21 << 3;
        let want = Mra {
            ids: Ids {
                local: 0,
                remote: 5,
            },
            message_mraed: 0,
            service_timeout: 21,
        };
        assert_eq!(Message::parse(&mra).unwrap().unwrap().body, Body::Mra(want));
        let mut out = [0xffu8; MAD_LEN];
        want.emit(3, &mut out);
        assert_eq!(out, mra);

        assert!(Message::parse(&req[..255]).is_err());
        req[2] = 1;
        assert!(Message::parse(&req).is_err(), "class version 1");
        req[2] = 2;
        req[1] = 0x01;
        assert_eq!(Message::parse(&req).unwrap(), None, "not the CM class");
        req[1] = mad::CLASS_CM;
        req[17] = 0x19;
        assert_eq!(Message::parse(&req).unwrap(), None, "LAP");
        let mut h = [0u8; RDMA_CM_HEADER_LEN];
        h[1] = 0x60;
        assert!(RdmaCmHeader::parse(&h).is_err(), "IPv6");
        assert!(RdmaCmHeader::parse(&h[..10]).is_err());
    }
}
