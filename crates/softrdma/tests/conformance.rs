//! One matrix of operations over every provider: SEND, WRITE (each also
//! inline and with immediate data where the transport has it), READ and the
//! atomics, at sizes around packet, pad and word edges, gathered from and
//! scattered into several pieces, checking the bytes that arrive, the bytes
//! around them that must not change, and each completion's fields; then the
//! remote and local protection errors. What the per-provider tests check one
//! provider at a time, asked of all alike.

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

mod common;
use common::{End, one};

const MR_LEN: usize = 1 << 20;
const INLINE: u32 = 128;
/// Where things go in each region: the sender's payload, the receiver's
/// scattered receive, the WRITE and READ targets, the atomic word and the
/// atomic result.
const SRC: usize = 0;
const RECV: usize = 200_000;
const TARGET: usize = 400_000;
const SINK: usize = 600_000;
const WORD: usize = 800_000;
const RESULT: usize = 800_064;
const SIZES: [usize; 14] = [
    0, 1, 3, 7, 8, 13, 64, 127, 128, 1000, 4095, 4097, 9000, 70_000,
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    Roce,
    Iwarp,
    Shm,
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: INLINE,
    }
}

const CQ_LEN: usize = 256;

fn end(dev: Device) -> End {
    End::new(dev, MR_LEN, CQ_LEN, caps())
}

/// RoCEv2 at a 1 KiB path MTU, so that the larger sizes take many packets.
fn roce_pair(busy_poll: bool) -> (End, End) {
    roce_pair_with(busy_poll, CQ_LEN)
}

fn roce_pair_with(busy_poll: bool, cq_len: usize) -> (End, End) {
    let a = End::new(
        Device::udp("127.0.0.1:0".parse().unwrap()),
        MR_LEN,
        cq_len,
        caps(),
    );
    let b = End::new(
        Device::udp("127.0.0.1:0".parse().unwrap()),
        MR_LEN,
        cq_len,
        caps(),
    );
    connect_roce(&a, &b, busy_poll);
    (a, b)
}

fn connect_roce(a: &End, b: &End, busy_poll: bool) {
    let mut ai = ConnInfo::local(&a.qp, Some(&a.mr)).unwrap();
    let mut bi = ConnInfo::local(&b.qp, Some(&b.mr)).unwrap();
    ai.mtu = Mtu::Mtu1024;
    bi.mtu = Mtu::Mtu1024;
    cm::connect(&a.qp, &ai, &bi, &RcOptions::default()).unwrap();
    cm::connect(&b.qp, &bi, &ai, &RcOptions::default()).unwrap();
    a.ctx.set_busy_poll(busy_poll);
    b.ctx.set_busy_poll(busy_poll);
}

fn iwarp_pair() -> (End, End) {
    iwarp_pair_with(CQ_LEN)
}

fn iwarp_pair_with(cq_len: usize) -> (End, End) {
    use softrdma::cm::iwarp::{self, Listener};
    use softrdma::cm::mpa::{Decision, MpaConfig};
    let end = |dev| End::new(dev, MR_LEN, cq_len, caps());
    let server = end(Device::iwarp([127, 0, 0, 2].into()));
    let listener = Listener::bind(&server.ctx, 0).unwrap();
    let at = listener.local_addr();
    let t = std::thread::spawn(move || {
        listener
            .accept(&server.qp, &MpaConfig::default(), |_| Decision::Accept)
            .unwrap();
        server
    });
    let client = end(Device::iwarp([127, 0, 0, 1].into()));
    iwarp::connect(&client.qp, at, &MpaConfig::default()).unwrap();
    (client, t.join().unwrap())
}

fn shm_pair() -> (End, End) {
    shm_pair_with(CQ_LEN)
}

fn shm_pair_with(cq_len: usize) -> (End, End) {
    use softrdma::cm::shm::{self, Listener};
    let end = |dev| End::new(dev, MR_LEN, cq_len, caps());
    // One name per pair: the tests of this file run at once in one process.
    static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let pair = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("conformance-{}-{pair}", std::process::id());
    let server = end(Device::shm());
    let listener = Listener::bind(&server.ctx, &name).unwrap();
    let t = std::thread::spawn(move || {
        listener.accept(&server.qp).unwrap();
        server
    });
    let client = end(Device::shm());
    shm::connect(&client.qp, &name).unwrap();
    (client, t.join().unwrap())
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + seed * 7 + 1) as u8).collect()
}

/// `len` bytes at `at` of `mr` as up to three SGEs of uneven lengths.
fn pieces(mr: &Mr, at: usize, len: usize) -> Vec<Sge> {
    if len < 3 {
        return if len == 0 {
            vec![]
        } else {
            vec![mr.sge(at, len as u32)]
        };
    }
    let (x, y) = (len / 3 + 1, len / 5 + 1);
    vec![
        mr.sge(at, x as u32),
        mr.sge(at + x, y as u32),
        mr.sge(at + x + y, (len - x - y) as u32),
    ]
}

/// Checks that `mr` holds `want` at `at`, with the 16 guard bytes either
/// side still `fill`.
fn check_area(mr: &Mr, at: usize, want: &[u8], fill: u8, what: &str) {
    let got = mr.read_vec(at - 16, want.len() + 32).unwrap();
    assert_eq!(&got[16..16 + want.len()], want, "{what}: payload");
    assert!(
        got[..16]
            .iter()
            .chain(&got[16 + want.len()..])
            .all(|&b| b == fill),
        "{what}: bytes outside the target changed"
    );
}

fn completion(cq: &Cq, what: &str) -> WorkCompletion {
    let wc = one(cq);
    assert_eq!(wc.status, WcStatus::Success, "{what}: {wc:?}");
    wc
}

fn run_matrix(t: Transport, a: &End, b: &End) {
    let (va, rkey) = (b.mr.addr(), b.mr.rkey());
    let has_imm_and_atomics = t != Transport::Iwarp;
    let mut id = 0u64;
    for (k, &n) in SIZES.iter().enumerate() {
        let data = pattern(n, k);
        a.mr.write(SRC, &data).unwrap();
        let inline = n <= INLINE as usize;
        // SEND, gathered or inline, with and without immediate data, into
        // a receive of two pieces (the first shorter than the message).
        for (inl, imm) in [
            (false, None),
            (true, None),
            (false, Some(0xc0de_0000 + k as u32)),
        ] {
            if (inl && !inline) || (imm.is_some() && !has_imm_and_atomics) {
                continue;
            }
            let what = format!("{t:?} SEND {n} inline={inl} imm={imm:?}");
            let fill = 0xa5;
            b.mr.write(RECV - 16, &vec![fill; 2 * n + 64]).unwrap();
            let first = n / 2;
            id += 1;
            b.qp.post_recv(RecvWr::new(
                id,
                [
                    b.mr.sge(RECV, first as u32),
                    b.mr.sge(RECV + first, (n - first + 16) as u32),
                ],
            ))
            .unwrap();
            let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
            let wr = if inl {
                SendWr::new(id + 1000, op, []).inline(&data)
            } else {
                SendWr::new(id + 1000, op, pieces(&a.mr, SRC, n))
            };
            a.qp.post_send(wr).unwrap();
            let wc = completion(&b.rcq, &what);
            assert_eq!(
                (wc.wr_id, wc.opcode, wc.byte_len as usize, wc.imm),
                (id, WcOpcode::Recv, n, imm),
                "{what}"
            );
            let wc = completion(&a.scq, &what);
            assert_eq!(
                (wc.wr_id, wc.opcode, wc.byte_len as usize),
                (id + 1000, WcOpcode::Send, n),
                "{what}"
            );
            check_area(&b.mr, RECV, &data, fill, &what);
        }
        // WRITE, gathered or inline, and with immediate data.
        for (inl, imm) in [
            (false, None),
            (true, None),
            (false, Some(0xbeef_0000 + k as u32)),
        ] {
            if (inl && !inline) || (imm.is_some() && !has_imm_and_atomics) {
                continue;
            }
            let what = format!("{t:?} WRITE {n} inline={inl} imm={imm:?}");
            let fill = 0x5a;
            b.mr.write(TARGET - 16, &vec![fill; n + 32]).unwrap();
            id += 1;
            let op = match imm {
                Some(imm) => {
                    b.qp.post_recv(RecvWr::new(id, [])).unwrap();
                    SendOp::WriteWithImm {
                        remote_addr: va + TARGET as u64,
                        rkey,
                        imm,
                    }
                }
                None => SendOp::Write {
                    remote_addr: va + TARGET as u64,
                    rkey,
                },
            };
            let wr = if inl {
                SendWr::new(id + 1000, op, []).inline(&data)
            } else {
                SendWr::new(id + 1000, op, pieces(&a.mr, SRC, n))
            };
            a.qp.post_send(wr).unwrap();
            let wc = completion(&a.scq, &what);
            assert_eq!(
                (wc.wr_id, wc.opcode, wc.byte_len as usize),
                (id + 1000, WcOpcode::RdmaWrite, n),
                "{what}"
            );
            // An iWARP WRITE completes once its bytes are in the socket (as
            // siw's): a READ behind it answers only once it is placed.
            a.qp.post_send(SendWr::new(
                id + 5000,
                SendOp::Read {
                    remote_addr: va + TARGET as u64,
                    rkey,
                },
                [a.mr.sge(RESULT + 16, 1)],
            ))
            .unwrap();
            assert_eq!(completion(&a.scq, &what).wr_id, id + 5000, "{what}");
            if let Some(imm) = imm {
                let wc = completion(&b.rcq, &what);
                assert_eq!(
                    (wc.wr_id, wc.opcode, wc.byte_len as usize, wc.imm),
                    (id, WcOpcode::RecvRdmaWithImm, n, Some(imm)),
                    "{what}"
                );
            }
            check_area(&b.mr, TARGET, &data, fill, &what);
        }
        // READ back into three pieces.
        {
            let what = format!("{t:?} READ {n}");
            let fill = 0x3c;
            let theirs = pattern(n, k + 100);
            b.mr.write(TARGET, &theirs).unwrap();
            a.mr.write(SINK - 16, &vec![fill; n + 32]).unwrap();
            id += 1;
            a.qp.post_send(SendWr::new(
                id,
                SendOp::Read {
                    remote_addr: va + TARGET as u64,
                    rkey,
                },
                pieces(&a.mr, SINK, n),
            ))
            .unwrap();
            let wc = completion(&a.scq, &what);
            assert_eq!(
                (wc.wr_id, wc.opcode, wc.byte_len as usize),
                (id, WcOpcode::RdmaRead, n),
                "{what}"
            );
            check_area(&a.mr, SINK, &theirs, fill, &what);
        }
    }
    if has_imm_and_atomics {
        b.mr.write(WORD, &40u64.to_ne_bytes()).unwrap();
        id += 1;
        a.qp.post_send(SendWr::new(
            id,
            SendOp::FetchAdd {
                remote_addr: va + WORD as u64,
                rkey,
                add: 2,
            },
            [a.mr.sge(RESULT, 8)],
        ))
        .unwrap();
        let wc = completion(&a.scq, "FETCH_ADD");
        assert_eq!((wc.opcode, wc.byte_len), (WcOpcode::FetchAdd, 8));
        assert_eq!(a.mr.load_u64(RESULT).unwrap(), 40);
        id += 1;
        a.qp.post_send(SendWr::new(
            id,
            SendOp::CompareSwap {
                remote_addr: va + WORD as u64,
                rkey,
                compare: 42,
                swap: 7,
            },
            [a.mr.sge(RESULT + 8, 8)],
        ))
        .unwrap();
        let wc = completion(&a.scq, "CMP_SWAP");
        assert_eq!((wc.opcode, wc.byte_len), (WcOpcode::CompareSwap, 8));
        assert_eq!(a.mr.load_u64(RESULT + 8).unwrap(), 42);
        assert_eq!(b.mr.load_u64(WORD).unwrap(), 7);
    }
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
}

#[test]
fn every_operation_over_roce() {
    let (a, b) = roce_pair(false);
    run_matrix(Transport::Roce, &a, &b);
    assert_eq!(a.ctx.stats().bad_icrc + b.ctx.stats().bad_icrc, 0);
}

#[test]
fn every_operation_over_roce_busy_polling() {
    let (a, b) = roce_pair(true);
    run_matrix(Transport::Roce, &a, &b);
}

#[test]
fn every_operation_through_a_shared_port() {
    use softrdma::provider::hostd::Hostd;
    // The daemon owns 127.0.0.58:4791 and passes datagrams to the device
    // sharing it; the peer owns 127.0.0.59:4791.
    let mut daemon = Hostd::bind("127.0.0.58:4791".parse().unwrap()).unwrap();
    let stopper = daemon.stopper();
    let thread = std::thread::spawn(move || daemon.run().unwrap());
    let a = end(Device::udp("127.0.0.58:4791".parse().unwrap()).shared_port(true));
    let b = end(Device::udp("127.0.0.59:4791".parse().unwrap()));
    connect_roce(&a, &b, false);
    run_matrix(Transport::Roce, &a, &b);
    drop((a, b));
    stopper.stop();
    thread.join().unwrap();
}

#[test]
fn every_operation_over_iwarp() {
    let (a, b) = iwarp_pair();
    run_matrix(Transport::Iwarp, &a, &b);
}

#[test]
fn every_operation_over_shared_memory() {
    let (a, b) = shm_pair();
    run_matrix(Transport::Shm, &a, &b);
}

/// A WRITE or a READ of the peer's `remote_addr`.
fn write_or_read(write: bool, remote_addr: u64, rkey: u32) -> SendOp {
    if write {
        SendOp::Write { remote_addr, rkey }
    } else {
        SendOp::Read { remote_addr, rkey }
    }
}

/// Runs `case` over each provider, each pair made fresh by the function given.
fn over_every_provider(case: impl Fn(Transport, &dyn Fn() -> (End, End))) {
    case(Transport::Roce, &|| roce_pair(false));
    case(Transport::Iwarp, &iwarp_pair);
    case(Transport::Shm, &shm_pair);
}

/// A remote access with a bad key, or past the end of the region: the
/// requester's completion says so, its QP goes to the error state and
/// flushes what was posted behind it. Each case on a fresh pair.
fn remote_access_errors(t: Transport, make: &dyn Fn() -> (End, End)) {
    let cases: [(&str, bool, u64, u32); 4] = [
        ("WRITE, bad rkey", true, 0, 1),
        ("WRITE past the region", true, MR_LEN as u64 - 8, 0),
        ("READ, bad rkey", false, 0, 1),
        ("READ past the region", false, MR_LEN as u64 - 8, 0),
    ];
    for (what, write, at, key_xor) in cases {
        let (a, b) = make();
        let op = write_or_read(write, b.mr.addr() + at, b.mr.rkey() ^ key_xor);
        a.qp.post_send(SendWr::new(1, op, [a.mr.sge(0, 64)]))
            .unwrap();
        a.qp.post_send(SendWr::new(2, SendOp::Send, [a.mr.sge(0, 8)]))
            .unwrap();
        let first = one(&a.scq);
        let second = one(&a.scq);
        if t == Transport::Iwarp {
            // An iWARP SEND or WRITE completes once sent (as on siw), so
            // either may complete before the peer's Terminate comes back;
            // that then fails the oldest WR not yet reported and flushes
            // the rest. A READ waits for its answer: it takes the error.
            assert_eq!((first.wr_id, second.wr_id), (1, 2), "{t:?} {what}");
            let after = match first.status {
                WcStatus::Success if write => {
                    vec![
                        WcStatus::Success,
                        WcStatus::RemAccessErr,
                        WcStatus::WrFlushErr,
                    ]
                }
                WcStatus::RemAccessErr => vec![WcStatus::Success, WcStatus::WrFlushErr],
                other => panic!("{t:?} {what}: the first WR ended {other:?}"),
            };
            assert!(after.contains(&second.status), "{t:?} {what}: {second:?}");
            common::wait_state(&a.qp, QpState::Err);
        } else {
            assert_eq!(
                (first.wr_id, first.status),
                (1, WcStatus::RemAccessErr),
                "{t:?} {what}: {first:?}"
            );
            assert_eq!(
                (second.wr_id, second.status),
                (2, WcStatus::WrFlushErr),
                "{t:?} {what}: {second:?}"
            );
            assert_eq!(a.qp.state(), QpState::Err, "{t:?} {what}");
        }
        // Work posted to the QP in error is flushed, not refused (how an
        // application drains a QP it tears down).
        a.qp.post_send(SendWr::new(3, SendOp::Send, [a.mr.sge(0, 8)]))
            .unwrap();
        a.qp.post_recv(RecvWr::new(4, [a.mr.sge(0, 8)])).unwrap();
        let wc = one(&a.scq);
        assert_eq!(
            (wc.wr_id, wc.status),
            (3, WcStatus::WrFlushErr),
            "{t:?} {what}"
        );
        let wc = one(&a.rcq);
        assert_eq!(
            (wc.wr_id, wc.status),
            (4, WcStatus::WrFlushErr),
            "{t:?} {what}"
        );
    }
}

#[test]
fn remote_access_errors_over_every_provider() {
    over_every_provider(remote_access_errors);
}

/// A local buffer that fails its checks (an unknown lkey, or a range past
/// the region's end): the WR completes with LOC_PROT_ERR, as rxe and NICs
/// report an L_Key violation, and the QP goes to the error state. A SEND's
/// receive at the peer gets none of it: it stays posted (RoCEv2, where
/// nothing was sent), or is flushed when the connection ends (iWARP, shm),
/// its bytes untouched.
fn local_protection_errors(t: Transport, make: &dyn Fn() -> (End, End)) {
    for (what, lkey_xor, at, len) in [
        ("bad lkey", 1u32, 0usize, 8u32),
        ("past the region", 0, MR_LEN - 8, 64),
    ] {
        for op in ["WRITE", "READ", "SEND"] {
            let (a, b) = make();
            let sge = Sge {
                lkey: a.mr.lkey() ^ lkey_xor,
                ..a.mr.sge(at, len)
            };
            let op_code = match op {
                "SEND" => {
                    b.mr.write(RECV - 16, &[0xee; 96]).unwrap();
                    b.qp.post_recv(RecvWr::new(9, [b.mr.sge(RECV, 64)]))
                        .unwrap();
                    SendOp::Send
                }
                _ => write_or_read(op == "WRITE", b.mr.addr(), b.mr.rkey()),
            };
            a.qp.post_send(SendWr::new(1, op_code, [sge])).unwrap();
            let wc = one(&a.scq);
            assert_eq!(
                (wc.wr_id, wc.status),
                (1, WcStatus::LocProtErr),
                "{t:?} {what}, {op}"
            );
            common::wait_state(&a.qp, QpState::Err);
            if op == "SEND" {
                if t == Transport::Roce {
                    let wc = b.rcq.wait(std::time::Duration::from_millis(200)).unwrap();
                    assert!(wc.is_none(), "{what}: the receive completed: {wc:?}");
                } else {
                    let wc = one(&b.rcq);
                    assert_eq!(
                        (wc.wr_id, wc.status),
                        (9, WcStatus::WrFlushErr),
                        "{t:?} {what}: the peer's receive"
                    );
                }
                check_area(&b.mr, RECV, &[0xee; 64], 0xee, &format!("{t:?} {what}"));
            }
        }
    }
}

#[test]
fn local_protection_errors_over_every_provider() {
    over_every_provider(local_protection_errors);
}

/// A SEND longer than the receive it lands in: the receive completes with
/// LOC_LEN_ERR and the receiver's QP goes to the error state. The sender's
/// SEND fails: REM_OP_ERR over RoCEv2, from the NAK rxe sends for it (6.1,
/// observed, `WIRE-NOTES.md`), REM_INV_REQ_ERR on shm, as the IB spec's
/// class C and NICs have it; on iWARP, where a SEND completes once sent, it
/// may have completed already.
fn receive_too_short(t: Transport, make: &dyn Fn() -> (End, End)) {
    let (a, b) = make();
    b.qp.post_recv(RecvWr::new(5, [b.mr.sge(0, 16)])).unwrap();
    a.qp.post_send(SendWr::new(1, SendOp::Send, [a.mr.sge(0, 17)]))
        .unwrap();
    let wc = one(&b.rcq);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::LocLenErr), "{t:?}");
    let wc = one(&a.scq);
    let allowed: &[WcStatus] = match t {
        Transport::Roce => &[WcStatus::RemOpErr],
        Transport::Shm => &[WcStatus::RemInvReqErr],
        Transport::Iwarp => &[
            WcStatus::Success,
            WcStatus::RemInvReqErr,
            WcStatus::RemOpErr,
        ],
    };
    assert!(allowed.contains(&wc.status), "{t:?}: {wc:?}");
    common::wait_state(&b.qp, QpState::Err);
}

#[test]
fn a_receive_too_short_over_every_provider() {
    over_every_provider(receive_too_short);
}

/// Work requests that break `ibv_post_send`'s rules are refused when posted,
/// whatever the provider, and the QP carries on: inline data on a READ or
/// beyond max_inline_data, too many SGEs, a message over 2 GiB.
fn refused_posts(t: Transport, make: &dyn Fn() -> (End, End)) {
    let (a, b) = make();
    let read = SendOp::Read {
        remote_addr: b.mr.addr(),
        rkey: b.mr.rkey(),
    };
    let write = SendOp::Write {
        remote_addr: b.mr.addr() + TARGET as u64,
        rkey: b.mr.rkey(),
    };
    let e =
        a.qp.post_send(SendWr::new(1, read, []).inline(&[1; 8]))
            .unwrap_err();
    assert!(
        matches!(e, VerbsError::Post(PostError::Unsupported(_))),
        "{t:?}: {e}"
    );
    let e =
        a.qp.post_send(SendWr::new(2, write, []).inline(&vec![1; INLINE as usize + 1]))
            .unwrap_err();
    assert!(
        matches!(e, VerbsError::Post(PostError::InlineTooLarge { .. })),
        "{t:?}: {e}"
    );
    let e =
        a.qp.post_send(SendWr::new(3, write, vec![a.mr.sge(0, 8); 5]))
            .unwrap_err();
    assert!(
        matches!(
            e,
            VerbsError::Post(PostError::TooManySges { given: 5, max: 4 })
        ),
        "{t:?}: {e}"
    );
    let e =
        a.qp.post_send(SendWr {
            sgl: vec![a.mr.sge(0, 8)].into(),
            ..SendWr::new(8, write, []).inline(&[1; 8])
        })
        .unwrap_err();
    assert!(
        matches!(e, VerbsError::Post(PostError::Unsupported(_))),
        "{t:?}: {e}"
    );
    // Atomics (refused as such on iWARP): one 8-byte buffer, an aligned word.
    for (wr_id, remote_addr, len) in [(9, b.mr.addr() + WORD as u64 + 4, 8), (10, b.mr.addr(), 4)] {
        let add = SendOp::FetchAdd {
            remote_addr,
            rkey: b.mr.rkey(),
            add: 1,
        };
        let e =
            a.qp.post_send(SendWr::new(wr_id, add, [a.mr.sge(RESULT, len)]))
                .unwrap_err();
        let VerbsError::Post(e) = e else {
            panic!("{t:?}: {e}")
        };
        let want = match (t, len) {
            (Transport::Iwarp, _) => matches!(e, PostError::Unsupported(_)),
            (_, 8) => e == PostError::MisalignedAtomic(remote_addr),
            _ => e == PostError::BadAtomicSge,
        };
        assert!(want, "{t:?}: {e}");
    }
    // Checked before the keys: the SGEs need not lie in a region.
    let huge = Sge {
        len: 1 << 31,
        ..a.mr.sge(0, 8)
    };
    let e =
        a.qp.post_send(SendWr::new(4, write, [huge, a.mr.sge(0, 8)]))
            .unwrap_err();
    assert!(
        matches!(e, VerbsError::Post(PostError::TooLong(0x8000_0008))),
        "{t:?}: {e}"
    );
    // None of them was posted, and the QP still works.
    a.mr.write(SRC, b"after the refusals").unwrap();
    a.qp.post_send(SendWr::new(5, write, [a.mr.sge(SRC, 18)]))
        .unwrap();
    // A READ of it back: on iWARP a WRITE completes once sent; the READ's
    // answer comes after it is placed.
    let back = SendOp::Read {
        remote_addr: b.mr.addr() + TARGET as u64,
        rkey: b.mr.rkey(),
    };
    a.qp.post_send(SendWr::new(6, back, [a.mr.sge(SINK, 18)]))
        .unwrap();
    for wr_id in [5, 6] {
        let wc = one(&a.scq);
        assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success), "{t:?}");
    }
    check_area(&a.mr, SINK, b"after the refusals", 0, &format!("{t:?}"));
}

#[test]
fn posts_that_break_the_send_rules_are_refused_over_every_provider() {
    over_every_provider(refused_posts);
}

/// Zero bytes name no memory: a zero-length WRITE or READ with rkey 0 and
/// address 0, and an empty SGE with lkey 0 among real ones, succeed without
/// a key check (rxe's `check_rkey`, siw's `siw_check_sgl_tx`), and the QP
/// stays up.
fn zero_length_names_no_memory(t: Transport, make: &dyn Fn() -> (End, End)) {
    let (a, b) = make();
    let nowhere = |write| write_or_read(write, 0, 0);
    a.qp.post_send(SendWr::new(1, nowhere(true), [])).unwrap();
    a.qp.post_send(SendWr::new(2, nowhere(false), [])).unwrap();
    let empty = Sge {
        addr: 0,
        len: 0,
        lkey: 0,
    };
    b.qp.post_recv(RecvWr::new(
        7,
        [b.mr.sge(RECV, 4), empty, b.mr.sge(RECV + 4, 60)],
    ))
    .unwrap();
    a.mr.write(SRC, b"eight by").unwrap();
    a.qp.post_send(SendWr::new(
        3,
        SendOp::Send,
        [a.mr.sge(SRC, 3), empty, a.mr.sge(SRC + 3, 5)],
    ))
    .unwrap();
    for wr_id in 1..=3 {
        let wc = one(&a.scq);
        assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success), "{t:?}");
    }
    let wc = one(&b.rcq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, WcStatus::Success, 8),
        "{t:?}"
    );
    check_area(&b.mr, RECV, b"eight by", 0, &format!("{t:?}"));
    assert_eq!(a.qp.state(), QpState::Rts, "{t:?}");
    assert_eq!(b.qp.state(), QpState::Rts, "{t:?}");
}

#[test]
fn zero_length_names_no_memory_over_every_provider() {
    over_every_provider(zero_length_names_no_memory);
}

/// A solicited SEND fires a CQ armed for solicited completions only, and
/// its completion says it was solicited; an unsolicited one does neither.
fn solicited_events(t: Transport, make: &dyn Fn() -> (End, End)) {
    let (a, b) = make();
    let _fd = std::os::fd::AsFd::as_fd(&b.rcq);
    b.rcq.req_notify(true);
    for (wr_id, solicited) in [(1, false), (2, true)] {
        b.qp.post_recv(RecvWr::new(wr_id, [b.mr.sge(RECV, 16)]))
            .unwrap();
        let send = SendWr::new(wr_id, SendOp::Send, [a.mr.sge(SRC, 16)]);
        let send = if solicited { send.solicited() } else { send };
        a.qp.post_send(send).unwrap();
        let fired = b.rcq.wait_event(std::time::Duration::from_millis(500));
        assert_eq!(fired, solicited, "{t:?}: solicited={solicited}");
        let wc = one(&b.rcq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.solicited),
            (wr_id, WcStatus::Success, solicited),
            "{t:?}"
        );
        assert_eq!(one(&a.scq).status, WcStatus::Success, "{t:?}");
    }
}

#[test]
fn solicited_events_over_every_provider() {
    over_every_provider(solicited_events);
}

/// CQs this small overrun in the test below.
const SMALL: usize = 4;

/// A CQ that overruns loses completions, so a QP whose completion it drops
/// can't go on: it moves to the error state with a fatal event, beside the
/// CQ's own error event, on every provider (rxe's responder does so on a
/// full CQ; the IB spec leaves the QPs of an overrun CQ unusable).
fn cq_overrun(t: Transport, make: &dyn Fn() -> (End, End)) {
    let (a, b) = make();
    let n = 2 * SMALL as u64;
    for i in 0..n {
        b.qp.post_recv(RecvWr::new(i, [b.mr.sge(RECV + 64 * i as usize, 8)]))
            .unwrap();
    }
    for i in 0..n {
        a.qp.post_send(SendWr::new(i, SendOp::Send, [a.mr.sge(SRC, 8)]).unsignaled())
            .unwrap();
    }
    common::wait_state(&b.qp, QpState::Err);
    let mut events = vec![];
    while let Some(e) = b
        .ctx
        .wait_async_event(std::time::Duration::from_millis(300))
    {
        events.push(e);
    }
    for want in [
        AsyncEvent::CqError { cq: b.rcq.id() },
        AsyncEvent::QpFatal { qpn: b.qp.qpn() },
    ] {
        assert!(events.contains(&want), "{t:?}: {want:?} not in {events:?}");
    }
    // What the CQ took before it overran is still polled, in order.
    for i in 0..SMALL as u64 {
        let wc = one(&b.rcq);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "{t:?}");
    }
    assert_eq!(b.rcq.poll_one(), Err(CqError::Overrun(SMALL)), "{t:?}");
}

#[test]
fn a_cq_overrun_fails_the_qp_that_lost_completions_over_every_provider() {
    cq_overrun(Transport::Roce, &|| roce_pair_with(false, SMALL));
    cq_overrun(Transport::Iwarp, &|| iwarp_pair_with(SMALL));
    cq_overrun(Transport::Shm, &|| shm_pair_with(SMALL));
}

/// A QP moved to ERR before it was ever connected takes what is posted and
/// flushes it, as a connected one does, on every provider (siw and rxe do:
/// it is how `ib_drain_qp` drains a QP).
#[test]
fn a_qp_moved_to_err_before_connecting_flushes_what_is_posted() {
    for (t, dev) in [
        (Transport::Roce, Device::udp("127.0.0.1:0".parse().unwrap())),
        (Transport::Iwarp, Device::iwarp([127, 0, 0, 1].into())),
        (Transport::Shm, Device::shm()),
    ] {
        let a = end(dev);
        let err = QpAttr {
            state: Some(QpState::Err),
            ..QpAttr::default()
        };
        a.qp.modify(&err, None).unwrap();
        assert_eq!(a.qp.state(), QpState::Err, "{t:?}");
        a.qp.post_recv(RecvWr::new(1, [a.mr.sge(RECV, 64)]))
            .unwrap();
        a.qp.post_send(SendWr::new(2, SendOp::Send, [a.mr.sge(SRC, 8)]))
            .unwrap();
        let wc = one(&a.rcq);
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushErr), "{t:?}");
        let wc = one(&a.scq);
        assert_eq!((wc.wr_id, wc.status), (2, WcStatus::WrFlushErr), "{t:?}");
        // A broken WR is still refused, not flushed.
        let e =
            a.qp.post_send(SendWr::new(3, SendOp::Send, vec![a.mr.sge(SRC, 8); 5]))
                .unwrap_err();
        assert!(
            matches!(e, VerbsError::Post(PostError::TooManySges { .. })),
            "{t:?}: {e}"
        );
    }
}
