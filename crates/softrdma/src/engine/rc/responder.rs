//! The responder: incoming requests executed against registered memory, in
//! PSN order, with ACKs, NAKs, READ responses and atomic ACKs as rxe sends them.

use std::collections::VecDeque;

use softrdma_wire::aeth::{self, NakCode, RnrTimer, Syndrome};
use softrdma_wire::opcode::{Operation, Position};
use softrdma_wire::packet::{Packet, Repr};
use softrdma_wire::{Opcode, Psn, bth};

use super::requester::packets_for;
use super::{MAX_MESSAGE_LEN, RcQp};
use crate::engine::{CqKind, PostError, QpState, RecvWr, Transmit, WcOpcode, WcStatus};
use crate::engine::{SegList, scatter};
use crate::memory::{Access, MrTable, Segment};

/// A message being received over several packets.
#[derive(Debug)]
enum InProgress {
    /// A SEND into this receive WQE.
    Send {
        wqe: RecvWr,
        segs: SegList,
        room: u64,
        received: u64,
        overflow: bool,
    },
    /// An RDMA WRITE into this range.
    Write {
        seg: Option<Segment>,
        dma_len: u64,
        written: u64,
    },
}

/// What the responder keeps of a READ or atomic, to answer a duplicate.
#[derive(Debug, Clone, Copy)]
enum Resource {
    Read {
        first_psn: Psn,
        npsn: u32,
        va: u64,
        rkey: u32,
        len: u64,
    },
    Atomic {
        psn: Psn,
        original: u64,
    },
}

/// A response waiting to go out.
#[derive(Debug)]
enum Pending {
    Ack {
        psn: Psn,
        syndrome: Syndrome,
        msn: u32,
    },
    AtomicAck {
        psn: Psn,
        original: u64,
        msn: u32,
    },
    /// READ response packets `next..npsn` of a READ of `len` bytes at `first_psn`.
    Read {
        seg: Option<Segment>,
        first_psn: Psn,
        npsn: u32,
        next: u32,
        len: u64,
        msn: u32,
    },
}

/// Answers (ACKs, NAKs, READ response streams, atomic ACKs) queued at most:
/// an honest requester keeps a few READs and one coalesced ACK waiting.
pub(crate) const MAX_QUEUED_ANSWERS: usize = 1024;

#[derive(Debug, Default)]
pub(super) struct Responder {
    /// Expected PSN.
    pub epsn: Psn,
    /// Messages completed.
    pub msn: u32,
    /// A sequence-error NAK went out for the current gap.
    nak_sent: bool,
    current: Option<InProgress>,
    pub rq: VecDeque<RecvWr>,
    resources: VecDeque<Resource>,
    out: VecDeque<Pending>,
}

/// Why a request is refused: the NAK to send.
struct Refusal(NakCode);

impl RcQp {
    pub(super) fn resp_post(&mut self, wr: RecvWr) -> Result<(), PostError> {
        crate::engine::check_post_recv(
            &wr,
            self.srq.is_some(),
            self.state,
            self.resp.rq.len(),
            &self.caps,
        )?;
        if self.state == QpState::Err {
            let wc = self.wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv);
            self.completions.push_back((CqKind::Recv, wc));
            return Ok(());
        }
        self.resp.rq.push_back(wr);
        Ok(())
    }

    /// Queues an ACK, replacing one not yet sent (ACKs are cumulative).
    fn queue_ack(&mut self, psn: Psn) {
        let msn = self.resp.msn;
        if let Some(Pending::Ack { syndrome, .. }) = self.resp.out.back()
            && syndrome.is_ack()
        {
            self.resp.out.pop_back();
        }
        self.resp.out.push_back(Pending::Ack {
            psn,
            syndrome: Syndrome::ACK,
            msn,
        });
    }

    fn queue_nak(&mut self, psn: Psn, syndrome: Syndrome) {
        let msn = self.resp.msn;
        // The same NAK again (a SEND retried into an empty receive queue)
        // is said once: the one queued says it.
        if !matches!(self.resp.out.back(),
            Some(Pending::Ack { psn: p, syndrome: s, .. }) if *p == psn && *s == syndrome)
        {
            self.resp.out.push_back(Pending::Ack { psn, syndrome, msn });
        }
    }

    fn save_resource(&mut self, r: Resource) {
        let max = usize::from(self.max_dest_rd_atomic.max(1));
        while self.resp.resources.len() >= max {
            self.resp.resources.pop_front();
        }
        self.resp.resources.push_back(r);
    }

    pub(super) fn respond_packet(&mut self, p: &Packet<&[u8]>, mrs: &MrTable) {
        if !matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            self.stats.dropped += 1;
            return;
        }
        // Answers wait here until the provider sends them: a peer that asks
        // faster than they leave is held off, its request dropped as if lost
        // (the requester retries), instead of queued without bound.
        if self.resp.out.len() >= MAX_QUEUED_ANSWERS {
            self.stats.dropped += 1;
            return;
        }
        let psn = p.bth().psn();
        let d = psn.distance(self.resp.epsn);
        if d > 0 {
            if !self.resp.nak_sent {
                self.resp.nak_sent = true;
                self.stats.seq_naks_sent += 1;
                let epsn = self.resp.epsn;
                self.queue_nak(epsn, Syndrome::Nak(NakCode::PsnSequenceError));
            } else {
                self.stats.dropped += 1;
            }
            return;
        }
        if d < 0 {
            self.stats.duplicates += 1;
            self.duplicate(p, mrs);
            return;
        }
        if let Err(Refusal(code)) = self.execute(p, mrs) {
            let epsn = self.resp.epsn;
            self.queue_nak(epsn, Syndrome::Nak(code));
            self.enter_error();
        }
    }

    /// A request at the expected PSN.
    fn execute(&mut self, p: &Packet<&[u8]>, mrs: &MrTable) -> Result<(), Refusal> {
        let info = p.info();
        let psn = p.bth().psn();
        let payload = p.payload();
        let invalid = Refusal(NakCode::InvalidRequest);
        // The opcode must continue the message in progress, or start one.
        let continues = match (&self.resp.current, info.operation) {
            (Some(InProgress::Send { .. }), Operation::Send)
            | (Some(InProgress::Write { .. }), Operation::RdmaWrite) => !info.position.starts(),
            (None, _) => info.position.starts(),
            _ => false,
        };
        if !continues {
            return Err(invalid);
        }
        // FIRST and MIDDLE carry exactly a path MTU; LAST at least one byte.
        let plen = payload.len();
        match info.position {
            Position::First | Position::Middle if plen != self.pmtu => return Err(invalid),
            Position::Last if plen == 0 || plen > self.pmtu => return Err(invalid),
            Position::Only if plen > self.pmtu => return Err(invalid),
            _ => {}
        }
        let ack_req = p.bth().ack_req();
        match info.operation {
            Operation::Send => self.execute_send(p, mrs)?,
            Operation::RdmaWrite => self.execute_write(p, mrs)?,
            Operation::ReadRequest => {
                // As rxe: no responder resources, no READs or atomics.
                if !self.access.contains(Access::REMOTE_READ) || self.max_dest_rd_atomic == 0 {
                    return Err(invalid);
                }
                let reth = p.reth().expect("READ requests carry a RETH");
                let len = u64::from(reth.dma_len());
                // IB messages are at most 2^31 bytes; a longer READ's
                // responses could span half the PSN space, where a duplicate
                // can no longer be told from a new request.
                if len > MAX_MESSAGE_LEN {
                    return Err(invalid);
                }
                let seg = if len == 0 {
                    None
                } else {
                    Some(
                        mrs.remote(self.pd, reth.rkey(), reth.va(), len, Access::REMOTE_READ)
                            .map_err(|_| Refusal(NakCode::RemoteAccessError))?,
                    )
                };
                let npsn = packets_for(len, self.pmtu);
                self.save_resource(Resource::Read {
                    first_psn: psn,
                    npsn,
                    va: reth.va(),
                    rkey: reth.rkey(),
                    len,
                });
                self.resp.msn = self.resp.msn.wrapping_add(1) & 0xff_ffff;
                let msn = self.resp.msn;
                self.resp.out.push_back(Pending::Read {
                    seg,
                    first_psn: psn,
                    npsn,
                    next: 0,
                    len,
                    msn,
                });
                self.resp.epsn = psn.add(npsn);
                self.resp.nak_sent = false;
                return Ok(());
            }
            Operation::CompareSwap | Operation::FetchAdd => {
                if !self.access.contains(Access::REMOTE_ATOMIC) || self.max_dest_rd_atomic == 0 {
                    return Err(invalid);
                }
                let a = p.atomic_eth().expect("atomics carry an AtomicETH");
                if !a.va().is_multiple_of(8) {
                    return Err(invalid);
                }
                let seg = mrs
                    .remote(self.pd, a.rkey(), a.va(), 8, Access::REMOTE_ATOMIC)
                    .map_err(|_| Refusal(NakCode::RemoteAccessError))?;
                let original = if info.operation == Operation::CompareSwap {
                    seg.compare_swap(a.compare(), a.swap_add())
                } else {
                    seg.fetch_add(a.swap_add())
                };
                self.save_resource(Resource::Atomic { psn, original });
                self.resp.msn = self.resp.msn.wrapping_add(1) & 0xff_ffff;
                let msn = self.resp.msn;
                self.resp
                    .out
                    .push_back(Pending::AtomicAck { psn, original, msn });
                self.resp.epsn = psn.next();
                self.resp.nak_sent = false;
                return Ok(());
            }
            _ => return Err(invalid),
        }
        // SEND and WRITE packets that were accepted (not RNR-NAKed) advance.
        if self.resp.epsn == psn {
            return Ok(());
        }
        if ack_req {
            self.queue_ack(psn);
        }
        Ok(())
    }

    /// RNR-NAKs the expected PSN: no receive WQE for it.
    fn rnr_nak(&mut self) {
        self.stats.rnr_naks_sent += 1;
        let epsn = self.resp.epsn;
        self.queue_nak(
            epsn,
            Syndrome::RnrNak(RnrTimer::from_code(self.min_rnr_timer)),
        );
    }

    /// Takes the next receive WQE with its buffers resolved, or RNR-NAKs.
    fn take_recv(&mut self, mrs: &MrTable) -> Result<Option<(RecvWr, SegList, u64)>, Refusal> {
        let Some((wqe, pd)) = self.next_recv() else {
            self.rnr_nak();
            return Ok(None);
        };
        let mut segs = SegList::with_capacity(wqe.sgl.len());
        let mut room = 0u64;
        for sge in &wqe.sgl {
            if sge.len == 0 {
                continue;
            }
            match mrs.local(pd, sge.lkey, sge.addr, sge.len, Access::LOCAL_WRITE) {
                Ok(s) => {
                    room += s.len() as u64;
                    segs.push(s);
                }
                Err(_) => {
                    let wc = self.wc(wqe.wr_id, WcStatus::LocProtErr, WcOpcode::Recv);
                    self.completions.push_back((CqKind::Recv, wc));
                    return Err(Refusal(NakCode::RemoteOperationalError));
                }
            }
        }
        // No message is longer than 2 GiB, whatever the receive holds.
        Ok(Some((wqe, segs, room.min(MAX_MESSAGE_LEN))))
    }

    fn finish_recv(&mut self, wqe: &RecvWr, opcode: WcOpcode, byte_len: u64, p: &Packet<&[u8]>) {
        let mut wc = self.wc(wqe.wr_id, WcStatus::Success, opcode);
        wc.byte_len = byte_len as u32;
        wc.imm = p.immediate();
        wc.invalidated_rkey = p.invalidate_rkey();
        wc.solicited = p.bth().solicited();
        self.completions.push_back((CqKind::Recv, wc));
        self.resp.msn = self.resp.msn.wrapping_add(1) & 0xff_ffff;
    }

    fn execute_send(&mut self, p: &Packet<&[u8]>, mrs: &MrTable) -> Result<(), Refusal> {
        let info = p.info();
        let psn = p.bth().psn();
        if info.position.starts() {
            let Some((wqe, segs, room)) = self.take_recv(mrs)? else {
                return Ok(());
            };
            self.resp.current = Some(InProgress::Send {
                wqe,
                segs,
                room,
                received: 0,
                overflow: false,
            });
        }
        let payload = p.payload();
        let Some(InProgress::Send {
            segs,
            room,
            received,
            overflow,
            ..
        }) = &mut self.resp.current
        else {
            unreachable!("a SEND is in progress");
        };
        if *received + payload.len() as u64 > *room {
            *overflow = true;
        }
        if !*overflow {
            scatter(segs, *received as usize, payload);
        }
        *received += payload.len() as u64;
        self.resp.epsn = psn.next();
        self.resp.nak_sent = false;
        if info.position.ends() {
            let Some(InProgress::Send {
                wqe,
                received,
                overflow,
                ..
            }) = self.resp.current.take()
            else {
                unreachable!("a SEND is in progress");
            };
            if overflow {
                // As rxe: the receive fails with a length error, the sender
                // hears "remote operational error" at the last packet.
                let mut wc = self.wc(wqe.wr_id, WcStatus::LocLenErr, WcOpcode::Recv);
                wc.byte_len = received as u32;
                self.completions.push_back((CqKind::Recv, wc));
                self.resp.epsn = psn;
                return Err(Refusal(NakCode::RemoteOperationalError));
            }
            if let Some(rkey) = p.invalidate_rkey() {
                // SEND with invalidate: the key stops working before the
                // receive completes (and before the next packet is looked
                // at). One not of this QP's PD, or no remote key: the
                // receive fails and the sender hears "invalid request".
                if !mrs.invalidate(self.pd, rkey) {
                    let wc = self.wc(wqe.wr_id, WcStatus::RemInvReqErr, WcOpcode::Recv);
                    self.completions.push_back((CqKind::Recv, wc));
                    self.resp.epsn = psn;
                    return Err(Refusal(NakCode::InvalidRequest));
                }
            }
            self.finish_recv(&wqe, WcOpcode::Recv, received, p);
        }
        Ok(())
    }

    fn execute_write(&mut self, p: &Packet<&[u8]>, mrs: &MrTable) -> Result<(), Refusal> {
        if !self.access.contains(Access::REMOTE_WRITE) {
            return Err(Refusal(NakCode::InvalidRequest));
        }
        let info = p.info();
        let psn = p.bth().psn();
        let payload = p.payload();
        // WRITE with immediate consumes a receive WQE at its last packet (the
        // one with the immediate). None waiting: RNR before any other check,
        // as rxe's responder looks for it before the rkey. (A peek: one
        // posted meanwhile waits for the retry; one another QP takes from
        // the SRQ meanwhile is missed at the take below, which RNR-NAKs.)
        let needs_recv = info.has_immediate();
        if needs_recv && !self.has_recv() {
            self.rnr_nak();
            return Ok(());
        }
        if info.position == Position::Only && !needs_recv {
            // Every packet of a WRITE without immediate is a WRITE ONLY (see
            // the requester): it borrows its region for its one packet. A
            // reference count taken and dropped per packet put a locked
            // instruction right after each 4 KiB copy, which waits there for
            // the copy's stores (5 % of a 1 MiB WRITE stream's CPU).
            let reth = p.reth().expect("WRITE ONLY carries a RETH");
            if u64::from(reth.dma_len()) != payload.len() as u64 {
                return Err(Refusal(NakCode::InvalidRequest));
            }
            // rxe ACKs a zero-length WRITE without looking at the key.
            if !payload.is_empty() {
                mrs.remote_ref(
                    self.pd,
                    reth.rkey(),
                    reth.va(),
                    payload.len() as u64,
                    Access::REMOTE_WRITE,
                )
                .map_err(|_| Refusal(NakCode::RemoteAccessError))?
                .write(0, payload);
            }
            self.resp.current = None;
            self.resp.epsn = psn.next();
            self.resp.nak_sent = false;
            self.resp.msn = self.resp.msn.wrapping_add(1) & 0xff_ffff;
            return Ok(());
        }
        if info.position.starts() {
            let reth = p.reth().expect("WRITE FIRST/ONLY carry a RETH");
            let dma_len = u64::from(reth.dma_len());
            if (info.position == Position::Only && dma_len != payload.len() as u64)
                || (info.position == Position::First && dma_len <= payload.len() as u64)
            {
                return Err(Refusal(NakCode::InvalidRequest));
            }
            // rxe ACKs a zero-length WRITE without looking at the key.
            let seg = if dma_len == 0 {
                None
            } else {
                Some(
                    mrs.remote(
                        self.pd,
                        reth.rkey(),
                        reth.va(),
                        dma_len,
                        Access::REMOTE_WRITE,
                    )
                    .map_err(|_| Refusal(NakCode::RemoteAccessError))?,
                )
            };
            self.resp.current = Some(InProgress::Write {
                seg,
                dma_len,
                written: 0,
            });
        }
        let Some(InProgress::Write {
            dma_len, written, ..
        }) = &self.resp.current
        else {
            unreachable!("a WRITE is in progress");
        };
        let (start, total) = (*written, *dma_len);
        let end = start + payload.len() as u64;
        if end > total || (info.position.ends() && end != total) {
            return Err(Refusal(NakCode::InvalidRequest));
        }
        // The receive is taken (one pop, the SRQ's other takers
        // notwithstanding) before the payload lands, so that an RNR retry
        // finds memory unchanged. One whose buffers fail their checks is
        // NAKed at this packet's PSN, as an overflowing SEND is: the
        // requester fails this WQE, not the next.
        let recv = if needs_recv {
            match self.take_recv(mrs)? {
                Some((wqe, _, _)) => Some(wqe),
                None => {
                    // RNR: an ONLY packet comes again as a new message.
                    if info.position.starts() {
                        self.resp.current = None;
                    }
                    return Ok(());
                }
            }
        } else {
            None
        };
        let Some(InProgress::Write { seg, written, .. }) = &mut self.resp.current else {
            unreachable!("a WRITE is in progress");
        };
        if let Some(s) = seg {
            s.write(start as usize, payload);
        }
        *written = end;
        self.resp.epsn = psn.next();
        self.resp.nak_sent = false;
        if info.position.ends() {
            self.resp.current = None;
            match recv {
                Some(wqe) => self.finish_recv(&wqe, WcOpcode::RecvRdmaWithImm, total, p),
                None => self.resp.msn = self.resp.msn.wrapping_add(1) & 0xff_ffff,
            }
        }
        Ok(())
    }

    /// A request below the expected PSN: re-ACK, re-read, or replay an atomic.
    fn duplicate(&mut self, p: &Packet<&[u8]>, mrs: &MrTable) {
        let psn = p.bth().psn();
        let msn = self.resp.msn;
        match p.info().operation {
            Operation::ReadRequest => {
                let found = self.resp.resources.iter().rev().find_map(|r| match *r {
                    Resource::Read {
                        first_psn,
                        npsn,
                        va,
                        rkey,
                        len,
                    } if psn.in_range(first_psn, npsn) => Some((first_psn, npsn, va, rkey, len)),
                    _ => None,
                });
                let Some((first_psn, npsn, va, rkey, len)) = found else {
                    self.stats.dropped += 1;
                    return;
                };
                // As rxe: a retry names the same key and a range inside the
                // first READ's (the requester restarts at a later packet with
                // the address and length moved on); anything else is dropped.
                let Some(reth) = p.reth() else {
                    self.stats.dropped += 1;
                    return;
                };
                let inside = reth.va() >= va
                    && (reth.va() - va).saturating_add(u64::from(reth.dma_len())) <= len;
                if reth.rkey() != rkey || !inside {
                    self.stats.dropped += 1;
                    return;
                }
                let from = psn.distance(first_psn) as u32;
                // One stream per READ: asked again while its responses are
                // queued (the requester's retry, or a peer flooding one
                // request), the queued stream goes back to the PSN asked
                // for instead of a second one queueing behind it.
                if let Some(Pending::Read { next, .. }) =
                    self.resp.out.iter_mut().find(
                        |p| matches!(p, Pending::Read { first_psn: f, .. } if *f == first_psn),
                    )
                {
                    *next = (*next).min(from);
                    return;
                }
                // Re-execute from memory, from the PSN asked for.
                let seg = if len == 0 {
                    None
                } else {
                    match mrs.remote(self.pd, rkey, va, len, Access::REMOTE_READ) {
                        Ok(s) => Some(s),
                        Err(_) => {
                            self.stats.dropped += 1;
                            return;
                        }
                    }
                };
                self.resp.out.push_back(Pending::Read {
                    seg,
                    first_psn,
                    npsn,
                    next: from,
                    len,
                    msn,
                });
            }
            Operation::CompareSwap | Operation::FetchAdd => {
                let found = self.resp.resources.iter().rev().find_map(|r| match *r {
                    Resource::Atomic { psn: q, original } if q == psn => Some(original),
                    _ => None,
                });
                match found {
                    // Never execute an atomic twice: replay the saved result.
                    Some(original) => {
                        self.resp
                            .out
                            .push_back(Pending::AtomicAck { psn, original, msn })
                    }
                    None => self.stats.dropped += 1,
                }
            }
            _ => {
                if p.bth().ack_req() {
                    let last = self.resp.epsn.sub(1);
                    self.queue_ack(last);
                }
            }
        }
    }

    /// Response packets queued: ACKs, READ response packets not yet sent,
    /// atomic ACKs.
    pub(crate) fn responses_queued(&self) -> u32 {
        self.resp
            .out
            .iter()
            .map(|p| match p {
                Pending::Read { npsn, next, .. } => npsn - next,
                Pending::Ack { .. } | Pending::AtomicAck { .. } => 1,
            })
            .fold(0, u32::saturating_add)
    }

    pub(super) fn resp_transmit(
        &mut self,
        buf: &mut [u8],
        pieces: &mut dyn crate::memory::PieceSink,
    ) -> Option<Transmit> {
        let dest_qp = self.dest_qp;
        let pmtu = self.pmtu;
        let front = self.resp.out.front_mut()?;
        let (repr, payload_len) = match front {
            Pending::Ack { psn, syndrome, msn } => {
                // One a message or one in 64 packets, and one in each busy-poll
                // half round trip: BTH and AETH written directly, as a
                // READ RESPONSE MIDDLE's BTH below.
                let bth = bth::Repr::new(Opcode::RC_ACKNOWLEDGE, dest_qp, *psn, 0);
                bth.emit(&mut bth::Header::new_unchecked(&mut buf[..bth::HEADER_LEN]));
                let aeth = aeth::Repr {
                    syndrome: *syndrome,
                    msn: *msn,
                };
                let len = bth::HEADER_LEN + aeth::HEADER_LEN;
                aeth.emit(&mut aeth::Header::new_unchecked(
                    &mut buf[bth::HEADER_LEN..len],
                ));
                self.resp.out.pop_front();
                return Some(Transmit {
                    len,
                    payload_len: 0,
                    pad: 0,
                });
            }
            Pending::AtomicAck { psn, original, msn } => {
                let mut r = Repr::new(Opcode::RC_ATOMIC_ACKNOWLEDGE, dest_qp, *psn, 0);
                r.aeth = Some(aeth::Repr {
                    syndrome: Syndrome::ACK,
                    msn: *msn,
                });
                r.atomic_ack = Some(*original);
                self.resp.out.pop_front();
                (r, 0)
            }
            Pending::Read {
                seg,
                first_psn,
                npsn,
                next,
                len,
                msn,
            } => {
                let k = *next;
                let n = *npsn;
                let off = u64::from(k) * pmtu as u64;
                let plen = (*len - off.min(*len)).min(pmtu as u64) as usize;
                let opcode = match (k == 0, k + 1 == n) {
                    (true, true) => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
                    (true, false) => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                    (false, true) => Opcode::RC_RDMA_READ_RESPONSE_LAST,
                    (false, false) => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
                };
                if opcode == Opcode::RC_RDMA_READ_RESPONSE_MIDDLE {
                    // Most packets of a long READ: a bare BTH, written
                    // without the general `Repr` (some 200 instructions).
                    let bth = bth::Repr::new(opcode, dest_qp, first_psn.add(k), bth::pad_for(plen));
                    bth.emit(&mut bth::Header::new_unchecked(&mut buf[..bth::HEADER_LEN]));
                    let payload_len = push_read_piece(seg.as_ref(), off as usize, plen, pieces);
                    // Not the last: the READ stays queued.
                    *next += 1;
                    return Some(Transmit {
                        len: bth::HEADER_LEN,
                        payload_len,
                        pad: bth::pad_for(payload_len),
                    });
                }
                let mut r = Repr::new(opcode, dest_qp, first_psn.add(k), plen);
                if k == 0 || k + 1 == n {
                    r.aeth = Some(aeth::Repr {
                        syndrome: Syndrome::ACK,
                        msn: *msn,
                    });
                }
                let payload_len = push_read_piece(seg.as_ref(), off as usize, plen, pieces);
                *next += 1;
                if *next >= n {
                    self.resp.out.pop_front();
                }
                (r, payload_len)
            }
        };
        let len = repr
            .emit_header(buf)
            .expect("the responder builds headers that match their opcodes");
        Some(Transmit {
            len,
            payload_len,
            pad: bth::pad_for(payload_len),
        })
    }

    /// On ERR: receives are flushed; only NAKs already queued still go out.
    pub(super) fn resp_flush(&mut self) {
        if let Some(InProgress::Send { wqe, .. }) = self.resp.current.take() {
            let wc = self.wc(wqe.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv);
            self.completions.push_back((CqKind::Recv, wc));
        }
        while let Some(wqe) = self.resp.rq.pop_front() {
            let wc = self.wc(wqe.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv);
            self.completions.push_back((CqKind::Recv, wc));
        }
        self.resp
            .out
            .retain(|p| matches!(p, Pending::Ack { syndrome, .. } if !syndrome.is_ack()));
    }
}

/// Pushes `len` bytes of a READ's source `seg` from `off` onto `pieces`;
/// returns the payload length (0 for a zero-length READ, which has no
/// segment, or a range past it, which validation at the request rules out).
fn push_read_piece(
    seg: Option<&Segment>,
    off: usize,
    len: usize,
    pieces: &mut dyn crate::memory::PieceSink,
) -> usize {
    match seg {
        Some(s) if s.covers(off, len) => {
            pieces.push_range(s, off, len);
            len
        }
        _ => 0,
    }
}
