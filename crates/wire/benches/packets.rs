//! The wire's per-packet work, without sockets: emitting an RC WRITE packet
//! with its ICRC, parsing and checking one, an ICRC check with the flow's
//! prefix computed once (as the UDP provider does), and CRC32c over an FPDU.
//! `cargo bench -p softrdma-wire --bench packets`

use divan::{Bencher, black_box};
use softrdma_wire::icrc::{self, IdentificationMap, Ipv4Flow, Ipv4Pseudo};
use softrdma_wire::packet::{Packet, Repr};
use softrdma_wire::{Opcode, Psn, reth};

fn main() {
    divan::main();
}

const UDP: [u8; 8] = [0xc0, 0x00, 0x12, 0xb7, 0, 0, 0, 0];

/// The benches' IPv4 addresses.
const PSEUDO: Ipv4Pseudo = Ipv4Pseudo::df(
    std::net::Ipv4Addr::new(10, 0, 0, 1),
    std::net::Ipv4Addr::new(10, 0, 0, 2),
);

fn ip(len: usize) -> [u8; 20] {
    PSEUDO.header((8 + len) as u16)
}

/// An RC WRITE ONLY of `payload_len` bytes.
fn write_repr(payload_len: usize) -> Repr {
    let mut r = Repr::new(Opcode::RC_RDMA_WRITE_ONLY, 0x11, Psn::new(7), payload_len);
    r.reth = Some(reth::Repr {
        va: 0x7f00_0000_1000,
        rkey: 0x1234,
        dma_len: payload_len as u32,
    });
    r
}

fn write_packet(payload_len: usize) -> Vec<u8> {
    let r = write_repr(payload_len);
    let mut buf = vec![0u8; r.buffer_len().unwrap()];
    r.emit(&mut buf, &vec![0x5a; payload_len]).unwrap();
    let n = buf.len();
    icrc::fill(&ip(n), &UDP, &mut buf).unwrap();
    buf
}

#[divan::bench(args = [8, 1024, 4096])]
fn emit_rc_write_with_icrc(b: Bencher, len: usize) {
    let payload = vec![0x5au8; len];
    let r = write_repr(len);
    let mut buf = vec![0u8; r.buffer_len().unwrap()];
    let ip = ip(buf.len());
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            r.emit(&mut buf, black_box(&payload)).unwrap();
            icrc::fill(&ip, &UDP, &mut buf).unwrap()
        });
}

#[divan::bench(args = [8, 1024, 4096])]
fn parse_and_verify_rc_write(b: Bencher, len: usize) {
    let pkt = write_packet(len);
    let ip = ip(pkt.len());
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            let p = Packet::new_checked(black_box(&pkt[..])).unwrap();
            icrc::verify(&ip, &UDP, &pkt).unwrap();
            Repr::parse(&p).unwrap()
        });
}

/// A WRITE of `payload_len` bytes sent with IP ID `id` on a flow between
/// two ports, and that flow.
fn flow_packet(payload_len: usize, id: u16) -> (Ipv4Flow, Vec<u8>) {
    let mut pkt = write_packet(payload_len);
    let (sport, dport) = (0xc000, 4791);
    let n = pkt.len();
    let udp = icrc::udp_header(sport, dport, (8 + n) as u16);
    let ip = Ipv4Pseudo {
        identification: id,
        ..PSEUDO
    };
    icrc::fill(&ip.header((8 + n) as u16), &udp, &mut pkt).unwrap();
    (Ipv4Flow::new(PSEUDO, sport, dport), pkt)
}

#[divan::bench(args = [8, 1024, 4096])]
fn verify_icrc_of_a_known_flow(b: Bencher, len: usize) {
    let (flow, pkt) = flow_packet(len, 0);
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| flow.verify(0, black_box(&pkt)).unwrap());
}

/// What a RoCEv2 sender does per packet: the ICRC of a WRITE ONLY from its
/// headers (BTH, RETH) and its payload, which sit apart (the payload is
/// sent from the region, zero copy).
#[divan::bench(args = [8, 1024, 4096])]
fn icrc_of_headers_then_payload(b: Bencher, len: usize) {
    let (flow, pkt) = flow_packet(len, 0);
    let head = &pkt[..28];
    let payload = pkt[28..28 + len].to_vec();
    let udp_len = (8 + pkt.len()) as u16;
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            let mut crc = flow.icrc(0, udp_len, black_box(head)).unwrap();
            crc.update(black_box(&payload));
            crc.finish()
        });
}

/// What a receiver does with a packet from a connected socket (a counting
/// IP ID): one ICRC pass under ID 0, the ID solved from the difference.
/// Two packets in turn, so that the ID is never the one guessed next.
#[divan::bench(args = [8, 1024, 4096])]
fn solve_the_ip_id_of_a_known_flow(b: Bencher, len: usize) {
    let ids = [0xb3a7, 0x1234];
    let packets = ids.map(|id| flow_packet(len, id).1);
    let flow = flow_packet(len, 0).0;
    // As the provider keeps them: the length's map made at the first.
    let mut maps = icrc::IdentificationMaps::new();
    let mut next = 0;
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            let k = next % 2;
            next += 1;
            assert_eq!(maps.identify(&flow, black_box(&packets[k])), Some(ids[k]));
        });
}

/// The same for IDs that count up (a ping-pong's WRITEs, a stream's
/// packets): the next ID is guessed and checked, not solved (but for two
/// in sixteen, where the count starts again).
#[divan::bench(args = [8, 1024, 4096])]
fn identify_ids_counting_up(b: Bencher, len: usize) {
    let packets: Vec<Vec<u8>> = (0..16).map(|k| flow_packet(len, 0xb3a7 + k).1).collect();
    let flow = flow_packet(len, 0).0;
    let mut maps = icrc::IdentificationMaps::new();
    let mut next = 0;
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| {
            let k = next % packets.len();
            next += 1;
            assert_eq!(
                maps.identify(&flow, black_box(&packets[k])),
                Some(0xb3a7 + k as u16)
            );
        });
}

/// A map for a packet length not seen before (a receiver keeps a few).
#[divan::bench(args = [40, 4128])]
fn map_an_ip_id_for_a_length(b: Bencher, len: usize) {
    b.bench_local(|| IdentificationMap::new(black_box(len)));
}

/// The solving alone.
#[divan::bench]
fn solve_an_ip_id(b: Bencher) {
    let map = IdentificationMap::new(40);
    let syndrome = map.delta(0xb3a7);
    b.bench_local(|| map.solve(black_box(syndrome)));
}

/// A receiver's ID solving for packets of many lengths (messages of many
/// sizes), sixteen in turn, more than it keeps maps for: per packet, one
/// ICRC pass and the solve. Two IDs in turn per length, never guessed.
#[divan::bench]
fn identify_packets_of_sixteen_lengths_in_turn(b: Bencher) {
    let ids = [0xb3a7, 0x1234];
    let packets: Vec<(Ipv4Flow, Vec<u8>, u16)> = ids
        .iter()
        .flat_map(|&id| (0..16).map(move |k| (k, id)))
        .map(|(k, id)| {
            let (flow, pkt) = flow_packet(100 + 8 * k, id);
            (flow, pkt, id)
        })
        .collect();
    let mut maps = icrc::IdentificationMaps::new();
    let mut next = 0;
    b.bench_local(|| {
        let (flow, pkt, id) = &packets[next % packets.len()];
        next += 1;
        assert_eq!(maps.identify(flow, black_box(pkt)), Some(*id));
    });
}

/// The solving for a length without a map: one multiplication mod P, the
/// same for every length up to 4352 bytes; past them (9000) a map is made.
#[divan::bench(args = [40, 9000])]
fn solve_an_ip_id_without_a_map(b: Bencher, len: usize) {
    let syndrome = IdentificationMap::new(len).delta(0xb3a7);
    b.bench_local(|| icrc::solve_identification(black_box(len), black_box(syndrome)));
}

#[divan::bench(args = [8, 1024, 4096])]
fn verify_icrc_from_the_headers(b: Bencher, len: usize) {
    let pkt = write_packet(len);
    let ip = ip(pkt.len());
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| icrc::verify(&ip, &UDP, black_box(&pkt)).unwrap());
}

#[divan::bench(args = [1442, 32732])]
fn crc32c_over_an_fpdu(b: Bencher, len: usize) {
    let fpdu = vec![0xa5u8; len];
    b.counter(divan::counter::BytesCount::new(len))
        .bench_local(|| crc32c::crc32c(black_box(&fpdu)));
}
