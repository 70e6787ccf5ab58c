//! perftest's out-of-band exchange: fixed-size messages, each a lock-step
//! swap (the client writes first, the server reads first), over TCP or, in
//! rdma_cm mode (`-R`), as SENDs on a control QP with binary key records;
//! see `../shared/TOOLS-PROTOCOLS.md` sections 2.1 and 2.4.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use softrdma::verbs::*;

/// The version perftest 4.5 reports (its package version); peers older than
/// 5.70 are refused, as perftest refuses them.
pub const VERSION: &str = "6.06";
const OLDEST_PEER: f64 = 5.70;
/// The largest page size a peer may announce (Linux pages go to 64 KiB; a
/// huge page as perftest's cycle buffer is allowed).
const MAX_CYCLE_BUFFER: u32 = 2 << 20;
/// A key message: `KEY_PRINT_FMT_GID` and its NUL.
pub const KEY_LEN: usize = 108;
/// A key record in rdma_cm mode: perftest's `struct pingpong_dest`.
pub const RECORD_LEN: usize = 56;

/// One side's QP, as a key message carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Key {
    pub lid: u16,
    pub out_reads: u16,
    pub qpn: u32,
    pub psn: u32,
    pub rkey: u32,
    pub vaddr: u64,
    pub gid: [u8; 16],
    pub srqn: u32,
}

impl Key {
    pub fn encode(&self) -> [u8; KEY_LEN] {
        let mut s = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        for b in self.gid {
            s.push_str(&format!("{b:02x}:"));
        }
        s.push_str(&format!("{:08x}:", self.srqn));
        let mut out = [0u8; KEY_LEN];
        out[..s.len()].copy_from_slice(s.as_bytes());
        out
    }

    pub fn parse(bytes: &[u8; KEY_LEN]) -> Result<Key, String> {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(KEY_LEN);
        let text = std::str::from_utf8(&bytes[..end]).map_err(|_| "a key message not in ASCII")?;
        let f: Vec<&str> = text.split(':').collect();
        if f.len() < 23 {
            return Err(format!("a key message with {} fields: {text:?}", f.len()));
        }
        let hex = |i: usize, max: u64| -> Result<u64, String> {
            u64::from_str_radix(f[i], 16)
                .ok()
                .filter(|&v| v <= max)
                .ok_or(format!("bad field {i} in key message {text:?}"))
        };
        let mut gid = [0u8; 16];
        for (k, g) in gid.iter_mut().enumerate() {
            *g = hex(6 + k, 0xff)? as u8;
        }
        Ok(Key {
            lid: hex(0, 0xffff)? as u16,
            out_reads: hex(1, 0xffff)? as u16,
            qpn: hex(2, 0xff_ffff)? as u32,
            psn: hex(3, 0xff_ffff)? as u32,
            rkey: hex(4, u64::from(u32::MAX))? as u32,
            vaddr: hex(5, u64::MAX)?,
            gid,
            srqn: hex(22, u64::from(u32::MAX))? as u32,
        })
    }
}

impl Key {
    /// The binary record (`struct pingpong_dest`, fields big-endian; the
    /// padding before `vaddr` and the GID index are zero).
    pub fn encode_record(&self) -> [u8; RECORD_LEN] {
        let mut r = [0u8; RECORD_LEN];
        let words = [
            u32::from(self.lid),
            u32::from(self.out_reads),
            self.qpn,
            self.psn,
            self.rkey,
        ];
        for (i, w) in words.iter().enumerate() {
            r[4 * i..4 * i + 4].copy_from_slice(&w.to_be_bytes());
        }
        r[24..32].copy_from_slice(&self.vaddr.to_be_bytes());
        r[32..48].copy_from_slice(&self.gid);
        r[48..52].copy_from_slice(&self.srqn.to_be_bytes());
        r
    }

    pub fn parse_record(r: &[u8; RECORD_LEN]) -> Key {
        let word = |i: usize| u32::from_be_bytes(r[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        Key {
            // perftest reads LID and OUT_READS as ints; they fit 16 bits.
            lid: word(0) as u16,
            out_reads: word(1) as u16,
            qpn: word(2),
            psn: word(3),
            rkey: word(4),
            vaddr: u64::from_be_bytes(r[24..32].try_into().expect("8 bytes")),
            gid: r[32..48].try_into().expect("16 bytes"),
            srqn: u32::from_be_bytes(r[48..52].try_into().expect("4 bytes")),
        }
    }
}

/// The bandwidth report a client sends after a BW test.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Report {
    pub size: u64,
    pub iters: u64,
    pub bw_peak: f64,
    pub bw_avg: f64,
    pub msg_rate: f64,
}

/// The connection the exchange runs on.
#[derive(Debug)]
pub struct Oob {
    link: Link,
    client: bool,
    /// Setup messages must come whole within [`SETUP_TIMEOUT`] each; the
    /// end-of-test barrier waits as long as the run takes.
    setup: bool,
    /// `--stats`: the close says how many probes the peer answered.
    report_probes: bool,
}

#[derive(Debug)]
enum Link {
    Tcp(TcpStream),
    Cm(Box<Control>),
}

/// rdma_cm mode's control QP (perftest's "comm" context): one message at a
/// time each way, at most [`CONTROL_MSG`] bytes (the peer posts receives of
/// a key record's size).
#[derive(Debug)]
pub struct Control {
    pub qp: Qp,
    mr: Mr,
    scq: Cq,
    rcq: Cq,
    _pd: Pd,
    /// RoCEv2: an untimed wait probes the peer (see [`PROBE_EVERY`]).
    /// iWARP's TCP connection has keepalives of its own.
    probes: bool,
    /// Probes the peer answered.
    answered: std::sync::atomic::AtomicU32,
}

const CONTROL_MSG: usize = 64;
/// How long each side of rdma_cm mode waits at the end for the peer to
/// disconnect (see `Oob::close`).
const CLIENT_LINGER: Duration = Duration::from_millis(300);
const SERVER_LINGER: Duration = Duration::from_secs(2);

/// This side's wait for the peer's disconnect: the client's the shorter, so
/// that two softrdma ends, both waiting, part after it.
fn cm_linger(client: bool) -> Duration {
    if client { CLIENT_LINGER } else { SERVER_LINGER }
}

/// Receives kept posted: one would do in lock step; two spare a race with a
/// repost.
const CONTROL_RECVS: usize = 2;
const SEND_AT: usize = CONTROL_RECVS * CONTROL_MSG;
/// An RC QP waiting for a receive cannot tell a busy peer from a dead host:
/// the end-of-test barrier sends a zero-length RDMA WRITE after this much
/// silence, which the peer's transport acknowledges (rxe and softrdma
/// check no key for it, C9-88; rdma_cm grants remote writes) and a vanished
/// host leaves to the transport's retries.
const PROBE_EVERY: Duration = Duration::from_secs(5);
const PROBE_ID: u64 = u64::MAX;

impl Control {
    /// A control QP on `ctx` (an iWARP or RoCEv2 device) with its receives
    /// posted, ready to be connected.
    pub fn new(ctx: &Context) -> Result<Control, String> {
        let e = |e: VerbsError| e.to_string();
        let pd = ctx.alloc_pd().map_err(e)?;
        let mr = pd
            .register(SEND_AT + CONTROL_MSG, Access::LOCAL_WRITE)
            .map_err(e)?;
        let scq = ctx.create_cq(4).map_err(e)?;
        let rcq = ctx.create_cq(2 * CONTROL_RECVS).map_err(e)?;
        let qp = pd
            .create_qp(&QpInit::rc(&scq, &rcq).caps(QpCaps {
                max_send_wr: 2,
                max_recv_wr: CONTROL_RECVS as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            }))
            .map_err(e)?;
        // softrdma's iWARP QPs take receives as they are; a device's in INIT.
        if !ctx.is_iwarp() || ctx.is_ibverbs() {
            super::to_init(&qp)?;
        }
        let c = Control {
            qp,
            mr,
            scq,
            rcq,
            _pd: pd,
            probes: !ctx.is_iwarp(),
            answered: 0.into(),
        };
        for slot in 0..CONTROL_RECVS {
            c.post_recv(slot)?;
        }
        Ok(c)
    }

    fn post_recv(&self, slot: usize) -> Result<(), String> {
        self.qp
            .post_recv(RecvWr::new(
                slot as u64,
                [self.mr.sge(slot * CONTROL_MSG, CONTROL_MSG as u32)],
            ))
            .map_err(|e| format!("out-of-band exchange: {e}"))
    }

    /// Posts `wr` and waits (at most 60 s, else the error `none`) for its
    /// completion: sends go one at a time, so the next completion is its.
    fn post_and_wait(&self, wr: SendWr, none: &str) -> io::Result<WorkCompletion> {
        let io = |e: String| io::Error::other(e);
        self.qp.post_send(wr).map_err(|e| io(e.to_string()))?;
        self.scq
            .wait(Duration::from_secs(60))
            .map_err(|e| io(e.to_string()))?
            .ok_or_else(|| io(none.into()))
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        let io = |e: String| io::Error::other(e);
        self.mr.write(SEND_AT, msg).map_err(|e| io(e.to_string()))?;
        let wr = SendWr::new(0, SendOp::Send, [self.mr.sge(SEND_AT, msg.len() as u32)]);
        let wc = self.post_and_wait(wr, "no send completion in 60 s")?;
        if wc.status != WcStatus::Success {
            return Err(io(format!("SEND on the control QP: {}", wc.status)));
        }
        Ok(())
    }

    /// A zero-length RDMA WRITE, waited for: an error if the peer's
    /// transport does not acknowledge it.
    fn probe(&self) -> io::Result<()> {
        let io = |e: String| io::Error::other(e);
        let zero_length = SendOp::Write {
            remote_addr: 0,
            rkey: 0,
        };
        let wc = self.post_and_wait(
            SendWr::new(PROBE_ID, zero_length, []),
            "no completion of a probe of the peer in 60 s",
        )?;
        match wc.status {
            WcStatus::Success => {
                self.answered
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            // The peer disconnected (its receive here flushes too).
            WcStatus::WrFlushErr => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the peer closed the control connection",
            )),
            WcStatus::RetryExcErr => Err(io(
                "the peer stopped answering on the control QP (transport retry counter \
                 exceeded): its host is gone or cut off"
                    .into(),
            )),
            s => Err(io(format!(
                "the peer refused a zero-length RDMA WRITE probing it on the control QP \
                 ({s}): its RDMA stack checks keys or rights even for no bytes"
            ))),
        }
    }

    /// Waits for the peer's next message, within `limit` if one is given,
    /// else as long as the connection lives (a lost connection flushes the
    /// receive; on RoCEv2 probes find a vanished host).
    fn recv(&self, out: &mut [u8], limit: Option<Duration>) -> io::Result<()> {
        let io = |e: String| io::Error::other(e);
        let wait = limit.unwrap_or(if self.probes {
            PROBE_EVERY
        } else {
            Duration::from_secs(3600)
        });
        let wc = loop {
            match self.rcq.wait(wait) {
                Ok(Some(wc)) => break wc,
                Ok(None) if limit.is_some() => return Err(io::ErrorKind::WouldBlock.into()),
                Ok(None) if self.probes => {
                    if let Err(e) = self.probe() {
                        // The peer's last message may have come before it
                        // went: that one still counts.
                        match self.rcq.poll_one() {
                            Ok(Some(wc)) if wc.status == WcStatus::Success => break wc,
                            _ => return Err(e),
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(io(e.to_string())),
            }
        };
        match wc.status {
            WcStatus::Success => {}
            WcStatus::WrFlushErr => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the peer closed the control connection",
                ));
            }
            s => return Err(io(format!("receive on the control QP: {s}"))),
        }
        if (wc.byte_len as usize) < out.len() {
            return Err(io(format!(
                "a {}-byte message where {} were expected",
                wc.byte_len,
                out.len()
            )));
        }
        let slot = wc.wr_id as usize;
        self.mr
            .read(slot * CONTROL_MSG, out)
            .map_err(|e| io(e.to_string()))?;
        // After the last message the peer may be gone already, and the QP
        // with it: a receive that cannot be posted shows at the next
        // exchange, if there is one.
        let _ = self.post_recv(slot);
        Ok(())
    }
}

/// How long a setup message may take to come: a peer that connects and
/// then says nothing (another tool on the port, a stuck peer) is an error,
/// not a hang. The end-of-test barrier waits as long as the run takes.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// TCP keepalive on the exchange's stream, which waits untimed for the
/// peer's end of the run: a peer host that vanishes without a FIN or RST
/// (powered off, cut off) fails the read after about 30 s of silence
/// instead of leaving this side waiting for good. The kernel answers the
/// probes of a live peer, however long its run. Probes wait while a message
/// sent is unacknowledged: the user timeout covers that case.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_PROBES: u32 = 3;
const USER_TIMEOUT: Duration = Duration::from_secs(30);

fn ctx(what: &'static str) -> impl Fn(io::Error) -> String {
    move |e| match e.kind() {
        // The keepalive's or the user timeout's end (ETIMEDOUT).
        io::ErrorKind::TimedOut => format!(
            "out-of-band exchange ({what}): the peer stopped answering for about {} s \
             (its host is gone or cut off)",
            USER_TIMEOUT.as_secs()
        ),
        io::ErrorKind::WouldBlock => format!(
            "out-of-band exchange ({what}): no whole message from the peer in {} s (is it \
             running a matching test?)",
            SETUP_TIMEOUT.as_secs()
        ),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => format!(
            "out-of-band exchange ({what}): the peer closed the connection (it ended or \
             failed: its output says why)"
        ),
        _ => format!("out-of-band exchange ({what}): {e}"),
    }
}

impl Oob {
    pub fn new(stream: TcpStream, client: bool) -> Oob {
        let _ = stream.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES);
        // Without them the run goes on as perftest's does.
        let sock = socket2::SockRef::from(&stream);
        let _ = sock.set_tcp_keepalive(&keepalive);
        let _ = sock.set_tcp_user_timeout(Some(USER_TIMEOUT));
        let _ = stream.set_read_timeout(Some(SETUP_TIMEOUT));
        let _ = stream.set_write_timeout(Some(SETUP_TIMEOUT));
        Oob {
            link: Link::Tcp(stream),
            client,
            setup: true,
            report_probes: false,
        }
    }

    /// rdma_cm mode: the exchange runs on a connected control QP.
    pub fn control(control: Control, client: bool) -> Oob {
        Oob {
            link: Link::Cm(Box::new(control)),
            client,
            setup: true,
            report_probes: false,
        }
    }

    /// `--stats`: [`Oob::close`] reports the control QP's probes.
    pub fn report_probes(mut self, on: bool) -> Oob {
        self.report_probes = on;
        self
    }

    /// One lock-step swap of `mine` for as many bytes of the peer's.
    fn xchg(&mut self, mine: &[u8], theirs: &mut [u8]) -> io::Result<()> {
        let limit = self.setup.then_some(SETUP_TIMEOUT);
        match &mut self.link {
            // perftest reads each message with one read(): one write each.
            Link::Tcp(stream) if self.client => {
                stream.write_all(mine)?;
                crate::exchange::read_whole(stream, theirs, limit)
            }
            Link::Tcp(stream) => {
                crate::exchange::read_whole(stream, theirs, limit)?;
                stream.write_all(mine)
            }
            Link::Cm(c) if self.client => {
                c.send(mine)?;
                c.recv(theirs, limit)
            }
            Link::Cm(c) => {
                c.recv(theirs, limit)?;
                c.send(mine)
            }
        }
    }

    /// The handshakes before traffic are done: from here the peer may take
    /// as long as its run does.
    pub fn setup_done(&mut self) {
        self.setup = false;
        if let Link::Tcp(stream) = &self.link {
            let _ = stream.set_read_timeout(None);
        }
    }

    /// A key handshake that must bring the same message as `before`: perftest
    /// sends each QP's message unchanged every time (`rxe_*.pcap`), so another
    /// one means the two sides run different tests or numbers of QPs.
    pub fn key_again(&mut self, mine: &Key, before: &Key) -> Result<(), String> {
        let theirs = self.key(mine)?;
        if theirs != *before {
            return Err(format!(
                "out-of-band exchange: the peer's message (QP 0x{:06x}) is not the one it \
                 sent before (QP 0x{:06x}): do both sides run the same test with the same -q?",
                theirs.qpn, before.qpn
            ));
        }
        Ok(())
    }

    /// Version, page ("cycle buffer") size, cache line size and MTU: returns
    /// the cycle buffer, the cache line and the MTU enum both use.
    pub fn preamble(
        &mut self,
        cycle: u32,
        cache_line: u32,
        mtu: u8,
    ) -> Result<(u32, u32, u8), String> {
        let mut v = [0u8; 16];
        v[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
        let mut rv = [0u8; 16];
        self.xchg(&v, &mut rv).map_err(ctx("version"))?;
        if rv.starts_with(b"MPA ID Req Frame") {
            return Err(
                "the peer opened an iWARP (MPA) connection: it runs with -R, so run this \
                 side with -R too"
                    .into(),
            );
        }
        let end = rv.iter().position(|&b| b == 0).unwrap_or(16);
        let remote = String::from_utf8_lossy(&rv[..end]).to_string();
        let num: f64 = remote
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.0);
        if num < OLDEST_PEER {
            return Err(format!(
                "the peer's perftest version {remote:?} is older than {OLDEST_PEER} \
                 (perftest refuses it too)"
            ));
        }
        let mut r4 = [0u8; 4];
        self.xchg(&cycle.to_be_bytes(), &mut r4)
            .map_err(ctx("cycle buffer"))?;
        let cycle = cycle.max(u32::from_be_bytes(r4));
        self.xchg(&cache_line.to_be_bytes(), &mut r4)
            .map_err(ctx("cache line"))?;
        let cache_line = cache_line.max(u32::from_be_bytes(r4));
        // Page and cache-line sizes, as perftest sends them: the buffers are
        // sized and strided by them, so a peer's absurd ones are refused.
        if cycle > MAX_CYCLE_BUFFER || cache_line == 0 || cache_line > cycle {
            return Err(format!(
                "the peer's cycle buffer ({cycle}) or cache line ({cache_line}) is out of \
                 range (a cache line of at most the cycle buffer, which is at most {MAX_CYCLE_BUFFER})"
            ));
        }
        let mut m = [0u8; 2];
        m[0] = b'0' + mtu;
        let mut rm = [0u8; 2];
        self.xchg(&m, &mut rm).map_err(ctx("MTU"))?;
        let remote_mtu = rm[0].wrapping_sub(b'0');
        let mtu = if (1..=5).contains(&remote_mtu) {
            mtu.min(remote_mtu)
        } else {
            mtu
        };
        Ok((cycle, cache_line, mtu))
    }

    /// A key handshake: sends `mine`, returns the peer's.
    pub fn key(&mut self, mine: &Key) -> Result<Key, String> {
        if matches!(self.link, Link::Cm(_)) {
            let mut theirs = [0u8; RECORD_LEN];
            self.xchg(&mine.encode_record(), &mut theirs)
                .map_err(ctx("key record"))?;
            return Ok(Key::parse_record(&theirs));
        }
        let mut theirs = [0u8; KEY_LEN];
        self.xchg(&mine.encode(), &mut theirs)
            .map_err(ctx("key message"))?;
        Key::parse(&theirs)
    }

    /// The bandwidth report exchange: five 8-byte big-endian values.
    pub fn report(&mut self, mine: &Report) -> Result<Report, String> {
        let mut vals = [0u64; 5];
        let out = [
            mine.size,
            mine.iters,
            mine.bw_peak.to_bits(),
            mine.bw_avg.to_bits(),
            mine.msg_rate.to_bits(),
        ];
        for (o, v) in out.iter().zip(vals.iter_mut()) {
            let mut b = [0u8; 8];
            self.xchg(&o.to_be_bytes(), &mut b).map_err(ctx("report"))?;
            *v = u64::from_be_bytes(b);
        }
        Ok(Report {
            size: vals[0],
            iters: vals[1],
            bw_peak: f64::from_bits(vals[2]),
            bw_avg: f64::from_bits(vals[3]),
            msg_rate: f64::from_bits(vals[4]),
        })
    }

    /// Waits (at most `limit`) for the peer to close the connection: for
    /// write-lat, which ends without a closing exchange, so that this side's
    /// QP stays up to acknowledge the peer's last WRITE (over RoCE).
    pub fn linger(self, limit: Duration) {
        match self.link {
            Link::Tcp(mut stream) => {
                // Half-close first: a softrdma peer lingering too sees the end.
                let _ = stream.shutdown(std::net::Shutdown::Write);
                // The limit is the whole wait's: a peer that keeps sending
                // a byte now and then does not hold this side open.
                let give_up = std::time::Instant::now() + limit;
                let mut buf = [0u8; 64];
                loop {
                    let left = give_up.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
                        break;
                    }
                    if !matches!(stream.read(&mut buf), Ok(n) if n > 0) {
                        break;
                    }
                }
            }
            // siw fails a WRITE still in its transmit path with
            // LOC_QP_OP_ERR when the connection goes, and either side's
            // last WRITE may be there when the other is done: the server's
            // (seen once in 130 runs) and the client's (its 100th, seen once
            // in CI, when our server still left at once). So each
            // side waits for the peer to disconnect, which flushes the
            // receive posted here, as in `close`, and with its limits.
            Link::Cm(c) => {
                let _ = c.rcq.wait(limit.min(cm_linger(self.client)));
            }
        }
    }

    /// perftest's close: a last key handshake, then (on TCP) "done", which
    /// nobody reads: the peer may already have closed, so errors after the
    /// handshake are not failures. rdma_cm mode disconnects once the peer
    /// has (or after a bounded wait).
    pub fn close(mut self, mine: &Key) -> Result<(), String> {
        self.key(mine)?;
        if let (true, Link::Cm(c)) = (self.report_probes, &self.link)
            && c.probes
        {
            let n = c.answered.load(std::sync::atomic::Ordering::Relaxed);
            outln!(" Control QP probes: {n} zero-length RDMA WRITEs, each answered");
        }
        match &mut self.link {
            Link::Tcp(stream) => {
                let _ = stream.write_all(b"done\0");
            }
            // siw completes a SEND after its data has left, and fails it
            // with LOC_QP_OP_ERR if the connection goes in between: the
            // peer's last SEND may have reached this side and still be
            // failing there (seen once in ~130 runs for each role). So each
            // side waits for the peer to disconnect, which flushes the
            // receive posted here; a siw peer disconnects once its SEND has
            // completed.
            Link::Cm(c) => {
                let _ = c.rcq.wait(cm_linger(self.client));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_message_is_perftests() {
        // rxe_write_bw.pcap frame 17.
        let text = "0000:0001:000011:037d1a:000002ab:00007f8ba99f4000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:00:03:00000000:";
        let mut bytes = [0u8; KEY_LEN];
        bytes[..text.len()].copy_from_slice(text.as_bytes());
        assert_eq!(text.len() + 1, KEY_LEN);
        let k = Key::parse(&bytes).unwrap();
        assert_eq!(
            k,
            Key {
                lid: 0,
                out_reads: 1,
                qpn: 0x11,
                psn: 0x037d1a,
                rkey: 0x2ab,
                vaddr: 0x7f8b_a99f_4000,
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 3],
                srqn: 0,
            }
        );
        assert_eq!(k.encode(), bytes);
    }

    #[test]
    fn key_record_is_perftests() {
        // siw_write_bw.pcap frame 32, after the 20-byte MPA/DDP/RDMAP header.
        let mut r = [0u8; RECORD_LEN];
        r[4..8].copy_from_slice(&1u32.to_be_bytes());
        r[8..12].copy_from_slice(&2u32.to_be_bytes());
        r[12..16].copy_from_slice(&0x00d6_53e8u32.to_be_bytes());
        r[16..20].copy_from_slice(&0xba2e_d400u32.to_be_bytes());
        r[24..32].copy_from_slice(&0x0000_7f02_a2a2_8000u64.to_be_bytes());
        r[32..38].copy_from_slice(&[0x52, 0x54, 0x0a, 0x63, 0x00, 0x03]);
        let k = Key::parse_record(&r);
        assert_eq!(
            (k.out_reads, k.qpn, k.psn, k.rkey, k.vaddr),
            (1, 2, 0x00d6_53e8, 0xba2e_d400, 0x7f02_a2a2_8000)
        );
        assert_eq!(k.gid[..6], [0x52, 0x54, 0x0a, 0x63, 0x00, 0x03]);
        assert_eq!(k.encode_record(), r);
    }

    /// A peer announcing a page or cache-line size the buffers can't be
    /// laid out by is refused with an error, not a panic or a huge buffer.
    #[test]
    fn absurd_peer_buffer_sizes_are_refused() {
        for (cycle, line) in [(4096u32, 4097u32), (4096, 8192), (u32::MAX, 64)] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let peer = std::thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                let mut buf = [0u8; 16];
                s.read_exact(&mut buf).unwrap();
                let mut v = [0u8; 16];
                v[..4].copy_from_slice(b"6.06");
                s.write_all(&v).unwrap();
                let mut r4 = [0u8; 4];
                s.read_exact(&mut r4).unwrap();
                s.write_all(&cycle.to_be_bytes()).unwrap();
                s.read_exact(&mut r4).unwrap();
                s.write_all(&line.to_be_bytes()).unwrap();
            });
            let mut oob = Oob::new(TcpStream::connect(addr).unwrap(), true);
            let err = oob.preamble(4096, 64, 3).unwrap_err();
            assert!(err.contains("out of range"), "{cycle}/{line}: {err}");
            peer.join().unwrap();
        }
    }

    #[test]
    fn the_exchange_stream_probes_a_silent_peer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let oob = Oob::new(TcpStream::connect(addr).unwrap(), true);
        let Link::Tcp(stream) = &oob.link else {
            panic!("a TCP exchange")
        };
        let s = socket2::SockRef::from(stream);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(s.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(s.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
        assert_eq!(s.tcp_user_timeout().unwrap(), Some(USER_TIMEOUT));
    }

    #[test]
    fn bad_key_messages_are_errors() {
        for text in [
            "",
            "0000:0001",
            "zzzz:0001:000011:037d1a:000002ab:00007f8ba99f4000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:00:03:00000000:",
        ] {
            let mut bytes = [0u8; KEY_LEN];
            bytes[..text.len()].copy_from_slice(text.as_bytes());
            assert!(Key::parse(&bytes).is_err(), "{text}");
        }
        assert!(Key::parse(&[0xff; KEY_LEN]).is_err());
    }
}
