//! The shared-memory provider through the verbs, two QPs in one process (the
//! cross-process cases are in `shm_processes.rs`): every operation, the
//! receive wait, the errors, and regions registered and deregistered while
//! connected.

use std::time::Duration;

use softrdma::cm::shm::{self, Listener};
use softrdma::verbs::*;

mod common;
use common::{End, T, one, wait_state};

fn end() -> End {
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 16,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    End::new(Device::shm(), 1 << 20, 256, caps)
}

/// Two connected ends; `name` must be unique per test (abstract sockets are
/// host-wide).
fn pair(name: &str) -> (End, End) {
    let server = end();
    let listener = Listener::bind(&server.ctx, name).unwrap();
    let t = std::thread::spawn(move || {
        listener.accept(&server.qp).unwrap();
        server
    });
    let client = end();
    shm::connect(&client.qp, name).unwrap();
    (client, t.join().unwrap())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

fn pid_name(what: &str) -> String {
    format!("test-{}-{what}", std::process::id())
}

#[test]
fn every_operation_moves_the_right_bytes() {
    let (a, b) = pair(&pid_name("ops"));
    let data = pattern(300_000, 7);
    a.mr.write(0, &data).unwrap();
    // WRITE from two SGEs.
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: b.mr.addr() + 4096,
            rkey: b.mr.rkey(),
        },
        vec![a.mr.sge(0, 100_000), a.mr.sge(100_000, 200_000)],
    ))
    .unwrap();
    let wc = one(&a.scq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (1, WcStatus::Success, WcOpcode::RdmaWrite, 300_000)
    );
    assert_eq!(b.mr.read_vec(4096, 300_000).unwrap(), data);
    // READ it back elsewhere.
    a.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            remote_addr: b.mr.addr() + 4096,
            rkey: b.mr.rkey(),
        },
        vec![a.mr.sge(500_000, 300_000)],
    ))
    .unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::Success);
    assert_eq!(a.mr.read_vec(500_000, 300_000).unwrap(), data);
    // Atomics on a word of b's.
    b.mr.write(64, &40u64.to_ne_bytes()).unwrap();
    for (id, op, old) in [
        (
            3,
            SendOp::FetchAdd {
                remote_addr: b.mr.addr() + 64,
                rkey: b.mr.rkey(),
                add: 2,
            },
            40,
        ),
        (
            4,
            SendOp::CompareSwap {
                remote_addr: b.mr.addr() + 64,
                rkey: b.mr.rkey(),
                compare: 42,
                swap: 7,
            },
            42,
        ),
    ] {
        a.qp.post_send(SendWr::new(id, op, vec![a.mr.sge(900_000, 8)]))
            .unwrap();
        assert_eq!(one(&a.scq).status, WcStatus::Success);
        assert_eq!(a.mr.read_vec(900_000, 8).unwrap(), u64::to_ne_bytes(old));
    }
    assert_eq!(b.mr.read_vec(64, 8).unwrap(), 7u64.to_ne_bytes());
    // SEND into two receive SGEs, SEND with immediate, inline SEND, WRITE
    // with immediate (its data lands by address, the receive gets the
    // immediate).
    b.qp.post_recv(RecvWr::new(
        10,
        [b.mr.sge(600_000, 1000), b.mr.sge(700_000, 1000)],
    ))
    .unwrap();
    for id in 11..14 {
        b.qp.post_recv(RecvWr::new(
            id,
            [b.mr.sge(800_000 + (id as usize - 11) * 4096, 4096)],
        ))
        .unwrap();
    }
    a.qp.post_send(SendWr::new(5, SendOp::Send, vec![a.mr.sge(0, 1500)]))
        .unwrap();
    a.qp.post_send(SendWr::new(
        6,
        SendOp::SendWithImm(0xabcd),
        vec![a.mr.sge(0, 10)],
    ))
    .unwrap();
    a.qp.post_send(SendWr::new(7, SendOp::Send, vec![]).inline(b"inline!"))
        .unwrap();
    a.qp.post_send(SendWr::new(
        8,
        SendOp::WriteWithImm {
            remote_addr: b.mr.addr() + 950_000,
            rkey: b.mr.rkey(),
            imm: 0x1234,
        },
        vec![a.mr.sge(0, 64)],
    ))
    .unwrap();
    let ids: Vec<u64> = (0..4).map(|_| one(&a.scq).wr_id).collect();
    assert_eq!(ids, [5, 6, 7, 8], "in order");
    let r: Vec<WorkCompletion> = (0..4).map(|_| one(&b.rcq)).collect();
    assert!(r.iter().all(|w| w.status == WcStatus::Success), "{r:?}");
    assert_eq!(
        r.iter().map(|w| (w.wr_id, w.byte_len)).collect::<Vec<_>>(),
        [(10, 1500), (11, 10), (12, 7), (13, 64)]
    );
    assert_eq!((r[1].imm, r[3].imm), (Some(0xabcd), Some(0x1234)));
    assert_eq!(r[3].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(b.mr.read_vec(600_000, 1000).unwrap(), data[..1000]);
    assert_eq!(b.mr.read_vec(700_000, 500).unwrap(), data[1000..1500]);
    assert_eq!(b.mr.read_vec(800_000, 10).unwrap(), data[..10]);
    assert_eq!(b.mr.read_vec(804_096, 7).unwrap(), b"inline!");
    assert_eq!(b.mr.read_vec(950_000, 64).unwrap(), data[..64]);
}

#[test]
fn a_send_waits_for_its_receive() {
    let (a, b) = pair(&pid_name("rnr"));
    a.mr.write(0, b"early").unwrap();
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![a.mr.sge(0, 5)]))
        .unwrap();
    // Work behind it waits too (RC order).
    a.qp.post_send(SendWr::new(
        2,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey(),
        },
        vec![a.mr.sge(0, 5)],
    ))
    .unwrap();
    assert!(a.scq.wait(Duration::from_millis(100)).unwrap().is_none());
    b.qp.post_recv(RecvWr::new(9, [b.mr.sge(100, 64)])).unwrap();
    assert_eq!(one(&a.scq).wr_id, 1);
    assert_eq!(one(&a.scq).wr_id, 2);
    let wc = one(&b.rcq);
    assert_eq!((wc.wr_id, wc.byte_len), (9, 5));
    assert_eq!(b.mr.read_vec(100, 5).unwrap(), b"early");
}

#[test]
fn remote_errors_fail_both_qps_and_flush() {
    // A wrong rkey, out of bounds, a right the region lacks.
    for (k, case) in ["rkey", "bounds", "right"].into_iter().enumerate() {
        let (a, b) = pair(&pid_name(&format!("err{k}")));
        let read_only = b.pd.register(4096, Access::REMOTE_READ).unwrap();
        b.qp.post_recv(RecvWr::new(77, [b.mr.sge(0, 64)])).unwrap();
        let (addr, rkey) = match case {
            "rkey" => (b.mr.addr(), b.mr.rkey() ^ 0x0101),
            "bounds" => (b.mr.addr() + (1 << 20) - 8, b.mr.rkey()),
            _ => (read_only.addr(), read_only.rkey()),
        };
        a.qp.post_send(SendWr::new(
            1,
            SendOp::Write {
                remote_addr: addr,
                rkey,
            },
            vec![a.mr.sge(0, 64)],
        ))
        .unwrap();
        let wc = one(&a.scq);
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemAccessErr), "{case}");
        wait_state(&a.qp, QpState::Err);
        wait_state(&b.qp, QpState::Err);
        let wc = one(&b.rcq);
        assert_eq!((wc.wr_id, wc.status), (77, WcStatus::WrFlushErr), "{case}");
        // Posted to the QP in error: flushed, as rxe and siw do.
        a.qp.post_send(SendWr::new(2, SendOp::Send, vec![]))
            .unwrap();
        let wc = one(&a.scq);
        assert_eq!((wc.wr_id, wc.status), (2, WcStatus::WrFlushErr), "{case}");
        // PortActive comes first on every device; then b's QP_FATAL.
        let fatal = std::iter::from_fn(|| b.ctx.wait_async_event(Duration::from_secs(1)))
            .any(|e| e == AsyncEvent::QpFatal { qpn: b.qp.qpn() });
        assert!(fatal, "{case}: b's QP fatal event");
    }
}

/// A WRITE with immediate takes the target's receive before any byte moves:
/// when it then fails, that receive completes too (with the remote error,
/// or flushed when the initiator's own buffer was bad), never lost.
#[test]
fn a_failed_write_with_immediate_completes_the_receive_it_took() {
    for (k, case) in ["rkey", "lkey"].into_iter().enumerate() {
        let (a, b) = pair(&pid_name(&format!("wimm{k}")));
        b.qp.post_recv(RecvWr::new(9, [])).unwrap();
        let (rkey, lkey) = match case {
            "rkey" => (b.mr.rkey() ^ 0x0101, a.mr.lkey()),
            _ => (b.mr.rkey(), a.mr.lkey() ^ 0x0101),
        };
        let mut sge = a.mr.sge(0, 64);
        sge.lkey = lkey;
        a.qp.post_send(SendWr::new(
            1,
            SendOp::WriteWithImm {
                remote_addr: b.mr.addr(),
                rkey,
                imm: 0x1234,
            },
            [sge],
        ))
        .unwrap();
        let (mine, theirs) = match case {
            "rkey" => (WcStatus::RemAccessErr, WcStatus::RemAccessErr),
            _ => (WcStatus::LocProtErr, WcStatus::WrFlushErr),
        };
        assert_eq!(one(&a.scq).status, mine, "{case}");
        let wc = one(&b.rcq);
        assert_eq!((wc.wr_id, wc.status), (9, theirs), "{case}");
        wait_state(&a.qp, QpState::Err);
        wait_state(&b.qp, QpState::Err);
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            b.rcq.poll_one().unwrap().is_none(),
            "{case}: completed once"
        );
    }
}

#[test]
fn a_send_longer_than_the_receive_fails_both_ends() {
    let (a, b) = pair(&pid_name("long"));
    b.qp.post_recv(RecvWr::new(5, [b.mr.sge(0, 16)])).unwrap();
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![a.mr.sge(0, 17)]))
        .unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemInvReqErr);
    let wc = one(&b.rcq);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::LocLenErr));
    wait_state(&b.qp, QpState::Err);
}

#[test]
fn regions_registered_later_work_and_deregistered_ones_stop() {
    let (a, b) = pair(&pid_name("regs"));
    let later = b.pd.register(8192, Access::ALL).unwrap();
    a.mr.write(0, b"to the new region").unwrap();
    a.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: later.addr() + 100,
            rkey: later.rkey(),
        },
        vec![a.mr.sge(0, 17)],
    ))
    .unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::Success);
    assert_eq!(later.read_vec(100, 17).unwrap(), b"to the new region");
    let (addr, rkey) = (later.addr(), later.rkey());
    // Deregistration returns once the peer has let go of it.
    drop(later);
    a.qp.post_send(SendWr::new(
        2,
        SendOp::Write {
            remote_addr: addr,
            rkey,
        },
        vec![a.mr.sge(0, 17)],
    ))
    .unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    wait_state(&b.qp, QpState::Err);
}

#[test]
fn a_local_region_works_once_registered_and_fails_once_deregistered() {
    let (a, b) = pair(&pid_name("local-regs"));
    let write = |wr_id, sge| {
        a.qp.post_send(SendWr::new(
            wr_id,
            SendOp::Write {
                remote_addr: b.mr.addr() + 64,
                rkey: b.mr.rkey(),
            },
            vec![sge],
        ))
        .unwrap();
        one(&a.scq)
    };
    // The QP has moved bytes already before this region exists.
    assert_eq!(write(1, a.mr.sge(0, 8)).status, WcStatus::Success);
    let local = a.pd.register(4096, Access::ALL).unwrap();
    local.write(0, b"from a region registered later").unwrap();
    assert_eq!(write(2, local.sge(0, 30)).status, WcStatus::Success);
    assert_eq!(
        b.mr.read_vec(64, 30).unwrap(),
        b"from a region registered later"
    );
    a.qp.post_send(SendWr::new(
        3,
        SendOp::Read {
            remote_addr: b.mr.addr() + 64,
            rkey: b.mr.rkey(),
        },
        vec![local.sge(100, 30)],
    ))
    .unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::Success);
    assert_eq!(
        local.read_vec(100, 30).unwrap(),
        b"from a region registered later"
    );
    // Its key, used by this QP, fails once the region is deregistered.
    let stale = local.sge(0, 30);
    drop(local);
    b.mr.write(64, &[0; 30]).unwrap();
    let wc = write(4, stale);
    assert_eq!((wc.wr_id, wc.status), (4, WcStatus::LocProtErr));
    assert_eq!(b.mr.read_vec(64, 30).unwrap(), [0; 30]);
    wait_state(&a.qp, QpState::Err);
}

#[test]
fn a_destroyed_peer_flushes_the_survivor() {
    let (a, b) = pair(&pid_name("gone"));
    a.qp.post_recv(RecvWr::new(3, [a.mr.sge(0, 64)])).unwrap();
    // A SEND waiting for a receive the peer will never post.
    a.qp.post_send(SendWr::new(4, SendOp::Send, vec![a.mr.sge(0, 8)]))
        .unwrap();
    drop(b);
    let mut got: Vec<(u64, WcStatus)> = vec![];
    got.push({
        let w = one(&a.scq);
        (w.wr_id, w.status)
    });
    got.push({
        let w = one(&a.rcq);
        (w.wr_id, w.status)
    });
    assert_eq!(got, [(4, WcStatus::WrFlushErr), (3, WcStatus::WrFlushErr)]);
    assert_eq!(a.qp.state(), QpState::Err);
}

#[test]
fn connecting_needs_a_listener_and_a_shm_device() {
    let a = end();
    let e = shm::connect(&a.qp, &pid_name("nobody")).unwrap_err();
    assert!(e.to_string().contains("no shm listener"), "{e}");
    let udp = Device::udp("127.0.0.1:0".parse().unwrap()).open().unwrap();
    assert!(Listener::bind(&udp, "x").is_err());
    assert!(a.pd.register_vec(vec![0; 64], Access::ALL).is_err());
    let l = Listener::bind(&a.ctx, &pid_name("twice")).unwrap();
    assert!(Listener::bind(&a.ctx, l.name()).is_err(), "name taken");
}

#[test]
fn the_fastest_device_to_an_address_of_this_host_is_shared_memory() {
    assert!(
        Device::fastest_to("127.0.0.1".parse().unwrap())
            .unwrap()
            .is_shm()
    );
    assert!(
        Device::fastest_to("127.3.2.1".parse().unwrap())
            .unwrap()
            .is_shm()
    );
    // An address of one of this host's interfaces, if it has one.
    if let Some(ip) = softrdma::provider::netdev::interfaces()
        .unwrap()
        .iter()
        .flat_map(|d| d.ipv4.clone())
        .find(|ip| !ip.is_loopback())
    {
        assert!(Device::fastest_to(ip).unwrap().is_shm(), "{ip}");
    }
    // Another host: RoCEv2 (if this host has a route there at all).
    if let Ok(d) = Device::fastest_to("192.0.2.1".parse().unwrap()) {
        assert!(!d.is_shm());
    }
}

#[test]
fn a_receive_fires_the_completion_channel() {
    let (a, b) = pair(&pid_name("event"));
    b.qp.post_recv(RecvWr::new(1, [b.mr.sge(0, 64)])).unwrap();
    b.rcq.req_notify(false);
    assert!(!b.rcq.wait_event(Duration::from_millis(50)), "nothing yet");
    a.qp.post_send(SendWr::new(2, SendOp::Send, vec![a.mr.sge(0, 8)]))
        .unwrap();
    assert!(b.rcq.wait_event(T), "the channel fired");
    assert_eq!(b.rcq.poll_one().unwrap().unwrap().wr_id, 1);
}

#[test]
fn two_qps_of_one_device_connect_to_each_other() {
    // One context: the listener's and the connector's exchanges run on the
    // same device at once.
    let ctx = Device::shm().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.register(4096, Access::ALL).unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let (qa, qb) = (
        pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap(),
        pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap(),
    );
    let name = pid_name("self");
    let l = Listener::bind(&ctx, &name).unwrap();
    std::thread::scope(|s| {
        let t = s.spawn(|| l.accept(&qb).unwrap());
        shm::connect(&qa, &name).unwrap();
        t.join().unwrap();
    });
    mr.write(0, b"looped").unwrap();
    qa.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: mr.addr() + 100,
            rkey: mr.rkey(),
        },
        vec![mr.sge(0, 6)],
    ))
    .unwrap();
    assert_eq!(one(&cq).status, WcStatus::Success);
    assert_eq!(mr.read_vec(100, 6).unwrap(), b"looped");
}

/// Both ends announce every region of their PD while connecting; with more
/// than the socket queues (about 280 here), sending all before reading
/// deadlocked both. The acceptor now reads first.
#[test]
fn ends_with_many_regions_each_connect() {
    const REGIONS: usize = 500;
    let server = end();
    let client = end();
    let mut keep = Vec::new();
    for e in [&server, &client] {
        for _ in 0..REGIONS {
            keep.push(e.pd.register(4096, Access::ALL).unwrap());
        }
    }
    let name = pid_name("many-regions");
    let listener = Listener::bind(&server.ctx, &name).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = listener.accept(&server.qp).map_err(|e| e.to_string());
        let _ = tx.send(r.map(|()| server));
    });
    shm::connect(&client.qp, &name).unwrap();
    let server = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the acceptor returned")
        .unwrap();
    // The connection works: a WRITE into the server's first region.
    client.mr.write(0, b"many").unwrap();
    let wr = SendWr::new(
        1,
        SendOp::Write {
            remote_addr: server.mr.addr(),
            rkey: server.mr.rkey(),
        },
        [client.mr.sge(0, 4)],
    );
    client.qp.post_send(wr).unwrap();
    assert_eq!(one(&client.scq).status, WcStatus::Success);
    let mut got = [0u8; 4];
    server.mr.read(0, &mut got).unwrap();
    assert_eq!(&got, b"many");
    drop(keep);
}

/// `modify` to ERR: the QP's work is flushed by the time it returns, the
/// connection closes and the peer's QP fails; it is the one move a shm QP
/// takes.
#[test]
fn modify_to_err_flushes_and_closes_the_connection() {
    let (a, b) = pair(&pid_name("to-err"));
    common::modify_to_err_flushes_and_closes(&a, &b);
}

#[test]
fn modify_to_err_before_connecting_flushes_the_early_receives() {
    let name = pid_name("err-early");
    let b = end();
    let _listener = Listener::bind(&b.ctx, &name).unwrap();
    let a = end();
    a.qp.post_recv(RecvWr::new(1, [a.mr.sge(0, 64)])).unwrap();
    let err = QpAttr {
        state: Some(QpState::Err),
        ..QpAttr::default()
    };
    a.qp.modify(&err, None).unwrap();
    assert_eq!(a.qp.state(), QpState::Err);
    let w = a
        .rcq
        .poll_one()
        .unwrap()
        .expect("the early receive, flushed");
    assert_eq!((w.wr_id, w.status), (1, WcStatus::WrFlushErr));
    let e = shm::connect(&a.qp, &name).unwrap_err();
    assert!(e.to_string().contains("moved to ERR"), "{e}");
}

/// While the exchange waits for a slow acceptor, the QP's state and posts
/// answer at once (they waited for the whole exchange), and a receive
/// posted meanwhile is the connection's.
#[test]
fn looking_and_posting_while_the_exchange_runs_do_not_wait_for_it() {
    use std::sync::Arc;
    use std::time::Instant;
    let name = pid_name("slow-accept");
    let server = end();
    let listener = Listener::bind(&server.ctx, &name).unwrap();
    let client = Arc::new(end());
    let connector = {
        let (c, name) = (client.clone(), name.clone());
        std::thread::spawn(move || shm::connect(&c.qp, &name))
    };
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    assert_eq!(client.qp.state(), QpState::Init);
    client
        .qp
        .post_recv(RecvWr::new(7, [client.mr.sge(0, 64)]))
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    listener.accept(&server.qp).unwrap();
    connector.join().unwrap().unwrap();
    assert_eq!(client.qp.state(), QpState::Rts);
    server
        .qp
        .post_send(SendWr::new(1, SendOp::Send, vec![server.mr.sge(0, 8)]))
        .unwrap();
    let w = one(&client.rcq);
    assert_eq!((w.wr_id, w.status, w.byte_len), (7, WcStatus::Success, 8));
}

/// A receive's SGEs live in a fixed slot of the shared ring: a QP asking for
/// more than it holds is refused when created, not on its first receive.
#[test]
fn more_receive_sges_than_the_ring_holds_are_refused_at_create() {
    let ctx = Device::shm().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let caps = |max_recv_sge| QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 4,
        max_recv_sge,
        max_inline_data: 0,
    };
    let e = pd
        .create_qp(&QpInit::rc(&cq, &cq).caps(caps(8)))
        .unwrap_err();
    assert!(
        matches!(&e, VerbsError::Invalid(m) if m.contains("at most 7")),
        "{e}"
    );
    pd.create_qp(&QpInit::rc(&cq, &cq).caps(caps(7))).unwrap();
}

/// A client that connects and then says nothing holds up no other: the
/// listener waits for each connection's first message on its own, and a
/// listener dropped meanwhile goes at once.
#[test]
fn a_silent_client_holds_up_no_other() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
    let name = pid_name("silent");
    let server = end();
    let listener = Listener::bind(&server.ctx, &name).unwrap();
    let silent = rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).unwrap();
    let at = SocketAddrUnix::new_abstract_name(format!("softrdma-shm/{name}").as_bytes()).unwrap();
    rustix::net::connect(&silent, &at).unwrap();
    let started = std::time::Instant::now();
    let t = std::thread::spawn(move || {
        let r = listener.accept(&server.qp).map_err(|e| e.to_string());
        (r, server, listener)
    });
    let client = end();
    shm::connect(&client.qp, &name).unwrap();
    let (accepted, server, listener) = t.join().unwrap();
    accepted.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    common::a_send_lands(&client, &server, &server.qp, b"next");
    let dropped = std::time::Instant::now();
    drop(listener);
    assert!(dropped.elapsed() < Duration::from_secs(1));
    drop(silent);
}

/// An accept given a time gives up when it passes; one waiting for ever
/// ends when another thread moves its QP to ERR.
#[test]
fn an_accept_ends_at_its_time_or_when_its_qp_fails() {
    let name = pid_name("accept-ends");
    let server = end();
    let listener = std::sync::Arc::new(Listener::bind(&server.ctx, &name).unwrap());
    let started = std::time::Instant::now();
    let e = listener
        .accept_timeout(&server.qp, Duration::from_millis(200))
        .unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(e.to_string().contains("no shm connection came"), "{e}");
    let qp = std::sync::Arc::new(server.qp);
    let (l, waiting) = (listener.clone(), qp.clone());
    let accepted = common::in_background(move || l.accept(&waiting).map_err(|e| e.to_string()));
    common::err_ends_the_waiting_accept(&qp, &accepted);
}

/// The QP's own access flags (`qp_access_flags`): every remote operation to
/// begin with; set before the connection or on it, the peer's WRITE, READ
/// or atomic they leave out fails with REM_INV_REQ_ERR (as an RC
/// responder's invalid request NAK), the target's memory untouched.
#[test]
fn the_qps_access_flags_refuse_what_they_leave_out() {
    // Each operation on (remote_addr, rkey).
    let write = |remote_addr, rkey| SendOp::Write { remote_addr, rkey };
    let read = |remote_addr, rkey| SendOp::Read { remote_addr, rkey };
    let add = |remote_addr, rkey| SendOp::FetchAdd {
        remote_addr,
        rkey,
        add: 1,
    };
    type Op = fn(u64, u32) -> SendOp;
    let cases: [(&str, Access, Op); 3] = [
        ("write", Access::REMOTE_READ | Access::REMOTE_ATOMIC, write),
        ("read", Access::REMOTE_WRITE | Access::REMOTE_ATOMIC, read),
        ("atomic", Access::REMOTE_WRITE | Access::REMOTE_READ, add),
    ];
    for (k, (what, allowed, op)) in cases.into_iter().enumerate() {
        for before_connecting in [false, true] {
            let name = pid_name(&format!("qp-access-{what}-{before_connecting}"));
            let server = end();
            assert_eq!(
                server.qp.query().access,
                Some(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
            );
            if before_connecting {
                common::access_flags_modify(&server.qp, QpState::Init, allowed);
            }
            let listener = Listener::bind(&server.ctx, &name).unwrap();
            let t = std::thread::spawn(move || {
                listener.accept(&server.qp).unwrap();
                server
            });
            let a = end();
            shm::connect(&a.qp, &name).unwrap();
            let b = t.join().unwrap();
            if !before_connecting {
                common::access_flags_modify(&b.qp, QpState::Rts, allowed);
            }
            b.mr.write(0, &[0u8; 8]).unwrap();
            a.mr.write(0, &[0xaa; 8]).unwrap();
            let op = op(b.mr.addr(), b.mr.rkey());
            a.qp.post_send(SendWr::new(1, op, vec![a.mr.sge(0, 8)]))
                .unwrap();
            let w = one(&a.scq);
            assert_eq!(w.status, WcStatus::RemInvReqErr, "{what} (case {k})");
            assert_eq!(b.mr.read_vec(0, 8).unwrap(), [0u8; 8], "{what}");
            if what != "write" {
                assert_eq!(a.mr.read_vec(0, 8).unwrap(), [0xaa; 8], "{what}");
            }
            wait_state(&b.qp, QpState::Err);
        }
    }
}
