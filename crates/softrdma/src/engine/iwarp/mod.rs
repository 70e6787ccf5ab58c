//! The iWARP transport: RDMAP (RFC 5040) over DDP (RFC 5041) over MPA
//! (RFC 5044), sans-I/O. TCP does the reliability, so there are no PSNs,
//! ACKs or timers: the work is segmentation, placement and error semantics.
//!
//! Transmit: [`IwarpQp::poll_transmit`] writes an FPDU's MPA length field and
//! DDP/RDMAP headers into a buffer and names the region pieces that carry its
//! payload; the provider sends them with gather I/O and appends pad and CRC.
//!
//! Receive is two steps so that payload lands straight in the region: the
//! provider reads an FPDU's length and DDP header and calls
//! [`IwarpQp::accept_header`], which checks STag, bounds, rights, queue and
//! sequence and answers where the payload goes ([`Placement`]); the provider
//! reads the payload there, checks the CRC and calls
//! [`IwarpQp::segment_done`].
//!
//! Completions: a SEND or WRITE completes when its last FPDU is handed to the
//! provider (as siw's do when written to the socket), a READ when its last
//! response segment is placed, a receive at the last segment of its message.
//! Completions come in posting order.
//!
//! Remote access is checked twice, as the IB verbs do: the QP's own access
//! flags ([`IwarpQp::set_access`]; iw_cm's default allows WRITE and READ),
//! then the target region's rights.
//!
//! Errors: a bad STag, bounds, rights, a SEND with no receive posted (iWARP
//! has no RNR), a malformed segment or a CRC error make this side send a
//! Terminate, go to ERROR and flush; a Terminate from the peer or a lost
//! connection do the same without a Terminate.

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use softrdma_wire::ddp::{self, QN_READ_REQUEST, QN_SEND, QN_TERMINATE};
use softrdma_wire::rdmap::{
    self, CopiedDdpHeader, Layer, Opcode, ReadRequest, ReadRequestRepr, TermControl, TermEncoding,
    TerminateRepr,
};

use super::rc::{MAX_MESSAGE_LEN, QpCaps};
use super::srq::Srq;
use super::{
    CqKind, PostError, QpEvent, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
    check_post_recv, push_pieces,
};
use crate::engine::SegList;
use crate::engine::qp::QpState;
use crate::memory::{Access, AccessError, MrTable, PdId, Segment};

/// The access an iWARP QP allows unless told otherwise: iw_cm's (WRITE and
/// READ).
pub const DEFAULT_ACCESS: Access = Access::REMOTE_WRITE.with(Access::REMOTE_READ);

/// Largest header [`IwarpQp::poll_transmit`] writes: MPA length, untagged DDP
/// header, a Read Request, or a Terminate body with copied headers.
pub const MAX_HEADER_LEN: usize = 2 + ddp::UNTAGGED_HEADER_LEN + 4 + 2 + 18 + 28;

/// What the connection agreed (MPA) and what the provider's stream allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IwarpConfig {
    /// Largest ULPDU (DDP segment) to send: siw keeps FPDUs within the MSS.
    pub max_ulpdu: usize,
    /// Inbound READs served at once.
    pub ird: u16,
    /// Outbound READs outstanding at once.
    pub ord: u16,
    /// How to lay out the Terminates this side sends.
    pub terminate_encoding: TermEncoding,
    /// Peer-to-peer mode (RFC 6581), if negotiated.
    pub p2p: Option<P2p>,
}

/// The zero-length message that ends a peer-to-peer establishment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rtr {
    /// A zero-length RDMA WRITE.
    Write,
    /// A zero-length RDMA READ (answered by a zero-length READ Response).
    Read,
}

/// A side's part in a peer-to-peer establishment: the initiator sends the
/// RTR message as its first FPDU; the responder sends nothing before it
/// has the RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2p {
    /// Initiator.
    Send(Rtr),
    /// Responder.
    Await(Rtr),
}

impl Default for IwarpConfig {
    /// siw's: ULPDU 1442 (an FPDU in a 1448-byte segment), IRD = ORD = 1.
    fn default() -> Self {
        IwarpConfig {
            max_ulpdu: 1442,
            ird: 1,
            ord: 1,
            terminate_encoding: TermEncoding::Rfc,
            p2p: None,
        }
    }
}

/// One FPDU handed to the provider: `header_len` bytes of the buffer (MPA
/// length field first), then `payload_len` bytes of region pieces; the
/// provider adds [`softrdma_wire::mpa::pad_len`] pad bytes and the CRC field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Bytes of the buffer to send first.
    pub header_len: usize,
    /// Bytes of the pieces after them.
    pub payload_len: usize,
    /// The ULPDU length (the MPA length field's value).
    pub ulpdu_len: usize,
}

/// Where an inbound segment's payload goes.
#[derive(Debug)]
pub enum Placement {
    /// Straight into the region pieces `accept_header` filled in, in order
    /// (they add up to the payload length).
    Data,
    /// Into a buffer the provider hands back to `segment_done` (Read
    /// Requests and Terminates: small control messages).
    Control,
    /// Read and drop (the segment failed; a Terminate is on its way).
    Discard,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IwarpStats {
    /// FPDUs sent.
    pub fpdus_sent: u64,
    /// The longest ULPDU sent (the FPDU size in use).
    pub largest_ulpdu_sent: usize,
    /// FPDUs received.
    pub fpdus_received: u64,
    /// Terminates sent.
    pub terminates_sent: u64,
    /// Terminates received.
    pub terminates_received: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Rts,
    /// A Terminate is queued or sent; nothing else goes out.
    Error,
}

/// A WQE whose completion is due in posting order.
#[derive(Debug)]
struct Pending {
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    byte_len: u32,
    done: Option<WcStatus>,
    /// Sequence number (to find it again).
    seq: u64,
}

/// A WQE being transmitted.
#[derive(Debug)]
struct SqEntry {
    wr: SendWr,
    seq: u64,
    /// Payload bytes handed out so far.
    sent: usize,
    /// Total payload bytes.
    len: usize,
    /// Resolved local pieces (on first transmit).
    segs: Option<SegList>,
    /// MSN of this message on its queue (untagged).
    msn: u32,
}

/// A READ this side asked for.
#[derive(Debug)]
struct OutRead {
    seq: u64,
    sink_stag: u32,
    sink_to: u64,
    segs: SegList,
    len: usize,
    got: usize,
}

/// A READ the peer asked for, being answered.
#[derive(Debug)]
struct InRead {
    sink_stag: u32,
    sink_to: u64,
    /// None for a zero-length READ (whose STag is not checked).
    src: Option<Segment>,
    sent: usize,
}

impl InRead {
    /// Bytes still to answer.
    fn left(&self) -> usize {
        self.src.as_ref().map_or(0, Segment::len) - self.sent
    }
}

/// A receive WQE.
#[derive(Debug)]
struct RqEntry {
    wr: RecvWr,
    /// The PD of its lkeys: the QP's, or its SRQ's.
    pd: PdId,
    /// Resolved when its message starts.
    segs: Option<SegList>,
    len: usize,
    /// Bytes of its message placed so far: the next segment's offset.
    placed: usize,
}

impl RqEntry {
    fn new(wr: RecvWr, pd: PdId) -> RqEntry {
        let len = wr.sgl.iter().map(|s| s.len as usize).sum();
        RqEntry {
            wr,
            pd,
            segs: None,
            len,
            placed: 0,
        }
    }
}

/// What the current inbound segment is, between `accept_header` and
/// `segment_done`.
#[derive(Debug, Clone, Copy)]
enum RxSeg {
    Write,
    ReadResponse {
        last: bool,
        len: usize,
    },
    Send {
        last: bool,
        end: usize,
        solicited: bool,
        invalidate: Option<u32>,
    },
    ReadRequest {
        /// In the peer-to-peer RTR's place: a zero-length one is answered
        /// whatever the QP's access.
        rtr: bool,
    },
    Terminate,
    Failed,
}

/// An iWARP QP's transport.
#[derive(Debug)]
pub struct IwarpQp {
    qpn: u32,
    pd: PdId,
    caps: QpCaps,
    cfg: IwarpConfig,
    /// The remote operations the QP allows (`qp_access_flags`).
    access: Access,
    state: State,
    next_seq: u64,
    pending: VecDeque<Pending>,
    /// WQEs whose last FPDU went to the provider, not yet confirmed sent.
    unconfirmed: Vec<u64>,
    sq: VecDeque<SqEntry>,
    reads_out: VecDeque<OutRead>,
    irq: VecDeque<InRead>,
    /// Posted receives; with an SRQ, only the one a message is landing in.
    rq: VecDeque<RqEntry>,
    /// Where receives come from, if shared.
    srq: Option<Arc<Mutex<Srq>>>,
    /// Next MSN to send on the SEND queue and the READ queue.
    send_msn: u32,
    read_msn: u32,
    /// Next MSN expected on each untagged queue.
    recv_send_msn: u32,
    recv_read_msn: u32,
    rx: Option<RxSeg>,
    /// Payload length of the current inbound segment.
    rx_payload_len: usize,
    /// Terminate to send (body), and the header of the segment that caused it.
    terminate: Option<TerminateRepr>,
    terminate_sent: bool,
    completions: VecDeque<(CqKind, WorkCompletion)>,
    events: VecDeque<QpEvent>,
    /// The Terminate the peer sent, if any.
    peer_terminate: Option<TerminateRepr>,
    /// Peer-to-peer: the RTR message still to send, the one still awaited,
    /// and whether the READ Response to this side's RTR READ is due.
    rtr_to_send: Option<Rtr>,
    rtr_awaited: Option<Rtr>,
    rtr_response_due: bool,
    stats: IwarpStats,
}

impl IwarpQp {
    /// A QP in RTS on an established connection.
    pub fn new(qpn: u32, pd: PdId, caps: QpCaps, cfg: IwarpConfig) -> IwarpQp {
        IwarpQp {
            qpn,
            pd,
            caps,
            cfg: IwarpConfig {
                max_ulpdu: cfg.max_ulpdu.clamp(64, softrdma_wire::mpa::MAX_ULPDU),
                ..cfg
            },
            access: DEFAULT_ACCESS,
            state: State::Rts,
            next_seq: 0,
            pending: VecDeque::new(),
            unconfirmed: Vec::new(),
            sq: VecDeque::new(),
            reads_out: VecDeque::new(),
            irq: VecDeque::new(),
            rq: VecDeque::new(),
            srq: None,
            send_msn: 1,
            read_msn: 1,
            recv_send_msn: 1,
            recv_read_msn: 1,
            rx: None,
            rx_payload_len: 0,
            terminate: None,
            terminate_sent: false,
            completions: VecDeque::new(),
            events: VecDeque::new(),
            peer_terminate: None,
            rtr_to_send: match cfg.p2p {
                Some(P2p::Send(r)) => Some(r),
                _ => None,
            },
            rtr_awaited: match cfg.p2p {
                Some(P2p::Await(r)) => Some(r),
                _ => None,
            },
            rtr_response_due: false,
            stats: IwarpStats::default(),
        }
    }

    /// The QP takes its receives from `srq` (SENDs take one as they start);
    /// receives posted to the QP itself are refused.
    pub fn with_srq(mut self, srq: Arc<Mutex<Srq>>) -> IwarpQp {
        self.srq = Some(srq);
        self
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The remote operations the QP allows from now on (`qp_access_flags`;
    /// only REMOTE_WRITE and REMOTE_READ mean anything on iWARP).
    pub fn set_access(&mut self, access: Access) {
        self.access = access;
    }

    /// The remote operations the QP allows.
    pub fn access(&self) -> Access {
        self.access
    }

    /// RTS, or ERROR after a failure.
    pub fn state(&self) -> QpState {
        match self.state {
            State::Rts => QpState::Rts,
            State::Error => QpState::Err,
        }
    }

    /// Counters.
    pub fn stats(&self) -> IwarpStats {
        self.stats
    }

    /// The Terminate the peer sent, if one came.
    pub fn peer_terminate(&self) -> Option<&TerminateRepr> {
        self.peer_terminate.as_ref()
    }

    /// The Terminate this side sent (or is sending), if any.
    pub fn own_terminate(&self) -> Option<&TerminateRepr> {
        self.terminate.as_ref()
    }

    /// The checks a send WR passes before it is posted (with or without a
    /// connection): an operation iWARP has, and `check_post_send`'s. Returns
    /// its length.
    pub fn check_send(wr: &SendWr, caps: &QpCaps) -> Result<u64, PostError> {
        match wr.op {
            SendOp::Send
            | SendOp::SendWithInv(_)
            | SendOp::LocalInv(_)
            | SendOp::Write { .. }
            | SendOp::Read { .. } => {}
            SendOp::SendWithImm(_) | SendOp::WriteWithImm { .. } => {
                return Err(PostError::Unsupported(
                    "iWARP has no immediate data (RDMAP carries none)",
                ));
            }
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                return Err(PostError::Unsupported(
                    "iWARP (RFC 5040) has no atomic operations",
                ));
            }
        }
        crate::engine::check_post_send(wr, caps)
    }

    /// Posts a send WR.
    pub fn post_send(&mut self, wr: SendWr) -> Result<(), PostError> {
        // At most 2 GiB: `len` fits in `usize` and the u32 fields below.
        let len = Self::check_send(&wr, &self.caps)? as usize;
        if self.sq.len() + self.reads_out.len() >= self.caps.max_send_wr as usize {
            return Err(PostError::QueueFull(self.caps.max_send_wr));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push_back(Pending {
            wr_id: wr.wr_id,
            opcode: wr.op.wc_opcode(),
            signaled: wr.flags.signaled,
            byte_len: len as u32,
            done: None,
            seq,
        });
        if self.state == State::Error {
            // Posted to a QP in error: flushed, in order behind what is
            // still being settled (as siw does, and the IB verbs ask: how
            // an application drains a QP it is tearing down).
            self.complete(seq, WcStatus::WrFlushErr);
            return Ok(());
        }
        self.sq.push_back(SqEntry {
            wr,
            seq,
            sent: 0,
            len,
            segs: None,
            msn: 0,
        });
        Ok(())
    }

    /// Posts a receive WR.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        let state = self.state();
        check_post_recv(&wr, self.srq.is_some(), state, self.rq.len(), &self.caps)?;
        if state == QpState::Err {
            // Flushed at once, as a send WR is.
            let wc = WorkCompletion::new(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qpn);
            self.completions.push_back((CqKind::Recv, wc));
            return Ok(());
        }
        self.rq.push_back(RqEntry::new(wr, self.pd));
        Ok(())
    }

    fn complete(&mut self, seq: u64, status: WcStatus) {
        if let Some(p) = self.pending.iter_mut().find(|p| p.seq == seq) {
            p.done = Some(status);
        }
        while let Some(p) = self.pending.front() {
            let Some(status) = p.done else { break };
            let p = self.pending.pop_front().expect("front");
            if p.signaled || status != WcStatus::Success {
                let mut wc = WorkCompletion::new(p.wr_id, status, p.opcode, self.qpn);
                wc.byte_len = if status == WcStatus::Success {
                    p.byte_len
                } else {
                    0
                };
                self.completions.push_back((CqKind::Send, wc));
            }
        }
    }

    /// Next completion.
    pub fn poll_completion(&mut self) -> Option<(CqKind, WorkCompletion)> {
        self.completions.pop_front()
    }

    /// Next asynchronous event.
    pub fn poll_event(&mut self) -> Option<QpEvent> {
        self.events.pop_front()
    }

    /// The QP fails, with a fatal event (the application didn't ask for
    /// it): see [`flush`](Self::flush).
    fn fail(&mut self, head_status: Option<WcStatus>) {
        if self.flush(head_status) {
            self.events.push_back(QpEvent::Fatal);
        }
    }

    /// Moves to ERR: `head` (a send WQE) completes with `status`, everything
    /// else is flushed. `false` if that was done already.
    fn flush(&mut self, head_status: Option<WcStatus>) -> bool {
        // WQEs whose bytes are being written are the transmit side's to
        // settle (`transmitted` or `transmit_failed`), whatever the receive
        // side learns meanwhile: they went out before it.
        let unconfirmed = &self.unconfirmed;
        let open = |p: &Pending| p.done.is_none() && !unconfirmed.contains(&p.seq);
        if self.state == State::Error && !self.pending.iter().any(open) {
            return false;
        }
        self.state = State::Error;
        // The oldest unreported WQE takes the error; everything after it is
        // flushed, even what already went out (completions stay in order).
        let mut first = head_status;
        for p in self
            .pending
            .iter_mut()
            .filter(|p| !unconfirmed.contains(&p.seq))
        {
            p.done = Some(first.take().unwrap_or(WcStatus::WrFlushErr));
        }
        if let Some((seq, status)) = self.pending.iter().find_map(|p| Some((p.seq, p.done?))) {
            self.complete(seq, status);
        }
        self.sq.clear();
        self.reads_out.clear();
        self.irq.clear();
        // With an SRQ, only the receive this QP took is flushed: the
        // SRQ's stay for its other QPs.
        while let Some(r) = self.rq.pop_front() {
            let wc =
                WorkCompletion::new(r.wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qpn);
            self.completions.push_back((CqKind::Recv, wc));
        }
        if self.srq.is_some() {
            // IBV_EVENT_QP_LAST_WQE_REACHED: it takes no more from the SRQ.
            self.events.push_back(QpEvent::LastWqeReached);
        }
        true
    }

    /// Queues a Terminate for the segment whose DDP header is `hdr` and fails.
    fn terminate(&mut self, layer: Layer, etype: u8, code: u8, hdr: &[u8], head: Option<WcStatus>) {
        if self.terminate.is_none() && self.state == State::Rts {
            let copied = CopiedDdpHeader::from_bytes(hdr).ok();
            self.terminate = Some(TerminateRepr {
                encoding: self.cfg.terminate_encoding,
                control: TermControl {
                    layer,
                    etype,
                    code,
                    m: copied.is_some(),
                    d: copied.is_some(),
                    r: false,
                },
                ddp_segment_length: copied
                    .is_some()
                    .then_some((hdr.len() + self.rx_payload_len).min(usize::from(u16::MAX)) as u16),
                ddp_header: copied,
                rdma_header: None,
            });
        }
        self.fail(head);
    }

    /// A Terminate for a Read Request this side refuses: the request's
    /// header goes with it.
    fn terminate_read(&mut self, req: &ReadRequestRepr, layer: Layer, etype: u8, code: u8) {
        let first = self.terminate.is_none() && self.state == State::Rts;
        self.terminate(layer, etype, code, &[], None);
        if let Some(t) = self.terminate.as_mut().filter(|_| first) {
            t.control.r = true;
            t.rdma_header = Some(*req);
        }
    }

    /// A CQ of this QP overran, so its completions are lost: it terminates
    /// the stream with a local catastrophic error (RFC 5040 7.1) and fails.
    pub fn cq_overrun(&mut self) {
        self.terminate(Layer::Rdmap, 0, 0, &[], None);
    }

    /// The connection is gone (closed, reset, or a CRC error): fail and flush.
    pub fn connection_lost(&mut self) {
        self.fail(None);
    }

    /// The application moves the QP to ERR (or destroys it): flush, with
    /// no fatal event.
    pub fn to_error(&mut self) {
        self.flush(None);
    }

    /// Whether all there is to send is one work request of at most
    /// `max_bytes` not yet started (and no READ to answer): what a poster
    /// can send on its own thread without waiting long in the socket.
    pub fn lone_send_within(&self, max_bytes: usize) -> bool {
        self.state == State::Rts
            && self.rtr_to_send.is_none()
            && self.rtr_awaited.is_none()
            && self.irq.is_empty()
            && self.sq.len() == 1
            && self
                .sq
                .front()
                .is_some_and(|e| e.sent == 0 && e.len <= max_bytes)
            && self.sq_ready()
    }

    /// Whether all there is to send is the answer to one READ with at most
    /// `max_bytes` left (no work request ready): what a receiving thread can
    /// send at once instead of waking a sender.
    pub fn lone_response_within(&self, max_bytes: usize) -> bool {
        self.state == State::Rts
            && self.rtr_to_send.is_none()
            && self.rtr_awaited.is_none()
            && self.irq.len() == 1
            && !self.sq_ready()
            && self.irq.front().is_some_and(|r| r.left() <= max_bytes)
    }

    /// Whether the QP has something to send.
    pub fn wants_transmit(&self) -> bool {
        match self.state {
            State::Error => self.terminate.is_some() && !self.terminate_sent,
            State::Rts => {
                self.rtr_to_send.is_some()
                    || (self.rtr_awaited.is_none() && (!self.irq.is_empty() || self.sq_ready()))
            }
        }
    }

    fn sq_ready(&self) -> bool {
        match self.sq.front() {
            None => false,
            Some(e) => match e.wr.op {
                // An RTR READ awaiting its answer counts (siw's sits in its ORQ).
                SendOp::Read { .. } => {
                    self.reads_out.len() + usize::from(self.rtr_response_due)
                        < usize::from(self.cfg.ord.max(1))
                }
                // A fenced WQE waits for the READs before it.
                _ => !e.wr.flags.fence || self.reads_out.is_empty(),
            },
        }
    }

    /// The next FPDU to send, if any (see [`Transmit`]). `buf` needs
    /// [`MAX_HEADER_LEN`] bytes, and room for the inline payload of an
    /// inline WR ([`crate::engine::MAX_INLINE_DATA`] covers any).
    pub fn poll_transmit(
        &mut self,
        mrs: &MrTable,
        buf: &mut [u8],
        pieces: &mut Vec<Segment>,
    ) -> Option<Transmit> {
        pieces.clear();
        if self.state == State::Error {
            if self.terminate_sent {
                return None;
            }
            let t = self.terminate?;
            self.terminate_sent = true;
            self.stats.terminates_sent += 1;
            return Some(self.emit_terminate(&t, buf));
        }
        if let Some(rtr) = self.rtr_to_send.take() {
            return Some(self.emit_rtr(rtr, buf));
        }
        if self.rtr_awaited.is_some() {
            return None; // RFC 6581: nothing before the peer's RTR
        }
        if let Some(t) = self.transmit_read_response(buf, pieces) {
            return Some(t);
        }
        if !self.sq_ready() {
            return None;
        }
        self.transmit_sq(mrs, buf, pieces)
    }

    fn emit_rtr(&mut self, rtr: Rtr, buf: &mut [u8]) -> Transmit {
        match rtr {
            Rtr::Write => {
                Self::tagged_header(buf, Opcode::Write, 0, 0, true);
                self.finish(buf, 2 + ddp::TAGGED_HEADER_LEN, 0)
            }
            Rtr::Read => {
                let msn = self.read_msn;
                self.read_msn = self.read_msn.wrapping_add(1);
                self.rtr_response_due = true;
                Self::untagged_header(buf, Opcode::ReadRequest, QN_READ_REQUEST, msn, 0, true, 0);
                let at = 2 + ddp::UNTAGGED_HEADER_LEN;
                ReadRequestRepr {
                    sink_stag: 0,
                    sink_offset: 0,
                    size: 0,
                    source_stag: 0,
                    source_offset: 0,
                }
                .emit(&mut ReadRequest::new_unchecked(
                    &mut buf[at..at + rdmap::READ_REQUEST_LEN],
                ));
                self.finish(buf, at + rdmap::READ_REQUEST_LEN, 0)
            }
        }
    }

    fn untagged_header(
        buf: &mut [u8],
        op: Opcode,
        qn: u32,
        msn: u32,
        mo: u32,
        last: bool,
        inv: u32,
    ) {
        let r = ddp::Repr {
            last,
            rsvd_ulp: op.control_byte(),
            placement: ddp::Placement::Untagged {
                rsvd_ulp_word: inv,
                queue: qn,
                msn,
                offset: mo,
            },
        };
        r.emit(&mut ddp::Segment::new_unchecked(
            &mut buf[2..2 + ddp::UNTAGGED_HEADER_LEN],
        ));
    }

    fn tagged_header(buf: &mut [u8], op: Opcode, stag: u32, to: u64, last: bool) {
        let r = ddp::Repr {
            last,
            rsvd_ulp: op.control_byte(),
            placement: ddp::Placement::Tagged { stag, offset: to },
        };
        r.emit(&mut ddp::Segment::new_unchecked(
            &mut buf[2..2 + ddp::TAGGED_HEADER_LEN],
        ));
    }

    fn finish(&mut self, buf: &mut [u8], header_len: usize, payload_len: usize) -> Transmit {
        let ulpdu_len = header_len - 2 + payload_len;
        buf[..2].copy_from_slice(&(ulpdu_len as u16).to_be_bytes());
        self.stats.fpdus_sent += 1;
        self.stats.largest_ulpdu_sent = self.stats.largest_ulpdu_sent.max(ulpdu_len);
        Transmit {
            header_len,
            payload_len,
            ulpdu_len,
        }
    }

    fn emit_terminate(&mut self, t: &TerminateRepr, buf: &mut [u8]) -> Transmit {
        let msn = 1;
        Self::untagged_header(buf, Opcode::Terminate, QN_TERMINATE, msn, 0, true, 0);
        let at = 2 + ddp::UNTAGGED_HEADER_LEN;
        let n = t.emit(&mut buf[at..]).unwrap_or(0);
        self.finish(buf, at + n, 0)
    }

    fn transmit_read_response(
        &mut self,
        buf: &mut [u8],
        pieces: &mut Vec<Segment>,
    ) -> Option<Transmit> {
        let room = self.cfg.max_ulpdu - ddp::TAGGED_HEADER_LEN;
        let r = self.irq.front_mut()?;
        let n = r.left().min(room);
        let last = n == r.left();
        let to = r.sink_to.wrapping_add(r.sent as u64);
        if let Some(src) = &r.src
            && n > 0
        {
            pieces.push(src.slice(r.sent, n).expect("inside the source"));
        }
        let stag = r.sink_stag;
        r.sent += n;
        if last {
            self.irq.pop_front();
        }
        Self::tagged_header(buf, Opcode::ReadResponse, stag, to, last);
        Some(self.finish(buf, 2 + ddp::TAGGED_HEADER_LEN, n))
    }

    fn transmit_sq(
        &mut self,
        mrs: &MrTable,
        buf: &mut [u8],
        pieces: &mut Vec<Segment>,
    ) -> Option<Transmit> {
        let pd = self.pd;
        while let Some(SendOp::LocalInv(rkey)) = self.sq.front().map(|e| e.wr.op) {
            let e = self.sq.pop_front().expect("front");
            if !mrs.invalidate(pd, rkey) {
                // Not an rkey of this PD: a local error ends the stream, as
                // any local error does (siw).
                self.complete(e.seq, WcStatus::LocProtErr);
                self.fail(None);
                return None;
            }
            self.complete(e.seq, WcStatus::Success);
            if !self.sq_ready() {
                return None;
            }
        }
        let e = self.sq.front_mut()?;
        if e.segs.is_none() && !e.wr.flags.inline {
            // Resolve the local buffers once, when the WQE starts.
            let need = match e.wr.op {
                SendOp::Read { .. } => Access::LOCAL_WRITE,
                _ => Access::NONE,
            };
            let mut segs = SegList::with_capacity(e.wr.sgl.len());
            // An empty SGE's key is not checked (siw, rxe).
            for s in e.wr.sgl.iter().filter(|s| s.len > 0) {
                match mrs.local(pd, s.lkey, s.addr, s.len, need) {
                    Ok(seg) => segs.push(seg),
                    Err(_) => {
                        // Key or bounds: an L_Key violation, LOC_PROT_ERR as
                        // rxe and NICs report it (LOC_LEN_ERR is for messages
                        // too long for their port or their receive).
                        let status = WcStatus::LocProtErr;
                        let seq = e.seq;
                        self.sq.pop_front();
                        self.complete(seq, status);
                        // A local error ends the stream, as in siw.
                        self.fail(None);
                        return None;
                    }
                }
            }
            e.segs = Some(segs);
            match e.wr.op {
                SendOp::Read { .. } => {
                    e.msn = self.read_msn;
                    self.read_msn = self.read_msn.wrapping_add(1);
                }
                SendOp::Send | SendOp::SendWithInv(_) => {
                    e.msn = self.send_msn;
                    self.send_msn = self.send_msn.wrapping_add(1);
                }
                _ => {}
            }
        } else if e.wr.flags.inline && e.segs.is_none() {
            e.segs = Some(SegList::new());
            if let SendOp::Send | SendOp::SendWithInv(_) = e.wr.op {
                e.msn = self.send_msn;
                self.send_msn = self.send_msn.wrapping_add(1);
            }
        }
        let e = self.sq.front_mut().expect("front");
        match e.wr.op {
            SendOp::Read { remote_addr, rkey } => {
                let e = self.sq.pop_front().expect("front");
                let segs = e.segs.unwrap_or_default();
                let (sink_stag, sink_to) = e.wr.sgl.first().map_or((0, 0), |s| (s.lkey, s.addr));
                Self::untagged_header(buf, Opcode::ReadRequest, QN_READ_REQUEST, e.msn, 0, true, 0);
                let at = 2 + ddp::UNTAGGED_HEADER_LEN;
                ReadRequestRepr {
                    sink_stag,
                    sink_offset: sink_to,
                    size: e.len as u32,
                    source_stag: rkey,
                    source_offset: remote_addr,
                }
                .emit(&mut ReadRequest::new_unchecked(
                    &mut buf[at..at + rdmap::READ_REQUEST_LEN],
                ));
                self.reads_out.push_back(OutRead {
                    seq: e.seq,
                    sink_stag,
                    sink_to,
                    segs,
                    len: e.len,
                    got: 0,
                });
                Some(self.finish(buf, at + rdmap::READ_REQUEST_LEN, 0))
            }
            SendOp::Write { remote_addr, rkey } => {
                let room = self.cfg.max_ulpdu - ddp::TAGGED_HEADER_LEN;
                let n = (e.len - e.sent).min(room);
                let last = e.sent + n == e.len;
                let at = 2 + ddp::TAGGED_HEADER_LEN;
                Self::take_payload(e, n, buf, at, pieces);
                Self::tagged_header(
                    buf,
                    Opcode::Write,
                    rkey,
                    remote_addr.wrapping_add(e.sent as u64),
                    last,
                );
                e.sent += n;
                let inline = if e.wr.flags.inline { n } else { 0 };
                self.after_segment(last);
                Some(self.finish(buf, at + inline, n - inline))
            }
            _ => {
                let room = self.cfg.max_ulpdu - ddp::UNTAGGED_HEADER_LEN;
                let n = (e.len - e.sent).min(room);
                let last = e.sent + n == e.len;
                let (op, inv) = match (e.wr.op, e.wr.flags.solicited) {
                    (SendOp::SendWithInv(stag), false) => (Opcode::SendInvalidate, stag),
                    (SendOp::SendWithInv(stag), true) => (Opcode::SendSeInvalidate, stag),
                    (_, false) => (Opcode::Send, 0),
                    (_, true) => (Opcode::SendSe, 0),
                };
                let at = 2 + ddp::UNTAGGED_HEADER_LEN;
                Self::take_payload(e, n, buf, at, pieces);
                Self::untagged_header(buf, op, QN_SEND, e.msn, e.sent as u32, last, inv);
                e.sent += n;
                let inline = if e.wr.flags.inline { n } else { 0 };
                self.after_segment(last);
                Some(self.finish(buf, at + inline, n - inline))
            }
        }
    }

    /// The payload of the next segment: region pieces, or inline bytes copied
    /// after the header.
    fn take_payload(e: &SqEntry, n: usize, buf: &mut [u8], at: usize, pieces: &mut Vec<Segment>) {
        if e.wr.flags.inline {
            buf[at..at + n].copy_from_slice(&e.wr.inline_data[e.sent..e.sent + n]);
        } else if let Some(segs) = &e.segs {
            push_pieces(segs, e.sent, n, pieces);
        }
    }

    fn after_segment(&mut self, last: bool) {
        if last {
            let e = self.sq.pop_front().expect("front");
            // Complete once the provider has the bytes in the socket.
            self.unconfirmed.push(e.seq);
        }
    }

    /// Everything [`IwarpQp::poll_transmit`] gave is in the socket: the SENDs
    /// and WRITEs it finished complete (until then their buffers may still be
    /// read).
    pub fn transmitted(&mut self) {
        self.confirm(WcStatus::Success);
    }

    /// Writing what [`IwarpQp::poll_transmit`] gave failed: the SENDs and
    /// WRITEs it finished are flushed (the connection is lost with them).
    pub fn transmit_failed(&mut self) {
        self.confirm(WcStatus::WrFlushErr);
    }

    fn confirm(&mut self, status: WcStatus) {
        let mut done = std::mem::take(&mut self.unconfirmed);
        for seq in done.drain(..) {
            self.complete(seq, status);
        }
        // The list keeps its room: no allocation per batch.
        if self.unconfirmed.is_empty() {
            self.unconfirmed = done;
        }
    }

    /// The DDP header (14 bytes tagged, 18 untagged, from the start of the
    /// ULPDU) of the next inbound segment, whose payload (everything after
    /// the DDP header) is `payload_len` bytes: where it goes.
    pub fn accept_header(
        &mut self,
        hdr: &[u8],
        payload_len: usize,
        mrs: &MrTable,
        pieces: &mut Vec<Segment>,
    ) -> Placement {
        pieces.clear();
        self.stats.fpdus_received += 1;
        self.rx = Some(RxSeg::Failed);
        self.rx_payload_len = payload_len;
        if self.state != State::Rts {
            return Placement::Discard;
        }
        let Ok(seg) = ddp::Segment::new_checked(hdr) else {
            self.terminate(Layer::Llp, 0, 0x02, &[], None);
            return Placement::Discard;
        };
        let Ok(d) = ddp::Repr::parse(&seg) else {
            // Bad DDP version (the only parse failure of a whole header).
            let etype = if seg.tagged() { 1 } else { 2 };
            self.terminate(
                Layer::Ddp,
                etype,
                if seg.tagged() { 0x04 } else { 0x06 },
                hdr,
                None,
            );
            return Placement::Discard;
        };
        if d.rsvd_ulp >> 6 != rdmap::VERSION {
            self.terminate(Layer::Rdmap, 2, 0x05, hdr, None);
            return Placement::Discard;
        }
        let op = match Opcode::from_code(d.rsvd_ulp & 0x0f) {
            Ok(op) if op.tagged() == d.tagged() => op,
            _ => {
                self.terminate(Layer::Rdmap, 2, 0x06, hdr, None);
                return Placement::Discard;
            }
        };
        // A Terminate in the RTR's place (RFC 6581: no matching RTR, too
        // few IRD) is the peer's reason, taken as any Terminate.
        let rtr = self.rtr_awaited.is_some() && op != Opcode::Terminate;
        if let Some(want) = self.rtr_awaited.filter(|_| op != Opcode::Terminate) {
            let rtr = match want {
                Rtr::Write => op == Opcode::Write && payload_len == 0 && d.last,
                Rtr::Read => op == Opcode::ReadRequest,
            };
            if !rtr {
                // Not the RTR message agreed on.
                self.terminate(Layer::Llp, 0, 0x07, hdr, None);
                return Placement::Discard;
            }
            self.rtr_awaited = None;
        }
        // The QP's own access first, as RC's responder: the RTR WRITE is
        // part of the connection's start, not an operation.
        if op == Opcode::Write && !rtr && !self.access.contains(Access::REMOTE_WRITE) {
            self.terminate(Layer::Rdmap, 1, ACCESS_VIOLATION, hdr, None);
            return Placement::Discard;
        }
        match (op, d.placement) {
            // A zero-length WRITE places nothing: its STag is not checked
            // (RFC 6581's RTR is one).
            (Opcode::Write, ddp::Placement::Tagged { .. }) if payload_len == 0 => {
                self.rx = Some(RxSeg::Write);
                Placement::Data
            }
            (Opcode::ReadResponse, ddp::Placement::Tagged { .. }) if self.rtr_response_due => {
                self.rtr_response_due = false;
                if payload_len != 0 || !d.last {
                    self.terminate(Layer::Ddp, 1, 0x01, hdr, None);
                    return Placement::Discard;
                }
                self.rx = Some(RxSeg::Write);
                Placement::Data
            }
            (Opcode::Write, ddp::Placement::Tagged { stag, offset }) => {
                match mrs.remote(
                    self.pd,
                    stag,
                    offset,
                    payload_len as u64,
                    Access::REMOTE_WRITE,
                ) {
                    Ok(s) => {
                        self.rx = Some(RxSeg::Write);
                        pieces.push(s);
                        Placement::Data
                    }
                    Err(e) => {
                        let (layer, etype, code) = tagged_error(&e);
                        self.terminate(layer, etype, code, hdr, None);
                        Placement::Discard
                    }
                }
            }
            (Opcode::ReadResponse, ddp::Placement::Tagged { stag, offset }) => {
                let Some(r) = self.reads_out.front() else {
                    self.terminate(Layer::Rdmap, 2, 0x06, hdr, None);
                    return Placement::Discard;
                };
                let off = offset.wrapping_sub(r.sink_to) as usize;
                if stag != r.sink_stag || off != r.got || off + payload_len > r.len {
                    self.terminate(Layer::Ddp, 1, 0x01, hdr, None);
                    return Placement::Discard;
                }
                push_pieces(&r.segs, off, payload_len, pieces);
                self.rx = Some(RxSeg::ReadResponse {
                    last: d.last,
                    len: payload_len,
                });
                Placement::Data
            }
            (
                Opcode::Send | Opcode::SendSe | Opcode::SendInvalidate | Opcode::SendSeInvalidate,
                ddp::Placement::Untagged {
                    rsvd_ulp_word,
                    queue,
                    msn,
                    offset: message_offset,
                },
            ) => {
                if queue != QN_SEND {
                    self.terminate(Layer::Ddp, 2, 0x01, hdr, None);
                    return Placement::Discard;
                }
                if msn != self.recv_send_msn {
                    self.terminate(Layer::Ddp, 2, 0x03, hdr, None);
                    return Placement::Discard;
                }
                if self.rq.is_empty()
                    && message_offset == 0
                    && let Some(srq) = &self.srq
                {
                    let mut srq = srq.lock().expect("SRQ lock");
                    let pd = srq.pd();
                    if let Some(wr) = srq.take() {
                        self.rq.push_back(RqEntry::new(wr, pd));
                    }
                }
                let Some(r) = self.rq.front_mut() else {
                    // No receive posted: iWARP has no RNR; the stream ends.
                    self.terminate(Layer::Ddp, 2, 0x02, hdr, None);
                    return Placement::Discard;
                };
                if r.segs.is_none() {
                    let mut segs = SegList::with_capacity(r.wr.sgl.len());
                    // An empty SGE's key is not checked (siw, rxe).
                    for s in r.wr.sgl.iter().filter(|s| s.len > 0) {
                        match mrs.local(r.pd, s.lkey, s.addr, s.len, Access::LOCAL_WRITE) {
                            Ok(seg) => segs.push(seg),
                            Err(_) => {
                                let r = self.rq.pop_front().expect("front");
                                let wc = WorkCompletion::new(
                                    r.wr.wr_id,
                                    WcStatus::LocProtErr,
                                    WcOpcode::Recv,
                                    self.qpn,
                                );
                                self.completions.push_back((CqKind::Recv, wc));
                                self.terminate(Layer::Rdmap, 2, 0x07, hdr, None);
                                return Placement::Discard;
                            }
                        }
                    }
                    r.segs = Some(segs);
                }
                // As siw: segments come in order, so each starts where the
                // last ended; a gap would complete the receive over bytes
                // that never came.
                if message_offset as usize != r.placed {
                    self.terminate(Layer::Ddp, 2, 0x04, hdr, None);
                    return Placement::Discard;
                }
                let end = message_offset as usize + payload_len;
                // No message is longer than 2 GiB, whatever the receive holds.
                if end > r.len.min(MAX_MESSAGE_LEN as usize) {
                    let r = self.rq.pop_front().expect("front");
                    let wc = WorkCompletion::new(
                        r.wr.wr_id,
                        WcStatus::LocLenErr,
                        WcOpcode::Recv,
                        self.qpn,
                    );
                    self.completions.push_back((CqKind::Recv, wc));
                    self.terminate(Layer::Ddp, 2, 0x05, hdr, None);
                    return Placement::Discard;
                }
                r.placed = end;
                push_pieces(
                    r.segs.as_deref().unwrap_or(&[]),
                    message_offset as usize,
                    payload_len,
                    pieces,
                );
                let invalidate = matches!(op, Opcode::SendInvalidate | Opcode::SendSeInvalidate)
                    .then_some(rsvd_ulp_word);
                self.rx = Some(RxSeg::Send {
                    last: d.last,
                    end,
                    solicited: matches!(op, Opcode::SendSe | Opcode::SendSeInvalidate),
                    invalidate,
                });
                Placement::Data
            }
            (Opcode::ReadRequest, ddp::Placement::Untagged { queue, msn, .. }) => {
                if queue != QN_READ_REQUEST || msn != self.recv_read_msn {
                    self.terminate(
                        Layer::Ddp,
                        2,
                        if queue != QN_READ_REQUEST { 0x01 } else { 0x03 },
                        hdr,
                        None,
                    );
                    return Placement::Discard;
                }
                if payload_len != rdmap::READ_REQUEST_LEN {
                    self.terminate(Layer::Rdmap, 2, 0x06, hdr, None);
                    return Placement::Discard;
                }
                self.rx = Some(RxSeg::ReadRequest { rtr });
                Placement::Control
            }
            (Opcode::Terminate, _) => {
                self.rx = Some(RxSeg::Terminate);
                Placement::Control
            }
            _ => {
                self.terminate(Layer::Rdmap, 2, 0x06, hdr, None);
                Placement::Discard
            }
        }
    }

    /// The current segment's payload is in place (or, for
    /// [`Placement::Control`], in `control`); `crc_ok` says whether the MPA
    /// CRC held (true when CRC is off).
    pub fn segment_done(&mut self, control: &[u8], crc_ok: bool, mrs: &MrTable) {
        let seg = self.rx.take().unwrap_or(RxSeg::Failed);
        if !crc_ok {
            // RFC 5044: a CRC error ends the connection.
            self.terminate(Layer::Llp, 0, 0x02, &[], None);
            return;
        }
        if self.state != State::Rts {
            return;
        }
        match seg {
            RxSeg::Failed | RxSeg::Write => {}
            RxSeg::ReadResponse { last, len } => {
                let r = self.reads_out.front_mut().expect("checked at the header");
                r.got += len;
                if last {
                    let r = self.reads_out.pop_front().expect("front");
                    if r.got == r.len {
                        self.complete(r.seq, WcStatus::Success);
                    } else {
                        self.terminate(Layer::Ddp, 1, 0x01, &[], Some(WcStatus::BadRespErr));
                    }
                }
            }
            RxSeg::Send {
                last,
                end,
                solicited,
                invalidate,
            } => {
                if last {
                    let r = self.rq.pop_front().expect("checked at the header");
                    self.recv_send_msn = self.recv_send_msn.wrapping_add(1);
                    let mut wc = WorkCompletion::new(
                        r.wr.wr_id,
                        WcStatus::Success,
                        WcOpcode::Recv,
                        self.qpn,
                    );
                    wc.byte_len = end as u32;
                    wc.solicited = solicited;
                    if let Some(stag) = invalidate {
                        if !mrs.invalidate(self.pd, stag) {
                            // As siw: another PD's STag is a protection
                            // error, an unknown one an operation error.
                            let etype = if mrs.key_in_use(stag) { 1 } else { 2 };
                            wc.status = WcStatus::RemInvReqErr;
                            self.completions.push_back((CqKind::Recv, wc));
                            self.terminate(Layer::Rdmap, etype, 0x09, &[], None);
                            return;
                        }
                        wc.invalidated_rkey = Some(stag);
                    }
                    self.completions.push_back((CqKind::Recv, wc));
                }
            }
            RxSeg::ReadRequest { rtr } => {
                self.recv_read_msn = self.recv_read_msn.wrapping_add(1);
                let req = ReadRequest::new_checked(control)
                    .ok()
                    .and_then(|v| ReadRequestRepr::parse(&v).ok());
                let Some(req) = req else {
                    self.terminate(Layer::Rdmap, 2, 0x06, &[], None);
                    return;
                };
                // RFC 6581's RTR READ reads nothing: one that would is an
                // operation like any other.
                let is_rtr = rtr && req.size == 0;
                if !is_rtr && !self.access.contains(Access::REMOTE_READ) {
                    self.terminate_read(&req, Layer::Rdmap, 1, ACCESS_VIOLATION);
                    return;
                }
                if self.irq.len() >= usize::from(self.cfg.ird.max(1)) {
                    // More READs than this side's IRD.
                    self.terminate(Layer::Rdmap, 2, 0x07, &[], None);
                    return;
                }
                if req.size == 0 {
                    // Nothing to read: the STag is not checked.
                    self.irq.push_back(InRead {
                        sink_stag: req.sink_stag,
                        sink_to: req.sink_offset,
                        src: None,
                        sent: 0,
                    });
                    return;
                }
                match mrs.remote(
                    self.pd,
                    req.source_stag,
                    req.source_offset,
                    u64::from(req.size),
                    Access::REMOTE_READ,
                ) {
                    Ok(src) => self.irq.push_back(InRead {
                        sink_stag: req.sink_stag,
                        sink_to: req.sink_offset,
                        src: Some(src),
                        sent: 0,
                    }),
                    Err(e) => {
                        let (layer, etype, code) = tagged_error(&e);
                        self.terminate_read(&req, layer, etype, code);
                    }
                }
            }
            RxSeg::Terminate => {
                self.stats.terminates_received += 1;
                let t = TerminateRepr::parse(control).ok();
                let status = t
                    .as_ref()
                    .map_or(WcStatus::RemOpErr, |t| terminate_status(&t.control));
                self.peer_terminate = t;
                // The WQE the peer failed on is the oldest not yet done.
                self.fail(Some(status));
            }
        }
    }
}

/// RDMAP's "access rights violation" (a remote protection error, etype 1):
/// the region's rights or the QP's.
const ACCESS_VIOLATION: u8 = 0x02;

/// The Terminate a failed remote access earns: an unknown STag is DDP's
/// "invalid STag", the rest RDMAP remote protection errors.
fn tagged_error(e: &AccessError) -> (Layer, u8, u8) {
    match e {
        AccessError::UnknownKey(_) | AccessError::WrongKeyKind(_) => (Layer::Ddp, 1, 0x00),
        AccessError::OutOfBounds { .. } => (Layer::Rdmap, 1, 0x01),
        AccessError::NotPermitted { .. } => (Layer::Rdmap, 1, ACCESS_VIOLATION),
        AccessError::WrongPd { .. } => (Layer::Rdmap, 1, 0x03),
        AccessError::Unaligned(_) => (Layer::Rdmap, 1, 0x01),
    }
}

/// The completion status of the WQE a peer's Terminate failed.
fn terminate_status(c: &TermControl) -> WcStatus {
    match (c.layer, c.etype) {
        (Layer::Rdmap, 1) | (Layer::Ddp, 1) => WcStatus::RemAccessErr,
        (Layer::Rdmap, 2) if matches!(c.code, 0x05 | 0x06) => WcStatus::RemInvReqErr,
        _ => WcStatus::RemOpErr,
    }
}
