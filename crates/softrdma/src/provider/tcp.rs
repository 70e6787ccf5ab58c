//! iWARP over TCP: one TCP connection per QP, established by `cm::mpa`.
//!
//! A receive thread per connection reads each FPDU's length and DDP header,
//! asks the engine where the payload goes, and reads the payload from the
//! socket straight into the region; then pad and CRC. A transmit thread per
//! connection writes FPDUs with gather I/O from the region. Two threads, so
//! that receiving never waits for a blocked send: a peer that is itself
//! blocked sending to us is always drained.
//!
//! Copies of payload bytes (the design's budget): none on send, none on
//! receive (READ Requests and Terminates, small control messages, are read
//! into a buffer).

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;

use softrdma_wire::ddp;
use softrdma_wire::mpa::{self, Crc32c};

use crate::engine::iwarp::{IwarpQp, MAX_HEADER_LEN, Placement};
use crate::engine::{CqKind, PostError, QpEvent, RecvWr, SendWr};
use crate::memory::{MrTable, Segment};
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
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    events: Arc<EventQueue>,
    /// The transmit thread's wake-up.
    tx_wake: Condvar,
    tx_pending: Mutex<bool>,
    closed: AtomicBool,
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
        crc: bool,
        send_cq: Arc<CqInner>,
        recv_cq: Arc<CqInner>,
        events: Arc<EventQueue>,
    ) -> io::Result<TcpQp> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(None)?;
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            mrs,
            stream,
            crc,
            send_cq,
            recv_cq,
            events,
            tx_wake: Condvar::new(),
            tx_pending: Mutex::new(false),
            closed: AtomicBool::new(false),
        });
        let (a, b) = (shared.clone(), shared.clone());
        let rx = std::thread::Builder::new()
            .name("softrdma-iwarp-rx".into())
            .spawn(move || receive_loop(&a))?;
        let tx = std::thread::Builder::new()
            .name(TX_NAME.into())
            .spawn(move || transmit_loop(&b))?;
        // A peer-to-peer initiator's RTR message goes first, unasked.
        if shared.engine.lock().expect("QP lock").wants_transmit() {
            shared.kick();
        }
        Ok(TcpQp {
            shared,
            threads: vec![rx, tx],
        })
    }

    /// Posts a send WR (the transmit thread sends it).
    pub fn post_send(&self, wr: SendWr) -> Result<(), PostError> {
        self.shared.engine.lock().expect("QP lock").post_send(wr)?;
        self.shared.kick();
        Ok(())
    }

    /// Posts a receive WR.
    pub fn post_recv(&self, wr: RecvWr) -> Result<(), PostError> {
        self.shared.engine.lock().expect("QP lock").post_recv(wr)
    }

    /// Runs `f` on the engine (state, stats, the Terminates).
    pub fn with_engine<R>(&self, f: impl FnOnce(&IwarpQp) -> R) -> R {
        f(&self.shared.engine.lock().expect("QP lock"))
    }
}

impl Drop for TcpQp {
    fn drop(&mut self) {
        // A destroyed QP flushes its work at once; only a Terminate it owes
        // the peer still goes out (the transmit thread gets 2 s for it)
        // before the socket closes.
        self.shared
            .engine
            .lock()
            .expect("QP lock")
            .connection_lost();
        self.shared.drain();
        self.shared.close();
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

const TX_NAME: &str = "softrdma-iwarp-tx";

impl Shared {
    fn kick(&self) {
        *self.tx_pending.lock().expect("tx lock") = true;
        self.tx_wake.notify_one();
    }

    /// Asks the threads to end (the transmit thread sends what is queued first).
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.kick();
    }

    /// The connection failed: the engine flushes, the threads end.
    fn lost(&self) {
        self.engine.lock().expect("QP lock").connection_lost();
        self.drain();
        self.closed.store(true, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
        self.kick();
    }

    /// Moves completions and events out of the engine.
    fn drain(&self) {
        let mut signal = [false; 2];
        let mut qp = self.engine.lock().expect("QP lock");
        // Invalidations first, so that nobody sees the completion of a SEND
        // with invalidate or a local invalidate while the STag still works.
        // (The MR table lock comes before the QP's: take it without the QP.)
        loop {
            let invalidated: Vec<u32> = std::iter::from_fn(|| qp.poll_invalidated()).collect();
            if invalidated.is_empty() {
                break;
            }
            drop(qp);
            let mut mrs = self.mrs.write().expect("MR table lock");
            for stag in invalidated {
                mrs.invalidate_remote(stag);
            }
            drop(mrs);
            qp = self.engine.lock().expect("QP lock");
        }
        while let Some((kind, wc)) = qp.poll_completion() {
            match kind {
                CqKind::Send => signal[0] |= self.send_cq.push(wc),
                CqKind::Recv => signal[1] |= self.recv_cq.push(wc),
            }
        }
        let qpn = qp.qpn();
        while let Some(e) = qp.poll_event() {
            self.events.push(match e {
                QpEvent::Fatal => AsyncEvent::QpFatal { qpn },
                QpEvent::LastWqeReached => AsyncEvent::QpLastWqeReached { qpn },
            });
        }
        drop(qp);
        if signal[0] {
            self.send_cq.signal();
        }
        if signal[1] {
            self.recv_cq.signal();
        }
    }
}

fn transmit_loop(s: &Shared) {
    let mut buf = vec![0u8; MAX_HEADER_LEN + 4096];
    let mut pieces: Vec<Segment> = Vec::new();
    loop {
        {
            let mut p = s.tx_pending.lock().expect("tx lock");
            while !*p && !s.closed.load(Ordering::Acquire) {
                p = s.tx_wake.wait(p).expect("tx lock");
            }
            *p = false;
        }
        if s.closed.load(Ordering::Acquire) {
            // Send a queued Terminate before leaving, if the socket still takes it.
            let _ = send_all(s, &mut buf, &mut pieces);
            return;
        }
        if send_all(s, &mut buf, &mut pieces).is_err() {
            s.lost();
            return;
        }
        // After a Terminate the stream ends, as siw ends it: the peer sees the
        // close and flushes; receiving goes on until it closes too.
        if s.engine.lock().expect("QP lock").state() == crate::engine::QpState::Err {
            let _ = s.stream.shutdown(Shutdown::Write);
        }
    }
}

/// Sends every FPDU the engine has.
fn send_all(s: &Shared, buf: &mut [u8], pieces: &mut Vec<Segment>) -> io::Result<()> {
    loop {
        let t = {
            let mrs = s.mrs.read().expect("MR table lock");
            s.engine
                .lock()
                .expect("QP lock")
                .poll_transmit(&mrs, buf, pieces)
        };
        s.drain();
        let Some(t) = t else { return Ok(()) };
        let pad = mpa::pad_len(t.ulpdu_len);
        let mut crc = Crc32c::default();
        let mut iov = [IoSlice::new(&[]); MAX_PIECES + 2];
        iov[0] = IoSlice::new(&buf[..t.header_len]);
        if s.crc {
            crc.update(&buf[..t.header_len]);
        }
        let mut n = 1;
        for p in pieces.iter().take(MAX_PIECES) {
            // SAFETY: the bytes go to the kernel now and are not kept; a
            // concurrent remote write into them makes what is sent
            // unspecified, as DMA from a changing buffer would on a NIC.
            let bytes = unsafe { p.bytes() };
            if s.crc {
                crc.update(bytes);
            }
            iov[n] = IoSlice::new(bytes);
            n += 1;
        }
        let mut trailer = [0u8; 7];
        if s.crc {
            crc.update(&trailer[..pad]);
            trailer[pad..pad + 4].copy_from_slice(&crc.finish().to_le_bytes());
        }
        iov[n] = IoSlice::new(&trailer[..pad + 4]);
        n += 1;
        write_all_vectored(&s.stream, &mut iov[..n])?;
    }
}

fn write_all_vectored(mut stream: &TcpStream, mut iov: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !iov.is_empty() {
        match stream.write_vectored(iov) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut iov, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn receive_loop(s: &Shared) {
    let mut control = Vec::new();
    let mut pieces = Vec::new();
    loop {
        match receive_one(s, &mut control, &mut pieces) {
            Ok(()) => {}
            Err(_) => {
                // Closed, reset, or framing the stream cannot recover from.
                if !s.closed.load(Ordering::Acquire) {
                    s.lost();
                } else {
                    s.engine.lock().expect("QP lock").connection_lost();
                    s.drain();
                }
                return;
            }
        }
    }
}

/// Reads, places and hands one FPDU to the engine.
fn receive_one(s: &Shared, control: &mut Vec<u8>, pieces: &mut Vec<Segment>) -> io::Result<()> {
    let mut stream = &s.stream;
    let mut crc = Crc32c::default();
    let mut len = [0u8; 2];
    stream.read_exact(&mut len)?;
    let ulpdu_len = usize::from(u16::from_be_bytes(len));
    let mut hdr = [0u8; ddp::UNTAGGED_HEADER_LEN];
    if ulpdu_len < 2 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "FPDU too short"));
    }
    stream.read_exact(&mut hdr[..2])?;
    let hlen = if hdr[0] & 0x80 != 0 {
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
    stream.read_exact(&mut hdr[2..hlen])?;
    if s.crc {
        crc.update(&len);
        crc.update(&hdr[..hlen]);
    }
    let payload_len = ulpdu_len - hlen;
    let placement = {
        let mrs = s.mrs.read().expect("MR table lock");
        s.engine
            .lock()
            .expect("QP lock")
            .accept_header(&hdr[..hlen], payload_len, &mrs, pieces)
    };
    control.clear();
    match placement {
        Placement::Data => {
            for p in pieces.iter() {
                let mut at = 0;
                while at < p.len() {
                    let n = p.read_from_fd(at, p.len() - at, s.stream.as_fd())?;
                    if n == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    at += n;
                }
                if s.crc {
                    // SAFETY: read right after placing, not kept; a concurrent
                    // write by the application makes the CRC fail, as on a NIC.
                    crc.update(unsafe { p.bytes() });
                }
            }
        }
        Placement::Control | Placement::Discard => {
            control.resize(payload_len, 0);
            stream.read_exact(&mut control[..])?;
            if s.crc {
                crc.update(control);
            }
        }
    }
    let pad = mpa::pad_len(ulpdu_len);
    let mut trailer = [0u8; 7];
    stream.read_exact(&mut trailer[..pad + 4])?;
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
    let wants = {
        let mrs = s.mrs.read().expect("MR table lock");
        let mut qp = s.engine.lock().expect("QP lock");
        qp.segment_done(control, crc_ok, &mrs);
        qp.wants_transmit()
    };
    s.drain();
    if wants {
        s.kick();
    }
    if !crc_ok {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "MPA CRC error"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
