//! Reliable connected transport, split as the Linux rxe driver splits it:
//! the requester turns send work requests into packets, the completer matches
//! ACKs, NAKs and responses to them (retransmitting and completing in order),
//! and the responder executes incoming requests against registered memory.
//!
//! [`RcQp`] is sans-I/O: its doors are [`RcQp::post_send`], [`RcQp::post_recv`],
//! [`RcQp::handle_packet`], [`RcQp::poll_transmit`], [`RcQp::poll_timeout`],
//! [`RcQp::handle_timeout`] and [`RcQp::poll_completion`].

mod completer;
mod requester;
mod responder;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use softrdma_wire::opcode::{Operation, Transport};
use softrdma_wire::packet::Packet;

use super::qp::{QpAttr, QpType, TransitionError, check_transition};
use super::srq::Srq;
use super::{
    CqKind, PostError, QpEvent, QpState, RecvWr, SendWr, Time, Transmit, WcStatus, WorkCompletion,
};
use crate::memory::{Access, MrTable, PdId, PieceSink};

pub use super::qp::Mtu;

/// Capacities a QP is created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send work request.
    pub max_send_sge: u32,
    /// SGEs per receive work request.
    pub max_recv_sge: u32,
    /// Inline payload per send work request.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        }
    }
}

/// Counters of transport events, for `softrdma perf --stats` and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RcStats {
    /// Request packets sent (first transmissions and retransmissions).
    pub requests_sent: u64,
    /// Request packets sent again.
    pub retransmitted: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// PSN sequence error NAKs received.
    pub seq_naks_received: u64,
    /// Responses sent (ACKs, NAKs, READ responses, atomic ACKs).
    pub responses_sent: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// PSN sequence error NAKs sent.
    pub seq_naks_sent: u64,
    /// Duplicate requests received.
    pub duplicates: u64,
    /// Packets dropped as out of order, stale or not for this QP's state.
    pub dropped: u64,
    /// The requester's window now: PSNs it may send past the oldest
    /// unacknowledged one (a gauge, not a count).
    pub window: u32,
}

/// The fewest PSNs the requester may send beyond the oldest unacknowledged
/// one: rxe's RXE_MAX_UNACKED_PSNS, where the window starts and to which
/// losses bring it back.
pub const MIN_UNACKED_PSNS: u32 = 128;
/// The most: 2 MiB of 4 KiB packets, so that a stream whose receiver answers
/// at once (busy-poll) does not wait on ACKs in flight. A loss resends at
/// most this many packets (go-back-N).
pub const MAX_UNACKED_PSNS: u32 = 512;
/// The requester asks for an ACK at least every this many packets (rxe's
/// RXE_MAX_PKT_PER_ACK).
pub const MAX_PKTS_PER_ACK: u32 = 64;
/// Room a transmit buffer needs beyond the inline payload: the longest header set.
pub const MAX_HEADER_LEN: usize = 64;
/// The longest message InfiniBand allows (2^31 bytes).
pub const MAX_MESSAGE_LEN: u64 = 1 << 31;

/// The state of one reliable connected QP.
#[derive(Debug)]
pub struct RcQp {
    qpn: u32,
    pd: PdId,
    caps: QpCaps,
    state: QpState,
    access: Access,
    pmtu: usize,
    dest_qp: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    req: requester::Requester,
    resp: responder::Responder,
    completions: VecDeque<(CqKind, WorkCompletion)>,
    stats: RcStats,
    /// Receives come from here instead of the QP's own queue.
    srq: Option<Arc<Mutex<Srq>>>,
    events: VecDeque<QpEvent>,
    /// Moved from RTS to SQD, and IBV_EVENT_SQ_DRAINED not yet raised.
    sq_draining: bool,
    /// IBV_EVENT_COMM_EST raised (once, for a packet received in RTR).
    comm_established: bool,
}

impl RcQp {
    /// A QP in the RESET state.
    pub fn new(qpn: u32, pd: PdId, caps: QpCaps) -> RcQp {
        RcQp {
            qpn,
            pd,
            caps,
            state: QpState::Reset,
            access: Access::NONE,
            pmtu: Mtu::Mtu1024.bytes(),
            dest_qp: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            req: requester::Requester::default(),
            resp: responder::Responder::default(),
            completions: VecDeque::new(),
            stats: RcStats::default(),
            srq: None,
            events: VecDeque::new(),
            sq_draining: false,
            comm_established: false,
        }
    }

    /// A QP in RESET that takes its receives from `srq`.
    pub fn with_srq(qpn: u32, pd: PdId, caps: QpCaps, srq: Arc<Mutex<Srq>>) -> RcQp {
        let mut q = RcQp::new(qpn, pd, caps);
        q.srq = Some(srq);
        q
    }

    /// The next asynchronous event.
    pub fn poll_event(&mut self) -> Option<QpEvent> {
        // Drained when everything sent is acknowledged, as rxe's requester
        // finds it (comp.psn == req.psn).
        if self.sq_draining && self.state == QpState::Sqd && self.oldest_unacked() == self.req.psn {
            self.sq_draining = false;
            self.events.push_back(QpEvent::SqDrained);
        }
        self.events.pop_front()
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// Protection domain.
    pub fn pd(&self) -> PdId {
        self.pd
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }
    /// Capacities.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }
    /// Signs that either end sent something again: retransmission
    /// timeouts plus duplicate requests received.
    pub fn resend_signs(&self) -> u64 {
        self.stats.timeouts + self.stats.duplicates
    }
    /// Counters.
    pub fn stats(&self) -> RcStats {
        RcStats {
            window: self.req.window.limit(),
            ..self.stats
        }
    }
    /// Path MTU in bytes.
    pub fn pmtu(&self) -> usize {
        self.pmtu
    }
    /// The peer's QP number.
    pub fn dest_qp(&self) -> u32 {
        self.dest_qp
    }

    /// The current attributes, as `ibv_query_qp` reports them.
    pub fn query(&self) -> QpAttr {
        QpAttr {
            state: Some(self.state),
            cur_state: Some(self.state),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(self.access),
            path_mtu: Mtu::from_bytes(self.pmtu),
            dest_qp: Some(self.dest_qp),
            rq_psn: Some(self.resp.epsn.value()),
            sq_psn: Some(self.req.psn.value()),
            max_dest_rd_atomic: Some(self.max_dest_rd_atomic),
            max_rd_atomic: Some(self.max_rd_atomic),
            min_rnr_timer: Some(self.min_rnr_timer),
            timeout: Some(self.timeout),
            retry_cnt: Some(self.retry_cnt),
            rnr_retry: Some(self.rnr_retry),
            qkey: None,
            has_av: self.state >= QpState::Rtr,
        }
    }

    /// Modifies the QP (`ibv_modify_qp`): checks the transition and its
    /// attributes, then applies them.
    pub fn modify(&mut self, attr: &QpAttr) -> Result<(), TransitionError> {
        let to = check_transition(QpType::Rc, self.state, attr)?;
        if let Some(a) = attr.access {
            self.access = a;
        }
        if let Some(m) = attr.path_mtu {
            self.pmtu = m.bytes();
        }
        if let Some(q) = attr.dest_qp {
            self.dest_qp = q;
        }
        if let Some(p) = attr.rq_psn {
            self.resp.epsn = softrdma_wire::Psn::new(p);
        }
        if let Some(p) = attr.sq_psn {
            self.req.psn = softrdma_wire::Psn::new(p);
        }
        if let Some(v) = attr.max_dest_rd_atomic {
            self.max_dest_rd_atomic = v;
        }
        if let Some(v) = attr.max_rd_atomic {
            self.max_rd_atomic = v;
        }
        if let Some(v) = attr.min_rnr_timer {
            self.min_rnr_timer = v;
        }
        if let Some(v) = attr.timeout {
            self.timeout = v;
        }
        if let Some(v) = attr.retry_cnt {
            self.retry_cnt = v;
            self.req.retry_left = v;
        }
        if let Some(v) = attr.rnr_retry {
            self.rnr_retry = v;
            self.req.rnr_left = v;
        }
        self.sq_draining = crate::engine::qp::sq_drain_owed(self.sq_draining, self.state, to);
        match to {
            QpState::Reset => {
                let mut fresh = RcQp::new(self.qpn, self.pd, self.caps);
                fresh.srq = self.srq.take();
                *self = fresh;
            }
            QpState::Err => self.go_to_error(false),
            // Packets sent since the last AckReq counted on a message behind
            // them to ask, which the drain will not start: send the last of
            // them again, asking (the responder ACKs a duplicate that asks).
            // A message still being sent (or sent again after a go-back)
            // asks with its own last packet.
            QpState::Sqd
                if self.state == QpState::Rts
                    && self.req.since_ackreq > 0
                    && self
                        .req
                        .sq
                        .iter()
                        .all(|w| !w.started || w.status.is_some() || w.fully_sent()) =>
            {
                self.state = to;
                self.go_back(self.req.psn.sub(1));
            }
            _ => self.state = to,
        }
        Ok(())
    }

    /// Posts a send work request (`ibv_post_send`). Errors are reported here,
    /// on the call; execution errors come later as completions.
    pub fn post_send(&mut self, wr: SendWr) -> Result<(), PostError> {
        self.req_post(wr)
    }

    /// Posts a receive work request (`ibv_post_recv`).
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        self.resp_post(wr)
    }

    /// Handles a received packet (BTH through ICRC; the provider checked the
    /// ICRC and that it is for this QP's number).
    pub fn handle_packet(&mut self, now: Time, packet: &[u8], mrs: &MrTable) {
        let Ok(p) = Packet::new_checked(packet) else {
            self.stats.dropped += 1;
            return;
        };
        let info = p.info();
        if info.transport != Transport::Rc || p.bth().dest_qp() != self.qpn {
            // rxe drops other classes silently, with no NAK.
            self.stats.dropped += 1;
            return;
        }
        match info.operation {
            Operation::ReadResponse | Operation::Acknowledge | Operation::AtomicAcknowledge => {
                self.complete_packet(now, &p)
            }
            _ => {
                // The first request in RTR: the peer is in RTS before this
                // side (qib, hfi1; rdma_cm takes it for a lost RTU).
                if self.state == QpState::Rtr && !self.comm_established {
                    self.comm_established = true;
                    self.events.push_back(QpEvent::CommEstablished);
                }
                self.respond_packet(&p, mrs)
            }
        }
        self.report_completions();
    }

    /// The next packet to send, written into `buf` (headers and inline payload);
    /// the payload's region pieces are pushed onto `pieces`. `buf` needs
    /// [`MAX_HEADER_LEN`] plus the path MTU.
    ///
    /// # Panics
    /// If `buf` is shorter than that: a bug in the provider.
    pub fn poll_transmit(
        &mut self,
        now: Time,
        mrs: &MrTable,
        buf: &mut [u8],
        pieces: &mut dyn PieceSink,
    ) -> Option<Transmit> {
        assert!(
            buf.len() >= MAX_HEADER_LEN + self.pmtu,
            "transmit buffer of {} bytes, needs {}",
            buf.len(),
            MAX_HEADER_LEN + self.pmtu
        );
        pieces.clear_pieces();
        if let Some(t) = self.resp_transmit(buf, pieces) {
            self.stats.responses_sent += 1;
            return Some(t);
        }
        let t = self.req_transmit(now, mrs, buf, pieces);
        self.report_completions();
        t
    }

    /// When [`RcQp::handle_timeout`] wants to be called next.
    pub fn poll_timeout(&self) -> Option<Time> {
        match (self.req.timer, self.req.rnr_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs the timers that are due.
    pub fn handle_timeout(&mut self, now: Time) {
        self.req_timeout(now);
        self.report_completions();
    }

    /// The next work completion, in the order the verbs require.
    pub fn poll_completion(&mut self) -> Option<(CqKind, WorkCompletion)> {
        self.completions.pop_front()
    }

    /// Work completions waiting.
    pub fn completions_pending(&self) -> usize {
        self.completions.len()
    }

    /// Send work requests not yet completed.
    pub fn send_queue_len(&self) -> usize {
        self.req.sq.len()
    }

    /// Receive work requests not yet consumed.
    pub fn recv_queue_len(&self) -> usize {
        self.resp.rq.len()
    }

    /// The requester's window: the oldest unacknowledged PSN and the next PSN
    /// to assign. Everything in between is in flight.
    pub fn requester_window(&self) -> (softrdma_wire::Psn, softrdma_wire::Psn) {
        (self.oldest_unacked(), self.req.psn)
    }

    /// The responder's expected PSN.
    pub fn expected_psn(&self) -> softrdma_wire::Psn {
        self.resp.epsn
    }

    /// The local ACK timeout as a duration (None when 0: no timer).
    fn ack_timeout(&self) -> Option<Duration> {
        (self.timeout != 0).then(|| Duration::from_nanos(4096u64 << self.timeout))
    }

    fn wc(&self, wr_id: u64, status: WcStatus, opcode: super::WcOpcode) -> WorkCompletion {
        WorkCompletion {
            src_qp: self.dest_qp,
            ..WorkCompletion::new(wr_id, status, opcode, self.qpn)
        }
    }

    /// A CQ of this QP overran, so its completions are lost: it fails as rxe's
    /// responder does on a full CQ (ERR, flushed, a fatal event).
    pub fn cq_overrun(&mut self) {
        self.enter_error();
    }

    /// Moves to ERR because of an error: everything outstanding is flushed,
    /// only a pending NAK still goes out.
    fn enter_error(&mut self) {
        self.go_to_error(true);
    }

    fn go_to_error(&mut self, fatal: bool) {
        if self.state == QpState::Err {
            return;
        }
        self.state = QpState::Err;
        self.req_flush();
        self.resp_flush();
        if fatal {
            self.events.push_back(QpEvent::Fatal);
        }
        if self.srq.is_some() {
            self.events.push_back(QpEvent::LastWqeReached);
        }
    }

    /// Whether a receive WQE is waiting (it may be gone when taken, if
    /// another QP takes from the same SRQ).
    fn has_recv(&self) -> bool {
        match &self.srq {
            Some(s) => !s.lock().expect("SRQ lock").is_empty(),
            None => !self.resp.rq.is_empty(),
        }
    }

    /// The next receive WQE and the PD of its lkeys: from the SRQ (of its
    /// own PD) if the QP has one.
    fn next_recv(&mut self) -> Option<(RecvWr, PdId)> {
        match &self.srq {
            Some(s) => {
                let mut s = s.lock().expect("SRQ lock");
                let pd = s.pd();
                s.take().map(|wr| (wr, pd))
            }
            None => self.resp.rq.pop_front().map(|wr| (wr, self.pd)),
        }
    }
}

#[cfg(test)]
mod tests;
