//! An RC QP in RTS fed hostile packets (and a few work requests of its own, so
//! that hostile ACKs and responses meet outstanding requests): it must never
//! panic, touch memory outside its region or where it grants no access, or
//! stop answering to its doors.
//!
//! Input: a control byte, then packets, each a 2-byte little-endian length
//! and that many bytes; the BTH's destination QP is patched to this QP's and
//! its PSN folded near the expected one so that the deep paths are reached
//! (and, by the control byte's low bit, a RETH's or AtomicETH's key and
//! address toward the region).
#![no_main]
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use softrdma::engine::rc::{MAX_HEADER_LEN, Mtu, QpCaps, RcQp};
use softrdma::engine::{QpAttr, QpState, RecvWr, SendFlags, SendOp, SendWr, Sge, Time};
use softrdma::memory::{Access, MrTable, Region, RegionMemory};

const IOVA: u64 = 0x10_0000;

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, mut rest)) = data.split_first() else {
        return;
    };
    let mem = Arc::new(RegionMemory::zeroed(65536).unwrap());
    let mut mrs = MrTable::new();
    mrs.insert(Region::new(1, (0x100, 0x200), mem.clone(), 0, 65536, IOVA, Access::ALL).unwrap());
    let mut qp = RcQp::new(0x11, 1, QpCaps::default());
    let access = Access::from_bits(u32::from(ctl) & 0xe);
    qp.modify(&QpAttr {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        access: Some(access),
        ..QpAttr::default()
    })
    .unwrap();
    qp.modify(&QpAttr {
        state: Some(QpState::Rtr),
        path_mtu: Mtu::from_code(1 + ctl % 5),
        dest_qp: Some(0x12),
        rq_psn: Some(0),
        max_dest_rd_atomic: Some(4),
        min_rnr_timer: Some(1),
        has_av: true,
        ..QpAttr::default()
    })
    .unwrap();
    qp.modify(&QpAttr {
        state: Some(QpState::Rts),
        sq_psn: Some(0),
        max_rd_atomic: Some(4),
        retry_cnt: Some(2),
        rnr_retry: Some(2),
        timeout: Some(1),
        ..QpAttr::default()
    })
    .unwrap();
    if ctl & 0x10 != 0 {
        let _ = qp.post_recv(RecvWr::new(
            1,
            [Sge {
                addr: IOVA,
                len: 3000,
                lkey: 0x100,
            }],
        ));
    }
    if ctl & 0x20 != 0 {
        let sge = |len| {
            vec![Sge {
                addr: IOVA + 8192,
                len,
                lkey: 0x100,
            }]
        };
        let flags = SendFlags {
            signaled: true,
            ..SendFlags::default()
        };
        for op in [
            SendOp::Send,
            SendOp::Read {
                remote_addr: 0,
                rkey: 1,
            },
            SendOp::FetchAdd {
                remote_addr: 0,
                rkey: 1,
                add: 1,
            },
        ] {
            let len = if matches!(op, SendOp::FetchAdd { .. }) {
                8
            } else {
                5000
            };
            let _ = qp.post_send(SendWr {
                wr_id: 2,
                op,
                sgl: sge(len).into(),
                flags,
                ud: None,
                inline_data: Default::default(),
            });
        }
    }
    let mut buf = vec![0u8; MAX_HEADER_LEN + 4096];
    let mut pieces = Vec::new();
    let mut now = Time(1);
    let mut drain = |qp: &mut RcQp, now: Time, mrs: &MrTable| {
        for _ in 0..10_000 {
            if qp.poll_transmit(now, mrs, &mut buf, &mut pieces).is_none() {
                break;
            }
        }
        while qp.poll_completion().is_some() {}
    };
    drain(&mut qp, now, &mrs);
    while rest.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let mut p = rest[2..2 + n].to_vec();
        rest = &rest[2 + n..];
        if p.len() >= 12 {
            p[5..8].copy_from_slice(&[0, 0, 0x11]);
            p[9] = 0;
            p[10] = 0;
        }
        // WRITE FIRST and ONLY, READ requests and atomics: by the control
        // byte, the key made the region's and the address folded near it.
        if ctl & 1 != 0 && p.len() >= 24 && matches!(p[0], 0x06 | 0x0a | 0x0b | 0x0c | 0x13 | 0x14)
        {
            let va = u64::from_be_bytes(p[12..20].try_into().unwrap());
            p[12..20].copy_from_slice(&(IOVA + va % 70_000).to_be_bytes());
            p[20..24].copy_from_slice(&0x200u32.to_be_bytes());
        }
        now = Time(now.0 + 1000);
        qp.handle_packet(now, &p, &mrs);
        drain(&mut qp, now, &mrs);
        if let Some(t) = qp.poll_timeout() {
            now = now.max(t);
            qp.handle_timeout(now);
            drain(&mut qp, now, &mrs);
        }
    }
    // Without remote write or atomic access on the QP, only its receive
    // buffer and its READ's and atomic's sinks may change.
    if !access.contains(Access::REMOTE_WRITE) && !access.contains(Access::REMOTE_ATOMIC) {
        let mut all = vec![0u8; 65536];
        mem.read(0, &mut all);
        let mut outside = all[3000..8192].iter().chain(&all[8192 + 5000..]);
        assert!(
            outside.all(|&b| b == 0),
            "a hostile packet wrote where the QP gives no access"
        );
    }
});
