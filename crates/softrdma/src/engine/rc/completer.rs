//! The completer: ACKs, NAKs, READ responses and atomic ACKs matched to send
//! WQEs; retransmission on NAKs and timeouts; completions in posting order.

use softrdma_wire::Psn;
use softrdma_wire::aeth::{NakCode, Syndrome};
use softrdma_wire::opcode::{Operation, Position};
use softrdma_wire::packet::Packet;

use super::RcQp;
use crate::engine::scatter;
use crate::engine::{CqKind, QpState, SendOp, Time, WcStatus};

impl RcQp {
    /// The first PSN not yet acknowledged or answered (the next to assign when
    /// everything is).
    pub(super) fn oldest_unacked(&self) -> Psn {
        self.req
            .sq
            .iter()
            .find(|w| w.started && w.status.is_none())
            .map_or(self.req.psn, |w| w.unacked_psn())
    }

    /// Packets are out and unanswered.
    fn outstanding(&self) -> bool {
        self.req
            .sq
            .iter()
            .any(|w| w.started && w.status.is_none() && (w.next_pkt > 0 || w.acked > 0))
    }

    /// Restarts the retransmission timer after progress, or stops it.
    fn rearm(&mut self, now: Time) {
        self.req.timer = match self.ack_timeout() {
            Some(d) if self.outstanding() => Some(now.after(d)),
            _ => None,
        };
    }

    /// Index of the unfinished WQE holding `psn`.
    fn wqe_at(&self, psn: Psn) -> Option<usize> {
        self.req
            .sq
            .iter()
            .position(|w| w.status.is_none() && w.contains(psn))
    }

    /// Resends from `psn`: the WQE holding it restarts there, later ones from
    /// their first packet (go-back-N, as rxe does).
    pub(super) fn go_back(&mut self, psn: Psn) {
        let Some(i) = self.wqe_at(psn) else {
            return;
        };
        self.req.next = i;
        self.req.last_go_back = Some(psn);
        for (j, w) in self.req.sq.iter_mut().enumerate().skip(i) {
            if !w.started || w.status.is_some() {
                continue;
            }
            if j == i && !w.wr.op.is_read_or_atomic() {
                let k = psn.distance(w.first_psn).max(0) as u32;
                w.next_pkt = k;
                w.acked = w.acked.min(k);
            } else {
                w.next_pkt = 0;
            }
        }
        self.req.since_ackreq = 0;
    }

    /// Counts a retry (every one is for a loss, which narrows the window);
    /// `false` (and the oldest WQE failed) when none are left.
    fn use_retry(&mut self) -> bool {
        if self.req.retry_left == 0 {
            self.fail_oldest(WcStatus::RetryExcErr);
            return false;
        }
        self.req.retry_left -= 1;
        self.req.window.lost();
        true
    }

    fn fail_oldest(&mut self, status: WcStatus) {
        if let Some(w) = self
            .req
            .sq
            .iter_mut()
            .find(|w| w.started && w.status.is_none())
        {
            w.status = Some(status);
        }
        self.enter_error();
    }

    /// Everything up to and including `psn` is acknowledged. A READ or atomic
    /// in that range still waiting for its answer means the answer was lost:
    /// `Err(psn)` of where to resend from (an implicit NAK).
    fn ack_upto(&mut self, psn: Psn) -> Result<(), Psn> {
        for w in self.req.sq.iter_mut() {
            if !w.started {
                break;
            }
            if w.status.is_some() {
                continue;
            }
            if psn.before(w.first_psn) {
                break;
            }
            if w.wr.op.is_read_or_atomic() {
                return Err(w.unacked_psn());
            }
            if !psn.before(w.last_psn()) {
                w.acked = w.npsn;
                w.status = Some(WcStatus::Success);
            } else {
                let k = psn.distance(w.first_psn) as u32 + 1;
                w.acked = w.acked.max(k);
                break;
            }
        }
        Ok(())
    }

    /// Acknowledges up to `psn`; on an implicit NAK resends (using a retry).
    fn ack_or_resend(&mut self, psn: Psn) -> bool {
        match self.ack_upto(psn) {
            Ok(()) => true,
            Err(from) => {
                self.resend_from(from);
                false
            }
        }
    }

    /// Goes back to `from` on a NAK, using a retry, unless that restart is
    /// already under way.
    fn resend_from(&mut self, from: Psn) {
        if self.req.last_go_back == Some(from) {
            self.stats.dropped += 1;
            return;
        }
        if self.use_retry() {
            self.go_back(from);
        }
    }

    pub(super) fn complete_packet(&mut self, now: Time, p: &Packet<&[u8]>) {
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            self.stats.dropped += 1;
            return;
        }
        let psn = p.bth().psn();
        // Answers to PSNs never sent, or long acknowledged, are stale or bogus.
        // "Sent" is up to the highest PSN that went out (a READ's whole
        // response range), not every PSN assigned: a message's later
        // packets may still wait for the window.
        let oldest = self.oldest_unacked();
        let sent_end = self.req.high_psn.unwrap_or(oldest);
        if psn.before(oldest) || !psn.before(sent_end) {
            self.stats.dropped += 1;
            return;
        }
        let info = p.info();
        self.answer(now, psn, info.operation, info.position, p);
        // Forward progress resets the retry counters (IBTA 9.7.6.1.3).
        let advanced = self.oldest_unacked().distance(oldest);
        if advanced > 0 {
            self.req.window.acknowledged(advanced as u32);
            self.req.retry_left = self.retry_cnt;
            self.req.rnr_left = self.rnr_retry;
            // Progress ends a go-back's duplicates, but not while an RNR
            // back-off holds the restart: the packets that followed the
            // refused one draw a sequence NAK for the same PSN (rxe spends a
            // retry on it).
            if self.req.rnr_until.is_none() {
                self.req.last_go_back = None;
            }
        }
    }

    fn answer(
        &mut self,
        now: Time,
        psn: Psn,
        operation: Operation,
        position: Position,
        p: &Packet<&[u8]>,
    ) {
        match operation {
            Operation::Acknowledge => {
                let Some(aeth) = p.aeth() else { return };
                match aeth.syndrome() {
                    Syndrome::Ack(_) => {
                        if self.ack_or_resend(psn) {
                            self.req.retry_left = self.retry_cnt;
                        }
                    }
                    Syndrome::RnrNak(timer) => {
                        self.stats.rnr_naks_received += 1;
                        if !self.ack_or_resend(psn.sub(1)) {
                            return;
                        }
                        if self.rnr_retry != 7 {
                            if self.req.rnr_left == 0 {
                                self.fail_at(psn, WcStatus::RnrRetryExcErr);
                                return;
                            }
                            self.req.rnr_left -= 1;
                        }
                        self.req.rnr_until = Some(
                            now.after(std::time::Duration::from_micros(timer.micros().into())),
                        );
                        self.go_back(psn);
                        self.req.timer = None;
                        return;
                    }
                    Syndrome::Nak(NakCode::PsnSequenceError) => {
                        self.stats.seq_naks_received += 1;
                        if !self.ack_or_resend(psn.sub(1)) {
                            return;
                        }
                        self.resend_from(psn);
                    }
                    Syndrome::Nak(code) => {
                        let status = match code {
                            NakCode::InvalidRequest => WcStatus::RemInvReqErr,
                            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                            _ => WcStatus::RemOpErr,
                        };
                        if self.ack_or_resend(psn.sub(1)) {
                            self.fail_at(psn, status);
                        }
                        return;
                    }
                    Syndrome::Reserved(_) => {
                        self.fail_at(psn, WcStatus::BadRespErr);
                        return;
                    }
                }
            }
            Operation::AtomicAcknowledge => {
                if !self.ack_or_resend(psn.sub(1)) {
                    return;
                }
                let Some(i) = self.wqe_at(psn) else {
                    return;
                };
                let w = &mut self.req.sq[i];
                if !w.wr.op.is_atomic() || w.first_psn != psn {
                    self.stats.dropped += 1;
                    return;
                }
                let original = p.atomic_ack_eth().map_or(0, |a| a.original());
                if let Some(s) = w.segs.first() {
                    s.write(0, &original.to_ne_bytes());
                }
                w.acked = 1;
                w.status = Some(WcStatus::Success);
                self.req.retry_left = self.retry_cnt;
            }
            Operation::ReadResponse => {
                if !self.read_response(psn, position, p) {
                    return;
                }
                self.req.retry_left = self.retry_cnt;
            }
            _ => return,
        }
        self.rearm(now);
    }

    /// A READ response packet; `false` if it was dropped or failed the QP.
    fn read_response(&mut self, psn: Psn, position: Position, p: &Packet<&[u8]>) -> bool {
        let Some(i) = self.wqe_at(psn) else {
            self.stats.dropped += 1;
            return false;
        };
        if !matches!(self.req.sq[i].wr.op, SendOp::Read { .. }) {
            self.stats.dropped += 1;
            return false;
        }
        // Responses come in order: a response here answers everything before it.
        if !self.ack_or_resend(self.req.sq[i].first_psn.sub(1)) {
            return false;
        }
        let pmtu = self.pmtu;
        let w = &mut self.req.sq[i];
        if psn != w.unacked_psn() {
            // A duplicate, or one that overtook a lost response: the timer resends.
            self.stats.dropped += 1;
            return false;
        }
        let k = w.acked;
        let n = w.npsn;
        let want_pos = match (k == 0, k + 1 == n) {
            (true, true) => Position::Only,
            (true, false) => Position::First,
            (false, true) => Position::Last,
            (false, false) => Position::Middle,
        };
        let off = u64::from(k) * pmtu as u64;
        let want_len = (w.len - off).min(pmtu as u64) as usize;
        let payload = p.payload();
        if position != want_pos || payload.len() != want_len {
            self.fail_at(psn, WcStatus::BadRespErr);
            return false;
        }
        scatter(&w.segs, off as usize, payload);
        w.acked += 1;
        if w.acked == n {
            w.status = Some(WcStatus::Success);
        }
        true
    }

    /// Fails the WQE holding `psn` with `status`; the QP goes to ERR.
    fn fail_at(&mut self, psn: Psn, status: WcStatus) {
        match self.wqe_at(psn) {
            Some(i) => {
                self.req.sq[i].status = Some(status);
                self.enter_error();
            }
            None => self.fail_oldest(status),
        }
    }

    pub(super) fn req_timeout(&mut self, now: Time) {
        if self.req.rnr_until.is_some_and(|t| t <= now) {
            self.req.rnr_until = None;
        }
        if self.req.timer.is_some_and(|t| t <= now) {
            self.req.timer = None;
            if !self.outstanding() || self.state == QpState::Err {
                return;
            }
            self.stats.timeouts += 1;
            if self.use_retry() {
                let from = self.oldest_unacked();
                self.go_back(from);
            }
        }
    }

    /// On ERR: every unfinished send WQE completes as flushed.
    pub(super) fn req_flush(&mut self) {
        for w in self.req.sq.iter_mut() {
            if w.status.is_none() {
                w.status = Some(WcStatus::WrFlushErr);
            }
        }
        self.req.timer = None;
        self.req.rnr_until = None;
        self.report_completions();
    }

    /// Moves finished WQEs at the head of the send queue to the completions,
    /// in posting order: successes only when signaled, errors always.
    #[inline]
    pub(super) fn report_completions(&mut self) {
        // Mostly nothing is finished: checked here, the work out of line.
        if self.req.sq.front().is_some_and(|w| w.status.is_some()) {
            self.report_finished();
        }
    }

    #[inline(never)]
    fn report_finished(&mut self) {
        while let Some(w) = self.req.sq.front() {
            let Some(status) = w.status else { break };
            let w = self.req.sq.pop_front().expect("front exists");
            self.req.next = self.req.next.saturating_sub(1);
            if status != WcStatus::Success || w.wr.flags.signaled {
                let mut wc = self.wc(w.wr.wr_id, status, w.wr.op.wc_opcode());
                // Every success reports its length, as rxe does (and siw, and
                // this crate's other transports): mlx5 reports it for READs
                // and atomics only, which applications read it for.
                if status == WcStatus::Success {
                    wc.byte_len = w.len as u32;
                }
                self.completions.push_back((CqKind::Send, wc));
            }
        }
    }
}
