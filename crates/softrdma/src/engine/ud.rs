//! Unreliable datagram transport: one QP sends to and receives from any
//! number of peers, a message per packet, no ACKs. Sans-I/O like the RC engine.
//!
//! Receives start with the 40-byte GRH area, as on a NIC: for RoCEv2 over
//! IPv4, 20 zero bytes and then the received packet's IPv4 header (rxe writes
//! it so); the completion's byte length counts those 40 bytes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use softrdma_wire::opcode::Transport;
use softrdma_wire::packet::{Packet, Repr};
use softrdma_wire::{Opcode, Psn, bth, deth, grh};

use super::QpEvent;
use super::qp::{Mtu, QpAttr, QpType, TransitionError, check_transition};
use super::rc::QpCaps;
use super::srq::Srq;
use super::{
    AhId, CqKind, PostError, QpState, RecvWr, SendOp, SendWr, Transmit, WcOpcode, WcStatus,
    WorkCompletion,
};
use super::{SegList, scatter};
use crate::memory::{Access, MrTable, PdId, PieceSink};

/// What the provider knows of a received datagram's IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvMeta {
    /// IPv4.
    V4 {
        /// Source address.
        src: [u8; 4],
        /// Destination address.
        dst: [u8; 4],
        /// Type of service.
        tos: u8,
        /// Time to live.
        ttl: u8,
        /// Identification (0 when the socket cannot see it).
        identification: u16,
    },
}

impl RecvMeta {
    /// The GRH area for a datagram with `ib_len` bytes of UDP payload.
    fn grh(&self, ib_len: usize) -> grh::Repr {
        match *self {
            RecvMeta::V4 {
                src,
                dst,
                tos,
                ttl,
                identification,
            } => grh::Repr::Ipv4 {
                tos,
                total_len: (20 + 8 + ib_len) as u16,
                identification,
                flags_fragment: 0x4000,
                ttl,
                protocol: 17,
                src,
                dst,
            },
        }
    }
}

/// Counters of a UD QP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdStats {
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams received into a receive WQE.
    pub received: u64,
    /// Dropped: the Q_Key did not match.
    pub qkey_mismatch: u64,
    /// Dropped: no receive WQE posted.
    pub no_receive: u64,
    /// Dropped: not a UD packet, or the QP not ready.
    pub dropped: u64,
}

#[derive(Debug)]
struct UdWqe {
    wr: SendWr,
    len: usize,
}

/// The state of one UD QP.
#[derive(Debug)]
pub struct UdQp {
    qpn: u32,
    pd: PdId,
    caps: QpCaps,
    state: QpState,
    qkey: u32,
    mtu: usize,
    psn: Psn,
    sq: VecDeque<UdWqe>,
    rq: VecDeque<RecvWr>,
    /// Completions in order; `true` marks a send's, held until the
    /// provider says its datagram is in the socket ([`UdQp::transmitted`]).
    completions: VecDeque<(CqKind, WorkCompletion, bool)>,
    /// How many completions are held.
    held: usize,
    /// Datagrams handed out by `poll_transmit` and not yet reported in the
    /// socket (`transmitted`), signaled or not.
    unsent: usize,
    stats: UdStats,
    srq: Option<Arc<Mutex<Srq>>>,
    events: VecDeque<QpEvent>,
    /// Moved from RTS to SQD, and IBV_EVENT_SQ_DRAINED not yet raised.
    sq_draining: bool,
}

impl UdQp {
    /// The QP's protection domain.
    pub fn pd(&self) -> PdId {
        self.pd
    }

    /// A UD QP in RESET; messages are limited to `mtu` (the port's active MTU).
    pub fn new(qpn: u32, pd: PdId, caps: QpCaps, mtu: Mtu) -> UdQp {
        UdQp {
            qpn,
            pd,
            caps,
            state: QpState::Reset,
            qkey: 0,
            mtu: mtu.bytes(),
            psn: Psn::new(0),
            sq: VecDeque::new(),
            rq: VecDeque::new(),
            completions: VecDeque::new(),
            held: 0,
            unsent: 0,
            stats: UdStats::default(),
            srq: None,
            events: VecDeque::new(),
            sq_draining: false,
        }
    }

    /// A UD QP in RESET that takes its receives from `srq`.
    pub fn with_srq(qpn: u32, pd: PdId, caps: QpCaps, mtu: Mtu, srq: Arc<Mutex<Srq>>) -> UdQp {
        let mut q = UdQp::new(qpn, pd, caps, mtu);
        q.srq = Some(srq);
        q
    }

    /// The next asynchronous event.
    pub fn poll_event(&mut self) -> Option<QpEvent> {
        // SQD sends nothing new: drained once what was sent is in the socket.
        if self.sq_draining && self.state == QpState::Sqd && self.unsent == 0 {
            self.sq_draining = false;
            self.events.push_back(QpEvent::SqDrained);
        }
        self.events.pop_front()
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }
    /// The QP's Q_Key.
    pub fn qkey(&self) -> u32 {
        self.qkey
    }
    /// Counters.
    pub fn stats(&self) -> UdStats {
        self.stats
    }
    /// Largest message.
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// The current attributes.
    pub fn query(&self) -> QpAttr {
        QpAttr {
            state: Some(self.state),
            cur_state: Some(self.state),
            pkey_index: Some(0),
            port: Some(1),
            qkey: Some(self.qkey),
            sq_psn: Some(self.psn.value()),
            path_mtu: Mtu::from_bytes(self.mtu),
            ..QpAttr::default()
        }
    }

    /// Modifies the QP: RESET -> INIT needs the Q_Key (with port and P_Key
    /// index), RTR nothing, RTS the send PSN.
    pub fn modify(&mut self, attr: &QpAttr) -> Result<(), TransitionError> {
        let to = check_transition(QpType::Ud, self.state, attr)?;
        if let Some(q) = attr.qkey {
            self.qkey = q;
        }
        if let Some(p) = attr.sq_psn {
            self.psn = Psn::new(p);
        }
        self.sq_draining = super::qp::sq_drain_owed(self.sq_draining, self.state, to);
        match to {
            QpState::Reset => {
                let mtu = Mtu::from_bytes(self.mtu).unwrap_or(Mtu::Mtu1024);
                let mut fresh = UdQp::new(self.qpn, self.pd, self.caps, mtu);
                fresh.srq = self.srq.take();
                *self = fresh;
            }
            QpState::Err => self.enter_error(false),
            _ => self.state = to,
        }
        Ok(())
    }

    fn wc(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
        WorkCompletion::new(wr_id, status, opcode, self.qpn)
    }

    /// A CQ of this QP overran: it fails (ERR, flushed, a fatal event).
    pub fn cq_overrun(&mut self) {
        self.enter_error(true);
    }

    fn enter_error(&mut self, fatal: bool) {
        if self.state == QpState::Err {
            return;
        }
        if fatal {
            self.events.push_back(QpEvent::Fatal);
        }
        if self.srq.is_some() {
            self.events.push_back(QpEvent::LastWqeReached);
        }
        self.state = QpState::Err;
        self.flush_sq();
        while let Some(r) = self.rq.pop_front() {
            let wc = self.wc(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv);
            self.completions.push_back((CqKind::Recv, wc, false));
        }
    }

    fn flush_sq(&mut self) {
        while let Some(w) = self.sq.pop_front() {
            let wc = self.wc(w.wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Send);
            self.completions.push_back((CqKind::Send, wc, false));
        }
    }

    /// Posts a SEND (with or without immediate) to `wr.ud`'s destination.
    pub fn post_send(&mut self, wr: SendWr) -> Result<(), PostError> {
        match self.state {
            QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Err => {}
            s => return Err(PostError::BadState(s)),
        }
        if !matches!(wr.op, SendOp::Send | SendOp::SendWithImm(_)) {
            return Err(PostError::Unsupported(
                "a UD QP sends SEND and SEND with immediate only",
            ));
        }
        if wr.ud.is_none() {
            return Err(PostError::Unsupported(
                "a UD send needs an address handle, remote QPN and Q_Key",
            ));
        }
        let len = crate::engine::check_post_send(&wr, &self.caps)? as usize;
        if len > self.mtu {
            return Err(PostError::LongerThanMtu { len, mtu: self.mtu });
        }
        if self.sq.len() >= self.caps.max_send_wr as usize {
            return Err(PostError::QueueFull(self.caps.max_send_wr));
        }
        if matches!(self.state, QpState::Err | QpState::Sqe) {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Send);
            self.completions.push_back((CqKind::Send, wc, false));
            return Ok(());
        }
        self.sq.push_back(UdWqe { wr, len });
        Ok(())
    }

    /// Posts a receive; its buffer must hold the 40-byte GRH area first.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        super::check_post_recv(
            &wr,
            self.srq.is_some(),
            self.state,
            self.rq.len(),
            &self.caps,
        )?;
        if self.state == QpState::Err {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv);
            self.completions.push_back((CqKind::Recv, wc, false));
            return Ok(());
        }
        self.rq.push_back(wr);
        Ok(())
    }

    /// The next datagram to send, and the address handle it goes to.
    pub fn poll_transmit(
        &mut self,
        mrs: &MrTable,
        buf: &mut [u8],
        pieces: &mut dyn PieceSink,
    ) -> Option<(Transmit, AhId)> {
        pieces.clear_pieces();
        if self.state != QpState::Rts {
            return None;
        }
        let w = self.sq.pop_front()?;
        let dest = w.wr.ud.expect("checked at post");
        // A datagram's payload is all of its SGEs: they go to `pieces` as they resolve.
        if !w.wr.flags.inline {
            for sge in w.wr.sgl.iter().filter(|s| s.len != 0) {
                match mrs.local(self.pd, sge.lkey, sge.addr, sge.len, Access::NONE) {
                    Ok(s) => pieces.push_segment(s),
                    Err(_) => {
                        pieces.clear_pieces();
                        // A send error moves a UD QP to SQE; the rest is flushed.
                        let wc = self.wc(w.wr.wr_id, WcStatus::LocProtErr, WcOpcode::Send);
                        self.completions.push_back((CqKind::Send, wc, false));
                        self.state = QpState::Sqe;
                        self.flush_sq();
                        return None;
                    }
                }
            }
        }
        let (opcode, imm) = match w.wr.op {
            SendOp::SendWithImm(i) => (Opcode::UD_SEND_ONLY_WITH_IMMEDIATE, Some(i)),
            _ => (Opcode::UD_SEND_ONLY, None),
        };
        let mut r = Repr::new(opcode, dest.remote_qpn, self.psn, w.len);
        self.psn = self.psn.next();
        r.bth.solicited = w.wr.flags.solicited;
        // The privileged Q_Key rule: a WR Q_Key with the high bit set means "the QP's own".
        let qkey = if dest.remote_qkey & 0x8000_0000 != 0 {
            self.qkey
        } else {
            dest.remote_qkey
        };
        r.deth = Some(deth::Repr {
            qkey,
            src_qp: self.qpn,
        });
        r.immediate = imm;
        let mut len = r.emit_header(buf).expect("UD headers match their opcodes");
        if w.wr.flags.inline {
            buf[len..len + w.len].copy_from_slice(&w.wr.inline_data);
            len += w.len;
        }
        self.stats.sent += 1;
        self.unsent += 1;
        if w.wr.flags.signaled {
            // A UD send is complete once it is on the wire: held until the
            // provider has handed the datagram to the kernel, so that the
            // application cannot reuse the buffer before its bytes are copied.
            let mut wc = self.wc(w.wr.wr_id, WcStatus::Success, WcOpcode::Send);
            // Its length, as rxe reports it (and the RC send completions).
            wc.byte_len = w.len as u32;
            self.completions.push_back((CqKind::Send, wc, true));
            self.held += 1;
        }
        Some((
            Transmit {
                len,
                // Inline payload is in `buf`, counted in `len`.
                payload_len: if w.wr.flags.inline { 0 } else { w.len },
                pad: bth::pad_for(w.len),
            },
            dest.ah,
        ))
    }

    /// A received datagram (BTH through ICRC; ICRC checked by the provider).
    pub fn handle_packet(&mut self, packet: &[u8], meta: &RecvMeta, mrs: &MrTable) {
        let Ok(p) = Packet::new_checked(packet) else {
            self.stats.dropped += 1;
            return;
        };
        let info = p.info();
        if info.transport != Transport::Ud
            || p.bth().dest_qp() != self.qpn
            || !matches!(
                self.state,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            )
        {
            self.stats.dropped += 1;
            return;
        }
        let Some(d) = p.deth() else {
            self.stats.dropped += 1;
            return;
        };
        if d.qkey() != self.qkey {
            self.stats.qkey_mismatch += 1;
            return;
        }
        let next = match &self.srq {
            Some(s) => {
                let mut s = s.lock().expect("SRQ lock");
                let pd = s.pd();
                s.take().map(|wr| (wr, pd))
            }
            None => self.rq.pop_front().map(|wr| (wr, self.pd)),
        };
        let Some((wqe, pd)) = next else {
            self.stats.no_receive += 1;
            return;
        };
        let mut segs = SegList::with_capacity(wqe.sgl.len());
        let mut room = 0usize;
        for sge in wqe.sgl.iter().filter(|s| s.len != 0) {
            match mrs.local(pd, sge.lkey, sge.addr, sge.len, Access::LOCAL_WRITE) {
                Ok(s) => {
                    room += s.len();
                    segs.push(s);
                }
                Err(_) => {
                    let wc = self.wc(wqe.wr_id, WcStatus::LocProtErr, WcOpcode::Recv);
                    self.completions.push_back((CqKind::Recv, wc, false));
                    self.enter_error(true);
                    return;
                }
            }
        }
        let payload = p.payload();
        let total = grh::HEADER_LEN + payload.len();
        let mut wc = self.wc(wqe.wr_id, WcStatus::Success, WcOpcode::Recv);
        if total > room {
            // Too big for the buffer: this receive fails, the QP goes on.
            wc.status = WcStatus::LocLenErr;
            self.completions.push_back((CqKind::Recv, wc, false));
            return;
        }
        let mut area = [0u8; grh::HEADER_LEN];
        meta.grh(packet.len())
            .emit(&mut grh::Header::new_unchecked(&mut area[..]));
        scatter(&segs, 0, &area);
        scatter(&segs, grh::HEADER_LEN, payload);
        wc.byte_len = total as u32;
        wc.imm = p.immediate();
        wc.src_qp = d.src_qp();
        wc.grh = true;
        wc.solicited = p.bth().solicited();
        self.stats.received += 1;
        self.completions.push_back((CqKind::Recv, wc, false));
    }

    /// The next work completion: receives' in their order, sends' in theirs,
    /// none past a send completion still held.
    pub fn poll_completion(&mut self) -> Option<(CqKind, WorkCompletion)> {
        let at = if self.held == 0 {
            0
        } else {
            let mut sends_held = false;
            self.completions.iter().position(|&(kind, _, held)| {
                sends_held |= held;
                kind == CqKind::Recv || !sends_held
            })?
        };
        self.completions.remove(at).map(|(kind, wc, _)| (kind, wc))
    }

    /// The datagrams [`UdQp::poll_transmit`] gave are in the socket: their
    /// completions may go to the application.
    pub fn transmitted(&mut self) {
        self.unsent = 0;
        if self.held > 0 {
            for c in &mut self.completions {
                c.2 = false;
            }
            self.held = 0;
        }
    }
}

#[cfg(test)]
mod tests;
