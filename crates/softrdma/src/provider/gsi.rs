//! QP 1 of a RoCEv2 device: where the IB connection manager's messages
//! (rdma_cm over RoCE) arrive and whom they are for. The progress thread
//! hands each CM MAD to [`Gsi::dispatch`], which answers what needs no
//! application (a REQ or SIDR_REQ nothing here takes, a DREQ, a repeated
//! SIDR_REQ already answered) and queues the rest for the exchange or
//! listener waiting for it ([`crate::cm::roce`], [`crate::cm::roce_ud`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use softrdma_wire::cm::{
    self, Body, Dreq, Ids, Message, REJ_INVALID_SERVICE_ID, Rej, SIDR_REJECT, SIDR_UNSUPPORTED,
    SidrRep,
};
use softrdma_wire::mad::MAD_LEN;

/// Messages a listener or an exchange keeps before it takes them: a peer
/// that floods one gets the rest dropped.
const QUEUE_MAX: usize = 64;

/// SIDR answers kept to send again when their request comes again (the
/// first answer was lost); the oldest go first.
const SIDR_ANSWERS_KEPT: usize = 64;

/// A CM message and the address it came from.
#[derive(Debug, Clone)]
pub(crate) struct Arrival {
    pub from: Ipv4Addr,
    pub msg: Message,
}

/// An established connection, by this side's communication ID.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Connection {
    pub qpn: u32,
    pub peer: Ipv4Addr,
    pub remote_comm_id: u32,
    pub remote_qpn: u32,
    pub tid: u64,
    /// This side sent the REQ (and so answers a repeated REP with an RTU).
    pub active: bool,
}

/// Whom a wait is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Waiter {
    /// A listener on an rdma_cm service.
    Service(u64),
    /// An exchange under way, by this side's communication ID.
    Exchange(u32),
}

#[derive(Debug, Default)]
struct State {
    queues: HashMap<Waiter, VecDeque<Arrival>>,
    /// Passive exchanges by the active side's address and communication
    /// ID: a repeated REQ goes to the exchange it started.
    passive: HashMap<(Ipv4Addr, u32), u32>,
    connections: HashMap<u32, Connection>,
    /// SIDR requests a listener's queue holds or an accept is answering: a
    /// repeat is dropped.
    sidr_pending: HashSet<SidrKey>,
    /// SIDR requests answered, and their answers.
    sidr_answers: VecDeque<(SidrKey, [u8; MAD_LEN])>,
}

impl State {
    /// A connection with the peer at `from` whose ID there is `remote`.
    fn connected_to(&self, from: Ipv4Addr, remote: u32) -> bool {
        self.connections
            .values()
            .any(|c| c.peer == from && c.remote_comm_id == remote)
    }
}

/// A SIDR request: its sender, request ID and service ID (a request ID
/// reused for another service is another request).
pub(crate) type SidrKey = (Ipv4Addr, u32, u64);

/// What the progress thread does after a dispatch.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// A MAD to send back to the sender.
    pub reply: Option<[u8; MAD_LEN]>,
    /// The reply refuses a message nothing here takes (a REJ of a REQ or of
    /// a REP for no exchange, a SIDR_REP without a QP; not a cached replay):
    /// counted in the device's stats.
    pub refused: bool,
    /// A QP whose peer disconnected: to the error state.
    pub disconnected_qp: Option<u32>,
}

/// The GSI's bookkeeping.
#[derive(Debug)]
pub(crate) struct Gsi {
    state: Mutex<State>,
    arrived: Condvar,
    /// The PSN of the next MAD sent (UD: counted, never checked).
    psn: AtomicU32,
    next_comm_id: AtomicU32,
}

impl Gsi {
    pub fn new(seed: u32) -> Gsi {
        Gsi {
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
            psn: AtomicU32::new(0),
            next_comm_id: AtomicU32::new(seed | 1),
        }
    }

    pub fn next_psn(&self) -> u32 {
        self.psn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff
    }

    /// A communication ID no connection of this device has (0 is never
    /// one): random, so that a peer cannot guess the next from one it saw.
    pub fn new_comm_id(&self) -> u32 {
        loop {
            let id = getrandom::u32()
                .unwrap_or_else(|_| self.next_comm_id.fetch_add(0x9e37_79b9, Ordering::Relaxed));
            let s = self.state.lock().expect("GSI lock");
            if id != 0
                && !s.connections.contains_key(&id)
                && !s.queues.contains_key(&Waiter::Exchange(id))
            {
                return id;
            }
        }
    }

    /// Starts taking messages for `w`; false if something already does
    /// (a port listened on twice).
    pub fn register(&self, w: Waiter) -> bool {
        let mut s = self.state.lock().expect("GSI lock");
        if s.queues.contains_key(&w) {
            return false;
        }
        s.queues.insert(w, VecDeque::new());
        true
    }

    /// Stops taking messages for `w` (and forgets its passive exchange; a
    /// service's queued SIDR requests and cached answers go with it).
    pub fn unregister(&self, w: Waiter) {
        let mut s = self.state.lock().expect("GSI lock");
        for a in s.queues.remove(&w).unwrap_or_default() {
            if let Body::SidrReq(r) = a.msg.body {
                s.sidr_pending.remove(&(a.from, r.request_id, r.service_id));
            }
        }
        // A service that goes takes its answers along: a late repeat is
        // asked of whatever listens then, as a new request.
        if let Waiter::Service(service) = w {
            s.sidr_answers
                .retain(|((_, _, answered), _)| *answered != service);
        }
        if let Waiter::Exchange(id) = w {
            s.passive.retain(|_, local| *local != id);
        }
    }

    /// A repeated REQ from `from` with communication ID `remote` goes to
    /// the passive exchange `local` from now on.
    pub fn note_passive(&self, from: Ipv4Addr, remote: u32, local: u32) {
        self.state
            .lock()
            .expect("GSI lock")
            .passive
            .insert((from, remote), local);
    }

    /// Whether a REQ from `from` with communication ID `remote` is one an
    /// exchange took already (a repeat that reached the listener's queue
    /// before the first was taken).
    pub fn is_taken(&self, from: Ipv4Addr, remote: u32) -> bool {
        let s = self.state.lock().expect("GSI lock");
        s.passive.contains_key(&(from, remote)) || s.connected_to(from, remote)
    }

    /// The next message for `w`, waiting until `deadline`.
    pub fn wait(&self, w: Waiter, deadline: Instant) -> Option<Arrival> {
        let mut s = self.state.lock().expect("GSI lock");
        loop {
            match s.queues.get_mut(&w) {
                None => return None,
                Some(q) => {
                    if let Some(a) = q.pop_front() {
                        return Some(a);
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            s = self.arrived.wait_timeout(s, left).expect("GSI lock").0;
        }
    }

    /// The SIDR request `key` is answered with `reply` (sent by the
    /// caller): repeats of it get the same answer.
    pub fn sidr_answered(&self, key: SidrKey, reply: &[u8; MAD_LEN]) {
        let mut s = self.state.lock().expect("GSI lock");
        s.sidr_pending.remove(&key);
        if s.sidr_answers.len() == SIDR_ANSWERS_KEPT {
            s.sidr_answers.pop_front();
        }
        s.sidr_answers.push_back((key, *reply));
    }

    /// The SIDR request `key` was taken and will not be answered (its
    /// accept failed): a repeat is a new request.
    pub fn sidr_forget(&self, key: SidrKey) {
        self.state
            .lock()
            .expect("GSI lock")
            .sidr_pending
            .remove(&key);
    }

    /// Records a connection (replacing any of the same QP: one reset and
    /// connected again).
    pub fn establish(&self, local_comm_id: u32, c: Connection) {
        let mut s = self.state.lock().expect("GSI lock");
        s.connections.retain(|_, old| old.qpn != c.qpn);
        s.connections.insert(local_comm_id, c);
    }

    /// The connection of QP `qpn`, forgotten: it is being disconnected.
    pub fn take_connection_of(&self, qpn: u32) -> Option<(u32, Connection)> {
        let mut s = self.state.lock().expect("GSI lock");
        let id = *s.connections.iter().find(|(_, c)| c.qpn == qpn)?.0;
        s.connections.remove(&id).map(|c| (id, c))
    }

    /// What to do with a CM MAD from `from`.
    pub fn dispatch(&self, from: Ipv4Addr, m: &[u8]) -> Outcome {
        let mut out = Outcome::default();
        let Ok(Some(msg)) = Message::parse(m) else {
            return out;
        };
        let mut s = self.state.lock().expect("GSI lock");
        let target = match &msg.body {
            Body::Req(r) => match s.passive.get(&(from, r.local_comm_id)) {
                Some(&local) => Some(Waiter::Exchange(local)),
                // A REQ repeated after its connection was made: the REP
                // reached the peer (it sent the RTU); nothing to do.
                None if s.connected_to(from, r.local_comm_id) => return out,
                None => {
                    let w = Waiter::Service(r.service_id);
                    let reason = if !s.queues.contains_key(&w) {
                        // As Linux's CM answers a REQ no listener takes.
                        Some(REJ_INVALID_SERVICE_ID)
                    } else if cm::rdma_cm_udp_port(r.service_id).is_some() {
                        // A UD service's: as Linux's rdma_cm refuses it.
                        Some(cm::REJ_CONSUMER)
                    } else {
                        None
                    };
                    if let Some(reason) = reason {
                        let mut rej = [0u8; MAD_LEN];
                        Rej::of_req(r.local_comm_id, reason).emit(msg.tid, &mut rej);
                        out.reply = Some(rej);
                        out.refused = true;
                        return out;
                    }
                    Some(w)
                }
            },
            Body::Dreq(d) => {
                // Answered whether or not the connection is known (so does
                // Linux's CM): the peer stops repeating it.
                out.reply = Some(answer(d.ids, cm::DREP, msg.tid));
                if let Some(c) = s.connections.get(&d.ids.remote)
                    && c.peer == from
                    && c.remote_comm_id == d.ids.local
                    && c.qpn == d.remote_qpn
                {
                    out.disconnected_qp = Some(c.qpn);
                    s.connections.remove(&d.ids.remote);
                }
                let w = Waiter::Exchange(d.ids.remote);
                s.queues.contains_key(&w).then_some(w)
            }
            Body::Rep(r) => {
                if let Some(c) = s.connections.get(&r.ids.remote)
                    && c.active
                    && c.peer == from
                    && c.remote_comm_id == r.ids.local
                {
                    // Our RTU was lost: the REP comes again.
                    out.reply = Some(answer(r.ids, cm::RTU, msg.tid));
                    return out;
                }
                let w = Waiter::Exchange(r.ids.remote);
                if !s.queues.contains_key(&w) {
                    // A REP for no exchange of ours: as Linux's CM, a REJ
                    // "invalid communication ID".
                    let mut rej = [0u8; MAD_LEN];
                    cm::Rej {
                        ids: Ids {
                            local: r.ids.remote,
                            remote: r.ids.local,
                        },
                        message_rejected: 1,
                        reason: cm::REJ_INVALID_COMM_ID,
                        private_data: [0; cm::REJ_PRIVATE_DATA_LEN],
                    }
                    .emit(msg.tid, &mut rej);
                    out.reply = Some(rej);
                    out.refused = true;
                    return out;
                }
                Some(w)
            }
            Body::SidrReq(r) => {
                let key = (from, r.request_id, r.service_id);
                if let Some((_, answer)) = s.sidr_answers.iter().find(|(k, _)| *k == key) {
                    // The answer was lost: the same again.
                    out.reply = Some(*answer);
                    return out;
                }
                if s.sidr_pending.contains(&key) {
                    return out;
                }
                let w = Waiter::Service(r.service_id);
                let status = match s.queues.get(&w).map(VecDeque::len) {
                    // As Linux's CM answers a SIDR_REQ no listener takes.
                    None => SIDR_UNSUPPORTED,
                    // An RC listener's service: as Linux's rdma_cm refuses
                    // a QP type its port space does not have.
                    Some(_) if cm::rdma_cm_udp_port(r.service_id).is_none() => SIDR_REJECT,
                    Some(queued) if queued < QUEUE_MAX => {
                        s.sidr_pending.insert(key);
                        return self.queue(&mut s, w, Arrival { from, msg }, out);
                    }
                    // A full queue drops it; a repeat may find room.
                    Some(_) => return out,
                };
                let mut rep = [0u8; MAD_LEN];
                SidrRep::refusal(r, status).emit(msg.tid, &mut rep);
                out.reply = Some(rep);
                out.refused = true;
                return out;
            }
            Body::SidrRep(r) => Some(Waiter::Exchange(r.request_id)),
            Body::Rtu(ids) | Body::Drep(ids) => Some(Waiter::Exchange(ids.remote)),
            Body::Rej(r) => Some(Waiter::Exchange(r.ids.remote)),
            Body::Mra(r) => Some(Waiter::Exchange(r.ids.remote)),
        };
        match target {
            Some(w) => self.queue(&mut s, w, Arrival { from, msg }, out),
            None => out,
        }
    }

    /// Queues `a` for `w`, if it waits and has room (a peer that floods
    /// one gets the rest dropped).
    fn queue(&self, s: &mut State, w: Waiter, a: Arrival, out: Outcome) -> Outcome {
        if let Some(q) = s.queues.get_mut(&w)
            && q.len() < QUEUE_MAX
        {
            q.push_back(a);
            self.arrived.notify_all();
        }
        out
    }
}

/// The message `attribute` (RTU, DREP) answering one with `ids`: the IDs
/// the other way round.
fn answer(ids: Ids, attribute: u16, tid: u64) -> [u8; MAD_LEN] {
    let mut m = [0u8; MAD_LEN];
    Ids {
        local: ids.remote,
        remote: ids.local,
    }
    .emit_as(attribute, tid, &mut m);
    m
}

/// The DREQ for connection `c` (this side's ID `local`).
pub(crate) fn dreq_for(local: u32, c: &Connection) -> [u8; MAD_LEN] {
    let mut m = [0u8; MAD_LEN];
    Dreq {
        ids: Ids {
            local,
            remote: c.remote_comm_id,
        },
        remote_qpn: c.remote_qpn,
    }
    .emit(c.tid, &mut m);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma_wire::cm::Rep;

    const PEER: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);

    fn parse(m: &[u8; MAD_LEN]) -> Body {
        Message::parse(m).unwrap().unwrap().body
    }

    #[test]
    fn a_dreq_is_answered_and_ends_only_its_own_connection() {
        let g = Gsi::new(7);
        let c = Connection {
            qpn: 0x11,
            peer: PEER,
            remote_comm_id: 0xaa,
            remote_qpn: 0x22,
            tid: 5,
            active: true,
        };
        g.establish(0x55, c);
        // The DREQ names the connection the wrong way round (another
        // peer's ID): answered, the connection kept.
        let mut m = [0u8; MAD_LEN];
        Dreq {
            ids: Ids {
                local: 0xab,
                remote: 0x55,
            },
            remote_qpn: 0x11,
        }
        .emit(5, &mut m);
        let out = g.dispatch(PEER, &m);
        assert_eq!(
            parse(&out.reply.unwrap()),
            Body::Drep(Ids {
                local: 0x55,
                remote: 0xab
            })
        );
        assert_eq!(out.disconnected_qp, None);
        // Its own DREQ ends it, once: from its peer, naming its QP.
        let theirs = Connection {
            remote_comm_id: 0x55,
            remote_qpn: 0x11,
            ..c
        };
        m = dreq_for(0xaa, &theirs);
        let elsewhere = Ipv4Addr::new(10, 99, 0, 9);
        assert_eq!(g.dispatch(elsewhere, &m).disconnected_qp, None);
        let other_qp = dreq_for(
            0xaa,
            &Connection {
                remote_qpn: 0x12,
                ..theirs
            },
        );
        assert_eq!(g.dispatch(PEER, &other_qp).disconnected_qp, None);
        assert_eq!(g.dispatch(PEER, &m).disconnected_qp, Some(0x11));
        assert_eq!(g.dispatch(PEER, &m).disconnected_qp, None);
        assert!(g.take_connection_of(0x11).is_none());
    }

    #[test]
    fn a_repeated_rep_gets_the_rtu_again_and_others_wait_in_their_queue() {
        let g = Gsi::new(7);
        g.establish(
            0x55,
            Connection {
                qpn: 0x11,
                peer: PEER,
                remote_comm_id: 0xaa,
                remote_qpn: 0x22,
                tid: 5,
                active: true,
            },
        );
        let mut m = [0u8; MAD_LEN];
        Rep {
            ids: Ids {
                local: 0xaa,
                remote: 0x55,
            },
            local_qpn: 0x22,
            starting_psn: 1,
            responder_resources: 1,
            initiator_depth: 1,
            target_ack_delay: 0,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: 0,
            private_data: [0; cm::REP_PRIVATE_DATA_LEN],
        }
        .emit(5, &mut m);
        let out = g.dispatch(PEER, &m);
        assert_eq!(
            parse(&out.reply.unwrap()),
            Body::Rtu(Ids {
                local: 0x55,
                remote: 0xaa
            })
        );
        // A REP for an exchange under way waits for it; one for nobody is
        // dropped.
        let w = Waiter::Exchange(0x66);
        assert!(g.register(w));
        assert!(!g.register(w));
        m[28..32].copy_from_slice(&0x66u32.to_be_bytes());
        assert!(g.dispatch(PEER, &m).reply.is_none());
        let got = g.wait(w, Instant::now()).unwrap();
        assert_eq!((got.from, got.msg.tid), (PEER, 5));
        // One for no exchange gets a REJ, "invalid communication ID".
        m[28..32].copy_from_slice(&0x77u32.to_be_bytes());
        let Body::Rej(rej) = parse(&g.dispatch(PEER, &m).reply.unwrap()) else {
            panic!("a REJ")
        };
        assert_eq!(
            (
                rej.ids.local,
                rej.ids.remote,
                rej.message_rejected,
                rej.reason
            ),
            (0x77, 0xaa, 1, cm::REJ_INVALID_COMM_ID)
        );
        g.unregister(w);
        assert!(g.wait(w, Instant::now()).is_none());
        // A REQ repeated after its connection was made reaches no listener.
        let svc = Waiter::Service(cm::rdma_cm_service_id(7174));
        assert!(g.register(svc));
        let mut req = [0u8; MAD_LEN];
        cm::Req {
            local_comm_id: 0xaa,
            service_id: cm::rdma_cm_service_id(7174),
            local_ca_guid: 0,
            local_qpn: 0x22,
            responder_resources: 1,
            initiator_depth: 1,
            remote_cm_response_timeout: 20,
            transport: 0,
            starting_psn: 1,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xffff,
            path_mtu: 3,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            primary: cm::Path {
                local_gid: [0; 16],
                remote_gid: [0; 16],
                flow_label: 0,
                traffic_class: 0,
                hop_limit: 64,
                sl: 0,
                local_ack_timeout: 14,
            },
            private_data: [0; cm::REQ_PRIVATE_DATA_LEN],
        }
        .emit(9, &mut req);
        assert!(g.is_taken(PEER, 0xaa));
        assert!(g.dispatch(PEER, &req).reply.is_none());
        assert!(g.wait(svc, Instant::now()).is_none());
        // From another peer it is a new request.
        assert!(!g.is_taken(Ipv4Addr::new(10, 99, 0, 3), 0xaa));
        assert!(
            g.dispatch(Ipv4Addr::new(10, 99, 0, 3), &req)
                .reply
                .is_none()
        );
        assert!(g.wait(svc, Instant::now()).is_some());
        // Garbage is no message.
        let out = g.dispatch(PEER, &[0u8; MAD_LEN]);
        assert!(out.reply.is_none() && out.disconnected_qp.is_none());
    }

    fn sidr_req(request_id: u32, service_id: u64) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        cm::SidrReq {
            request_id,
            pkey: 0xffff,
            service_id,
            private_data: [0; cm::SIDR_REQ_PRIVATE_DATA_LEN],
        }
        .emit(3, &mut m);
        m
    }

    #[test]
    fn sidr_requests_are_queued_once_and_answered_again_when_repeated() {
        let g = Gsi::new(7);
        let (udp, tcp) = (
            cm::rdma_cm_udp_service_id(7174),
            cm::rdma_cm_service_id(7174),
        );
        let status = |out: Outcome| match out.reply.map(|r| parse(&r)) {
            Some(Body::SidrRep(r)) => Some(r.status),
            None => None,
            other => panic!("{other:?}"),
        };
        // Nothing listens: status 1; an RC listener's service: status 2,
        // as Linux's rdma_cm answers there.
        assert_eq!(
            status(g.dispatch(PEER, &sidr_req(1, udp))),
            Some(SIDR_UNSUPPORTED)
        );
        assert!(g.register(Waiter::Service(tcp)));
        assert_eq!(
            status(g.dispatch(PEER, &sidr_req(1, tcp))),
            Some(SIDR_REJECT)
        );
        let w = Waiter::Service(udp);
        assert!(g.register(w));
        let soon = Instant::now() + std::time::Duration::from_millis(10);
        // Queued once: a repeat while it waits is dropped.
        for _ in 0..2 {
            assert_eq!(status(g.dispatch(PEER, &sidr_req(1, udp))), None);
        }
        assert!(matches!(
            g.wait(w, soon).unwrap().msg.body,
            Body::SidrReq(_)
        ));
        assert!(g.wait(w, soon).is_none());
        // Answered: a repeat gets the same answer, and is not queued.
        let mut answer = [0u8; MAD_LEN];
        answer[0] = 9;
        g.sidr_answered((PEER, 1, udp), &answer);
        assert_eq!(g.dispatch(PEER, &sidr_req(1, udp)).reply, Some(answer));
        assert!(g.wait(w, soon).is_none());
        // The same ID from another peer is another request.
        let other = Ipv4Addr::new(10, 99, 0, 9);
        assert_eq!(status(g.dispatch(other, &sidr_req(1, udp))), None);
        assert_eq!(g.wait(w, soon).unwrap().from, other);
        // One taken and forgotten (its accept failed): a repeat is new.
        g.sidr_forget((other, 1, udp));
        assert_eq!(status(g.dispatch(other, &sidr_req(1, udp))), None);
        assert_eq!(g.wait(w, soon).unwrap().from, other);
        // A listener that goes takes its queued requests and its answers
        // along: a new one takes their repeats.
        assert_eq!(status(g.dispatch(PEER, &sidr_req(2, udp))), None);
        g.unregister(w);
        assert!(g.register(w));
        for id in [2, 1] {
            assert_eq!(status(g.dispatch(PEER, &sidr_req(id, udp))), None);
            assert!(g.wait(w, soon).is_some(), "{id}");
        }
        // An RC REQ for the UDP port space: with a UD listener there, the
        // REJ Linux's rdma_cm sends (consumer), else "invalid service ID".
        let mut req = [0u8; MAD_LEN];
        cm::Ids {
            local: 5,
            remote: 0,
        }
        .emit_as(cm::REP, 3, &mut req);
        req[16..18].copy_from_slice(&softrdma_wire::mad::CM_REQ.to_be_bytes());
        req[32..40].copy_from_slice(&udp.to_be_bytes());
        let rej = |g: &Gsi| match parse(&g.dispatch(PEER, &req).reply.unwrap()) {
            Body::Rej(r) => r.reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(rej(&g), cm::REJ_CONSUMER);
        g.unregister(w);
        assert_eq!(rej(&g), REJ_INVALID_SERVICE_ID);
    }

    #[test]
    fn a_flood_of_sidr_requests_is_bounded() {
        let g = Gsi::new(7);
        let udp = cm::rdma_cm_udp_service_id(7174);
        let w = Waiter::Service(udp);
        assert!(g.register(w));
        let answer = [1u8; MAD_LEN];
        for id in 0..1000 {
            g.dispatch(PEER, &sidr_req(id, udp));
            if id % 3 == 0 {
                g.sidr_answered((PEER, id, udp), &answer);
            }
        }
        let s = g.state.lock().unwrap();
        assert!(
            s.sidr_pending.len() <= QUEUE_MAX,
            "{}",
            s.sidr_pending.len()
        );
        assert_eq!(s.queues[&w].len(), QUEUE_MAX);
        assert_eq!(s.sidr_answers.len(), SIDR_ANSWERS_KEPT);
        // The oldest answers went first.
        assert_eq!(s.sidr_answers.front().unwrap().0.1, 999 - 3 * 63);
    }
}
