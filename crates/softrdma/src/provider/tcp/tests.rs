//! iWARP QPs over real loopback TCP: MPA establishment, then SEND, WRITE,
//! READ with the payload placed straight from the socket, the Terminate of a
//! bad STag, and a peer that vanishes mid-transfer.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::*;
use crate::cm::mpa::{self as cm_mpa, Decision, MpaConfig};
use crate::engine::iwarp::IwarpConfig;
use crate::engine::rc::QpCaps;
use crate::engine::{SendOp, Sge, WcStatus, WorkCompletion};
use crate::memory::{Access, Region, RegionMemory};
use crate::verbs::cq::Cq;

const MEM: usize = 4 << 20;
const T: Duration = Duration::from_secs(10);

struct End {
    qp: TcpQp,
    mem: Arc<RegionMemory>,
    scq: Cq,
    rcq: Cq,
    lkey: u32,
    rkey: u32,
    iova: u64,
}

/// An end; with `busy`, of a device in busy-poll mode (its CQs' polls work
/// for its connection).
fn end_with(i: u32, stream: TcpStream, crc: bool, busy: Option<Arc<AtomicBool>>) -> End {
    end_watching(i, stream, crc, busy, PEER_TIMEOUT)
}

/// [`end_with`], failing after `peer_timeout` of a silent peer.
fn end_watching(
    i: u32,
    stream: TcpStream,
    crc: bool,
    busy: Option<Arc<AtomicBool>>,
    peer_timeout: Duration,
) -> End {
    let mem = Arc::new(RegionMemory::zeroed(MEM).unwrap());
    let (lkey, rkey, iova) = (0x100 + i, 0x200 + i, 0x1000_0000 * u64::from(i + 1));
    let mut t = MrTable::new();
    t.insert(Region::new(1, (lkey, rkey), mem.clone(), 0, MEM, iova, Access::ALL).unwrap());
    let mrs = Arc::new(RwLock::new(t));
    let events = Arc::new(EventQueue::new().unwrap());
    let connections = Arc::new(Connections::default());
    let flag = busy.clone().unwrap_or_default();
    let mut scq = Cq::new(256, 1, Some(events.clone())).unwrap();
    let mut rcq = Cq::new(256, 2, Some(events.clone())).unwrap();
    if busy.is_some() {
        scq = scq.polls_connections(&connections, &flag);
        rcq = rcq.polls_connections(&connections, &flag);
    }
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 30,
        max_recv_sge: 4,
        max_inline_data: MAX_INLINE_DATA,
    };
    let cfg = IwarpConfig {
        max_ulpdu: max_ulpdu_for(&stream),
        ird: 4,
        ord: 4,
        ..IwarpConfig::default()
    };
    let engine = IwarpQp::new(0x11 + i, 1, caps, cfg);
    let qp = TcpQp::start(
        stream,
        engine,
        mrs,
        ConnOptions {
            crc,
            busy_poll: flag,
            connections: busy.map(|_| connections),
            peer_timeout,
            srq: None,
        },
        scq.inner.clone(),
        rcq.inner.clone(),
        events,
    )
    .unwrap();
    End {
        qp,
        mem,
        scq,
        rcq,
        lkey,
        rkey,
        iova,
    }
}

/// Two ends connected through MPA on loopback.
fn pair(crc: bool) -> (End, End) {
    connected_with(crc, Link::Direct, None)
}

/// How the bytes go between the two ends.
enum Link {
    Direct,
    /// Through [`forward`] both ways, a few bytes per write.
    Dribbled,
    /// Through [`forward`] both ways; toward the client only while the flag
    /// is clear. The server's sending buffer and the relay's receiving one
    /// are small, so that the server's sends soon meet a full socket.
    Pausable(Arc<AtomicBool>),
}

impl Link {
    fn dribbled(yes: bool) -> Link {
        if yes { Link::Dribbled } else { Link::Direct }
    }
}

/// Two ends (client, server) connected through MPA over `link`; with
/// `busy`, of devices in busy-poll mode.
fn connected_with(crc: bool, link: Link, busy: Option<Arc<AtomicBool>>) -> (End, End) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let server_at = l.local_addr().unwrap();
    let small_buffers = matches!(link, Link::Pausable(_));
    let at = match link {
        Link::Direct => server_at,
        Link::Dribbled | Link::Pausable(_) => {
            let relay = TcpListener::bind("127.0.0.1:0").unwrap();
            let relay_at = relay.local_addr().unwrap();
            let (dribbled, paused) = match link {
                Link::Pausable(p) => (false, p),
                _ => (true, Arc::default()),
            };
            std::thread::spawn(move || {
                let (c, _) = relay.accept().unwrap();
                let s = TcpStream::connect(server_at).unwrap();
                if small_buffers {
                    socket2::SockRef::from(&s)
                        .set_recv_buffer_size(4096)
                        .unwrap();
                }
                let (c2, s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
                std::thread::spawn(move || forward(c, s, dribbled, Arc::default()));
                forward(s2, c2, dribbled, paused);
            });
            relay_at
        }
    };
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let out = cm_mpa::accept(&mut s, &MpaConfig::default(), |_| Decision::Accept).unwrap();
        if small_buffers {
            socket2::SockRef::from(&s)
                .set_send_buffer_size(4096)
                .unwrap();
        }
        (s, out)
    });
    let mut c = TcpStream::connect(at).unwrap();
    let cfg = MpaConfig {
        crc: if crc {
            cm_mpa::CrcPolicy::Required
        } else {
            cm_mpa::CrcPolicy::IfAsked
        },
        ..MpaConfig::default()
    };
    let co = cm_mpa::connect(&mut c, &cfg).unwrap();
    let (s, so) = server.join().unwrap();
    assert_eq!((co.crc, so.crc), (crc, crc));
    (
        end_with(0, c, co.crc, busy.clone()),
        end_with(1, s, so.crc, busy),
    )
}

fn sge(e: &End, off: u64, len: u32) -> Sge {
    Sge {
        addr: e.iova + off,
        len,
        lkey: e.lkey,
    }
}

fn one(cq: &Cq) -> WorkCompletion {
    cq.wait(T).unwrap().expect("a completion within 10 s")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

#[test]
fn send_write_and_read_over_tcp_with_and_without_crc() {
    for crc in [false, true] {
        let (a, b) = pair(crc);
        let data = pattern(300_000, 3);
        a.mem.write(0, &data);
        b.qp.post_recv(RecvWr::new(9, [sge(&b, 0, 400_000)]))
            .unwrap();
        a.qp.post_send(SendWr::new(1, SendOp::Send, vec![sge(&a, 0, 300_000)]))
            .unwrap();
        a.qp.post_send(SendWr::new(
            2,
            SendOp::Write {
                remote_addr: b.iova + 1_000_000,
                rkey: b.rkey,
            },
            vec![sge(&a, 0, 300_000)],
        ))
        .unwrap();
        a.qp.post_send(SendWr::new(
            3,
            SendOp::Read {
                remote_addr: b.iova + 1_000_000,
                rkey: b.rkey,
            },
            vec![sge(&a, 2_000_000, 300_000)],
        ))
        .unwrap();
        for k in 1..=3 {
            let wc = one(&a.scq);
            assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success), "crc {crc}");
        }
        let wc = one(&b.rcq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (9, WcStatus::Success, 300_000)
        );
        let mut got = vec![0u8; 300_000];
        b.mem.read(0, &mut got);
        assert_eq!(got, data, "SEND");
        b.mem.read(1_000_000, &mut got);
        assert_eq!(got, data, "WRITE");
        a.mem.read(2_000_000, &mut got);
        assert_eq!(got, data, "READ");
        // At most a loopback MSS each (32741 here), so several per message.
        assert!(a.qp.with_engine(|q| q.stats().fpdus_sent) >= 11);
    }
}

/// A queue of the largest inline WRITEs, then of WRITEs gathered from 30
/// pieces each, all sent in full batches: every byte lands where it should.
#[test]
fn inline_and_many_piece_writes_fill_batches_and_arrive_whole() {
    let (a, b) = pair(false);
    let inline = MAX_INLINE_DATA as usize;
    // Held, the batch buffers keep both the poster and the transmit thread
    // from sending: the whole queue waits for one go.
    let hold = a.qp.shared.tx.lock().unwrap();
    let mut id = 0;
    for k in 0..24 {
        id += 1;
        let data = pattern(inline, k as u8);
        a.qp.post_send(
            SendWr::new(
                id,
                SendOp::Write {
                    remote_addr: b.iova + (k * inline) as u64,
                    rkey: b.rkey,
                },
                vec![],
            )
            .inline(&data),
        )
        .unwrap();
    }
    // 30 pieces of 1000 bytes, every other 1000 of the source.
    let source = pattern(60_000, 77);
    a.mem.write(1 << 20, &source);
    let pieces: Vec<Sge> = (0..30)
        .map(|j| sge(&a, (1 << 20) + 2000 * j, 1000))
        .collect();
    for k in 0..40u64 {
        id += 1;
        a.qp.post_send(SendWr::new(
            id,
            SendOp::Write {
                remote_addr: b.iova + (2 << 20) + 30_000 * k,
                rkey: b.rkey,
            },
            pieces.clone(),
        ))
        .unwrap();
    }
    drop(hold);
    for k in 1..=id {
        let wc = one(&a.scq);
        assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
    }
    // A WRITE completes once in the socket; a SEND behind them arrives
    // after they are placed.
    b.qp.post_recv(RecvWr::new(99, [sge(&b, 0, 8)])).unwrap();
    a.qp.post_send(SendWr::new(100, SendOp::Send, vec![]))
        .unwrap();
    assert_eq!(one(&b.rcq).status, WcStatus::Success);
    assert_eq!(one(&a.scq).wr_id, 100);
    let mut got = vec![0u8; inline];
    for k in 0..24 {
        b.mem.read(k * inline, &mut got);
        assert!(got == pattern(inline, k as u8), "inline WRITE {k}");
    }
    let gathered: Vec<u8> = (0..30)
        .flat_map(|j| source[2000 * j..2000 * j + 1000].to_vec())
        .collect();
    let mut got = vec![0u8; 30_000];
    for k in 0..40 {
        b.mem.read((2 << 20) + 30_000 * k, &mut got);
        assert!(got == gathered, "gathered WRITE {k}");
    }
}

/// Copies `from` to `to` until either closes; `dribbled`: a few bytes per
/// write (1 to 13, then again), so that the receiver's reads end anywhere:
/// inside a header, a payload, a trailer or the bytes read ahead of the next
/// FPDU. While `paused` is set it leaves the bytes in `from`.
fn forward(mut from: TcpStream, mut to: TcpStream, dribbled: bool, paused: Arc<AtomicBool>) {
    let _ = to.set_nodelay(true);
    let mut buf = [0u8; 4096];
    let mut k = 0usize;
    loop {
        while paused.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut at = 0;
        while at < n {
            k += 1;
            let m = if dribbled {
                (k % 13 + 1).min(n - at)
            } else {
                n - at
            };
            if to.write_all(&buf[at..at + m]).is_err() {
                return;
            }
            at += m;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn fpdus_cut_anywhere_or_read_many_at_once_are_placed_whole() {
    // Busy-poll mode reads up to AHEAD bytes ahead, small FPDUs whole.
    for (crc, dribbled, busy) in [
        (false, true, false),
        (true, true, false),
        (false, false, false),
        (true, false, false),
        (true, false, true),
        (false, true, true),
    ] {
        let busy = busy.then(|| Arc::new(AtomicBool::new(true)));
        let (a, b) = connected_with(crc, Link::dribbled(dribbled), busy);
        let data = pattern(100_000, 5);
        a.mem.write(0, &data);
        // Small SENDs (untagged) and WRITEs (tagged) in turn, then a large
        // WRITE and a READ of it back (Read Request, then responses).
        for k in 0..20u32 {
            b.qp.post_recv(RecvWr::new(
                u64::from(k),
                [sge(&b, 3_000_000 + 64 * u64::from(k), 64)],
            ))
            .unwrap();
        }
        // Not dribbled, the small FPDUs go out in one `writev` (their sender
        // held meanwhile), and a read takes several of them whole.
        let hold = (!dribbled).then(|| a.qp.shared.tx.lock().unwrap());
        let mut id = 0;
        for k in 0..20u32 {
            id += 1;
            a.qp.post_send(SendWr::new(id, SendOp::Send, vec![sge(&a, 0, k + 1)]))
                .unwrap();
            id += 1;
            a.qp.post_send(SendWr::new(
                id,
                SendOp::Write {
                    remote_addr: b.iova + 2_000_000 + 64 * u64::from(k),
                    rkey: b.rkey,
                },
                vec![sge(&a, 0, 2 * k + 1)],
            ))
            .unwrap();
        }
        for (op, wr) in [
            (
                SendOp::Write {
                    remote_addr: b.iova + 1_000_000,
                    rkey: b.rkey,
                },
                sge(&a, 0, 100_000),
            ),
            (
                SendOp::Read {
                    remote_addr: b.iova + 1_000_000,
                    rkey: b.rkey,
                },
                sge(&a, 500_000, 100_000),
            ),
        ] {
            id += 1;
            a.qp.post_send(SendWr::new(id, op, vec![wr])).unwrap();
        }
        drop(hold);
        for k in 1..=id {
            let wc = one(&a.scq);
            assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success), "crc {crc}");
        }
        for k in 0..20u32 {
            let wc = one(&b.rcq);
            assert_eq!(
                (wc.wr_id, wc.status, wc.byte_len),
                (u64::from(k), WcStatus::Success, k + 1),
                "crc {crc}"
            );
            let mut got = vec![0u8; k as usize + 1];
            b.mem.read(3_000_000 + 64 * k as usize, &mut got);
            assert_eq!(got, data[..got.len()], "SEND {k}");
            let mut got = vec![0u8; 2 * k as usize + 1];
            b.mem.read(2_000_000 + 64 * k as usize, &mut got);
            assert_eq!(got, data[..got.len()], "WRITE {k}");
        }
        let mut got = vec![0u8; 100_000];
        b.mem.read(1_000_000, &mut got);
        assert_eq!(got, data, "large WRITE, crc {crc}");
        a.mem.read(500_000, &mut got);
        assert_eq!(got, data, "READ, crc {crc}");
        // A small SEND across two receive pieces (it goes through a buffer).
        b.qp.post_recv(RecvWr::new(
            99,
            [sge(&b, 3_500_000, 5), sge(&b, 3_500_100, 60)],
        ))
        .unwrap();
        a.qp.post_send(SendWr::new(99, SendOp::Send, vec![sge(&a, 7, 30)]))
            .unwrap();
        assert_eq!(one(&a.scq).status, WcStatus::Success);
        let wc = one(&b.rcq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (99, WcStatus::Success, 30)
        );
        let (mut head, mut rest) = ([0u8; 5], [0u8; 25]);
        b.mem.read(3_500_000, &mut head);
        b.mem.read(3_500_100, &mut rest);
        assert_eq!(
            (&head[..], &rest[..]),
            (&data[7..12], &data[12..37]),
            "crc {crc}"
        );
    }
}

#[test]
fn a_bad_stag_is_terminated_and_the_connection_closes() {
    let (a, b) = pair(false);
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: b.iova,
            rkey: 0xbad,
        },
        vec![sge(&a, 0, 100)],
    ))
    .unwrap();
    // The WRITE went out (and completed); the Terminate comes back and the
    // QP goes to ERROR, after which what is posted is flushed.
    assert_eq!(one(&a.scq).status, WcStatus::Success);
    let t0 = std::time::Instant::now();
    while a.qp.with_engine(|q| q.state()) != crate::engine::QpState::Err {
        assert!(t0.elapsed() < T, "the requester never saw the Terminate");
        std::thread::sleep(Duration::from_millis(2));
    }
    a.qp.post_send(SendWr::new(2, SendOp::Send, vec![sge(&a, 0, 8)]))
        .unwrap();
    let wc = one(&a.scq);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::WrFlushErr));
    let t = b.qp.with_engine(|q| q.own_terminate().map(|t| t.control));
    assert_eq!(
        t.map(|c| (c.layer, c.etype, c.code)),
        Some((softrdma_wire::rdmap::Layer::Ddp, 1, 0x00))
    );
    let seen = a.qp.with_engine(|q| q.peer_terminate().map(|t| t.control));
    assert_eq!(seen, t, "the Terminate reached the requester");
}

#[test]
fn a_peer_that_vanishes_mid_transfer_flushes_and_never_hangs() {
    let (a, b) = pair(false);
    a.qp.post_recv(RecvWr::new(50, [sge(&a, 0, 64)])).unwrap();
    for k in 0..8 {
        a.qp.post_send(SendWr::new(
            k,
            SendOp::Write {
                remote_addr: b.iova,
                rkey: b.rkey,
            },
            vec![sge(&a, 0, 4 << 20)],
        ))
        .unwrap();
    }
    a.qp.post_send(SendWr::new(
        99,
        SendOp::Read {
            remote_addr: b.iova,
            rkey: b.rkey,
        },
        vec![sge(&a, 0, 64)],
    ))
    .unwrap();
    // The target goes away while 32 MiB are on their way, so the READ
    // queued behind them cannot have been answered (with a longer wait,
    // loopback sometimes finished it all first).
    std::thread::sleep(Duration::from_millis(1));
    drop(b);
    let mut statuses = Vec::new();
    while statuses.len() < 9 {
        statuses.push(one(&a.scq));
    }
    let last = statuses.last().unwrap();
    assert_eq!(last.wr_id, 99);
    assert_eq!(last.status, WcStatus::WrFlushErr, "{statuses:?}");
    let r = one(&a.rcq);
    assert_eq!((r.wr_id, r.status), (50, WcStatus::WrFlushErr));
    assert_eq!(a.qp.with_engine(|q| q.state()), crate::engine::QpState::Err);
}

/// A transmit thread that panics (a bug) fails the QP too, though the
/// receive thread sits in a read that would never end (its lock held).
#[test]
fn a_transmit_thread_that_panics_fails_the_qp_and_flushes() {
    let (a, b) = pair(false);
    a.qp.post_recv(RecvWr::new(5, [sge(&a, 0, 64)])).unwrap();
    a.qp.shared.panic_in_tx.store(true, Ordering::SeqCst);
    // Too large for the poster's own thread: the transmit thread's.
    a.qp.post_send(SendWr::new(
        6,
        SendOp::Write {
            remote_addr: b.iova,
            rkey: b.rkey,
        },
        vec![sge(&a, 0, 1 << 20)],
    ))
    .unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (6, WcStatus::WrFlushErr));
    let r = one(&a.rcq);
    assert_eq!((r.wr_id, r.status), (5, WcStatus::WrFlushErr));
    let deadline = std::time::Instant::now() + T;
    while b.qp.with_engine(|q| q.state()) != crate::engine::QpState::Err {
        assert!(
            std::time::Instant::now() < deadline,
            "the peer never failed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A receive thread that panics (a bug) fails the QP as a lost connection
/// does: its work is flushed, the peer sees the stream end, nobody hangs.
#[test]
fn a_receive_thread_that_panics_fails_the_qp_and_flushes() {
    let (a, b) = pair(false);
    for k in 0..2 {
        b.qp.post_recv(RecvWr::new(k, [sge(&b, k * 64, 64)]))
            .unwrap();
    }
    b.qp.shared.panic_in_rx.store(true, Ordering::SeqCst);
    a.qp.post_send(SendWr::new(7, SendOp::Send, vec![sge(&a, 0, 8)]))
        .unwrap();
    let got: Vec<(u64, WcStatus)> = (0..2)
        .map(|_| {
            let w = one(&b.rcq);
            (w.wr_id, w.status)
        })
        .collect();
    // The panic comes before the SEND is placed or after it: the first
    // receive completes either way, flushed or not, and the second is flushed.
    assert_eq!(got[0].0, 0);
    assert_eq!(got[1], (1, WcStatus::WrFlushErr));
    assert_eq!(b.qp.with_engine(|q| q.state()), crate::engine::QpState::Err);
    // The peer sees the connection end.
    let deadline = std::time::Instant::now() + T;
    while a.qp.with_engine(|q| q.state()) != crate::engine::QpState::Err {
        assert!(
            std::time::Instant::now() < deadline,
            "the peer never failed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Spins on `cq` (a busy-polling application) until a completion comes.
fn spin(cq: &Cq) -> WorkCompletion {
    let deadline = std::time::Instant::now() + T;
    loop {
        if let Some(wc) = cq.poll_one().unwrap() {
            return wc;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no completion in 10 s"
        );
        std::hint::spin_loop();
    }
}

#[test]
fn busy_polling_threads_receive_and_large_or_cut_fpdus_still_arrive() {
    for dribbled in [false, true] {
        let busy = Arc::new(AtomicBool::new(true));
        let (a, b) = connected_with(true, Link::dribbled(dribbled), Some(busy));
        // A ping-pong of SENDs, each side spinning on its CQs: after the
        // first, the polls receive (the receive threads stand by).
        let rounds = 40;
        for k in 0..rounds {
            b.qp.post_recv(RecvWr::new(k, [sge(&b, 0, 64)])).unwrap();
            a.qp.post_recv(RecvWr::new(k, [sge(&a, 0, 64)])).unwrap();
        }
        for k in 0..rounds {
            a.mem.write(128, &pattern(64, k as u8));
            a.qp.post_send(SendWr::new(k, SendOp::Send, [sge(&a, 128, 64)]))
                .unwrap();
            assert_eq!(spin(&a.scq).status, WcStatus::Success);
            let r = spin(&b.rcq);
            assert_eq!((r.wr_id, r.status, r.byte_len), (k, WcStatus::Success, 64));
            let mut got = vec![0u8; 64];
            b.mem.read(0, &mut got);
            assert_eq!(got, pattern(64, k as u8));
            b.qp.post_send(SendWr::new(k, SendOp::Send, [sge(&b, 0, 64)]))
                .unwrap();
            assert_eq!(spin(&b.scq).status, WcStatus::Success);
            assert_eq!(spin(&a.rcq).status, WcStatus::Success);
        }
        assert!(
            b.qp.polled_fpdus() > 0,
            "dribbled {dribbled}: no poll received"
        );
        // FPDUs larger than a poll takes (loopback's MSS makes them about 64
        // KiB) go to the receive thread while the application spins.
        let big = pattern(1 << 20, 9);
        a.mem.write(0, &big);
        b.qp.post_recv(RecvWr::new(77, [sge(&b, 0, 8)])).unwrap();
        a.qp.post_send(SendWr::new(
            1,
            SendOp::Write {
                remote_addr: b.iova + (1 << 20),
                rkey: b.rkey,
            },
            vec![sge(&a, 0, 1 << 20)],
        ))
        .unwrap();
        a.qp.post_send(SendWr::new(2, SendOp::Send, [sge(&a, 0, 8)]))
            .unwrap();
        let r = spin(&b.rcq);
        assert_eq!((r.wr_id, r.status), (77, WcStatus::Success));
        let mut got = vec![0u8; 1 << 20];
        b.mem.read(1 << 20, &mut got);
        assert!(got == big, "the 1 MiB WRITE's bytes");
        // An application that stops polling and sleeps in a wait: the
        // receive thread takes over.
        b.qp.post_recv(RecvWr::new(78, [sge(&b, 0, 8)])).unwrap();
        a.qp.post_send(SendWr::new(3, SendOp::Send, [sge(&a, 0, 8)]))
            .unwrap();
        let r = one(&b.rcq);
        assert_eq!((r.wr_id, r.status), (78, WcStatus::Success));
    }
}

#[test]
fn a_read_answered_into_a_full_socket_leaves_the_receiving_thread_free() {
    // A (client) -> relay -> B (server). B answers A's READs on its
    // receiving thread; with the relay paused toward A, B's socket fills.
    let to_a_paused = Arc::new(AtomicBool::new(false));
    let (a, b) = connected_with(false, Link::Pausable(to_a_paused.clone()), None);

    const LEN: usize = 16 << 10;
    const READS: usize = 4; // the ORD: more would hold the SEND back in A's queue
    for k in 0..READS {
        b.mem.write(k * LEN, &pattern(LEN, k as u8));
    }
    b.qp.post_recv(RecvWr::new(9, [sge(&b, 1 << 20, 64)]))
        .unwrap();
    to_a_paused.store(true, Ordering::Relaxed);
    // One READ at a time reaches B (each the only one it holds), and each
    // answer goes into a socket the relay no longer empties.
    for k in 0..READS {
        a.qp.post_send(SendWr::new(
            k as u64,
            SendOp::Read {
                remote_addr: b.iova + (k * LEN) as u64,
                rkey: b.rkey,
            },
            [sge(&a, (2 << 20) + (k * LEN) as u64, LEN as u32)],
        ))
        .unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    // B still receives: a SEND from A completes while its answers wait.
    a.qp.post_send(SendWr::new(99, SendOp::Send, [sge(&a, 0, 64)]))
        .unwrap();
    let wc = one(&b.rcq);
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::Success));
    assert!(
        b.qp.deferred_bytes() > 0,
        "no answer met a full socket: the test did not test"
    );
    assert!(
        a.scq.poll_one().unwrap().is_none(),
        "a READ completed through a paused relay"
    );
    to_a_paused.store(false, Ordering::Relaxed);
    let mut done: Vec<u64> = (0..=READS)
        .map(|_| one(&a.scq))
        .map(|wc| {
            assert_eq!(wc.status, WcStatus::Success);
            wc.wr_id
        })
        .collect();
    done.sort_unstable();
    assert_eq!(done, (0..READS as u64).chain([99]).collect::<Vec<_>>());
    for k in 0..READS {
        let mut got = vec![0u8; LEN];
        a.mem.read((2 << 20) + k * LEN, &mut got);
        assert!(got == pattern(LEN, k as u8), "READ {k} arrived wrong");
    }
}

/// A made-up peer's FPDU of `ulpdu`: its length, the pad, the CRC (zero
/// without `crc`).
fn made_up_fpdu(ulpdu: &[u8], crc: bool) -> Vec<u8> {
    let mut f = (ulpdu.len() as u16).to_be_bytes().to_vec();
    f.extend_from_slice(ulpdu);
    f.resize(f.len() + mpa::pad_len(ulpdu.len()), 0);
    let sum = if crc {
        let mut c = Crc32c::default();
        c.update(&f);
        c.finish()
    } else {
        0
    };
    f.extend_from_slice(&sum.to_le_bytes());
    f
}

/// A client stream through MPA to a made-up peer accepted on `l`: the
/// stream, whether CRC is on, and the peer's stream.
fn through_mpa_to_a_made_up_peer(l: TcpListener) -> (TcpStream, bool, TcpStream) {
    let at = l.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        cm_mpa::accept(&mut s, &MpaConfig::default(), |_| Decision::Accept).unwrap();
        s
    });
    let mut c = TcpStream::connect(at).unwrap();
    let co = cm_mpa::connect(&mut c, &MpaConfig::default()).unwrap();
    (c, co.crc, peer.join().unwrap())
}

/// A peer that takes the MPA exchange and then neither reads nor closes (a
/// host gone, a process hung): once what was sent stays unacknowledged for
/// the peer timeout, the QP fails and flushes instead of waiting for TCP's
/// retries (some 15 minutes).
#[test]
fn a_silent_peer_fails_the_qp_after_the_peer_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    // Inherited by the accepted socket: its window soon shuts.
    socket2::SockRef::from(&l)
        .set_recv_buffer_size(4096)
        .unwrap();
    let (c, crc, _silent) = through_mpa_to_a_made_up_peer(l);
    let timeout = Duration::from_secs(1);
    let a = end_watching(0, c, crc, None, timeout);
    let sock = socket2::SockRef::from(&a.qp.shared.stream);
    assert_eq!(sock.tcp_user_timeout().unwrap(), Some(timeout));
    assert!(sock.keepalive().unwrap());
    a.qp.post_recv(RecvWr::new(50, [sge(&a, 0, 64)])).unwrap();
    for k in 0..8 {
        a.qp.post_send(SendWr::new(
            k,
            SendOp::Write {
                remote_addr: 0x1000,
                rkey: 0x1234,
            },
            vec![sge(&a, 0, 4 << 20)],
        ))
        .unwrap();
    }
    // The window shuts long before 32 MiB are in; TCP's probes of it go
    // unanswered by any read, and the connection is dropped.
    let mut statuses = Vec::new();
    while statuses.len() < 8 {
        let wc = one(&a.scq);
        statuses.push((wc.wr_id, wc.status));
    }
    assert!(
        statuses.iter().any(|s| s.1 == WcStatus::WrFlushErr),
        "{statuses:?}"
    );
    let r = one(&a.rcq);
    assert_eq!((r.wr_id, r.status), (50, WcStatus::WrFlushErr));
    assert_eq!(a.qp.with_engine(|q| q.state()), crate::engine::QpState::Err);
}

/// A peer that sends a Terminate and keeps its half of the stream open:
/// this side ends the stream (its FIN at once, the connection within
/// `LINGER`) instead of holding the socket for the QP's life.
#[test]
fn a_peer_terminate_ends_the_stream_even_if_the_peer_keeps_it_open() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let (c, crc, mut theirs) = through_mpa_to_a_made_up_peer(l);
    let a = end_with(0, c, crc, None);
    a.qp.post_recv(RecvWr::new(50, [sge(&a, 0, 64)])).unwrap();
    // An untagged DDP segment to queue 2 (MSN 1, last), RDMAP version 1
    // opcode Terminate, its control: layer RDMAP, remote protection error,
    // invalid STag, no headers copied.
    let mut ulpdu = vec![0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0];
    ulpdu.extend_from_slice(&[0x01, 0x00, 0x00, 0x00]);
    let t = made_up_fpdu(&ulpdu, crc);
    std::io::Write::write_all(&mut theirs, &t).unwrap();
    let r = one(&a.rcq);
    assert_eq!((r.wr_id, r.status), (50, WcStatus::WrFlushErr));
    assert!(a.qp.with_engine(|q| q.peer_terminate().is_some()));
    // This side's half ends at once (its FIN) ...
    theirs
        .set_read_timeout(Some(LINGER + Duration::from_secs(3)))
        .unwrap();
    let mut rest = Vec::new();
    let t0 = std::time::Instant::now();
    let read = std::io::Read::read_to_end(&mut theirs, &mut rest);
    assert!(
        read.is_ok()
            || read
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "the stream was not ended: {read:?} after {:?}",
        t0.elapsed()
    );
    // ... and, the peer keeping its own half open, the connection within
    // LINGER.
    while !a.qp.shared.lingered.load(Ordering::Acquire) {
        assert!(
            t0.elapsed() < LINGER + Duration::from_secs(3),
            "the connection was not ended"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(theirs);
}

/// A busy-polling application whose peer (after MPA) sends `bytes` and
/// then, if `close`, closes: the poll that takes them fails the QP, which
/// flushes the receive the application spins for; no poll blocks in a
/// read, and none spins on for good.
fn a_poller_meets(bytes: &'static [u8], close: bool) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let (c, crc, mut theirs) = through_mpa_to_a_made_up_peer(l);
    let busy = Arc::new(AtomicBool::new(true));
    let a = Arc::new(end_with(0, c, crc, Some(busy)));
    a.qp.post_recv(RecvWr::new(50, [sge(&a, 0, 64)])).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let polling = {
        let a = a.clone();
        std::thread::spawn(move || {
            let wc = spin(&a.rcq);
            let _ = tx.send((wc.wr_id, wc.status));
        })
    };
    // Good FPDUs first (zero-length WRITEs, which place nothing): the
    // receive thread, waiting in its read, takes the first, then stands by
    // while the application polls, whose polls take the rest.
    let mut write = vec![0xc1, 0x40];
    write.resize(14, 0);
    let good = made_up_fpdu(&write, crc);
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(50));
        std::io::Write::write_all(&mut theirs, &good).unwrap();
    }
    // The second went to a poll: the receive thread stands by, and what
    // follows is the polls' too.
    let t0 = std::time::Instant::now();
    while a.qp.polled_fpdus() < 1 {
        assert!(t0.elapsed() < T, "no poll took the second FPDU");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::io::Write::write_all(&mut theirs, bytes).unwrap();
    // Kept open, or closed.
    let _open = (!close).then_some(theirs);
    let got = rx
        .recv_timeout(T + Duration::from_secs(5))
        .expect("the polling application hung");
    assert_eq!(got, (50, WcStatus::WrFlushErr));
    polling.join().unwrap();
    assert_eq!(a.qp.with_engine(|q| q.state()), crate::engine::QpState::Err);
}

/// An FPDU whose length leaves no room for a DDP header, from a peer that
/// then says nothing: the stream fails, instead of a poll waiting for the
/// rest of the FPDU (12 bytes, 20 with CRC: not all sent; the poll's own
/// check fails it, else the receive thread's once it takes over) or
/// blocking in a read for header bytes that never come (0 bytes, 8 with
/// CRC: all sent).
#[test]
fn a_poll_that_meets_an_fpdu_too_short_for_a_header_fails_the_qp() {
    a_poller_meets(&[0x00, 0x0c], false);
    a_poller_meets(&[0; 8], false);
}

/// Part of a small FPDU, then the peer closes: the poll finds the end.
#[test]
fn a_poll_that_meets_a_cut_fpdu_and_the_end_fails_the_qp() {
    a_poller_meets(&[0x00, 0x20, 0x80, 0x41, 0, 0, 0, 0, 0, 0], true);
}
