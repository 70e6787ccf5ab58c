//! A deterministic network between two RC queue pairs, for tests and fuzzing.
//!
//! The simulator drives [`RcQp`]s through the same doors a provider uses, over
//! a fake network that loses, duplicates, reorders (by random delay) and
//! corrupts packets as a seeded generator decides. Packets carry a real ICRC
//! over a synthesized IPv4/UDP header, so a corrupted packet is dropped by the
//! same check a provider makes. Time is simulated: a run is as fast as the CPU.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use softrdma_wire::Opcode;
use softrdma_wire::icrc::{self, Ipv4Pseudo};
use softrdma_wire::packet::Packet;

use super::rc::{MAX_HEADER_LEN, RcQp};
use super::{CqKind, Time, WorkCompletion};
use crate::memory::{MrTable, Segment};

/// A small, fast, seedable generator (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u32) -> bool {
        self.below(1000) < u64::from(per_mille)
    }
}

/// How badly the network behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// Packets lost, per mille.
    pub loss: u32,
    /// Packets delivered twice, per mille.
    pub duplicate: u32,
    /// Packets with a flipped bit (dropped by the ICRC check), per mille.
    pub corrupt: u32,
    /// Shortest one-way delay.
    pub min_delay: Duration,
    /// Longest one-way delay; a spread between the two reorders packets.
    pub max_delay: Duration,
}

impl NetConfig {
    /// A perfect network with a fixed 10 us delay.
    pub const PERFECT: NetConfig = NetConfig {
        loss: 0,
        duplicate: 0,
        corrupt: 0,
        min_delay: Duration::from_micros(10),
        max_delay: Duration::from_micros(10),
    };
}

/// What the network did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Packets the QPs sent.
    pub sent: u64,
    /// Lost on the way.
    pub lost: u64,
    /// Delivered twice.
    pub duplicated: u64,
    /// Corrupted.
    pub corrupted: u64,
    /// Dropped by the receiver's ICRC check.
    pub bad_icrc: u64,
    /// Handed to a QP.
    pub delivered: u64,
    /// Packets each end sent asking for an acknowledgement (AckReq).
    pub ack_requests: [u64; 2],
    /// ACK packets (positive or not) each end sent.
    pub acks: [u64; 2],
}

/// One end: a QP, the memory it reaches, and an address.
#[derive(Debug)]
pub struct Endpoint {
    /// The queue pair.
    pub qp: RcQp,
    /// Its device's registered memory.
    pub mrs: MrTable,
    /// Its IPv4 address.
    pub addr: [u8; 4],
    /// Completions taken from the QP so far.
    pub completions: Vec<(CqKind, WorkCompletion)>,
}

impl Endpoint {
    /// An end around a QP.
    pub fn new(qp: RcQp, mrs: MrTable, addr: [u8; 4]) -> Endpoint {
        Endpoint {
            qp,
            mrs,
            addr,
            completions: Vec::new(),
        }
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Flight {
    at: Time,
    seq: u64,
    to: usize,
    packet: Vec<u8>,
}

/// Two endpoints and the network between them.
#[derive(Debug)]
pub struct Sim {
    /// Simulated time.
    pub now: Time,
    /// The two ends.
    pub ends: [Endpoint; 2],
    /// The network's behaviour; may change between steps.
    pub net: NetConfig,
    /// What the network did.
    pub stats: NetStats,
    /// The generator (tests may draw workload from it too).
    pub rng: Rng,
    flights: BinaryHeap<Reverse<Flight>>,
    seq: u64,
    buf: Vec<u8>,
    pieces: Vec<Segment>,
    /// Ends whose outgoing packets are all lost (a vanished peer, or a cut
    /// return path).
    pub down: [bool; 2],
}

const UDP_SPORT: u16 = 0xc000;

fn headers(src: [u8; 4], dst: [u8; 4], ib_len: usize) -> ([u8; 20], [u8; 8]) {
    let udp_len = (8 + ib_len) as u16;
    let ip = Ipv4Pseudo::df(src.into(), dst.into()).header(udp_len);
    (
        ip,
        icrc::udp_header(UDP_SPORT, softrdma_wire::ROCEV2_UDP_PORT, udp_len),
    )
}

impl Sim {
    /// A simulator of two ends over `net`, seeded with `seed`.
    pub fn new(seed: u64, net: NetConfig, a: Endpoint, b: Endpoint) -> Sim {
        Sim {
            now: Time(1_000_000),
            ends: [a, b],
            net,
            stats: NetStats::default(),
            rng: Rng::new(seed),
            flights: BinaryHeap::new(),
            seq: 0,
            buf: vec![0u8; MAX_HEADER_LEN + 4096],
            pieces: Vec::new(),
            down: [false; 2],
        }
    }

    /// The next packet end `from` sends now, framed with its ICRC, or
    /// `None`: what the network would carry (tests may take it by hand).
    pub fn next_packet(&mut self, from: usize) -> Option<Vec<u8>> {
        let end = &mut self.ends[from];
        let t = end
            .qp
            .poll_transmit(self.now, &end.mrs, &mut self.buf, &mut self.pieces)?;
        assert_eq!(
            self.pieces.iter().map(Segment::len).sum::<usize>(),
            t.payload_len,
            "a Transmit's payload_len counts the bytes in its pieces"
        );
        let mut packet = Vec::with_capacity(t.len + t.payload_len + 8);
        packet.extend_from_slice(&self.buf[..t.len]);
        for s in &self.pieces {
            let at = packet.len();
            packet.resize(at + s.len(), 0);
            s.read(0, &mut packet[at..]);
        }
        packet.resize(packet.len() + usize::from(t.pad) + icrc::LEN, 0);
        let (ip, udp) = headers(self.ends[from].addr, self.ends[1 - from].addr, packet.len());
        icrc::fill(&ip, &udp, &mut packet).expect("a well-formed packet");
        Some(packet)
    }

    /// Sends everything both QPs want to send.
    fn transmit_all(&mut self) {
        for from in 0..2 {
            while let Some(packet) = self.next_packet(from) {
                if let Ok(p) = Packet::new_checked(&packet[..]) {
                    self.stats.ack_requests[from] += u64::from(p.bth().ack_req());
                    self.stats.acks[from] += u64::from(p.opcode() == Opcode::RC_ACKNOWLEDGE);
                }
                let to = 1 - from;
                self.send(to, packet, from);
            }
        }
    }

    fn send(&mut self, to: usize, mut packet: Vec<u8>, from: usize) {
        self.stats.sent += 1;
        if self.down[from] || self.rng.chance(self.net.loss) {
            self.stats.lost += 1;
            return;
        }
        let copies = if self.rng.chance(self.net.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        if self.rng.chance(self.net.corrupt) {
            self.stats.corrupted += 1;
            let i = self.rng.below(packet.len() as u64) as usize;
            packet[i] ^= 1 << self.rng.below(8);
        }
        for _ in 0..copies {
            let spread = self
                .net
                .max_delay
                .saturating_sub(self.net.min_delay)
                .as_nanos() as u64;
            let delay = self.net.min_delay + Duration::from_nanos(self.rng.below(spread + 1));
            self.seq += 1;
            self.flights.push(Reverse(Flight {
                at: self.now.after(delay),
                seq: self.seq,
                to,
                packet: packet.clone(),
            }));
        }
    }

    fn deliver(&mut self, f: Flight) {
        let from = 1 - f.to;
        let (ip, udp) = headers(self.ends[from].addr, self.ends[f.to].addr, f.packet.len());
        if icrc::verify(&ip, &udp, &f.packet).is_err() {
            self.stats.bad_icrc += 1;
            return;
        }
        self.stats.delivered += 1;
        let end = &mut self.ends[f.to];
        end.qp.handle_packet(self.now, &f.packet, &end.mrs);
    }

    fn collect(&mut self) {
        for end in &mut self.ends {
            while let Some(c) = end.qp.poll_completion() {
                end.completions.push(c);
            }
        }
    }

    /// One event: sends what is ready, then delivers the next packet or runs
    /// the next timer. `false` when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        self.transmit_all();
        self.collect();
        let next_flight = self.flights.peek().map(|f| f.0.at);
        let next_timer = self.ends.iter().filter_map(|e| e.qp.poll_timeout()).min();
        let at = match (next_flight, next_timer) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(t) => t,
                None => return false,
            },
        };
        self.now = self.now.max(at);
        if next_flight == Some(at) {
            let f = self.flights.pop().expect("peeked").0;
            self.deliver(f);
        } else {
            for end in &mut self.ends {
                if end.qp.poll_timeout().is_some_and(|t| t <= self.now) {
                    end.qp.handle_timeout(self.now);
                }
            }
        }
        self.transmit_all();
        self.collect();
        true
    }

    /// Steps until `done` says so, nothing is left to happen, or `limit` of
    /// simulated time passes. Returns whether `done` was reached.
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Sim) -> bool) -> bool {
        let end = self.now.after(limit);
        while self.now <= end {
            if done(self) {
                return true;
            }
            if !self.step() {
                return done(self);
            }
        }
        done(self)
    }
}
