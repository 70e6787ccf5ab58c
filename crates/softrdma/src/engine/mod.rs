//! Sans-I/O transport state machines, after quinn-proto: a queue pair's
//! transport is a plain struct told everything (posted work requests, received
//! packets, the time) and asked for everything (packets to send, completions,
//! the next timer). No sockets, threads or clocks here; the providers and the
//! simulator drive the same code.

#![forbid(unsafe_code)]

pub mod gsi;
pub mod iwarp;
pub mod qp;
pub mod rc;
pub mod sim;
pub mod srq;
pub mod ud;

use std::fmt;

use crate::memory::{PieceSink, Segment};
use std::time::Duration;

pub use qp::{QpAttr, QpState, TransitionError};

/// The most inline bytes a work request carries (a QP's largest
/// `max_inline_data`): providers size their framing buffers by it.
pub const MAX_INLINE_DATA: u32 = 4096;

/// The engine's clock: nanoseconds since an arbitrary origin, given by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(pub u64);

impl Time {
    /// `self + d`, saturating.
    #[must_use]
    pub fn after(self, d: Duration) -> Time {
        Time(
            self.0
                .saturating_add(d.as_nanos().min(u128::from(u64::MAX)) as u64),
        )
    }
    /// Time since `earlier` (zero if it is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// A scatter/gather element: `len` bytes at `addr` of the region with `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address (the region's iova space).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

/// A work request's SGEs: one or two stay inline (no allocation per post).
pub type SgList = smallvec::SmallVec<[Sge; 2]>;

/// An inline send's bytes: up to 16 stay in the work request, in the room a
/// `Vec` takes (no allocation to post an 8-byte message inline).
pub type InlineData = smallvec::SmallVec<[u8; 16]>;

/// A work request's buffers resolved to region memory: held inline for up
/// to two (no allocation per message).
pub type SegList = smallvec::SmallVec<[crate::memory::Segment; 2]>;

/// Send work request operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendWithImm(u32),
    /// RDMA WRITE.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// RDMA WRITE with immediate data.
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// RDMA READ into the local SGEs.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Atomic compare and swap of 8 bytes; the old value lands in the local SGE.
    CompareSwap {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Atomic fetch and add of 8 bytes; the old value lands in the local SGE.
    FetchAdd {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Addend.
        add: u64,
    },
    /// SEND with invalidate (RC on iWARP and RoCEv2): the message also
    /// invalidates the peer's STag (rkey) `0` when it arrives.
    SendWithInv(u32),
    /// Local invalidate (RC on iWARP and RoCEv2): this side's rkey `0`
    /// stops working for remote access, in send queue order (on RoCEv2
    /// once everything posted before it has completed). No message goes
    /// out.
    LocalInv(u32),
}

impl SendOp {
    /// The work completion opcode this operation reports.
    pub fn wc_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInv(_) => WcOpcode::Send,
            SendOp::LocalInv(_) => WcOpcode::LocalInv,
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        }
    }
    /// READ or atomic: needs a responder resource and counts against max_rd_atomic.
    pub fn is_read_or_atomic(&self) -> bool {
        matches!(
            self,
            SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }
    /// An atomic.
    pub fn is_atomic(&self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }
}

/// Flags of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags {
    /// Report a work completion on success (errors always complete).
    pub signaled: bool,
    /// Wait for every earlier READ and atomic to complete first.
    pub fence: bool,
    /// Ask the receiver for a solicited event.
    pub solicited: bool,
    /// The payload was copied into the work request at post time.
    pub inline: bool,
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffers: the payload of SEND/WRITE, the sink of READ/atomics.
    pub sgl: SgList,
    /// Flags.
    pub flags: SendFlags,
    /// Payload copied at post time when `flags.inline` (SEND/WRITE only).
    pub inline_data: InlineData,
    /// Where a UD SEND goes (UD QPs only).
    pub ud: Option<UdDest>,
}

impl SendWr {
    /// A signaled work request with these buffers; the rest off.
    pub fn new(wr_id: u64, op: SendOp, sgl: impl IntoIterator<Item = Sge>) -> SendWr {
        // Pushed one by one: `collect`'s generic extend costs a few ns more
        // per post, which shared memory's posts notice.
        let mut list = SgList::new();
        for s in sgl {
            list.push(s);
        }
        SendWr {
            wr_id,
            op,
            sgl: list,
            flags: SendFlags {
                signaled: true,
                ..SendFlags::default()
            },
            inline_data: InlineData::new(),
            ud: None,
        }
    }

    /// Not signaled: no completion on success.
    #[must_use]
    pub fn unsignaled(mut self) -> SendWr {
        self.flags.signaled = false;
        self
    }

    /// With the solicited-event flag.
    #[must_use]
    pub fn solicited(mut self) -> SendWr {
        self.flags.solicited = true;
        self
    }

    /// Fenced behind earlier READs and atomics.
    #[must_use]
    pub fn fenced(mut self) -> SendWr {
        self.flags.fence = true;
        self
    }

    /// With this payload inline (copied now) instead of the SGEs.
    #[must_use]
    pub fn inline(mut self, data: &[u8]) -> SendWr {
        self.flags.inline = true;
        self.inline_data = InlineData::from_slice(data);
        self.sgl.clear();
        self
    }

    /// A UD send to this destination.
    #[must_use]
    pub fn to(mut self, dest: UdDest) -> SendWr {
        self.ud = Some(dest);
        self
    }
}

/// An address handle's number, as the provider hands them out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AhId(pub u64);

/// The destination of a UD send: an address handle, the remote QP and its Q_Key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    /// Address handle.
    pub ah: AhId,
    /// Remote QP number.
    pub remote_qpn: u32,
    /// Remote Q_Key; with the high bit set the QP's own Q_Key is used instead
    /// (the IBTA's privileged Q_Key rule, 10.2.5).
    pub remote_qkey: u32,
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's payload goes.
    pub sgl: SgList,
}

impl RecvWr {
    /// A receive WR with these buffers.
    pub fn new(wr_id: u64, sgl: impl IntoIterator<Item = Sge>) -> RecvWr {
        RecvWr {
            wr_id,
            sgl: sgl.into_iter().collect(),
        }
    }
}

/// Work completion status (libibverbs' `ibv_wc_status` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    /// Success.
    Success = 0,
    /// A receive buffer too small for the message, or a bad length.
    LocLenErr = 1,
    /// Internal inconsistency of the local QP.
    LocQpOpErr = 2,
    /// A local buffer's key, bounds or rights were wrong.
    LocProtErr = 4,
    /// Flushed: the QP was in the error state.
    WrFlushErr = 5,
    /// A memory window bind failed (devices through libibverbs).
    MwBindErr = 6,
    /// The responder's answer was malformed.
    BadRespErr = 7,
    /// A protection error on a local buffer the responder's answer was to
    /// fill (devices through libibverbs).
    LocAccessErr = 8,
    /// The responder found the request invalid (or its QP forbids it).
    RemInvReqErr = 9,
    /// The responder refused the remote key, bounds or rights.
    RemAccessErr = 10,
    /// The responder could not complete the operation.
    RemOpErr = 11,
    /// No answer after retry_cnt retransmissions.
    RetryExcErr = 12,
    /// Receiver not ready after rnr_retry retries.
    RnrRetryExcErr = 13,
    /// The responder could not serve the READ request (devices through
    /// libibverbs).
    RemInvRdReqErr = 15,
    /// The responder aborted the operation (devices through libibverbs).
    RemAbortErr = 16,
    /// The device failed (devices through libibverbs).
    FatalErr = 19,
    /// The responder did not answer in time (devices through libibverbs).
    RespTimeoutErr = 20,
    /// General error.
    GeneralErr = 21,
}

impl WcStatus {
    /// The status with libibverbs' number `code` (GeneralErr for one that
    /// is not a status here).
    pub fn from_code(code: u32) -> WcStatus {
        use WcStatus::*;
        [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            RemInvRdReqErr,
            RemAbortErr,
            FatalErr,
            RespTimeoutErr,
        ]
        .into_iter()
        .find(|s| *s as u32 == code)
        .unwrap_or(GeneralErr)
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "work request flushed",
            WcStatus::MwBindErr => "memory window bind error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvRdReqErr => "remote invalid RD request",
            WcStatus::RemAbortErr => "remote abort error",
            WcStatus::FatalErr => "fatal error",
            WcStatus::RespTimeoutErr => "response timeout error",
            WcStatus::BadRespErr => "bad response",
            WcStatus::RemInvReqErr => "remote invalid request",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operational error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::GeneralErr => "general error",
        })
    }
}

/// Work completion opcodes (libibverbs' `ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// SEND (with or without immediate).
    Send,
    /// RDMA WRITE.
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// Compare and swap.
    CompareSwap,
    /// Fetch and add.
    FetchAdd,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
    /// A local invalidate.
    LocalInv,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's identifier.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed (meaningful on success).
    pub opcode: WcOpcode,
    /// Bytes received (receives) or read.
    pub byte_len: u32,
    /// Immediate data, if the message carried some.
    pub imm: Option<u32>,
    /// The local QP.
    pub qp_num: u32,
    /// The sending QP (UD receives; the peer for RC).
    pub src_qp: u32,
    /// The receive buffer starts with a GRH (UD).
    pub grh: bool,
    /// The sender asked for a solicited event.
    pub solicited: bool,
    /// The STag the message invalidated here (SEND with invalidate).
    pub invalidated_rkey: Option<u32>,
}

/// Asynchronous events a QP raises (`ibv_get_async_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpEvent {
    /// The QP went to ERR because of an error (IBV_EVENT_QP_FATAL and friends).
    Fatal,
    /// A QP on an SRQ went to ERR: no more receives will be taken for it
    /// (IBV_EVENT_QP_LAST_WQE_REACHED).
    LastWqeReached,
    /// A QP moved to SQD has no sends outstanding: every one started before
    /// is acknowledged, or for UD on the wire (IBV_EVENT_SQ_DRAINED).
    SqDrained,
    /// An RC QP in RTR received its first request (IBV_EVENT_COMM_EST).
    CommEstablished,
}

impl WorkCompletion {
    /// A completion of `wr_id` on QP `qp_num`; the other fields empty.
    pub fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm: None,
            qp_num,
            src_qp: 0,
            grh: false,
            solicited: false,
            invalidated_rkey: None,
        }
    }
}

/// Which completion queue a completion goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqKind {
    /// The send CQ.
    Send,
    /// The receive CQ.
    Recv,
}

/// A packet the engine wants sent: `len` bytes of headers (and inline payload)
/// in the caller's buffer, then the payload pieces it pushed, then pad and ICRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    /// Bytes of the caller's buffer used.
    pub len: usize,
    /// Bytes in the payload pieces.
    pub payload_len: usize,
    /// Pad bytes to add after the payload (the BTH says so too).
    pub pad: u8,
}

/// Errors a post reports on the call, as libibverbs does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The QP's state does not allow this post.
    #[error("queue pair is in state {0}, which does not accept this work request")]
    BadState(QpState),
    /// The queue is full.
    #[error("the queue is full ({0} work requests outstanding)")]
    QueueFull(u32),
    /// More SGEs than the QP was created for.
    #[error("{given} scatter/gather elements given, the queue pair allows {max}")]
    TooManySges {
        /// Given.
        given: usize,
        /// Allowed.
        max: u32,
    },
    /// Inline data larger than the QP's max_inline_data.
    #[error("{given} bytes of inline data, the queue pair allows {max}")]
    InlineTooLarge {
        /// Given.
        given: usize,
        /// Allowed.
        max: u32,
    },
    /// An operation this QP type or transport cannot do.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A message longer than the transport allows.
    #[error("message of {0} bytes is longer than the 2 GiB limit")]
    TooLong(u64),
    /// A UD message longer than the path MTU.
    #[error("a UD message of {len} bytes does not fit the {mtu}-byte MTU")]
    LongerThanMtu {
        /// Message length.
        len: usize,
        /// Path MTU.
        mtu: usize,
    },
    /// An atomic whose local buffer is not 8 bytes.
    #[error("atomic operations need exactly one 8-byte local buffer")]
    BadAtomicSge,
    /// A UD send through an address handle that is not of the QP's
    /// protection domain (destroyed, or another domain's).
    #[error(
        "address handle {0} is not one of this QP's protection domain (destroyed, or another's)"
    )]
    BadAh(u64),
    /// An atomic whose remote address is not 8-byte aligned.
    #[error("atomic operations need an 8-byte-aligned remote address, not {0:#x}")]
    MisalignedAtomic(u64),
    /// A hardware device refused the post (its errno).
    #[error("the device refused the work request: {}", std::io::Error::from_raw_os_error(*.0))]
    Device(i32),
}

/// The checks of `ibv_post_send` that every QP shares (RoCEv2 RC and UD,
/// iWARP, shared memory), as rxe's `validate_send_wr` makes them: SGEs
/// within the QP's capacity; inline data only on SEND and WRITE, within
/// its limit and with no SGEs beside it; an atomic's one 8-byte buffer and
/// 8-byte-aligned remote address; a message of at most
/// [`rc::MAX_MESSAGE_LEN`]. Returns the message's length.
pub(crate) fn check_post_send(wr: &SendWr, caps: &rc::QpCaps) -> Result<u64, PostError> {
    if wr.sgl.len() > caps.max_send_sge as usize {
        return Err(PostError::TooManySges {
            given: wr.sgl.len(),
            max: caps.max_send_sge,
        });
    }
    if wr.flags.inline {
        if wr.op.is_read_or_atomic() {
            return Err(PostError::Unsupported(
                "inline data is for SEND and RDMA WRITE only",
            ));
        }
        if !wr.sgl.is_empty() {
            // libibverbs copies the SGEs' bytes for IBV_SEND_INLINE; here
            // they go in `inline_data`, and SGEs beside them would be lost.
            return Err(PostError::Unsupported(
                "an inline work request carries its bytes in inline_data \
                 (SendWr::inline), not in SGEs",
            ));
        }
        let max = caps.max_inline_data.min(MAX_INLINE_DATA);
        if wr.inline_data.len() > max as usize {
            return Err(PostError::InlineTooLarge {
                given: wr.inline_data.len(),
                max,
            });
        }
        return Ok(wr.inline_data.len() as u64);
    }
    if let SendOp::CompareSwap { remote_addr, .. } | SendOp::FetchAdd { remote_addr, .. } = wr.op {
        if wr.sgl.len() != 1 || wr.sgl[0].len != 8 {
            return Err(PostError::BadAtomicSge);
        }
        if !remote_addr.is_multiple_of(8) {
            return Err(PostError::MisalignedAtomic(remote_addr));
        }
    }
    let len = wr.sgl.iter().map(|s| u64::from(s.len)).sum();
    if len > rc::MAX_MESSAGE_LEN {
        return Err(PostError::TooLong(len));
    }
    Ok(len)
}

impl PostError {
    /// A receive posted to a QP that takes its receives from an SRQ.
    pub const ON_SRQ: PostError = PostError::Unsupported(
        "this QP takes its receives from a shared receive queue: post them there",
    );
}

/// The checks of `ibv_post_recv` that RC, UD and iWARP QPs share: not on an
/// SRQ, not in RESET, SGEs and queue depth within the QP's capacities.
pub(crate) fn check_post_recv(
    wr: &RecvWr,
    on_srq: bool,
    state: QpState,
    queued: usize,
    caps: &rc::QpCaps,
) -> Result<(), PostError> {
    if on_srq {
        return Err(PostError::ON_SRQ);
    }
    if state == QpState::Reset {
        return Err(PostError::BadState(state));
    }
    if wr.sgl.len() > caps.max_recv_sge as usize {
        return Err(PostError::TooManySges {
            given: wr.sgl.len(),
            max: caps.max_recv_sge,
        });
    }
    if queued >= caps.max_recv_wr as usize {
        return Err(PostError::QueueFull(caps.max_recv_wr));
    }
    Ok(())
}

/// The stretches of `segs` covering `off..off + len`: each segment with the
/// offset and length of its part.
fn stretches(
    segs: &[Segment],
    mut off: usize,
    mut len: usize,
) -> impl Iterator<Item = (&Segment, usize, usize)> {
    segs.iter()
        .map_while(move |s| {
            if len == 0 {
                return None;
            }
            let at = off.min(s.len());
            off -= at;
            let n = (s.len() - at).min(len);
            len -= n;
            Some((s, at, n))
        })
        .filter(|&(_, _, n)| n > 0)
}

/// Pushes the pieces of `segs` covering `off..off + len` onto `pieces`.
pub(crate) fn push_pieces(segs: &[Segment], off: usize, len: usize, pieces: &mut dyn PieceSink) {
    for (s, at, n) in stretches(segs, off, len) {
        pieces.push_range(s, at, n);
    }
}

/// Copies `out.len()` bytes of `segs`, starting `off` bytes into them, into
/// `out`.
pub(crate) fn gather(segs: &[Segment], off: usize, out: &mut [u8]) {
    let mut done = 0;
    for (s, at, n) in stretches(segs, off, out.len()) {
        s.read(at, &mut out[done..done + n]);
        done += n;
    }
}

/// Copies `data` into `segs` starting `off` bytes into them (the one copy of
/// a receive: datagram buffer to region).
pub(crate) fn scatter(segs: &[Segment], off: usize, data: &[u8]) {
    let mut done = 0;
    for (s, at, n) in stretches(segs, off, data.len()) {
        s.write(at, &data[done..done + n]);
        done += n;
    }
}

/// A queue pair's transport, whichever type it is: what a provider drives.
// One per QP, kept in place behind a lock: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum QpEngine {
    /// Reliable connected.
    Rc(rc::RcQp),
    /// Unreliable datagram.
    Ud(ud::UdQp),
}

impl QpEngine {
    /// The QP's protection domain.
    pub fn pd(&self) -> crate::memory::PdId {
        match self {
            QpEngine::Rc(q) => q.pd(),
            QpEngine::Ud(q) => q.pd(),
        }
    }

    /// RC packets sent and not yet acknowledged (0 on UD).
    pub fn packets_in_flight(&self) -> u32 {
        match self {
            QpEngine::Rc(q) => {
                let (oldest, next) = q.requester_window();
                next.distance(oldest).max(0) as u32
            }
            QpEngine::Ud(_) => 0,
        }
    }

    /// Signs that either end of an RC QP sent something again (its
    /// timeouts, duplicate requests it received); 0 on UD.
    pub fn resend_signs(&self) -> u64 {
        match self {
            QpEngine::Rc(q) => q.resend_signs(),
            QpEngine::Ud(_) => 0,
        }
    }

    /// Response packets the RC responder has queued (ACKs, READ responses,
    /// atomic ACKs); 0 on UD.
    pub fn responses_queued(&self) -> u32 {
        match self {
            QpEngine::Rc(q) => q.responses_queued(),
            QpEngine::Ud(_) => 0,
        }
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        match self {
            QpEngine::Rc(q) => q.qpn(),
            QpEngine::Ud(q) => q.qpn(),
        }
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        match self {
            QpEngine::Rc(q) => q.state(),
            QpEngine::Ud(q) => q.state(),
        }
    }
    /// Modifies the QP.
    pub fn modify(&mut self, attr: &QpAttr) -> Result<(), TransitionError> {
        match self {
            QpEngine::Rc(q) => q.modify(attr),
            QpEngine::Ud(q) => q.modify(attr),
        }
    }
    /// The QP's attributes.
    pub fn query(&self) -> QpAttr {
        match self {
            QpEngine::Rc(q) => q.query(),
            QpEngine::Ud(q) => q.query(),
        }
    }
    /// Posts a send.
    pub fn post_send(&mut self, wr: SendWr) -> Result<(), PostError> {
        match self {
            QpEngine::Rc(q) => q.post_send(wr),
            QpEngine::Ud(q) => q.post_send(wr),
        }
    }
    /// Posts a receive.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        match self {
            QpEngine::Rc(q) => q.post_recv(wr),
            QpEngine::Ud(q) => q.post_recv(wr),
        }
    }
    /// A received packet; `meta` describes its IP header (UD writes it into the GRH area).
    pub fn handle_packet(
        &mut self,
        now: Time,
        packet: &[u8],
        meta: &ud::RecvMeta,
        mrs: &crate::memory::MrTable,
    ) {
        match self {
            QpEngine::Rc(q) => q.handle_packet(now, packet, mrs),
            QpEngine::Ud(q) => q.handle_packet(packet, meta, mrs),
        }
    }
    /// The next packet, and for UD the address handle it goes to.
    pub fn poll_transmit(
        &mut self,
        now: Time,
        mrs: &crate::memory::MrTable,
        buf: &mut [u8],
        pieces: &mut dyn PieceSink,
    ) -> Option<(Transmit, Option<AhId>)> {
        match self {
            QpEngine::Rc(q) => q.poll_transmit(now, mrs, buf, pieces).map(|t| (t, None)),
            QpEngine::Ud(q) => q
                .poll_transmit(mrs, buf, pieces)
                .map(|(t, ah)| (t, Some(ah))),
        }
    }
    /// The next timer.
    pub fn poll_timeout(&self) -> Option<Time> {
        match self {
            QpEngine::Rc(q) => q.poll_timeout(),
            QpEngine::Ud(_) => None,
        }
    }
    /// Runs due timers.
    pub fn handle_timeout(&mut self, now: Time) {
        if let QpEngine::Rc(q) = self {
            q.handle_timeout(now);
        }
    }
    /// The next completion.
    pub fn poll_completion(&mut self) -> Option<(CqKind, WorkCompletion)> {
        match self {
            QpEngine::Rc(q) => q.poll_completion(),
            QpEngine::Ud(q) => q.poll_completion(),
        }
    }
    /// What `poll_transmit` gave is in the socket (UD send completions wait
    /// for this; RC ones for the peer's ACK).
    pub fn transmitted(&mut self) {
        if let QpEngine::Ud(q) = self {
            q.transmitted();
        }
    }
    /// A CQ of this QP overran: it fails.
    pub fn cq_overrun(&mut self) {
        match self {
            QpEngine::Rc(q) => q.cq_overrun(),
            QpEngine::Ud(q) => q.cq_overrun(),
        }
    }
    /// The next asynchronous event.
    pub fn poll_event(&mut self) -> Option<QpEvent> {
        match self {
            QpEngine::Rc(q) => q.poll_event(),
            QpEngine::Ud(q) => q.poll_event(),
        }
    }
}
