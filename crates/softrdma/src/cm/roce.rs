//! Connecting RC QPs over RoCEv2 as rdma_cm does: the IB connection
//! manager's REQ, REP and RTU, as UD MADs between the devices' QP 1
//! (`softrdma_wire::cm`), addressed as rdma_cm addresses them (an IPv4
//! address and a port of rdma_cm's TCP port space); DREQ and DREP to end.
//! A peer is Linux's rdma_cm (rping, perftest `-R`, any librdmacm
//! application on rxe or a RoCE NIC) or softrdma.
//!
//! The same calls connect the QPs of a RoCE device opened through
//! libibverbs (rxe, a NIC): there the kernel's rdma_cm exchanges the
//! messages (librdmacm; `docs/ibverbs.md`).
//!
//! Every RoCEv2 peer sends its CM messages to UDP port 4791, so a device
//! that takes part is one bound to port 4791.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};

use softrdma_wire::cm::{self as wire, Body, Ids, Rej, Rep, Req};
use softrdma_wire::mad::MAD_LEN;

use super::{ConnInfo, RcOptions};
use crate::provider::gsi::{Arrival, Connection, Waiter};
use crate::provider::ibverbs::rdmacm::{self, CmFailure, CmListener, CmOutcome, CmParams};
use crate::provider::ibverbs::{HwContext, HwQp};
use crate::provider::udp::{Shared, send_mad};
use crate::verbs::Mtu;
use crate::verbs::{Context, Qp, QpAttr, QpState, VerbsError};

/// Bytes of private data an application may put in a REQ (rdma_cm's
/// header takes the rest).
pub const REQ_PRIVATE_DATA_MAX: usize = wire::REQ_PRIVATE_DATA_LEN - wire::RDMA_CM_HEADER_LEN;
/// Bytes of private data a REP may carry.
pub const REP_PRIVATE_DATA_MAX: usize = wire::REP_PRIVATE_DATA_LEN;

/// How long each side waits for an answer before it sends its message
/// again, and how many times it sends it.
pub(super) const RESEND_AFTER: Duration = Duration::from_millis(1000);
pub(super) const SENDS: u32 = 6;
/// The longest extra wait an MRA may ask for.
const MRA_MAX: Duration = Duration::from_secs(60);

/// Why a connection (or a UD resolution, `cm::roce_ud`) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The QP or the device.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The peer rejected it (IBTA reason; 8: nothing listens on that port,
    /// 28: its application or rdma_cm said no; a SIDR_REP's status 1 and 2
    /// read as these).
    #[error("the peer rejected the connection (CM reason {reason}{})", reason_name(*.reason))]
    Rejected {
        /// Why.
        reason: u16,
        /// The peer's private data (an application's reject).
        private_data: Vec<u8>,
    },
    /// No answer came.
    #[error("no answer from {peer} to the CM {what} ({sends} sent, {waited:?})")]
    NoAnswer {
        /// Whom it was sent to.
        peer: Ipv4Addr,
        /// What went unanswered.
        what: &'static str,
        /// Times it was sent.
        sends: u32,
        /// How long it waited.
        waited: Duration,
    },
    /// No request (REQ, SIDR_REQ) came within the time given.
    #[error("no connection request came within {0:?}")]
    NoClient(Duration),
    /// The peer's message was not one that fits.
    #[error("bad CM message from {peer}: {what}")]
    Protocol {
        /// From whom.
        peer: Ipv4Addr,
        /// What was wrong.
        what: String,
    },
    /// rdma_cm through librdmacm (a RoCE device of the ibverbs provider).
    #[error("rdma_cm: {0}")]
    Rdmacm(String),
}

/// The parameters of a device's rdma_cm connection from `o`.
fn cm_params(o: &RcOptions, private_data: &[u8]) -> CmParams {
    CmParams {
        private_data: private_data.to_vec(),
        responder_resources: o.max_dest_rd_atomic,
        initiator_depth: o.max_rd_atomic,
        retry_count: o.retry_cnt,
        rnr_retry_count: o.rnr_retry,
        access: o.access,
        timeout: Some(o.timeout),
        min_rnr_timer: Some(o.min_rnr_timer),
    }
}

fn cm_error(e: CmFailure) -> ConnectError {
    match e {
        // librdmacm's status of a REJECTED event on IB is the REJ's reason.
        CmFailure::Rejected {
            status,
            private_data,
        } => ConnectError::Rejected {
            reason: u16::try_from(status).unwrap_or(wire::REJ_CONSUMER),
            private_data,
        },
        CmFailure::Refused => ConnectError::Rejected {
            reason: wire::REJ_INVALID_SERVICE_ID,
            private_data: Vec::new(),
        },
        CmFailure::Other(s) => ConnectError::Rdmacm(s),
    }
}

/// A RoCE device of the ibverbs provider, or None; an error for an iWARP one.
fn hw_roce(qp: &Qp) -> Result<Option<(&HwContext, &Arc<HwQp>)>, ConnectError> {
    match (qp.context().hw(), qp.hw()) {
        (Some(hw), _) if hw.iwarp => Err(VerbsError::Invalid(format!(
            "{} is an iWARP device: its QPs connect with cm::iwarp",
            hw.name
        ))
        .into()),
        (Some(hw), Some(hq)) => Ok(Some((hw, hq))),
        _ => Ok(None),
    }
}

fn connected(out: CmOutcome) -> Connected {
    Connected {
        peer: *out.peer.ip(),
        remote_qpn: out.remote_qpn,
        private_data: out.private_data,
        initiator_depth: out.initiator_depth,
        responder_resources: out.responder_resources,
    }
}

fn reason_name(reason: u16) -> &'static str {
    match reason {
        wire::REJ_TIMEOUT => ": timeout",
        wire::REJ_INVALID_SERVICE_ID => ": nothing listens on that port",
        // Linux's rdma_cm sends it for its own refusals too (a QP type the
        // port space does not have, a request it cannot take).
        wire::REJ_CONSUMER => ": the peer's application or rdma_cm refused it",
        _ => "",
    }
}

/// The RoCEv2 device of `ctx`, if it can do rdma_cm.
pub(super) fn rdma_cm_device(ctx: &Context) -> Result<&Shared, VerbsError> {
    let d = ctx.roce_device("rdma_cm over RoCE")?;
    if d.local_addr().port() != softrdma_wire::ROCEV2_UDP_PORT || d.shared.is_shared_port() {
        return Err(VerbsError::Invalid(format!(
            "rdma_cm over RoCE needs a device of its own on UDP port 4791 (peers send their \
             CM messages there); this one is at {}{}",
            d.local_addr(),
            if d.shared.is_shared_port() {
                " through the hostd"
            } else {
                ""
            }
        )));
    }
    Ok(&d.shared)
}

/// Checks `qp` is a new RC QP of a RoCEv2 device; says whether it has an
/// SRQ.
fn check_qp(qp: &Qp) -> Result<bool, VerbsError> {
    let Some(srq) = qp.roce_rc() else {
        return Err(VerbsError::Invalid(
            "rdma_cm over RoCE connects RC QPs of RoCEv2 devices".into(),
        ));
    };
    if !matches!(qp.state(), QpState::Reset | QpState::Init) {
        return Err(VerbsError::Invalid(
            "the QP to connect must be new (RESET, or INIT as rdma_create_qp leaves it)".into(),
        ));
    }
    Ok(srq)
}

pub(super) fn send(shared: &Shared, to: Ipv4Addr, m: &[u8; MAD_LEN]) -> Result<(), VerbsError> {
    send_mad(shared, to, m).map_err(|source| VerbsError::Io {
        what: format!("sending a CM message to {to}"),
        source,
    })
}

/// rdma_cm's header of a request from `me` to `peer` in exchange `id`.
pub(super) fn rdma_cm_header(me: Ipv4Addr, peer: Ipv4Addr, id: u32) -> wire::RdmaCmHeader {
    wire::RdmaCmHeader {
        // rdma_cm's own port on this side: any, as an ephemeral one.
        src_port: 0xc000 | (id as u16 & 0x3fff),
        src: me.octets(),
        dst: peer.octets(),
    }
}

/// The transaction ID of exchange `id` for QP `qpn` (any value the peer
/// echoes; unique while both are).
pub(super) fn transaction_id(id: u32, qpn: u32) -> u64 {
    u64::from(id) | u64::from(qpn) << 32
}

/// An IPv4-mapped GID.
fn gid(ip: Ipv4Addr) -> [u8; 16] {
    Ipv4Addr::to_ipv6_mapped(&ip).octets()
}

/// A CA GUID for the device at `ip` (an EUI-64 of a locally administered
/// MAC made of the address; peers only echo it).
fn guid(ip: Ipv4Addr) -> u64 {
    let o = ip.octets();
    u64::from_be_bytes([0x02, 0x00, o[0], 0xff, 0xfe, o[1], o[2], o[3]])
}

fn random_psn() -> Result<u32, VerbsError> {
    getrandom::u32()
        .map(|v| v & 0xff_ffff)
        .map_err(|e| VerbsError::Invalid(format!("no randomness: {e}")))
}

/// Brings `qp` to RTS towards the peer's QP `remote_qpn` at `peer`,
/// sending from `sq_psn` and taking the peer's from `rq_psn`.
///
/// Each side's Starting PSN (REQ, REP) is the PSN it expects to receive
/// first: Linux's CM gives the other side's send queue that PSN
/// (`rxe_rping.pcap`, `rxe_write_bw_cm.pcap`: the active side sends from
/// the REP's, the passive side from the REQ's).
fn bring_up(
    qp: &Qp,
    sq_psn: u32,
    peer: Ipv4Addr,
    remote_qpn: u32,
    rq_psn: u32,
    mtu: Mtu,
    o: &RcOptions,
) -> Result<(), VerbsError> {
    let local = ConnInfo {
        addr: qp.context().local_addr(),
        qpn: qp.qpn(),
        psn: sq_psn,
        mtu: qp.context().query_port().active_mtu,
        rkey: 0,
        va: 0,
        len: 0,
    };
    let remote = ConnInfo {
        addr: SocketAddrV4::new(peer, softrdma_wire::ROCEV2_UDP_PORT),
        qpn: remote_qpn,
        psn: rq_psn,
        mtu,
        ..local
    };
    super::connect(qp, &local, &remote, o)
}

/// What an established connection learnt of its peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connected {
    /// The peer's address.
    pub peer: Ipv4Addr,
    /// The peer's QP.
    pub remote_qpn: u32,
    /// The peer's private data (of its REP, or the application's part of
    /// its REQ).
    pub private_data: Vec<u8>,
    /// READs and atomics this side may have outstanding.
    pub initiator_depth: u8,
    /// READs and atomics this side serves at once.
    pub responder_resources: u8,
}

/// Connects RC `qp` (new: in RESET, or INIT with receives posted) to the rdma_cm listener at `to` (the
/// peer's IPv4 address and rdma_cm port), with `private_data` (at most
/// [`REQ_PRIVATE_DATA_MAX`] bytes) in the REQ. `o` gives the QP's
/// settings; its READ/atomic depths are offered and cut to the peer's.
pub fn connect(
    qp: &Qp,
    to: SocketAddrV4,
    private_data: &[u8],
    o: &RcOptions,
) -> Result<Connected, ConnectError> {
    if private_data.len() > REQ_PRIVATE_DATA_MAX {
        return Err(VerbsError::Invalid(format!(
            "at most {REQ_PRIVATE_DATA_MAX} bytes of private data in a REQ"
        ))
        .into());
    }
    if let Some((hw, hq)) = hw_roce(qp)? {
        qp.check_unconnected()?;
        let out = rdmacm::connect(hw, hq, to, &cm_params(o, private_data)).map_err(cm_error)?;
        return Ok(connected(out));
    }
    let shared = rdma_cm_device(qp.context())?;
    let srq = check_qp(qp)?;
    let me = *qp.context().local_addr().ip();
    let peer = *to.ip();
    let psn = random_psn()?;
    let local_comm_id = shared.gsi.new_comm_id();
    let tid = transaction_id(local_comm_id, qp.qpn());
    let mtu = qp.context().query_port().active_mtu;
    let mut pd = [0u8; wire::REQ_PRIVATE_DATA_LEN];
    rdma_cm_header(me, peer, local_comm_id).emit(&mut pd);
    pd[wire::RDMA_CM_HEADER_LEN..][..private_data.len()].copy_from_slice(private_data);
    let req = Req {
        local_comm_id,
        service_id: wire::rdma_cm_service_id(to.port()),
        local_ca_guid: guid(me),
        local_qpn: qp.qpn(),
        responder_resources: o.max_dest_rd_atomic,
        initiator_depth: o.max_rd_atomic,
        remote_cm_response_timeout: 20,
        transport: 0,
        starting_psn: psn,
        local_cm_response_timeout: 20,
        retry_count: o.retry_cnt & 7,
        pkey: 0xffff,
        path_mtu: mtu.code(),
        rnr_retry_count: o.rnr_retry & 7,
        max_cm_retries: 15,
        srq,
        primary: wire::Path {
            local_gid: gid(me),
            remote_gid: gid(peer),
            flow_label: 0,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
            local_ack_timeout: o.timeout & 0x1f,
        },
        private_data: pd,
    };
    let mut m = [0u8; MAD_LEN];
    req.emit(tid, &mut m);
    let w = Waiter::Exchange(local_comm_id);
    shared.gsi.register(w);
    let _unregister = Unregister(shared, w);
    let started = Instant::now();
    // However the peer answers with MRAs, the REQ's exchange ends by then.
    let overall = started + RESEND_AFTER * SENDS + MRA_MAX;
    let mut sends = 0;
    let mut mra_for = 0;
    let mut deadline = Instant::now();
    let rep = loop {
        if Instant::now() >= deadline {
            if sends == SENDS || Instant::now() >= overall {
                return Err(ConnectError::NoAnswer {
                    peer,
                    what: "REQ",
                    sends,
                    waited: started.elapsed(),
                });
            }
            send(shared, peer, &m)?;
            sends += 1;
            deadline = Instant::now() + RESEND_AFTER;
        }
        let Some(Arrival { from, msg }) = shared.gsi.wait(w, deadline) else {
            continue;
        };
        if from != peer {
            continue;
        }
        match msg.body {
            Body::Rep(rep) => break rep,
            Body::Rej(rej) => {
                return Err(ConnectError::Rejected {
                    reason: rej.reason,
                    private_data: rej.private_data.to_vec(),
                });
            }
            // The peer's application takes its time: wait as it asks, once
            // per REQ sent (as Linux, which heeds an MRA only then).
            Body::Mra(mra) if mra.message_mraed == 0 && mra_for != sends => {
                mra_for = sends;
                let asked = Duration::from_nanos(4096u64 << mra.service_timeout.min(31));
                deadline = (Instant::now() + asked.clamp(RESEND_AFTER, MRA_MAX)).min(overall);
            }
            _ => {}
        }
    };
    // This side's depths, cut to what the peer serves and issues.
    let initiator_depth = o.max_rd_atomic.min(rep.responder_resources).max(1);
    let opts = RcOptions {
        max_rd_atomic: initiator_depth,
        rnr_retry: rep.rnr_retry_count,
        ..*o
    };
    if let Err(e) = bring_up(qp, rep.starting_psn, peer, rep.local_qpn, psn, mtu, &opts) {
        reject(
            shared,
            peer,
            tid,
            rep.ids.remote,
            rep.ids.local,
            1,
            wire::REJ_CONSUMER,
            &[],
        );
        to_error(qp);
        return Err(e.into());
    }
    let ids = Ids {
        local: local_comm_id,
        remote: rep.ids.local,
    };
    let mut rtu = [0u8; MAD_LEN];
    ids.emit_as(wire::RTU, tid, &mut rtu);
    shared.gsi.establish(
        local_comm_id,
        Connection {
            qpn: qp.qpn(),
            peer,
            remote_comm_id: rep.ids.local,
            remote_qpn: rep.local_qpn,
            tid,
            active: true,
        },
    );
    // A lost RTU (or one that could not be sent) is made good when the
    // peer repeats its REP: the progress thread answers with the RTU.
    let _ = send_mad(shared, peer, &rtu);
    Ok(Connected {
        peer,
        remote_qpn: rep.local_qpn,
        private_data: rep.private_data.to_vec(),
        initiator_depth,
        responder_resources: o.max_dest_rd_atomic,
    })
}

/// Sends a REJ of message `rejected` (0 REQ, 1 REP) for `reason`.
#[allow(clippy::too_many_arguments)]
fn reject(
    shared: &Shared,
    to: Ipv4Addr,
    tid: u64,
    local: u32,
    remote: u32,
    rejected: u8,
    reason: u16,
    private_data: &[u8],
) {
    let mut pd = [0u8; wire::REJ_PRIVATE_DATA_LEN];
    let n = private_data.len().min(pd.len());
    pd[..n].copy_from_slice(&private_data[..n]);
    let mut m = [0u8; MAD_LEN];
    Rej {
        ids: Ids { local, remote },
        message_rejected: rejected,
        reason,
        private_data: pd,
    }
    .emit(tid, &mut m);
    let _ = send_mad(shared, to, &m);
}

/// Unregisters a waiter when dropped.
pub(super) struct Unregister<'a>(pub(super) &'a Shared, pub(super) Waiter);

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.0.gsi.unregister(self.1);
    }
}

/// A connection request a listener took.
#[derive(Debug, Clone)]
pub struct ConnRequest {
    /// The active side's address and rdma_cm port.
    pub from: SocketAddrV4,
    /// The application's private data (after rdma_cm's header).
    pub private_data: Vec<u8>,
    /// READs and atomics the active side will serve at once.
    pub responder_resources: u8,
    /// READs and atomics it will have outstanding.
    pub initiator_depth: u8,
}

/// What the listening application answers a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Accept, with this private data in the REP.
    Accept(Vec<u8>),
    /// Reject, with this private data in the REJ.
    Reject(Vec<u8>),
}

/// A listened-on rdma_cm service (a port of its TCP or UDP port space) of a
/// RoCEv2 device: the GSI queues its requests until this goes.
#[derive(Debug)]
pub(super) struct Service {
    ctx: Context,
    port: u16,
    id: u64,
}

impl Service {
    /// Listens on `port` of the port space whose service IDs `id_of` makes
    /// (`space`: how errors name it).
    pub(super) fn bind(
        ctx: &Context,
        port: u16,
        id_of: fn(u16) -> u64,
        space: &str,
    ) -> Result<Service, VerbsError> {
        let shared = rdma_cm_device(ctx)?;
        if port == 0 {
            return Err(VerbsError::Invalid("an rdma_cm port is 1..=65535".into()));
        }
        let id = id_of(port);
        if !shared.gsi.register(Waiter::Service(id)) {
            return Err(VerbsError::Invalid(format!(
                "rdma_cm {space}port {port} is listened on already"
            )));
        }
        Ok(Service {
            ctx: ctx.clone(),
            port,
            id,
        })
    }

    pub(super) fn port(&self) -> u16 {
        self.port
    }

    pub(super) fn shared(&self) -> Result<&Shared, VerbsError> {
        rdma_cm_device(&self.ctx)
    }

    /// The next request `take` keeps (it drops the others), waiting as
    /// long as `waited` (`None`: for ever); `usable` is asked every second
    /// and its error ends the wait (the QP moved on).
    pub(super) fn next<T>(
        &self,
        waited: Option<Duration>,
        usable: impl Fn() -> Result<(), VerbsError>,
        mut take: impl FnMut(Arrival) -> Option<T>,
    ) -> Result<T, ConnectError> {
        let shared = self.shared()?;
        let started = Instant::now();
        loop {
            usable()?;
            let slice = Instant::now() + Duration::from_secs(1);
            let deadline = waited
                .and_then(|w| started.checked_add(w))
                .map_or(slice, |end| end.min(slice));
            let Some(a) = shared.gsi.wait(Waiter::Service(self.id), deadline) else {
                if let Some(w) = waited
                    && started.elapsed() >= w
                {
                    return Err(ConnectError::NoClient(w));
                }
                continue;
            };
            if let Some(t) = take(a) {
                return Ok(t);
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(shared) = self.shared() {
            shared.gsi.unregister(Waiter::Service(self.id));
        }
    }
}

/// A listener on an rdma_cm port of a RoCEv2 device.
#[derive(Debug)]
pub struct Listener(Taking);

/// How a listener takes its requests.
#[derive(Debug)]
enum Taking {
    /// softrdma's RoCEv2: the GSI's queue.
    Gsi(Service),
    /// A device of the ibverbs provider: rdma_cm through librdmacm.
    Rdmacm(CmListener),
}

impl Listener {
    /// Listens on rdma_cm port `port` (TCP port space) of `ctx`'s device
    /// (one bound to UDP port 4791).
    pub fn bind(ctx: &Context, port: u16) -> Result<Listener, VerbsError> {
        if let Some(hw) = ctx.hw() {
            if hw.iwarp {
                return Err(VerbsError::Invalid(format!(
                    "{} is an iWARP device: listen with cm::iwarp",
                    hw.name
                )));
            }
            let l = CmListener::bind(hw, port).map_err(VerbsError::Invalid)?;
            return Ok(Listener(Taking::Rdmacm(l)));
        }
        Service::bind(ctx, port, wire::rdma_cm_service_id, "").map(|s| Listener(Taking::Gsi(s)))
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        match &self.0 {
            Taking::Gsi(s) => s.port(),
            Taking::Rdmacm(l) => l.local_addr().port(),
        }
    }

    /// Takes the next REQ for `qp` (new, RC, in RESET or INIT), lets `decide`
    /// accept or reject it, and on acceptance brings `qp` to RTS, sends the
    /// REP and waits for the RTU. Waits for a REQ as long as `waited`
    /// (`None`: for ever).
    pub fn accept(
        &self,
        qp: &Qp,
        o: &RcOptions,
        decide: impl FnOnce(&ConnRequest) -> Decision,
        waited: Option<Duration>,
    ) -> Result<Connected, ConnectError> {
        let service = match &self.0 {
            Taking::Gsi(s) => s,
            Taking::Rdmacm(l) => return accept_rdmacm(l, qp, o, decide, waited),
        };
        let shared = service.shared()?;
        let srq = check_qp(qp)?;
        let usable = || {
            if matches!(qp.state(), QpState::Reset | QpState::Init) {
                Ok(())
            } else {
                Err(VerbsError::Invalid(
                    "the QP was moved on while it waited for a connection".into(),
                ))
            }
        };
        let (from, tid, req) = service.next(waited, usable, |a| match a.msg.body {
            Body::Req(req) if !shared.gsi.is_taken(a.from, req.local_comm_id) => {
                Some((a.from, a.msg.tid, req))
            }
            _ => None,
        })?;
        // A REJ of the REQ (this side has no communication ID yet).
        let reject_req = |reason: u16, private_data: &[u8]| {
            reject(
                shared,
                from,
                tid,
                0,
                req.local_comm_id,
                0,
                reason,
                private_data,
            );
        };
        let header = match wire::RdmaCmHeader::parse(&req.private_data) {
            Ok(h) => h,
            Err(e) => {
                reject_req(wire::REJ_CONSUMER, &[]);
                return Err(ConnectError::Protocol {
                    peer: from,
                    what: format!("a REQ without rdma_cm's header ({e})"),
                });
            }
        };
        if req.transport != 0 || req.local_qpn <= 1 {
            let reason = if req.transport != 0 {
                wire::REJ_INVALID_TRANSPORT
            } else {
                wire::REJ_CONSUMER
            };
            reject_req(reason, &[]);
            return Err(ConnectError::Protocol {
                peer: from,
                what: format!(
                    "a REQ for transport {} from QP {} (RC from a QP above 1 only)",
                    req.transport, req.local_qpn
                ),
            });
        }
        let request = ConnRequest {
            from: SocketAddrV4::new(Ipv4Addr::from(header.src), header.src_port),
            private_data: req.private_data[wire::RDMA_CM_HEADER_LEN..].to_vec(),
            responder_resources: req.responder_resources,
            initiator_depth: req.initiator_depth,
        };
        let reply = match decide(&request) {
            Decision::Reject(pd) => {
                reject_req(wire::REJ_CONSUMER, &pd);
                return Err(ConnectError::Rejected {
                    reason: wire::REJ_CONSUMER,
                    private_data: pd,
                });
            }
            Decision::Accept(pd) => pd,
        };
        if reply.len() > REP_PRIVATE_DATA_MAX {
            reject_req(wire::REJ_CONSUMER, &[]);
            return Err(VerbsError::Invalid(format!(
                "at most {REP_PRIVATE_DATA_MAX} bytes of private data in a REP"
            ))
            .into());
        }
        let local_comm_id = shared.gsi.new_comm_id();
        let w = Waiter::Exchange(local_comm_id);
        shared.gsi.register(w);
        let _unregister = Unregister(shared, w);
        shared
            .gsi
            .note_passive(from, req.local_comm_id, local_comm_id);
        let psn = random_psn()?;
        let responder_resources = o.max_dest_rd_atomic.min(req.initiator_depth).max(1);
        let initiator_depth = o.max_rd_atomic.min(req.responder_resources).max(1);
        let mtu = Mtu::from_code(req.path_mtu)
            .unwrap_or(Mtu::Mtu1024)
            .min(qp.context().query_port().active_mtu);
        let opts = RcOptions {
            max_rd_atomic: initiator_depth,
            retry_cnt: req.retry_count,
            rnr_retry: req.rnr_retry_count,
            ..*o
        };
        if let Err(e) = bring_up(qp, req.starting_psn, from, req.local_qpn, psn, mtu, &opts) {
            let (local, remote) = (local_comm_id, req.local_comm_id);
            reject(shared, from, tid, local, remote, 0, wire::REJ_CONSUMER, &[]);
            to_error(qp);
            return Err(e.into());
        }
        let mut pd = [0u8; wire::REP_PRIVATE_DATA_LEN];
        pd[..reply.len()].copy_from_slice(&reply);
        let mut m = [0u8; MAD_LEN];
        Rep {
            ids: Ids {
                local: local_comm_id,
                remote: req.local_comm_id,
            },
            local_qpn: qp.qpn(),
            starting_psn: psn,
            responder_resources,
            initiator_depth,
            target_ack_delay: 15,
            rnr_retry_count: o.rnr_retry & 7,
            srq,
            local_ca_guid: guid(*qp.context().local_addr().ip()),
            private_data: pd,
        }
        .emit(tid, &mut m);
        let connection = Connection {
            qpn: qp.qpn(),
            peer: from,
            remote_comm_id: req.local_comm_id,
            remote_qpn: req.local_qpn,
            tid,
            active: false,
        };
        let connected = Connected {
            peer: from,
            remote_qpn: req.local_qpn,
            private_data: request.private_data,
            initiator_depth,
            responder_resources,
        };
        // Recorded before the REP goes: a DREQ that comes at any time after
        // it ends the connection (the progress thread moves the QP to ERR).
        shared.gsi.establish(local_comm_id, connection);
        let fail = |e: ConnectError| {
            shared.gsi.take_connection_of(qp.qpn());
            to_error(qp);
            Err(e)
        };
        let begun = Instant::now();
        let mut mra_honoured = false;
        let mut sends = 0;
        while sends < SENDS {
            if let Err(e) = send(shared, from, &m) {
                return fail(e.into());
            }
            sends += 1;
            let mut deadline = Instant::now() + RESEND_AFTER;
            while let Some(a) = shared.gsi.wait(w, deadline) {
                // Only the active side's messages for this exchange count.
                if a.from != from {
                    continue;
                }
                match a.msg.body {
                    Body::Rtu(ids) if ids.local == req.local_comm_id => return Ok(connected),
                    Body::Rej(rej) if rej.ids.local == req.local_comm_id => {
                        return fail(ConnectError::Rejected {
                            reason: rej.reason,
                            private_data: rej.private_data.to_vec(),
                        });
                    }
                    Body::Dreq(d) if d.ids.local == req.local_comm_id => {
                        return fail(ConnectError::Protocol {
                            peer: from,
                            what: "a DREQ before the RTU".into(),
                        });
                    }
                    // The active side needs longer for its RTU: once.
                    Body::Mra(mra) if mra.message_mraed == 1 && !mra_honoured => {
                        mra_honoured = true;
                        let asked = Duration::from_nanos(4096u64 << mra.service_timeout.min(31));
                        deadline = Instant::now() + asked.clamp(RESEND_AFTER, MRA_MAX);
                    }
                    // A repeated REQ: the REP again, at once.
                    Body::Req(r) if r.local_comm_id == req.local_comm_id => break,
                    _ => {}
                }
            }
            // The RTU may be lost while the peer already sends on the QP:
            // that it does is as good an answer (IBTA 12.9.8.3).
            if qp.stats().is_some_and(|s| s.responses_sent > 0) {
                return Ok(connected);
            }
            if qp.state() == QpState::Err {
                // The peer's DREQ (handled by the progress thread).
                return fail(ConnectError::Protocol {
                    peer: from,
                    what: "disconnected before the RTU".into(),
                });
            }
        }
        fail(ConnectError::NoAnswer {
            peer: from,
            what: "REP",
            sends: SENDS,
            waited: begun.elapsed(),
        })
    }
}

/// [`Listener::accept`] on a device of the ibverbs provider.
fn accept_rdmacm(
    l: &CmListener,
    qp: &Qp,
    o: &RcOptions,
    decide: impl FnOnce(&ConnRequest) -> Decision,
    waited: Option<Duration>,
) -> Result<Connected, ConnectError> {
    let Some((hw, hq)) = hw_roce(qp)? else {
        return Err(VerbsError::Invalid(
            "this listener is a libibverbs device's: accept a QP of that device".into(),
        )
        .into());
    };
    qp.check_unconnected()?;
    let mut said_no = None;
    let mut too_long = false;
    let got = l.accept(
        hw,
        hq,
        &cm_params(o, &[]),
        |r| {
            let request = ConnRequest {
                from: r.from,
                private_data: r.private_data.clone(),
                responder_resources: r.responder_resources,
                initiator_depth: r.initiator_depth,
            };
            match decide(&request) {
                Decision::Accept(pd) if pd.len() > REP_PRIVATE_DATA_MAX => {
                    too_long = true;
                    Err(Vec::new())
                }
                Decision::Accept(pd) => Ok(pd),
                Decision::Reject(pd) => {
                    said_no = Some(pd.clone());
                    Err(pd)
                }
            }
        },
        waited.map(crate::verbs::deadline_after),
    );
    match got {
        Ok(Some(out)) => Ok(connected(out)),
        Ok(None) => Err(ConnectError::NoClient(waited.unwrap_or_default())),
        Err(_) if too_long => Err(VerbsError::Invalid(format!(
            "at most {REP_PRIVATE_DATA_MAX} bytes of private data in a REP"
        ))
        .into()),
        Err(_) if said_no.is_some() => Err(ConnectError::Rejected {
            reason: wire::REJ_CONSUMER,
            private_data: said_no.unwrap_or_default(),
        }),
        Err(e) => Err(cm_error(e)),
    }
}

fn to_error(qp: &Qp) {
    let _ = qp.modify(
        &QpAttr {
            state: Some(QpState::Err),
            ..QpAttr::default()
        },
        None,
    );
}

/// Disconnects `qp`'s rdma_cm connection: a DREQ to the peer, then the QP
/// to ERR (its outstanding work flushed). Waits up to a second for the
/// peer's DREP, sending the DREQ twice (a libibverbs device's kernel CM
/// sends and repeats it on its own: this returns at once). A QP without a
/// connection is only moved to ERR. (Dropping a connected QP sends the DREQ
/// too.)
pub fn disconnect(qp: &Qp) -> Result<(), VerbsError> {
    if let Some(hq) = qp.hw() {
        return hq.disconnect().map_err(VerbsError::Invalid);
    }
    let shared = rdma_cm_device(qp.context())?;
    let mut sent = Ok(());
    if let Some((local, c)) = shared.gsi.take_connection_of(qp.qpn()) {
        let w = Waiter::Exchange(local);
        shared.gsi.register(w);
        let _unregister = Unregister(shared, w);
        let m = crate::provider::gsi::dreq_for(local, &c);
        'sends: for _ in 0..2 {
            sent = send(shared, c.peer, &m);
            if sent.is_err() {
                break;
            }
            let deadline = Instant::now() + RESEND_AFTER / 2;
            while let Some(a) = shared.gsi.wait(w, deadline) {
                if a.from == c.peer && matches!(a.msg.body, Body::Drep(_)) {
                    break 'sends;
                }
            }
        }
    }
    to_error(qp);
    sent
}
