//! `softrdma rping`: rdma-core's `rping` over iWARP, or over RoCEv2 with
//! `--roce` (its flags, its connection parameters and its per-iteration
//! exchange), so that either side can be softrdma and the other `rping` on
//! Linux siw or rxe.
//!
//! Per iteration: the client SENDs the address/rkey/size of its start
//! buffer; the server RDMA READs it, SENDs "go ahead"; the client SENDs the
//! address of its rdma buffer; the server RDMA WRITEs the data there and
//! SENDs "go ahead"; the client validates (-V) and prints (-v).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::ExitCode;
use std::time::Duration;

use softrdma::cm::RcOptions;
use softrdma::cm::iwarp::{self, Listener};
use softrdma::cm::mpa::{CrcPolicy, Decision, MpaConfig};
use softrdma::cm::roce;
use softrdma::verbs::*;

/// Options, spelled as rping spells them.
#[derive(Debug, Clone, clap::Args)]
pub struct RpingArgs {
    /// Be the server.
    #[arg(
        short = 's',
        conflicts_with = "client",
        required_unless_present = "client"
    )]
    pub server: bool,
    /// Be the client.
    #[arg(short = 'c')]
    pub client: bool,
    /// Server: the address to listen on; client: the server's address.
    #[arg(short = 'a', value_name = "ADDR")]
    pub addr: Ipv4Addr,
    /// Client: the source address (default: the route to the server).
    #[arg(short = 'I', value_name = "ADDR")]
    pub source: Option<Ipv4Addr>,
    /// Port (rdma_cm's TCP port space).
    #[arg(short = 'p', default_value_t = 7174,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// Iterations (0: until interrupted).
    #[arg(short = 'C', default_value_t = 0)]
    pub count: u64,
    /// Ping data size.
    #[arg(short = 'S', default_value_t = 64)]
    pub size: usize,
    /// Print the ping data.
    #[arg(short = 'v')]
    pub verbose: bool,
    /// Validate the ping data.
    #[arg(short = 'V')]
    pub validate: bool,
    /// Debug prints.
    #[arg(short = 'd')]
    pub debug: bool,
    /// Server: serve connections one after another until interrupted.
    #[arg(short = 'P')]
    pub persistent: bool,
    /// IP type of service of the connection (decimal or 0x hex).
    #[arg(short = 't', value_name = "TOS", value_parser = parse_tos)]
    pub tos: Option<u8>,
    /// Self-created QP (rping creates its QP itself instead of through
    /// rdma_cm; so does this one always: accepted, no effect on the wire).
    #[arg(short = 'q')]
    pub self_created_qp: bool,
    /// Ask for MPA CRC32c (ours; a peer that asks for it gets it anyway).
    #[arg(long, conflicts_with = "roce")]
    pub crc: bool,
    /// Over RoCEv2 (softrdma's device at ADDR, UDP port 4791, and the IB
    /// connection manager) instead of iWARP.
    #[arg(long)]
    pub roce: bool,
    /// On this libibverbs device (siw0, rxe0, an RDMA NIC) instead of
    /// softrdma's own, connecting through the kernel's rdma_cm (librdmacm):
    /// iWARP or RoCE as the device is.
    #[arg(long, value_name = "DEV", conflicts_with_all = ["roce", "crc"])]
    pub ibverbs: Option<String>,
    /// Fault injection for the interop suite's error case: a client
    /// advertises a wrong rkey for its start buffer (the peer's READ fails),
    /// a server WRITEs with a wrong rkey. Prints the Terminates and fails.
    #[arg(long, hide = true)]
    pub bad_rkey: bool,
}

/// rping's minimum: room for the message format and a number.
const MIN_SIZE: usize = "2147483647".len() + 1 + "rdma-ping-%d: ".len() + 1;
const INFO_LEN: usize = 16;
const T: Duration = Duration::from_secs(30);

pub fn run(a: &RpingArgs) -> ExitCode {
    if !(MIN_SIZE..=65535).contains(&a.size) {
        eprintln!(
            "Invalid size {} (valid range is {MIN_SIZE} to 65535)",
            a.size
        );
        return ExitCode::FAILURE;
    }
    let r = if a.server { server(a) } else { client(a) };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softrdma rping: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_tos(s: &str) -> Result<u8, String> {
    let v = match s.strip_prefix("0x") {
        Some(h) => u8::from_str_radix(h, 16),
        None => s.parse(),
    };
    v.map_err(|_| format!("{s:?}: a type of service is 0 to 255"))
}

/// rping's connection parameters over RoCE: one READ each way.
fn rc_options() -> RcOptions {
    RcOptions {
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        ..RcOptions::default()
    }
}

fn mpa_config(a: &RpingArgs) -> MpaConfig {
    // rping's connection parameters: responder resources and initiator depth 1.
    MpaConfig {
        crc: if a.crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::IfAsked
        },
        ird: 1,
        ord: 1,
        tos: a.tos,
        ..MpaConfig::default()
    }
}

/// The QP and buffers of one side: [0, 16) receive, [16, 32) send,
/// then the start buffer and the rdma buffer.
struct Side {
    _ctx: Context,
    _pd: Pd,
    mr: Mr,
    scq: Cq,
    rcq: Cq,
    qp: Qp,
    size: usize,
}

const RECV: usize = 0;
const SEND: usize = INFO_LEN;
const START: usize = 2 * INFO_LEN;

impl Side {
    fn new(ip: Ipv4Addr, size: usize, roce: bool) -> Result<Side, String> {
        Side::on(&open(ip, roce)?, size)
    }

    fn on(ctx: &Context, size: usize) -> Result<Side, String> {
        let e = |e: VerbsError| e.to_string();
        let ctx = ctx.clone();
        let pd = ctx.alloc_pd().map_err(e)?;
        let mr = pd.register(START + 2 * size, Access::ALL).map_err(e)?;
        let scq = ctx.create_cq(32).map_err(e)?;
        let rcq = ctx.create_cq(8).map_err(e)?;
        let qp = pd
            .create_qp(&QpInit::rc(&scq, &rcq).caps(QpCaps {
                max_send_wr: 16,
                max_recv_wr: 2,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            }))
            .map_err(e)?;
        if !ctx.is_iwarp() || ctx.is_ibverbs() {
            // As rdma_create_qp leaves it: in INIT, taking receives before
            // the connection (softrdma's iWARP QPs take them as they are).
            qp.modify(
                &QpAttr {
                    state: Some(QpState::Init),
                    pkey_index: Some(0),
                    port: Some(1),
                    access: Some(Access::REMOTE_WRITE | Access::REMOTE_READ),
                    ..QpAttr::default()
                },
                None,
            )
            .map_err(e)?;
        }
        Ok(Side {
            _ctx: ctx,
            _pd: pd,
            mr,
            scq,
            rcq,
            qp,
            size,
        })
    }

    fn rdma(&self) -> usize {
        START + self.size
    }

    fn post_recv(&self) -> Result<(), String> {
        self.qp
            .post_recv(RecvWr::new(1, [self.mr.sge(RECV, INFO_LEN as u32)]))
            .map_err(|e| e.to_string())
    }

    /// Waits for the next receive; `None` when the connection ended.
    fn recv_info(&self) -> Result<Option<(u64, u32, u32)>, String> {
        let wc = self
            .rcq
            .wait(T)
            .map_err(|e| e.to_string())?
            .ok_or("no message from the peer in 30 s")?;
        if wc.status == WcStatus::WrFlushErr {
            return Ok(None);
        }
        if wc.status != WcStatus::Success {
            return Err(format!("receive failed: {}", wc.status));
        }
        let b = self
            .mr
            .read_vec(RECV, INFO_LEN)
            .map_err(|e| e.to_string())?;
        self.post_recv()?;
        Ok(Some((
            u64::from_be_bytes(b[0..8].try_into().expect("8 bytes")),
            u32::from_be_bytes(b[8..12].try_into().expect("4 bytes")),
            u32::from_be_bytes(b[12..16].try_into().expect("4 bytes")),
        )))
    }

    fn post(&self, op: SendOp, at: usize, len: usize) -> Result<(), String> {
        self.qp
            .post_send(SendWr::new(0, op, [self.mr.sge(at, len as u32)]))
            .map_err(|e| e.to_string())?;
        let wc = self
            .scq
            .wait(T)
            .map_err(|e| e.to_string())?
            .ok_or("no send completion in 30 s")?;
        if wc.status != WcStatus::Success {
            return Err(format!("{:?} failed: {}", wc.opcode, wc.status));
        }
        Ok(())
    }

    /// SENDs rping's rdma_info for the buffer at `at` (with a wrong rkey
    /// when `bad`).
    fn send_info(&self, at: usize, bad: bool) -> Result<(), String> {
        let mut info = [0u8; INFO_LEN];
        info[0..8].copy_from_slice(&(self.mr.addr() + at as u64).to_be_bytes());
        let rkey = if bad {
            self.mr.rkey() ^ 0x00ff_ff00
        } else {
            self.mr.rkey()
        };
        info[8..12].copy_from_slice(&rkey.to_be_bytes());
        info[12..16].copy_from_slice(&(self.size as u32).to_be_bytes());
        self.mr.write(SEND, &info).map_err(|e| e.to_string())?;
        self.post(SendOp::Send, SEND, INFO_LEN)
    }
}

/// The libibverbs device `name`, whose address must be `ip` (or 0.0.0.0).
fn open_ibverbs(name: &str, ip: Ipv4Addr) -> Result<Context, String> {
    let ctx = Device::ibverbs(name).open().map_err(|e| e.to_string())?;
    let mine = *ctx.local_addr().ip();
    if !ip.is_unspecified() && ip != mine {
        return Err(format!("{name} has the address {mine}, not {ip}"));
    }
    Ok(ctx)
}

/// The device at `ip`: iWARP, or RoCEv2 on UDP port 4791.
fn open(ip: Ipv4Addr, roce: bool) -> Result<Context, String> {
    let dev = if roce {
        Device::udp(SocketAddrV4::new(ip, 4791).into())
    } else {
        Device::iwarp(ip)
    };
    dev.open().map_err(|e| e.to_string())
}

enum Listening {
    Iwarp(Listener),
    Roce(roce::Listener),
}

fn server(a: &RpingArgs) -> Result<(), String> {
    let e = |e: VerbsError| e.to_string();
    // The listener's device; each connection's QP has a device of its own
    // on iWARP, and shares this one on RoCE (one device per address).
    // A libibverbs device serves every connection, as RoCE's does.
    let probe = match &a.ibverbs {
        Some(name) => open_ibverbs(name, a.addr)?,
        None => open(a.addr, a.roce)?,
    };
    let listener = if !probe.is_iwarp() {
        Listening::Roce(roce::Listener::bind(&probe, a.port).map_err(e)?)
    } else {
        Listening::Iwarp(Listener::bind(&probe, a.port).map_err(e)?)
    };
    loop {
        let side = match &listener {
            Listening::Iwarp(_) if !probe.is_ibverbs() => Side::new(a.addr, a.size, false)?,
            _ => Side::on(&probe, a.size)?,
        };
        side.post_recv()?;
        let accepted = match &listener {
            Listening::Iwarp(l) => l
                .accept(&side.qp, &mpa_config(a), |_| Decision::Accept)
                .map(drop)
                .map_err(|e| e.to_string()),
            Listening::Roce(l) => l
                .accept(
                    &side.qp,
                    &rc_options(),
                    |_| roce::Decision::Accept(vec![]),
                    None,
                )
                .map(drop)
                .map_err(|e| e.to_string()),
        };
        if let Err(e) = accepted {
            // As rdma-core's rping -P: one bad client doesn't end the server.
            if !a.persistent {
                return Err(e);
            }
            eprintln!("rping: connection refused: {e}");
            continue;
        }
        if a.debug {
            eprintln!("accepting client connection request");
        }
        if !a.persistent {
            serve(a, &side)?;
            debug_fpdus(a, &side);
            eprintln!("server DISCONNECT EVENT...");
            return Ok(());
        }
        // As rdma-core's rping -P: each client on a thread of its own, so a
        // long (or stuck) session holds up no other.
        let a = a.clone();
        let session = std::thread::Builder::new()
            .name("rping-session".into())
            .spawn(move || match serve(&a, &side) {
                Ok(()) => {
                    debug_fpdus(&a, &side);
                    eprintln!("server DISCONNECT EVENT...");
                }
                Err(e) => eprintln!("rping: client failed: {e}"),
            });
        if let Err(e) = session {
            eprintln!("rping: cannot serve the client: {e}");
        }
    }
}

fn serve(a: &RpingArgs, s: &Side) -> Result<(), String> {
    loop {
        // The client's start buffer: READ it.
        let Some((addr, rkey, len)) = s.recv_info()? else {
            return Ok(());
        };
        if len as usize > s.size {
            return Err(format!(
                "the client's {len}-byte buffer does not fit this side's {} (-S)",
                s.size
            ));
        }
        s.post(
            SendOp::Read {
                remote_addr: addr,
                rkey,
            },
            s.rdma(),
            len as usize,
        )?;
        let data =
            s.mr.read_vec(s.rdma(), len as usize)
                .map_err(|e| e.to_string())?;
        let text_len = data.iter().position(|&b| b == 0).unwrap_or(data.len());
        if a.verbose {
            outln!(
                "server ping data: {}",
                String::from_utf8_lossy(&data[..text_len])
            );
        }
        // "Go ahead" is the (zeroed) send buffer.
        s.mr.write(SEND, &[0u8; INFO_LEN])
            .map_err(|e| e.to_string())?;
        s.post(SendOp::Send, SEND, INFO_LEN)?;
        let Some((addr, rkey, _)) = s.recv_info()? else {
            return Ok(());
        };
        // Echo the string and its NUL, as rping writes strlen + 1.
        let rkey = if a.bad_rkey { rkey ^ 0x00ff_ff00 } else { rkey };
        s.post(
            SendOp::Write {
                remote_addr: addr,
                rkey,
            },
            s.rdma(),
            (text_len + 1).min(len as usize),
        )?;
        if let Err(e) = s.post(SendOp::Send, SEND, INFO_LEN) {
            report_terminates(s);
            return Err(e);
        }
        if a.bad_rkey {
            // The peer's Terminate is on its way: wait for the stream to end.
            let _ = s.recv_info();
            report_terminates(s);
            return Err("the peer terminated the connection".into());
        }
    }
}

/// Prints the Terminates of the connection (the error case's evidence).
fn report_terminates(s: &Side) {
    let Some(st) = s.qp.iwarp_stats() else { return };
    for (what, t) in [
        ("sent", st.terminate_sent),
        ("received", st.terminate_received),
    ] {
        if let Some(t) = t {
            eprintln!(
                "Terminate {what}: layer {} type {} code {:#04x} ({}), {:?} layout",
                t.control.layer.code(),
                t.control.etype,
                t.control.code,
                t.control.description(),
                t.encoding
            );
        }
    }
}

/// With -d: the FPDUs this side sent (rping's debug lines go to stdout). Large
/// FPDUs are only for peers that take them: siw's stay within a segment.
fn debug_fpdus(a: &RpingArgs, s: &Side) {
    if let (true, Some(st)) = (a.debug, s.qp.iwarp_stats()) {
        outln!(
            "FPDUs sent: {}, largest ULPDU: {} bytes",
            st.fpdus.fpdus_sent,
            st.fpdus.largest_ulpdu_sent
        );
    }
}

/// rping's ping data for iteration `ping`: "rdma-ping-N: " and letters from
/// `start` up, wrapping 'z' to 'A'; NUL last.
fn ping_data(ping: u64, start: u8, size: usize) -> Vec<u8> {
    let mut buf = format!("rdma-ping-{ping}: ").into_bytes();
    buf.truncate(size - 1);
    let mut c = start;
    while buf.len() < size {
        buf.push(c);
        c = if c >= 122 { 65 } else { c + 1 };
    }
    buf[size - 1] = 0;
    buf
}

fn client(a: &RpingArgs) -> Result<(), String> {
    let side = match &a.ibverbs {
        Some(name) => Side::on(
            &open_ibverbs(name, a.source.unwrap_or(Ipv4Addr::UNSPECIFIED))?,
            a.size,
        )?,
        None => {
            let source = match a.source {
                Some(s) => s,
                None => crate::device::route_to(a.addr)?,
            };
            Side::new(source, a.size, a.roce)?
        }
    };
    side.post_recv()?;
    let to = SocketAddrV4::new(a.addr, a.port);
    let roce = !side.qp.context().is_iwarp();
    if roce {
        roce::connect(&side.qp, to, &[], &rc_options()).map_err(|e| e.to_string())?;
    } else {
        iwarp::connect(&side.qp, to, &mpa_config(a)).map_err(|e| e.to_string())?;
    }
    let mut start = 65u8;
    let mut ping = 0u64;
    while a.count == 0 || ping < a.count {
        let data = ping_data(ping, start, a.size);
        start = if start >= 122 { 65 } else { start + 1 };
        side.mr.write(START, &data).map_err(|e| e.to_string())?;
        side.send_info(START, a.bad_rkey)?;
        if side.recv_info()?.is_none() {
            report_terminates(&side);
            return Err("the server went away".into());
        }
        side.send_info(side.rdma(), false)?;
        side.recv_info()?.ok_or("the server went away")?;
        let echoed = side
            .mr
            .read_vec(side.rdma(), a.size)
            .map_err(|e| e.to_string())?;
        if a.validate && echoed != data {
            return Err("data mismatch!".into());
        }
        if a.verbose {
            let n = echoed.iter().position(|&b| b == 0).unwrap_or(echoed.len());
            outln!("ping data: {}", String::from_utf8_lossy(&echoed[..n]));
        }
        ping += 1;
    }
    debug_fpdus(a, &side);
    // The server's last SEND has arrived, but siw completes that SEND only
    // after its transmit path looks again, and fails it (LOC_QP_OP_ERR, and
    // rping's server then exits 255) if the connection is closing by then:
    // seen once in the CI's runs. rping's server waits for this side's
    // disconnect, so there is nothing to wait for but a moment.
    std::thread::sleep(std::time::Duration::from_millis(100));
    if roce {
        // rping's server ends at this side's DREQ.
        roce::disconnect(&side.qp).map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_data_is_rpings() {
        // results/siw_rping.log: the first ping of 64 bytes.
        let d = ping_data(0, 65, 64);
        assert_eq!(
            String::from_utf8_lossy(&d[..63]),
            "rdma-ping-0: ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqr"
        );
        assert_eq!(d[63], 0);
        let d = ping_data(1, 66, 64);
        assert!(d.starts_with(b"rdma-ping-1: BCD"));
    }
}
