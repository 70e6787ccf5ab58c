//! CM MADs as a hostile peer may send them to QP 1: parsed (never a panic,
//! whatever the bytes), re-emitted and parsed again to the same message;
//! and the refusal the GSI sends when nothing listens, which answers only a
//! REQ or SIDR_REQ, with a REJ or SIDR_REP for that request.
#![no_main]
use libfuzzer_sys::fuzz_target;
use softrdma::engine::gsi::{MAD_PACKET_LEN, mad_packet, refuse_request};
use softrdma_wire::cm::{self, Body, Message};
use softrdma_wire::mad::MAD_LEN;

fn emit(m: &Message, out: &mut [u8; MAD_LEN]) {
    match &m.body {
        Body::Req(r) => r.emit(m.tid, out),
        Body::Rep(r) => r.emit(m.tid, out),
        Body::Rtu(ids) => ids.emit_as(cm::RTU, m.tid, out),
        Body::Rej(r) => r.emit(m.tid, out),
        Body::Mra(r) => r.emit(m.tid, out),
        Body::Dreq(r) => r.emit(m.tid, out),
        Body::Drep(ids) => ids.emit_as(cm::DREP, m.tid, out),
        Body::SidrReq(r) => r.emit(m.tid, out),
        Body::SidrRep(r) => r.emit(m.tid, out),
    }
}

fuzz_target!(|data: &[u8]| {
    let parsed = Message::parse(data);
    let Ok(mad) = <[u8; MAD_LEN]>::try_from(data.get(..MAD_LEN).unwrap_or(&[])) else {
        assert!(parsed.is_err(), "a short MAD parsed");
        return;
    };
    if let Ok(Some(m)) = &parsed {
        let mut out = [0u8; MAD_LEN];
        emit(m, &mut out);
        assert_eq!(Message::parse(&out).unwrap().as_ref(), Some(m));
    }
    let mut packet = [0u8; MAD_PACKET_LEN];
    mad_packet(&mad, 0, &mut packet).expect("a MAD packet builds");
    let mut answer = [0u8; MAD_PACKET_LEN];
    if refuse_request(&packet, &mut answer).is_some() {
        let asked = parsed.unwrap().expect("only a CM request is answered");
        let reply = Message::parse(&answer[20..20 + MAD_LEN]).unwrap().unwrap();
        assert_eq!(reply.tid, asked.tid);
        match (asked.body, reply.body) {
            (Body::Req(q), Body::Rej(r)) => {
                assert_eq!(
                    (r.ids.remote, r.reason),
                    (q.local_comm_id, cm::REJ_INVALID_SERVICE_ID)
                )
            }
            (Body::SidrReq(q), Body::SidrRep(r)) => assert_eq!(
                (r.request_id, r.status, r.service_id),
                (q.request_id, cm::SIDR_UNSUPPORTED, q.service_id)
            ),
            other => panic!("{other:?}"),
        }
    }
});
