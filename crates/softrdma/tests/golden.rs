//! Golden tests against real Linux rxe and siw traffic.
//!
//! Every RoCEv2 packet and every iWARP FPDU in the captures under `tests/data/`
//! must decode, match tshark's dissection of the same packet (the committed
//! `NAME.fields.tsv`, read here at test time), pass its ICRC or CRC32c check,
//! and re-emit byte for byte from its parsed form.

use std::collections::BTreeMap;
use std::path::PathBuf;

use softrdma::capture::{self, CrcCheck, IwarpPdu, Record};
use softrdma::wire::{self, icrc, mad, mpa, packet, rdmap};

const ROCE_CAPTURES: &[&str] = &[
    "rxe_atomic_bw",
    "rxe_atomic_cas",
    "rxe_ipv6",
    "rxe_mtu4096_write_bw",
    "rxe_rc_pingpong",
    "rxe_read_bw",
    "rxe_rping",
    "rxe_send_lat",
    "rxe_send_lat_ud_cm",
    "rxe_ud_pingpong",
    "rxe_udaddy_sidr",
    "rxe_write_bw",
    "rxe_write_bw_cm",
    "server_mode_host_client",
];

const IWARP_CAPTURES: &[&str] = &[
    "siw_read_bw",
    "siw_rping",
    "siw_send_bw",
    "siw_write_bw",
    "siwcrc_rping",
    "siwcrc_write_bw",
];

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data")
}

fn read(name: &str) -> Vec<u8> {
    let p = data_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// tshark's fields for one capture: column name -> frame -> value.
struct Tsv {
    columns: Vec<String>,
    rows: BTreeMap<u64, Vec<String>>,
}

impl Tsv {
    fn load(name: &str) -> Tsv {
        let text = String::from_utf8(read(&format!("{name}.fields.tsv"))).unwrap();
        let mut lines = text.lines();
        let columns: Vec<String> = lines
            .next()
            .unwrap()
            .split('\t')
            .map(String::from)
            .collect();
        let rows = lines
            .filter(|l| !l.is_empty())
            .map(|l| {
                let cells: Vec<String> = l.split('\t').map(String::from).collect();
                (cells[0].parse().unwrap(), cells)
            })
            .collect();
        Tsv { columns, rows }
    }

    /// The values of `column` in `frame` (several when a frame holds several units).
    fn values(&self, frame: u64, column: &str) -> Vec<String> {
        let Some(i) = self.columns.iter().position(|c| c == column) else {
            return Vec::new();
        };
        let cell = self.rows[&frame].get(i).map_or("", String::as_str);
        if cell.is_empty() {
            Vec::new()
        } else {
            cell.split(',').map(String::from).collect()
        }
    }
}

/// A tshark number: hex with 0x, else decimal.
fn num(s: &str) -> u64 {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap(),
    }
}

/// Compares our values of a field with tshark's for one frame.
fn check_field(errs: &mut Vec<String>, tsv: &Tsv, frame: u64, column: &str, ours: &[u64]) {
    let theirs: Vec<u64> = tsv.values(frame, column).iter().map(|s| num(s)).collect();
    if theirs != ours {
        errs.push(format!(
            "frame {frame}: {column}: tshark {theirs:x?}, softrdma {ours:x?}"
        ));
    }
}

/// Everything checked about one RoCEv2 capture; returns the mismatches found.
fn check_roce(name: &str, file: &[u8]) -> (Vec<String>, usize, usize) {
    let tsv = Tsv::load(name);
    let mut errs = Vec::new();
    let mut seen = Vec::new();
    let mut good_icrc = 0;
    let mut inverted_icrc = 0;
    let mut decoder = capture::Decoder::new();
    for frame in capture::frames(file).unwrap() {
        let frame = frame.unwrap();
        decoder.push(&frame, &mut |rec| {
            let Record::Roce(r) = rec else {
                errs.push(format!("frame {}: unexpected {rec:?}", rec.frame()));
                return;
            };
            let n = r.frame;
            seen.push(n);
            if !tsv.rows.contains_key(&n) {
                errs.push(format!(
                    "frame {n}: decoded, but tshark saw no InfiniBand there"
                ));
                return;
            }
            let p = match &r.repr {
                Ok(p) => *p,
                Err(e) => {
                    errs.push(format!("frame {n}: does not parse: {e}"));
                    return;
                }
            };
            let ip = if r.ip_header[0] >> 4 == 6 {
                "ipv6"
            } else {
                "ip"
            };
            let addr = |c: &str| tsv.values(n, c).first().cloned().unwrap_or_default();
            if addr(&format!("{ip}.src")) != r.endpoints.src.ip().to_string()
                || addr(&format!("{ip}.dst")) != r.endpoints.dst.ip().to_string()
            {
                errs.push(format!("frame {n}: addresses differ: {}", r.endpoints));
            }
            let b = &p.bth;
            let f = |errs: &mut Vec<String>, c: &str, v: Option<u64>| {
                check_field(errs, &tsv, n, c, &v.into_iter().collect::<Vec<_>>())
            };
            f(
                &mut errs,
                "udp.srcport",
                Some(r.endpoints.src.port().into()),
            );
            f(
                &mut errs,
                "udp.dstport",
                Some(r.endpoints.dst.port().into()),
            );
            f(&mut errs, "infiniband.bth.opcode", Some(b.opcode.0.into()));
            f(&mut errs, "infiniband.bth.se", Some(b.solicited.into()));
            f(&mut errs, "infiniband.bth.m", Some(b.mig_req.into()));
            f(&mut errs, "infiniband.bth.padcnt", Some(b.pad_count.into()));
            f(&mut errs, "infiniband.bth.p_key", Some(b.pkey.into()));
            f(&mut errs, "infiniband.bth.destqp", Some(b.dest_qp.into()));
            f(&mut errs, "infiniband.bth.a", Some(b.ack_req.into()));
            f(&mut errs, "infiniband.bth.psn", Some(b.psn.value().into()));
            f(
                &mut errs,
                "infiniband.deth.q_key",
                p.deth.map(|d| d.qkey.into()),
            );
            f(
                &mut errs,
                "infiniband.deth.srcqp",
                p.deth.map(|d| d.src_qp.into()),
            );
            // tshark files the AtomicETH's address and key under the RETH's names.
            let va = p.reth.map(|h| h.va).or(p.atomic.map(|h| h.va));
            let rkey = p.reth.map(|h| h.rkey).or(p.atomic.map(|h| h.rkey));
            f(&mut errs, "infiniband.reth.va", va);
            f(&mut errs, "infiniband.reth.r_key", rkey.map(u64::from));
            f(
                &mut errs,
                "infiniband.reth.dmalen",
                p.reth.map(|h| h.dma_len.into()),
            );
            f(
                &mut errs,
                "infiniband.aeth.syndrome",
                p.aeth.map(|h| h.syndrome.to_byte().into()),
            );
            f(
                &mut errs,
                "infiniband.aeth.msn",
                p.aeth.map(|h| h.msn.into()),
            );
            f(
                &mut errs,
                "infiniband.atomiceth.swapdt",
                p.atomic.map(|h| h.swap_add),
            );
            f(
                &mut errs,
                "infiniband.atomiceth.cmpdt",
                p.atomic.map(|h| h.compare),
            );
            f(&mut errs, "infiniband.atomicacketh.origremdt", p.atomic_ack);
            let m = r.mad.as_ref().map(|m| *m.as_ref().unwrap());
            f(
                &mut errs,
                "infiniband.mad.mgmtclass",
                m.map(|m| m.mgmt_class.into()),
            );
            f(
                &mut errs,
                "infiniband.mad.method",
                m.map(|m| m.method.into()),
            );
            f(
                &mut errs,
                "infiniband.mad.attributeid",
                m.map(|m| m.attribute_id.into()),
            );
            // tshark prints the ICRC bytes as a big-endian number.
            let carried = icrc::carried(r.ib).unwrap();
            f(
                &mut errs,
                "infiniband.invariant.crc",
                Some(u32::from_be_bytes(carried.to_le_bytes()).into()),
            );

            // Re-emit from the parsed form with a recomputed ICRC.
            let view = packet::Packet::new_checked(r.ib).unwrap();
            let mut out = vec![0u8; p.buffer_len().unwrap()];
            p.emit(&mut out, view.payload()).unwrap();
            let computed = icrc::fill(r.ip_header, r.udp_header, &mut out).unwrap();
            // A UDP socket does not see the IP Identification: it must follow
            // from the ICRC (rxe sends a counting one).
            if r.icrc.is_ok() && r.ip_header[0] >> 4 == 4 {
                let real = u16::from_be_bytes([r.ip_header[4], r.ip_header[5]]);
                let solved = icrc::solve_ipv4_identification(r.ip_header, r.udp_header, r.ib);
                if solved != Ok(Some(real)) {
                    errs.push(format!("frame {n}: IP ID {real:#06x}, solved {solved:?}"));
                }
            }
            match r.icrc {
                Ok(()) => {
                    good_icrc += 1;
                    if out != r.ib {
                        errs.push(format!("frame {n}: re-emitted packet differs"));
                    }
                }
                Err(wire::Error::BadIcrc { .. }) if carried == !computed => {
                    inverted_icrc += 1;
                    let n_ = out.len() - 4;
                    if out[..n_] != r.ib[..n_] {
                        errs.push(format!("frame {n}: re-emitted headers differ"));
                    }
                }
                Err(e) => errs.push(format!("frame {n}: {e}")),
            }
        });
    }
    let want: Vec<u64> = tsv.rows.keys().copied().collect();
    if seen != want {
        errs.push(format!(
            "{name}: decoded frames {seen:?} differ from tshark's {want:?}"
        ));
    }
    (errs, good_icrc, inverted_icrc)
}

/// One value per iWARP field of a unit, in tshark's field names.
fn iwarp_fields(pdu: &IwarpPdu<'_>) -> Vec<(&'static str, u64)> {
    let mut v = Vec::new();
    match pdu {
        IwarpPdu::Start { repr, .. } => {
            let r = repr.as_ref().unwrap();
            v.push(("iwarp_mpa.crc_flag", r.crc.into()));
            v.push(("iwarp_mpa.marker_flag", r.markers.into()));
            v.push(("iwarp_mpa.rej_flag", r.reject.into()));
            v.push(("iwarp_mpa.rev", r.revision.into()));
            let pd = r.buffer_len() - mpa::START_FRAME_HEADER_LEN;
            v.push(("iwarp_mpa.pdlength", pd as u64));
        }
        IwarpPdu::Fpdu {
            bytes,
            message,
            crc,
            ..
        } => {
            let f = mpa::Fpdu::new_checked(*bytes).unwrap();
            v.push(("iwarp_mpa.ulpdulength", f.ulpdu_len().into()));
            if let CrcCheck::Off { field } = crc {
                v.push((
                    "iwarp_mpa.crc",
                    u32::from_be_bytes(field.to_le_bytes()).into(),
                ));
            }
            let m = message.as_ref().unwrap();
            v.push(("iwarp_ddp.tagged_flag", m.ddp.tagged().into()));
            v.push(("iwarp_ddp.last_flag", m.ddp.last.into()));
            match m.ddp.placement {
                wire::ddp::Placement::Tagged { stag, offset } => {
                    v.push(("iwarp_ddp.stag", stag.into()));
                    v.push(("iwarp_ddp.tagged_offset", offset));
                }
                wire::ddp::Placement::Untagged {
                    queue, msn, offset, ..
                } => {
                    v.push(("iwarp_ddp.qn", queue.into()));
                    v.push(("iwarp_ddp.msn", msn.into()));
                    v.push(("iwarp_ddp.mo", offset.into()));
                }
            }
            v.push(("iwarp_rdma.opcode", m.opcode as u64));
            if let Some(rr) = m.read_request {
                v.push(("iwarp_rdma.sinkstag", rr.sink_stag.into()));
                v.push(("iwarp_rdma.sinkto", rr.sink_offset));
                v.push(("iwarp_rdma.rdmardsz", rr.size.into()));
                v.push(("iwarp_rdma.srcstag", rr.source_stag.into()));
                v.push(("iwarp_rdma.srcto", rr.source_offset));
            }
        }
    }
    v
}

const IWARP_COLUMNS: &[&str] = &[
    "iwarp_mpa.crc_flag",
    "iwarp_mpa.marker_flag",
    "iwarp_mpa.rej_flag",
    "iwarp_mpa.rev",
    "iwarp_mpa.pdlength",
    "iwarp_mpa.ulpdulength",
    "iwarp_ddp.tagged_flag",
    "iwarp_ddp.last_flag",
    "iwarp_ddp.stag",
    "iwarp_ddp.tagged_offset",
    "iwarp_ddp.qn",
    "iwarp_ddp.msn",
    "iwarp_ddp.mo",
    "iwarp_rdma.opcode",
    "iwarp_rdma.sinkstag",
    "iwarp_rdma.sinkto",
    "iwarp_rdma.rdmardsz",
    "iwarp_rdma.srcstag",
    "iwarp_rdma.srcto",
];

/// Everything checked about one iWARP capture: mismatches, FPDUs, FPDUs with a good CRC32c.
fn check_iwarp(name: &str, file: &[u8]) -> (Vec<String>, usize, usize) {
    let tsv = Tsv::load(name);
    let mut errs = Vec::new();
    let mut per_frame: BTreeMap<u64, Vec<(&'static str, u64)>> = BTreeMap::new();
    let mut fpdus = 0;
    let mut good_crc = 0;
    let mut decoder = capture::Decoder::new();
    let mut last = 0;
    for frame in capture::frames(file).unwrap() {
        let frame = frame.unwrap();
        last = frame.number;
        decoder.push(&frame, &mut |rec| {
            let n = rec.frame();
            if !rec.errors().is_empty() {
                errs.push(format!("frame {n}: {:?}", rec.errors()));
                return;
            }
            let Record::Iwarp(r) = rec else {
                errs.push(format!("frame {n}: unexpected {rec:?}"));
                return;
            };
            per_frame.entry(n).or_default().extend(iwarp_fields(&r.pdu));
            if let IwarpPdu::Fpdu {
                bytes,
                message,
                crc,
                ..
            } = &r.pdu
            {
                fpdus += 1;
                let crc_on = match crc {
                    CrcCheck::Good => {
                        good_crc += 1;
                        true
                    }
                    CrcCheck::Off { field } => {
                        if *field != 0 {
                            errs.push(format!("frame {n}: CRC off but field {field:#x}"));
                        }
                        false
                    }
                    CrcCheck::Bad { .. } => unreachable!("reported above"),
                };
                // Re-emit: headers from the parsed form, payload, pad, CRC.
                let m = message.as_ref().unwrap();
                let f = mpa::Fpdu::new_checked(*bytes).unwrap();
                let msg = rdmap::Message::new_checked(f.ulpdu()).unwrap();
                let mut ulpdu = vec![0u8; m.buffer_len()];
                let h = m.emit_header(&mut ulpdu).unwrap();
                ulpdu[h..].copy_from_slice(msg.payload());
                let mut out = vec![0u8; mpa::fpdu_len(ulpdu.len())];
                mpa::emit(&mut out, &ulpdu, crc_on).unwrap();
                // siw does not always zero its pad bytes (RFC 5044 says a receiver
                // ignores them): carry them over like payload, then recompute the CRC.
                let mut o = mpa::Fpdu::new_unchecked(&mut out[..]);
                o.pad_mut().copy_from_slice(f.pad());
                if crc_on {
                    let c = o.compute_crc();
                    o.set_crc(c);
                }
                if out != *bytes {
                    errs.push(format!("frame {n}: re-emitted FPDU differs"));
                }
            }
            if let IwarpPdu::Start { bytes, repr } = &r.pdu {
                let s = repr.as_ref().unwrap();
                let f = mpa::StartFrame::new_checked(*bytes).unwrap();
                let ulp = &f.private_data()[f.private_data().len() - s.ulp_private_data_len..];
                let mut out = vec![0u8; s.buffer_len()];
                s.emit(&mut mpa::StartFrame::new_unchecked(&mut out[..]), ulp)
                    .unwrap();
                if out != *bytes {
                    errs.push(format!("frame {n}: re-emitted MPA start frame differs"));
                }
            }
        });
    }
    decoder.finish(last, &mut |rec| errs.push(rec.describe()));
    let ours: Vec<u64> = per_frame.keys().copied().collect();
    let theirs: Vec<u64> = tsv.rows.keys().copied().collect();
    if ours != theirs {
        errs.push(format!(
            "{name}: frames with iWARP units {ours:?} differ from tshark's {theirs:?}"
        ));
    }
    for (&n, fields) in &per_frame {
        if !tsv.rows.contains_key(&n) {
            continue;
        }
        for &c in IWARP_COLUMNS {
            let mine: Vec<u64> = fields.iter().filter(|f| f.0 == c).map(|f| f.1).collect();
            check_field(&mut errs, &tsv, n, c, &mine);
        }
        // tshark leaves the CRC column empty when it checked a CRC32c.
        let theirs = tsv.values(n, "iwarp_mpa.crc");
        if !theirs.is_empty() {
            let mine: Vec<u64> = fields
                .iter()
                .filter(|f| f.0 == "iwarp_mpa.crc")
                .map(|f| f.1)
                .collect();
            check_field(&mut errs, &tsv, n, "iwarp_mpa.crc", &mine);
        }
    }
    (errs, fpdus, good_crc)
}

/// The independent checker's counts for a capture (`CRC-CHECKS.txt`, from
/// the harness's `check_crc.py`): (units, good).
fn crc_checks(name: &str) -> Option<(usize, usize)> {
    let text = String::from_utf8(read("CRC-CHECKS.txt")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}.pcap:")))?;
    let (mut total, mut good) = (0, 0);
    // "... ok 269/269" for RoCEv2, "... FPDUs 16, CRC32c ok 16/16" per iWARP direction.
    for part in line.split(';') {
        if let Some(frac) = part.split_whitespace().find(|w| w.contains('/')) {
            let (g, t) = frac.split_once('/').unwrap();
            good += g.parse::<usize>().unwrap();
            total += t
                .trim_end_matches(|c: char| !c.is_ascii_digit())
                .parse::<usize>()
                .unwrap();
        }
    }
    Some((total, good))
}

#[test]
fn every_rxe_packet_matches_tshark_checks_its_icrc_and_reemits() {
    let mut total = 0;
    for name in ROCE_CAPTURES {
        let file = read(&format!("{name}.pcap"));
        let (errs, good, inverted) = check_roce(name, &file);
        assert!(errs.is_empty(), "{name}:\n{}", errs.join("\n"));
        let want_inverted = usize::from(*name == "server_mode_host_client");
        assert_eq!(
            inverted, want_inverted,
            "{name}: deliberately inverted ICRCs"
        );
        if let Some((t, g)) = crc_checks(name) {
            assert_eq!(
                (good, good),
                (t, g),
                "{name}: count differs from CRC-CHECKS.txt"
            );
        }
        total += good + inverted;
    }
    assert!(total > 500, "only {total} RoCEv2 packets checked");
}

#[test]
fn every_siw_fpdu_matches_tshark_checks_its_crc_and_reemits() {
    for name in IWARP_CAPTURES {
        let file = read(&format!("{name}.pcap"));
        let (errs, fpdus, good_crc) = check_iwarp(name, &file);
        assert!(errs.is_empty(), "{name}:\n{}", errs.join("\n"));
        let (t, g) = crc_checks(name).expect("in CRC-CHECKS.txt");
        assert_eq!(fpdus, t, "{name}: FPDUs, against CRC-CHECKS.txt");
        if name.starts_with("siwcrc") {
            assert_eq!(good_crc, g, "{name}: good CRC32c, against CRC-CHECKS.txt");
        } else {
            assert_eq!(good_crc, 0, "{name}: CRC was not negotiated");
        }
    }
}

#[test]
fn the_ipv6_capture_is_ipv6_and_padded() {
    let file = read("rxe_ipv6.pcap");
    let mut v6 = 0;
    let mut pads = std::collections::BTreeSet::new();
    let mut decoder = capture::Decoder::new();
    for frame in capture::frames(&file).unwrap() {
        decoder.push(&frame.unwrap(), &mut |rec| {
            if let Record::Roce(r) = rec {
                assert_eq!(r.ip_header.len(), 40);
                assert!(r.icrc.is_ok());
                v6 += 1;
                pads.insert(r.repr.as_ref().unwrap().bth.pad_count);
            }
        });
    }
    assert_eq!(v6, 24);
    assert!(
        pads.contains(&2) && pads.contains(&3),
        "pads seen: {pads:?}"
    );
}

/// Finds the first frame of a capture holding a RoCEv2 packet of `opcode` and
/// returns the byte offset of its BTH in the file.
fn bth_offset_in_file(file: &[u8], opcode: u8) -> usize {
    let mut found = None;
    let mut decoder = capture::Decoder::new();
    for frame in capture::frames(file).unwrap() {
        let frame = frame.unwrap();
        decoder.push(&frame, &mut |rec| {
            if let Record::Roce(r) = rec
                && found.is_none()
                && r.ib[0] == opcode
            {
                found = Some(r.ib.as_ptr() as usize - file.as_ptr() as usize);
            }
        });
    }
    found.expect("opcode present")
}

#[test]
fn a_corrupted_field_fails_the_golden_check() {
    let name = "rxe_read_bw";
    let mut file = read(&format!("{name}.pcap"));
    let at = bth_offset_in_file(&file, 0x0c); // a READ REQUEST
    // A PSN byte: tshark's PSN and the ICRC no longer match.
    file[at + 11] ^= 0x01;
    let (errs, _, _) = check_roce(name, &file);
    assert!(
        errs.iter().any(|e| e.contains("infiniband.bth.psn")),
        "{errs:?}"
    );
    assert!(errs.iter().any(|e| e.contains("bad ICRC")), "{errs:?}");
    // The RETH's R_Key, same story.
    let mut file = read(&format!("{name}.pcap"));
    file[at + 12 + 11] ^= 0x40;
    let (errs, _, _) = check_roce(name, &file);
    assert!(
        errs.iter().any(|e| e.contains("infiniband.reth.r_key")),
        "{errs:?}"
    );
}

#[test]
fn a_corrupted_payload_byte_fails_the_crc32c_check() {
    let name = "siwcrc_rping";
    let mut file = read(&format!("{name}.pcap"));
    // The 16-byte rdma_info of the first Send (frame 10) ends 4 bytes before its CRC.
    let key = [0x00u8, 0x00, 0x00, 0x40, 0x8c, 0x15, 0x3b, 0xcc];
    let at = file
        .windows(key.len())
        .position(|w| w == key)
        .expect("frame 10 payload");
    file[at] ^= 0x01;
    let (errs, _, _) = check_iwarp(name, &file);
    assert!(
        errs.iter().any(|e| e.contains("bad MPA CRC32c")),
        "{errs:?}"
    );
}

#[test]
fn cm_mads_decode() {
    let file = read("rxe_rping.pcap");
    let mut attrs = Vec::new();
    let mut decoder = capture::Decoder::new();
    for frame in capture::frames(&file).unwrap() {
        decoder.push(&frame.unwrap(), &mut |rec| {
            if let Record::Roce(r) = rec
                && let Some(Ok(m)) = r.mad
            {
                assert_eq!(m.mgmt_class, mad::CLASS_CM);
                attrs.push(mad::cm_attribute_name(m.attribute_id).unwrap());
            }
        });
    }
    assert_eq!(attrs, ["REQ", "REP", "RTU", "DREQ", "DREP"]);
}

/// A pcap record: its 16-byte header, its frame.
type PcapRecord = (Vec<u8>, Vec<u8>);

/// A legacy pcap's global header and its records.
fn pcap_records(file: &[u8]) -> (Vec<u8>, Vec<PcapRecord>) {
    assert_eq!(
        &file[..4],
        &0xa1b2_c3d4u32.to_le_bytes(),
        "little-endian pcap"
    );
    let mut records = Vec::new();
    let mut at = 24;
    while at < file.len() {
        let len = u32::from_le_bytes(file[at + 8..at + 12].try_into().unwrap()) as usize;
        records.push((
            file[at..at + 16].to_vec(),
            file[at + 16..at + 16 + len].to_vec(),
        ));
        at += 16 + len;
    }
    (file[..24].to_vec(), records)
}

/// An Ethernet/IPv4/TCP frame's (source port, sequence number's offset in
/// the frame, payload length).
fn tcp_of(frame: &[u8]) -> Option<(u16, usize, usize)> {
    if frame[12..14] != [0x08, 0x00] || frame[23] != 6 {
        return None;
    }
    let ihl = usize::from(frame[14] & 15) * 4;
    let total = usize::from(u16::from_be_bytes([frame[16], frame[17]]));
    let tcp = 14 + ihl;
    let doff = usize::from(frame[tcp + 12] >> 4) * 4;
    Some((
        u16::from_be_bytes([frame[tcp], frame[tcp + 1]]),
        tcp + 4,
        total - ihl - doff,
    ))
}

/// Each direction's iWARP records' fields, in order, and every problem the
/// decoder saw.
type Directions = BTreeMap<String, Vec<Vec<(&'static str, u64)>>>;
fn iwarp_decoded(file: &[u8]) -> (Directions, Vec<String>) {
    let (mut fields, mut problems) = (Directions::new(), Vec::new());
    let mut decoder = capture::Decoder::new();
    let mut last = 0;
    for frame in capture::frames(file).unwrap() {
        let frame = frame.unwrap();
        last = frame.number;
        decoder.push(&frame, &mut |rec| match rec {
            Record::Iwarp(ref r) if rec.errors().is_empty() => fields
                .entry(format!("{:?}", rec.endpoints()))
                .or_default()
                .push(iwarp_fields(&r.pdu)),
            other => problems.push(format!("{other:?}")),
        });
    }
    decoder.finish(last, &mut |rec| problems.push(format!("{rec:?}")));
    (fields, problems)
}

/// Segments held behind a gap that lie on both sides of the TCP sequence
/// number's wrap are placed once the gap fills: the decoder took the
/// numerically smallest held segment as the next, and the stream stalled
/// (it crosses the wrap once per 4 GiB). siw's rping capture, one direction
/// renumbered so that its third and fourth segments straddle the wrap, its
/// second sent after them.
#[test]
fn held_segments_on_both_sides_of_the_sequence_wrap_are_placed() {
    let file = read("siw_rping.pcap");
    let (want, problems) = iwarp_decoded(&file);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(want.len(), 2);
    assert!(want.values().all(|records| records.len() > 5));
    let (header, mut records) = pcap_records(&file);
    let with_payload: Vec<usize> = (0..records.len())
        .filter(|&i| tcp_of(&records[i].1).is_some_and(|(_, _, n)| n > 0))
        .collect();
    let client_port = tcp_of(&records[with_payload[0]].1).unwrap().0;
    let client: Vec<usize> = with_payload
        .into_iter()
        .filter(|&i| tcp_of(&records[i].1).unwrap().0 == client_port)
        .collect();
    let seq_at = |f: &[u8], at: usize| u32::from_be_bytes(f[at..at + 4].try_into().unwrap());
    let (_, at, _) = tcp_of(&records[client[3]].1).unwrap();
    let shift = 0u32.wrapping_sub(seq_at(&records[client[3]].1, at));
    for (_, frame) in records.iter_mut() {
        if let Some((port, at, _)) = tcp_of(frame)
            && port == client_port
        {
            let seq = seq_at(frame, at).wrapping_add(shift);
            frame[at..at + 4].copy_from_slice(&seq.to_be_bytes());
        }
    }
    let (_, at, _) = tcp_of(&records[client[2]].1).unwrap();
    assert!(
        seq_at(&records[client[2]].1, at) > 0xffff_0000,
        "before the wrap"
    );
    let second = records.remove(client[1]);
    records.insert(client[3], second);
    let mut moved = header;
    for (h, f) in &records {
        moved.extend_from_slice(h);
        moved.extend_from_slice(f);
    }
    let (got, problems) = iwarp_decoded(&moved);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(got, want);
}
