//! iWARP QPs in the verbs: created unconnected in a PD, brought up by
//! `cm::iwarp` (TCP connection and MPA exchange), then the same `post_send`,
//! `post_recv` and CQs as RoCEv2 QPs.

use std::net::TcpStream;
use std::sync::{Arc, Mutex};

use super::cq::CqInner;
use super::early::{BeforeConnect, Kept};
use super::events::{AsyncEvent, EventQueue};
use super::{Pd, Provider, Qp, QpInit, QpKind, QpType, Result, VerbsError};
use crate::cm::mpa::MpaOutcome;
use crate::engine::iwarp::{DEFAULT_ACCESS, IwarpConfig, IwarpQp, IwarpStats, P2p};
use crate::engine::rc::QpCaps;
use crate::engine::srq::Srq;
use crate::engine::{PostError, QpState, RecvWr, SendWr, WcOpcode};
use crate::memory::Access;
use crate::provider::tcp::{ConnOptions, PEER_TIMEOUT, TcpQp, max_ulpdu_for};
use softrdma_wire::rdmap::{TermEncoding, TerminateRepr};

/// An iWARP QP's counters and the Terminates of its connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IwarpQpStats {
    /// FPDU counters.
    pub fpdus: IwarpStats,
    /// The Terminate this side sent, if any.
    pub terminate_sent: Option<TerminateRepr>,
    /// The Terminate the peer sent, if any.
    pub terminate_received: Option<TerminateRepr>,
}

/// What the verbs keep of an iWARP QP.
#[derive(Debug)]
pub(crate) struct IwarpSlot {
    pub(crate) qpn: u32,
    pd: crate::memory::PdId,
    caps: QpCaps,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    /// The SRQ receives come from (and its number), if shared.
    srq: Option<(u64, Arc<Mutex<Srq>>)>,
    /// The connection, once up.
    conn: Mutex<Option<TcpQp>>,
    /// The remote operations the QP allows (`qp_access_flags`); taken
    /// before `conn`'s lock, held while the connection is told.
    access: Mutex<Access>,
    /// Held through a move to ERR, `conn`'s lock only for its start: a
    /// second mover waits for the first to end the threads, posts and
    /// looks do not.
    moving_to_err: Mutex<()>,
    pub(super) before: BeforeConnect,
    /// Last: the number is given back after the connection is gone.
    _qpn: super::QpnLease,
}

impl IwarpSlot {
    /// The state. The connection's lock is never held while `before`'s is
    /// taken (a connect holds `before`'s while it sets the connection).
    pub(crate) fn state(&self) -> QpState {
        if let Some(s) = self.conn_state() {
            return s;
        }
        match self.before.state() {
            // Connected since the look above (the connection is set before
            // the QP is marked connected).
            QpState::Err => self.conn_state().unwrap_or(QpState::Err),
            s => s,
        }
    }

    fn conn_state(&self) -> Option<QpState> {
        let conn = self.conn.lock().expect("conn lock");
        conn.as_ref().map(|c| c.with_engine(|q| q.state()))
    }

    pub(crate) fn access(&self) -> Access {
        *self.access.lock().expect("access lock")
    }

    /// The remote operations the QP allows from now on, connected or not.
    pub(crate) fn set_access(&self, access: Access) {
        let mut a = self.access.lock().expect("access lock");
        *a = access;
        if let Some(c) = &*self.conn.lock().expect("conn lock") {
            c.set_access(access);
        }
    }

    pub(crate) fn stats(&self) -> IwarpQpStats {
        match &*self.conn.lock().expect("conn lock") {
            Some(c) => c.with_engine(|q| IwarpQpStats {
                fpdus: q.stats(),
                terminate_sent: q.own_terminate().copied(),
                terminate_received: q.peer_terminate().copied(),
            }),
            None => IwarpQpStats::default(),
        }
    }

    /// `modify` to ERR: a connection is closed (its work flushed, the peer
    /// sees it go), receives kept for one are flushed.
    pub(crate) fn to_error(&self, events: &EventQueue) {
        if self.before.fail_and_flush(self.qpn, &self.recv_cq) && self.srq.is_some() {
            // Never connected, it takes nothing from its SRQ (a connected
            // QP's engine says so when it flushes).
            events.push(AsyncEvent::QpLastWqeReached { qpn: self.qpn });
        }
        let _moving = self.moving_to_err.lock().expect("move lock");
        // The wait for the threads runs with the connection's lock let go:
        // posts and polls on other threads see ERR at once, not after up to
        // 2 s.
        let rest = self
            .conn
            .lock()
            .expect("conn lock")
            .as_mut()
            .and_then(|c| c.begin_shut_down());
        if let Some(rest) = rest {
            rest.finish();
        }
    }

    pub(crate) fn post_send(&self, wr: SendWr) -> Result<(), PostError> {
        if let Some(c) = &*self.conn.lock().expect("conn lock") {
            return c.post_send(wr);
        }
        // `state` waits for a connect under way: after it, a connection is
        // there if the connect succeeded.
        let state = self.state();
        if let Some(c) = &*self.conn.lock().expect("conn lock") {
            return c.post_send(wr);
        }
        if state != QpState::Err {
            return Err(PostError::BadState(state));
        }
        IwarpQp::check_send(&wr, &self.caps)?;
        self.send_cq
            .push_flushed(wr.wr_id, wr.op.wc_opcode(), self.qpn);
        Ok(())
    }

    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<(), PostError> {
        if self.srq.is_some() {
            return Err(PostError::ON_SRQ);
        }
        if let Some(c) = &*self.conn.lock().expect("conn lock") {
            return c.post_recv(wr);
        }
        match self
            .before
            .post_recv(wr, self.caps.max_recv_sge, self.caps.max_recv_wr)?
        {
            Kept::Yes => Ok(()),
            Kept::Late(wr) => match &*self.conn.lock().expect("conn lock") {
                Some(c) => c.post_recv(wr),
                None => {
                    self.recv_cq
                        .push_flushed(wr.wr_id, WcOpcode::Recv, self.qpn);
                    Ok(())
                }
            },
        }
    }
}

impl Pd {
    pub(super) fn create_iwarp_qp(&self, init: &QpInit<'_>) -> Result<Qp> {
        if init.qp_type != QpType::Rc {
            return Err(VerbsError::Invalid("iWARP has RC QPs only (no UD)".into()));
        }
        let lease = self.ctx.inner.take_cm_qpn()?;
        let qpn = lease.qpn();
        Ok(Qp {
            ctx: self.ctx.clone(),
            kind: QpKind::Iwarp(Arc::new(IwarpSlot {
                qpn,
                pd: self.id,
                caps: init.caps,
                send_cq: init.send_cq.inner.clone(),
                recv_cq: init.recv_cq.inner.clone(),
                srq: init.srq.map(|s| (s.id, s.inner.clone())),
                conn: Mutex::new(None),
                access: Mutex::new(DEFAULT_ACCESS),
                moving_to_err: Mutex::new(()),
                before: BeforeConnect::default(),
                _qpn: lease,
            })),
        })
    }
}

impl Qp {
    /// Starts the QP on a connection whose MPA exchange is done.
    pub(crate) fn attach_iwarp(&self, stream: TcpStream, mpa: &MpaOutcome) -> Result<()> {
        let slot = self
            .iwarp_slot()
            .ok_or_else(|| VerbsError::Invalid("cm::iwarp needs a QP of an iWARP device".into()))?;
        let Provider::Iwarp(dev) = &self.ctx.inner.dev else {
            unreachable!("iWARP QPs live on iWARP devices")
        };
        let mut connecting = slot.before.connecting().ok_or_else(|| {
            VerbsError::Invalid(
                "this iWARP QP was connected before or moved to ERR: create a new one".into(),
            )
        })?;
        let cfg = IwarpConfig {
            max_ulpdu: fpdu_override().unwrap_or_else(|| {
                if mpa.large_fpdus {
                    LARGE_ULPDU
                } else {
                    max_ulpdu_for(&stream)
                }
            }),
            ird: mpa.ird.max(1),
            ord: mpa.ord.max(1),
            terminate_encoding: TermEncoding::Rfc,
            p2p: mpa.rtr.map(|r| {
                if mpa.initiator {
                    P2p::Send(r)
                } else {
                    P2p::Await(r)
                }
            }),
        };
        // Held until the connection is in the slot: a modify meanwhile
        // waits for it, then tells it.
        let access = slot.access.lock().expect("access lock");
        let mut engine = IwarpQp::new(slot.qpn, slot.pd, slot.caps, cfg);
        engine.set_access(*access);
        if let Some((_, srq)) = &slot.srq {
            engine = engine.with_srq(srq.clone());
        }
        // Receives posted before the connection are in place before its
        // first byte is read. If it fails to start, they stay the QP's.
        let early = connecting.receives();
        for wr in &early {
            if let Err(e) = engine.post_recv(wr.clone()) {
                connecting.restore(early);
                return Err(e.into());
            }
        }
        let started = TcpQp::start(
            stream,
            engine,
            dev.mrs.clone(),
            ConnOptions {
                crc: mpa.crc,
                busy_poll: dev.busy_poll.clone(),
                connections: Some(dev.connections.clone()),
                peer_timeout: PEER_TIMEOUT,
                srq: slot.srq.clone(),
            },
            slot.send_cq.clone(),
            slot.recv_cq.clone(),
            dev.events.clone(),
        );
        let conn = match started {
            Ok(c) => c,
            Err(e) => {
                connecting.restore(early);
                return Err(VerbsError::Io {
                    what: "cannot start the iWARP connection".into(),
                    source: e,
                });
            }
        };
        *slot.conn.lock().expect("conn lock") = Some(conn);
        drop(access);
        connecting.done();
        Ok(())
    }
}

/// The ULPDU sent when both ends take FPDUs larger than a segment: MPA's
/// limit (the engine keeps room for pad and CRC).
const LARGE_ULPDU: usize = u16::MAX as usize;

/// `SOFTRDMA_IWARP_ULPDU`: the largest ULPDU to send, instead of the
/// negotiated one (one that fits the TCP MSS, or [`LARGE_ULPDU`] between
/// ends that both take large FPDUs); `max` is MPA's limit. For measuring
/// FPDU sizes (docs/iwarp.md).
fn fpdu_override() -> Option<usize> {
    let v = std::env::var("SOFTRDMA_IWARP_ULPDU").ok()?;
    match v.as_str() {
        "max" => Some(LARGE_ULPDU),
        n => n.parse().ok(),
    }
}
