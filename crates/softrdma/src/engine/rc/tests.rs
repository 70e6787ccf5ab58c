//! The RC engine between two QPs over the simulator: every opcode, every error
//! completion, and the transport's answers to duplicates and gaps.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::engine::sim::{Endpoint, NetConfig, Sim};
use crate::engine::{
    InlineData, QpAttr, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};
use crate::memory::{Access, MrTable, Region, RegionMemory};

const MEM: usize = 1 << 20;
const IOVA: [u64; 2] = [0x1000_0000, 0x2000_0000];
const LKEY: [u32; 2] = [0x0a0a_0001, 0x0b0b_0001];
const RKEY: [u32; 2] = [0x0a0a_0002, 0x0b0b_0002];
const QPN: [u32; 2] = [0x11, 0x12];

fn endpoint(i: usize, mr_access: Access) -> Endpoint {
    let mem = Arc::new(RegionMemory::zeroed(MEM).unwrap());
    let mut mrs = MrTable::new();
    mrs.insert(Region::new(1, (LKEY[i], RKEY[i]), mem, 0, MEM, IOVA[i], mr_access).unwrap());
    let qp = RcQp::new(QPN[i], 1, QpCaps::default());
    Endpoint::new(qp, mrs, [10, 0, 0, 1 + i as u8])
}

struct Pair {
    sim: Sim,
    next_wr: u64,
}

#[derive(Clone, Copy)]
struct Setup {
    pmtu: Mtu,
    psn: [u32; 2],
    qp_access: Access,
    mr_access: Access,
    retry_cnt: u8,
    rnr_retry: u8,
    max_rd_atomic: u8,
    timeout: u8,
    net: NetConfig,
    seed: u64,
    /// End 1 stays in RTR.
    end1_in_rtr: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            pmtu: Mtu::Mtu1024,
            psn: [0x12_3456, 0xff_fff0],
            qp_access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            mr_access: Access::ALL,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 4,
            timeout: 10,
            net: NetConfig::PERFECT,
            seed: 1,
            end1_in_rtr: false,
        }
    }
}

impl Pair {
    fn new(s: Setup) -> Pair {
        let mut sim = Sim::new(
            s.seed,
            s.net,
            endpoint(0, s.mr_access),
            endpoint(1, s.mr_access),
        );
        for i in 0..2 {
            let qp = &mut sim.ends[i].qp;
            qp.modify(&QpAttr {
                state: Some(QpState::Init),
                pkey_index: Some(0),
                port: Some(1),
                access: Some(s.qp_access),
                ..QpAttr::default()
            })
            .unwrap();
            qp.modify(&QpAttr {
                state: Some(QpState::Rtr),
                path_mtu: Some(s.pmtu),
                dest_qp: Some(QPN[1 - i]),
                rq_psn: Some(s.psn[1 - i]),
                max_dest_rd_atomic: Some(16),
                min_rnr_timer: Some(1),
                has_av: true,
                ..QpAttr::default()
            })
            .unwrap();
            if i == 1 && s.end1_in_rtr {
                continue;
            }
            qp.modify(&QpAttr {
                state: Some(QpState::Rts),
                sq_psn: Some(s.psn[i]),
                max_rd_atomic: Some(s.max_rd_atomic),
                retry_cnt: Some(s.retry_cnt),
                rnr_retry: Some(s.rnr_retry),
                timeout: Some(s.timeout),
                ..QpAttr::default()
            })
            .unwrap();
        }
        Pair { sim, next_wr: 1 }
    }

    fn write_mem(&self, i: usize, off: u64, data: &[u8]) {
        let e = &self.sim.ends[i];
        e.mrs
            .local(1, LKEY[i], IOVA[i] + off, data.len() as u32, Access::NONE)
            .unwrap()
            .write(0, data);
    }

    fn read_mem(&self, i: usize, off: u64, len: usize) -> Vec<u8> {
        let e = &self.sim.ends[i];
        let mut v = vec![0u8; len];
        e.mrs
            .local(1, LKEY[i], IOVA[i] + off, len as u32, Access::NONE)
            .unwrap()
            .read(0, &mut v);
        v
    }

    fn sge(i: usize, off: u64, len: u32) -> Sge {
        Sge {
            addr: IOVA[i] + off,
            len,
            lkey: LKEY[i],
        }
    }

    fn send(&mut self, i: usize, op: SendOp, sgl: Vec<Sge>) -> u64 {
        self.send_flags(
            i,
            op,
            sgl,
            SendFlags {
                signaled: true,
                ..SendFlags::default()
            },
        )
    }

    fn send_flags(&mut self, i: usize, op: SendOp, sgl: Vec<Sge>, flags: SendFlags) -> u64 {
        let wr_id = self.next_wr;
        self.next_wr += 1;
        self.sim.ends[i]
            .qp
            .post_send(SendWr {
                wr_id,
                op,
                sgl: sgl.into(),
                flags,
                ud: None,
                inline_data: InlineData::new(),
            })
            .unwrap();
        wr_id
    }

    /// A WRITE of `len` bytes from the start of end 0's memory to `off` in
    /// end 1's, signaled.
    fn write(&mut self, off: u64, len: u32) -> u64 {
        let op = SendOp::Write {
            remote_addr: IOVA[1] + off,
            rkey: RKEY[1],
        };
        self.send(0, op, vec![Pair::sge(0, 0, len)])
    }

    /// Hands end `to` packets taken by hand (see `take_packets`), now.
    fn deliver<'a>(&mut self, to: usize, packets: impl IntoIterator<Item = &'a Vec<u8>>) {
        let now = self.sim.now;
        let e = &mut self.sim.ends[to];
        for packet in packets {
            e.qp.handle_packet(now, packet, &e.mrs);
        }
    }

    /// Moves end `i`'s QP to SQD (a drain).
    fn drain(&mut self, i: usize) {
        self.sim.ends[i]
            .qp
            .modify(&QpAttr {
                state: Some(QpState::Sqd),
                ..QpAttr::default()
            })
            .unwrap();
    }

    fn recv(&mut self, i: usize, sgl: Vec<Sge>) -> u64 {
        let wr_id = self.next_wr;
        self.next_wr += 1;
        self.sim.ends[i]
            .qp
            .post_recv(RecvWr::new(wr_id, sgl))
            .unwrap();
        wr_id
    }

    /// Runs until both sides have `n` completions (or the network goes quiet).
    fn run(&mut self, n: [usize; 2]) {
        let ok = self.sim.run_until(Duration::from_secs(30), |s| {
            s.ends[0].completions.len() >= n[0] && s.ends[1].completions.len() >= n[1]
        });
        assert!(
            ok,
            "wanted {n:?} completions, have {:?} / {:?}",
            self.sim.ends[0].completions, self.sim.ends[1].completions
        );
    }

    fn wcs(&self, i: usize) -> Vec<(CqKind, WorkCompletion)> {
        self.sim.ends[i].completions.clone()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn send_recv_multi_packet_with_psn_wrap() {
    let mut p = Pair::new(Setup::default());
    let data = pattern(5000, 7);
    p.write_mem(0, 0, &data);
    let r = p.recv(1, vec![Pair::sge(1, 100, 3000), Pair::sge(1, 8000, 3000)]);
    let s = p.send(
        0,
        SendOp::Send,
        vec![Pair::sge(0, 0, 1000), Pair::sge(0, 1000, 4000)],
    );
    p.run([1, 1]);
    let (kind, wc) = p.wcs(1)[0];
    assert_eq!(kind, CqKind::Recv);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (r, WcStatus::Success, WcOpcode::Recv, 5000)
    );
    assert_eq!(wc.imm, None);
    assert_eq!(p.read_mem(1, 100, 3000), data[..3000]);
    assert_eq!(p.read_mem(1, 8000, 2000), data[3000..]);
    let (kind, wc) = p.wcs(0)[0];
    assert_eq!(
        (kind, wc.wr_id, wc.status, wc.opcode),
        (CqKind::Send, s, WcStatus::Success, WcOpcode::Send)
    );
    // 5 packets at PMTU 1024, from 0xfffff0 (the B->A side wraps too).
    assert_eq!(p.sim.ends[0].qp.query().sq_psn, Some(0x12_3456 + 5));
}

#[test]
fn send_with_immediate_and_solicited() {
    let mut p = Pair::new(Setup::default());
    p.write_mem(0, 0, b"hello");
    p.recv(1, vec![Pair::sge(1, 0, 64)]);
    p.send_flags(
        0,
        SendOp::SendWithImm(0xdead_beef),
        vec![Pair::sge(0, 0, 5)],
        SendFlags {
            signaled: true,
            solicited: true,
            ..SendFlags::default()
        },
    );
    p.run([1, 1]);
    let wc = p.wcs(1)[0].1;
    assert_eq!(
        (wc.imm, wc.byte_len, wc.solicited),
        (Some(0xdead_beef), 5, true)
    );
    assert_eq!(p.read_mem(1, 0, 5), b"hello");
}

#[test]
fn inline_send() {
    let mut p = Pair::new(Setup::default());
    p.recv(1, vec![Pair::sge(1, 0, 64)]);
    p.sim.ends[0]
        .qp
        .post_send(SendWr {
            wr_id: 9,
            op: SendOp::Send,
            sgl: Default::default(),
            flags: SendFlags {
                signaled: true,
                inline: true,
                ..SendFlags::default()
            },
            ud: None,
            inline_data: InlineData::from_slice(b"inline!"),
        })
        .unwrap();
    p.run([1, 1]);
    assert_eq!(p.read_mem(1, 0, 7), b"inline!");
    assert_eq!(p.wcs(1)[0].1.byte_len, 7);
}

#[test]
fn rdma_write_and_write_with_immediate() {
    let mut p = Pair::new(Setup::default());
    let data = pattern(3333, 3);
    p.write_mem(0, 0, &data);
    let w = p.send(
        0,
        SendOp::Write {
            remote_addr: IOVA[1] + 4096,
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 3333)],
    );
    p.run([1, 0]);
    assert_eq!(p.wcs(0)[0].1.wr_id, w);
    assert_eq!(p.wcs(0)[0].1.opcode, WcOpcode::RdmaWrite);
    assert_eq!(p.read_mem(1, 4096, 3333), data);
    assert!(
        p.wcs(1).is_empty(),
        "a plain WRITE is invisible to the target"
    );
    // With immediate: consumes a receive, reports the length and the immediate.
    let r = p.recv(1, vec![]);
    p.send(
        0,
        SendOp::WriteWithImm {
            remote_addr: IOVA[1] + 65536,
            rkey: RKEY[1],
            imm: 42,
        },
        vec![Pair::sge(0, 0, 2049)],
    );
    p.run([2, 1]);
    let wc = p.wcs(1)[0].1;
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.byte_len, wc.imm),
        (r, WcOpcode::RecvRdmaWithImm, 2049, Some(42))
    );
    assert_eq!(p.read_mem(1, 65536, 2049), data[..2049]);
}

#[test]
fn a_write_goes_as_write_only_packets_and_with_an_immediate_as_one_message() {
    use softrdma_wire::Opcode as O;
    use softrdma_wire::packet::{Packet, Repr};
    let parse = |b: &Vec<u8>| Repr::parse(&Packet::new_checked(&b[..]).unwrap()).unwrap();
    let mut p = Pair::new(Setup::default());
    let data = pattern(3 * 1024 + 100, 5);
    p.write_mem(0, 0, &data);
    let w = p.write(7000, data.len() as u32);
    // Four packets of one size (the last shorter), each a WRITE ONLY
    // whose RETH names its own part; only the last asks for the ACK.
    let packets = take_packets(&mut p, 0, 10);
    assert_eq!(packets.len(), 4);
    let first_psn = parse(&packets[0]).bth.psn;
    for (k, b) in packets.iter().enumerate() {
        let r = parse(b);
        let reth = r.reth.expect("a RETH on every packet");
        let len = if k == 3 { 100 } else { 1024 };
        assert_eq!(r.bth.opcode, O::RC_RDMA_WRITE_ONLY);
        assert_eq!(r.bth.psn, first_psn.add(k as u32));
        assert_eq!(r.bth.ack_req, k == 3, "packet {k}");
        assert_eq!(
            (reth.va, reth.rkey, reth.dma_len, r.payload_len),
            (IOVA[1] + 7000 + 1024 * k as u64, RKEY[1], len as u32, len)
        );
    }
    assert_eq!(packets[0].len(), packets[2].len());
    p.deliver(1, &packets);
    p.run([1, 0]);
    assert_eq!(p.wcs(0)[0].1.wr_id, w);
    assert_eq!(p.wcs(0)[0].1.status, WcStatus::Success);
    assert_eq!(p.read_mem(1, 7000, data.len()), data);
    // With an immediate: FIRST, MIDDLE, LAST WITH IMMEDIATE, one message
    // whose receive completion reports the whole length.
    let r = p.recv(1, vec![]);
    p.send(
        0,
        SendOp::WriteWithImm {
            remote_addr: IOVA[1] + 65536,
            rkey: RKEY[1],
            imm: 9,
        },
        vec![Pair::sge(0, 0, 2049)],
    );
    let packets = take_packets(&mut p, 0, 10);
    let opcodes: Vec<O> = packets.iter().map(|b| parse(b).bth.opcode).collect();
    assert_eq!(
        opcodes,
        [
            O::RC_RDMA_WRITE_FIRST,
            O::RC_RDMA_WRITE_MIDDLE,
            O::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE
        ]
    );
    p.deliver(1, &packets);
    p.run([2, 1]);
    let wc = p.wcs(1)[0].1;
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.byte_len, wc.imm),
        (r, WcOpcode::RecvRdmaWithImm, 2049, Some(9))
    );
    assert_eq!(p.read_mem(1, 65536, 2049), data[..2049]);
}

#[test]
fn middle_packets_match_the_general_framing() {
    use softrdma_wire::Opcode as O;
    // 70 packets of 256 bytes, the last 246: the middle ones take the
    // requester's short path, the first and last the general one.
    let len = 70 * 256 - 10;
    let data = pattern(len, 3);
    let ops = [
        SendOp::Send,
        SendOp::SendWithImm(7),
        SendOp::Write {
            remote_addr: IOVA[1] + 100,
            rkey: RKEY[1],
        },
        SendOp::WriteWithImm {
            remote_addr: IOVA[1] + 100,
            rkey: RKEY[1],
            imm: 7,
        },
    ];
    for op in ops {
        let mut p = Pair::new(Setup {
            pmtu: Mtu::Mtu256,
            ..Setup::default()
        });
        p.write_mem(0, 0, &data);
        p.send(0, op, vec![Pair::sge(0, 0, len as u32)]);
        let packets = take_packets(&mut p, 0, 100);
        assert_eq!(packets.len(), 70, "{op:?}");
        let first = reframed(&packets[0], &format!("{op:?} packet 0")).0;
        for (k, b) in packets.iter().enumerate() {
            let (r, h) = reframed(b, &format!("{op:?} packet {k}"));
            let last = k == 69;
            let want = match (op, k, last) {
                (SendOp::Write { .. }, _, _) => O::RC_RDMA_WRITE_ONLY,
                (_, 0, _) if matches!(op, SendOp::WriteWithImm { .. }) => O::RC_RDMA_WRITE_FIRST,
                (_, 0, _) => O::RC_SEND_FIRST,
                (SendOp::WriteWithImm { .. }, _, true) => O::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                (SendOp::WriteWithImm { .. }, _, false) => O::RC_RDMA_WRITE_MIDDLE,
                (SendOp::SendWithImm(_), _, true) => O::RC_SEND_LAST_WITH_IMMEDIATE,
                (_, _, true) => O::RC_SEND_LAST,
                _ => O::RC_SEND_MIDDLE,
            };
            assert_eq!(r.bth.opcode, want, "{op:?} packet {k}");
            assert_eq!(r.bth.psn, first.bth.psn.add(k as u32));
            assert_eq!(r.bth.dest_qp, QPN[1]);
            // An ACK asked for every 64 packets, and by the last.
            assert_eq!(r.bth.ack_req, k == 63 || last, "{op:?} packet {k}");
            assert!(!r.bth.solicited);
            let plen = if last { 246 } else { 256 };
            assert_eq!(r.payload_len, plen);
            let at = h;
            assert_eq!(&b[at..at + plen], &data[k * 256..k * 256 + plen]);
            if let SendOp::Write { .. } = op {
                let reth = r.reth.expect("a RETH on every WRITE ONLY");
                assert_eq!(
                    (reth.va, reth.rkey, reth.dma_len),
                    (IOVA[1] + 100 + 256 * k as u64, RKEY[1], plen as u32)
                );
            }
        }
        p.deliver(1, &packets);
        // The responder's answers, framed as the general path would: ACKs,
        // and where a receive is consumed (none is posted yet) an RNR NAK
        // (for a SEND, then a sequence NAK for the packet after it).
        let answers = take_packets(&mut p, 1, 10);
        let mut rnr_naks = 0;
        for b in &answers {
            let (r, h) = reframed(b, &format!("{op:?} answer"));
            assert_eq!(h, b.len() - 4, "{op:?}");
            assert_eq!(r.bth.opcode, O::RC_ACKNOWLEDGE);
            assert_eq!(r.bth.dest_qp, QPN[0]);
            let aeth = r.aeth.expect("an AETH");
            if let SendOp::Write { .. } = op {
                assert!(aeth.syndrome.is_ack(), "{op:?}: {aeth:?}");
            }
            rnr_naks += usize::from(matches!(
                aeth.syndrome,
                softrdma_wire::aeth::Syndrome::RnrNak(_)
            ));
        }
        let consumes = !matches!(op, SendOp::Write { .. });
        assert_eq!(
            rnr_naks,
            usize::from(consumes),
            "{op:?}: {} answers",
            answers.len()
        );
        p.deliver(0, &answers);
        if matches!(op, SendOp::Send | SendOp::SendWithImm(_)) {
            p.recv(1, vec![Pair::sge(1, 0, len as u32)]);
            // The receive came after the packets: they are retransmitted.
            p.run([1, 1]);
            assert_eq!(p.read_mem(1, 0, len), data, "{op:?}");
        } else {
            p.recv(1, vec![]);
            p.run([1, 0]);
            assert_eq!(p.read_mem(1, 100, len), data, "{op:?}");
        }
        assert_eq!(p.wcs(0)[0].1.status, WcStatus::Success, "{op:?}");
    }
}

#[test]
fn read_response_middles_match_the_general_framing() {
    use softrdma_wire::Opcode as O;
    let len = 70 * 256 - 10;
    let data = pattern(len, 9);
    let mut p = Pair::new(Setup {
        pmtu: Mtu::Mtu256,
        ..Setup::default()
    });
    p.write_mem(1, 300, &data);
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1] + 300,
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, len as u32)],
    );
    let request = take_packets(&mut p, 0, 10);
    assert_eq!(request.len(), 1);
    p.deliver(1, &request);
    let responses = take_packets(&mut p, 1, 100);
    assert_eq!(responses.len(), 70);
    let req = reframed(&request[0], "request").0;
    for (k, b) in responses.iter().enumerate() {
        let (r, h) = reframed(b, &format!("response {k}"));
        let (first, last) = (k == 0, k == 69);
        let want = match (first, last) {
            (true, _) => O::RC_RDMA_READ_RESPONSE_FIRST,
            (_, true) => O::RC_RDMA_READ_RESPONSE_LAST,
            _ => O::RC_RDMA_READ_RESPONSE_MIDDLE,
        };
        assert_eq!(r.bth.opcode, want, "response {k}");
        assert_eq!(r.bth.psn, req.bth.psn.add(k as u32));
        assert_eq!(r.bth.dest_qp, QPN[0]);
        assert_eq!(r.aeth.is_some(), first || last, "response {k}");
        assert!(!r.bth.ack_req && !r.bth.solicited, "response {k}");
        let plen = if last { 246 } else { 256 };
        assert_eq!(r.payload_len, plen);
        assert_eq!(&b[h..h + plen], &data[k * 256..k * 256 + plen]);
    }
    p.deliver(0, &responses);
    p.run([1, 0]);
    assert_eq!(p.wcs(0)[0].1.status, WcStatus::Success);
    assert_eq!(p.read_mem(0, 0, len), data);
}

#[test]
fn rdma_read() {
    let mut p = Pair::new(Setup::default());
    let data = pattern(10_000, 9);
    p.write_mem(1, 200_000, &data);
    let id = p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1] + 200_000,
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 7000), Pair::sge(0, 50_000, 3000)],
    );
    p.run([1, 0]);
    let wc = p.wcs(0)[0].1;
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (id, WcStatus::Success, WcOpcode::RdmaRead, 10_000)
    );
    assert_eq!(p.read_mem(0, 0, 7000), data[..7000]);
    assert_eq!(p.read_mem(0, 50_000, 3000), data[7000..]);
}

/// The responder counts what it has queued to send: each READ response
/// packet not yet sent, and an ACK as one.
#[test]
fn the_responder_counts_the_responses_it_has_queued() {
    let mut p = Pair::new(Setup::default());
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 0);
    for k in 0..2 {
        p.send(
            0,
            SendOp::Read {
                remote_addr: IOVA[1] + k * 8192,
                rkey: RKEY[1],
            },
            vec![Pair::sge(0, k * 8192, 3000)],
        );
    }
    let requests = take_packets(&mut p, 0, 2);
    p.deliver(1, &requests);
    // Two READs of three 1 KiB packets each.
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 6);
    let first = take_packets(&mut p, 1, 4);
    assert_eq!(first.len(), 4);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 2);
    take_packets(&mut p, 1, 2);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 0);
    // A WRITE asks for an ACK: one packet queued until it is sent.
    p.write(0, 8);
    let write = take_packets(&mut p, 0, 1);
    p.deliver(1, &write);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 1);
    take_packets(&mut p, 1, 1);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 0);
}

/// A READ asked for again while its responses are still queued does not
/// queue a second stream: a retransmitting requester, or a peer that floods
/// one request, gets the one stream, moved back to the PSN it asked from.
#[test]
fn a_repeated_read_request_does_not_queue_another_response_stream() {
    let mut p = Pair::new(Setup::default());
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 3000)],
    );
    let request = take_packets(&mut p, 0, 1);
    p.deliver(1, &request);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 3);
    for _ in 0..1000 {
        p.deliver(1, &request);
    }
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 3);
    // Two of the three sent, then asked again: all three go again.
    assert_eq!(take_packets(&mut p, 1, 2).len(), 2);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 1);
    p.deliver(1, &request);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 3);
    let responses = take_packets(&mut p, 1, 3);
    p.deliver(0, &responses);
    p.run([1, 0]);
    let wc = p.wcs(0)[0].1;
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 3000));
}

/// No more READs in flight than max_rd_atomic (4 here), however many are
/// queued; each answered one lets the next go, and all land.
#[test]
fn reads_in_flight_stay_within_max_rd_atomic() {
    use softrdma_wire::Opcode as O;
    use softrdma_wire::packet::{Packet, Repr};
    let opcode = |b: &Vec<u8>| {
        Repr::parse(&Packet::new_checked(&b[..]).unwrap())
            .unwrap()
            .bth
            .opcode
    };
    let mut p = Pair::new(Setup::default());
    let data = pattern(10 * 100, 3);
    p.write_mem(1, 300_000, &data);
    let ids: Vec<u64> = (0..10u64)
        .map(|k| {
            p.send(
                0,
                SendOp::Read {
                    remote_addr: IOVA[1] + 300_000 + k * 100,
                    rkey: RKEY[1],
                },
                vec![Pair::sge(0, k * 100, 100)],
            )
        })
        .collect();
    let first = take_packets(&mut p, 0, 20);
    assert_eq!(first.len(), 4, "READ requests before any response");
    assert!(first.iter().all(|b| opcode(b) == O::RC_RDMA_READ_REQUEST));
    // One answered: one more leaves.
    p.deliver(1, &first[..1]);
    let answer = take_packets(&mut p, 1, 5);
    assert_eq!(answer.len(), 1);
    p.deliver(0, &answer);
    let fifth = take_packets(&mut p, 0, 20);
    assert_eq!(fifth.len(), 1);
    // The rest in the simulator: every READ completes, in order.
    p.deliver(1, first[1..].iter().chain(&fifth));
    p.run([10, 0]);
    let wcs = p.wcs(0);
    assert_eq!(wcs.iter().map(|c| c.1.wr_id).collect::<Vec<_>>(), ids);
    assert!(wcs.iter().all(|c| c.1.status == WcStatus::Success));
    assert_eq!(p.read_mem(0, 0, data.len()), data);
}

#[test]
fn zero_length_operations() {
    let mut p = Pair::new(Setup::default());
    p.recv(1, vec![]);
    p.send(0, SendOp::Send, vec![]);
    p.send(
        0,
        SendOp::Write {
            remote_addr: 0,
            rkey: 0,
        },
        vec![],
    );
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![],
    );
    p.run([3, 1]);
    assert!(p.wcs(0).iter().all(|c| c.1.status == WcStatus::Success));
    assert_eq!(p.wcs(1)[0].1.byte_len, 0);
}

#[test]
fn atomics() {
    let mut p = Pair::new(Setup::default());
    p.write_mem(1, 64, &100u64.to_ne_bytes());
    p.send(
        0,
        SendOp::FetchAdd {
            remote_addr: IOVA[1] + 64,
            rkey: RKEY[1],
            add: 5,
        },
        vec![Pair::sge(0, 0, 8)],
    );
    p.send(
        0,
        SendOp::CompareSwap {
            remote_addr: IOVA[1] + 64,
            rkey: RKEY[1],
            compare: 105,
            swap: 7,
        },
        vec![Pair::sge(0, 8, 8)],
    );
    p.send(
        0,
        SendOp::CompareSwap {
            remote_addr: IOVA[1] + 64,
            rkey: RKEY[1],
            compare: 105,
            swap: 9,
        },
        vec![Pair::sge(0, 16, 8)],
    );
    p.run([3, 0]);
    let ops: Vec<_> = p.wcs(0).iter().map(|c| c.1.opcode).collect();
    assert_eq!(
        ops,
        [
            WcOpcode::FetchAdd,
            WcOpcode::CompareSwap,
            WcOpcode::CompareSwap
        ]
    );
    let got = |off| u64::from_ne_bytes(p.read_mem(0, off, 8).try_into().unwrap());
    assert_eq!((got(0), got(8), got(16)), (100, 105, 7));
    assert_eq!(
        u64::from_ne_bytes(p.read_mem(1, 64, 8).try_into().unwrap()),
        7
    );
}

#[test]
fn unsignaled_requests_complete_silently() {
    let mut p = Pair::new(Setup::default());
    for _ in 0..5 {
        p.send_flags(
            0,
            SendOp::Write {
                remote_addr: IOVA[1],
                rkey: RKEY[1],
            },
            vec![Pair::sge(0, 0, 100)],
            SendFlags::default(),
        );
    }
    let last = p.send(
        0,
        SendOp::Write {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 100)],
    );
    p.run([1, 0]);
    assert!(!p.sim.step() || p.wcs(0).len() == 1);
    assert_eq!(p.wcs(0).len(), 1);
    assert_eq!(p.wcs(0)[0].1.wr_id, last);
}

fn statuses(p: &Pair, i: usize) -> Vec<(u64, WcStatus)> {
    p.wcs(i).iter().map(|c| (c.1.wr_id, c.1.status)).collect()
}

#[test]
fn receive_too_small_is_loc_len_err_and_rem_op_err() {
    let mut p = Pair::new(Setup::default());
    let r = p.recv(1, vec![Pair::sge(1, 0, 1000)]);
    let r2 = p.recv(1, vec![Pair::sge(1, 0, 1000)]);
    let s = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 3000)]);
    let s2 = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 10)]);
    p.run([2, 2]);
    assert_eq!(
        statuses(&p, 1),
        [(r, WcStatus::LocLenErr), (r2, WcStatus::WrFlushErr)]
    );
    assert_eq!(
        statuses(&p, 0),
        [(s, WcStatus::RemOpErr), (s2, WcStatus::WrFlushErr)]
    );
    assert_eq!(p.sim.ends[0].qp.state(), QpState::Err);
    assert_eq!(p.sim.ends[1].qp.state(), QpState::Err);
}

#[test]
fn bad_lkey_is_loc_prot_err_and_flushes_the_rest() {
    let mut p = Pair::new(Setup::default());
    let bad = p.send(
        0,
        SendOp::Write {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Sge {
            addr: IOVA[0],
            len: 8,
            lkey: 0x999,
        }],
    );
    let after = p.send(
        0,
        SendOp::Write {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 8)],
    );
    p.run([2, 0]);
    assert_eq!(
        statuses(&p, 0),
        [(bad, WcStatus::LocProtErr), (after, WcStatus::WrFlushErr)]
    );
    // Posts to a QP in ERR complete as flushed.
    let late = p.send(0, SendOp::Send, vec![]);
    let late_r = p.recv(0, vec![]);
    p.run([4, 0]);
    assert_eq!(
        statuses(&p, 0)[2..],
        [(late, WcStatus::WrFlushErr), (late_r, WcStatus::WrFlushErr)]
    );
    // A READ into memory without LOCAL_WRITE is a local protection error too.
    let mut p = Pair::new(Setup {
        mr_access: Access::REMOTE_READ,
        ..Setup::default()
    });
    let r = p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 8)],
    );
    p.run([1, 0]);
    assert_eq!(statuses(&p, 0), [(r, WcStatus::LocProtErr)]);
}

/// A WRITE with immediate whose receive names a bad lkey: the NAK carries
/// the WRITE's own PSN, so the requester fails that WQE (not the one after
/// it, which a NAK one PSN later would blame, or none, leaving the WRITE
/// to succeed).
#[test]
fn a_write_with_immediate_into_a_bad_receive_fails_itself() {
    let mut p = Pair::new(Setup::default());
    let r = p.recv(
        1,
        vec![Sge {
            addr: IOVA[1],
            len: 8,
            lkey: 0x999,
        }],
    );
    let w = p.send(
        0,
        SendOp::WriteWithImm {
            remote_addr: IOVA[1] + 4096,
            rkey: RKEY[1],
            imm: 7,
        },
        vec![Pair::sge(0, 0, 64)],
    );
    let after = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 8)]);
    p.run([2, 1]);
    assert_eq!(statuses(&p, 1), [(r, WcStatus::LocProtErr)]);
    assert_eq!(
        statuses(&p, 0),
        [(w, WcStatus::RemOpErr), (after, WcStatus::WrFlushErr)]
    );
}

#[test]
fn forbidden_by_the_remote_qp_is_rem_inv_req_err() {
    let mut p = Pair::new(Setup {
        qp_access: Access::REMOTE_READ,
        ..Setup::default()
    });
    let w = p.send(
        0,
        SendOp::Write {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 8)],
    );
    p.run([1, 0]);
    assert_eq!(statuses(&p, 0), [(w, WcStatus::RemInvReqErr)]);
    assert_eq!(p.sim.ends[1].qp.state(), QpState::Err);
    // An unaligned atomic, too: refused on post, and NAKed by a responder
    // that gets one anyway (from another stack), the word untouched.
    let mut p = Pair::new(Setup::default());
    let unaligned = SendOp::FetchAdd {
        remote_addr: IOVA[1] + 4,
        rkey: RKEY[1],
        add: 1,
    };
    let e = p.sim.ends[0]
        .qp
        .post_send(SendWr::new(7, unaligned, vec![Pair::sge(0, 0, 8)]))
        .unwrap_err();
    assert_eq!(e, PostError::MisalignedAtomic(IOVA[1] + 4));
    let a = p.send(
        0,
        SendOp::FetchAdd {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
            add: 1,
        },
        vec![Pair::sge(0, 0, 8)],
    );
    let mut request = take_packets(&mut p, 0, 1);
    // The AtomicETH's VA follows the 12-byte BTH.
    request[0][12..20].copy_from_slice(&(IOVA[1] + 4).to_be_bytes());
    p.deliver(1, &request);
    p.run([1, 0]);
    assert_eq!(statuses(&p, 0), [(a, WcStatus::RemInvReqErr)]);
    assert_eq!(p.read_mem(1, 0, 16), [0; 16]);
}

#[test]
fn bad_rkey_bounds_or_rights_is_rem_access_err() {
    let cases: [(Access, SendOp); 4] = [
        (
            Access::ALL,
            SendOp::Write {
                remote_addr: IOVA[1],
                rkey: 0x1234,
            },
        ),
        (
            Access::ALL,
            SendOp::Write {
                remote_addr: IOVA[1] + MEM as u64 - 4,
                rkey: RKEY[1],
            },
        ),
        (
            Access::LOCAL_WRITE | Access::REMOTE_READ,
            SendOp::Write {
                remote_addr: IOVA[1],
                rkey: RKEY[1],
            },
        ),
        (
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            SendOp::Read {
                remote_addr: IOVA[1],
                rkey: RKEY[1],
            },
        ),
    ];
    for (mr_access, op) in cases {
        let mut p = Pair::new(Setup {
            mr_access,
            ..Setup::default()
        });
        p.write_mem(1, 0, b"untouched");
        let id = p.send(0, op, vec![Pair::sge(0, 0, 8)]);
        p.run([1, 0]);
        assert_eq!(statuses(&p, 0), [(id, WcStatus::RemAccessErr)], "{op:?}");
        assert_eq!(p.read_mem(1, 0, 9), b"untouched");
    }
}

#[test]
fn no_receive_exhausts_rnr_retry() {
    let mut p = Pair::new(Setup {
        rnr_retry: 2,
        ..Setup::default()
    });
    let s = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 8)]);
    p.run([1, 0]);
    assert_eq!(statuses(&p, 0), [(s, WcStatus::RnrRetryExcErr)]);
    assert_eq!(p.sim.ends[0].qp.stats().rnr_naks_received, 3);
}

#[test]
fn rnr_recovers_when_a_receive_is_posted() {
    let mut p = Pair::new(Setup::default());
    p.write_mem(0, 0, b"late");
    let s = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 4)]);
    p.sim.run_until(Duration::from_millis(5), |_| false);
    assert!(p.sim.ends[0].qp.stats().rnr_naks_received >= 2);
    let r = p.recv(1, vec![Pair::sge(1, 0, 4)]);
    p.run([1, 1]);
    assert_eq!(statuses(&p, 0), [(s, WcStatus::Success)]);
    assert_eq!(statuses(&p, 1), [(r, WcStatus::Success)]);
    assert_eq!(p.read_mem(1, 0, 4), b"late");
}

#[test]
fn vanished_peer_exhausts_retry_cnt() {
    let mut p = Pair::new(Setup {
        retry_cnt: 3,
        ..Setup::default()
    });
    p.sim.down[1] = true;
    let s = p.send(
        0,
        SendOp::Write {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 8)],
    );
    let s2 = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 8)]);
    p.run([2, 0]);
    assert_eq!(
        statuses(&p, 0),
        [(s, WcStatus::RetryExcErr), (s2, WcStatus::WrFlushErr)]
    );
    assert_eq!(
        p.sim.ends[0].qp.stats().timeouts,
        4,
        "three retries, then the error"
    );
}

#[test]
fn retry_cnt_seven_is_seven_retries_not_forever() {
    let mut p = Pair::new(Setup {
        retry_cnt: 7,
        timeout: 1,
        ..Setup::default()
    });
    p.sim.down[1] = true;
    let s = p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 8)]);
    p.run([1, 0]);
    assert_eq!(statuses(&p, 0), [(s, WcStatus::RetryExcErr)]);
    assert_eq!(p.sim.ends[0].qp.stats().retransmitted, 7);
}

#[test]
fn duplicate_atomic_replays_the_saved_answer() {
    let mut p = Pair::new(Setup::default());
    p.write_mem(1, 0, &10u64.to_ne_bytes());
    // Every packet from B to A is lost until further notice: A times out and
    // resends its FETCH_ADD, which B must answer from its saved result.
    p.sim.down[1] = true;
    p.send(
        0,
        SendOp::FetchAdd {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
            add: 1,
        },
        vec![Pair::sge(0, 0, 8)],
    );
    p.sim.run_until(Duration::from_micros(200), |_| false);
    p.sim.down[1] = false;
    p.run([1, 0]);
    assert!(p.sim.ends[0].qp.stats().retransmitted >= 1);
    assert!(p.sim.ends[1].qp.stats().duplicates >= 1);
    assert_eq!(
        u64::from_ne_bytes(p.read_mem(1, 0, 8).try_into().unwrap()),
        11,
        "executed once"
    );
    assert_eq!(
        u64::from_ne_bytes(p.read_mem(0, 0, 8).try_into().unwrap()),
        10
    );
}

#[test]
fn post_errors_are_reported_on_the_call() {
    let mut p = Pair::new(Setup::default());
    let qp = &mut p.sim.ends[0].qp;
    let wr = |sgl: Vec<Sge>| SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sgl: sgl.into(),
        flags: SendFlags::default(),
        ud: None,
        inline_data: InlineData::new(),
    };
    assert!(matches!(
        qp.post_send(wr(vec![Pair::sge(0, 0, 1); 5])),
        Err(PostError::TooManySges { given: 5, max: 4 })
    ));
    let mut big = wr(vec![]);
    big.flags.inline = true;
    big.inline_data = InlineData::from_elem(0, 300);
    assert!(matches!(
        qp.post_send(big),
        Err(PostError::InlineTooLarge { .. })
    ));
    let atomic = SendWr {
        op: SendOp::FetchAdd {
            remote_addr: 0,
            rkey: 0,
            add: 1,
        },
        ..wr(vec![Pair::sge(0, 0, 4)])
    };
    assert_eq!(qp.post_send(atomic), Err(PostError::BadAtomicSge));
    for _ in 0..128 {
        qp.post_send(wr(vec![])).unwrap();
    }
    assert_eq!(qp.post_send(wr(vec![])), Err(PostError::QueueFull(128)));
    let mut fresh = RcQp::new(5, 1, QpCaps::default());
    assert_eq!(
        fresh.post_send(wr(vec![])),
        Err(PostError::BadState(QpState::Reset))
    );
    assert!(fresh.post_recv(RecvWr::new(1, [])).is_err());
}

#[test]
fn fence_waits_for_earlier_reads() {
    let mut p = Pair::new(Setup::default());
    p.write_mem(1, 0, &pattern(4096, 1));
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 4096)],
    );
    // The fenced WRITE sends the bytes the READ brings in.
    p.send_flags(
        0,
        SendOp::Write {
            remote_addr: IOVA[1] + 8192,
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 0, 4096)],
        SendFlags {
            signaled: true,
            fence: true,
            ..SendFlags::default()
        },
    );
    p.run([2, 0]);
    assert_eq!(p.read_mem(1, 8192, 4096), pattern(4096, 1));
}

#[test]
fn deep_queues_of_large_messages_share_ack_requests() {
    // At the default 1 KiB path MTU a 16 KiB WRITE is 16 packets.
    let all_succeed = |p: &Pair| {
        p.wcs(0)
            .iter()
            .all(|(_, wc)| wc.status == WcStatus::Success)
    };
    // Twenty posted together: a message with 64 packets queued behind it
    // asks only where the every-64-packets rule says (messages 3, 7, 11,
    // 15); the last four, with less behind them, ask each. 8, not 20.
    let mut p = Pair::new(Setup::default());
    for k in 0..20 {
        p.write((k % 4) * 16384, 16384);
    }
    p.run([20, 0]);
    assert!(all_succeed(&p));
    assert_eq!(p.sim.stats.ack_requests[0], 8);
    assert!(p.sim.stats.acks[1] <= 8);
    // Forty single-packet WRITEs: never 64 packets behind, so each asks
    // (the responder still coalesces the ACKs).
    let mut p = Pair::new(Setup::default());
    for k in 0..40 {
        p.write((k % 4) * 16384, 1024);
    }
    p.run([40, 0]);
    assert!(all_succeed(&p));
    assert_eq!(p.sim.stats.ack_requests[0], 40);
    // A fence or a READ behind stops the count, and a READ ahead that is
    // not yet answered makes every message ask: here all nine ask (the
    // WRITE after the READ has 64 packets behind it, and asks only because
    // the READ's answer has not come).
    let fenced = SendFlags {
        signaled: true,
        fence: true,
        ..SendFlags::default()
    };
    let mut p = Pair::new(Setup::default());
    p.write(0, 16384);
    let write_1 = SendOp::Write {
        remote_addr: IOVA[1] + 16384,
        rkey: RKEY[1],
    };
    p.send_flags(0, write_1, vec![Pair::sge(0, 0, 16384)], fenced);
    p.write(2 * 16384, 16384);
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 65536, 1024)],
    );
    for k in 3..8 {
        p.write((k % 4) * 16384, 16384);
    }
    p.run([9, 0]);
    assert!(all_succeed(&p));
    assert_eq!(p.sim.stats.ack_requests[0], 9);
}

/// Up to `n` packets end `i` sends now, taken by hand (not delivered).
/// Parses a packet taken by hand and emits its headers again through the
/// general path (`packet::Repr::emit_header`), which must write the same
/// bytes: no field or reserved bit differs. Returns the parse and the
/// headers' length.
fn reframed(b: &[u8], what: &str) -> (softrdma_wire::packet::Repr, usize) {
    use softrdma_wire::packet::{Packet, Repr};
    let r = Repr::parse(&Packet::new_checked(b).unwrap()).unwrap();
    let mut again = [0u8; 64];
    let h = r.emit_header(&mut again).unwrap();
    assert_eq!(&again[..h], &b[..h], "{what}");
    (r, h)
}

fn take_packets(p: &mut Pair, i: usize, n: usize) -> Vec<Vec<u8>> {
    std::iter::from_fn(|| p.sim.next_packet(i))
        .take(n)
        .collect()
}

/// Six 16-packet WRITEs posted, `sent` packets sent by hand, then the QP
/// drained (RTS -> SQD) and the packets delivered: runs until `done`
/// WRITEs complete and returns the pair, the simulated time it took and
/// how many of the packets sent by hand asked for an ACK.
fn drain_after(sent: usize, done: usize) -> (Pair, Duration, usize) {
    let mut p = Pair::new(Setup::default());
    for k in 0..6 {
        p.write(k * 16384, 16384);
    }
    let now = p.sim.now;
    let packets = take_packets(&mut p, 0, sent);
    assert_eq!(packets.len(), sent);
    let asked = packets
        .iter()
        .filter(|b| {
            softrdma_wire::bth::Header::new_checked(&b[..])
                .unwrap()
                .ack_req()
        })
        .count();
    p.drain(0);
    p.deliver(1, &packets);
    p.run([done, 0]);
    assert!(
        p.wcs(0)
            .iter()
            .all(|(_, wc)| wc.status == WcStatus::Success)
    );
    let took = Duration::from_nanos(p.sim.now.0 - now.0);
    (p, took, asked)
}

#[test]
fn draining_asks_for_the_ack_a_deep_queue_left_unasked() {
    // The first two WRITEs (64 or more packets behind each) went without
    // asking, and the drain stops the third from starting: the last packet
    // goes again, asking, and both complete with no timeout.
    let (p, took, asked) = drain_after(32, 2);
    assert_eq!(asked, 0);
    let stats = p.sim.ends[0].qp.stats();
    assert_eq!((stats.timeouts, stats.retransmitted), (0, 1));
    assert!(took < Duration::from_millis(1), "completed by a timeout");
    // Drained halfway through the third: its own last packet asks, and
    // nothing is sent again.
    let (p, took, asked) = drain_after(40, 3);
    assert_eq!(asked, 0);
    let stats = p.sim.ends[0].qp.stats();
    assert_eq!((stats.timeouts, stats.retransmitted), (0, 0));
    assert!(took < Duration::from_millis(1), "completed by a timeout");
}

#[test]
fn a_drain_during_a_go_back_lets_it_finish() {
    // A 10-packet SEND whose 6th packet is lost, and the NAK for it too.
    let mut p = Pair::new(Setup::default());
    p.recv(1, vec![Pair::sge(1, 0, 10240)]);
    p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 10240)]);
    let sent = take_packets(&mut p, 0, 10);
    p.deliver(
        1,
        sent.iter()
            .enumerate()
            .filter(|(k, _)| *k != 5)
            .map(|(_, b)| b),
    );
    let nak = take_packets(&mut p, 1, 8);
    assert_eq!(nak.len(), 1, "one NAK for the gap");
    // The timeout goes back to the first packet; two go again (duplicates),
    // then the QP is drained: the go-back still runs to its end (jumping to
    // the last packet, which the responder drops after its NAK, cost a
    // second timeout).
    let later = p.sim.ends[0].qp.poll_timeout().unwrap();
    p.sim.now = later;
    p.sim.ends[0].qp.handle_timeout(later);
    let again = take_packets(&mut p, 0, 2);
    p.deliver(1, &again);
    p.drain(0);
    p.run([1, 1]);
    assert_eq!(p.wcs(0)[0].1.status, WcStatus::Success);
    assert_eq!(p.sim.ends[0].qp.stats().timeouts, 1);
}

#[test]
fn messages_behind_an_unanswered_read_ask_for_their_acks() {
    // A 100-packet READ, then sixteen 8-packet WRITEs. Until the READ is
    // answered each WRITE asks, although 64 packets are queued behind it:
    // its ACK is what reveals a lost READ response before the timer, and
    // the READ holds most of the window.
    let mut p = Pair::new(Setup::default());
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Pair::sge(0, 1 << 19, 100 * 1024)],
    );
    for k in 0..16 {
        p.write(k * 8192, 8192);
    }
    // The window: the READ's 100 PSNs, three whole WRITEs, half a fourth.
    // Each WRITE packet is a WRITE ONLY; the last of each WRITE asks.
    let packets = take_packets(&mut p, 0, 1000);
    let asks: Vec<bool> = packets
        .iter()
        .map(|b| softrdma_wire::bth::Header::new_checked(&b[..]).unwrap())
        .filter(|h| h.opcode() == softrdma_wire::Opcode::RC_RDMA_WRITE_ONLY)
        .map(|h| h.ack_req())
        .collect();
    assert_eq!(asks.len(), 28);
    for (i, ask) in asks.iter().enumerate() {
        assert_eq!(*ask, i % 8 == 7, "packet {i} of the WRITEs");
    }
}

#[test]
fn lossy_network_still_delivers_in_order() {
    // Six 20-packet SENDs posted at once: the first three go without asking
    // for their own ACKs (64 packets or more behind), so losses there are
    // found through the later requests' ACKs and NAKs.
    for seed in 0..40 {
        let net = NetConfig {
            loss: 150,
            duplicate: 50,
            corrupt: 30,
            min_delay: Duration::from_micros(1),
            max_delay: Duration::from_micros(80),
        };
        let mut p = Pair::new(Setup {
            net,
            seed,
            ..Setup::default()
        });
        let data = pattern(20_000, seed as u8);
        p.write_mem(0, 0, &data);
        let mut ids = vec![];
        for k in 0..6u64 {
            p.recv(1, vec![Pair::sge(1, k * 20_000, 20_000)]);
            ids.push(p.send(
                0,
                SendOp::Send,
                vec![Pair::sge(0, 0, 20_000 - k as u32 * 997)],
            ));
        }
        p.run([6, 6]);
        assert_eq!(
            p.wcs(0).iter().map(|c| c.1.wr_id).collect::<Vec<_>>(),
            ids,
            "seed {seed}"
        );
        for k in 0..6u64 {
            let n = 20_000 - k as usize * 997;
            assert_eq!(p.wcs(1)[k as usize].1.byte_len as usize, n, "seed {seed}");
            assert_eq!(p.read_mem(1, k * 20_000, n), data[..n], "seed {seed}");
        }
    }
}

/// End 0's packets delivered to end 1 and end 1's answers back to end 0.
fn exchange(p: &mut Pair, packets: &[Vec<u8>]) {
    p.deliver(1, packets);
    let answers = take_packets(p, 1, 10_000);
    p.deliver(0, &answers);
}

#[test]
fn the_window_opens_as_acks_return_and_narrows_on_a_loss() {
    // Sixty-four 16-packet WRITEs: 1024 packets queued at once.
    let mut p = Pair::new(Setup::default());
    for k in 0..64u64 {
        p.write((k % 64) * 16384, 16384);
    }
    // It starts at rxe's 128, then doubles with each window acknowledged,
    // up to 512.
    let first = take_packets(&mut p, 0, 10_000);
    assert_eq!(first.len(), MIN_UNACKED_PSNS as usize);
    exchange(&mut p, &first);
    let second = take_packets(&mut p, 0, 10_000);
    assert_eq!(second.len(), 256);
    exchange(&mut p, &second);
    let third = take_packets(&mut p, 0, 10_000);
    assert_eq!(third.len(), MAX_UNACKED_PSNS as usize);
    // The 11th of those is lost: the NAK halves the window, and the go-back
    // resends that many from the lost packet on.
    let delivered: Vec<_> = third
        .iter()
        .enumerate()
        .filter(|(k, _)| *k != 10)
        .map(|(_, b)| b.clone())
        .collect();
    exchange(&mut p, &delivered);
    let stats = p.sim.ends[0].qp.stats();
    assert_eq!((stats.seq_naks_received, stats.window), (1, 256));
    let resent = take_packets(&mut p, 0, 10_000);
    assert_eq!(resent.len(), 256);
    // The rest completes; the counts stay those of one loss.
    exchange(&mut p, &resent);
    p.run([64, 0]);
    assert!(
        p.wcs(0)
            .iter()
            .all(|(_, wc)| wc.status == WcStatus::Success)
    );
    let stats = p.sim.ends[0].qp.stats();
    assert_eq!((stats.seq_naks_received, stats.timeouts), (1, 0));
}

#[test]
fn after_a_loss_the_window_grows_by_one_psn_per_window_and_never_below_128() {
    let mut w = requester::Window::default();
    assert_eq!(w.limit(), MIN_UNACKED_PSNS);
    w.acknowledged(100);
    assert_eq!(w.limit(), 228);
    w.acknowledged(10_000);
    assert_eq!(w.limit(), MAX_UNACKED_PSNS);
    w.lost();
    assert_eq!(w.limit(), 256);
    // One more PSN each time a whole window's worth is acknowledged.
    w.acknowledged(255);
    assert_eq!(w.limit(), 256);
    w.acknowledged(1);
    assert_eq!(w.limit(), 257);
    w.acknowledged(257);
    assert_eq!(w.limit(), 258);
    for _ in 0..5 {
        w.lost();
    }
    assert_eq!(w.limit(), MIN_UNACKED_PSNS);
    // Losses leave no credit behind: the next step takes a whole window.
    w.acknowledged(127);
    w.lost();
    w.acknowledged(127);
    assert_eq!(w.limit(), MIN_UNACKED_PSNS);
    w.acknowledged(1);
    assert_eq!(w.limit(), MIN_UNACKED_PSNS + 1);
}

/// A 2 GiB READ at a 256-byte MTU spans half the PSN space by itself: what
/// is posted after it waits for its answer instead of going out, where its
/// PSNs and the READ's responses could no longer be told apart.
#[test]
fn nothing_follows_a_read_that_spans_half_the_psn_space() {
    let mut p = Pair::new(Setup {
        pmtu: Mtu::Mtu256,
        ..Setup::default()
    });
    // Mapped, never touched: the READ is only posted and sent.
    let big = Arc::new(RegionMemory::zeroed(1 << 31).unwrap());
    let (lkey, iova) = (0x0c0c_0001, 0x4000_0000_0000);
    p.sim.ends[0]
        .mrs
        .insert(Region::new(1, (lkey, 0x0c0c_0002), big, 0, 1 << 31, iova, Access::ALL).unwrap());
    p.send(
        0,
        SendOp::Read {
            remote_addr: IOVA[1],
            rkey: RKEY[1],
        },
        vec![Sge {
            addr: iova,
            len: 1 << 31,
            lkey,
        }],
    );
    p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 8)]);
    let sent = take_packets(&mut p, 0, 2);
    assert_eq!(sent.len(), 1, "only the READ request goes out");
}

/// A peer that floods requests while nothing is sent back: the same RNR NAK
/// is queued once however often its SEND comes, and new READs past the cap
/// are dropped as if lost (the responder's queue stays bounded), then
/// answered once the queue drains and the requester retries.
#[test]
fn a_flood_of_requests_is_held_off_not_queued_without_bound() {
    use softrdma_wire::Opcode as O;
    use softrdma_wire::Psn;
    use softrdma_wire::packet::Repr;
    let mut p = Pair::new(Setup::default());
    let epsn = Setup::default().psn[0];
    let packet = |r: Repr, payload: &[u8]| {
        let mut b = vec![0u8; r.buffer_len().unwrap()];
        r.emit(&mut b, payload).unwrap();
        b
    };
    // SENDs with no receive posted.
    let send = packet(
        Repr::new(O::RC_SEND_ONLY, QPN[1], Psn::new(epsn), 8),
        &[1; 8],
    );
    for _ in 0..5000 {
        p.deliver(1, [&send]);
    }
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 1, "one RNR NAK");
    // READs at consecutive PSNs, none of their answers sent.
    let read = |k: u32| {
        let mut r = Repr::new(O::RC_RDMA_READ_REQUEST, QPN[1], Psn::new(epsn).add(k), 0);
        r.reth = Some(softrdma_wire::reth::Repr {
            va: IOVA[1],
            rkey: RKEY[1],
            dma_len: 8,
        });
        packet(r, &[])
    };
    for k in 0..5000 {
        p.deliver(1, [&read(k)]);
    }
    let queued = p.sim.ends[1].qp.responses_queued() as usize;
    assert_eq!(queued, responder::MAX_QUEUED_ANSWERS, "held at the cap");
    assert!(p.sim.ends[1].qp.stats().dropped >= 5000 - 1023);
    // Once the answers leave, the next READ is taken again.
    let answers = take_packets(&mut p, 1, queued);
    assert_eq!(answers.len(), queued);
    p.deliver(1, [&read(1023)]);
    assert_eq!(p.sim.ends[1].qp.responses_queued(), 1);
}

#[test]
fn a_sequence_nak_behind_an_rnr_nak_costs_no_retry() {
    // A WRITE, then a 4-packet SEND with no receive posted: the responder
    // answers the SEND's first packet with an RNR NAK and the next with a
    // sequence NAK for the same PSN. The WRITE's own ACK is lost, so the RNR
    // NAK is what acknowledges it. The RNR retry already goes back to the
    // SEND; the sequence NAK must not count a second loss.
    use softrdma_wire::aeth::Syndrome;
    use softrdma_wire::packet::Packet;
    let mut p = Pair::new(Setup::default());
    let w = p.write(0, 8);
    p.send(0, SendOp::Send, vec![Pair::sge(0, 0, 4096)]);
    let sent = take_packets(&mut p, 0, 10);
    assert_eq!(sent.len(), 5);
    p.deliver(1, &sent);
    let naks: Vec<_> = take_packets(&mut p, 1, 10)
        .into_iter()
        .filter(|b| {
            let packet = Packet::new_checked(&b[..]).unwrap();
            !matches!(packet.aeth().map(|a| a.syndrome()), Some(Syndrome::Ack(_)))
        })
        .collect();
    assert_eq!(naks.len(), 2);
    p.deliver(0, &naks);
    let stats = p.sim.ends[0].qp.stats();
    assert_eq!((stats.rnr_naks_received, stats.seq_naks_received), (1, 1));
    assert_eq!(stats.window, MIN_UNACKED_PSNS + 1, "narrowed as for a loss");
    assert_eq!(p.sim.ends[0].qp.req.retry_left, 7, "a retry was used");
    p.recv(1, vec![Pair::sge(1, 0, 4096)]);
    p.run([2, 1]);
    assert_eq!(statuses(&p, 0)[0], (w, WcStatus::Success));
    assert_eq!(statuses(&p, 0)[1].1, WcStatus::Success);
}

#[test]
fn sqd_raises_sq_drained_once_everything_sent_is_acknowledged() {
    let mut p = Pair::new(Setup::default());
    // Idle: drained at once.
    p.drain(1);
    assert_eq!(p.sim.ends[1].qp.poll_event(), Some(QpEvent::SqDrained));
    assert_eq!(p.sim.ends[1].qp.poll_event(), None);
    // A WRITE out and unanswered: not yet; its ACK drains the queue. A WQE
    // posted in SQD waits and does not hold the event back.
    p.write(0, 3000);
    let sent = take_packets(&mut p, 0, 10);
    p.drain(0);
    p.write(0, 8);
    assert_eq!(p.sim.ends[0].qp.poll_event(), None);
    exchange(&mut p, &sent);
    assert_eq!(p.sim.ends[0].qp.poll_event(), Some(QpEvent::SqDrained));
    assert_eq!(p.sim.ends[0].qp.poll_event(), None);
    assert_eq!(take_packets(&mut p, 0, 10).len(), 0, "SQD starts nothing");
    // Back to RTS: the waiting WRITE goes; to SQD again: one more event
    // once it is acknowledged.
    p.sim.ends[0]
        .qp
        .modify(&QpAttr {
            state: Some(QpState::Rts),
            ..QpAttr::default()
        })
        .unwrap();
    let sent = take_packets(&mut p, 0, 10);
    assert_eq!(sent.len(), 1);
    p.drain(0);
    assert_eq!(p.sim.ends[0].qp.poll_event(), None);
    exchange(&mut p, &sent);
    assert_eq!(p.sim.ends[0].qp.poll_event(), Some(QpEvent::SqDrained));
}

#[test]
fn the_first_packet_in_rtr_raises_comm_established_once() {
    let mut p = Pair::new(Setup {
        end1_in_rtr: true,
        ..Setup::default()
    });
    p.write(0, 8);
    p.write(8, 8);
    let w = take_packets(&mut p, 0, 10);
    assert_eq!(w.len(), 2);
    p.deliver(1, &w[..1]);
    assert_eq!(
        p.sim.ends[1].qp.poll_event(),
        Some(QpEvent::CommEstablished)
    );
    p.deliver(1, &w[1..]);
    assert_eq!(p.sim.ends[1].qp.poll_event(), None);
    // Never for a QP that is in RTS when its first packet comes.
    assert_eq!(p.sim.ends[0].qp.poll_event(), None);
    p.run([2, 0]);
    assert_eq!(p.sim.ends[0].qp.poll_event(), None);
}

#[test]
fn a_write_with_immediate_refused_for_want_of_a_receive_lands_once_one_is_posted() {
    // One packet (an ONLY): RNR-NAKed, nothing written; then it comes again.
    let mut p = Pair::new(Setup::default());
    p.write_mem(0, 0, b"late");
    let op = SendOp::WriteWithImm {
        remote_addr: IOVA[1] + 64,
        rkey: RKEY[1],
        imm: 9,
    };
    let s = p.send(0, op, vec![Pair::sge(0, 0, 4)]);
    let sent = take_packets(&mut p, 0, 10);
    exchange(&mut p, &sent);
    assert_eq!(p.sim.ends[1].qp.stats().rnr_naks_sent, 1);
    assert_eq!(p.read_mem(1, 64, 4), [0; 4]);
    let r = p.recv(1, vec![]);
    p.run([1, 1]);
    assert_eq!(statuses(&p, 0), [(s, WcStatus::Success)]);
    assert_eq!(statuses(&p, 1), [(r, WcStatus::Success)]);
    assert_eq!(p.read_mem(1, 64, 4), b"late");
}

#[test]
fn a_write_with_immediate_finds_no_receive_before_its_rkey_is_checked() {
    // As rxe: no receive is an RNR NAK, even with a bad rkey; with one
    // posted, the retry fails on the rkey.
    let mut p = Pair::new(Setup::default());
    let op = SendOp::WriteWithImm {
        remote_addr: IOVA[1],
        rkey: RKEY[1] ^ 1,
        imm: 9,
    };
    let s = p.send(0, op, vec![Pair::sge(0, 0, 4)]);
    let sent = take_packets(&mut p, 0, 10);
    exchange(&mut p, &sent);
    let stats = p.sim.ends[1].qp.stats();
    assert_eq!(stats.rnr_naks_sent, 1);
    assert_eq!(p.sim.ends[1].qp.state(), QpState::Rts);
    let r = p.recv(1, vec![]);
    p.run([1, 1]);
    assert_eq!(statuses(&p, 0), [(s, WcStatus::RemAccessErr)]);
    assert_eq!(statuses(&p, 1)[0].0, r);
}

/// An inline post of up to 16 bytes keeps them in the work request (no
/// allocation), which is no larger for it.
#[test]
fn sixteen_inline_bytes_take_no_allocation() {
    assert_eq!(
        std::mem::size_of::<InlineData>(),
        std::mem::size_of::<Vec<u8>>()
    );
    let wr = SendWr::new(1, SendOp::Send, []).inline(&[7; 16]);
    assert!(!wr.inline_data.spilled());
    assert_eq!(&wr.inline_data[..], &[7; 16]);
    let wr = SendWr::new(1, SendOp::Send, []).inline(&[7; 17]);
    assert!(wr.inline_data.spilled());
}
