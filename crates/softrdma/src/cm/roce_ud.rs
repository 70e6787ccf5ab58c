//! Finding a UD QP over RoCEv2 as rdma_cm does in its UDP port space
//! (RDMA_PS_UDP): the IB connection manager's service ID resolution, a
//! SIDR_REQ and its SIDR_REP between the devices' QP 1. The active side
//! asks which QP serves an IPv4 address and rdma_cm port; the passive
//! side's application answers with its UD QP and Q_Key. No connection is
//! made: the passive side learns the active side's QP from the first
//! datagram it receives (as udaddy and perftest's `-R -c UD` do).
//!
//! rdma_cm gives the UD QPs of this port space the Q_Key
//! [`RDMA_CM_UDP_QKEY`](softrdma_wire::cm::RDMA_CM_UDP_QKEY); a QP handed
//! over in RESET is brought to RTS with it here, as `rdma_create_qp` does.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use softrdma_wire::cm::{self as wire, Body, SidrRep, SidrReq};
use softrdma_wire::mad::MAD_LEN;

use super::roce::{
    ConnectError, Decision, RESEND_AFTER, SENDS, Service, Unregister, rdma_cm_device,
    rdma_cm_header, send, transaction_id,
};
use crate::provider::gsi::{Arrival, SidrKey, Waiter};
use crate::provider::udp::{Shared, send_mad};
use crate::verbs::{Context, Qp, QpState, VerbsError};

/// Bytes of private data an application may put in a SIDR_REQ (rdma_cm's
/// header takes the rest).
pub const REQ_PRIVATE_DATA_MAX: usize = wire::SIDR_REQ_PRIVATE_DATA_LEN - wire::RDMA_CM_HEADER_LEN;
/// Bytes of private data a SIDR_REP may carry.
pub const REP_PRIVATE_DATA_MAX: usize = wire::SIDR_REP_PRIVATE_DATA_LEN;

/// What the active side learnt: where to send its datagrams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The peer's address.
    pub peer: Ipv4Addr,
    /// The peer's UD QP.
    pub remote_qpn: u32,
    /// The Q_Key its datagrams must carry.
    pub qkey: u32,
    /// The peer's private data.
    pub private_data: Vec<u8>,
}

/// A resolution request a listener took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The active side's address and rdma_cm port.
    pub from: SocketAddrV4,
    /// The application's private data (after rdma_cm's header).
    pub private_data: Vec<u8>,
}

/// Checks `qp` is a UD QP of a RoCEv2 device and brings it to RTS with
/// rdma_cm's Q_Key if it is new.
fn ready(qp: &Qp) -> Result<(), VerbsError> {
    if !qp.is_roce_ud() {
        return Err(VerbsError::Invalid(
            "rdma_cm's UDP port space is for UD QPs of RoCEv2 devices".into(),
        ));
    }
    match qp.state() {
        QpState::Rts => Ok(()),
        QpState::Reset => super::ready_ud(qp, wire::RDMA_CM_UDP_QKEY, 0),
        s => Err(VerbsError::Invalid(format!(
            "the UD QP must be new (RESET) or ready to send (RTS), not {s:?}"
        ))),
    }
}

/// Asks the rdma_cm listener at `to` (the peer's IPv4 address and port of
/// the UDP port space) for its UD QP, with `private_data` (at most
/// [`REQ_PRIVATE_DATA_MAX`] bytes). `qp`, the UD QP that will send to it,
/// is brought to RTS with rdma_cm's Q_Key if it is in RESET. The peer's
/// Q_Key must be this QP's (Linux's rdma_cm refuses the answer too).
pub fn resolve(qp: &Qp, to: SocketAddrV4, private_data: &[u8]) -> Result<Resolved, ConnectError> {
    let shared = rdma_cm_device(qp.context())?;
    if private_data.len() > REQ_PRIVATE_DATA_MAX {
        return Err(VerbsError::Invalid(format!(
            "at most {REQ_PRIVATE_DATA_MAX} bytes of private data in a SIDR_REQ"
        ))
        .into());
    }
    ready(qp)?;
    let me = *qp.context().local_addr().ip();
    let peer = *to.ip();
    let request_id = shared.gsi.new_comm_id();
    let mut pd = [0u8; wire::SIDR_REQ_PRIVATE_DATA_LEN];
    rdma_cm_header(me, peer, request_id).emit(&mut pd);
    pd[wire::RDMA_CM_HEADER_LEN..][..private_data.len()].copy_from_slice(private_data);
    let req = SidrReq {
        request_id,
        pkey: 0xffff,
        service_id: wire::rdma_cm_udp_service_id(to.port()),
        private_data: pd,
    };
    let tid = transaction_id(request_id, qp.qpn());
    let mut m = [0u8; MAD_LEN];
    req.emit(tid, &mut m);
    let w = Waiter::Exchange(request_id);
    shared.gsi.register(w);
    let _unregister = Unregister(shared, w);
    let started = Instant::now();
    let mut sends = 0;
    let mut deadline = started;
    let rep = loop {
        if Instant::now() >= deadline {
            if sends == SENDS {
                return Err(ConnectError::NoAnswer {
                    peer,
                    what: "SIDR_REQ",
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
        if let Body::SidrRep(rep) = msg.body
            && from == peer
            && rep.service_id == req.service_id
        {
            break rep;
        }
    };
    let qkey = qp.query().qkey.unwrap_or(wire::RDMA_CM_UDP_QKEY);
    match rep.status {
        wire::SIDR_VALID if rep.qpn > 1 && rep.qkey != qkey => Err(ConnectError::Protocol {
            peer,
            what: format!(
                "the peer's QP takes Q_Key {:#010x}, this one {qkey:#010x} (rdma_cm gives both \
                 {:#010x})",
                rep.qkey,
                wire::RDMA_CM_UDP_QKEY
            ),
        }),
        wire::SIDR_VALID if rep.qpn > 1 => Ok(Resolved {
            peer,
            remote_qpn: rep.qpn,
            qkey: rep.qkey,
            private_data: rep.private_data.to_vec(),
        }),
        wire::SIDR_UNSUPPORTED => Err(ConnectError::Rejected {
            reason: wire::REJ_INVALID_SERVICE_ID,
            private_data: rep.private_data.to_vec(),
        }),
        wire::SIDR_REJECT => Err(ConnectError::Rejected {
            reason: wire::REJ_CONSUMER,
            private_data: rep.private_data.to_vec(),
        }),
        status => Err(ConnectError::Protocol {
            peer,
            what: format!("a SIDR_REP with status {status} and QP {}", rep.qpn),
        }),
    }
}

/// A listener on a port of rdma_cm's UDP port space of a RoCEv2 device.
#[derive(Debug)]
pub struct Listener(Service);

impl Listener {
    /// Listens on port `port` of rdma_cm's UDP port space of `ctx`'s
    /// device (one bound to UDP port 4791).
    pub fn bind(ctx: &Context, port: u16) -> Result<Listener, VerbsError> {
        Service::bind(ctx, port, wire::rdma_cm_udp_service_id, "UDP ").map(Listener)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.0.port()
    }

    /// Takes the next SIDR_REQ and lets `decide` answer it: with UD `qp`
    /// (brought to RTS with rdma_cm's Q_Key if in RESET) and its Q_Key on
    /// acceptance. Waits for a request as long as `waited` (`None`: for
    /// ever). A request asked again gets the same answer.
    pub fn accept(
        &self,
        qp: &Qp,
        decide: impl FnOnce(&Request) -> Decision,
        waited: Option<Duration>,
    ) -> Result<Request, ConnectError> {
        let shared = self.0.shared()?;
        ready(qp)?;
        let usable = || {
            if qp.state() == QpState::Rts {
                Ok(())
            } else {
                Err(VerbsError::Invalid(
                    "the QP was moved on while it waited for a request".into(),
                ))
            }
        };
        let (from, tid, req) = self.0.next(waited, usable, |a| match a.msg.body {
            Body::SidrReq(req) => Some((a.from, a.msg.tid, req)),
            _ => None,
        })?;
        let key = (from, req.request_id, req.service_id);
        // Whatever happens to this accept (`decide` may panic), the request
        // is answered or forgotten, so that its repeats are not dropped.
        let pending = Pending { shared, key };
        let answer = |status: u8, qpn: u32, qkey: u32, pd: &[u8]| {
            let mut rep = SidrRep::answer(&req, status, qpn, qkey);
            let n = pd.len().min(REP_PRIVATE_DATA_MAX);
            rep.private_data[..n].copy_from_slice(&pd[..n]);
            let mut m = [0u8; MAD_LEN];
            rep.emit(tid, &mut m);
            pending.answered(&m);
            let _ = send_mad(shared, from, &m);
        };
        let header = match wire::RdmaCmHeader::parse(&req.private_data) {
            Ok(h) => h,
            Err(e) => {
                answer(wire::SIDR_REJECT, 0, 0, &[]);
                return Err(ConnectError::Protocol {
                    peer: from,
                    what: format!("a SIDR_REQ without rdma_cm's header ({e})"),
                });
            }
        };
        let request = Request {
            from: SocketAddrV4::new(Ipv4Addr::from(header.src), header.src_port),
            private_data: req.private_data[wire::RDMA_CM_HEADER_LEN..].to_vec(),
        };
        match decide(&request) {
            Decision::Reject(pd) => {
                answer(wire::SIDR_REJECT, 0, 0, &pd);
                Err(ConnectError::Rejected {
                    reason: wire::REJ_CONSUMER,
                    private_data: pd,
                })
            }
            Decision::Accept(pd) if pd.len() > REP_PRIVATE_DATA_MAX => {
                answer(wire::SIDR_REJECT, 0, 0, &[]);
                Err(VerbsError::Invalid(format!(
                    "at most {REP_PRIVATE_DATA_MAX} bytes of private data in a SIDR_REP"
                ))
                .into())
            }
            Decision::Accept(pd) => {
                let qkey = qp.query().qkey.unwrap_or(wire::RDMA_CM_UDP_QKEY);
                answer(wire::SIDR_VALID, qp.qpn(), qkey, &pd);
                Ok(request)
            }
        }
    }
}

/// A SIDR request an accept took: forgotten when dropped unless answered.
struct Pending<'a> {
    shared: &'a Shared,
    key: SidrKey,
}

impl Pending<'_> {
    fn answered(&self, reply: &[u8; MAD_LEN]) {
        self.shared.gsi.sidr_answered(self.key, reply);
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        // A no-op once answered (the answer removed it).
        self.shared.gsi.sidr_forget(self.key);
    }
}
