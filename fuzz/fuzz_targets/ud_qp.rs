//! A UD QP fed hostile datagrams, and a few work requests of its own: it must
//! never panic, write a receive's bytes past its buffer (nothing else in its
//! region may change: only receives write there), or complete a receive
//! longer than its buffer.
//!
//! Input: a control byte, then packets, each a 2-byte little-endian length
//! and that many bytes; the BTH's destination QP is patched to this QP's and,
//! when the control byte says so, the DETH's Q_Key to this QP's.
#![no_main]
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use softrdma::engine::rc::{Mtu, QpCaps};
use softrdma::engine::ud::{RecvMeta, UdQp};
use softrdma::engine::{
    AhId, CqKind, QpAttr, QpState, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest,
};
use softrdma::memory::{Access, MrTable, Region, RegionMemory};

const IOVA: u64 = 0x10_0000;
const REGION: usize = 16384;
const QKEY: u32 = 0x1111_1111;
const META: RecvMeta = RecvMeta::V4 {
    src: [127, 0, 0, 2],
    dst: [127, 0, 0, 1],
    tos: 0,
    ttl: 64,
    identification: 0,
};

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, mut rest)) = data.split_first() else {
        return;
    };
    let mem = Arc::new(RegionMemory::zeroed(REGION).unwrap());
    let mut mrs = MrTable::new();
    mrs.insert(Region::new(1, (0x100, 0x200), mem.clone(), 0, REGION, IOVA, Access::ALL).unwrap());
    let mtu = Mtu::from_code(1 + ctl % 5).unwrap_or(Mtu::Mtu1024);
    let mut qp = UdQp::new(0x11, 1, QpCaps::default(), mtu);
    for attr in [
        QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            qkey: Some(QKEY),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rtr),
            ..QpAttr::default()
        },
        QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(0),
            ..QpAttr::default()
        },
    ] {
        qp.modify(&attr).unwrap();
    }
    // Receive buffers of 1 to 3 869 bytes (some shorter than the GRH), one
    // after another from the region's start: the rest must stay zero.
    let recv_len = 1 + u32::from(ctl & 0xf0) * 16 + u32::from(ctl & 7) * 4;
    let recvs = 1 + u64::from(ctl >> 6);
    let recv_end = recvs as usize * recv_len as usize;
    for i in 0..recvs {
        let _ = qp.post_recv(RecvWr::new(
            10 + i,
            [Sge {
                addr: IOVA + i * u64::from(recv_len),
                len: recv_len,
                lkey: 0x100,
            }],
        ));
    }
    if ctl & 8 != 0 {
        for (k, op) in [SendOp::Send, SendOp::SendWithImm(7)]
            .into_iter()
            .enumerate()
        {
            let _ = qp.post_send(SendWr {
                wr_id: 2,
                op,
                sgl: vec![Sge {
                    addr: IOVA + 12288,
                    len: 100 * k as u32,
                    lkey: 0x100,
                }]
                .into(),
                flags: SendFlags {
                    signaled: true,
                    ..SendFlags::default()
                },
                ud: Some(UdDest {
                    ah: AhId(1),
                    remote_qpn: 0x12,
                    remote_qkey: QKEY,
                }),
                inline_data: Default::default(),
            });
        }
        // And one inline: its payload is in the header buffer, not in the
        // pieces that `payload_len` counts (the drain below checks it).
        let _ = qp.post_send(
            SendWr::new(3, SendOp::Send, [])
                .inline(&[0x5a; 13])
                .to(UdDest {
                    ah: AhId(1),
                    remote_qpn: 0x12,
                    remote_qkey: QKEY,
                }),
        );
    }
    let mut buf = vec![0u8; 64 + 4096];
    let mut pieces = Vec::new();
    let mut drain = |qp: &mut UdQp, mrs: &MrTable| {
        while let Some((t, _ah)) = qp.poll_transmit(mrs, &mut buf, &mut pieces) {
            assert!(t.len <= buf.len());
            assert_eq!(pieces.iter().map(|p| p.len()).sum::<usize>(), t.payload_len);
            qp.transmitted();
        }
        while let Some((kind, wc)) = qp.poll_completion() {
            if kind == CqKind::Recv && wc.status == softrdma::engine::WcStatus::Success {
                assert!(wc.byte_len <= recv_len, "a receive longer than its buffer");
            }
        }
        while qp.poll_event().is_some() {}
    };
    drain(&mut qp, &mrs);
    while rest.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let mut p = rest[2..2 + n].to_vec();
        rest = &rest[2 + n..];
        if p.len() >= 12 {
            p[5..8].copy_from_slice(&[0, 0, 0x11]);
        }
        if ctl & 4 != 0 && p.len() >= 20 {
            p[12..16].copy_from_slice(&QKEY.to_be_bytes());
        }
        qp.handle_packet(&p, &META, &mrs);
        drain(&mut qp, &mrs);
    }
    let mut after = vec![0u8; REGION - recv_end.min(REGION)];
    mem.read(recv_end.min(REGION), &mut after);
    assert!(
        after.iter().all(|&b| b == 0),
        "bytes written past the receive buffers"
    );
});
