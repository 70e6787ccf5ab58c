use std::time::{Duration, Instant};

use super::*;
use crate::cm::shm::{Listener, connect};
use crate::verbs::{Device, QpInit};

fn send_msg(sock: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    send_by(
        sock,
        msg,
        fds,
        Instant::now() + Duration::from_secs(5),
        &|| false,
    )
}

/// One side's objects: context, PD, CQ, QP.
type Side = (
    crate::verbs::Context,
    crate::verbs::Pd,
    crate::verbs::Cq,
    crate::verbs::Qp,
);

/// Two connected QPs of two shm contexts, `name` unique per test.
fn connected(name: &str) -> (Side, Side) {
    let make = || {
        let ctx = Device::shm().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        (ctx, pd, cq, qp)
    };
    let b = make();
    let name = format!("unit-{}-{name}", std::process::id());
    let l = Listener::bind(&b.0, &name).unwrap();
    let a = make();
    std::thread::scope(|s| {
        let t = s.spawn(|| l.accept(&b.3).unwrap());
        connect(&a.3, &name).unwrap();
        t.join().unwrap();
    });
    (a, b)
}

#[test]
fn a_peer_that_writes_a_wild_completion_count_fails_the_qp_instead_of_looping() {
    let ((_a_ctx, _a_pd, _a_cq, a_qp), (_b_ctx, _b_pd, _b_cq, b_qp)) = connected("wild");
    // a, misbehaving: says it put 2^40 completions on b's ring.
    let a = a_qp.shm_conn().unwrap();
    a.peer.mem.store(CQ_HEAD, 1 << 40);
    a.peer.wake();
    let t = Instant::now();
    while b_qp.state() != QpState::Err {
        assert!(t.elapsed() < Duration::from_secs(5), "b noticed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A peer's completion names the oldest receive and, for a SEND, at most
/// its length, whatever it writes: a made-up work request ID went to the
/// application as given, with a length beyond the receive's buffers.
#[test]
fn a_peers_completion_cannot_name_another_receive_or_overstate_its_length() {
    let ((_a_ctx, _a_pd, _a_cq, a_qp), (_b_ctx, b_pd, b_cq, b_qp)) = connected("wrid");
    let mr = b_pd.register(4096, crate::memory::Access::ALL).unwrap();
    b_qp.post_recv(crate::engine::RecvWr::new(7, [mr.sge(0, 16)]))
        .unwrap();
    // a, misbehaving: completes "receive 99" with a megabyte.
    let a = a_qp.shm_conn().unwrap();
    let m = &a.peer.mem;
    let head = m.load(CQ_HEAD);
    let mut slot = [0u8; CQ_SLOT];
    slot[0..8].copy_from_slice(&99u64.to_le_bytes());
    slot[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
    m.write(a.peer.cq_slot(head), &slot);
    m.store(CQ_HEAD, head + 1);
    a.peer.wake();
    let wc = b_cq
        .wait(Duration::from_secs(5))
        .unwrap()
        .expect("a completion");
    assert_eq!((wc.wr_id, wc.byte_len), (7, 16));
}

/// A receive the peer took is not flushed while the peer may still copy
/// into it: the side that ends the connection waits for the peer to say it
/// has let go (the end of its stream, after its copy). It was flushed after
/// 50 ms, and a slower copy went on into a buffer the application had back.
/// Ended by a move to ERR, and by a message it can't take.
#[test]
fn a_taken_receive_is_not_flushed_while_the_peer_still_copies_into_it() {
    for by_message in [false, true] {
        let name = format!("mid-copy-{by_message}");
        let ((_a_ctx, _a_pd, _a_cq, a_qp), (_b_ctx, b_pd, b_cq, b_qp)) = connected(&name);
        let mr = b_pd.register(4096, crate::memory::Access::ALL).unwrap();
        b_qp.post_recv(crate::engine::RecvWr::new(5, [mr.sge(0, 64)]))
            .unwrap();
        // a, in the middle of a SEND into that receive: it holds its send
        // queue's lock, as a copy does, and has taken the receive.
        let a = a_qp.shm_conn().unwrap();
        let copying = a.sq.lock();
        let taken = a.take_receive().expect("the posted receive");
        let b_qp = std::sync::Arc::new(b_qp);
        let ending = b_qp.clone();
        let to_err = std::thread::spawn(move || {
            if by_message {
                // Not a message b knows: b ends the connection.
                send_msg(a_qp.shm_conn().unwrap().sock.as_fd(), &[0xee; 8], &[]).unwrap();
            } else {
                let err = crate::verbs::QpAttr {
                    state: Some(QpState::Err),
                    ..Default::default()
                };
                ending.modify(&err, None).unwrap();
            }
            a_qp
        });
        // Longer than the 50 ms after which it was flushed, well within the
        // second the peer has to answer.
        std::thread::sleep(Duration::from_millis(200));
        let early = b_cq.poll_one().unwrap();
        // The copy ends: the receive completes, then a lets go.
        a.put_completion(&taken, 64, false, WcStatus::Success, None, false);
        drop(copying);
        let _a_qp = to_err.join().unwrap();
        assert!(
            early.is_none(),
            "flushed while the peer copies (by message: {by_message}): {early:?}"
        );
        let wc = b_cq
            .wait(Duration::from_secs(5))
            .unwrap()
            .expect("the receive");
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (5, WcStatus::Success, 64)
        );
    }
}

/// A made-up peer's HELLO over `sock`: a real inbox (whose QP access word,
/// 0, refuses every remote operation), and `event` as its eventfd.
fn send_hello(sock: BorrowedFd<'_>, event: BorrowedFd<'_>) -> RegionMemory {
    let (inbox, inbox_fd) = mapping::create(inbox_len(4), "test-inbox").unwrap();
    let mut hello = [0u8; 16];
    hello[0] = HELLO;
    hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
    hello[12..16].copy_from_slice(&4u32.to_le_bytes());
    send_msg(sock, &hello, &[inbox_fd.as_fd(), event]).unwrap();
    inbox
}

/// A made-up peer's REGION message: region `k` of 4096 bytes, every right.
fn region_message(k: u32) -> [u8; 32] {
    let mut m = [0u8; 32];
    m[0] = REGION;
    m[4..8].copy_from_slice(&(0x100 + 2 * k).to_le_bytes());
    m[8..12].copy_from_slice(&(0x101 + 2 * k).to_le_bytes());
    m[12..16].copy_from_slice(&Access::ALL.bits().to_le_bytes());
    m[24..32].copy_from_slice(&4096u64.to_le_bytes());
    m
}

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}

/// A peer on the other end of `ours`: its hello, then `regions` REGION
/// messages of one memfd, `gap` apart, then READY; it stops once `ours` is
/// closed.
fn a_peer_announcing(regions: u32, gap: Duration) -> (OwnedFd, std::thread::JoinHandle<()>) {
    let (ours, theirs) = seqpacket_pair();
    let event = rustix::event::eventfd(0, EventfdFlags::CLOEXEC).unwrap();
    let peer = std::thread::spawn(move || {
        let _inbox = send_hello(theirs.as_fd(), event.as_fd());
        let (_mem, fd) = mapping::create(4096, "test-region").unwrap();
        for k in 0..regions {
            let m = region_message(k);
            if send_msg(theirs.as_fd(), &m, &[fd.as_fd()]).is_err() {
                return;
            }
            std::thread::sleep(gap);
        }
        let _ = send_msg(theirs.as_fd(), &[READY], &[]);
    });
    (ours, peer)
}

#[test]
fn a_peer_that_dribbles_its_regions_times_out_within_the_exchanges_limit() {
    // A region every 100 ms: each message well within the limit, all of
    // them (and the READY after them) not.
    let (ours, peer) = a_peer_announcing(20, Duration::from_millis(100));
    let t = Instant::now();
    let Err(e) = read_peer(ours.as_fd(), Deadline::after(Duration::from_millis(300))) else {
        panic!("the exchange went on past its limit");
    };
    assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
    assert!(e.to_string().contains("within 0.3 s"), "{e}");
    assert!(
        t.elapsed() < Duration::from_millis(800),
        "{:?}",
        t.elapsed()
    );
    drop(ours);
    peer.join().unwrap();
}

/// A blocking eventfd (made non-blocking here), and anything else refused:
/// a pipe or socket whose other end closed raises SIGPIPE on a wake-up, a
/// file can block it.
#[test]
fn the_peers_wake_up_descriptor_must_be_an_eventfd_and_is_made_non_blocking() {
    let (ours, theirs) = seqpacket_pair();
    let event = rustix::event::eventfd(0, EventfdFlags::CLOEXEC).unwrap();
    let flags = || rustix::fs::fcntl_getfl(&event).unwrap();
    assert!(!flags().contains(rustix::fs::OFlags::NONBLOCK));
    let _inbox = send_hello(theirs.as_fd(), event.as_fd());
    send_msg(theirs.as_fd(), &[READY], &[]).unwrap();
    let (_, peer_event, _, regions) =
        read_peer(ours.as_fd(), Deadline::after(Duration::from_secs(5))).unwrap();
    assert!(regions.is_empty());
    assert!(flags().contains(rustix::fs::OFlags::NONBLOCK));
    drop(peer_event);

    let (ours, theirs) = seqpacket_pair();
    let (socket, _other_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let _inbox = send_hello(theirs.as_fd(), socket.as_fd());
    send_msg(theirs.as_fd(), &[READY], &[]).unwrap();
    let Err(e) = read_peer(ours.as_fd(), Deadline::after(Duration::from_secs(5))) else {
        panic!("a socket taken for the peer's eventfd");
    };
    assert!(e.to_string().contains("not an eventfd"), "{e}");
}

/// A peer that stops reading after the exchange (a process stopped, hung):
/// a deregistration it can't acknowledge ends the connection, since the
/// peer might still reach the region; registers never block on it.
/// A QP of `pd` connected to a made-up peer: HELLO, READY, then silence
/// (it never reads). Keep what it returns alive as long as the peer.
fn connected_to_a_mute_peer(
    ctx: &crate::verbs::Context,
    pd: &crate::verbs::Pd,
    cq: &crate::verbs::Cq,
    name: &str,
) -> (crate::verbs::Qp, impl Sized + use<>) {
    let qp = pd.create_qp(&QpInit::rc(cq, cq)).unwrap();
    let name = format!("unit-{}-{name}", std::process::id());
    let l = Listener::bind(ctx, &name).unwrap();
    let peer = crate::provider::unix_seqpacket(rustix::net::SocketFlags::empty()).unwrap();
    rustix::net::connect(
        &peer,
        &rustix::net::SocketAddrUnix::new_abstract_name(format!("softrdma-shm/{name}").as_bytes())
            .unwrap(),
    )
    .unwrap();
    let event = rustix::event::eventfd(0, EventfdFlags::CLOEXEC).unwrap();
    let inbox = send_hello(peer.as_fd(), event.as_fd());
    send_msg(peer.as_fd(), &[READY], &[]).unwrap();
    l.accept(&qp).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    (qp, (peer, event, inbox))
}

#[test]
fn a_peer_that_stops_answering_is_dropped_when_a_region_is_revoked() {
    let ctx = Device::shm().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let (qp, _peer) = connected_to_a_mute_peer(&ctx, &pd, &cq, "mute");
    // Unacknowledged, a registration waits its second and goes on.
    let t = Instant::now();
    let mr = pd.register(4096, crate::memory::Access::ALL).unwrap();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(qp.state(), QpState::Rts);
    // The next doesn't wait for it again: a peer that never answers costs
    // one second, not one per registration.
    let t = Instant::now();
    let _second = pd.register(4096, crate::memory::Access::ALL).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    drop(mr);
    let t = Instant::now();
    while qp.state() != QpState::Err {
        assert!(t.elapsed() < Duration::from_secs(5), "the QP never failed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // And registering goes on without it.
    let t = Instant::now();
    let _mr = pd.register(4096, crate::memory::Access::ALL).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}

/// A PD with three QPs, each connected to a mute peer; `tag` unique per
/// test.
#[allow(clippy::type_complexity)]
fn three_mute_peers(
    tag: &str,
) -> (
    crate::verbs::Context,
    crate::verbs::Pd,
    crate::verbs::Cq,
    Vec<(crate::verbs::Qp, impl Sized + use<>)>,
) {
    let ctx = Device::shm().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let peers = (0..3)
        .map(|k| connected_to_a_mute_peer(&ctx, &pd, &cq, &format!("{tag}{k}")))
        .collect();
    (ctx, pd, cq, peers)
}

/// Peers that stop answering are waited for together: three cost a
/// registration and a deregistration one wait each, not three (each was
/// waited for in turn).
#[test]
fn mute_peers_cost_one_wait_not_one_each() {
    let (_ctx, pd, _cq, peers) = three_mute_peers("mute");
    let t = Instant::now();
    let mr = pd.register(4096, crate::memory::Access::ALL).unwrap();
    let took = t.elapsed();
    assert!(took >= ACK_WAIT, "no wait: {took:?}");
    assert!(took < 2 * ACK_WAIT, "{took:?}");
    let t = Instant::now();
    drop(mr);
    let took = t.elapsed();
    assert!(took >= ACK_WAIT, "no wait: {took:?}");
    assert!(took < 2 * ACK_WAIT, "{took:?}");
    for (qp, _) in &peers {
        assert_eq!(qp.state(), QpState::Err);
    }
}

/// Peers that never read fill their queues: then a send into each waits
/// for room, and those waits are shared too (each was up to a second).
#[test]
fn mute_peers_with_full_queues_cost_one_wait_not_one_each() {
    let (_ctx, pd, _cq, peers) = three_mute_peers("full");
    let mut regions = Vec::new();
    let mut slowest = Duration::ZERO;
    // The first waits out the answers; the rest go unanswered into the
    // queues until they are full.
    while peers.iter().any(|(qp, _)| qp.state() == QpState::Rts) {
        assert!(regions.len() < 10_000, "the queues never filled");
        let t = Instant::now();
        regions.push(pd.register(4096, crate::memory::Access::ALL).unwrap());
        slowest = slowest.max(t.elapsed());
    }
    assert!(slowest < ACK_WAIT + ACK_WAIT / 2, "{slowest:?}");
}

/// Each region a peer announces is a mapping here: a peer announcing one
/// memfd over and over (which costs it nothing) is refused past the cap,
/// before the process runs out of mappings.
#[test]
fn a_peer_that_announces_too_many_regions_is_refused() {
    let (ours, peer) = a_peer_announcing(MAX_PEER_REGIONS as u32 + 1, Duration::ZERO);
    let Err(e) = read_peer(ours.as_fd(), Deadline::after(Duration::from_secs(20))) else {
        panic!("the peer's regions were all taken");
    };
    assert!(e.to_string().contains("more than 4096 regions"), "{e}");
    drop(ours);
    peer.join().unwrap();
}

/// A progress thread that panics (a bug) ends the connection as any failure
/// does: this side's receives are flushed, the peer ends too, nobody hangs.
#[test]
fn a_progress_thread_that_panics_ends_the_connection_and_flushes() {
    let ((_a_ctx, _a_pd, _a_cq, a_qp), (_b_ctx, b_pd, b_cq, b_qp)) = connected("panics");
    let mr = b_pd.register(4096, crate::memory::Access::ALL).unwrap();
    b_qp.post_recv(crate::engine::RecvWr::new(7, [mr.sge(0, 16)]))
        .unwrap();
    let b = b_qp.shm_conn().unwrap();
    b.panic_in_progress.store(true, Ordering::SeqCst);
    b.mine.wake();
    let wc = b_cq
        .wait(Duration::from_secs(5))
        .unwrap()
        .expect("the receive, flushed");
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::WrFlushErr));
    assert_eq!(b_qp.state(), QpState::Err);
    let t = Instant::now();
    while a_qp.state() != QpState::Err {
        assert!(t.elapsed() < Duration::from_secs(5), "the peer never ended");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A stream of large WRITEs and READs (the copy helper's sizes) moves every
/// byte, and the helper takes chunks of them: copies go on until it has
/// (it stays away while the CPUs are busy, as under a parallel test run).
#[test]
fn large_copies_shared_with_the_copy_helper_move_every_byte() {
    use crate::engine::{SendOp, SendWr};
    use crate::memory::Access;
    let ((_a_ctx, a_pd, a_cq, a_qp), (_b_ctx, b_pd, _b_cq, _b_qp)) = connected("helper");
    let len = 1 << 20;
    let a_mr = a_pd.register(2 * len, Access::ALL).unwrap();
    let b_mr = b_pd.register(len, Access::ALL).unwrap();
    let before = copier::CHUNKS_HELPED.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut round = 0u32;
    loop {
        // Sizes from the smallest shared copy up, at offsets not aligned.
        let size = [32 << 10, 65536 + 3, 300_001, len - 8][round as usize % 4];
        let data: Vec<u8> = (0..size)
            .map(|i| (i as u32 ^ (i as u32 >> 9) ^ round) as u8)
            .collect();
        a_mr.write(5, &data).unwrap();
        let write = SendOp::Write {
            remote_addr: b_mr.addr() + 7,
            rkey: b_mr.rkey(),
        };
        a_qp.post_send(SendWr::new(1, write, vec![a_mr.sge(5, size as u32)]))
            .unwrap();
        let wc = a_cq.wait(Duration::from_secs(5)).unwrap().expect("WRITE");
        assert_eq!(wc.status, WcStatus::Success);
        assert!(b_mr.read_vec(7, size).unwrap() == data, "WRITE {round}");
        let read = SendOp::Read {
            remote_addr: b_mr.addr() + 7,
            rkey: b_mr.rkey(),
        };
        a_qp.post_send(SendWr::new(2, read, vec![a_mr.sge(len + 1, size as u32)]))
            .unwrap();
        let wc = a_cq.wait(Duration::from_secs(5)).unwrap().expect("READ");
        assert_eq!(wc.status, WcStatus::Success);
        assert!(
            a_mr.read_vec(len + 1, size).unwrap() == data,
            "READ {round}"
        );
        round += 1;
        // With the helper off (SOFTRDMA_SHM_COPY_HELPER=0), only the bytes.
        let helped = copier::CHUNKS_HELPED.load(Ordering::Relaxed) > before || !copier::on();
        if helped && round >= 40 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the helper took no chunk in {round} rounds"
        );
    }
}

/// A QP's access flags reach its inbox whenever they change: before the
/// inbox is made (it starts with them) or after.
#[test]
fn access_flags_reach_the_inbox_whenever_they_change() {
    let flags = AccessFlags::new(Access::REMOTE_WRITE);
    flags.set(Access::REMOTE_READ);
    let (inbox, _fd) = mapping::create(inbox_len(4), "test-inbox").unwrap();
    let inbox = Arc::new(inbox);
    flags.publish_in(&inbox);
    assert_eq!(inbox.load(QP_ACCESS), u64::from(Access::REMOTE_READ.bits()));
    flags.set(Access::REMOTE_ATOMIC);
    assert_eq!(
        inbox.load(QP_ACCESS),
        u64::from(Access::REMOTE_ATOMIC.bits())
    );
    assert_eq!(flags.get(), Access::REMOTE_ATOMIC);
}
