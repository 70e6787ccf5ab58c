//! iWARP over TCP: one TCP connection per QP, established by `cm::mpa`.
//!
//! A receive thread per connection reads each FPDU's length and DDP header,
//! asks the engine where the payload goes, and reads the payload from the
//! socket straight into the region, with the pad, CRC and the start of the
//! next FPDU in the same `readv`. A transmit thread per connection writes
//! FPDUs with gather I/O from the region, many per gather write (`sendmsg`). Two threads, so
//! that receiving never waits for a blocked send: a peer that is itself
//! blocked sending to us is always drained. In busy-poll mode an application
//! thread polling a CQ of the device receives small FPDUs itself, and the
//! receive thread stands by meanwhile (see `poll_now`).
//!
//! Copies of payload bytes (the design's budget): none on send, none on
//! receive (READ Requests and Terminates, small control messages, are read
//! into a buffer).

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softrdma_wire::ddp;
use softrdma_wire::mpa::{self, Crc32c};

use crate::engine::iwarp::{IwarpQp, MAX_HEADER_LEN, Placement, Transmit};
use crate::engine::srq::Srq;
use crate::engine::{MAX_INLINE_DATA, PostError, QpEvent, QpState, RecvWr, SendWr};
use crate::memory::{Access, MrTable, Segment};
use crate::verbs::cq::CqInner;
use crate::verbs::events::{AsyncEvent, EventQueue};

/// Most region pieces an FPDU's payload spans.
const MAX_PIECES: usize = 32;

/// The largest ULPDU that keeps an FPDU (length, ULPDU, pad, CRC) within one
/// TCP segment, as siw does (MSS 1448: 1442).
pub(crate) fn max_ulpdu_for(stream: &TcpStream) -> usize {
    let mss = socket2::SockRef::from(stream)
        .tcp_mss()
        .map_or(1448, |m| m as usize)
        .clamp(128, 65535);
    let room = mss - mpa::LENGTH_FIELD_LEN - mpa::CRC_LEN;
    // Pad rounds the length field and ULPDU up to 4 bytes.
    room - (room + mpa::LENGTH_FIELD_LEN) % 4
}

#[derive(Debug)]
struct Shared {
    engine: Mutex<IwarpQp>,
    mrs: Arc<RwLock<MrTable>>,
    stream: TcpStream,
    crc: bool,
    /// Busy-poll mode (the device's flag): see [`spin_for_bytes`].
    busy_poll: Arc<AtomicBool>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    events: Arc<EventQueue>,
    srq: Option<(u64, Arc<Mutex<Srq>>)>,
    /// The QP was destroyed: its flushes still reach the CQs, its events
    /// (a last WQE) no longer name it.
    destroyed: AtomicBool,
    /// Whichever thread sends holds this: the transmit thread, a poster
    /// sending its lone small work request itself, or a receiving thread
    /// answering a lone small READ.
    tx: Mutex<Tx>,
    /// When a send last finished (ns from `epoch`): a post that comes soon
    /// after one leaves batching to the transmit thread.
    last_sent: AtomicU64,
    /// When this side ended its half of the stream after a Terminate or a
    /// local error (ns from `epoch`, 0: not), and whether it then ended the
    /// connection (see [`LINGER`]).
    write_ended: AtomicU64,
    lingered: AtomicBool,
    epoch: Instant,
    /// The transmit thread's wake-up.
    tx_wake: Condvar,
    tx_pending: Mutex<TxPending>,
    closed: AtomicBool,
    /// The receive side, held by whichever thread reads the stream.
    rx: Mutex<RxState>,
    /// When an application thread last polled (ns from `epoch`; busy-poll
    /// mode): the receive thread stands by until [`STANDBY`] after it.
    app_polled: AtomicU64,
    rx_standby: Condvar,
    rx_standby_lock: Mutex<()>,
    /// Until when (ns from `epoch`) the receive thread receives even while
    /// applications poll: it took over an FPDU too large for a poll.
    rx_active_until: AtomicU64,
    /// Application threads sleeping in a CQ wait (busy-poll mode): the
    /// receive thread does not stand by meanwhile.
    app_asleep: AtomicU64,
    /// When an application thread last went to or came from such a sleep.
    app_slept: AtomicU64,
    /// The receive thread is standing by (its wakers' cue).
    standing_by: AtomicBool,
    /// A send is writing a large batch (busy-poll mode: pollers give it the
    /// CPU; see [`LARGE_WRITE`]).
    transmitting: AtomicBool,
    /// FPDUs application threads' polls received.
    polled_fpdus: AtomicU64,
    /// Bytes a receiving thread's answer left to the transmit thread (the
    /// socket did not take them at once).
    deferred_bytes: AtomicU64,
    /// The largest FPDU a poll receives: at most a quarter of the socket's
    /// receive buffer, which then always holds it whole, and at most
    /// [`POLL_FPDU_MAX`] (larger ones are the receive thread's).
    poll_fpdu_max: usize,
    /// Tests: the receive thread panics at its next FPDU, the transmit
    /// thread at its next pass.
    #[cfg(test)]
    panic_in_rx: AtomicBool,
    #[cfg(test)]
    panic_in_tx: AtomicBool,
}

/// What receiving keeps between FPDUs.
#[derive(Debug, Default)]
struct RxState {
    control: Vec<u8>,
    pieces: Vec<Segment>,
    ahead: Lookahead,
    /// The stream ended (or failed): nobody reads it again.
    done: bool,
}

/// How long, after this side ends its half of the stream (a Terminate or a
/// local error), it reads on for the peer to close its half before it ends
/// the connection itself (siw ends it at once; a peer that never closes
/// must not keep the receive thread and the socket for the QP's life).
const LINGER: Duration = Duration::from_secs(1);

/// How long after an application thread's last poll the receive thread
/// stays in standby (RoCEv2's span too): an application that stops polling
/// leaves its FPDUs to the receive thread this long after.
const STANDBY: Duration = Duration::from_millis(10);

/// How long application threads must have polled without sleeping in a CQ
/// wait before the receive thread stands by: one that sleeps between polls
/// (a bandwidth test reaping completions) keeps it receiving.
const POLLING_ONLY: Duration = Duration::from_micros(200);

/// How a connection runs.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnOptions {
    /// MPA CRC32c on every FPDU (negotiated).
    pub crc: bool,
    /// Busy-poll mode, shared with the device (it may change at any time).
    pub busy_poll: Arc<AtomicBool>,
    /// The device's connections, which polls of its CQs work for.
    pub connections: Option<Arc<Connections>>,
    /// How long the peer may leave what was sent unacknowledged (or its
    /// window shut, or keepalives unanswered) before the QP fails: RC's
    /// retries running out, where TCP's own would take some 15 minutes.
    pub peer_timeout: Duration,
    /// The SRQ the engine takes receives from, and its number, for its
    /// limit event.
    pub srq: Option<(u64, Arc<Mutex<Srq>>)>,
}

/// [`ConnOptions::peer_timeout`] of the verbs' iWARP QPs.
pub(crate) const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Sets the socket's peer timeout (TCP_USER_TIMEOUT) and keepalives, which
/// probe an idle connection: a READ then waits no longer than the timeout
/// for a peer that vanished after taking its request.
fn watch_peer(sock: &socket2::SockRef<'_>, timeout: Duration) -> io::Result<()> {
    sock.set_tcp_user_timeout(Some(timeout))?;
    let idle = (timeout / 3).max(Duration::from_secs(1));
    sock.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval((idle / 2).max(Duration::from_secs(1)))
            .with_retries(4),
    )
}

/// An application thread asleep in a CQ wait (see [`Connections::app_sleeps`]).
pub(crate) struct AppAsleep(smallvec::SmallVec<[Arc<Shared>; 4]>);

impl Drop for AppAsleep {
    fn drop(&mut self) {
        for c in &self.0 {
            c.app_slept.store(c.now(), Ordering::SeqCst);
            c.app_asleep.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// An iWARP device's connections: in busy-poll mode, a thread polling any
/// of the device's CQs receives for them (as a RoCEv2 device's pollers
/// receive on its sockets), so that a thread polling for one QP (perftest's
/// control QP) does not leave another's to a second spinning thread.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    list: spin::mutex::SpinMutex<Vec<std::sync::Weak<Shared>>, spin::relax::Yield>,
}

impl Connections {
    fn add(&self, c: &Arc<Shared>) {
        let mut list = self.list.lock();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(c));
    }

    /// The connections not yet dropped.
    fn live(&self) -> smallvec::SmallVec<[Arc<Shared>; 4]> {
        self.list
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }

    /// An application thread goes to sleep in a CQ wait: until the guard
    /// drops, the receive threads receive (busy-poll mode).
    pub(crate) fn app_sleeps(&self) -> AppAsleep {
        let live = self.live();
        for c in &live {
            c.app_asleep.fetch_add(1, Ordering::SeqCst);
            c.app_slept.store(c.now(), Ordering::SeqCst);
            if c.standing_by.load(Ordering::SeqCst) {
                c.wake_receiver();
            }
        }
        AppAsleep(live)
    }

    /// Busy-poll mode was turned off: receive threads standing by for
    /// polling threads go back to their sockets now (not when their standby
    /// runs out).
    pub(crate) fn busy_poll_ended(&self) {
        for c in &self.live() {
            if c.standing_by.load(Ordering::SeqCst) {
                c.wake_receiver();
            }
        }
    }

    /// One busy-poll look at every connection (see [`poll_now`]). While a
    /// receive thread streams large FPDUs, or a transmit thread sends, the
    /// polling thread gives the CPU away between looks (two CPUs, three
    /// spinning threads otherwise).
    pub(crate) fn poll(&self) {
        let live = self.live();
        let mut streaming = false;
        for c in &live {
            streaming |= poll_now(c) | c.transmitting.load(Ordering::Relaxed);
        }
        if streaming {
            std::thread::yield_now();
        }
    }
}

/// An iWARP QP on its connection.
#[derive(Debug)]
pub(crate) struct TcpQp {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl TcpQp {
    /// Starts the QP's threads on an established connection (MPA done).
    pub fn start(
        stream: TcpStream,
        engine: IwarpQp,
        mrs: Arc<RwLock<MrTable>>,
        options: ConnOptions,
        send_cq: Arc<CqInner>,
        recv_cq: Arc<CqInner>,
        events: Arc<EventQueue>,
    ) -> io::Result<TcpQp> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(None)?;
        // Busy-poll mode: a receive buffer that holds the largest FPDUs whole
        // lets polling threads receive them (see `poll_now`). The kernel caps
        // it (net.core.rmem_max); the size it took decides.
        let sock = socket2::SockRef::from(&stream);
        watch_peer(&sock, options.peer_timeout)?;
        if options.busy_poll.load(Ordering::Relaxed) {
            let _ = sock.set_recv_buffer_size(POLL_RCVBUF);
        }
        let poll_fpdu_max = (sock.recv_buffer_size().unwrap_or(0) / 4).min(POLL_FPDU_MAX);
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            mrs,
            stream,
            crc: options.crc,
            busy_poll: options.busy_poll,
            send_cq,
            recv_cq,
            events,
            srq: options.srq,
            destroyed: AtomicBool::new(false),
            tx: Mutex::new(Tx {
                batch: (0..TX_BATCH).map(|_| TxFpdu::new()).collect(),
                leftover: Vec::new(),
            }),
            last_sent: AtomicU64::new(0),
            write_ended: AtomicU64::new(0),
            lingered: AtomicBool::new(false),
            epoch: Instant::now(),
            tx_wake: Condvar::new(),
            tx_pending: Mutex::new(TxPending::default()),
            closed: AtomicBool::new(false),
            rx: Mutex::new(RxState::default()),
            app_polled: AtomicU64::new(0),
            rx_standby: Condvar::new(),
            rx_standby_lock: Mutex::new(()),
            rx_active_until: AtomicU64::new(0),
            app_asleep: AtomicU64::new(0),
            app_slept: AtomicU64::new(0),
            standing_by: AtomicBool::new(false),
            transmitting: AtomicBool::new(false),
            polled_fpdus: AtomicU64::new(0),
            deferred_bytes: AtomicU64::new(0),
            poll_fpdu_max,
            #[cfg(test)]
            panic_in_rx: AtomicBool::new(false),
            #[cfg(test)]
            panic_in_tx: AtomicBool::new(false),
        });
        // Busy-poll mode: the pollers of the device's CQs work for it.
        if let Some(c) = &options.connections {
            c.add(&shared);
        }
        let (a, b) = (shared.clone(), shared.clone());
        let rx = std::thread::Builder::new()
            .name("softrdma-iwarp-rx".into())
            .spawn(move || contained(&a, receive_loop))?;
        let tx = match std::thread::Builder::new()
            .name(TX_NAME.into())
            .spawn(move || contained(&b, transmit_loop))
        {
            Ok(t) => t,
            Err(e) => {
                // The receive thread must not go on placing the peer's data.
                shared.close();
                let _ = shared.stream.shutdown(Shutdown::Both);
                let _ = rx.join();
                return Err(e);
            }
        };
        // A peer-to-peer initiator's RTR message goes first, unasked.
        if shared.engine.lock().expect("QP lock").wants_transmit() {
            shared.kick();
        }
        Ok(TcpQp {
            shared,
            threads: vec![rx, tx],
        })
    }

    /// Posts a send WR. A lone small one (nothing else queued, the
    /// transmit thread idle, no send in the last [`STREAM_GAP`]) is sent on
    /// this thread, as siw does: waking the transmit thread costs a
    /// ping-pong more than the send itself. Anything else, and a stream of
    /// posts, goes to the transmit thread, which sends many per gather write.
    pub fn post_send(&self, wr: SendWr) -> Result<(), PostError> {
        let (lone, failed) = {
            let mut qp = self.shared.engine.lock().expect("QP lock");
            qp.post_send(wr)?;
            (
                qp.lone_send_within(POSTER_SENDS_UP_TO),
                qp.state() == QpState::Err,
            )
        };
        if failed {
            // Flushed on the post: its completion goes to the CQ now (the
            // connection's threads may be gone).
            self.shared.drain();
            return Ok(());
        }
        // Without waiting on the socket: a peer that stops reading must not
        // hold the poster (what doesn't fit is the transmit thread's).
        if !(lone && self.shared.send_here()) {
            self.shared.kick();
        }
        Ok(())
    }

    /// Posts a receive WR.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), PostError> {
        let failed = {
            let mut qp = self.shared.engine.lock().expect("QP lock");
            qp.post_recv(wr)?;
            qp.state() == QpState::Err
        };
        if failed {
            self.shared.drain();
        }
        Ok(())
    }

    /// FPDUs that application threads' polls received (busy-poll mode).
    #[cfg(test)]
    pub fn polled_fpdus(&self) -> u64 {
        self.shared.polled_fpdus.load(Ordering::Relaxed)
    }

    /// Bytes of READ responses that a receiving thread could not write at
    /// once and left to the transmit thread.
    #[cfg(test)]
    pub fn deferred_bytes(&self) -> u64 {
        self.shared.deferred_bytes.load(Ordering::Relaxed)
    }

    /// Runs `f` on the engine (state, stats, the Terminates).
    pub fn with_engine<R>(&self, f: impl FnOnce(&IwarpQp) -> R) -> R {
        f(&self.shared.engine.lock().expect("QP lock"))
    }

    /// The remote operations the QP allows from now on.
    pub fn set_access(&self, access: Access) {
        self.shared
            .engine
            .lock()
            .expect("QP lock")
            .set_access(access);
    }

    /// Moves the QP to ERR and closes its connection, as siw does on a
    /// modify to ERROR: its work is flushed at once; only a Terminate it
    /// owes the peer still goes out (the transmit thread gets 2 s for it)
    /// before the socket closes. Returns with the flushes in the CQs and the
    /// threads ended; again, does nothing.
    pub fn shut_down(&mut self) {
        if let Some(rest) = self.begin_shut_down() {
            rest.finish();
        }
    }

    /// The part of [`TcpQp::shut_down`] that must not wait: the QP is in
    /// ERR and its work flushed when this returns. The rest waits for the
    /// threads; a caller holding a lock others need finishes it after
    /// letting go. `None` if the threads were ended before.
    pub(crate) fn begin_shut_down(&mut self) -> Option<ShutDownRest> {
        if self.threads.is_empty() {
            return None;
        }
        self.shared.engine.lock().expect("QP lock").to_error();
        self.shared.drain();
        self.shared.close();
        Some(ShutDownRest {
            shared: self.shared.clone(),
            threads: std::mem::take(&mut self.threads),
        })
    }
}

/// What is left of a shut-down once the QP is in ERR: the transmit thread's
/// last send and the joins.
pub(crate) struct ShutDownRest {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl ShutDownRest {
    /// Gives the transmit thread up to 2 s to send a Terminate it owes,
    /// closes the socket and joins the threads (as dropping it does).
    pub(crate) fn finish(self) {
        drop(self);
    }
}

impl Drop for ShutDownRest {
    fn drop(&mut self) {
        let t0 = std::time::Instant::now();
        while self
            .threads
            .iter()
            .any(|t| t.thread().name() == Some(TX_NAME) && !t.is_finished())
            && t0.elapsed() < std::time::Duration::from_secs(2)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _ = self.shared.stream.shutdown(Shutdown::Both);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for TcpQp {
    fn drop(&mut self) {
        self.shared.destroyed.store(true, Ordering::Release);
        self.shut_down();
    }
}

const TX_NAME: &str = "softrdma-iwarp-tx";

/// The largest work request a poster sends on its own thread: a small one
/// fits the socket's buffer, so the write seldom leaves a rest.
const POSTER_SENDS_UP_TO: usize = 16 << 10;

/// After receiving: a lone small READ response goes out on this thread, as
/// a poster's lone small send does, without waiting on the socket (a READ
/// request's round trip paid the transmit thread's wake-up); anything else
/// is the transmit thread's.
fn answer_or_kick(s: &Shared, lone_response: bool) {
    if !(lone_response && s.send_here()) {
        s.kick();
    }
}

/// Posts closer than this to the last send are a stream (their sends are
/// batched by the transmit thread); a ping-pong's come a round trip apart.
const STREAM_GAP: Duration = Duration::from_micros(5);

impl Shared {
    /// Sends one batch on the calling thread without waiting on the socket
    /// (what doesn't fit is left to the transmit thread), unless a send
    /// finished within [`STREAM_GAP`] (a stream, the transmit thread's to
    /// batch) or another thread is sending. Returns whether it sent.
    fn send_here(&self) -> bool {
        if self
            .now()
            .saturating_sub(self.last_sent.load(Ordering::Relaxed))
            <= STREAM_GAP.as_nanos() as u64
        {
            return false;
        }
        let Ok(mut tx) = self.tx.try_lock() else {
            return false;
        };
        let sent = send_all(self, &mut tx, false);
        drop(tx);
        match sent {
            Err(_) => self.lost(),
            // A local error on the poster's thread ends the stream too.
            Ok(Ended::Yes) => self.end_writing(),
            Ok(Ended::No) => {}
        }
        true
    }

    /// Ends this side's half of the stream (FIN after the Terminate, if
    /// any); the transmit thread ends the connection [`LINGER`] later.
    fn end_writing(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
        if self
            .write_ended
            .compare_exchange(0, self.now().max(1), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.kick();
        }
    }

    /// How long the transmit thread waits before it ends the connection
    /// (see [`LINGER`]); `None`: no end is due.
    fn linger_left(&self) -> Option<Duration> {
        let ended = self.write_ended.load(Ordering::Acquire);
        if ended == 0 || self.lingered.load(Ordering::Acquire) {
            return None;
        }
        let since = Duration::from_nanos(self.now().saturating_sub(ended));
        Some(LINGER.saturating_sub(since))
    }

    fn kick(&self) {
        let mut p = self.tx_pending.lock().expect("tx lock");
        p.work = true;
        // A notify is a futex call even with nobody waiting: one per post
        // in a stream of small WRITEs, while the thread was awake anyway.
        let asleep = p.asleep;
        drop(p);
        if asleep {
            self.tx_wake.notify_one();
        }
    }

    /// Asks the threads to end (the transmit thread sends what is queued first).
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.kick();
        self.wake_receiver();
    }

    /// A transport thread panicked (a bug): the QP fails as on a lost
    /// connection. The locks the panic may have poisoned are cleared first:
    /// the QP is in ERR after this, where only flushes happen.
    fn thread_panicked(&self) {
        self.engine.clear_poison();
        self.mrs.clear_poison();
        self.tx.clear_poison();
        self.tx_pending.clear_poison();
        self.rx.clear_poison();
        self.rx_standby_lock.clear_poison();
        if let Some((_, srq)) = &self.srq {
            srq.clear_poison();
        }
        // First, as it ends the stream: a receive thread still reading
        // holds the receive lock until its read ends.
        self.lost();
        // Nobody reads the stream any more, pollers included.
        self.rx.lock().expect("rx lock").done = true;
    }

    /// Ends the receive thread's standby.
    fn wake_receiver(&self) {
        let _g = self.rx_standby_lock.lock().expect("standby lock");
        self.rx_standby.notify_all();
    }

    /// Nanoseconds since `epoch`.
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Whether the receive thread may stand by: busy-poll mode, an
    /// application thread polling (within the standby span), none asleep in
    /// a CQ wait for the last [`POLLING_ONLY`], no large FPDUs streaming.
    /// Returns how long it may, if it may.
    fn standby_left(&self) -> Option<Duration> {
        if !self.busy_poll.load(Ordering::SeqCst)
            || self.closed.load(Ordering::Acquire)
            || self.app_asleep.load(Ordering::SeqCst) > 0
        {
            return None;
        }
        let now = self.now();
        if now < self.rx_active_until.load(Ordering::Acquire)
            || now.saturating_sub(self.app_slept.load(Ordering::SeqCst))
                < POLLING_ONLY.as_nanos() as u64
        {
            return None;
        }
        let idle = now.saturating_sub(self.app_polled.load(Ordering::Relaxed));
        STANDBY
            .checked_sub(Duration::from_nanos(idle))
            .filter(|left| !left.is_zero())
    }

    /// The stream ended or failed under `rx` (receiving is over).
    fn end_of_stream(&self, rx: &mut RxState) {
        rx.done = true;
        if !self.closed.load(Ordering::Acquire) {
            // A Terminate this side owes (a CRC error, a malformed segment)
            // still goes out: the transmit thread sends it, then ends the
            // stream (see `LINGER`). Shut at once, the socket lost it. It
            // is owed from when the engine made it until that end, not only
            // while it waits to be taken: a transmit thread that has just
            // taken it is writing it.
            let owed = {
                let qp = self.engine.lock().expect("QP lock");
                qp.state() == QpState::Err
                    && qp.own_terminate().is_some()
                    && self.write_ended.load(Ordering::Acquire) == 0
            };
            if owed {
                self.kick();
            } else {
                self.lost();
            }
        } else {
            self.engine.lock().expect("QP lock").connection_lost();
            self.drain();
        }
    }

    /// The connection failed: the engine flushes, the threads end.
    fn lost(&self) {
        self.engine.lock().expect("QP lock").connection_lost();
        self.drain();
        self.closed.store(true, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
        self.kick();
        self.wake_receiver();
    }

    /// Moves completions and events out of the engine.
    fn drain(&self) {
        let mut signal = [false; 2];
        let mut overran = false;
        let mut qp = self.engine.lock().expect("QP lock");
        while let Some((kind, wc)) = qp.poll_completion() {
            if !CqInner::deliver([&self.send_cq, &self.recv_cq], kind, wc, &mut signal) {
                // Completions are being lost: the QP terminates the stream.
                qp.cq_overrun();
                overran = true;
            }
        }
        let qpn = qp.qpn();
        while let Some(e) = qp.poll_event() {
            if self.destroyed.load(Ordering::Acquire) {
                continue;
            }
            self.events.push(match e {
                QpEvent::Fatal => AsyncEvent::QpFatal { qpn },
                QpEvent::LastWqeReached => AsyncEvent::QpLastWqeReached { qpn },
                QpEvent::SqDrained => AsyncEvent::SqDrained { qpn },
                QpEvent::CommEstablished => AsyncEvent::CommEstablished { qpn },
            });
        }
        drop(qp);
        if let Some((id, srq)) = &self.srq
            && srq.lock().expect("SRQ lock").take_limit_event()
        {
            self.events.push(AsyncEvent::SrqLimitReached { srq: *id });
        }
        if overran {
            // Its Terminate goes out from the transmit thread.
            self.kick();
        }
        if signal[0] {
            self.send_cq.signal();
        }
        if signal[1] {
            self.recv_cq.signal();
        }
    }
}

/// Runs one of a connection's threads; if it panics (a bug), the QP fails
/// rather than leave its work and its peer waiting forever.
fn contained(s: &Shared, thread: fn(&Shared)) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| thread(s))).is_err() {
        s.thread_panicked();
    }
}

fn transmit_loop(s: &Shared) {
    loop {
        {
            let mut p = s.tx_pending.lock().expect("tx lock");
            while !p.work && !s.closed.load(Ordering::Acquire) {
                p.asleep = true;
                match s.linger_left() {
                    // The peer had its time to close: the receive thread's
                    // read ends, and it ends the QP's threads.
                    Some(left) if left.is_zero() => {
                        s.lingered.store(true, Ordering::Release);
                        let _ = s.stream.shutdown(Shutdown::Both);
                    }
                    Some(left) => p = s.tx_wake.wait_timeout(p, left).expect("tx lock").0,
                    None => p = s.tx_wake.wait(p).expect("tx lock"),
                }
                p.asleep = false;
            }
            p.work = false;
        }
        let mut tx = s.tx.lock().expect("tx buffers lock");
        #[cfg(test)]
        if s.panic_in_tx.swap(false, Ordering::SeqCst) {
            panic!("the transmit thread fails, as a test asked");
        }
        if s.closed.load(Ordering::Acquire) {
            // Send a queued Terminate before leaving, if the socket still takes it.
            let _ = send_all(s, &mut tx, true);
            return;
        }
        let sent = send_all(s, &mut tx, true);
        drop(tx);
        match sent {
            Err(_) => {
                s.lost();
                return;
            }
            // After a Terminate or a local error the stream ends, as siw
            // ends it: the peer sees the close and flushes; receiving goes
            // on until it closes too, for `LINGER` at most.
            Ok(Ended::Yes) => s.end_writing(),
            Ok(Ended::No) => {}
        }
    }
}

/// From a gather write of at least this many bytes until the transmit thread
/// runs out of work, busy-poll pollers give it the CPU (a 1 MiB write takes
/// a few hundred µs; spinning beside it makes three busy threads on two
/// CPUs). A batch of small FPDUs takes a few µs, and yielding for those cost
/// the 8-byte WRITE rate six sevenths (`docs/performance.md`, fourteenth
/// session).
const LARGE_WRITE: usize = 256 << 10;

/// Most FPDUs in one gather write: small messages go out many per system call,
/// MPA's largest 16 at a time (about 1 MiB; ULPDUs never exceed
/// `mpa::MAX_ULPDU`, so no byte limit is needed). A 256 KiB limit moved 64 KiB
/// and 1 MiB WRITEs 20-40 % slower; 24 or 32 FPDUs (a 1 MiB WRITE's 17 in one
/// call) were no faster than 16 (`docs/performance.md`, thirteenth session).
const TX_BATCH: usize = 16;

/// The transmit thread's cue: work for it, and whether it sleeps.
#[derive(Debug, Default)]
struct TxPending {
    work: bool,
    asleep: bool,
}

/// The sending side's buffers.
#[derive(Debug)]
struct Tx {
    batch: Vec<TxFpdu>,
    /// Bytes of FPDUs a send that could not wait left unwritten (the
    /// engine counts them sent): the next sender writes them first.
    leftover: Vec<u8>,
}

/// An FPDU being framed: its headers (and inline payload), region pieces,
/// and pad and CRC.
#[derive(Debug)]
struct TxFpdu {
    buf: Vec<u8>,
    pieces: Vec<Segment>,
    trailer: [u8; 7],
    t: Transmit,
}

impl TxFpdu {
    fn new() -> TxFpdu {
        TxFpdu {
            buf: vec![0u8; MAX_HEADER_LEN + MAX_INLINE_DATA as usize],
            // An FPDU's payload from up to four SGEs, without growing.
            pieces: Vec::with_capacity(4),
            trailer: [0; 7],
            t: Transmit {
                header_len: 0,
                payload_len: 0,
                ulpdu_len: 0,
            },
        }
    }

    /// Pad and CRC: the bytes of `trailer` that follow the payload.
    fn trailer_len(&self) -> usize {
        mpa::pad_len(self.t.ulpdu_len) + mpa::CRC_LEN
    }

    /// Fills in pad and CRC.
    fn seal(&mut self, with_crc: bool) {
        let pad = mpa::pad_len(self.t.ulpdu_len);
        self.trailer = [0; 7];
        if with_crc {
            let mut crc = Crc32c::default();
            crc.update(&self.buf[..self.t.header_len]);
            for p in &self.pieces {
                // SAFETY: read now, not kept; a concurrent remote write into
                // these bytes makes what is sent unspecified, as on a NIC.
                crc.update(unsafe { p.bytes() });
            }
            crc.update(&self.trailer[..pad]);
            self.trailer[pad..pad + 4].copy_from_slice(&crc.finish().to_le_bytes());
        }
    }
}

/// Whether the QP is in error with everything sent: its stream should end.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Ended {
    Yes,
    No,
}

/// Sends every FPDU the engine has, a batch per gather write. The engine
/// completes a SEND or WRITE only once told its bytes are in the socket (or
/// copied to `leftover`): the application may reuse a buffer as soon as it
/// sees its completion. `wait`: false for a receiving thread, which must not
/// block on a full socket (both ends would stop reading); it sends one batch,
/// copies what the socket does not take at once to `leftover`, and wakes the
/// transmit thread for that and anything more (the stream's end included).
/// Says whether the stream should end: the QP failed and all is sent.
fn send_all(s: &Shared, tx: &mut Tx, wait: bool) -> io::Result<Ended> {
    if !tx.leftover.is_empty() {
        if !wait {
            s.kick();
            return Ok(Ended::No);
        }
        if let Err(e) = (&s.stream).write_all(&tx.leftover) {
            s.engine.lock().expect("QP lock").transmit_failed();
            return Err(e);
        }
        tx.leftover.clear();
    }
    let batch = &mut tx.batch;
    let mut large = LargeWrite(&s.transmitting, false);
    loop {
        let mut n = 0;
        let failed = {
            let mrs = s.mrs.read().expect("MR table lock");
            let mut qp = s.engine.lock().expect("QP lock");
            while n < batch.len() {
                let f = &mut batch[n];
                let Some(t) = qp.poll_transmit(&mrs, &mut f.buf, &mut f.pieces) else {
                    break;
                };
                f.t = t;
                n += 1;
            }
            qp.state() == QpState::Err
        };
        if n == 0 {
            s.drain();
            return Ok(if failed { Ended::Yes } else { Ended::No });
        }
        for f in &mut batch[..n] {
            f.seal(s.crc);
        }
        {
            let mut iov: smallvec::SmallVec<[IoSlice<'_>; 64]> = smallvec::SmallVec::new();
            let mut bytes = 0;
            for f in &batch[..n] {
                bytes += f.t.header_len + f.t.payload_len;
                iov.push(IoSlice::new(&f.buf[..f.t.header_len]));
                for p in f.pieces.iter().take(MAX_PIECES) {
                    // SAFETY: as in `seal`: the kernel copies them in this call.
                    iov.push(IoSlice::new(unsafe { p.bytes() }));
                }
                iov.push(IoSlice::new(&f.trailer[..f.trailer_len()]));
            }
            if bytes >= LARGE_WRITE && !large.1 {
                s.transmitting.store(true, Ordering::Relaxed);
                large.1 = true;
            }
            let written = if wait {
                write_all_vectored(&s.stream, &mut iov)
            } else {
                let kept = write_or_keep(&s.stream, &mut iov, &mut tx.leftover);
                if !tx.leftover.is_empty() {
                    s.deferred_bytes
                        .fetch_add(tx.leftover.len() as u64, Ordering::Relaxed);
                }
                kept
            };
            if let Err(e) = written {
                s.engine.lock().expect("QP lock").transmit_failed();
                return Err(e);
            }
        }
        for f in &mut batch[..n] {
            f.pieces.clear();
        }
        s.engine.lock().expect("QP lock").transmitted();
        s.drain();
        s.last_sent.store(s.now(), Ordering::Relaxed);
        if !wait {
            // One batch: more is the transmit thread's.
            let more = !tx.leftover.is_empty() || {
                let qp = s.engine.lock().expect("QP lock");
                qp.wants_transmit() || qp.state() == QpState::Err
            };
            if more {
                s.kick();
            }
            return Ok(Ended::No);
        }
    }
}

/// Clears `transmitting` when the send that set it (the `bool`) ends, by
/// whichever thread it ran on.
struct LargeWrite<'a>(&'a AtomicBool, bool);

impl Drop for LargeWrite<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.store(false, Ordering::Relaxed);
        }
    }
}

/// Writes what the socket takes without waiting; copies the rest to `keep`.
fn write_or_keep(
    stream: &TcpStream,
    iov: &mut [IoSlice<'_>],
    keep: &mut Vec<u8>,
) -> io::Result<()> {
    let written = loop {
        match rustix::net::sendmsg(
            stream,
            iov,
            &mut rustix::net::SendAncillaryBuffer::default(),
            rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::AGAIN) => break 0,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    let mut iov = &mut iov[..];
    IoSlice::advance_slices(&mut iov, written);
    for piece in iov.iter() {
        keep.extend_from_slice(piece);
    }
    Ok(())
}

/// `sendmsg` with MSG_NOSIGNAL (a `writev` into a closed stream raises
/// SIGPIPE, which kills a host process that has not ignored it).
fn write_all_vectored(stream: &TcpStream, mut iov: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !iov.is_empty() {
        match rustix::net::sendmsg(
            stream,
            iov,
            &mut rustix::net::SendAncillaryBuffer::default(),
            rustix::net::SendFlags::NOSIGNAL,
        ) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut iov, n),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn receive_loop(s: &Shared) {
    loop {
        // Standing by while an application thread polls (busy-poll mode):
        // two threads spinning on one side of a ping-pong take turns on
        // the CPUs, which cost iWARP's latency several times over.
        if s.busy_poll.load(Ordering::Relaxed) {
            // The flag first, then the conditions, under the lock its wakers
            // take: a waker either sees the flag or is seen.
            let g = s.rx_standby_lock.lock().expect("standby lock");
            s.standing_by.store(true, Ordering::SeqCst);
            if let Some(left) = s.standby_left() {
                drop(s.rx_standby.wait_timeout(g, left).expect("standby lock"));
                s.standing_by.store(false, Ordering::SeqCst);
                continue;
            }
            s.standing_by.store(false, Ordering::SeqCst);
        }
        let mut rx = s.rx.lock().expect("rx lock");
        if rx.done {
            return;
        }
        #[cfg(test)]
        if s.panic_in_rx.swap(false, Ordering::SeqCst) {
            panic!("the receive thread fails, as a test asked");
        }
        let RxState {
            control,
            pieces,
            ahead,
            ..
        } = &mut *rx;
        if receive_one(s, control, pieces, ahead, &s.busy_poll).is_err() {
            // Closed, reset, or framing the stream cannot recover from.
            s.end_of_stream(&mut rx);
            return;
        }
    }
}

/// Most FPDUs an application thread's poll receives.
const POLL_FPDUS: usize = 16;

/// The receive buffer a busy-polling connection asks for (4 MiB: a quarter
/// holds the largest FPDU a poll takes many times over).
const POLL_RCVBUF: usize = 4 << 20;

/// The largest FPDU a poll takes: larger ones come in streams, which the
/// receive thread reads as they arrive (a poll would wait for each whole).
const POLL_FPDU_MAX: usize = 16 << 10;

/// Busy-poll mode: the calling application thread (polling a CQ of the
/// device) receives the FPDUs that are whole in the socket, unless another
/// thread is receiving; the receive thread stands by while such polls come
/// (see [`Shared::standby_left`]). Only whole FPDUs, so that a peer that
/// stops mid-FPDU cannot hold the application in `read`; one larger than a
/// poll takes wakes the receive thread, which then streams for the standby
/// span. Returns whether it does.
fn poll_now(s: &Shared) -> bool {
    if !s.busy_poll.load(Ordering::Relaxed) || s.closed.load(Ordering::Relaxed) {
        return false;
    }
    let now = s.now();
    s.app_polled.store(now, Ordering::Relaxed);
    if now < s.rx_active_until.load(Ordering::Acquire) {
        return true;
    }
    let Ok(mut rx) = s.rx.try_lock() else {
        return false;
    };
    for _ in 0..POLL_FPDUS {
        if rx.done {
            return false;
        }
        match next_fpdu(&s.stream, &mut rx.ahead, s.poll_fpdu_max) {
            NextFpdu::Whole(len) if len <= s.poll_fpdu_max => {}
            NextFpdu::Whole(_) | NextFpdu::Large => {
                s.rx_active_until
                    .store(now + STANDBY.as_nanos() as u64, Ordering::Release);
                drop(rx);
                s.wake_receiver();
                return true;
            }
            NextFpdu::NotYet => return false,
            NextFpdu::Malformed => {
                s.end_of_stream(&mut rx);
                return false;
            }
        }
        let RxState {
            control,
            pieces,
            ahead,
            ..
        } = &mut *rx;
        // The FPDU is whole in the socket: its reads need no spinning first.
        if receive_one(s, control, pieces, ahead, &NO_SPIN).is_err() {
            s.end_of_stream(&mut rx);
            return false;
        }
        s.polled_fpdus.fetch_add(1, Ordering::Relaxed);
    }
    false
}

/// What a poll finds of the next FPDU.
enum NextFpdu {
    /// Whole in what was read ahead and the socket (its bytes), or the
    /// stream failed or ended (for the reading to find out).
    Whole(usize),
    /// Larger than a poll takes, not whole yet.
    Large,
    /// Nothing, or part of a small one.
    NotYet,
    /// A length no FPDU can have: the stream is broken.
    Malformed,
}

/// The next FPDU's state. Its first bytes (up to [`AHEAD`], a small FPDU
/// whole) are read into `ahead` without waiting, where the FPDU's reading
/// takes them from.
fn next_fpdu(stream: &TcpStream, ahead: &mut Lookahead, most: usize) -> NextFpdu {
    if ahead.len - ahead.at < mpa::LENGTH_FIELD_LEN {
        ahead.buf.copy_within(ahead.at..ahead.len, 0);
        ahead.len -= ahead.at;
        ahead.at = 0;
        let flags = rustix::net::RecvFlags::DONTWAIT;
        match rustix::net::recv(stream, &mut ahead.buf[ahead.len..], flags) {
            Ok((0, _)) => return NextFpdu::Whole(0),
            Ok((n, _)) => ahead.len += n,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return NextFpdu::NotYet,
            Err(_) => return NextFpdu::Whole(0),
        }
        if ahead.len < mpa::LENGTH_FIELD_LEN {
            return NextFpdu::NotYet;
        }
    }
    let length = [ahead.buf[ahead.at], ahead.buf[ahead.at + 1]];
    let ulpdu = usize::from(u16::from_be_bytes(length));
    if ulpdu < ddp::TAGGED_HEADER_LEN {
        // No DDP header fits: its reading could wait for header bytes the
        // peer never sends.
        return NextFpdu::Malformed;
    }
    let whole = mpa::LENGTH_FIELD_LEN + ulpdu + mpa::pad_len(ulpdu) + mpa::CRC_LEN;
    let buffered = ahead.len - ahead.at;
    if buffered >= whole {
        // A small FPDU usually comes whole in the read ahead: no more calls.
        return NextFpdu::Whole(whole);
    }
    let in_socket = rustix::io::ioctl_fionread(stream).unwrap_or(0) as usize;
    if buffered + in_socket >= whole {
        NextFpdu::Whole(whole)
    } else if whole > most {
        NextFpdu::Large
    } else if in_socket == 0 && stream_ended(stream) {
        // Part of an FPDU, then the end: the reading finds the end at once.
        NextFpdu::Whole(0)
    } else {
        NextFpdu::NotYet
    }
}

/// Whether the peer closed or reset the stream, with nothing left in the
/// socket to read (a peek, taking nothing).
fn stream_ended(stream: &TcpStream) -> bool {
    let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
    !matches!(
        rustix::net::recv(stream, &mut [0u8; 1], flags),
        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) | Ok((1, _))
    )
}

/// How long a busy-polling receive thread spins on its socket before it
/// sleeps in `read` (RoCEv2's standby span).
const BUSY_SPIN: Duration = Duration::from_millis(1);

/// In busy-poll mode, waits for the stream's next bytes by spinning (up to
/// [`BUSY_SPIN`]) instead of sleeping in `read`: the peer's send then wakes
/// no thread, and the kernel's receive work runs in this thread's `read`
/// rather than in the sender's softirq. Returns at once outside the mode.
fn spin_for_bytes(stream: &TcpStream, busy_poll: &AtomicBool) {
    if !busy_poll.load(Ordering::Relaxed) {
        return;
    }
    let t0 = Instant::now();
    while matches!(rustix::io::ioctl_fionread(stream), Ok(0)) && t0.elapsed() < BUSY_SPIN {
        // An application thread spinning on this CPU (perftest's write_lat
        // spins on memory) gets its turn: without this, it waits a whole
        // time slice for this thread to give up the CPU.
        std::thread::yield_now();
    }
}

/// Every FPDU has at least this many bytes before its payload (length
/// field and tagged DDP header): a header's first read.
const LOOKAHEAD: usize = mpa::LENGTH_FIELD_LEN + ddp::TAGGED_HEADER_LEN;

/// Most bytes read ahead of what a read needs: a small FPDU (an 8-byte
/// WRITE's is 32 bytes, a READ request's 52) then comes whole in the read
/// of its header, and its payload is copied into place from here. A large
/// payload loses at most this much of its direct placement to a copy.
const AHEAD: usize = 256;

/// Bytes of the stream read ahead (`buf[at..len]` not yet used).
#[derive(Debug)]
struct Lookahead {
    buf: [u8; AHEAD],
    at: usize,
    len: usize,
}

impl Default for Lookahead {
    fn default() -> Lookahead {
        Lookahead {
            buf: [0; AHEAD],
            at: 0,
            len: 0,
        }
    }
}

impl Lookahead {
    /// Fills `out` from the bytes read ahead, then from the stream, reading
    /// as much more as came (up to [`AHEAD`]).
    fn read_exact(
        &mut self,
        mut stream: &TcpStream,
        busy_poll: &AtomicBool,
        out: &mut [u8],
    ) -> io::Result<()> {
        let k = self.take(out);
        if k == out.len() {
            return Ok(());
        }
        // Empty now: `take` used all it had.
        (self.at, self.len) = (0, 0);
        while self.len < out.len() - k {
            spin_for_bytes(stream, busy_poll);
            let room = self.room(busy_poll).max(out.len() - k);
            match stream.read(&mut self.buf[self.len..room]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.len += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.take(&mut out[k..]);
        Ok(())
    }

    /// How far a read may go: [`AHEAD`] in busy-poll mode; otherwise
    /// [`LOOKAHEAD`], a tagged FPDU's header (one FPDU a read). A blocking
    /// receive thread that took many small FPDUs a read emptied the socket
    /// and slept between them, and every send then paid its wake-up (the
    /// 8-byte WRITE rate 12 % lower; one FPDU a read keeps it awake).
    fn room(&self, busy_poll: &AtomicBool) -> usize {
        if busy_poll.load(Ordering::Relaxed) {
            AHEAD
        } else {
            LOOKAHEAD
        }
    }

    /// The next at most `max` bytes read ahead, counted as taken.
    fn next(&mut self, max: usize) -> &[u8] {
        let k = (self.len - self.at).min(max);
        self.at += k;
        &self.buf[self.at - k..self.at]
    }

    /// Copies what is read ahead into `out`, at most all of it; returns how much.
    fn take(&mut self, out: &mut [u8]) -> usize {
        let bytes = self.next(out.len());
        out[..bytes.len()].copy_from_slice(bytes);
        bytes.len()
    }

    /// As [`Lookahead::take`], into the start of a region piece.
    fn take_into(&mut self, piece: &Segment) -> usize {
        let bytes = self.next(piece.len());
        piece.write(0, bytes);
        bytes.len()
    }
}

/// Reads an FPDU's payload straight into `pieces` (or into `control`, which
/// is not empty when the payload goes there), then its `trailer`, and as
/// many bytes after it as came (at most [`AHEAD`]): one `readv` per FPDU
/// when the stream keeps up, none when it was all read ahead. What was read
/// ahead is copied into place first.
fn read_rest(
    stream: &TcpStream,
    busy_poll: &AtomicBool,
    pieces: &[Segment],
    control: &mut [u8],
    trailer: &mut [u8],
    ahead: &mut Lookahead,
) -> io::Result<()> {
    let placed: usize = pieces.iter().map(Segment::len).sum();
    let want = placed + control.len() + trailer.len();
    let mut done = 0;
    for p in pieces {
        let k = ahead.take_into(p);
        done += k;
        if k < p.len() {
            break;
        }
    }
    if done == placed {
        done += ahead.take(control);
        if done == placed + control.len() {
            done += ahead.take(trailer);
        }
    }
    while done < want {
        let mut spans: smallvec::SmallVec<[(&Segment, usize, usize); MAX_PIECES]> =
            smallvec::SmallVec::new();
        let mut skip = done;
        for p in pieces {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            spans.push((p, skip, p.len() - skip));
            skip = 0;
        }
        let after = done.saturating_sub(placed);
        let in_control = after.min(control.len());
        let in_trailer = after - in_control;
        spin_for_bytes(stream, busy_poll);
        let room = ahead.room(busy_poll);
        let n = crate::memory::read_vectored_from_fd(
            stream.as_fd(),
            &spans,
            &mut [
                &mut control[in_control..],
                &mut trailer[in_trailer..],
                &mut ahead.buf[..room],
            ],
        );
        let n = match n {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if done + n > want {
            ahead.at = 0;
            ahead.len = done + n - want;
        }
        done = (done + n).min(want);
    }
    Ok(())
}

/// Payloads up to this long are read into a buffer and then placed by the
/// region's copy (see [`receive_one`]): the copies that store whole words once.
const SMALL_PAYLOAD: usize = crate::memory::WORD_COPY_MAX;

/// A busy-poll flag that is off: reads that need not spin for their bytes.
static NO_SPIN: AtomicBool = AtomicBool::new(false);

/// Reads, places and hands one FPDU to the engine; `busy`: spin for bytes
/// before each read while it is on (see [`spin_for_bytes`]).
fn receive_one(
    s: &Shared,
    control: &mut Vec<u8>,
    pieces: &mut Vec<Segment>,
    ahead: &mut Lookahead,
    busy: &AtomicBool,
) -> io::Result<()> {
    let stream = &s.stream;
    let mut crc = Crc32c::default();
    // The length field and the shorter (tagged) header in one read; the
    // length looked at first, so that one no header fits fails at once
    // instead of waiting for header bytes a broken peer may never send.
    let mut head = [0u8; mpa::LENGTH_FIELD_LEN + ddp::UNTAGGED_HEADER_LEN];
    ahead.read_exact(stream, busy, &mut head[..mpa::LENGTH_FIELD_LEN])?;
    let ulpdu_len = usize::from(u16::from_be_bytes([head[0], head[1]]));
    if ulpdu_len < ddp::TAGGED_HEADER_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "ULPDU shorter than any DDP header",
        ));
    }
    ahead.read_exact(stream, busy, &mut head[mpa::LENGTH_FIELD_LEN..LOOKAHEAD])?;
    let hlen = if head[2] & 0x80 != 0 {
        ddp::TAGGED_HEADER_LEN
    } else {
        ddp::UNTAGGED_HEADER_LEN
    };
    if ulpdu_len < hlen {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "ULPDU shorter than its DDP header",
        ));
    }
    let head = &mut head[..mpa::LENGTH_FIELD_LEN + hlen];
    ahead.read_exact(stream, busy, &mut head[LOOKAHEAD..])?;
    if s.crc {
        crc.update(head);
    }
    let hdr = &head[mpa::LENGTH_FIELD_LEN..];
    let payload_len = ulpdu_len - hlen;
    let placement = {
        let mrs = s.mrs.read().expect("MR table lock");
        s.engine
            .lock()
            .expect("QP lock")
            .accept_header(hdr, payload_len, &mrs, pieces)
    };
    let pad = mpa::pad_len(ulpdu_len);
    let mut trailer = [0u8; 7];
    let trailer = &mut trailer[..pad + mpa::CRC_LEN];
    control.clear();
    match placement {
        Placement::Data => {
            let placed: usize = pieces.iter().map(Segment::len).sum();
            if placed <= SMALL_PAYLOAD {
                // Through a buffer, then into place by the region's own copy,
                // which stores each aligned 8-byte word once (as a NIC's DMA
                // does: a word the application takes with an atomic is not
                // undone by a second store); the kernel's copy into the region
                // promises no such thing.
                let mut buffer = [0u8; SMALL_PAYLOAD];
                read_rest(stream, busy, &[], &mut buffer[..placed], trailer, ahead)?;
                let mut at = 0;
                for p in pieces.iter() {
                    p.write(0, &buffer[at..at + p.len()]);
                    at += p.len();
                }
            } else {
                read_rest(stream, busy, pieces, &mut [], trailer, ahead)?;
            }
            if s.crc {
                for p in pieces.iter() {
                    // SAFETY: read right after placing, not kept; a concurrent
                    // write by the application makes the CRC fail, as on a NIC.
                    crc.update(unsafe { p.bytes() });
                }
            }
        }
        Placement::Control | Placement::Discard => {
            control.resize(payload_len, 0);
            read_rest(stream, busy, &[], control, trailer, ahead)?;
            if s.crc {
                crc.update(control);
            }
        }
    }
    let sent = u32::from_le_bytes([
        trailer[pad],
        trailer[pad + 1],
        trailer[pad + 2],
        trailer[pad + 3],
    ]);
    let crc_ok = if s.crc {
        crc.update(&trailer[..pad]);
        crc.finish() == sent
    } else {
        true
    };
    let (wants, lone_response, terminated) = {
        let mrs = s.mrs.read().expect("MR table lock");
        let mut qp = s.engine.lock().expect("QP lock");
        qp.segment_done(control, crc_ok, &mrs);
        (
            qp.wants_transmit(),
            qp.lone_response_within(POSTER_SENDS_UP_TO),
            qp.peer_terminate().is_some(),
        )
    };
    s.drain();
    if terminated && s.write_ended.load(Ordering::Acquire) == 0 {
        // The peer ended the QP: this side ends its half of the stream, and
        // the connection after `LINGER` if the peer keeps its half open (a
        // socket held for the QP's life otherwise).
        s.end_writing();
    }
    if wants {
        answer_or_kick(s, lone_response);
    }
    if !crc_ok {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "MPA CRC error"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
