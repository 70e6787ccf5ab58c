//! `softrdma ping`: the ping-pong of rdma-core's `ibv_rc_pingpong` and
//! `ibv_ud_pingpong`, with their out-of-band exchange (TCP 18515, the
//! 52-byte "LID:QPN:PSN:GID" message, then "done") and their traffic.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use softrdma::verbs::*;

use crate::exchange::read_whole;

/// Options, spelled as the rdma-core tools spell them.
#[derive(Debug, Clone, clap::Args)]
pub struct PingArgs {
    /// The server to connect to; without it, be the server.
    pub host: Option<String>,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18515,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// Message size in bytes (default 4096, or 2048 with --ud).
    #[arg(short = 's', long)]
    pub size: Option<usize>,
    /// Iterations (each is one message each way).
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub iters: u64,
    /// Path MTU (256, 512, 1024, 2048 or 4096; RC only).
    #[arg(short = 'm', long, default_value_t = 1024)]
    pub mtu: usize,
    /// Receives posted at a time.
    #[arg(short = 'r', long, default_value_t = 500)]
    pub rx_depth: u32,
    /// Device (see `softrdma devices`; default: a client's route to the
    /// server, a server's first non-loopback device, or --bind).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    pub dev: Option<String>,
    /// Local GID index: 1 is the IPv4 GID, as on rxe (0 is IPv6 link-local).
    #[arg(short = 'g', long, default_value_t = 1)]
    pub gid_idx: usize,
    /// Service level (carried for compatibility; RoCEv2 has no SL on the wire).
    #[arg(short = 'l', long, default_value_t = 0)]
    pub sl: u8,
    /// Sleep on completion events instead of polling.
    #[arg(short = 'e', long)]
    pub events: bool,
    /// Validate the received buffer (as the rdma-core tools do: byte 0 of each page).
    #[arg(short = 'c', long)]
    pub chk: bool,
    /// Unreliable datagram (as ibv_ud_pingpong) instead of RC.
    #[arg(long)]
    pub ud: bool,
    /// Local IPv4 address of the device (default: the address the TCP
    /// connection uses; a server listens there, or on all addresses without it).
    #[arg(long)]
    pub bind: Option<Ipv4Addr>,
    /// UDP port of both devices (RoCEv2: 4791).
    #[arg(long, default_value_t = 4791,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub udp_port: u16,
    /// Share the device's address with other processes through
    /// `softrdma hostd` (started if none runs) instead of binding it alone.
    #[arg(long)]
    pub shared_port: bool,
    /// Write what this side sends and receives to a pcap file.
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<std::path::PathBuf>,
    /// The provider: roce (softrdma's RoCEv2 over UDP, default) or ibverbs
    /// (the libibverbs device -d names: a RoCE NIC, or the kernel's rxe).
    #[arg(long, value_enum, default_value_t = PingProvider::Roce)]
    pub provider: PingProvider,
}

/// `--provider`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PingProvider {
    Roce,
    Ibverbs,
}

/// How long a ping waits for its next completion before giving up.
const COMPLETION_WAIT: Duration = Duration::from_secs(30);

/// How long each message of the out-of-band exchange may take to come.
const EXCHANGE_WAIT: Duration = Duration::from_secs(60);
const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
const UD_QKEY: u32 = 0x1111_1111;
const GRH: usize = 40;
const MSG_LEN: usize = 52;

/// The peer's (or our) address as the tools print and send it.
#[derive(Debug, Clone, Copy)]
struct Dest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
}

impl Dest {
    fn message(&self) -> [u8; MSG_LEN] {
        let gid: String = self.gid.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!("{:04x}:{:06x}:{:06x}:{gid}", self.lid, self.qpn, self.psn);
        let mut m = [0u8; MSG_LEN];
        m[..text.len()].copy_from_slice(text.as_bytes());
        m
    }

    fn parse(m: &[u8]) -> Result<Dest, String> {
        let text = m.split(|&b| b == 0).next().unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| "the peer's address is not text")?;
        let mut f = text.split(':');
        let mut hex = |what: &str, max: u32| -> Result<u32, String> {
            let v = f.next().ok_or(format!("no {what} in {text:?}"))?;
            u32::from_str_radix(v, 16)
                .ok()
                .filter(|&x| x <= max)
                .ok_or(format!("bad {what} {v:?} in {text:?}"))
        };
        let lid = hex("LID", 0xffff)? as u16;
        let qpn = hex("QPN", 0xff_ffff)?;
        let psn = hex("PSN", 0xff_ffff)?;
        let g = f.next().ok_or(format!("no GID in {text:?}"))?;
        // Hex digits only: byte-indexing a string with multi-byte
        // characters in it would panic.
        if g.len() != 32 || !g.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("bad GID {g:?}"));
        }
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&g[2 * i..2 * i + 2], 16)
                .map_err(|_| format!("bad GID {g:?}"))?;
        }
        Ok(Dest { lid, qpn, psn, gid })
    }

    fn ipv4(&self) -> Result<Ipv4Addr, String> {
        softrdma::wire::grh::ipv4_of_mapped(&self.gid)
            .map(Ipv4Addr::from)
            .ok_or_else(|| "the peer's GID is not an IPv4-mapped (RoCEv2/IPv4) address".into())
    }

    fn print(&self, which: &str, ud: bool) {
        let gid = std::net::Ipv6Addr::from(self.gid);
        let sep = if ud && which == "local" { ":" } else { "," };
        let head = if which == "local" {
            "local address: "
        } else {
            "remote address:"
        };
        outln!(
            "  {head} LID {:#06x}, QPN {:#08x}, PSN {:#08x}{sep} GID {gid}",
            self.lid,
            self.qpn,
            self.psn
        );
    }
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("softrdma ping: {msg}");
    ExitCode::FAILURE
}

/// Runs the ping-pong; exit status as the tools'.
pub fn run(a: &PingArgs) -> ExitCode {
    match run_inner(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn run_inner(a: &PingArgs) -> Result<(), String> {
    let size = a.size.unwrap_or(if a.ud { 2048 } else { 4096 });
    // As perf's -s: a message's length must fit a work request's.
    if size > i32::MAX as usize {
        return Err(format!("-s {size}: a message is at most 2147483647 bytes"));
    }
    let mtu = Mtu::from_bytes(a.mtu).ok_or(format!(
        "-m {}: the MTU must be 256, 512, 1024, 2048 or 4096",
        a.mtu
    ))?;
    if a.rx_depth == 0 || a.iters == 0 {
        return Err("-r and -n must be at least 1".into());
    }
    let peer_ip = match &a.host {
        Some(h) => Some(resolve_v4(h, a.port)?),
        None => None,
    };
    let ibverbs = a.provider == PingProvider::Ibverbs;
    if ibverbs {
        if a.dev.is_none() {
            return Err("--provider ibverbs needs -d, a libibverbs device (rxe0, mlx5_0)".into());
        }
        if a.shared_port || a.pcap.is_some() {
            return Err(
                "--shared-port and --pcap are for softrdma's RoCEv2 device, not --provider ibverbs"
                    .into(),
            );
        }
    }
    let chosen = if ibverbs {
        crate::device::Chosen::named(a.dev.as_deref().unwrap_or_default())
    } else {
        crate::device::choose(a.dev.as_deref(), a.gid_idx, a.bind, peer_ip)?
    };
    // A libibverbs device is opened before the exchange, so that a wrong
    // name fails at once (softrdma's own are checked by `choose`).
    let hw_ctx = match ibverbs {
        true => {
            let ctx = Device::ibverbs(a.dev.as_deref().unwrap_or_default())
                .open()
                .map_err(|e| e.to_string())?;
            crate::device::check_ibverbs_gid(
                "-g",
                a.gid_idx,
                chosen.name.as_deref().unwrap_or_default(),
                ctx.query_port().gids.len(),
            )?;
            Some(ctx)
        }
        false => None,
    };
    let mut tcp = match peer_ip {
        Some(ip) => TcpStream::connect((ip, a.port)).map_err(|e| {
            format!(
                "couldn't connect to {}:{}: {e}",
                a.host.as_deref().unwrap_or_default(),
                a.port
            )
        })?,
        None => {
            let at = a.bind.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V4);
            let l = TcpListener::bind((at, a.port))
                .map_err(|e| format!("couldn't listen on port {}: {e}", a.port))?;
            l.accept().map_err(|e| format!("accept: {e}"))?.0
        }
    };
    let ctx = match hw_ctx {
        Some(ctx) => ctx,
        None => {
            let mut dev = chosen.device(a.udp_port);
            if a.shared_port {
                dev = dev.shared_port(true);
            }
            if let Some(p) = &a.pcap {
                dev = dev.pcap(p);
            }
            dev.open().map_err(|e| e.to_string())?
        }
    };
    let port = ctx.query_port();
    let gid = *port.gids.get(a.gid_idx).ok_or(format!(
        "-g {}: no such GID index (the table has {})",
        a.gid_idx,
        port.gids.len()
    ))?;
    if a.ud && size > port.active_mtu.bytes() {
        return Err("Requested size larger than port MTU".into());
    }
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let buf_len = size + if a.ud { GRH } else { 0 };
    let mr = pd
        .register(buf_len.max(1), Access::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    // The tools fill their buffer with 0x7b; -c clients write 0 at the first
    // payload byte of each page (after the GRH area for UD), servers check it.
    let base = if a.ud { GRH } else { 0 };
    let mut fill = vec![0x7bu8; buf_len];
    if a.chk && a.host.is_some() {
        for p in (0..size).step_by(4096) {
            fill[base + p] = 0;
        }
    }
    mr.write(0, &fill).map_err(|e| e.to_string())?;
    let cq = ctx
        .create_cq(a.rx_depth as usize + 1)
        .map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: a.rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let init = if a.ud {
        QpInit::ud(&cq, &cq)
    } else {
        QpInit::rc(&cq, &cq)
    }
    .caps(caps);
    let qp = pd.create_qp(&init).map_err(|e| e.to_string())?;
    let e = |e: VerbsError| e.to_string();
    let init_attr = QpAttr {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(1),
        access: (!a.ud).then_some(Access::NONE),
        qkey: a.ud.then_some(UD_QKEY),
        ..QpAttr::default()
    };
    qp.modify(&init_attr, None).map_err(e)?;
    let recv_wr = || RecvWr::new(RECV_WRID, [mr.sge(0, buf_len as u32)]);
    let mut routs = 0;
    for _ in 0..a.rx_depth {
        qp.post_recv(recv_wr()).map_err(e)?;
        routs += 1;
    }
    let psn = getrandom::u32().map_err(|e| e.to_string())? & 0xff_ffff;
    let me = Dest {
        lid: 0,
        qpn: qp.qpn(),
        psn,
        gid,
    };
    // A peer that connects and says nothing is an error, not a hang.
    tcp.set_read_timeout(Some(EXCHANGE_WAIT))
        .and_then(|()| tcp.set_write_timeout(Some(EXCHANGE_WAIT)))
        .map_err(|e| format!("out-of-band exchange: {e}"))?;
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
            "out-of-band exchange: no whole message from the peer in {} s (is it a pingpong peer?)",
            EXCHANGE_WAIT.as_secs()
        ),
        _ => format!("out-of-band exchange: {e}"),
    };
    let mut buf = [0u8; MSG_LEN];
    let connect = |rem: &Dest| -> Result<Option<Ah>, String> {
        let peer = SocketAddrV4::new(rem.ipv4()?, a.udp_port);
        if a.ud {
            qp.modify(
                &QpAttr {
                    state: Some(QpState::Rtr),
                    ..QpAttr::default()
                },
                None,
            )
            .map_err(e)?;
            qp.modify(
                &QpAttr {
                    state: Some(QpState::Rts),
                    sq_psn: Some(me.psn),
                    ..QpAttr::default()
                },
                None,
            )
            .map_err(e)?;
            return Ok(Some(pd.create_ah(AhAttr { addr: peer }).map_err(e)?));
        }
        let rtr = QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(mtu),
            dest_qp: Some(rem.qpn),
            rq_psn: Some(rem.psn),
            max_dest_rd_atomic: Some(1),
            min_rnr_timer: Some(12),
            ..QpAttr::default()
        };
        qp.modify(&rtr, Some(AddressVector { addr: peer }))
            .map_err(e)?;
        let rts = QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(me.psn),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(1),
            ..QpAttr::default()
        };
        qp.modify(&rts, None).map_err(e)?;
        Ok(None)
    };
    let (rem, ah) = if a.host.is_some() {
        tcp.write_all(&me.message()).map_err(io)?;
        read_whole(&mut tcp, &mut buf, Some(EXCHANGE_WAIT)).map_err(io)?;
        let rem = Dest::parse(&buf)?;
        let ah = connect(&rem)?;
        tcp.write_all(b"done\0").map_err(io)?;
        (rem, ah)
    } else {
        read_whole(&mut tcp, &mut buf, Some(EXCHANGE_WAIT)).map_err(io)?;
        let rem = Dest::parse(&buf)?;
        let ah = connect(&rem)?;
        tcp.write_all(&me.message()).map_err(io)?;
        let mut done = [0u8; 5];
        read_whole(&mut tcp, &mut done, Some(EXCHANGE_WAIT)).map_err(io)?;
        (rem, ah)
    };
    me.print("local", a.ud);
    rem.print("remote", a.ud);
    let send = || -> Result<(), String> {
        let sgl = if a.ud {
            vec![mr.sge(GRH, size as u32)]
        } else {
            vec![mr.sge(0, size as u32)]
        };
        let mut wr = SendWr::new(SEND_WRID, SendOp::Send, sgl);
        if let Some(ah) = &ah {
            wr = wr.to(ah.dest(rem.qpn, UD_QKEY));
        }
        qp.post_send(wr).map_err(e)
    };
    if a.events {
        cq.req_notify(false);
    }
    let start = Instant::now();
    let mut pending = RECV_WRID;
    if a.host.is_some() {
        send()?;
        pending |= SEND_WRID;
    }
    let (mut rcnt, mut scnt) = (0u64, 0u64);
    while rcnt < a.iters || scnt < a.iters {
        let wc = if a.events {
            match cq.poll_one().map_err(|e| e.to_string())? {
                Some(wc) => wc,
                None => {
                    if !cq.wait_event(COMPLETION_WAIT) {
                        return Err(format!(
                            "no completion event in {} s (the QP is in {}; {scnt} sends and {rcnt} receives done)",
                            COMPLETION_WAIT.as_secs(),
                            qp.state()
                        ));
                    }
                    cq.req_notify(false);
                    continue;
                }
            }
        } else {
            cq.wait(COMPLETION_WAIT)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| {
                    format!(
                        "no completion in {} s (the QP is in {})",
                        COMPLETION_WAIT.as_secs(),
                        qp.state()
                    )
                })?
        };
        if wc.status != WcStatus::Success {
            return Err(format!(
                "Failed status {} ({}) for wr_id {}",
                wc.status, wc.status as u32, wc.wr_id
            ));
        }
        match wc.wr_id {
            SEND_WRID => scnt += 1,
            RECV_WRID => {
                routs -= 1;
                if routs <= 1 {
                    while routs < a.rx_depth {
                        qp.post_recv(recv_wr()).map_err(e)?;
                        routs += 1;
                    }
                }
                rcnt += 1;
            }
            other => return Err(format!("Completion for unknown wr_id {other}")),
        }
        pending &= !wc.wr_id;
        if scnt < a.iters && pending == 0 {
            send()?;
            pending = RECV_WRID | SEND_WRID;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = size as u64 * a.iters * 2;
    outln!(
        "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as f64 * 8.0 / secs / 1e6
    );
    outln!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        a.iters,
        secs * 1e6 / a.iters as f64
    );
    if a.chk && a.host.is_none() {
        let data = mr.read_vec(0, buf_len).map_err(|e| e.to_string())?;
        for (page, p) in (0..size).step_by(4096).enumerate() {
            if data[base + p] != 0 {
                outln!("invalid data in page {page}");
            }
        }
    }
    Ok(())
}

/// The IPv4 address of `host` (a name or an address).
pub fn resolve_v4(host: &str, port: u16) -> Result<Ipv4Addr, String> {
    use std::net::ToSocketAddrs;
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{host}: {e}"))?
        .find_map(|a| match a.ip() {
            IpAddr::V4(v) => Some(v),
            IpAddr::V6(_) => None,
        })
        .ok_or(format!("{host}: no IPv4 address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_bad_ones_are_errors() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0x123456,
            gid: [0xfe; 16],
        };
        let back = Dest::parse(&d.message()).unwrap();
        assert_eq!((back.qpn, back.psn, back.gid), (0x11, 0x123456, [0xfe; 16]));
        // 32 bytes of GID with a two-byte character in it: refused, where
        // slicing it by bytes would panic.
        let mut m = b"0000:000000:000000:a\xc3\xa9".to_vec();
        m.extend_from_slice(&[b'0'; 29]);
        m.push(0);
        assert!(Dest::parse(&m).unwrap_err().contains("bad GID"));
        assert!(Dest::parse(b"0000:000000:000000:zz\0").is_err());
    }
}
