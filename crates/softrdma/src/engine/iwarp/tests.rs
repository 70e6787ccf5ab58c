//! Two iWARP QPs joined by an in-memory byte stream, framed and parsed the
//! way the TCP provider does (MPA length, DDP header, placement, pad, CRC).

use std::sync::Arc;

use softrdma_wire::ddp;
use softrdma_wire::mpa::{self, Crc32c};
use softrdma_wire::rdmap::{Layer, TermEncoding};

use super::*;
use crate::engine::Sge;
use crate::memory::{Region, RegionMemory};

const MEM: usize = 1 << 20;
const LKEY: [u32; 2] = [0x1000_0001, 0x2000_0001];
const RKEY: [u32; 2] = [0x1000_0002, 0x2000_0002];
const IOVA: [u64; 2] = [0x10_0000_0000, 0x20_0000_0000];

struct Side {
    qp: IwarpQp,
    mrs: MrTable,
    mem: Arc<RegionMemory>,
    wcs: Vec<(CqKind, WorkCompletion)>,
}

fn side(i: usize, access: Access, cfg: IwarpConfig) -> Side {
    let mem = Arc::new(RegionMemory::zeroed(MEM).unwrap());
    let mut mrs = MrTable::new();
    mrs.insert(Region::new(1, (LKEY[i], RKEY[i]), mem.clone(), 0, MEM, IOVA[i], access).unwrap());
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 256,
    };
    Side {
        qp: IwarpQp::new(0x11 + i as u32, 1, caps, cfg),
        mrs,
        mem,
        wcs: Vec::new(),
    }
}

struct Pair {
    s: [Side; 2],
    crc: bool,
    /// Bytes on the way from side i to the other.
    wire: [Vec<u8>; 2],
}

/// A READ of `len` bytes from the start of side 1's memory to `off` in side
/// 0's.
fn read(wr_id: u64, off: u64, len: u32) -> SendWr {
    let op = SendOp::Read {
        remote_addr: IOVA[1],
        rkey: RKEY[1],
    };
    SendWr::new(wr_id, op, vec![sge(0, off, len)])
}

fn sge(i: usize, off: u64, len: u32) -> Sge {
    Sge {
        addr: IOVA[i] + off,
        len,
        lkey: LKEY[i],
    }
}

impl Pair {
    fn new() -> Pair {
        Pair::with(IwarpConfig::default(), Access::ALL, true)
    }

    /// Side 0 with `initiator`'s configuration, side 1 with `responder`'s;
    /// every right, CRC on.
    fn of(initiator: IwarpConfig, responder: IwarpConfig) -> Pair {
        Pair {
            s: [
                side(0, Access::ALL, initiator),
                side(1, Access::ALL, responder),
            ],
            crc: true,
            wire: [Vec::new(), Vec::new()],
        }
    }

    fn with(cfg: IwarpConfig, access: Access, crc: bool) -> Pair {
        Pair {
            s: [side(0, access, cfg), side(1, access, cfg)],
            crc,
            wire: [Vec::new(), Vec::new()],
        }
    }

    /// Side i's FPDUs onto the wire, as the provider frames them.
    fn transmit(&mut self, i: usize) {
        let mut buf = vec![0u8; MAX_HEADER_LEN + 512];
        let mut pieces = Vec::new();
        let s = &mut self.s[i];
        while let Some(t) = s.qp.poll_transmit(&s.mrs, &mut buf, &mut pieces) {
            let start = self.wire[i].len();
            self.wire[i].extend_from_slice(&buf[..t.header_len]);
            for p in &pieces {
                let mut b = vec![0u8; p.len()];
                p.read(0, &mut b);
                self.wire[i].extend_from_slice(&b);
            }
            assert_eq!(self.wire[i].len() - start, 2 + t.ulpdu_len);
            assert!(t.ulpdu_len <= s.qp.cfg.max_ulpdu);
            self.wire[i].extend(std::iter::repeat_n(0, mpa::pad_len(t.ulpdu_len)));
            let crc = if self.crc {
                let mut c = Crc32c::default();
                c.update(&self.wire[i][start..]);
                c.finish()
            } else {
                0
            };
            self.wire[i].extend_from_slice(&crc.to_le_bytes());
        }
        s.qp.transmitted();
        while let Some(c) = s.qp.poll_completion() {
            s.wcs.push(c);
        }
    }

    /// The other side reads what side i sent, placing as it goes.
    fn receive(&mut self, i: usize) {
        let bytes = std::mem::take(&mut self.wire[i]);
        let r = &mut self.s[1 - i];
        let mut at = 0;
        while at < bytes.len() {
            let ulpdu_len = u16::from_be_bytes([bytes[at], bytes[at + 1]]) as usize;
            let fpdu = &bytes[at..at + mpa::fpdu_len(ulpdu_len)];
            let ulpdu = &fpdu[2..2 + ulpdu_len];
            let hlen = if ulpdu[0] & 0x80 != 0 {
                ddp::TAGGED_HEADER_LEN
            } else {
                ddp::UNTAGGED_HEADER_LEN
            };
            let payload = &ulpdu[hlen..];
            let mut control = Vec::new();
            let mut pieces = Vec::new();
            match r
                .qp
                .accept_header(&ulpdu[..hlen], payload.len(), &r.mrs, &mut pieces)
            {
                Placement::Data => {
                    assert_eq!(pieces.iter().map(|p| p.len()).sum::<usize>(), payload.len());
                    let mut off = 0;
                    for p in pieces {
                        p.write(0, &payload[off..off + p.len()]);
                        off += p.len();
                    }
                }
                Placement::Control => control = payload.to_vec(),
                Placement::Discard => {}
            }
            let covered = &fpdu[..fpdu.len() - 4];
            let sent = u32::from_le_bytes(fpdu[fpdu.len() - 4..].try_into().unwrap());
            let crc_ok = !self.crc || {
                let mut c = Crc32c::default();
                c.update(covered);
                c.finish() == sent
            };
            r.qp.segment_done(&control, crc_ok, &r.mrs);
            at += fpdu.len();
        }
        while let Some(c) = r.qp.poll_completion() {
            r.wcs.push(c);
        }
    }

    /// Both ways until quiet.
    fn run(&mut self) {
        for _ in 0..64 {
            self.transmit(0);
            self.transmit(1);
            if self.wire.iter().all(Vec::is_empty) {
                return;
            }
            self.receive(0);
            self.receive(1);
        }
        panic!("no quiet");
    }

    fn post(&mut self, i: usize, wr: SendWr) {
        self.s[i].qp.post_send(wr).unwrap();
    }

    fn recv(&mut self, i: usize, wr_id: u64, sgl: Vec<Sge>) {
        self.s[i].qp.post_recv(RecvWr::new(wr_id, sgl)).unwrap();
    }

    fn statuses(&self, i: usize, kind: CqKind) -> Vec<(u64, WcStatus)> {
        self.s[i]
            .wcs
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, w)| (w.wr_id, w.status))
            .collect()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn send_spans_many_fpdus_and_lands_in_the_receive() {
    for crc in [false, true] {
        let mut p = Pair::with(IwarpConfig::default(), Access::ALL, crc);
        let data = pattern(10_000, 1);
        p.s[0].mem.write(0, &data);
        p.recv(1, 7, vec![sge(1, 4096, 4000), sge(1, 65536, 8000)]);
        p.post(
            0,
            SendWr::new(1, SendOp::Send, vec![sge(0, 0, 10_000)]).solicited(),
        );
        p.run();
        assert_eq!(p.statuses(0, CqKind::Send), [(1, WcStatus::Success)]);
        let wc = p.s[1].wcs[0].1;
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len, wc.solicited),
            (7, WcStatus::Success, 10_000, true)
        );
        let mut got = vec![0u8; 4000];
        p.s[1].mem.read(4096, &mut got);
        assert_eq!(got, data[..4000]);
        let mut got = vec![0u8; 6000];
        p.s[1].mem.read(65536, &mut got);
        assert_eq!(got, data[4000..]);
        // 1442-byte ULPDUs: 18 header + 1424 payload each.
        assert_eq!(
            p.s[0].qp.stats().fpdus_sent,
            10_000usize.div_ceil(1424) as u64
        );
    }
}

/// With an SRQ, a SEND takes one receive when it starts and keeps it for
/// every FPDU; a failure flushes only that one and reports the last WQE.
#[test]
fn sends_over_many_fpdus_take_one_srq_receive_each() {
    let mut p = Pair::new();
    let srq = Arc::new(std::sync::Mutex::new(Srq::new(1, 8, 1)));
    let qp = std::mem::replace(
        &mut p.s[1].qp,
        side(1, Access::ALL, IwarpConfig::default()).qp,
    );
    p.s[1].qp = qp.with_srq(srq.clone());
    assert_eq!(
        p.s[1].qp.post_recv(RecvWr::new(1, vec![sge(1, 0, 8)])),
        Err(PostError::ON_SRQ)
    );
    for k in 0..4u64 {
        let wr = RecvWr::new(10 + k, vec![sge(1, k * 20_000, 20_000)]);
        srq.lock().unwrap().post_recv(wr).unwrap();
    }
    let data = pattern(10_000, 3);
    p.s[0].mem.write(0, &data);
    for k in 0..2 {
        p.post(0, SendWr::new(k, SendOp::Send, vec![sge(0, 0, 10_000)]));
    }
    p.run();
    let got: Vec<(u64, WcStatus, u32)> = p.s[1]
        .wcs
        .iter()
        .map(|(_, w)| (w.wr_id, w.status, w.byte_len))
        .collect();
    assert_eq!(
        got,
        [
            (10, WcStatus::Success, 10_000),
            (11, WcStatus::Success, 10_000)
        ]
    );
    for k in 0..2 {
        let mut back = vec![0u8; 10_000];
        p.s[1].mem.read(k * 20_000, &mut back);
        assert_eq!(back, data);
    }
    assert_eq!(srq.lock().unwrap().len(), 2);
    // A failure mid-message: the receive it took is flushed, not the SRQ's.
    p.post(0, SendWr::new(2, SendOp::Send, vec![sge(0, 0, 10_000)]));
    p.transmit(0);
    let first = mpa::fpdu_len(u16::from_be_bytes([p.wire[0][0], p.wire[0][1]]) as usize);
    p.wire[0].truncate(first);
    p.receive(0);
    p.s[1].qp.connection_lost();
    while let Some(c) = p.s[1].qp.poll_completion() {
        p.s[1].wcs.push(c);
    }
    assert_eq!(p.s[1].wcs[2].1.wr_id, 12);
    assert_eq!(p.s[1].wcs[2].1.status, WcStatus::WrFlushErr);
    assert_eq!(p.s[1].wcs.len(), 3);
    assert_eq!(srq.lock().unwrap().len(), 1);
    let events: Vec<QpEvent> = std::iter::from_fn(|| p.s[1].qp.poll_event()).collect();
    assert!(events.contains(&QpEvent::LastWqeReached), "{events:?}");
}

#[test]
fn write_and_read_place_at_the_tagged_offset() {
    let mut p = Pair::new();
    let data = pattern(70_000, 2);
    p.s[0].mem.write(0, &data);
    p.post(
        0,
        SendWr::new(
            1,
            SendOp::Write {
                remote_addr: IOVA[1] + 100_000,
                rkey: RKEY[1],
            },
            vec![sge(0, 0, 70_000)],
        ),
    );
    // Read it back into another place, in two SGEs.
    p.post(
        0,
        SendWr::new(
            2,
            SendOp::Read {
                remote_addr: IOVA[1] + 100_000,
                rkey: RKEY[1],
            },
            vec![sge(0, 200_000, 30_000), sge(0, 300_000, 40_000)],
        ),
    );
    p.run();
    assert_eq!(
        p.statuses(0, CqKind::Send),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let mut got = vec![0u8; 70_000];
    p.s[1].mem.read(100_000, &mut got);
    assert_eq!(got, data);
    let mut a = vec![0u8; 30_000];
    p.s[0].mem.read(200_000, &mut a);
    let mut b = vec![0u8; 40_000];
    p.s[0].mem.read(300_000, &mut b);
    assert_eq!([a, b].concat(), data);
    assert!(p.s[1].wcs.is_empty(), "one-sided: nothing at the target");
}

#[test]
fn inline_and_zero_length_operations() {
    let mut p = Pair::new();
    p.recv(1, 1, vec![sge(1, 0, 64)]);
    p.recv(1, 2, vec![]);
    p.post(
        0,
        SendWr::new(1, SendOp::Send, vec![]).inline(b"inline bytes"),
    );
    p.post(0, SendWr::new(2, SendOp::Send, vec![]));
    p.post(
        0,
        SendWr::new(
            3,
            SendOp::Write {
                remote_addr: IOVA[1] + 512,
                rkey: RKEY[1],
            },
            vec![],
        )
        .inline(b"written inline"),
    );
    p.post(
        0,
        SendWr::new(
            4,
            SendOp::Read {
                remote_addr: IOVA[1],
                rkey: RKEY[1],
            },
            vec![],
        ),
    );
    p.run();
    assert_eq!(p.statuses(0, CqKind::Send).len(), 4);
    assert!(
        p.statuses(0, CqKind::Send)
            .iter()
            .all(|s| s.1 == WcStatus::Success)
    );
    let lens: Vec<u32> = p.s[1].wcs.iter().map(|(_, w)| w.byte_len).collect();
    assert_eq!(lens, [12, 0]);
    let mut got = [0u8; 14];
    p.s[1].mem.read(512, &mut got);
    assert_eq!(&got, b"written inline");
}

#[test]
fn posts_that_break_the_send_rules_are_refused() {
    let mut p = Pair::new();
    let read = SendOp::Read {
        remote_addr: IOVA[1],
        rkey: RKEY[1],
    };
    let write = SendOp::Write {
        remote_addr: IOVA[1],
        rkey: RKEY[1],
    };
    // Inline data is for SEND and WRITE, and within max_inline_data.
    let e = p.s[0]
        .qp
        .post_send(SendWr::new(1, read, vec![]).inline(&[7; 8]))
        .unwrap_err();
    assert!(matches!(e, PostError::Unsupported(_)), "{e}");
    let e = p.s[0]
        .qp
        .post_send(SendWr::new(2, write, vec![]).inline(&[7; 257]))
        .unwrap_err();
    assert!(
        matches!(
            e,
            PostError::InlineTooLarge {
                given: 257,
                max: 256
            }
        ),
        "{e}"
    );
    // At most 2 GiB, the IB and iWARP message limit (rxe's and siw's too).
    let e = p.s[0]
        .qp
        .post_send(SendWr::new(
            3,
            write,
            vec![sge(0, 0, 1 << 31), sge(0, 0, 1)],
        ))
        .unwrap_err();
    assert!(matches!(e, PostError::TooLong(0x8000_0001)), "{e}");
    p.s[0]
        .qp
        .post_send(SendWr::new(4, write, vec![sge(0, 0, 1 << 31)]))
        .expect("2 GiB is allowed (its keys are checked when it starts)");
    assert!(p.s[0].wcs.is_empty(), "nothing refused was posted");
}

#[test]
fn atomics_and_immediate_data_are_refused_on_post() {
    let mut p = Pair::new();
    for op in [
        SendOp::FetchAdd {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
            add: 1,
        },
        SendOp::SendWithImm(5),
        SendOp::WriteWithImm {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
            imm: 5,
        },
    ] {
        let e = p.s[0]
            .qp
            .post_send(SendWr::new(1, op, vec![sge(0, 0, 8)]))
            .unwrap_err();
        assert!(matches!(e, PostError::Unsupported(_)), "{e}");
    }
}

#[test]
fn a_bad_stag_terminates_and_both_sides_flush() {
    for (stag, off, layer, etype, code) in [
        (0xdead_beef, 0, Layer::Ddp, 1, 0x00),
        (RKEY[1], MEM as u64 - 10, Layer::Rdmap, 1, 0x01),
    ] {
        let mut p = Pair::new();
        p.recv(0, 50, vec![sge(0, 0, 64)]);
        p.post(
            0,
            SendWr::new(
                1,
                SendOp::Write {
                    remote_addr: IOVA[1] + off,
                    rkey: stag,
                },
                vec![sge(0, 0, 100)],
            ),
        );
        p.post(0, SendWr::new(2, SendOp::Send, vec![sge(0, 0, 8)]));
        p.run();
        // The target sent a Terminate with the DDP header of the segment.
        let t = p.s[1].qp.own_terminate().expect("a Terminate");
        assert_eq!(
            (t.control.layer, t.control.etype, t.control.code),
            (layer, etype, code)
        );
        let h = t
            .ddp_header
            .as_ref()
            .expect("the failed header")
            .parse()
            .unwrap();
        assert!(h.tagged());
        let pt = p.s[0].qp.peer_terminate().expect("the Terminate arrived");
        assert_eq!(pt.control, t.control);
        // The WRITE already completed (sent); the SEND after it fails with the
        // Terminate's status, the receive is flushed.
        assert_eq!(
            p.statuses(0, CqKind::Send),
            [(1, WcStatus::Success), (2, WcStatus::Success)]
        );
        assert_eq!(p.statuses(0, CqKind::Recv), [(50, WcStatus::WrFlushErr)]);
        assert_eq!(p.s[0].qp.state(), QpState::Err);
        assert_eq!(p.s[1].qp.state(), QpState::Err);
        // Work posted to the QP in error is flushed (as on siw), not refused.
        p.post(0, SendWr::new(3, SendOp::Send, vec![]));
        p.recv(0, 51, vec![]);
        p.run();
        assert_eq!(
            p.statuses(0, CqKind::Send),
            [
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::WrFlushErr)
            ]
        );
        assert_eq!(
            p.statuses(0, CqKind::Recv),
            [(50, WcStatus::WrFlushErr), (51, WcStatus::WrFlushErr)]
        );
    }
}

#[test]
fn a_bad_read_fails_the_read_with_rem_access_err() {
    let mut p = Pair::with(
        IwarpConfig::default(),
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        true,
    );
    p.post(0, read(1, 0, 100));
    p.post(0, SendWr::new(2, SendOp::Send, vec![sge(0, 0, 8)]));
    p.run();
    let t = p.s[1].qp.own_terminate().unwrap();
    assert_eq!(
        (t.control.layer, t.control.etype, t.control.code),
        (Layer::Rdmap, 1, 0x02)
    );
    assert!(
        t.control.r && t.rdma_header.is_some(),
        "the Read Request header goes along"
    );
    // The READ fails with the Terminate's status; the SEND behind it flushes
    // (it went out, but completes in order after the READ).
    assert_eq!(
        p.statuses(0, CqKind::Send),
        [(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]
    );
}

#[test]
fn a_send_without_a_receive_terminates_the_connection() {
    let mut p = Pair::new();
    p.post(0, SendWr::new(1, SendOp::Send, vec![sge(0, 0, 8)]));
    p.run();
    let t = p.s[1].qp.own_terminate().unwrap();
    assert_eq!(
        (t.control.layer, t.control.etype, t.control.code),
        (Layer::Ddp, 2, 0x02)
    );
    assert_eq!(p.s[1].qp.state(), QpState::Err);
}

#[test]
fn a_send_longer_than_the_receive_is_loc_len_err() {
    let mut p = Pair::new();
    p.recv(1, 9, vec![sge(1, 0, 100)]);
    p.post(0, SendWr::new(1, SendOp::Send, vec![sge(0, 0, 3000)]));
    p.run();
    assert_eq!(p.statuses(1, CqKind::Recv), [(9, WcStatus::LocLenErr)]);
    let t = p.s[1].qp.own_terminate().unwrap();
    assert_eq!(
        (t.control.layer, t.control.etype, t.control.code),
        (Layer::Ddp, 2, 0x05)
    );
}

#[test]
fn a_crc_error_ends_the_connection() {
    let mut p = Pair::new();
    p.recv(1, 9, vec![sge(1, 0, 100)]);
    p.post(0, SendWr::new(1, SendOp::Send, vec![sge(0, 0, 50)]));
    p.transmit(0);
    let n = p.wire[0].len();
    p.wire[0][n - 10] ^= 0x40;
    p.receive(0);
    assert_eq!(p.s[1].qp.state(), QpState::Err);
    assert_eq!(p.statuses(1, CqKind::Recv), [(9, WcStatus::WrFlushErr)]);
}

/// A WRITE completes only once the provider says its FPDUs are in the
/// socket, even if the receive side loses the connection meanwhile (the
/// bytes went out before); a failed write flushes it instead.
#[test]
fn a_write_completes_once_transmitted_and_is_flushed_if_its_write_fails() {
    for (case, want) in [
        ("written", WcStatus::Success),
        ("lost, then written", WcStatus::Success),
        ("write failed", WcStatus::WrFlushErr),
    ] {
        let mut p = Pair::new();
        p.post(
            0,
            SendWr::new(
                4,
                SendOp::Write {
                    remote_addr: IOVA[1],
                    rkey: RKEY[1],
                },
                vec![sge(0, 0, 64)],
            ),
        );
        let q = &mut p.s[0].qp;
        let (mut buf, mut pieces) = (vec![0u8; MAX_HEADER_LEN], Vec::new());
        assert!(
            q.poll_transmit(&p.s[0].mrs, &mut buf, &mut pieces)
                .is_some()
        );
        assert!(
            q.poll_completion().is_none(),
            "{case}: not before it is sent"
        );
        match case {
            "written" => q.transmitted(),
            "lost, then written" => {
                q.connection_lost();
                assert!(q.poll_completion().is_none(), "{case}: still the writer's");
                q.transmitted();
            }
            _ => {
                q.transmit_failed();
                q.connection_lost();
            }
        }
        let (k, wc) = q.poll_completion().expect("a completion");
        assert_eq!((k, wc.wr_id, wc.status), (CqKind::Send, 4, want), "{case}");
        assert!(q.poll_completion().is_none(), "{case}: completed once");
    }
}

#[test]
fn a_lost_connection_flushes_everything() {
    let mut p = Pair::new();
    p.recv(0, 5, vec![sge(0, 0, 8)]);
    p.post(0, read(1, 0, 8));
    p.transmit(0);
    p.s[0].qp.connection_lost();
    while let Some(c) = p.s[0].qp.poll_completion() {
        p.s[0].wcs.push(c);
    }
    assert_eq!(p.statuses(0, CqKind::Send), [(1, WcStatus::WrFlushErr)]);
    assert_eq!(p.statuses(0, CqKind::Recv), [(5, WcStatus::WrFlushErr)]);
    assert_eq!(p.s[0].qp.poll_event(), Some(QpEvent::Fatal));
}

#[test]
fn ord_limits_outstanding_reads_and_fence_waits_for_them() {
    let cfg = IwarpConfig {
        ord: 1,
        ird: 1,
        ..IwarpConfig::default()
    };
    let mut p = Pair::with(cfg, Access::ALL, false);
    for k in 0..3 {
        p.post(0, read(k, k * 64, 64));
    }
    // One Read Request goes out at a time.
    let mut buf = vec![0u8; MAX_HEADER_LEN];
    let mut pieces = Vec::new();
    assert!(
        p.s[0]
            .qp
            .poll_transmit(&p.s[0].mrs, &mut buf, &mut pieces)
            .is_some()
    );
    assert!(
        p.s[0]
            .qp
            .poll_transmit(&p.s[0].mrs, &mut buf, &mut pieces)
            .is_none()
    );
    let mut p = Pair::with(cfg, Access::ALL, false);
    for k in 0..3 {
        p.post(0, read(k, k * 64, 64));
    }
    p.run();
    assert_eq!(p.statuses(0, CqKind::Send).len(), 3);
    assert!(
        p.statuses(0, CqKind::Send)
            .iter()
            .all(|s| s.1 == WcStatus::Success)
    );
}

#[test]
fn the_peers_terminate_in_siws_layout_is_understood() {
    let cfg = IwarpConfig {
        terminate_encoding: TermEncoding::Siw,
        ..IwarpConfig::default()
    };
    let mut p = Pair::with(cfg, Access::ALL, true);
    p.post(
        0,
        SendWr::new(
            1,
            SendOp::Write {
                remote_addr: IOVA[1],
                rkey: 0x1234_5678,
            },
            vec![sge(0, 0, 10)],
        ),
    );
    p.post(0, SendWr::new(2, SendOp::Send, vec![sge(0, 0, 8)]));
    p.run();
    let pt = p.s[0].qp.peer_terminate().unwrap();
    assert_eq!(pt.encoding, TermEncoding::Siw);
    assert_eq!((pt.control.layer, pt.control.etype), (Layer::Ddp, 1));
    // Both went out before the Terminate came back; the QP is in error now.
    assert_eq!(
        p.statuses(0, CqKind::Send),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(p.s[0].qp.state(), QpState::Err);
}

#[test]
fn garbage_headers_terminate_instead_of_panicking() {
    let mut p = Pair::new();
    p.recv(1, 1, vec![sge(1, 0, 64)]);
    // An untagged header naming queue 5, then a bad RDMAP version.
    for hdr in [
        [0x41u8, 0x43, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 0],
        [0x41, 0x83, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0],
    ] {
        let mut q = Pair::new();
        let r = &mut q.s[1];
        assert!(matches!(
            r.qp.accept_header(&hdr, 0, &r.mrs, &mut Vec::new()),
            Placement::Discard
        ));
        r.qp.segment_done(&[], true, &r.mrs);
        assert!(r.qp.own_terminate().is_some());
        assert_eq!(r.qp.state(), QpState::Err);
    }
    // Short and empty headers too.
    let r = &mut p.s[1];
    assert!(matches!(
        r.qp.accept_header(&[0x80], 0, &r.mrs, &mut Vec::new()),
        Placement::Discard
    ));
    r.qp.segment_done(&[], true, &r.mrs);
    assert_eq!(r.qp.state(), QpState::Err);
}

#[test]
fn a_p2p_responder_holds_its_sends_until_the_rtr_and_refuses_another_first_message() {
    let responder = IwarpConfig {
        p2p: Some(P2p::Await(Rtr::Write)),
        ..IwarpConfig::default()
    };
    let mut p = Pair::of(IwarpConfig::default(), responder);
    p.recv(0, 1, vec![sge(0, 0, 64)]);
    p.post(1, SendWr::new(1, SendOp::Send, vec![]).inline(b"early"));
    p.transmit(1);
    assert!(p.wire[1].is_empty(), "nothing before the RTR");
    assert!(!p.s[1].qp.wants_transmit());
    // An initiator that is not in peer-to-peer mode sends a SEND first.
    p.recv(1, 2, vec![sge(1, 0, 64)]);
    p.post(0, SendWr::new(2, SendOp::Send, vec![]).inline(b"hi"));
    p.run();
    let t = p.s[1].qp.own_terminate().expect("the responder terminates");
    assert_eq!(
        (t.control.layer, t.control.etype, t.control.code),
        (Layer::Llp, 0, 0x07),
        "no matching RTR"
    );
    assert_eq!(p.statuses(1, CqKind::Send), [(1, WcStatus::WrFlushErr)]);
}

/// An RTR READ counts against ORD until its answer comes (siw keeps it in
/// its ORQ): with ORD 1 the application's READ waits for it, so a peer
/// serving one READ at a time never sees two.
#[test]
fn an_rtr_read_counts_against_ord() {
    let initiator = IwarpConfig {
        ord: 1,
        p2p: Some(P2p::Send(Rtr::Read)),
        ..IwarpConfig::default()
    };
    let responder = IwarpConfig {
        ird: 1,
        p2p: Some(P2p::Await(Rtr::Read)),
        ..IwarpConfig::default()
    };
    let mut p = Pair::of(initiator, responder);
    p.post(0, read(1, 0, 64));
    let mut buf = vec![0u8; MAX_HEADER_LEN];
    let mut pieces = Vec::new();
    let s = &mut p.s[0];
    assert!(
        s.qp.poll_transmit(&s.mrs, &mut buf, &mut pieces).is_some(),
        "the RTR"
    );
    assert!(
        s.qp.poll_transmit(&s.mrs, &mut buf, &mut pieces).is_none(),
        "the READ waits for the RTR's answer"
    );
    // From the start, with the RTR answered: the READ runs.
    let mut p = Pair::of(initiator, responder);
    p.s[1].mem.write(0, b"readable");
    p.post(0, read(1, 0, 8));
    p.run();
    assert_eq!(p.statuses(0, CqKind::Send), [(1, WcStatus::Success)]);
    assert!(p.s[1].qp.own_terminate().is_none());
}

/// A Terminate in place of the RTR (RFC 6581: the initiator found no
/// matching RTR, or too few IRD) is the peer's reason, taken as any
/// Terminate, not answered with one.
#[test]
fn a_terminate_in_place_of_the_rtr_is_taken_as_the_peers() {
    let responder = IwarpConfig {
        p2p: Some(P2p::Await(Rtr::Write)),
        ..IwarpConfig::default()
    };
    let mut p = Pair::of(IwarpConfig::default(), responder);
    // Side 0 fails (its CQ overran): a Terminate is its first FPDU.
    p.s[0].qp.cq_overrun();
    p.run();
    assert!(
        p.s[1].qp.peer_terminate().is_some(),
        "the peer's reason kept"
    );
    assert!(
        p.s[1].qp.own_terminate().is_none(),
        "no Terminate answers one"
    );
}

#[test]
fn zero_length_writes_and_reads_do_not_check_the_stag() {
    let mut p = Pair::new();
    for (id, op) in [
        (
            1,
            SendOp::Write {
                remote_addr: 0,
                rkey: 0xdead_0000,
            },
        ),
        (
            2,
            SendOp::Read {
                remote_addr: 0,
                rkey: 0xdead_0000,
            },
        ),
    ] {
        p.post(0, SendWr::new(id, op, vec![]));
    }
    p.run();
    assert_eq!(
        p.statuses(0, CqKind::Send),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert!(p.s[1].qp.own_terminate().is_none());
}

/// A poster may send on its own thread only what is alone and small: one
/// WR not yet started, within the bound, nothing else queued.
#[test]
fn a_lone_small_send_is_the_posters_to_send() {
    let mut p = Pair::new();
    let write = |id, len| {
        SendWr::new(
            id,
            SendOp::Write {
                remote_addr: IOVA[1],
                rkey: RKEY[1],
            },
            vec![sge(0, 0, len)],
        )
    };
    assert!(!p.s[0].qp.lone_send_within(4096), "nothing queued");
    p.post(0, write(1, 64));
    assert!(p.s[0].qp.lone_send_within(4096));
    assert!(!p.s[0].qp.lone_send_within(63), "larger than the bound");
    p.post(0, write(2, 64));
    assert!(!p.s[0].qp.lone_send_within(4096), "two queued");
    p.transmit(0);
    assert!(!p.s[0].qp.lone_send_within(4096), "all sent");
    p.post(0, write(3, 10_000));
    assert!(!p.s[0].qp.lone_send_within(4096));
    assert!(p.s[0].qp.lone_send_within(10_000));
}

#[test]
fn a_lone_small_read_is_a_lone_response_and_anything_more_is_not() {
    let cfg = IwarpConfig {
        ord: 2,
        ird: 2,
        ..IwarpConfig::default()
    };
    let mut p = Pair::with(cfg, Access::ALL, true);
    assert!(!p.s[1].qp.lone_response_within(4096), "nothing to answer");
    // One READ of 4 KiB: the answer is lone and small.
    p.post(0, read(1, 0, 4096));
    p.transmit(0);
    p.receive(0);
    assert!(p.s[1].qp.lone_response_within(4096));
    assert!(!p.s[1].qp.lone_response_within(4095), "larger than allowed");
    // A second READ waiting behind it: no longer lone.
    p.post(0, read(2, 0, 16));
    p.transmit(0);
    p.receive(0);
    assert!(!p.s[1].qp.lone_response_within(1 << 20));
    p.run();
    assert!(!p.s[1].qp.lone_response_within(1 << 20), "all answered");
    // A READ to answer with a SEND of the responder's own ready: not lone.
    p.recv(0, 7, vec![sge(0, 0, 64)]);
    p.post(1, SendWr::new(3, SendOp::Send, vec![sge(1, 0, 8)]));
    p.post(0, read(4, 0, 8));
    p.transmit(0);
    p.receive(0);
    assert!(p.s[1].qp.wants_transmit());
    assert!(!p.s[1].qp.lone_response_within(1 << 20));
    p.run();
    assert_eq!(
        p.statuses(0, CqKind::Send),
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (4, WcStatus::Success)
        ]
    );
}

/// The QP's own access flags gate WRITEs and READs before the region's
/// rights (a zero-length one too, as RC's responder), with an access
/// rights violation; what one allows, the other's lack still refuses.
#[test]
fn the_qps_access_flags_refuse_what_they_leave_out() {
    let write = |len| {
        SendWr::new(
            1,
            SendOp::Write {
                remote_addr: IOVA[1],
                rkey: RKEY[1],
            },
            vec![sge(0, 0, len)],
        )
    };
    for (allowed, wr, status, is_read) in [
        (Access::REMOTE_READ, write(100), WcStatus::Success, false),
        (Access::REMOTE_READ, write(0), WcStatus::Success, false),
        (
            Access::REMOTE_WRITE,
            read(1, 0, 100),
            WcStatus::RemAccessErr,
            true,
        ),
        (
            Access::REMOTE_WRITE,
            read(1, 0, 0),
            WcStatus::RemAccessErr,
            true,
        ),
    ] {
        let mut p = Pair::new();
        assert_eq!(p.s[1].qp.access(), DEFAULT_ACCESS);
        p.s[1].qp.set_access(allowed);
        p.s[1].mem.write(0, b"untouched");
        p.s[0].mem.write(0, &[0xaa; 100]);
        p.post(0, wr);
        p.post(0, SendWr::new(2, SendOp::Send, vec![sge(0, 0, 8)]));
        p.run();
        let t = p.s[1].qp.own_terminate().expect("a Terminate");
        assert_eq!(
            (t.control.layer, t.control.etype, t.control.code),
            (Layer::Rdmap, 1, 0x02)
        );
        assert_eq!(t.control.r, is_read, "a Read Request's header goes along");
        // A WRITE completed when sent; the READ fails with the Terminate.
        let after = if is_read {
            WcStatus::WrFlushErr
        } else {
            WcStatus::Success
        };
        assert_eq!(p.statuses(0, CqKind::Send), [(1, status), (2, after)]);
        // Nothing placed: the target region, or the READ's sink.
        let mut b = [0u8; 9];
        p.s[1].mem.read(0, &mut b);
        assert_eq!(&b, b"untouched");
        let mut sink = [0u8; 100];
        p.s[0].mem.read(0, &mut sink);
        assert_eq!(sink, [0xaa; 100]);
        assert_eq!(p.s[1].qp.state(), QpState::Err);
    }
    // Allowed by the QP, refused by the region: the region's rights hold.
    let mut p = Pair::with(IwarpConfig::default(), Access::LOCAL_WRITE, true);
    p.s[1].qp.set_access(Access::ALL);
    p.post(0, write(8));
    p.run();
    let t = p.s[1].qp.own_terminate().expect("a Terminate");
    assert_eq!(
        (t.control.layer, t.control.etype, t.control.code),
        (Layer::Rdmap, 1, 0x02)
    );
}

/// The peer-to-peer RTR is part of the connection's start: a QP that
/// allows no remote access still takes it, WRITE or READ.
#[test]
fn the_rtr_passes_a_qp_that_allows_no_remote_access() {
    for rtr in [Rtr::Write, Rtr::Read] {
        let initiator = IwarpConfig {
            p2p: Some(P2p::Send(rtr)),
            ..IwarpConfig::default()
        };
        let responder = IwarpConfig {
            p2p: Some(P2p::Await(rtr)),
            ..IwarpConfig::default()
        };
        let mut p = Pair::of(initiator, responder);
        p.s[1].qp.set_access(Access::NONE);
        p.recv(1, 7, vec![sge(1, 0, 64)]);
        p.post(0, SendWr::new(1, SendOp::Send, vec![]).inline(b"after"));
        p.run();
        assert!(p.s[1].qp.own_terminate().is_none(), "{rtr:?}");
        assert_eq!(p.statuses(1, CqKind::Recv), [(7, WcStatus::Success)]);
        // After it, the QP's access holds.
        p.post(
            0,
            SendWr::new(
                2,
                SendOp::Write {
                    remote_addr: IOVA[1],
                    rkey: RKEY[1],
                },
                vec![],
            ),
        );
        p.run();
        let t = p.s[1].qp.own_terminate().expect("a Terminate");
        assert_eq!(t.control.code, 0x02, "{rtr:?}");
    }
    // A READ in the RTR READ's place that would read something is no RTR
    // (RFC 6581's reads nothing): the QP's access holds for it.
    let responder = IwarpConfig {
        p2p: Some(P2p::Await(Rtr::Read)),
        ..IwarpConfig::default()
    };
    let mut p = Pair::of(IwarpConfig::default(), responder);
    p.s[1].qp.set_access(Access::REMOTE_WRITE);
    p.s[1].mem.write(0, b"secret");
    p.post(0, read(1, 0, 6));
    p.run();
    let t = p.s[1].qp.own_terminate().expect("a Terminate");
    assert_eq!(
        (t.control.layer, t.control.etype, t.control.code),
        (Layer::Rdmap, 1, 0x02)
    );
    assert_eq!(p.statuses(0, CqKind::Send), [(1, WcStatus::RemAccessErr)]);
    let mut got = [0u8; 6];
    p.s[0].mem.read(0, &mut got);
    assert_eq!(got, [0u8; 6]);
}
