//! RoCEv2 over a UDP socket: one socket per device, a progress thread that
//! owns receiving and the timers, and transmission from whichever thread has
//! work (the poster, or the progress thread after an ACK or a timer).
//!
//! Copies of payload bytes (the design's copy budget): none on send — headers,
//! region memory and the ICRC go to the kernel as one gather list; one on
//! receive — the engine copies from the datagram buffer into the target region.
//!
//! System calls: the packets a QP has ready go out in UDP GSO sends (one
//! datagram per `sendmsg` call, holding up to 16 equal-sized packets (64 of
//! 1 KiB payload or more) or as many as fit its 65 507 bytes, each with its
//! own headers and ICRC), and the
//! sockets take UDP GRO, so that on loopback one recvmsg returns a whole GSO
//! send. `SOFTRDMA_NO_GSO=1` turns both off.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd};
use rustix::net::sockopt;
use softrdma_wire::bth;
use softrdma_wire::icrc::{self, IdentificationMaps, Ipv4Flow, Ipv4Pseudo};
use softrdma_wire::mad::MAD_LEN;
use softrdma_wire::opcode::Opcode;
use spin::mutex::SpinMutex;
use spin::relax::Yield;

use super::pcap::{PacketMeta, PcapWriter};

pub mod connected;
use super::timespec;
use crate::engine::gsi;
use crate::engine::rc::MAX_HEADER_LEN;
use crate::engine::srq::Srq;
use crate::engine::ud::RecvMeta;
use crate::engine::{AhId, MAX_INLINE_DATA, QpAttr, QpEngine, QpState, Time, Transmit};
use crate::memory::{HeldPiece, HeldRegions, KeyHash, MrTable, PdId};
use crate::verbs::cq::CqInner;
use crate::verbs::events::{AsyncEvent, EventQueue};

/// Packets taken from a QP under its lock before they are sent without it: a
/// multiple of the 15 full 4 KiB packets a GSO send holds, so that a long
/// message's batches do not end in a short send (16 made every other send of
/// a 1 MiB WRITE a lone datagram).
const BATCH: usize = 60;
/// Sockets per device (source ports its QPs spread over).
const SOCKETS: usize = 8;
/// Looks per look at a socket other than the device's address: only what
/// is sent to a source port comes there, which RoCEv2 peers do not do (they
/// send to 4791). An empty `recvmsg` takes 0.4 µs here: one look in 8, as
/// before, put 50 ns on the average look, and so (a datagram waiting half a
/// look on average) about 25 ns on the time a busy-polling thread takes to
/// see its answer.
const OTHER_SOCKET_LOOKS: u32 = 64;
/// Largest datagram received (a UDP GRO one holds several packets).
const RX_BUF: usize = 65536;
/// Most packets in one UDP GSO send: small ones (more cost the 8-byte
/// message rate), and packets with a payload of at least
/// [`GSO_BULK_PAYLOAD`] bytes (the kernel's limit; 4 KiB packets fill a send
/// at 15, 1 KiB ones at 62).
const GSO_MAX_SEGMENTS: usize = 16;
const GSO_MAX_SEGMENTS_BULK: usize = 64;
const GSO_BULK_PAYLOAD: usize = 1024;
/// Gather entries a GSO send keeps off the heap: headers, two region pieces
/// and the trailer per packet (more pieces spill).
const GSO_MAX_IOV: usize = 4 * GSO_MAX_SEGMENTS_BULK;
/// The kernel's most gather entries per send (UIO_MAXIOV).
const MAX_IOV: usize = 1024;
/// Most UDP payload bytes in one GSO send (an IPv4 datagram's limit).
const GSO_MAX_BYTES: usize = 65507;
/// Most scatter/gather elements per work request on this provider (a packet's
/// payload spans at most this many region pieces).
pub(crate) const MAX_SGE: usize = 30;
// Any one packet's gather list fits in a send.
const _: () = assert!(MAX_SGE + 2 <= MAX_IOV);

/// A QP as the provider holds it.
#[derive(Debug)]
pub(crate) struct QpSlot {
    pub qpn: u32,
    pub engine: Mutex<QpEngine>,
    /// The peer's address, set at RTR (see [`QpSlot::peer`]): an atomic,
    /// since every packet in and out reads it.
    peer: AtomicU64,
    pub send_cq: Arc<CqInner>,
    pub recv_cq: Arc<CqInner>,
    /// The SRQ the QP takes receives from, with its number.
    pub srq: Option<(u64, Arc<Mutex<Srq>>)>,
    /// Which thread transmits for the QP.
    tx: TransmitTurn,
    /// Its own send socket, connected to its peer: taken in the transmit
    /// turn (and by a QP reset, to give it back).
    sender: SpinMutex<connected::SendSocket, Yield>,
    /// Whether packets were handled since a transmit last found nothing to
    /// send: a deferred transmit (see [`poll_now`]) is skipped when a post's
    /// has sent the answers already. Written under the QP lock.
    answers_pending: AtomicBool,
    /// The QP was destroyed (set under the QP lock): a thread that still
    /// holds the slot (a timer pass, a deferred answer) sends nothing more
    /// for it and completes nothing into its CQs.
    destroyed: AtomicBool,
}

/// The hand-off of a QP's transmitting between threads: one thread
/// transmits at a time, and a thread that finds another at it asks it to go
/// round again (it then sends what the asking thread queued). Uncontended, a
/// pass costs two read-modify-writes.
#[derive(Debug, Default)]
struct TransmitTurn(AtomicU8);

const TX_BUSY: u8 = 1;
const TX_AGAIN: u8 = 2;

impl TransmitTurn {
    /// Whether this thread is to transmit: true if no other thread does;
    /// false once the one that does has been asked to go round again.
    fn enter(&self) -> bool {
        loop {
            if self.0.fetch_or(TX_BUSY, Ordering::AcqRel) & TX_BUSY == 0 {
                return true;
            }
            // The RMWs on the word are totally ordered: if the holder has
            // left meanwhile, this sees no TX_BUSY and tries again to hold it.
            if self.0.fetch_or(TX_AGAIN, Ordering::AcqRel) & TX_BUSY != 0 {
                return false;
            }
        }
    }

    /// Ends a pass: true if done; false if another thread asked for another
    /// pass. The swap that clears the request reads it, so that the next
    /// pass sees what the asking thread queued before it asked.
    fn leave(&self) -> bool {
        if self
            .0
            .compare_exchange(TX_BUSY, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return true;
        }
        self.0.swap(TX_BUSY, Ordering::AcqRel);
        false
    }
}

/// Gives a turn back if its holder unwinds (a bug): a turn held by a dead
/// thread would keep every later pass, flushes included, from running.
struct TurnGivenBackOnPanic<'a> {
    turn: &'a TransmitTurn,
    left: bool,
}

impl Drop for TurnGivenBackOnPanic<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.turn.0.store(0, Ordering::Release);
        }
    }
}

impl QpSlot {
    pub fn new(
        qp: QpEngine,
        send_cq: Arc<CqInner>,
        recv_cq: Arc<CqInner>,
        srq: Option<(u64, Arc<Mutex<Srq>>)>,
    ) -> QpSlot {
        QpSlot {
            qpn: qp.qpn(),
            engine: Mutex::new(qp),
            peer: AtomicU64::new(0),
            send_cq,
            recv_cq,
            srq,
            tx: TransmitTurn::default(),
            sender: SpinMutex::new(connected::SendSocket::Untried),
            answers_pending: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
        }
    }

    /// The peer's address, once set.
    pub fn peer(&self) -> Option<SocketAddrV4> {
        let v = self.peer.load(Ordering::Acquire);
        (v >> 48 != 0)
            .then(|| SocketAddrV4::new(std::net::Ipv4Addr::from((v >> 16) as u32), v as u16))
    }

    /// Sets (or clears) the peer's address.
    pub fn set_peer(&self, peer: Option<SocketAddrV4>) {
        let v = peer.map_or(0, |a| {
            1 << 48 | u64::from(u32::from(*a.ip())) << 16 | u64::from(a.port())
        });
        self.peer.store(v, Ordering::Release);
        if peer.is_none() {
            // Its connected socket goes back to the device's budget.
            *self.sender.lock() = connected::SendSocket::Untried;
        }
    }
}

/// Counters of the device.
#[derive(Debug, Default)]
pub struct DeviceStats {
    /// Datagrams sent.
    pub sent: AtomicU64,
    /// Datagrams received (counted by the holder of the receive lock).
    pub received: AtomicU64,
    /// Dropped: bad ICRC.
    pub bad_icrc: AtomicU64,
    /// Dropped: no such QP, or not a RoCEv2 packet.
    pub no_qp: AtomicU64,
    /// Dropped: a BTH transport version other than 0, or a P_Key outside
    /// the default partition.
    pub bad_header: AtomicU64,
    /// CM messages the device refused itself (see `DeviceStats::cm_rejects`).
    pub cm_rejects: AtomicU64,
    /// Dropped: for an RC QP, from an address that is not its peer's.
    pub wrong_source: AtomicU64,
    /// Send errors from the kernel.
    pub send_errors: AtomicU64,
    /// Of those received, the ones application threads polling CQs took
    /// (busy-poll mode).
    pub polled: AtomicU64,
}

/// What the device's threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub mrs: Arc<RwLock<MrTable>>,
    pub qps: RwLock<HashMap<u32, Arc<QpSlot>, KeyHash>>,
    /// Address handles: where each sends, and its protection domain.
    pub ahs: RwLock<HashMap<u64, (SocketAddrV4, PdId)>>,
    /// Asynchronous events.
    pub events: Arc<EventQueue>,
    port_up: AtomicBool,
    /// Taken to move `port_up` (rarely: see [`Shared::set_port`]).
    port_moves: Mutex<()>,
    /// The hostd connection broke: the port stays down.
    uplink_lost: AtomicBool,
    pub stats: DeviceStats,
    /// The device's sockets: the first is bound to its address (exclusive)
    /// or an ephemeral port (hostd); the others to ephemeral ports. A UD QP
    /// (and an RC QP without a connected socket of its own) sends from the
    /// one its number hashes to, so that fabrics hashing the UDP source port
    /// (ECMP) spread the flows; all of them receive.
    sockets: Vec<UdpSocket>,
    /// Their ports (the source port of what each sends).
    ports: Vec<u16>,
    /// The address peers reach the device at.
    local: SocketAddrV4,
    /// The connection to the hostd sharing `local`, if any.
    uplink: Option<OwnedFd>,
    /// The QPN slot (top byte of QPNs) given by the hostd; 0 when exclusive.
    pub slot: u8,
    /// A capture of what the device sends and receives.
    pcap: Option<Mutex<PcapWriter>>,
    /// [`device_clock`]'s reading at `Time(base)`; both move if the counter
    /// goes back (see [`Shared::clock_went_back`]).
    epoch: AtomicU64,
    base: AtomicU64,
    /// Held while the counter's going back moves `epoch` and `base`.
    clock_moves: Mutex<()>,
    /// The monotonic clock at the device's start, `Time(0)`.
    started: std::time::Instant,
    wake: OwnedFd,
    /// Raised with every write to `wake`, so that a spinning progress thread
    /// sees a wake-up without a system call (see [`RxBuffers::spin`]).
    woken: AtomicBool,
    /// When the progress thread will wake by itself (engine time; MAX = never).
    sleep_until: AtomicU64,
    stop: AtomicBool,
    /// The progress thread died (a bug): see [`device_fatal`].
    fatal: AtomicBool,
    /// Tests: the progress thread panics at its next pass.
    #[cfg(test)]
    panic_next_pass: AtomicBool,
    /// Busy-poll mode: application threads polling the device's CQs receive
    /// (see [`poll_now`]); the progress thread stands by while they do.
    busy_poll: AtomicBool,
    /// When an application thread last polled (engine time, ns).
    app_polled: AtomicU64,
    /// The progress thread sleeps with the sockets left to a polling
    /// thread, and wakes within the standby time to take them back.
    standing_by: AtomicBool,
    /// Its alarm for that: a one-shot timer the polling threads push back
    /// as they poll, so that it fires only once they stop (a wake-up every
    /// standby period would take a CPU from a spinning thread each time).
    standby_alarm: OwnedFd,
    /// When a polling thread last pushed the alarm back (engine time, ns).
    alarm_pushed: AtomicU64,
    /// Held by whichever thread is receiving from the sockets. A spin lock:
    /// polling threads only try it, and its release is a store (a futex
    /// mutex's is a read-modify-write, on every look).
    rx_lock: SpinMutex<Receiving, Yield>,
    /// Packets of a QP go out in UDP GSO sends (off after the kernel refuses).
    gso: AtomicBool,
    /// RC QPs send from sockets of their own connected to their peers
    /// (see [`connected`]), within this budget.
    connected: Arc<connected::Budget>,
    /// The sockets report received TTLs and TOSes (see [`report_ip_fields`]).
    ip_fields: AtomicBool,
    /// QP 1's connection-manager bookkeeping (rdma_cm over RoCE).
    pub gsi: super::gsi::Gsi,
}

impl Shared {
    /// Whether the port is up (the last send worked, the hostd is there).
    pub fn port_up(&self) -> bool {
        self.port_up.load(Ordering::Acquire)
    }

    /// Moves the port up or down, with its event, unless it is there
    /// already; up only while the hostd (if any) is there and the device
    /// lives. Under a lock: a send that finds the port back, racing a lost
    /// uplink or a fatal error, can't leave it up, nor raise the events out
    /// of order.
    fn set_port(&self, up: bool) {
        let _moving = self
            .port_moves
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if up && (self.uplink_lost.load(Ordering::Acquire) || self.fatal.load(Ordering::Acquire)) {
            return;
        }
        if self.port_up.swap(up, Ordering::AcqRel) != up {
            self.events.push(if up {
                AsyncEvent::PortActive
            } else {
                AsyncEvent::PortDown
            });
        }
    }

    /// It shares its address through the hostd (which answers QP 1).
    pub fn is_shared_port(&self) -> bool {
        self.uplink.is_some()
    }

    /// The device failed: its progress thread is gone.
    pub fn is_fatal(&self) -> bool {
        self.fatal.load(Ordering::Acquire)
    }

    /// Tests: makes the progress thread panic at its next pass.
    #[cfg(test)]
    pub(crate) fn panic_soon(&self) {
        self.panic_next_pass.store(true, Ordering::SeqCst);
        self.wake();
    }

    pub fn now(&self) -> Time {
        self.reading().unwrap_or_else(|| self.clock_went_back())
    }

    /// The time by the counter; `None` if the counter is below the epoch
    /// (it went back). Epoch and base are read before the counter: a
    /// reader that pairs an old epoch with a new base (set after the
    /// counter went back) reads the counter after that and finds it below
    /// the epoch, instead of adding the old epoch's span to the new base.
    #[inline]
    fn reading(&self) -> Option<Time> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let base = self.base.load(Ordering::Acquire);
        let clock = device_clock();
        let raw = clock.raw();
        (raw >= epoch).then(|| Time(base + clock.delta_as_nanos(epoch, raw)))
    }

    /// The counter went back (a TSC reset by a suspend, say): time goes on
    /// from the monotonic clock's, so that timers still run out. It may
    /// land a little behind the last reading (the two clocks drift apart);
    /// engine time differences saturate, so a timer then runs that much
    /// longer, never out early.
    #[cold]
    fn clock_went_back(&self) -> Time {
        // One thread moves the pair at a time, and only if no other has:
        // two interleaved moves could leave one's epoch with the other's base.
        let _moving = self
            .clock_moves
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = self.reading() {
            return t;
        }
        let raw = device_clock().raw();
        let now = self.started.elapsed().as_nanos() as u64;
        // The base first: a reader that sees the new epoch sees it.
        self.base.store(now, Ordering::Release);
        self.epoch.store(raw, Ordering::Release);
        Time(now)
    }

    /// Takes a QP out of the device's table, and out of the receiving
    /// thread's recent QPs (waiting for that thread to finish its look).
    pub fn remove_qp(&self, qpn: u32) {
        let slot = self.qps.write().expect("QP table lock").remove(&qpn);
        let mut receiving = self.rx_lock.lock();
        for s in &mut receiving.recent_qps {
            s.take_if(|s| s.qpn == qpn);
        }
        // Its deferred answers go unsent (they hold its regions too).
        receiving.deferred.retain(|s| s.qpn != qpn);
        drop(receiving);
        if let Some(slot) = slot {
            let _qp = slot.engine.lock().expect("QP lock");
            slot.destroyed.store(true, Ordering::Release);
        }
    }

    /// Has the sockets report the TTL and TOS of what arrives, from now on
    /// (before the first UD QP).
    pub fn want_ip_fields(&self) -> io::Result<()> {
        if !self.ip_fields.swap(true, Ordering::AcqRel) {
            for s in &self.sockets {
                report_ip_fields(s)?;
            }
        }
        Ok(())
    }

    /// Whether the device is in busy-poll mode.
    pub fn busy_poll(&self) -> bool {
        self.busy_poll.load(Ordering::Relaxed)
    }

    fn wake(&self) {
        self.woken.store(true, Ordering::SeqCst);
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Sets the standby alarm to fire `after_ns` from now.
    fn set_standby_alarm(&self, after_ns: u64) {
        let spec = rustix::time::Itimerspec {
            it_interval: timespec(Duration::ZERO),
            // At least 1 ns: zero would disarm it.
            it_value: timespec(Duration::from_nanos(after_ns.max(1))),
        };
        let _ = rustix::time::timerfd_settime(
            &self.standby_alarm,
            rustix::time::TimerfdTimerFlags::empty(),
            &spec,
        );
    }
}

/// One packet taken from a QP: headers (and inline payload), region pieces
/// (their regions held by the batch: [`TxBatch`]).
#[derive(Debug)]
struct TxSlot {
    buf: Vec<u8>,
    pieces: Vec<HeldPiece>,
    t: Transmit,
    /// The pad and the ICRC, written as the packet is framed.
    trailer: [u8; 7],
    /// UD: the address handle; RC: the QP's peer.
    ah: Option<AhId>,
}

/// A transmitting thread's packets taken from a QP under its lock, and the
/// regions their pieces come from, held until the batch is sent.
#[derive(Debug)]
struct TxBatch {
    slots: Vec<TxSlot>,
    held: HeldRegions,
}

/// Packets in flight from which a post leaves transmitting to the thread
/// that receives the ACKs (the poster transmits while the queue is short):
/// their ACKs bring a transmit soon (or their timer does), and the new work
/// leaves with others in GSO sends instead of one datagram per post.
const POSTER_LEAVES_AT: u32 = 16;

/// How long the progress thread leaves the sockets to an application
/// thread that polled (busy-poll mode): if it stops polling, the progress
/// thread is receiving again within this time.
const STANDBY_NS: u64 = 10_000_000;

/// An application thread that looks at the sockets again within this time
/// takes one datagram a look (see `poll_now`).
const LOOKS_OFTEN_NS: u64 = 20_000;

/// How often polling threads push the standby alarm back: a system call
/// every this often, and the progress thread takes the sockets back at most
/// [`STANDBY_NS`] after the last poll. Seldom: setting a timer that is its
/// CPU's next expiry exits to the hypervisor on VMs (about 5 µs; pushed
/// every 200 µs, it slowed 6 % of busy-poll round trips).
const ALARM_PUSH_NS: u64 = 5_000_000;

/// Most datagrams a receiving thread takes before it sends the responses
/// it holds back for GSO sends (see [`RxBuffers::drain_sockets`]).
const HELD_DATAGRAMS: usize = 16;

/// Most datagrams one look takes from a socket (or the hostd's uplink): a
/// sender that never stops
/// (a flood of junk included) must not keep the progress thread from its
/// timers, its stop flag and the other sockets, nor keep the receive lock
/// from a polling thread for good.
const RX_BUDGET: usize = 256;

/// How long the progress thread spins on the sockets after the last
/// datagram before it sleeps (busy-poll mode, no application thread
/// polling; see [`RxBuffers::spin`]).
const BUSY_SPIN_NS: u64 = 1_000_000;

/// Blocking mode: [`STREAM_LOOKS`] looks in a row that each found datagrams
/// within this of the one before are a stream, and the progress thread then
/// spins on the sockets while datagrams keep coming this close together,
/// instead of sleeping between them (a sleeping receiver costs every
/// datagram a wake-up, which on loopback the sender pays). A ping-pong's
/// datagrams come a round trip apart, further than this: it still sleeps,
/// and no spinning costs it a CPU.
const STREAM_GAP_NS: u64 = 20_000;
const STREAM_LOOKS: u32 = 4;

/// A look of the spinning progress thread that takes at least this many
/// bytes finds bulk data (a WRITE stream's GSO sends hold 60 KB); two such
/// looks within [`STREAM_GAP_NS`] are a stream (one large message is not).
/// For [`BULK_HOLD_NS`] after such a look in a stream, an empty look is
/// followed by
/// [`BULK_PAUSE_NS`] of spinning that makes no system call, not at once by
/// the next look: the data gathers into fewer, fuller looks, and the sender
/// (on loopback, the other CPU, which also delivers into this socket) runs
/// faster when the receiver is not forever in `recvmsg` and `sched_yield`.
/// A 64 KiB busy-poll WRITE stream moved 7.0-7.6 GB/s so against 5.9-6.0
/// with a look after every yield, and 6.5-6.9 with a server that blocks
/// (docs/performance.md, forty-sixth session). A blocking device's
/// progress thread spinning through a stream ([`STREAM_GAP_NS`]) pauses
/// alike. Small datagrams (a
/// ping-pong's, READ requests, a stream of 8-byte WRITEs, whose rate hangs
/// on prompt ACKs) never start it: their answers leave as soon as now.
const BULK_BYTES: usize = 32 << 10;
const BULK_HOLD_NS: u64 = 200_000;
const BULK_PAUSE_NS: u64 = 10_000;

/// What the thread receiving from a device's sockets keeps (under
/// [`Shared::rx_lock`]).
#[derive(Debug, Default)]
pub(crate) struct Receiving {
    /// QPs whose answers a polling thread deferred (see [`poll_now`]).
    deferred: Vec<Arc<QpSlot>>,
    /// QPs the datagrams of the current look reached (see
    /// [`receive_datagram`]).
    touched: Vec<Arc<QpSlot>>,
    /// The QPs the last packets were for, most recent first: datagrams
    /// mostly come for the QP the last one came for, and a hit takes no
    /// lock of the QP table. A destroyed QP is dropped from here (see
    /// [`Shared::remove_qp`]).
    recent_qps: [Option<Arc<QpSlot>>; RECENT_QPS],
}

/// How many QPs [`Receiving::recent_qps`] holds.
const RECENT_QPS: usize = 4;

impl Receiving {
    /// The QP `qpn` names, from the recent ones or the device's table.
    fn qp(&mut self, shared: &Shared, qpn: u32) -> Option<Arc<QpSlot>> {
        if let Some(at) = self
            .recent_qps
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.qpn == qpn))
        {
            self.recent_qps[..=at].rotate_right(1);
            return self.recent_qps[0].clone();
        }
        let slot = shared
            .qps
            .read()
            .expect("QP table lock")
            .get(&qpn)
            .cloned()?;
        self.recent_qps.rotate_right(1);
        self.recent_qps[0] = Some(slot.clone());
        Some(slot)
    }
}

/// A receiving thread's buffers.
struct RxBuffers {
    rx: Vec<u8>,
    cmsg: Vec<u8>,
    polls: u32,
    /// When the progress thread last received a datagram (engine time, ns;
    /// see [`RxBuffers::spin`]).
    last_rx: u64,
    /// Until when the spinning progress thread pauses between empty looks
    /// (engine time, ns; see [`BULK_BYTES`]).
    bulk_until: u64,
    /// When the last look that took [`BULK_BYTES`] came (engine time, ns).
    last_bulk: u64,
}

impl RxBuffers {
    fn new() -> RxBuffers {
        RxBuffers {
            rx: vec![0u8; RX_BUF],
            cmsg: nix::cmsg_space!(i32, u8, i32),
            polls: 0,
            last_rx: 0,
            bulk_until: 0,
            last_bulk: 0,
        }
    }

    /// Receives and handles what waits on the device's sockets: up to
    /// [`RX_BUDGET`] datagrams a socket, or (`one`) one. With `defer`, the QPs the
    /// datagrams reached are left in `receiving.touched` (see
    /// [`receive_datagram`]); otherwise they send what they have after each
    /// datagram, unless one has a GSO send's worth of responses queued: then
    /// the next datagrams are taken first (at most [`HELD_DATAGRAMS`]), so
    /// that consecutive READ responses share GSO sends (a 64 KiB READ's FIRST
    /// and LAST packets are 4 bytes longer than its MIDDLE ones, so alone it
    /// takes three sends; with the next READ's, two). `looked_at`: when the
    /// caller started looking, taken as the first datagram's arrival (the
    /// clock is read for the others). Returns the packets and the bytes
    /// received.
    fn drain_sockets(
        &mut self,
        shared: &Shared,
        receiving: &mut Receiving,
        readable: &[bool; SOCKETS],
        defer: bool,
        one: bool,
        mut looked_at: Option<Time>,
    ) -> (u64, usize) {
        let (mut received, mut bytes) = (0, 0);
        let mut held = 0;
        let mut holding = false;
        // The device's address last: a polling thread's answer to what it
        // takes there then leaves without an empty `recvmsg` on a source
        // port first (one look in OTHER_SOCKET_LOOKS has one).
        for (i, sock) in shared.sockets.iter().enumerate().rev() {
            if !readable[i] {
                continue;
            }
            let mut budget = if one { 1 } else { RX_BUDGET };
            while budget > 0
                && let Some((n, meta)) = recv_datagram(sock, &mut self.rx, &mut self.cmsg)
            {
                budget -= 1;
                bytes += n;
                let (holds, packets) = receive_datagram(
                    shared,
                    receiving,
                    &self.rx[..n],
                    &meta,
                    shared.ports[i],
                    true,
                    looked_at.take().unwrap_or_else(|| shared.now()),
                );
                holding |= holds;
                received += packets;
                held += 1;
                if !defer && (held >= HELD_DATAGRAMS || !holding) {
                    for slot in receiving.touched.drain(..) {
                        transmit(shared, &slot);
                    }
                    held = 0;
                    holding = false;
                }
            }
        }
        if !defer {
            for slot in receiving.touched.drain(..) {
                transmit(shared, &slot);
            }
        }
        (received, bytes)
    }

    /// The sockets a look takes: the device's address, where peers send,
    /// every time; one look in [`OTHER_SOCKET_LOOKS`] one of the others
    /// (source ports), in turn. One at a time: all seven in one look took
    /// 3 µs, which a ping-pong's answer arriving meanwhile waited for
    /// (busy-poll WRITE latency p99 10 µs). Through the hostd, every socket
    /// is a source port: each in turn, one look in [`OTHER_SOCKET_LOOKS`].
    fn sockets_to_look_at(&mut self, through_hostd: bool) -> [bool; SOCKETS] {
        self.polls = self.polls.wrapping_add(1);
        let turn = (self.polls / OTHER_SOCKET_LOOKS) as usize;
        let other = self.polls.is_multiple_of(OTHER_SOCKET_LOOKS).then(|| {
            if through_hostd {
                turn % SOCKETS
            } else {
                1 + turn % (SOCKETS - 1)
            }
        });
        std::array::from_fn(|i| (i == 0 && !through_hostd) || Some(i) == other)
    }

    /// The progress thread's look at `which` sockets: first what a polling
    /// thread deferred, then everything that waits. Returns whether a
    /// datagram came (and notes when, and whether a stream flows).
    fn take_sockets(&mut self, shared: &Shared, which: &[bool; SOCKETS]) -> bool {
        let mut receiving = shared.rx_lock.lock();
        send_deferred(shared, &mut receiving);
        let (received, bytes) =
            self.drain_sockets(shared, &mut receiving, which, false, false, None);
        if received > 0 {
            self.last_rx = shared.now().0;
            if bytes >= BULK_BYTES {
                if self.last_rx.saturating_sub(self.last_bulk) < STREAM_GAP_NS {
                    self.bulk_until = self.last_rx + BULK_HOLD_NS;
                }
                self.last_bulk = self.last_rx;
            }
        }
        received > 0
    }

    /// The progress thread in busy-poll mode while no application thread
    /// polls: spins on the sockets (yielding the CPU between empty looks, or
    /// in a stream pausing without a system call: [`BULK_BYTES`]) instead of
    /// sleeping in poll(2), as the iWARP receive threads do. A
    /// sleeping receiver costs every datagram a wake-up, which on loopback
    /// the sender pays. Returns true once it has handled datagrams; false on
    /// a wake-up, at `deadline` (the next timer), once an application thread
    /// polls, or after [`BUSY_SPIN_NS`] without a datagram.
    fn spin(&mut self, shared: &Shared, deadline: u64) -> bool {
        self.spin_for(shared, deadline, BUSY_SPIN_NS, true)
    }

    /// As [`RxBuffers::spin`], until `idle_ns` without a datagram; `busy`:
    /// only in busy-poll mode with no application thread polling.
    fn spin_for(&mut self, shared: &Shared, deadline: u64, idle_ns: u64, busy: bool) -> bool {
        loop {
            let now = shared.now().0;
            if shared.woken.load(Ordering::SeqCst)
                || now >= deadline
                || now.saturating_sub(self.last_rx) >= idle_ns
                || (busy
                    && (now.saturating_sub(shared.app_polled.load(Ordering::Relaxed)) < STANDBY_NS
                        || !shared.busy_poll()))
            {
                return false;
            }
            let which = self.sockets_to_look_at(false);
            if self.take_sockets(shared, &which) {
                return true;
            }
            if now < self.bulk_until {
                let until = now + BULK_PAUSE_NS;
                while shared.now().0 < until && !shared.woken.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Sends what a polling thread's look deferred (see [`poll_now`]); returns
/// the earliest timer that set, or `u64::MAX`.
fn send_deferred(shared: &Shared, receiving: &mut Receiving) -> u64 {
    let mut earliest = u64::MAX;
    // Tested first: an empty `drain` still costs a busy-poll look some 40
    // instructions.
    if !receiving.deferred.is_empty() {
        for slot in receiving.deferred.drain(..) {
            if let Some(t) = transmit_deferred(shared, &slot) {
                earliest = earliest.min(t.0);
            }
        }
    }
    earliest
}

/// Busy-poll mode: the calling application thread (polling a CQ) receives
/// what waits on the device's sockets (or the hostd's uplink) and handles
/// it, so that a ping-pong takes no thread wake-up (libfabric's manual
/// progress). Returns at once when another thread is receiving, or outside
/// busy-poll mode.
pub(crate) fn poll_now(shared: &Shared) {
    if !shared.busy_poll.load(Ordering::Relaxed) {
        return;
    }
    let now = shared.now().0;
    // A load and a store, not a (locked) swap: polling threads racing here
    // only blur the time of the last look.
    let since_last_look = now.saturating_sub(shared.app_polled.load(Ordering::Relaxed));
    shared.app_polled.store(now, Ordering::Relaxed);
    if shared.standing_by.load(Ordering::Relaxed)
        && now.saturating_sub(shared.alarm_pushed.load(Ordering::Relaxed)) >= ALARM_PUSH_NS
    {
        shared.alarm_pushed.store(now, Ordering::Relaxed);
        shared.set_standby_alarm(STANDBY_NS);
    }
    let Some(mut receiving) = shared.rx_lock.try_lock() else {
        return;
    };
    // What the last look received answers now, unless a post sent it
    // already: deferred so that an answer (an ACK) can leave with the
    // application's next request in one GSO send.
    let earliest = send_deferred(shared, &mut receiving);
    APP_RX.with_borrow_mut(|b| {
        // A thread that looks again at once takes one datagram a look: the
        // answer to it (a ping-pong's next post, a receive posted again)
        // leaves without an empty `recvmsg` (about 1 µs) first. A thread
        // that looks seldom takes everything that waits.
        let one = since_last_look < LOOKS_OFTEN_NS;
        // Shared through the hostd, the device's sockets are source ports
        // (peers send to the daemon's 4791): what comes, comes up the uplink.
        let from_uplink = match &shared.uplink {
            Some(uplink) if !shared.uplink_lost.load(Ordering::Acquire) => take_uplink(
                shared,
                uplink,
                &mut receiving,
                &mut b.rx,
                if one { 1 } else { RX_BUDGET },
                true,
            ),
            _ => 0,
        };
        let which = b.sockets_to_look_at(shared.uplink.is_some());
        let received = from_uplink
            + b.drain_sockets(shared, &mut receiving, &which, true, one, Some(Time(now)))
                .0;
        if received > 0 {
            // Only the holder of the receive lock counts: a load and a store.
            let polled = &shared.stats.polled;
            polled.store(polled.load(Ordering::Relaxed) + received, Ordering::Relaxed);
        }
        let Receiving {
            deferred, touched, ..
        } = &mut *receiving;
        if !touched.is_empty() {
            deferred.append(touched);
        }
    });
    let waiting = !receiving.deferred.is_empty();
    drop(receiving);
    // A progress thread asleep on the sockets would not wake to send what
    // was deferred if this thread stopped polling: wake it into standby.
    // (It clears the flag before it takes the deferred list: one of the two
    // sees the other.)
    // A timer set here (an RNR retry, a retransmission) earlier than the
    // progress thread's sleep must wake it, as a post's does (`kick`),
    // unless a wake-up is pending (the thread looks at the timers after it
    // clears the flag).
    if (waiting && !shared.standing_by.load(Ordering::SeqCst))
        || (earliest < shared.sleep_until.load(Ordering::SeqCst)
            && !shared.woken.load(Ordering::SeqCst))
    {
        shared.wake();
    }
}

/// Busy-poll mode: an application thread is about to sleep on a CQ's
/// channel. A progress thread standing by for polling threads takes the
/// sockets back now, not at its standby alarm (up to [`STANDBY_NS`] later,
/// which the thread's event would have waited for). Unconditional: the
/// progress thread may be about to stand by.
pub(crate) fn app_sleeps(shared: &Shared) {
    if shared.busy_poll() {
        shared.app_polled.store(0, Ordering::Relaxed);
        shared.wake();
    }
}

thread_local! {
    static APP_RX: RefCell<RxBuffers> = RefCell::new(RxBuffers::new());
    // The flows this thread last sent on from a device socket (a connected
    // socket keeps its own) and received from, with their ICRC prefixes:
    // consecutive packets mostly share them.
    static SEND_FLOW: Cell<Option<Ipv4Flow>> = const { Cell::new(None) };
    static RECV_FLOW: Cell<Option<Ipv4Flow>> = const { Cell::new(None) };
    static ID_MAPS: RefCell<IdentificationMaps> = const { RefCell::new(IdentificationMaps::new()) };
    static TX: RefCell<TxBatch> = RefCell::new(TxBatch {
        slots: (0..BATCH)
            .map(|_| TxSlot {
                buf: vec![0u8; MAX_HEADER_LEN + MAX_INLINE_DATA as usize],
                // A packet's payload from up to four SGEs, without growing.
                pieces: Vec::with_capacity(4),
                t: Transmit { len: 0, payload_len: 0, pad: 0 },
                trailer: [0; 7],
                ah: None,
            })
            .collect(),
        held: HeldRegions::default(),
    });
}

/// A RoCEv2 device on a UDP socket.
#[derive(Debug)]
pub(crate) struct UdpDevice {
    pub shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl UdpDevice {
    /// Opens the device at `addr`: binds it (exclusive), or joins the hostd
    /// that shares it (then the socket sends from an ephemeral port and
    /// receives through the daemon). Returns the device and its QPN slot.
    pub fn open(
        addr: SocketAddrV4,
        busy_poll: bool,
        shared_port: bool,
        pcap: Option<&std::path::Path>,
    ) -> io::Result<UdpDevice> {
        let pcap = match pcap {
            Some(p) => Some(Mutex::new(PcapWriter::create(p).map_err(|e| {
                io::Error::new(e.kind(), format!("pcap file {}: {e}", p.display()))
            })?)),
            None => None,
        };
        // A capture shows the TTL and TOS of what arrives.
        let ip_fields = pcap.is_some();
        let (socket, uplink, slot) = if shared_port {
            let (uplink, slot) = super::hostd::join(addr)?;
            (
                roce_socket(SocketAddrV4::new(*addr.ip(), 0), ip_fields)?,
                Some(uplink),
                slot,
            )
        } else {
            (roce_socket(addr, ip_fields)?, None, 0)
        };
        let port_of = |s: &UdpSocket| -> io::Result<SocketAddrV4> {
            match s.local_addr()? {
                SocketAddr::V4(a) => Ok(a),
                SocketAddr::V6(_) => unreachable!("bound to IPv4"),
            }
        };
        let bound = port_of(&socket)?;
        let local = if shared_port { addr } else { bound };
        let mut sockets = vec![socket];
        for _ in 1..SOCKETS {
            sockets.push(roce_socket(SocketAddrV4::new(*addr.ip(), 0), ip_fields)?);
        }
        // UDP GRO: a GSO send arrives as one datagram (on loopback, never
        // cut up). SOFTRDMA_NO_GSO turns GSO and GRO off (for comparison).
        let offload = std::env::var_os("SOFTRDMA_NO_GSO").is_none();
        if offload {
            for s in &sockets {
                let _ = nix::sys::socket::setsockopt(
                    s,
                    nix::sys::socket::sockopt::UdpGroSegment,
                    &true,
                );
            }
        }
        let ports = sockets
            .iter()
            .map(|s| port_of(s).map(|a| a.port()))
            .collect::<io::Result<Vec<u16>>>()?;
        let shared = Arc::new(Shared {
            mrs: Arc::new(RwLock::new(MrTable::new())),
            qps: RwLock::new(HashMap::default()),
            ahs: RwLock::new(HashMap::new()),
            events: Arc::new(EventQueue::new()?),
            port_up: AtomicBool::new(true),
            port_moves: Mutex::new(()),
            uplink_lost: AtomicBool::new(false),
            stats: DeviceStats::default(),
            sockets,
            ports,
            local,
            uplink,
            slot,
            pcap,
            epoch: AtomicU64::new(device_clock().raw()),
            base: AtomicU64::new(0),
            started: std::time::Instant::now(),
            clock_moves: Mutex::new(()),
            wake: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            woken: AtomicBool::new(false),
            sleep_until: AtomicU64::new(u64::MAX),
            stop: AtomicBool::new(false),
            fatal: AtomicBool::new(false),
            #[cfg(test)]
            panic_next_pass: AtomicBool::new(false),
            busy_poll: AtomicBool::new(busy_poll),
            app_polled: AtomicU64::new(0),
            standing_by: AtomicBool::new(false),
            standby_alarm: rustix::time::timerfd_create(
                rustix::time::TimerfdClockId::Monotonic,
                rustix::time::TimerfdFlags::CLOEXEC | rustix::time::TimerfdFlags::NONBLOCK,
            )?,
            alarm_pushed: AtomicU64::new(0),
            rx_lock: SpinMutex::new(Receiving::default()),
            gso: AtomicBool::new(offload),
            connected: connected::Budget::new(),
            ip_fields: AtomicBool::new(ip_fields),
            gsi: super::gsi::Gsi::new(
                std::process::id().wrapping_mul(0x9e37_79b9)
                    ^ SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos()),
            ),
        });
        shared.events.push(AsyncEvent::PortActive);
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-{}", local))
            .spawn(move || {
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| progress(&s)));
                if ran.is_err() {
                    device_fatal(&s);
                }
            })?;
        Ok(UdpDevice {
            shared,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.shared.local
    }

    /// Sends what a QP has to send now (after a post), and makes sure the
    /// progress thread wakes for the QP's timers.
    pub fn kick(&self, slot: &QpSlot) {
        if let Some(t) = transmit(&self.shared, slot)
            && t.0 < self.shared.sleep_until.load(Ordering::SeqCst)
        {
            self.shared.wake();
        }
    }

    /// Whether a post that finds `in_flight` packets of its QP unacknowledged
    /// sends itself (see [`POSTER_LEAVES_AT`]). In busy-poll mode the thread
    /// taking the ACKs spins, so leaving costs no wake-up, and a post leaves
    /// whenever anything is in flight: with ACKs back within microseconds, a
    /// queue never reaches 16, and every post would be a datagram (the 8-byte
    /// message rate halved).
    pub fn poster_transmits(&self, in_flight: u32) -> bool {
        in_flight
            < if self.shared.busy_poll() {
                1
            } else {
                POSTER_LEAVES_AT
            }
    }

    /// Busy-poll mode on or off: application threads polling CQs receive
    /// (latency against CPU).
    pub fn set_busy_poll(&self, on: bool) {
        self.shared.busy_poll.store(on, Ordering::Release);
        self.shared.wake();
    }
}

impl Drop for UdpDevice {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Moves the QP's completions to its CQs (noting the CQs to signal) and its
/// asynchronous events, and its SRQ's, to the device's event queue.
fn drain_completions(
    qp: &mut QpEngine,
    slot: &QpSlot,
    events: &EventQueue,
    signal: &mut [bool; 2],
) {
    if slot.destroyed.load(Ordering::Acquire) {
        while qp.poll_completion().is_some() {}
        while qp.poll_event().is_some() {}
        return;
    }
    while let Some((kind, wc)) = qp.poll_completion() {
        if !CqInner::deliver([&slot.send_cq, &slot.recv_cq], kind, wc, signal) {
            // Completions are being lost: the QP can't go on (its flush's
            // completions are lost too, and this loop takes them).
            qp.cq_overrun();
        }
    }
    while let Some(e) = qp.poll_event() {
        events.push(match e {
            crate::engine::QpEvent::Fatal => AsyncEvent::QpFatal { qpn: slot.qpn },
            crate::engine::QpEvent::LastWqeReached => {
                AsyncEvent::QpLastWqeReached { qpn: slot.qpn }
            }
            crate::engine::QpEvent::SqDrained => AsyncEvent::SqDrained { qpn: slot.qpn },
            crate::engine::QpEvent::CommEstablished => {
                AsyncEvent::CommEstablished { qpn: slot.qpn }
            }
        });
    }
    if let Some((id, srq)) = &slot.srq
        && srq.lock().expect("SRQ lock").take_limit_event()
    {
        events.push(AsyncEvent::SrqLimitReached { srq: *id });
    }
}

fn signal_cqs(slot: &QpSlot, signal: [bool; 2]) {
    if signal[0] {
        slot.send_cq.signal();
    }
    if signal[1] {
        slot.recv_cq.signal();
    }
}

/// [`transmit`] for a QP whose answers a polling thread deferred, unless a
/// transmit (a post's) has found nothing left to send since its packets were
/// handled.
fn transmit_deferred(shared: &Shared, slot: &QpSlot) -> Option<Time> {
    if slot.answers_pending.load(Ordering::Relaxed) {
        transmit(shared, slot)
    } else {
        None
    }
}

/// Sends everything the QP has to send, unless another thread is at it (then
/// that thread goes round again). Returns the QP's next timer.
fn transmit(shared: &Shared, slot: &QpSlot) -> Option<Time> {
    if slot.destroyed.load(Ordering::Acquire) || !slot.tx.enter() {
        return None;
    }
    let mut turn = TurnGivenBackOnPanic {
        turn: &slot.tx,
        left: false,
    };
    let mut timer = None;
    TX.with_borrow_mut(|batch| {
        let TxBatch { slots: tx, held } = batch;
        loop {
            loop {
                let mut signal = [false; 2];
                let (n, peer, resends) = {
                    let mrs = shared.mrs.read().expect("MR table lock");
                    let mut qp = slot.engine.lock().expect("QP lock");
                    let now = shared.now();
                    let mut n = 0;
                    while n < BATCH {
                        let s = &mut tx[n];
                        match qp.poll_transmit(now, &mrs, &mut s.buf, &mut held.sink(&mut s.pieces))
                        {
                            Some((t, ah)) => {
                                s.t = t;
                                s.ah = ah;
                                n += 1;
                            }
                            None => {
                                slot.answers_pending.store(false, Ordering::Relaxed);
                                break;
                            }
                        }
                    }
                    drain_completions(&mut qp, slot, &shared.events, &mut signal);
                    timer = qp.poll_timeout();
                    (n, slot.peer(), qp.resend_signs())
                };
                signal_cqs(slot, signal);
                // ACKs (the responder's, a PSN space of their own) after
                // the requests, so that a request and the ACK it follows
                // can share a GSO send (the last segment may be shorter).
                // Only past requests: the responder's own packets (READ
                // responses, atomic ACKs) keep their order with its ACKs.
                if n > 1 {
                    let is_ack =
                        |s: &TxSlot| s.ah.is_none() && s.buf[0] == Opcode::RC_ACKNOWLEDGE.0;
                    let is_request =
                        |s: &TxSlot| Opcode(s.buf[0]).info().is_some_and(|i| i.is_request());
                    if let Some(first) = tx[..n].iter().position(is_ack)
                        && tx[first..n].iter().any(|s| !is_ack(s))
                        && tx[first..n].iter().all(|s| is_ack(s) || is_request(s))
                    {
                        // A stable partition of tx[first..n].
                        let mut w = first;
                        for r in first..n {
                            if !is_ack(&tx[r]) {
                                tx[w..=r].rotate_right(1);
                                w += 1;
                            }
                        }
                    }
                }
                // Taken at the pass's first RC packet, held to its end.
                let mut sender = None;
                let mut i = 0;
                while i < n {
                    let dest = match tx[i].ah {
                        Some(ah) => shared
                            .ahs
                            .read()
                            .expect("AH table lock")
                            .get(&ah.0)
                            .map(|&(addr, _)| addr),
                        None => peer,
                    };
                    let Some(d) = dest else {
                        // An address handle destroyed with sends in flight.
                        shared.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                        continue;
                    };
                    let gso = shared.gso.load(Ordering::Relaxed);
                    // Checked under the lock: a QP reset since has no peer,
                    // and must not make a socket for the old one.
                    let via = if tx[i].ah.is_none() {
                        let sender = sender.get_or_insert_with(|| slot.sender.lock());
                        (slot.peer() == Some(d))
                            .then(|| {
                                sender.connected_to(
                                    &shared.connected,
                                    *shared.local.ip(),
                                    d,
                                    gso,
                                    resends,
                                )
                            })
                            .flatten()
                    } else {
                        None
                    };
                    // All of a QP's packets from one port: a GSO run only
                    // where its socket takes one.
                    let gso = gso && via.as_ref().is_none_or(|c| c.takes_gso());
                    let k = gso_run(gso, &tx[i..n]);
                    send_packets(shared, d, &mut tx[i..i + k], held, slot.qpn, via);
                    i += k;
                }
                drop(sender);
                // UD send completions wait for their datagrams to be in the
                // socket (the application may reuse a buffer once it sees
                // its completion).
                if tx[..n].iter().any(|s| s.ah.is_some()) {
                    let mut signal = [false; 2];
                    {
                        let mut qp = slot.engine.lock().expect("QP lock");
                        qp.transmitted();
                        drain_completions(&mut qp, slot, &shared.events, &mut signal);
                    }
                    signal_cqs(slot, signal);
                }
                for s in &mut tx[..n] {
                    s.pieces.clear();
                }
                held.release();
                if n < BATCH {
                    break;
                }
            }
            if slot.tx.leave() {
                break;
            }
        }
    });
    turn.left = true;
    timer
}

/// Why the kernel refused a GSO send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GsoRefused {
    /// Not on this device's route: no checksum offload there, or IPsec
    /// (EIO); or ENOPROTOOPT on an unconnected socket (which gets no ICMP
    /// errors), taken as a kernel without UDP GSO.
    ByTheDevice,
    /// This run (EINVAL): on Linux 6.1 a segment longer than the route's
    /// MTU (later kernels say EMSGSIZE) or more segments than the kernel
    /// takes. Other runs, to other peers, may pass.
    ThisRun,
}

/// What a failed GSO send's `e` says, if it refused the GSO send itself; a
/// connected socket's ENOPROTOOPT is its peer's ICMP protocol unreachable
/// (and the socket took a GSO send at calibration).
fn gso_refused(e: nix::errno::Errno, connected: bool) -> Option<GsoRefused> {
    use nix::errno::Errno as E;
    match e {
        E::ENOPROTOOPT if connected => None,
        E::EIO | E::ENOPROTOOPT => Some(GsoRefused::ByTheDevice),
        E::EINVAL => Some(GsoRefused::ThisRun),
        _ => None,
    }
}

/// The devices' clock: the TSC where it is invariant (10 ns a read here,
/// against 26 for `Instant`; every busy-poll look and transmit pass reads
/// it), else the monotonic clock. Calibrated once per process, at the first
/// device's opening (under a millisecond here).
fn device_clock() -> &'static quanta::Clock {
    static CLOCK: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}

/// The UDP length of a packet.
fn udp_len(t: &Transmit) -> usize {
    8 + t.len + t.payload_len + usize::from(t.pad) + icrc::LEN
}

/// How many packets from the first of `tx` go in one GSO send: RC packets
/// (UD ones each go to their own address) of the first's size, the last
/// possibly shorter, within the kernel's limits.
fn gso_run(gso: bool, tx: &[TxSlot]) -> usize {
    if !gso || tx[0].ah.is_some() {
        return 1;
    }
    let size = udp_len(&tx[0].t);
    let most = if tx[0].t.payload_len >= GSO_BULK_PAYLOAD {
        GSO_MAX_SEGMENTS_BULK
    } else {
        GSO_MAX_SEGMENTS
    };
    let iov_of = |s: &TxSlot| 2 + s.pieces.len();
    let (mut k, mut total, mut iov) = (1, size, iov_of(&tx[0]));
    while k < tx.len() && k < most && tx[k].ah.is_none() {
        let l = udp_len(&tx[k].t);
        if l > size || total + l - 8 > GSO_MAX_BYTES || iov + iov_of(&tx[k]) > MAX_IOV {
            break;
        }
        total += l - 8;
        iov += iov_of(&tx[k]);
        k += 1;
        if l < size {
            break;
        }
    }
    k
}

/// Writes the pad and ICRC of `s`, sent as the `ident`th datagram, into its
/// trailer.
fn seal(flow: &Ipv4Flow, s: &mut TxSlot, held: &HeldRegions, ident: u16) {
    let t = s.t;
    let mut crc = flow
        .icrc(ident, udp_len(&t) as u16, &s.buf[..t.len])
        .expect("headers from the engine start with a BTH");
    for p in &s.pieces {
        // SAFETY: the bytes are read once here, not kept; a concurrent remote
        // write into them makes the ICRC unspecified, as DMA from a changing
        // buffer would on a NIC.
        crc.update(unsafe { held.bytes(p) });
    }
    let pad = usize::from(t.pad);
    s.trailer[..pad].fill(0);
    crc.update(&s.trailer[..pad]);
    s.trailer[pad..pad + icrc::LEN].copy_from_slice(&crc.finish().to_le_bytes());
}

/// Appends the gather list of sealed `s`: headers, region pieces, trailer.
fn gather<'a>(
    s: &'a TxSlot,
    held: &'a HeldRegions,
    iov: &mut smallvec::SmallVec<[IoSlice<'a>; GSO_MAX_IOV]>,
) {
    iov.push(IoSlice::new(&s.buf[..s.t.len]));
    for p in &s.pieces {
        // SAFETY: the bytes go to the kernel in this send and are not kept; a
        // concurrent remote write into them makes what is sent unspecified,
        // as DMA from a changing buffer would on a NIC.
        iov.push(IoSlice::new(unsafe { held.bytes(p) }));
    }
    iov.push(IoSlice::new(&s.trailer[..usize::from(s.t.pad) + icrc::LEN]));
}

/// The flow of `ip` and these ports, from `cache` if it is the one there.
fn cached_flow(
    cache: &'static std::thread::LocalKey<Cell<Option<Ipv4Flow>>>,
    ip: Ipv4Pseudo,
    src_port: u16,
    dst_port: u16,
) -> Ipv4Flow {
    cache.with(|c| match c.get() {
        Some(f) if f.is(&ip, src_port, dst_port) => f,
        _ => {
            let f = Ipv4Flow::new(ip, src_port, dst_port);
            c.set(Some(f));
            f
        }
    })
}

/// The device socket a QP sends from unconnected: rxe's hash_32 of the
/// QPN (WIRE-NOTES 1.1) picks it.
fn socket_for(shared: &Shared, qpn: u32) -> usize {
    (qpn.wrapping_mul(0x61C8_8647) >> 18) as usize % shared.sockets.len()
}

/// Sends packets as one datagram each: with more than one, in one GSO send
/// (UDP_SEGMENT), which the kernel cuts into datagrams numbered from the
/// send's IP ID on (each ICRC covers its ID): from the QP's connected socket
/// `via` if given and able, else from the device's. Zero copy here:
/// headers, region memory and ICRCs go to the kernel as one gather list.
fn send_packets(
    shared: &Shared,
    peer: SocketAddrV4,
    tx: &mut [TxSlot],
    held: &HeldRegions,
    qpn: u32,
    via: Option<&mut connected::ConnectedSend>,
) {
    let gso = tx.len() > 1;
    // The caller makes a GSO run only where the QP's socket takes one.
    debug_assert!(!gso || via.as_ref().is_none_or(|c| c.takes_gso()));
    // From the QP's connected socket if it takes this send and knows the
    // ID it goes out with; else from the device's, unconnected (ID 0).
    let connected = match via {
        Some(c) => match c.next_ident() {
            Ok(id) => Some((c, id)),
            // Lost, as in a full socket buffer: sent from another port, the
            // packets could overtake those still queued on this one.
            Err(connected::NoIdent::Busy) => {
                shared
                    .stats
                    .send_errors
                    .fetch_add(tx.len() as u64, Ordering::Relaxed);
                return;
            }
            Err(connected::NoIdent::GaveUp) => None,
        },
        _ => None,
    };
    // The flow (the source port) and the IP ID of the send: unconnected,
    // from the device socket the QPN picks, with ID 0.
    let device_socket = socket_for(shared, qpn);
    let (flow, base) = match &connected {
        Some((c, id)) => (c.flow(), *id),
        None => {
            let ip = Ipv4Pseudo::df(*shared.local.ip(), *peer.ip());
            let port = shared.ports[device_socket];
            (cached_flow(&SEND_FLOW, ip, port, peer.port()), 0)
        }
    };
    let src_port = flow.src_port;
    let mut via = connected.map(|(c, _)| c);
    let ident = |k: usize| {
        if gso {
            base.wrapping_add(k as u16)
        } else {
            base
        }
    };
    for (k, s) in tx.iter_mut().enumerate() {
        seal(&flow, s, held, ident(k));
    }
    let sealed = &*tx;
    let mut iov = smallvec::SmallVec::<[IoSlice<'_>; GSO_MAX_IOV]>::new();
    for s in sealed {
        gather(s, held, &mut iov);
    }
    if let Some(pcap) = &shared.pcap {
        let mut w = pcap.lock().expect("pcap lock");
        for (k, s) in sealed.iter().enumerate() {
            // Each packet's own gather list, as it went into `iov`.
            let mut one = smallvec::SmallVec::<[IoSlice<'_>; GSO_MAX_IOV]>::new();
            gather(s, held, &mut one);
            let m = PacketMeta {
                src: SocketAddrV4::new(*shared.local.ip(), src_port),
                dst: peer,
                identification: ident(k),
                ttl: 64,
                tos: 0,
            };
            let parts: smallvec::SmallVec<[&[u8]; 8]> = one.iter().map(|s| &**s).collect();
            let _ = w.record(&m, &parts);
        }
    }
    let segment = gso.then(|| (udp_len(&tx[0].t) - 8) as u16);
    // A connected socket's sends name no address.
    let (socket, to) = match via.as_deref() {
        Some(c) => (c.socket(), None),
        None => (&shared.sockets[device_socket], Some(peer)),
    };
    let sent = send_datagram(socket.as_fd(), &iov, to, segment);
    // The gather list borrows `tx`, which the fallback below seals again.
    drop(iov);
    match sent {
        Ok(_) => {
            if let Some(c) = via {
                c.sent(tx.len());
            }
            shared
                .stats
                .sent
                .fetch_add(tx.len() as u64, Ordering::Relaxed);
            // Loaded first: a lock on every send costs the latency.
            if !shared.port_up.load(Ordering::Acquire) {
                shared.set_port(true);
            }
        }
        // A GSO send refused: its packets go one datagram each, and, if the
        // device can't take GSO sends at all, every run from now on.
        Err(e) if gso && let Some(refused) = gso_refused(e, via.is_some()) => {
            if refused == GsoRefused::ByTheDevice {
                shared.gso.store(false, Ordering::Relaxed);
            }
            if let Some(c) = via.as_deref_mut() {
                c.failed();
            }
            for s in tx {
                send_packets(
                    shared,
                    peer,
                    std::slice::from_mut(s),
                    held,
                    qpn,
                    via.as_deref_mut(),
                );
            }
        }
        Err(e) => {
            if let Some(c) = via {
                c.failed();
            }
            // A full socket buffer or an unreachable peer: the packets are
            // lost, and the transport retransmits as for any loss.
            shared
                .stats
                .send_errors
                .fetch_add(tx.len() as u64, Ordering::Relaxed);
            // The device's own address gone, or its network: the port is down.
            if matches!(
                e,
                nix::errno::Errno::EADDRNOTAVAIL | nix::errno::Errno::ENETDOWN
            ) {
                shared.set_port(false);
            }
        }
    }
}

/// The progress thread: receives, runs timers, sleeps in poll(2).
fn progress(shared: &Arc<Shared>) {
    let mut b = RxBuffers::new();
    let mut slots: Vec<Arc<QpSlot>> = Vec::new();
    // Consecutive looks that found a stream (see [`STREAM_GAP_NS`]).
    let mut stream_looks = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        #[cfg(test)]
        if shared.panic_next_pass.swap(false, Ordering::SeqCst) {
            panic!("the progress thread fails, as a test asked");
        }
        // Timers.
        let now = shared.now();
        let mut next = u64::MAX;
        slots.clear();
        slots.extend(shared.qps.read().expect("QP table lock").values().cloned());
        for slot in &slots {
            let due = {
                let mut qp = slot.engine.lock().expect("QP lock");
                match qp.poll_timeout() {
                    Some(t) if t <= now => {
                        qp.handle_timeout(now);
                        let mut signal = [false; 2];
                        drain_completions(&mut qp, slot, &shared.events, &mut signal);
                        drop(qp);
                        signal_cqs(slot, signal);
                        true
                    }
                    Some(t) => {
                        next = next.min(t.0);
                        false
                    }
                    None => false,
                }
            };
            if due && let Some(t) = transmit(shared, slot) {
                next = next.min(t.0);
            }
        }
        // Publish the deadline, then look at the timers once more: a poster
        // that armed one after the scan either sees this deadline (and wakes
        // us if it is earlier) or its timer is seen here.
        shared.sleep_until.store(next, Ordering::SeqCst);
        for slot in &slots {
            if let Some(t) = slot.engine.lock().expect("QP lock").poll_timeout() {
                next = next.min(t.0);
            }
        }
        // Not held while asleep: a QP dropped meanwhile lets go of its
        // CQs and regions at once (a caller's buffer comes back from
        // `Mr::deregister`).
        slots.clear();
        shared.sleep_until.store(next, Ordering::SeqCst);
        // Sleep until a datagram, a wake-up or the next timer. In busy-poll
        // mode, while an application thread polls, the sockets are its.
        let now = shared.now().0;
        let app_since = shared.app_polled.load(Ordering::Relaxed);
        let standby =
            shared.busy_poll.load(Ordering::Relaxed) && now.saturating_sub(app_since) < STANDBY_NS;
        shared.standing_by.store(standby, Ordering::SeqCst);
        if !standby {
            // No thread polls (any more, or busy-poll mode was turned off):
            // send what one deferred (see `poll_now`), which woke this
            // thread if it was not standing by.
            let deferred = std::mem::take(&mut shared.rx_lock.lock().deferred);
            for slot in &deferred {
                transmit_deferred(shared, slot);
            }
        }
        if standby {
            // The alarm fires once the polling threads stop pushing it back.
            shared.alarm_pushed.store(now, Ordering::Relaxed);
            shared.set_standby_alarm((app_since + STANDBY_NS).saturating_sub(now));
        }
        if !standby && shared.busy_poll() && shared.uplink.is_none() && b.spin(shared, next) {
            continue;
        }
        let timeout = (next != u64::MAX).then(|| Duration::from_nanos(next.saturating_sub(now)));
        let ts = timeout.map(timespec);
        // The wake-up, the standby alarm, the hostd uplink, then the sockets.
        // Standing by, the uplink and the sockets are left out: a waiter on a
        // socket, even one asking for no events, costs every datagram sent
        // to it a walk of its wait queue in the sender's system call (about
        // 0.1 µs of a busy-poll half round trip).
        const WAKE: usize = 0;
        const ALARM: usize = 1;
        const FIRST_SOCKET: usize = 3;
        // Standing by, the uplink is the polling threads' too.
        let uplink_open = !standby && !shared.uplink_lost.load(Ordering::Acquire);
        let mut fds: [PollFd; FIRST_SOCKET + SOCKETS] = std::array::from_fn(|i| match i {
            WAKE => PollFd::new(&shared.wake, PollFlags::IN),
            ALARM => PollFd::new(&shared.standby_alarm, PollFlags::IN),
            2 => match &shared.uplink {
                Some(u) if uplink_open => PollFd::new(u, PollFlags::IN),
                _ => PollFd::new(&shared.wake, PollFlags::empty()),
            },
            _ => PollFd::new(&shared.sockets[i - FIRST_SOCKET], PollFlags::IN),
        });
        let watched = if standby { FIRST_SOCKET } else { fds.len() };
        if rustix::event::poll(&mut fds[..watched], ts.as_ref()).is_err() {
            continue;
        }
        if !fds[WAKE].revents().is_empty() {
            // Read, then clear: a wake-up between the two leaves the flag
            // clear and its count in the eventfd (the next poll returns at
            // once). Cleared first, a wake-up in between had its count read
            // here and the flag left set, and wakers that see the flag set
            // (a polling thread's new timer) stayed silent while this
            // thread slept to its old deadline.
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&shared.wake, &mut b);
            shared.woken.store(false, Ordering::SeqCst);
        }
        if !fds[ALARM].revents().is_empty() {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&shared.standby_alarm, &mut b);
        }
        let readable: [bool; SOCKETS] =
            std::array::from_fn(|i| !fds[FIRST_SOCKET + i].revents().is_empty());
        // Everything that is there; in a stream (blocking mode), the next
        // datagrams without sleeping in between.
        if readable.iter().any(|&r| r) {
            let before = b.last_rx;
            if b.take_sockets(shared, &readable) {
                stream_looks = if b.last_rx.saturating_sub(before) < STREAM_GAP_NS {
                    stream_looks.saturating_add(1)
                } else {
                    0
                };
                if stream_looks >= STREAM_LOOKS && !shared.busy_poll() && shared.uplink.is_none() {
                    while b.spin_for(shared, next, STREAM_GAP_NS, false) {}
                }
            }
        }
        if let Some(uplink) = &shared.uplink
            && uplink_open
        {
            let mut receiving = shared.rx_lock.lock();
            take_uplink(shared, uplink, &mut receiving, &mut b.rx, RX_BUDGET, false);
        }
    }
}

/// Receives and handles up to `budget` datagrams the hostd forwarded, as
/// [`receive_datagram`] does (`defer` as there). Returns the packets
/// received. A closed uplink (the daemon is gone: nothing reaches the device
/// now) takes the port down for good.
fn take_uplink(
    shared: &Shared,
    uplink: &OwnedFd,
    receiving: &mut Receiving,
    rx: &mut [u8],
    budget: usize,
    defer: bool,
) -> u64 {
    let mut received = 0;
    for _ in 0..budget {
        match super::hostd::recv_forwarded(uplink, rx) {
            Ok(Some((n, meta))) => {
                received += receive_datagram(
                    shared,
                    receiving,
                    &rx[..n],
                    &meta,
                    shared.local.port(),
                    defer,
                    shared.now(),
                )
                .1;
            }
            Ok(None) => break,
            Err(_) => {
                shared.uplink_lost.store(true, Ordering::Release);
                shared.set_port(false);
                break;
            }
        }
    }
    received
}

/// The progress thread panicked (a bug): nothing moves the device's QPs on
/// any more. So that no application waits forever, every QP goes to ERR (its
/// work flushed to its CQs) and IBV_EVENT_DEVICE_FATAL is raised. Locks the
/// panic left poisoned are taken and cleared: the QPs they guard are in ERR,
/// where only flushes happen.
fn device_fatal(shared: &Shared) {
    shared.fatal.store(true, Ordering::Release);
    let slots: Vec<Arc<QpSlot>> = shared
        .qps
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .values()
        .cloned()
        .collect();
    shared.qps.clear_poison();
    shared.mrs.clear_poison();
    let to_error = crate::engine::qp::QpAttr {
        state: Some(crate::engine::qp::QpState::Err),
        ..Default::default()
    };
    for slot in slots {
        // A QP whose state the bug broke may panic again here: the others
        // are still failed, and the event still raised.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut qp = slot
                .engine
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slot.engine.clear_poison();
            if let Some((_, srq)) = &slot.srq {
                srq.clear_poison();
            }
            let _ = qp.modify(&to_error);
            let mut signal = [false; 2];
            drain_completions(&mut qp, &slot, &shared.events, &mut signal);
            drop(qp);
            signal_cqs(&slot, signal);
        }));
    }
    shared.set_port(false);
    shared.events.push(AsyncEvent::DeviceFatal);
}

/// Binds a UDP socket for RoCEv2 at `addr`; `ip_fields`: see
/// [`report_ip_fields`].
pub(crate) fn roce_socket(addr: SocketAddrV4, ip_fields: bool) -> io::Result<UdpSocket> {
    let sock = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    sock.set_recv_buffer_size(8 << 20)?;
    sock.set_send_buffer_size(8 << 20)?;
    sock.bind(&SocketAddr::V4(addr).into())?;
    // DF set, and (unconnected) the kernel writes IP ID 0, which the ICRC covers.
    sockopt::set_ip_mtu_discover(&sock, sockopt::Ipv4PathMtuDiscovery::DO)?;
    sock.set_nonblocking(true)?;
    let sock: UdpSocket = sock.into();
    if ip_fields {
        report_ip_fields(&sock)?;
    }
    Ok(sock)
}

/// Has `recvmsg` on `sock` report the TTL and TOS of what arrives (for the
/// GRH of UD receives and for captures). Not asked for otherwise: the two
/// control messages cost each receive about 0.3 µs.
fn report_ip_fields(sock: &UdpSocket) -> io::Result<()> {
    nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::Ipv4RecvTtl, &true)
        .map_err(io::Error::from)?;
    nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::IpRecvTos, &true)
        .map_err(io::Error::from)
}

/// Where a datagram came from, and its IP header's TTL and TOS.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RxMeta {
    pub from: SocketAddrV4,
    pub ttl: u8,
    pub tos: u8,
    /// UDP GRO: the datagram is several, each this long (the last may be
    /// shorter).
    pub gro_segment: Option<usize>,
}

/// The control message of a GSO send: the segment size (`UDP_SEGMENT`),
/// padded as `CMSG_SPACE` pads it.
#[repr(C, align(8))]
struct GsoSegment {
    header: libc::cmsghdr,
    size: u16,
}

// SAFETY: CMSG_SPACE and CMSG_LEN are arithmetic on their argument.
const _: () = unsafe {
    assert!(size_of::<GsoSegment>() == libc::CMSG_SPACE(2) as usize);
    assert!(std::mem::offset_of!(GsoSegment, size) == libc::CMSG_LEN(0) as usize);
};

/// Sends the gather list `iov` from UDP socket `fd` as one datagram (to
/// `to`, or the socket's peer), or with `gso_segment` as a GSO send the
/// kernel cuts into datagrams of that many bytes. The provider's RC and UD
/// sends go through it (and `roce_ceiling`'s, to send as they do).
///
/// The system call is made directly, as the provider's `recvmsg` is: nix's
/// `sendmsg` allocates its control-message buffer on every call, its
/// `sendmmsg` builds a message vector for the one datagram, and libc's
/// wrappers are thread-cancellation points.
#[doc(hidden)]
pub fn send_datagram(
    fd: std::os::fd::BorrowedFd<'_>,
    iov: &[IoSlice<'_>],
    to: Option<SocketAddrV4>,
    gso_segment: Option<u16>,
) -> Result<(), nix::errno::Errno> {
    // SAFETY: all-zero bytes are a valid `sockaddr_in`, `msghdr` and
    // `GsoSegment` (plain C structs of integers and pointers).
    let (mut addr, mut hdr, mut control): (libc::sockaddr_in, libc::msghdr, GsoSegment) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed(), std::mem::zeroed()) };
    if let Some(to) = to {
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_port = to.port().to_be();
        addr.sin_addr.s_addr = u32::from(*to.ip()).to_be();
        hdr.msg_name = (&raw mut addr).cast();
        hdr.msg_namelen = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    }
    // `IoSlice` is ABI-compatible with `iovec` (std guarantees it on Unix).
    hdr.msg_iov = iov.as_ptr().cast_mut().cast();
    hdr.msg_iovlen = iov.len() as _;
    if let Some(size) = gso_segment {
        control.header.cmsg_len = (std::mem::offset_of!(GsoSegment, size) + size_of::<u16>()) as _;
        control.header.cmsg_level = libc::SOL_UDP;
        control.header.cmsg_type = libc::UDP_SEGMENT;
        control.size = size;
        hdr.msg_control = (&raw mut control).cast();
        // CMSG_SPACE(2): the header and the value, padded to `size_t`.
        hdr.msg_controllen = size_of::<GsoSegment>() as _;
    }
    // SAFETY: `hdr` points at `addr`, at the `iov.len()` iovecs of `iov`
    // and at `control`, each live and as long as `hdr` says; the kernel only
    // reads them, and keeps no pointer past the call.
    let n = unsafe {
        socket_call(
            libc::SYS_sendmsg,
            fd.as_raw_fd(),
            (&raw const hdr).cast_mut(),
            0,
        )
    };
    if n < 0 {
        Err(nix::errno::Errno::from_raw(-n as i32))
    } else {
        Ok(())
    }
}

/// The system call `nr` (`sendmsg` or `recvmsg`) on socket `fd` with message
/// `msg` and `flags`; returns the kernel's answer (a count, or minus an
/// errno). On x86-64 the `syscall` instruction itself: libc's `syscall()`
/// (used elsewhere) moves seven arguments and stores errno, and every empty
/// busy-poll look meets EAGAIN.
///
/// # Safety
/// The arguments are valid for the call `nr`.
unsafe fn socket_call(
    nr: libc::c_long,
    fd: libc::c_int,
    msg: *mut libc::msghdr,
    flags: libc::c_int,
) -> isize {
    #[cfg(target_arch = "x86_64")]
    {
        let ret: isize;
        // SAFETY: the arguments are the caller's contract; `syscall` takes
        // the number in rax and the arguments in rdi, rsi and rdx, returns
        // in rax and overwrites rcx and r11; the kernel reads and writes
        // memory only through `msg` and the pointers in it (the asm may
        // touch memory: no `nomem`), and does not use our stack.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") nr as isize => ret,
                in("rdi") fd as isize,
                in("rsi") msg,
                in("rdx") flags as isize,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's contract.
        let n = unsafe { libc::syscall(nr, fd, msg, flags) };
        if n < 0 {
            -(nix::errno::Errno::last_raw() as isize)
        } else {
            n as isize
        }
    }
}

/// Receives one datagram from a socket made by [`roce_socket`]; `None` when
/// there is none.
///
/// The system call is made directly, not through libc's `recvmsg`: that
/// wrapper makes every call a thread-cancellation point, two calls around
/// the system call that took 8 % of a profile of two processes spinning on
/// empty sockets.
#[allow(
    clippy::unnecessary_cast,
    reason = "msghdr and cmsghdr lengths are size_t on glibc, socklen_t on musl"
)]
pub(crate) fn recv_datagram(
    socket: &UdpSocket,
    rx: &mut [u8],
    cmsg: &mut [u8],
) -> Option<(usize, RxMeta)> {
    // SAFETY: all-zero bytes are a valid `sockaddr_in` and `msghdr` (plain C
    // structs of integers and pointers).
    let (mut from, mut hdr): (libc::sockaddr_in, libc::msghdr) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    let mut iov = libc::iovec {
        iov_base: rx.as_mut_ptr().cast(),
        iov_len: rx.len(),
    };
    hdr.msg_name = (&raw mut from).cast();
    hdr.msg_namelen = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    hdr.msg_iov = &raw mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = cmsg.as_mut_ptr().cast();
    hdr.msg_controllen = cmsg.len() as _;
    // SAFETY: `hdr` points at `from`, at `iov` (over `rx`) and at `cmsg`,
    // each live, writable and as long as `hdr` says; the kernel writes
    // within those lengths and keeps no pointer past the call.
    let n = unsafe {
        socket_call(
            libc::SYS_recvmsg,
            socket.as_raw_fd(),
            &raw mut hdr,
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0
        || hdr.msg_namelen as usize != size_of::<libc::sockaddr_in>()
        || from.sin_family != libc::AF_INET as libc::sa_family_t
    {
        return None;
    }
    let from = SocketAddrV4::new(
        u32::from_be(from.sin_addr.s_addr).into(),
        u16::from_be(from.sin_port),
    );
    let (mut ttl, mut tos, mut gro_segment) = (64, 0, None);
    // The control messages the kernel wrote: `msg_controllen` is now their
    // length, within `cmsg`. Each header and value is read unaligned (a
    // `Vec<u8>` need not be aligned for `cmsghdr`).
    let control = &cmsg[..(hdr.msg_controllen as usize).min(cmsg.len())];
    let header_len = size_of::<libc::cmsghdr>();
    let mut at = 0;
    while control.len() >= at + header_len {
        // SAFETY: `header_len` bytes from `at` are within `control`.
        let c: libc::cmsghdr = unsafe {
            control
                .as_ptr()
                .add(at)
                .cast::<libc::cmsghdr>()
                .read_unaligned()
        };
        let Some(data) = at
            .checked_add(c.cmsg_len as usize)
            .and_then(|end| control.get(at + header_len..end))
        else {
            break;
        };
        let int = |d: &[u8]| d.first_chunk().map(|b| i32::from_ne_bytes(*b));
        match (c.cmsg_level, c.cmsg_type) {
            (libc::IPPROTO_IP, libc::IP_TTL) => ttl = int(data).map_or(ttl, |t| t as u8),
            (libc::IPPROTO_IP, libc::IP_TOS) => tos = data.first().copied().unwrap_or(tos),
            (libc::SOL_UDP, libc::UDP_GRO) => {
                gro_segment = int(data).filter(|&g| g > 0).map(|g| g as usize)
            }
            _ => {}
        }
        // Each message starts aligned to `size_t`.
        at += (c.cmsg_len as usize)
            .max(header_len)
            .next_multiple_of(size_of::<usize>());
    }
    Some((
        n as usize,
        RxMeta {
            from,
            ttl,
            tos,
            gro_segment,
        },
    ))
}

/// A datagram (with UDP GRO, several packets of one segment size) received
/// at `now` (one time for its packets: they arrived together): each packet
/// to its QP, then each QP it reached sends what it has (ACKs coalesce over
/// the datagram) — unless `defer`, when the QPs are left in
/// `receiving.touched` for the caller to transmit later. Returns whether a QP
/// it reached holds a GSO send's worth of responses (see
/// [`RxBuffers::drain_sockets`]), and how many packets it held.
fn receive_datagram(
    shared: &Shared,
    receiving: &mut Receiving,
    datagram: &[u8],
    rx: &RxMeta,
    dst_port: u16,
    defer: bool,
    now: Time,
) -> (bool, u64) {
    let segment = rx.gro_segment.unwrap_or(datagram.len()).max(1);
    let count = datagram.len().div_ceil(segment);
    // Only the holder of the receive lock (`receiving`) counts here: a load
    // and a store, not a read-modify-write.
    let received = &shared.stats.received;
    received.store(
        received.load(Ordering::Relaxed) + count as u64,
        Ordering::Relaxed,
    );
    // Consecutive packets for one QP (a GRO datagram's come from one GSO
    // send, so from one QP to one QP) are handled under one hold of its
    // lock: one look-up, one lock and one completion drain a run, not a
    // packet.
    let mut run = Run::new();
    let mut run_slot: Option<Arc<QpSlot>> = None;
    let mut holding = false;
    for packet in datagram.chunks(segment) {
        let Some((dest_qp, ident)) = check_packet(shared, packet, rx, dst_port) else {
            continue;
        };
        if let Some(slot) = run_slot.take_if(|s| s.qpn != dest_qp) {
            holding |= deliver(shared, slot, &mut run, rx, now, &mut receiving.touched);
        }
        if dest_qp == gsi::GSI_QPN {
            answer_gsi(shared, packet, rx.from);
            continue;
        }
        if run_slot.is_none() {
            run_slot = qp_for(shared, receiving, dest_qp, rx.from);
            if run_slot.is_none() {
                continue;
            }
        }
        run.push((packet, ident));
    }
    if let Some(slot) = run_slot {
        holding |= deliver(shared, slot, &mut run, rx, now, &mut receiving.touched);
    }
    if !defer {
        for slot in receiving.touched.drain(..) {
            transmit(shared, &slot);
        }
    }
    (holding, count as u64)
}

/// Checked packets for one QP, each with the IP ID it came under.
type Run<'a> = smallvec::SmallVec<[(&'a [u8], u16); GSO_MAX_SEGMENTS_BULK]>;

/// Checks a packet: its ICRC (solving the IP ID
/// it came under) and its BTH. Returns the QP number it is for and the ID.
fn check_packet(shared: &Shared, packet: &[u8], rx: &RxMeta, dst_port: u16) -> Option<(u32, u16)> {
    let from = rx.from;
    let ip = Ipv4Pseudo::df(*from.ip(), *shared.local.ip());
    let flow = cached_flow(&RECV_FLOW, ip, from.port(), dst_port);
    // The ID the packet came under, which the socket does not show: 0 or k
    // (the kth segment of a GSO send) from an unconnected softrdma socket,
    // a count from a connected one or from rxe. One pass over the packet
    // gives the ICRC's difference from ID 0's, which gives the ID.
    let ident = ID_MAPS.with_borrow_mut(|maps| maps.identify(&flow, packet));
    if let Some(pcap) = &shared.pcap {
        let m = PacketMeta {
            src: from,
            dst: SocketAddrV4::new(*shared.local.ip(), dst_port),
            identification: ident.unwrap_or(0),
            ttl: rx.ttl,
            tos: rx.tos,
        };
        let _ = pcap.lock().expect("pcap lock").record(&m, &[packet]);
    }
    let Some(ident) = ident else {
        shared.stats.bad_icrc.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    let Ok(h) = bth::Header::new_checked(packet) else {
        shared.stats.no_qp.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    // As rxe: transport version 0, and the default partition (either
    // membership) only.
    if h.transport_version() != bth::TRANSPORT_VERSION
        || h.pkey() & 0x7fff != bth::DEFAULT_PKEY & 0x7fff
    {
        shared.stats.bad_header.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    Some((h.dest_qp(), ident))
}

/// The UDP port RoCEv2 peers receive on.
const ROCE_PORT: u16 = 4791;

/// A packet for QP 1 (its ICRC checked): a CM message goes to the GSI's
/// bookkeeping, which may answer it (a REQ no listener takes gets a REJ, a
/// DREQ its DREP, sent to the peer's RoCEv2 port) and may end a
/// connection; anything else is dropped.
fn answer_gsi(shared: &Shared, packet: &[u8], from: SocketAddrV4) {
    let Some(mad) = gsi::gsi_mad(packet) else {
        shared.stats.no_qp.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let out = shared.gsi.dispatch(*from.ip(), mad);
    if let Some(reply) = out.reply {
        if out.refused {
            shared.stats.cm_rejects.fetch_add(1, Ordering::Relaxed);
        }
        if send_mad(shared, *from.ip(), &reply).is_err() {
            shared.stats.send_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Some(qpn) = out.disconnected_qp {
        qp_to_error(shared, qpn);
    }
}

/// Sends a MAD to QP 1 of the device at `to` (its RoCEv2 port, 4791).
pub(crate) fn send_mad(shared: &Shared, to: Ipv4Addr, mad: &[u8; MAD_LEN]) -> io::Result<()> {
    let mut packet = [0u8; gsi::MAD_PACKET_LEN];
    gsi::mad_packet(mad, shared.gsi.next_psn(), &mut packet)
        .ok_or_else(|| io::Error::other("a MAD packet that does not build"))?;
    let sock = socket_for(shared, gsi::GSI_QPN);
    let local = SocketAddrV4::new(*shared.local.ip(), shared.ports[sock]);
    let to = SocketAddrV4::new(to, ROCE_PORT);
    seal_gsi(local, to, &mut packet).ok_or_else(|| io::Error::other("no ICRC"))?;
    if let Some(pcap) = &shared.pcap {
        let m = PacketMeta {
            src: local,
            dst: to,
            identification: 0,
            ttl: 64,
            tos: 0,
        };
        let _ = pcap.lock().expect("pcap lock").record(&m, &[&packet[..]]);
    }
    shared.sockets[sock].send_to(&packet, to).map(drop)
}

/// Moves QP `qpn` to the error state (its peer disconnected), flushing its
/// work to its CQs.
fn qp_to_error(shared: &Shared, qpn: u32) {
    let Some(slot) = shared.qps.read().expect("QP table lock").get(&qpn).cloned() else {
        return;
    };
    let to_error = QpAttr {
        state: Some(QpState::Err),
        ..QpAttr::default()
    };
    let _ = slot.engine.lock().expect("QP lock").modify(&to_error);
    transmit(shared, &slot);
}

/// Sends the refusal for `packet` (BTH through ICRC, its ICRC checked) from
/// `sock`, bound to `local`, to `from`'s RoCEv2 port, if `packet` is a CM
/// REQ or SIDR_REQ for QP 1 (as if nothing listened): `Some(sent)`; `None`
/// for anything else.
pub(crate) fn send_cm_refusal(
    sock: &UdpSocket,
    local: SocketAddrV4,
    packet: &[u8],
    from: SocketAddrV4,
) -> Option<bool> {
    let mut rej = [0u8; gsi::MAD_PACKET_LEN];
    gsi::refuse_request(packet, &mut rej)?;
    let to = SocketAddrV4::new(*from.ip(), ROCE_PORT);
    seal_gsi(local, to, &mut rej)?;
    Some(sock.send_to(&rej, to).is_ok())
}

/// Fills the ICRC of a GSI packet (BTH to ICRC) sent from `local` to `to`'s
/// RoCEv2 port.
fn seal_gsi(local: SocketAddrV4, to: SocketAddrV4, packet: &mut [u8]) -> Option<()> {
    let udp_len = (8 + packet.len()) as u16;
    let ip = Ipv4Pseudo::df(*local.ip(), *to.ip());
    let udp = icrc::udp_header(local.port(), ROCE_PORT, udp_len);
    icrc::fill(&ip.header(udp_len), &udp, packet).ok().map(drop)
}

/// The QP `qpn` names, if it takes packets from `from`.
fn qp_for(
    shared: &Shared,
    receiving: &mut Receiving,
    qpn: u32,
    from: SocketAddrV4,
) -> Option<Arc<QpSlot>> {
    let Some(slot) = receiving.qp(shared, qpn) else {
        shared.stats.no_qp.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    // As rxe: an RC QP takes packets only from its peer's address.
    if let Some(peer) = slot.peer()
        && peer.ip() != from.ip()
    {
        shared.stats.wrong_source.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    Some(slot)
}

/// Hands checked packets to their QP, received at `now`, and notes the QP
/// in `touched`. Returns whether the QP then holds a GSO send's worth of
/// responses (read under the lock the packets took).
fn deliver(
    shared: &Shared,
    slot: Arc<QpSlot>,
    run: &mut Run<'_>,
    rx: &RxMeta,
    now: Time,
    touched: &mut Vec<Arc<QpSlot>>,
) -> bool {
    let mut signal = [false; 2];
    let holding = {
        let mrs = shared.mrs.read().expect("MR table lock");
        let mut qp = slot.engine.lock().expect("QP lock");
        for (packet, ident) in run.drain(..) {
            let meta = RecvMeta::V4 {
                src: rx.from.ip().octets(),
                dst: shared.local.ip().octets(),
                tos: rx.tos,
                ttl: rx.ttl,
                identification: ident,
            };
            qp.handle_packet(now, packet, &meta, &mrs);
        }
        slot.answers_pending.store(true, Ordering::Relaxed);
        drain_completions(&mut qp, &slot, &shared.events, &mut signal);
        qp.responses_queued() >= GSO_MAX_SEGMENTS as u32
    };
    signal_cqs(&slot, signal);
    if !touched.iter().any(|t| Arc::ptr_eq(t, &slot)) {
        touched.push(slot);
    }
    holding
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Access, MrTable, PieceSink, Region, RegionMemory};
    use std::time::Instant;

    /// `send_datagram`'s three shapes, seen by a receiver without GRO: a GSO
    /// send cut at its segment size (unconnected, to an address; connected,
    /// to the peer), a plain datagram, and a send the kernel refuses.
    #[test]
    fn a_gso_send_arrives_cut_at_its_segment_size() {
        let rx = UdpSocket::bind("127.0.0.97:0").unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let SocketAddr::V4(to) = rx.local_addr().unwrap() else {
            unreachable!()
        };
        let unconnected = UdpSocket::bind("127.0.0.98:0").unwrap();
        let connected = UdpSocket::bind("127.0.0.98:0").unwrap();
        connected.connect(to).unwrap();
        let payload: Vec<u8> = (0..250u32).map(|i| i as u8).collect();
        let (head, tail) = payload.split_at(30);
        let iov = [IoSlice::new(head), IoSlice::new(tail)];
        let mut buf = [0u8; 512];
        for (socket, dest) in [(&unconnected, Some(to)), (&connected, None)] {
            send_datagram(socket.as_fd(), &iov, dest, Some(100)).unwrap();
            for part in payload.chunks(100) {
                let (n, _) = rx.recv_from(&mut buf).unwrap();
                assert_eq!(&buf[..n], part);
            }
            send_datagram(socket.as_fd(), &iov, dest, None).unwrap();
            let (n, _) = rx.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], &payload[..]);
        }
        // 250 segments of one byte: more than a GSO send may hold. The
        // kernel refuses the run, not GSO.
        let refused = send_datagram(connected.as_fd(), &iov, None, Some(1));
        assert_eq!(refused, Err(nix::errno::Errno::EINVAL));
        assert_eq!(
            gso_refused(refused.unwrap_err(), true),
            Some(GsoRefused::ThisRun)
        );
    }

    /// Which refusals of a GSO send turn GSO off for the device: only those
    /// that say it can't do GSO at all, not a run the kernel would not take,
    /// nor a connected socket's pending ICMP protocol unreachable, nor
    /// errors that are not about GSO.
    #[test]
    fn only_a_device_without_gso_turns_gso_off() {
        use nix::errno::Errno as E;
        for connected in [false, true] {
            assert_eq!(
                gso_refused(E::EIO, connected),
                Some(GsoRefused::ByTheDevice)
            );
            assert_eq!(gso_refused(E::EINVAL, connected), Some(GsoRefused::ThisRun));
            for e in [
                E::EAGAIN,
                E::ENOBUFS,
                E::EMSGSIZE,
                E::ECONNREFUSED,
                E::EPERM,
            ] {
                assert_eq!(gso_refused(e, connected), None, "{e}");
            }
        }
        assert_eq!(
            gso_refused(E::ENOPROTOOPT, false),
            Some(GsoRefused::ByTheDevice)
        );
        assert_eq!(gso_refused(E::ENOPROTOOPT, true), None);
    }

    /// Packets of these payload lengths, each from `pieces` region pieces.
    fn packets(payloads: &[usize], pieces: usize) -> Vec<TxSlot> {
        let mut mrs = MrTable::new();
        let mem = Arc::new(RegionMemory::from_vec(vec![0u8; 4096]));
        mrs.insert(Region::new(1, (1, 2), mem, 0, 4096, 0x1000, Access::REMOTE_READ).unwrap());
        let seg = mrs.remote(1, 2, 0x1000, 1, Access::REMOTE_READ).unwrap();
        let mut held = HeldRegions::default();
        let mut piece = Vec::new();
        held.sink(&mut piece).push_range(&seg, 0, 1);
        payloads
            .iter()
            .map(|&payload_len| TxSlot {
                buf: vec![0u8; 12],
                pieces: vec![piece[0]; pieces],
                t: Transmit {
                    len: 12,
                    payload_len,
                    pad: 0,
                },
                trailer: [0; 7],
                ah: None,
            })
            .collect()
    }

    /// A device's time goes on when its counter goes back (a TSC reset by a
    /// suspend): from the monotonic clock's, onwards, and never to 0, where
    /// it would stop every timer.
    #[test]
    fn the_clock_goes_on_when_its_counter_goes_back() {
        let dev = UdpDevice::open("127.0.0.2:0".parse().unwrap(), false, false, None).unwrap();
        let shared = &dev.shared;
        std::thread::sleep(Duration::from_millis(20));
        let before = shared.now();
        assert!(before >= Time(20_000_000), "{before:?}");
        // The counter as if it had been far ahead at the start.
        shared.epoch.store(u64::MAX, Ordering::Release);
        let after = shared.now();
        // From the monotonic clock, which may run a little behind the
        // counter's reading (they drift apart), never far.
        assert!(
            after.0 + 1_000_000 >= before.0,
            "{after:?} after {before:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
        let later = shared.now();
        assert!(
            later >= Time(after.0 + 5_000_000),
            "{later:?} after {after:?}"
        );
    }

    /// The turn's states, one step at a time: a thread that finds another
    /// at it gets a second pass out of it, and the turn is free after.
    #[test]
    fn the_transmit_turn_gives_a_pass_to_whoever_asks() {
        let turn = TransmitTurn::default();
        assert!(turn.enter(), "a free turn is taken");
        assert!(turn.leave(), "no one asked: one pass");
        assert!(turn.enter(), "left free");
        assert!(!turn.enter(), "held: the asker leaves it to the holder");
        assert!(!turn.enter(), "asked twice, still one more pass");
        assert!(!turn.leave(), "asked: another pass");
        assert!(turn.leave(), "then done");
        assert_eq!(turn.0.load(Ordering::Relaxed), 0);
    }

    /// Rounds in which threads each queue an item and try for the turn to
    /// transmit, as posts do, then wait until every item of the round has
    /// been taken: a pass asked for and never made strands an item, with no
    /// thread left to take it.
    #[test]
    fn the_transmit_turn_loses_no_work() {
        use std::sync::atomic::AtomicUsize;
        const THREADS: usize = 4;
        const ROUNDS: usize = 20_000;
        let turn = TransmitTurn::default();
        let pending: [AtomicBool; THREADS] = Default::default();
        let (taken, arrived) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let stranded = AtomicUsize::new(usize::MAX);
        // Waits until `done`; false (noting the round) after 5 s or once
        // another thread gave up.
        let wait = |round: usize, done: &dyn Fn() -> bool| {
            let until = Instant::now() + Duration::from_secs(5);
            while !done() {
                if stranded.load(Ordering::Relaxed) != usize::MAX || Instant::now() > until {
                    stranded.fetch_min(round, Ordering::Relaxed);
                    return false;
                }
                std::thread::yield_now();
            }
            true
        };
        std::thread::scope(|s| {
            for me in 0..THREADS {
                let (turn, pending, taken, arrived, wait) =
                    (&turn, &pending, &taken, &arrived, &wait);
                s.spawn(move || {
                    for round in 0..ROUNDS {
                        pending[me].store(true, Ordering::Release);
                        if turn.enter() {
                            loop {
                                for p in pending {
                                    if p.swap(false, Ordering::AcqRel) {
                                        taken.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                                if turn.leave() {
                                    break;
                                }
                            }
                        }
                        let all_taken = || !pending.iter().any(|p| p.load(Ordering::Acquire));
                        arrived.fetch_add(1, Ordering::AcqRel);
                        let all_here = || arrived.load(Ordering::Acquire) >= THREADS * (round + 1);
                        if !wait(round, &all_taken) || !wait(round, &all_here) {
                            return;
                        }
                    }
                });
            }
        });
        let stranded = stranded.load(Ordering::Relaxed);
        assert_eq!(
            stranded,
            usize::MAX,
            "round {stranded}: an item was never taken"
        );
        assert_eq!(taken.load(Ordering::Relaxed), THREADS * ROUNDS);
        assert_eq!(turn.0.load(Ordering::Relaxed), 0, "the turn is left held");
    }

    #[test]
    fn gso_sends_hold_as_many_packets_as_the_kernel_takes() {
        // 1 KiB payloads: 62 of 12 + 1024 + 4 bytes fit in 65 507.
        assert_eq!(gso_run(true, &packets(&[1024; 100], 1)), 62);
        // 4 KiB: 15. Small packets: 16, for the message rate.
        assert_eq!(gso_run(true, &packets(&[4096; 100], 1)), 15);
        assert_eq!(gso_run(true, &packets(&[8; 100], 1)), 16);
        // Thirty pieces a packet: 32 gather entries each, 1024 in a send.
        assert_eq!(gso_run(true, &packets(&[1024; 100], 30)), 32);
        // A shorter packet ends a send, a longer one starts the next.
        assert_eq!(
            gso_run(true, &packets(&[1024, 1024, 1024, 512, 1024], 1)),
            4
        );
        assert_eq!(gso_run(true, &packets(&[1024, 2048], 1)), 1);
        // Without GSO, or for UD, one packet a datagram.
        assert_eq!(gso_run(false, &packets(&[1024; 10], 1)), 1);
        let mut ud = packets(&[1024; 10], 1);
        ud[0].ah = Some(AhId(3));
        assert_eq!(gso_run(true, &ud), 1);
    }
}
