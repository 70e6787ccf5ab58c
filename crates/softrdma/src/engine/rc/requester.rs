//! The requester: send work requests become request packets.

use std::collections::VecDeque;

use softrdma_wire::packet::Repr;
use softrdma_wire::{Opcode, Psn, atomic, bth, reth};

use super::{MAX_PKTS_PER_ACK, MAX_UNACKED_PSNS, MIN_UNACKED_PSNS, RcQp};
use crate::engine::{
    CqKind, PostError, QpState, SendOp, SendWr, Time, Transmit, WcOpcode, WcStatus,
};
use crate::engine::{SegList, gather, push_pieces};
use crate::memory::{Access, MrTable, PieceSink};

/// Half the 24-bit PSN space.
const HALF_PSN_SPACE: u32 = 1 << 23;

/// Payloads up to this long are copied into the packet buffer when the
/// packet is built, not sent from region pieces.
const COPIED_PAYLOAD_MAX: usize = 128;

/// A send work request and its progress.
#[derive(Debug)]
pub(super) struct SendWqe {
    pub wr: SendWr,
    /// Payload (SEND/WRITE) or read size (READ) in bytes; 8 for atomics.
    pub len: u64,
    /// PSNs are assigned when the WQE is first transmitted.
    pub started: bool,
    pub first_psn: Psn,
    /// PSNs the WQE consumes: its packets, or a READ's response packets.
    pub npsn: u32,
    /// SEND/WRITE: next packet to (re)send. READ/atomic: 1 once the request went out.
    pub next_pkt: u32,
    /// SEND/WRITE: packets acknowledged. READ: response packets received.
    pub acked: u32,
    /// The local buffers, resolved when the WQE starts.
    pub segs: SegList,
    /// Set when the WQE is finished.
    pub status: Option<WcStatus>,
}

impl SendWqe {
    pub fn last_psn(&self) -> Psn {
        self.first_psn.add(self.npsn - 1)
    }
    pub fn contains(&self, psn: Psn) -> bool {
        self.started && psn.in_range(self.first_psn, self.npsn)
    }
    /// The first PSN not yet acknowledged or answered.
    pub fn unacked_psn(&self) -> Psn {
        self.first_psn.add(self.acked)
    }
    fn request_packets(&self) -> u32 {
        if self.wr.op.is_read_or_atomic() {
            1
        } else {
            self.npsn
        }
    }
    pub fn fully_sent(&self) -> bool {
        self.next_pkt >= self.request_packets()
    }
}

/// Requester and completer state.
#[derive(Debug, Default)]
pub(super) struct Requester {
    pub sq: VecDeque<SendWqe>,
    /// Index in `sq` of the WQE being transmitted.
    pub next: usize,
    /// Next PSN to assign.
    pub psn: Psn,
    /// Highest PSN sent plus one, to tell retransmissions.
    pub high_psn: Option<Psn>,
    pub retry_left: u8,
    pub rnr_left: u8,
    /// Retransmission deadline.
    pub timer: Option<Time>,
    /// No transmission before this (RNR back-off).
    pub rnr_until: Option<Time>,
    pub since_ackreq: u32,
    /// Where the last go-back restarted, until progress is made outside an
    /// RNR back-off: a NAK or an implicit NAK asking for the same restart is
    /// a duplicate (the network duplicated or delayed it, or it answers a
    /// packet behind the one refused) and must not cost another retry.
    pub last_go_back: Option<Psn>,
    pub window: Window,
}

/// How many PSNs past the oldest unacknowledged one the requester may send.
/// A fixed window either overruns a slow peer or holds back a fast one: rxe in
/// an emulated guest drops what 512 PSNs in flight bring, and go-back-N then
/// resends them into the same overflow until the retries run out, while a
/// busy-polling softrdma peer moves 11-12 % more with 512 than with 128. So
/// the window starts at rxe's 128, doubles each window's worth of ACKs until
/// the first loss (a NAK or a timeout), then grows by one PSN per window's
/// worth; each loss halves it, never below 128 (TCP Reno's rule, in PSNs).
#[derive(Debug)]
pub(super) struct Window {
    limit: u32,
    /// PSNs acknowledged toward the next additive step.
    credit: u32,
    lost: bool,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            limit: MIN_UNACKED_PSNS,
            credit: 0,
            lost: false,
        }
    }
}

impl Window {
    pub(super) fn limit(&self) -> u32 {
        self.limit
    }

    /// `psns` more are acknowledged (or answered).
    pub(super) fn acknowledged(&mut self, psns: u32) {
        if !self.lost {
            self.limit = self.limit.saturating_add(psns).min(MAX_UNACKED_PSNS);
            return;
        }
        self.credit = self.credit.saturating_add(psns);
        if self.credit >= self.limit {
            self.credit -= self.limit;
            self.limit = (self.limit + 1).min(MAX_UNACKED_PSNS);
        }
    }

    /// A NAK or a timeout: something sent was lost.
    pub(super) fn lost(&mut self) {
        self.lost = true;
        self.credit = 0;
        self.limit = (self.limit / 2).max(MIN_UNACKED_PSNS);
    }
}

/// PSNs a message of `len` bytes takes at `pmtu`.
pub(super) fn packets_for(len: u64, pmtu: usize) -> u32 {
    len.div_ceil(pmtu as u64).max(1) as u32
}

impl RcQp {
    pub(super) fn req_post(&mut self, wr: SendWr) -> Result<(), PostError> {
        match self.state {
            QpState::Reset | QpState::Init | QpState::Rtr => {
                return Err(PostError::BadState(self.state));
            }
            _ => {}
        }
        let len = crate::engine::check_post_send(&wr, &self.caps)?;
        if self.req.sq.len() >= self.caps.max_send_wr as usize {
            return Err(PostError::QueueFull(self.caps.max_send_wr));
        }
        if self.state == QpState::Err {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, wr.op.wc_opcode());
            self.completions.push_back((CqKind::Send, wc));
            return Ok(());
        }
        self.req.sq.push_back(SendWqe {
            wr,
            len,
            started: false,
            first_psn: Psn::default(),
            npsn: 0,
            next_pkt: 0,
            acked: 0,
            segs: SegList::new(),
            status: None,
        });
        Ok(())
    }

    /// READ and atomic WQEs sent and not yet answered.
    fn outstanding_rd_atomic(&self) -> usize {
        // WQEs start in order (skipping only those failed before they
        // started) and never unstart: the scan ends at the first WQE not yet
        // reached, not at the end of a long queue.
        self.req
            .sq
            .iter()
            .take_while(|w| w.started || w.status.is_some())
            .filter(|w| w.started && w.status.is_none() && w.wr.op.is_read_or_atomic())
            .count()
    }

    /// Resolves a WQE's local buffers; `false` (and the QP in error) if one is bad.
    fn resolve(&mut self, idx: usize, mrs: &MrTable) -> bool {
        let pd = self.pd;
        let w = &mut self.req.sq[idx];
        if w.wr.flags.inline {
            return true;
        }
        let need = if w.wr.op.is_read_or_atomic() {
            Access::LOCAL_WRITE
        } else {
            Access::NONE
        };
        let mut segs = SegList::with_capacity(w.wr.sgl.len());
        for sge in &w.wr.sgl {
            if sge.len == 0 {
                continue;
            }
            match mrs.local(pd, sge.lkey, sge.addr, sge.len, need) {
                Ok(s) => segs.push(s),
                Err(_) => {
                    w.status = Some(WcStatus::LocProtErr);
                    self.enter_error();
                    return false;
                }
            }
        }
        w.segs = segs;
        true
    }

    pub(super) fn req_transmit(
        &mut self,
        now: Time,
        mrs: &MrTable,
        buf: &mut [u8],
        pieces: &mut dyn PieceSink,
    ) -> Option<Transmit> {
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return None;
        }
        if self.req.rnr_until.is_some_and(|t| now < t) {
            return None;
        }
        self.req.rnr_until = None;
        let oldest = self.oldest_unacked();
        loop {
            let idx = self.req.next;
            let w = self.req.sq.get(idx)?;
            if w.status.is_some() || (w.started && w.fully_sent()) {
                self.req.next += 1;
                continue;
            }
            if !w.started {
                if self.state == QpState::Sqd {
                    return None;
                }
                if let SendOp::LocalInv(rkey) = w.wr.op {
                    // Runs once everything posted before it has completed
                    // (a fence of its own): no PSN, and its completion then
                    // comes in posting order.
                    if idx != 0 {
                        return None;
                    }
                    let w = self.req.sq.pop_front().expect("front exists");
                    if !mrs.invalidate(self.pd, rkey) {
                        // Not a remote key of this PD: a local error, which
                        // ends the QP as any does.
                        let wc = self.wc(w.wr.wr_id, WcStatus::LocProtErr, WcOpcode::LocalInv);
                        self.completions.push_back((CqKind::Send, wc));
                        self.enter_error();
                        return None;
                    }
                    if w.wr.flags.signaled {
                        let wc = self.wc(w.wr.wr_id, WcStatus::Success, WcOpcode::LocalInv);
                        self.completions.push_back((CqKind::Send, wc));
                    }
                    continue;
                }
                if w.wr.flags.fence
                    && self
                        .req
                        .sq
                        .iter()
                        .take(idx)
                        .any(|e| e.wr.op.is_read_or_atomic() && e.status.is_none())
                {
                    return None;
                }
                if w.wr.op.is_read_or_atomic() {
                    if self.max_rd_atomic == 0 {
                        // The QP was set up to issue no READs or atomics.
                        self.req.sq[idx].status = Some(WcStatus::LocQpOpErr);
                        self.enter_error();
                        return None;
                    }
                    if self.outstanding_rd_atomic() >= usize::from(self.max_rd_atomic) {
                        return None;
                    }
                }
                let in_flight = self.req.psn.distance(oldest);
                if in_flight >= self.req.window.limit() as i32 {
                    return None;
                }
                // The PSNs in flight stay within half the 24-bit space, where
                // a response's PSN still tells old from new: a READ of 2 GiB
                // at a 256-byte MTU fills that half alone, and what follows
                // it waits for its answer.
                let npsn = if w.wr.op.is_atomic() {
                    1
                } else {
                    packets_for(w.len, self.pmtu)
                };
                if in_flight < 0 || (in_flight > 0 && in_flight as u32 + npsn > HALF_PSN_SPACE) {
                    return None;
                }
                if !self.resolve(idx, mrs) {
                    return None;
                }
                let psn = self.req.psn;
                let w = &mut self.req.sq[idx];
                w.npsn = npsn;
                w.first_psn = psn;
                w.started = true;
                w.next_pkt = 0;
                w.acked = 0;
                self.req.psn = psn.add(w.npsn);
            }
            let t = self.build_request(idx, oldest, buf, pieces)?;
            self.stats.requests_sent += 1;
            if self.req.timer.is_none()
                && let Some(d) = self.ack_timeout()
            {
                self.req.timer = Some(now.after(d));
            }
            return Some(t);
        }
    }

    /// Packets of the unfenced SENDs and WRITEs queued right after WQE
    /// `idx`, counted up to MAX_PKTS_PER_ACK and over at most 16 WQEs.
    fn packets_queued_behind(&self, idx: usize) -> u32 {
        let mut packets = 0;
        for w in self.req.sq.iter().skip(idx + 1).take(16) {
            let stream = !w.wr.flags.fence
                && matches!(
                    w.wr.op,
                    SendOp::Send
                        | SendOp::SendWithImm(_)
                        | SendOp::SendWithInv(_)
                        | SendOp::Write { .. }
                        | SendOp::WriteWithImm { .. }
                );
            if !stream {
                break;
            }
            packets += packets_for(w.len, self.pmtu);
            if packets >= MAX_PKTS_PER_ACK {
                break;
            }
        }
        packets
    }

    /// Writes the next packet of WQE `idx`, or `None` when the PSN window is full.
    fn build_request(
        &mut self,
        idx: usize,
        oldest: Psn,
        buf: &mut [u8],
        pieces: &mut dyn PieceSink,
    ) -> Option<Transmit> {
        if let Some(t) = self.build_middle(idx, oldest, buf, pieces) {
            return t;
        }
        let pmtu = self.pmtu;
        let dest_qp = self.dest_qp;
        let w = &self.req.sq[idx];
        let k = w.next_pkt;
        let (psn, mut repr, payload) = match w.wr.op {
            SendOp::Read { remote_addr, rkey } => {
                // A (re)request starts at the first response not yet received.
                let skip = u64::from(w.acked) * pmtu as u64;
                let psn = w.first_psn.add(w.acked);
                let mut r = Repr::new(Opcode::RC_RDMA_READ_REQUEST, dest_qp, psn, 0);
                r.reth = Some(reth::Repr {
                    va: remote_addr.wrapping_add(skip),
                    rkey,
                    dma_len: (w.len - skip.min(w.len)) as u32,
                });
                (psn, r, None)
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                let mut r = Repr::new(Opcode::RC_COMPARE_SWAP, dest_qp, w.first_psn, 0);
                r.atomic = Some(atomic::Repr {
                    va: remote_addr,
                    rkey,
                    swap_add: swap,
                    compare,
                });
                (w.first_psn, r, None)
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                let mut r = Repr::new(Opcode::RC_FETCH_ADD, dest_qp, w.first_psn, 0);
                r.atomic = Some(atomic::Repr {
                    va: remote_addr,
                    rkey,
                    swap_add: add,
                    compare: 0,
                });
                (w.first_psn, r, None)
            }
            op => {
                let n = w.npsn;
                let off = u64::from(k) * pmtu as u64;
                let len = (w.len - off).min(pmtu as u64) as usize;
                let (first, last) = (k == 0, k + 1 == n);
                use Opcode as O;
                let (opcode, imm, reth_on) = match op {
                    SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => {
                        let imm = match op {
                            SendOp::SendWithImm(i) => Some(i),
                            _ => None,
                        };
                        let inv = matches!(op, SendOp::SendWithInv(_));
                        let opc = match (first, last, imm.is_some(), inv) {
                            (true, true, _, true) => O::RC_SEND_ONLY_WITH_INVALIDATE,
                            (false, true, _, true) => O::RC_SEND_LAST_WITH_INVALIDATE,
                            (true, true, false, _) => O::RC_SEND_ONLY,
                            (true, true, true, _) => O::RC_SEND_ONLY_WITH_IMMEDIATE,
                            (true, false, ..) => O::RC_SEND_FIRST,
                            (false, false, ..) => O::RC_SEND_MIDDLE,
                            (false, true, false, _) => O::RC_SEND_LAST,
                            (false, true, true, _) => O::RC_SEND_LAST_WITH_IMMEDIATE,
                        };
                        (opc, imm.filter(|_| last), false)
                    }
                    _ => {
                        let imm = match op {
                            SendOp::WriteWithImm { imm, .. } => Some(imm),
                            _ => None,
                        };
                        // A WRITE without an immediate goes as one WRITE
                        // ONLY per packet, each with its own RETH: the
                        // packets are then all of one size, so a UDP GSO
                        // send holds 15 of them where FIRST (16 bytes
                        // longer than MIDDLE) would end it after two, and
                        // on loopback each datagram costs about as much as
                        // 60 KB of payload. The responder sees a run of
                        // messages that writes the same bytes; with an
                        // immediate the receive completion reports the
                        // whole length, so those stay one message.
                        let opc = match (first, last, imm.is_some()) {
                            (_, _, false) => O::RC_RDMA_WRITE_ONLY,
                            (true, true, true) => O::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                            (true, false, true) => O::RC_RDMA_WRITE_FIRST,
                            (false, false, true) => O::RC_RDMA_WRITE_MIDDLE,
                            (false, true, true) => O::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                        };
                        (opc, imm.filter(|_| last), first || imm.is_none())
                    }
                };
                let psn = w.first_psn.add(k);
                let mut r = Repr::new(opcode, dest_qp, psn, len);
                r.immediate = imm;
                if let (SendOp::SendWithInv(rkey), true) = (op, last) {
                    r.invalidate_rkey = Some(rkey);
                }
                if reth_on {
                    let (remote_addr, rkey) = match op {
                        SendOp::Write { remote_addr, rkey }
                        | SendOp::WriteWithImm {
                            remote_addr, rkey, ..
                        } => (remote_addr, rkey),
                        _ => unreachable!("WRITE opcodes only"),
                    };
                    r.reth = Some(if opcode == O::RC_RDMA_WRITE_ONLY {
                        reth::Repr {
                            va: remote_addr.wrapping_add(off),
                            rkey,
                            dma_len: len as u32,
                        }
                    } else {
                        reth::Repr {
                            va: remote_addr,
                            rkey,
                            dma_len: w.len as u32,
                        }
                    });
                }
                let wants_se = matches!(
                    op,
                    SendOp::Send
                        | SendOp::SendWithImm(_)
                        | SendOp::SendWithInv(_)
                        | SendOp::WriteWithImm { .. }
                );
                r.bth.solicited = last && w.wr.flags.solicited && wants_se;
                (psn, r, Some((off as usize, len, last)))
            }
        };
        if psn.distance(oldest) >= self.req.window.limit() as i32 {
            return None;
        }
        let last = payload.is_none_or(|p| p.2);
        // A SEND or WRITE with at least MAX_PKTS_PER_ACK packets of SENDs
        // and WRITEs queued right behind it need not ask for its own ACK:
        // one of theirs (every MAX_PKTS_PER_ACK packets at most) covers it
        // before the window runs dry, so a stream of large messages costs
        // the peer fewer ACKs and this side fewer wake-ups. A shorter queue
        // asks per message, as rxe does: the application may be waiting
        // for this completion to post more. So does anything else next (a
        // READ, a fence, a drain), which may hold the queue. And while a
        // READ or atomic ahead is unanswered, every message asks: an ACK
        // beyond it is what reveals a lost response before the timer does,
        // and that READ may hold the window shut before the 64th packet.
        let followed = last
            && payload.is_some()
            && self.state == QpState::Rts
            && self.packets_queued_behind(idx) >= MAX_PKTS_PER_ACK
            && !self
                .req
                .sq
                .iter()
                .take(idx)
                .any(|w| w.status.is_none() && w.wr.op.is_read_or_atomic());
        self.req.since_ackreq += 1;
        repr.bth.ack_req = (last && !followed) || self.req.since_ackreq >= MAX_PKTS_PER_ACK;
        if repr.bth.ack_req {
            self.req.since_ackreq = 0;
        }
        let w = &self.req.sq[idx];
        let mut len = repr
            .emit_header(buf)
            .expect("the requester builds headers that match their opcodes");
        // Payload bytes in `pieces`; inline payload, and a small one, is
        // copied into `buf` (counted in `len`): a piece costs its sink's
        // bookkeeping (on iWARP its region's reference count, two atomic
        // read-modify-writes) and a gather entry, more than copying these
        // few bytes.
        let mut in_pieces = 0;
        if let Some((off, plen, _)) = payload {
            if w.wr.flags.inline {
                buf[len..len + plen].copy_from_slice(&w.wr.inline_data[off..off + plen]);
                len += plen;
            } else if plen <= COPIED_PAYLOAD_MAX {
                gather(&w.segs, off, &mut buf[len..len + plen]);
                len += plen;
            } else {
                push_pieces(&w.segs, off, plen, pieces);
                in_pieces = plen;
            }
        }
        if self.req.high_psn.is_some_and(|h| psn.before(h)) {
            self.stats.retransmitted += 1;
        }
        if self.req.high_psn.is_none_or(|h| !psn.before(h)) {
            let end = if matches!(w.wr.op, SendOp::Read { .. }) {
                w.first_psn.add(w.npsn)
            } else {
                psn.next()
            };
            self.req.high_psn = Some(end);
        }
        self.req.sq[idx].next_pkt += 1;
        if self.req.sq[idx].fully_sent() {
            self.req.next += 1;
        }
        Some(Transmit {
            len,
            payload_len: in_pieces,
            pad: bth::pad_for(payload.map_or(0, |p| p.1)),
        })
    }

    /// [`Self::build_request`] for a packet that is neither the first nor
    /// the last of a SEND or WRITE from registered memory: most packets of a
    /// stream. They need no solicited bit, no immediate, no pad and no check
    /// of what follows, so their headers are written straight from the WQE
    /// (the general path's `Repr` costs some 200 instructions a packet).
    /// `None` when the packet is not such a one; `Some(None)` when the PSN
    /// window is full.
    fn build_middle(
        &mut self,
        idx: usize,
        oldest: Psn,
        buf: &mut [u8],
        pieces: &mut dyn PieceSink,
    ) -> Option<Option<Transmit>> {
        let pmtu = self.pmtu;
        let w = &self.req.sq[idx];
        let k = w.next_pkt;
        if k == 0 || k + 1 >= w.npsn || w.wr.flags.inline {
            return None;
        }
        let off = u64::from(k) * pmtu as u64;
        let (opcode, reth) = match w.wr.op {
            // One WRITE ONLY per packet (see build_request).
            SendOp::Write { remote_addr, rkey } => (
                Opcode::RC_RDMA_WRITE_ONLY,
                Some(reth::Repr {
                    va: remote_addr.wrapping_add(off),
                    rkey,
                    dma_len: pmtu as u32,
                }),
            ),
            SendOp::WriteWithImm { .. } => (Opcode::RC_RDMA_WRITE_MIDDLE, None),
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => {
                (Opcode::RC_SEND_MIDDLE, None)
            }
            _ => return None,
        };
        let psn = w.first_psn.add(k);
        if psn.distance(oldest) >= self.req.window.limit() as i32 {
            return Some(None);
        }
        self.req.since_ackreq += 1;
        let ack_req = self.req.since_ackreq >= MAX_PKTS_PER_ACK;
        if ack_req {
            self.req.since_ackreq = 0;
        }
        let bth = bth::Repr {
            ack_req,
            ..bth::Repr::new(opcode, self.dest_qp, psn, 0)
        };
        bth.emit(&mut bth::Header::new_unchecked(&mut buf[..bth::HEADER_LEN]));
        let mut len = bth::HEADER_LEN;
        if let Some(r) = reth {
            r.emit(&mut reth::Header::new_unchecked(
                &mut buf[len..len + reth::HEADER_LEN],
            ));
            len += reth::HEADER_LEN;
        }
        push_pieces(&w.segs, off as usize, pmtu, pieces);
        match self.req.high_psn {
            Some(h) if psn.before(h) => self.stats.retransmitted += 1,
            _ => self.req.high_psn = Some(psn.next()),
        }
        // Not the last packet: the WQE is not fully sent after it.
        self.req.sq[idx].next_pkt += 1;
        Some(Some(Transmit {
            len,
            payload_len: pmtu,
            pad: 0,
        }))
    }
}
