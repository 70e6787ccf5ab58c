//! `softrdma perf`: perftest's bandwidth and latency tests (`ib_write_bw`
//! and friends) with perftest's flags, its out-of-band exchange on TCP 18515
//! and its output, so that either side can be softrdma and the other
//! perftest 4.5. What perftest does is described in
//! `../shared/TOOLS-PROTOCOLS.md` section 2.

mod oob;
mod report;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

// TSC stamps, as perftest takes (a std clock read costs ~30 ns here, as
// much as a shared-memory post).
use quanta::Instant;

use softrdma::cm::iwarp::{self, ConnectError, Listener};
use softrdma::cm::mpa::{Decision, MpaConfig};
use softrdma::cm::{self, ConnInfo, RcOptions, roce, roce_ud};
use softrdma::verbs::*;
use softrdma::wire::cm::REJ_INVALID_SERVICE_ID;

use oob::{Control, Key, Oob, Report};
use report::*;

/// The tests, by perftest's names too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Test {
    #[value(name = "write-bw", alias = "ib_write_bw")]
    WriteBw,
    #[value(name = "write-lat", alias = "ib_write_lat")]
    WriteLat,
    #[value(name = "read-bw", alias = "ib_read_bw")]
    ReadBw,
    #[value(name = "read-lat", alias = "ib_read_lat")]
    ReadLat,
    #[value(name = "send-bw", alias = "ib_send_bw")]
    SendBw,
    #[value(name = "send-lat", alias = "ib_send_lat")]
    SendLat,
    #[value(name = "atomic-bw", alias = "ib_atomic_bw")]
    AtomicBw,
    #[value(name = "atomic-lat", alias = "ib_atomic_lat")]
    AtomicLat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Write,
    Read,
    Send,
    Atomic,
}

impl Test {
    fn verb(self) -> Verb {
        match self {
            Test::WriteBw | Test::WriteLat => Verb::Write,
            Test::ReadBw | Test::ReadLat => Verb::Read,
            Test::SendBw | Test::SendLat => Verb::Send,
            Test::AtomicBw | Test::AtomicLat => Verb::Atomic,
        }
    }

    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat
        )
    }
}

/// Options, spelled as perftest spells them.
#[derive(Debug, Clone, clap::Args)]
pub struct PerfArgs {
    /// The test: write-bw, write-lat, read-bw, read-lat, send-bw, send-lat,
    /// atomic-bw, atomic-lat (or perftest's names, ib_write_bw ...).
    pub test: Test,
    /// The server to connect to; without it, be the server.
    pub host: Option<String>,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 18515,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// Device (see `softrdma devices`; default: the route to the server, or
    /// the first non-loopback device, or --bind).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    pub dev: Option<String>,
    /// GID index: 1 is the IPv4 GID, as on rxe.
    #[arg(short = 'x', long = "gid-index", default_value_t = 1)]
    pub gid: usize,
    /// Local IPv4 address of the device (and of a server's listener).
    #[arg(long)]
    pub bind: Option<Ipv4Addr>,
    /// Message size (K and M suffixes allowed; default 65536 for BW tests,
    /// 2 for latency tests, 8 for atomics).
    #[arg(short = 's', long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Run every size from 2 bytes to 8 MiB.
    #[arg(short = 'a', long = "all")]
    pub all: bool,
    /// Iterations (default 5000 for write-bw, 1000 for the others).
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u64>,
    /// Run for this many seconds instead of a number of iterations (every
    /// test; not with -a).
    #[arg(short = 'D', long = "duration")]
    pub duration: Option<u64>,
    /// Number of QPs (BW tests; perftest's limits).
    #[arg(short = 'q', long = "qp", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub qps: u32,
    /// Send queue depth: work requests outstanding per QP.
    #[arg(short = 't', long = "tx-depth",
          value_parser = clap::value_parser!(u32).range(1..=15000))]
    pub tx_depth: Option<u32>,
    /// Receive queue depth (SEND tests).
    #[arg(short = 'r', long = "rx-depth",
          value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub rx_depth: Option<u32>,
    /// Signal one send completion in this many.
    #[arg(short = 'Q', long = "cq-mod",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cq_mod: Option<u32>,
    /// Path MTU (256 .. 4096; default: the port's active MTU).
    #[arg(short = 'm', long = "mtu")]
    pub mtu: Option<usize>,
    /// Largest message sent inline.
    #[arg(short = 'I', long = "inline_size")]
    pub inline: Option<u32>,
    /// Outstanding READs/atomics (READ and atomic tests; default 128).
    #[arg(short = 'o', long = "outs")]
    pub out_reads: Option<u8>,
    /// Atomic type: FETCH_AND_ADD (default) or CMP_AND_SWAP.
    #[arg(short = 'A', long = "atomic_type")]
    pub atomic: Option<String>,
    /// Connection type: RC, or UD for the SEND tests.
    #[arg(short = 'c', long = "connection", default_value = "RC")]
    pub conn: String,
    /// Report bandwidth in Gb/s instead of MB/s.
    #[arg(long = "report_gbits", visible_alias = "report-gbits")]
    pub gbits: bool,
    /// Accepted for perftest compatibility (no CPU frequency check here).
    #[arg(short = 'F', long = "CPU-freq")]
    pub cpu_freq: bool,
    /// Bidirectional: both sides send (BW tests).
    #[arg(short = 'b', long = "bidirectional")]
    pub bidir: bool,
    /// SEND tests: the receiving QPs take their receives from one shared
    /// receive queue of rx-depth receives (each QP's share refilled as it is
    /// used). Give it to both sides, as with perftest.
    #[arg(long = "use-srq")]
    pub use_srq: bool,
    /// Sleep on completion events (softrdma always waits blocking; accepted).
    #[arg(short = 'e', long = "events")]
    pub events: bool,
    /// Check the payload end to end (both sides softrdma with --verify).
    #[arg(long)]
    pub verify: bool,
    /// Share the device's address through `softrdma hostd`.
    #[arg(long)]
    pub shared_port: bool,
    /// Write what this side sends and receives to a pcap file.
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<std::path::PathBuf>,
    /// Connect with rdma_cm, as perftest's -R, the exchange on a control
    /// QP: over iWARP (MPA on the TCP port), or with `--provider roce` over
    /// RoCEv2 (the IB CM on QP 1; the device on UDP port 4791).
    #[arg(short = 'R', long = "rdma_cm")]
    pub rdma_cm: bool,
    /// The provider: roce (RoCEv2 over UDP; the default, but with -R
    /// iwarp), iwarp (as -R), shm (shared memory; both processes on this
    /// host, both with --provider shm; the exchange still runs on the TCP
    /// port) or ibverbs (the libibverbs device -d names: a RoCE NIC, or the
    /// kernel's rxe).
    #[arg(long, value_enum)]
    pub provider: Option<ProviderKind>,
    /// RoCEv2: spin on completions (and target memory) instead of blocking,
    /// this thread receiving the device's packets itself: perftest's own
    /// polling, and no thread wake-up per message (a CPU per side). iWARP:
    /// the connection's receiving thread spins on its socket (up to 1 ms at a
    /// time) instead of sleeping in read; completion waits still block.
    #[arg(long)]
    pub busy_poll: bool,
    /// At the end, print each RoCEv2 RC QP's transport counters (packets
    /// sent and resent, timeouts, NAKs, the send window) to stderr.
    #[arg(long)]
    pub stats: bool,
    /// Latency tests: print every iteration's time, sorted, before the
    /// summary (perftest's "#, usec" list).
    #[arg(short = 'H', long = "report-histogram")]
    pub histogram: bool,
    /// Latency tests: print every iteration's time in the order measured,
    /// before the summary (and before -H's sorted list).
    #[arg(short = 'U', long = "report-unsorted")]
    pub unsorted: bool,
}

/// `--provider`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProviderKind {
    Roce,
    Iwarp,
    Shm,
    /// A libibverbs device named by -d (rxe0, mlx5_0): RoCE ports.
    Ibverbs,
}

/// The provider asked for: `--provider`, else iWARP with -R (as before
/// RoCE had rdma_cm), else RoCEv2.
fn provider(a: &PerfArgs) -> ProviderKind {
    a.provider.unwrap_or(if a.rdma_cm {
        ProviderKind::Iwarp
    } else {
        ProviderKind::Roce
    })
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mul) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1024),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1024 * 1024),
        _ => (s, 1),
    };
    let v: u64 = num.parse().map_err(|_| format!("{s}: not a size"))?;
    let v = v.saturating_mul(mul);
    if !(1..=u64::from(u32::MAX / 2)).contains(&v) {
        return Err(" Message Size should be between 1 and 2147483647".into());
    }
    Ok(v)
}

const MAX_SIZE: u64 = 1 << 23;
const MAX_DURATION_SECS: u64 = 365 * 86_400;
const CACHE_LINE: u32 = 64;
const PAGE: u32 = 4096;

/// The run's parameters after perftest's defaults and checks.
#[derive(Debug, Clone)]
struct Config {
    test: Test,
    client: bool,
    sizes: Vec<u64>,
    iters: u64,
    duration: Option<Duration>,
    qps: usize,
    tx_depth: u32,
    rx_depth: u32,
    /// `--use-srq`.
    srq: bool,
    cq_mod: u32,
    inline: u32,
    out_reads: u8,
    cas: bool,
    gbits: bool,
    verify: bool,
    duplex: bool,
    ud: bool,
    /// rdma_cm mode (iWARP, or RoCE with `roce_cm`).
    cm: bool,
    /// rdma_cm over RoCEv2 (the IB CM).
    roce_cm: bool,
    /// Shared memory.
    shm: bool,
    /// RoCEv2 busy-poll mode.
    busy_poll: bool,
    /// Spins put a PAUSE between polls: all but RoCEv2's busy-poll spins,
    /// whose every poll is a `recvmsg` (0.4 µs here) that a PAUSE (25 ns)
    /// only delays (perftest's spins and the peers' have none). The others
    /// poll memory, where a PAUSE is the spinning CPU's manners; iWARP's
    /// busy-poll pairs moved by ±1 µs either way without it.
    pause_in_spins: bool,
    /// -U and -H: the iterations' times listed.
    list: Listing,
}

fn config(a: &PerfArgs) -> Result<Config, String> {
    let t = a.test;
    let verb = t.verb();
    let ud = match a.conn.as_str() {
        "RC" => false,
        "UD" if verb == Verb::Send => true,
        "UD" => return Err(" UD connection only possible in SEND tests".into()),
        other => {
            return Err(format!(
                "-c {other}: softrdma perf runs RC and UD (perftest also has UC, XRC, DC)"
            ));
        }
    };
    if a.bidir && t.is_lat() {
        return Err(" Bidirectional is only available in BW test".into());
    }
    if t.is_lat() && a.qps > 1 {
        return Err(" Multiple QPs only available on bw tests".into());
    }
    if a.atomic.is_some() && verb != Verb::Atomic {
        return Err("-A is for the atomic tests".into());
    }
    let cas = match a.atomic.as_deref() {
        None | Some("FETCH_AND_ADD") => false,
        Some("CMP_AND_SWAP") => true,
        Some(_) => {
            return Err(
                " Invalid Atomic type! please choose from {CMP_AND_SWAP,FETCH_AND_ADD}".into(),
            );
        }
    };
    if verb == Verb::Atomic && (a.all || a.size.is_some_and(|s| s != 8)) {
        return Err("Message size cannot be changed for Atomic tests ".into());
    }
    if a.inline.is_some() && matches!(verb, Verb::Read | Verb::Atomic) {
        return Err(" Inline feature not available on READ/Atomic verbs".into());
    }
    if a.out_reads.is_some() && matches!(verb, Verb::Write | Verb::Send) {
        return Err(" Outstanding reads is only for READ and atomic tests".into());
    }
    if a.verify && matches!(t, Test::WriteLat | Test::AtomicLat) {
        return Err(
            "--verify checks the BW tests, send-lat and read-lat (write-lat and atomic-lat \
             move no payload worth checking)"
                .into(),
        );
    }
    let provider = provider(a);
    // An RNIC (siw) connects through rdma_cm only, as iWARP does here.
    let rnic =
        provider == ProviderKind::Ibverbs && a.dev.as_deref().is_some_and(crate::device::is_rnic);
    let rdma_cm = a.rdma_cm || provider == ProviderKind::Iwarp || rnic;
    let roce_cm = rdma_cm && !rnic && provider != ProviderKind::Iwarp;
    let shm = provider == ProviderKind::Shm;
    if a.busy_poll && shm {
        return Err(
            " --busy-poll is for RoCEv2 and iWARP (shm completes on the poster's thread)".into(),
        );
    }
    if a.use_srq {
        if verb != Verb::Send {
            return Err(" Using SRQ only avavilible in SEND / SEND_IMM tests.".into());
        }
        if shm {
            return Err(" --use-srq: shm devices have no shared receive queues yet".into());
        }
    }
    if provider == ProviderKind::Ibverbs {
        if a.dev.is_none() {
            return Err(
                " --provider ibverbs needs -d, a device of `softrdma devices`'s \
                        libibverbs list (rxe0, mlx5_0)"
                    .into(),
            );
        }
        if rdma_cm && ud && !rnic {
            return Err(
                " -R with -c UD: --provider ibverbs has no rdma_cm UD mode yet (RC only)".into(),
            );
        }
        if a.shared_port || a.pcap.is_some() {
            return Err(
                " --shared-port and --pcap are for softrdma's RoCEv2 device, not \
                        --provider ibverbs"
                    .into(),
            );
        }
    }
    if shm {
        if a.rdma_cm {
            return Err(" --provider shm connects through shared memory, not rdma_cm (-R)".into());
        }
        if ud {
            return Err(" --provider shm has RC QPs only".into());
        }
        if a.shared_port || a.pcap.is_some() {
            return Err(" --shared-port and --pcap are for RoCEv2, not --provider shm".into());
        }
    }
    if roce_cm && a.shared_port {
        return Err(
            " -R over RoCE needs the device of its own on UDP port 4791 (no --shared-port)".into(),
        );
    }
    if rnic && (verb == Verb::Atomic || ud) {
        let dev = a.dev.as_deref().unwrap_or_default();
        return Err(format!(
            " {dev} is an iWARP device (RNIC): it has no {} (run them on a RoCE device)",
            if ud { "UD QPs" } else { "atomics" }
        ));
    }
    if rdma_cm && !roce_cm {
        if verb == Verb::Atomic {
            return Err(
                " -R runs over iWARP, which has no atomics (run the atomic tests \
                        without -R, over RoCEv2)"
                    .into(),
            );
        }
        if ud {
            return Err(
                " -R with -c UD: iWARP has no UD (rdma_cm's UD mode runs over RoCEv2: \
                        --provider roce)"
                    .into(),
            );
        }
        if a.bidir && verb == Verb::Send {
            return Err(
                " -R with -b on send-bw is not implemented (iWARP's receive credits \
                        run one way here)"
                    .into(),
            );
        }
        if a.shared_port || a.pcap.is_some() {
            return Err(" --shared-port and --pcap are for RoCEv2, not -R (iWARP)".into());
        }
    }
    // perftest refuses 0; past a year the run's clock arithmetic overflows.
    if a.duration.is_some_and(|d| d == 0 || d > MAX_DURATION_SECS) {
        return Err(format!(
            " Duration period must be between 1 and {MAX_DURATION_SECS} seconds"
        ));
    }
    if a.duration.is_some() && a.all {
        return Err("Duration mode currently doesn't support running on all sizes.".into());
    }
    if (a.histogram || a.unsorted) && !t.is_lat() {
        return Err(
            " -H and -U list a latency test's iterations: bandwidth tests have none".into(),
        );
    }
    if (a.histogram || a.unsorted) && a.duration.is_some() {
        return Err(" -H and -U need a number of iterations (-n), not a duration (-D)".into());
    }
    let iters = a
        .iters
        .unwrap_or(if t == Test::WriteBw { 5000 } else { 1000 });
    if !(5..=100_000_000).contains(&iters) {
        return Err(" Iteration num should be between 5 and 100000000".into());
    }
    let size = a.size.unwrap_or(match (verb, t.is_lat()) {
        (Verb::Atomic, _) => 8,
        (_, true) => 2,
        (_, false) => 65536,
    });
    let sizes = if a.all {
        (1..)
            .map(|i| 1u64 << i)
            .take_while(|&s| s <= MAX_SIZE)
            .collect()
    } else {
        vec![size]
    };
    let big_iters = if a.duration.is_some() {
        u64::MAX
    } else {
        iters
    };
    let tx_depth = a
        .tx_depth
        .unwrap_or(if t.is_lat() { 1 } else { 128 })
        .clamp(1, u32::try_from(big_iters.min(65536)).unwrap_or(65536));
    let mut cq_mod = a.cq_mod.unwrap_or(
        if a.cq_mod.is_none() && size > 8192 && !a.all && !a.events {
            1
        } else {
            100
        },
    );
    if t.is_lat() {
        cq_mod = 1;
    }
    let cq_mod = cq_mod.clamp(1, tx_depth);
    let rx_depth = if verb == Verb::Send {
        let mut r = a
            .rx_depth
            .unwrap_or(512)
            .min(u32::try_from(iters).unwrap_or(u32::MAX));
        if r % 2 == 1 && !a.all {
            r += 1;
        }
        r.max(1)
    } else {
        1
    };
    if a.use_srq && a.qps > rx_depth {
        return Err(" Using SRQ depth should be greater than number of QPs.".into());
    }
    Ok(Config {
        test: t,
        client: a.host.is_some(),
        sizes,
        iters,
        duration: a.duration.map(Duration::from_secs),
        qps: a.qps as usize,
        tx_depth,
        rx_depth,
        srq: a.use_srq,
        cq_mod,
        inline: a.inline.unwrap_or(0),
        out_reads: match verb {
            Verb::Read | Verb::Atomic => a.out_reads.unwrap_or(128).clamp(1, 128),
            _ => 1,
        },
        cas,
        gbits: a.gbits,
        verify: a.verify,
        duplex: a.bidir,
        ud,
        cm: rdma_cm,
        roce_cm,
        shm,
        busy_poll: a.busy_poll,
        pause_in_spins: !(a.busy_poll && provider == ProviderKind::Roce),
        list: Listing {
            unsorted: a.unsorted,
            sorted: a.histogram,
        },
    })
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("softrdma perf: {msg}");
    ExitCode::FAILURE
}

/// Runs a test; exit status as perftest's.
pub fn run(a: &PerfArgs) -> ExitCode {
    match run_inner(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// What the traffic loops work on.
struct Setup {
    cfg: Config,
    qps: Vec<Qp>,
    scq: Cq,
    rcq: Cq,
    mr: Mr,
    /// Bytes of one QP's area in each half of the buffer.
    half: usize,
    cycle: usize,
    cache_line: usize,
    rem: Vec<Key>,
    /// UD: the address handle of each QP's peer.
    ahs: Vec<Ah>,
    /// UD over rdma_cm: each QP's peer QP as SIDR or the client's handshake
    /// found it (perftest sends there, not to its records' QP).
    ud_peer_qpns: Vec<Option<u32>>,
    /// send-bw over iWARP: the receive credits.
    credit: Option<Credit>,
    /// `--use-srq` on a receiving side: the SRQ, and each QP's index by
    /// number (a receive's QP is the one that took it, not its poster's).
    srq: Option<(Srq, HashMap<u32, usize>)>,
}

/// iWARP has no RNR: a SEND finding no receive ends the connection. So
/// perftest's send_bw on iWARP keeps each sender within the receives its
/// peer has posted: every `every` receives, the receiver RDMA WRITEs its
/// count of receives (a u32 in host order, as perftest's) into the sender's
/// credit area, and the sender keeps at most rx_depth messages beyond it (its
/// QP's share of the SRQ with `--use-srq`).
struct Credit {
    /// Per QP: the credit this side receives (its key's rkey and vaddr).
    mr: Mr,
    every: u64,
}

impl Credit {
    fn new(pd: &Pd, qps: usize, rx_depth: u32) -> Result<Credit, String> {
        let mr = pd
            .register(4 * qps, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .map_err(|e| e.to_string())?;
        Ok(Credit {
            mr,
            every: u64::from(rx_depth / 3).max(1),
        })
    }

    fn addr(&self, i: usize) -> u64 {
        self.mr.addr() + 4 * i as u64
    }

    /// Receives the peer has counted on QP `i`.
    fn received(&self, i: usize) -> u64 {
        let mut b = [0u8; 4];
        let _ = self.mr.read(4 * i, &mut b);
        u64::from(u32::from_le_bytes(b))
    }
}

/// UD receive buffers start with the 40-byte GRH area.
const GRH: usize = 40;
/// perftest's Q_Key.
const QKEY: u32 = 0x1111_1111;

impl Config {
    /// The UD QPs' Q_Key: perftest's, or rdma_cm's with `-R`.
    fn qkey(&self) -> u32 {
        if self.roce_cm {
            softrdma::wire::cm::RDMA_CM_UDP_QKEY
        } else {
            QKEY
        }
    }

    /// Whether a UD client over rdma_cm sends the server its address first
    /// (a 4-byte SEND with its QPN as the immediate), for a server that
    /// answers: perftest's latency tests and `-b`.
    fn ud_cm_handshake(&self) -> bool {
        self.ud && self.roce_cm && (self.test.is_lat() || self.duplex)
    }

    /// Receives posted for each QP: rx-depth, or with `--use-srq` its share
    /// of the SRQ's (as perftest).
    fn rx_share(&self) -> u32 {
        if self.srq {
            self.rx_depth / self.qps as u32
        } else {
            self.rx_depth
        }
    }
}

impl Setup {
    /// Posts a receive for QP `i`: on the SRQ if there is one.
    fn post_recv(&self, i: usize, wr: RecvWr) -> Result<(), String> {
        match &self.srq {
            Some((srq, _)) => srq.post_recv(wr),
            None => self.qps[i].post_recv(wr),
        }
        .map_err(|e| e.to_string())
    }

    /// The index of the QP a receive completed on (its wr_id names the QP
    /// that posted it, which with an SRQ may be another).
    fn receiving_qp(&self, wc: &WorkCompletion) -> usize {
        match &self.srq {
            Some((_, index)) => index.get(&wc.qp_num).copied().unwrap_or(0),
            None => (wc.wr_id >> 40) as usize,
        }
    }

    /// Bytes a message takes in a receive buffer (with the GRH area on UD).
    fn span(&self, size: u64) -> u64 {
        if self.cfg.ud { size + GRH as u64 } else { size }
    }

    /// Address step between messages (perftest's INC), if messages step.
    fn step(&self, size: u64, k: u64) -> usize {
        message_step(size as usize, k as usize, self.cycle, self.cache_line)
    }

    /// Offset in the MR of QP `i`'s source area (first half) or target area.
    fn local(&self, i: usize) -> usize {
        i * self.half
    }

    fn target(&self, i: usize) -> usize {
        (self.cfg.qps + i) * self.half
    }
}

/// The byte the payload check expects at `offset` of an area.
fn pattern(offset: usize) -> u8 {
    (offset.wrapping_mul(31) ^ (offset >> 8)) as u8
}

/// The first byte of `got` (read from `offset` of an area) that is not the
/// pattern.
fn mismatch(got: &[u8], offset: usize) -> Option<usize> {
    got.iter()
        .enumerate()
        .position(|(j, &b)| b != pattern(offset + j))
}

fn run_inner(a: &PerfArgs) -> Result<(), String> {
    let mut cfg = config(a)?;
    let verb = cfg.test.verb();
    let peer_ip = match &a.host {
        Some(h) => Some(crate::ping::resolve_v4(h, a.port)?),
        None => None,
    };
    let ibverbs = provider(a) == ProviderKind::Ibverbs;
    let chosen = if ibverbs {
        crate::device::Chosen::named(a.dev.as_deref().unwrap_or_default())
    } else {
        crate::device::choose(a.dev.as_deref(), a.gid, a.bind, peer_ip)?
    };
    let ctx = if ibverbs {
        Device::ibverbs(a.dev.as_deref().unwrap_or_default())
            .busy_poll(a.busy_poll)
            .open()
    } else if cfg.shm {
        Device::shm().open()
    } else if cfg.cm && !cfg.roce_cm {
        Device::iwarp(chosen.addr).busy_poll(a.busy_poll).open()
    } else {
        let mut dev = chosen.device(4791);
        if a.shared_port {
            dev = dev.shared_port(true);
        }
        if let Some(p) = &a.pcap {
            dev = dev.pcap(p);
        }
        dev.busy_poll(a.busy_poll).open()
    }
    .map_err(|e| e.to_string())?;
    let port = ctx.query_port();
    if ibverbs && !ctx.is_iwarp() {
        crate::device::check_ibverbs_gid(
            "-x",
            a.gid,
            chosen.name.as_deref().unwrap_or_default(),
            port.gids.len(),
        )?;
    }
    // An RNIC's GID (its MAC) names nothing rdma_cm uses.
    let gid = if ibverbs && ctx.is_iwarp() {
        port.gids.first().copied().unwrap_or_default()
    } else {
        *port
            .gids
            .get(a.gid)
            .ok_or(format!("-x {}: the device has no such GID index", a.gid))?
    };
    let mtu = match a.mtu {
        Some(m) => Mtu::from_bytes(m).ok_or(format!(
            "-m {m}: the MTU must be 256, 512, 1024, 2048 or 4096"
        ))?,
        None => port.active_mtu,
    };
    let mut listener = None;
    // shm: the data QPs connect through a listener named after the port,
    // which the server opens before it takes the exchange's connection.
    let shm_name = format!("perf-{}", a.port);
    let shm_listener = match (cfg.shm, peer_ip) {
        (true, None) => Some(
            softrdma::cm::shm::Listener::bind(&ctx, &shm_name)
                .map_err(|e| format!("shm listener: {e}"))?,
        ),
        _ => None,
    };
    let mut oob = if cfg.cm {
        // perftest's control connection: no READs, so IRD = ORD = 0.
        let control = Control::new(&ctx)?;
        match peer_ip {
            Some(ip) => connect_data_qp(
                &control.qp,
                SocketAddrV4::new(ip, a.port),
                &mpa_config(0),
                cfg.roce_cm,
            )?,
            None => {
                let l = CmListener::bind(&ctx, a.port, cfg.roce_cm)?;
                outln!("{WAITING}");
                l.accept(&control.qp, &mpa_config(0))?;
                listener = Some(l);
            }
        }
        Oob::control(control, cfg.client).report_probes(a.stats)
    } else {
        let stream = match peer_ip {
            Some(ip) => TcpStream::connect((ip, a.port))
                .map_err(|e| format!("Couldn't connect to {ip}:{}: {e}", a.port))?,
            None => {
                let at = a.bind.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V4);
                let l = TcpListener::bind((at, a.port))
                    .map_err(|e| format!("couldn't listen on port {}: {e}", a.port))?;
                outln!("{WAITING}");
                l.accept().map_err(|e| format!("accept: {e}"))?.0
            }
        };
        Oob::new(stream, cfg.client)
    };
    let (cycle, cache_line, mtu_enum) = oob.preamble(PAGE, CACHE_LINE, mtu_enum(mtu))?;
    let mtu = enum_mtu(mtu_enum);
    let (cycle, cache_line) = (cycle as usize, cache_line as usize);
    if cfg.ud && cfg.sizes.iter().any(|&z| z > mtu.bytes() as u64) {
        outln!(
            " Max msg size in UD is MTU {}\n Changing to this MTU",
            mtu.bytes()
        );
        for z in &mut cfg.sizes {
            *z = (*z).min(mtu.bytes() as u64);
        }
        // -a runs each size once: it stops at the MTU, as perftest's does.
        cfg.sizes.dedup();
    }
    let dev_name = if cfg.shm {
        "shm"
    } else {
        chosen.name.as_deref().unwrap_or("softrdma")
    };
    print_header(&cfg, a, dev_name, mtu);

    // perftest's buffer: per QP a source area, then per QP a target area.
    let max_size = *cfg.sizes.iter().max().expect("a size") as usize + if cfg.ud { GRH } else { 0 };
    let half = max_size.max(cycle).div_ceil(cache_line) * cache_line;
    let access = match verb {
        Verb::Write => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        Verb::Read => Access::LOCAL_WRITE | Access::REMOTE_READ,
        Verb::Atomic => Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
        Verb::Send => Access::LOCAL_WRITE,
    };
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let mr = pd
        .register(2 * cfg.qps * half, access)
        .map_err(|e| e.to_string())?;
    fill(&mr, &cfg, half)?;
    // iWARP has no RNR: perftest's send-bw there runs on receive credits.
    let credit = if cfg.cm && !cfg.roce_cm && cfg.test == Test::SendBw {
        Some(Credit::new(&pd, cfg.qps, cfg.rx_share())?)
    } else {
        None
    };
    let scq = ctx
        .create_cq((cfg.tx_depth as usize * cfg.qps).max(2))
        .map_err(|e| e.to_string())?;
    let rcq = ctx
        .create_cq((cfg.rx_depth as usize * cfg.qps).max(2))
        .map_err(|e| e.to_string())?;
    // As perftest: an SRQ where receives are posted (a BW client has none).
    let srq = if cfg.srq && (cfg.test.is_lat() || !cfg.client || cfg.duplex) {
        Some(
            pd.create_srq(cfg.rx_depth, 1)
                .map_err(|e| format!("cannot create the SRQ: {e}"))?,
        )
    } else {
        None
    };
    let mut qps = Vec::new();
    let mut mine = Vec::new();
    for i in 0..cfg.qps {
        let init = if cfg.ud {
            QpInit::ud(&scq, &rcq)
        } else {
            QpInit::rc(&scq, &rcq)
        };
        let init = match &srq {
            Some(srq) => init.srq(srq),
            None => init,
        };
        let qp = pd
            .create_qp(&init.caps(QpCaps {
                max_send_wr: cfg.tx_depth,
                max_recv_wr: cfg.rx_depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                // Credits go inline (the value as it was when posted).
                max_inline_data: if credit.is_some() {
                    cfg.inline.max(4)
                } else {
                    cfg.inline
                },
            }))
            .map_err(|e| e.to_string())?;
        // A device's QP (not softrdma's iWARP one) takes receives in INIT.
        if cfg.roce_cm || (cfg.cm && ibverbs) {
            if cfg.ud {
                // As rdma_create_qp readies a UD QP: it can take the
                // handshake's receive before SIDR answers.
                cm::ready_ud(&qp, cfg.qkey(), 0).map_err(|e| e.to_string())?;
            } else {
                to_init(&qp)?;
            }
        }
        let (rkey, vaddr) = match (&credit, verb) {
            (Some(c), _) => (c.mr.rkey(), c.addr(i)),
            (None, Verb::Send) => (0, mr.addr() + ((cfg.qps + i) * half) as u64),
            (None, _) => (mr.rkey(), mr.addr() + ((cfg.qps + i) * half) as u64),
        };
        mine.push(Key {
            lid: 0,
            out_reads: u16::from(cfg.out_reads),
            qpn: qp.qpn(),
            psn: getrandom::u32().map_err(|e| e.to_string())? & 0xff_ffff,
            rkey,
            vaddr,
            gid,
            srqn: 0,
        });
        qps.push(qp);
    }
    if cfg.shm {
        for qp in &qps {
            match &shm_listener {
                Some(l) => l.accept(qp),
                None => softrdma::cm::shm::connect(qp, &shm_name),
            }
            .map_err(|e| format!("shm connection: {e}"))?;
        }
    }
    // UD over rdma_cm: the peers' QPs as SIDR and the client's handshake
    // found them (perftest sends its data there, not to its records' QPs).
    let mut ud_peer_qpns = Vec::new();
    let mut ud_listener = None;
    if cfg.cm {
        // perftest's rdma_cm connection step: a handshake (with empty keys)
        // on each side of connecting the data QPs through the listener.
        oob.key(&Key::default())?;
        let mpa = mpa_config(if matches!(verb, Verb::Read | Verb::Atomic) {
            u16::from(cfg.out_reads)
        } else {
            0
        });
        if peer_ip.is_some() {
            // perftest's server opens its data listener only after the
            // handshake, and siw (Linux 6.1) strands a connection whose TCP
            // handshake completes between that listener's listen() and its
            // LISTENING state: it is never accepted and the MPA Request is
            // never read (`siw_accept_newconn`). What the interop suite saw
            // once, "no MPA Reply within 10 s", fits it. A first attempt
            // made right after the handshake is the one that can land there:
            // give the listener a retry interval to come up.
            std::thread::sleep(DATA_CONNECT_RETRY);
        }
        if cfg.ud {
            match peer_ip {
                Some(ip) => {
                    for qp in &qps {
                        let to = SocketAddrV4::new(ip, a.port);
                        let peer = resolve_data_qp(&cfg, (&pd, &mr, &scq), qp, to)?;
                        ud_peer_qpns.push(Some(peer.remote_qpn));
                    }
                }
                None => {
                    let l = roce_ud::Listener::bind(&ctx, a.port)
                        .map_err(|e| format!("rdma_cm UD listener: {e}"))?;
                    for qp in &qps {
                        let handshake = (&rcq, &mr, srq.as_ref());
                        ud_peer_qpns.push(accept_data_qp(&cfg, &l, handshake, qp)?);
                    }
                    // Kept to the handshake's end: a client whose answer was
                    // lost asks again, and the listener's cache answers.
                    ud_listener = Some(l);
                }
            }
        } else {
            for qp in &qps {
                match (peer_ip, &listener) {
                    (Some(ip), _) => {
                        connect_data_qp(qp, SocketAddrV4::new(ip, a.port), &mpa, cfg.roce_cm)?;
                    }
                    (None, Some(l)) => l.accept(qp, &mpa)?,
                    (None, None) => unreachable!("an rdma_cm server listens"),
                }
            }
        }
        oob.key(&Key::default())?;
        drop(ud_listener);
    }
    for k in &mine {
        print_addr("local", k, verb);
    }
    let connect = |rem: &[Key]| -> Result<Vec<Ah>, String> {
        let mut ahs = Vec::new();
        if (cfg.cm && !cfg.ud) || cfg.shm {
            return Ok(ahs); // connected by rdma_cm or cm::shm
        }
        for (i, qp) in qps.iter().enumerate() {
            let r = &rem[i];
            if r.gid[..12] != [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] {
                return Err(
                    "the peer's GID is not an IPv4 one: give it the IPv4 GID index (-x 1)".into(),
                );
            }
            let ip = Ipv4Addr::new(r.gid[12], r.gid[13], r.gid[14], r.gid[15]);
            if cfg.ud {
                // With rdma_cm the QPs are ready already (SIDR found the peer's).
                if !cfg.cm {
                    cm::ready_ud(qp, QKEY, mine[i].psn).map_err(|e| e.to_string())?;
                }
                ahs.push(
                    pd.create_ah(AhAttr {
                        addr: SocketAddrV4::new(ip, 4791),
                    })
                    .map_err(|e| e.to_string())?,
                );
                continue;
            }
            let local = ConnInfo {
                addr: ctx.local_addr(),
                qpn: mine[i].qpn,
                psn: mine[i].psn,
                mtu,
                rkey: 0,
                va: 0,
                len: 0,
            };
            let remote = ConnInfo {
                addr: SocketAddrV4::new(ip, 4791),
                qpn: r.qpn,
                psn: r.psn,
                mtu,
                rkey: r.rkey,
                va: r.vaddr,
                len: 0,
            };
            let opts = RcOptions {
                access,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                min_rnr_timer: 12,
                max_rd_atomic: r.out_reads.clamp(1, 128) as u8,
                max_dest_rd_atomic: cfg.out_reads,
            };
            cm::connect(qp, &local, &remote, &opts).map_err(|e| e.to_string())?;
        }
        Ok(ahs)
    };
    let keys_round =
        |oob: &mut Oob| -> Result<Vec<Key>, String> { mine.iter().map(|k| oob.key(k)).collect() };
    // Each later message repeats the first: one that doesn't is a peer with
    // another -q (or test), caught here instead of read as a report later.
    let again = |oob: &mut Oob, r: &[Key]| -> Result<(), String> {
        mine.iter()
            .zip(r)
            .try_for_each(|(k, before)| oob.key_again(k, before))
    };
    // The handshakes before traffic, in each test's order.
    let (rem, ahs) = match cfg.test {
        Test::WriteBw | Test::ReadBw | Test::AtomicBw => {
            let r = keys_round(&mut oob)?;
            let ahs = connect(&r)?;
            again(&mut oob, &r)?;
            oob.key_again(&mine[0], &r[0])?;
            (r, ahs)
        }
        Test::SendBw | Test::SendLat => {
            let r = keys_round(&mut oob)?;
            let ahs = connect(&r)?;
            oob.key_again(&mine[0], &r[0])?;
            again(&mut oob, &r)?;
            (r, ahs)
        }
        Test::WriteLat | Test::ReadLat | Test::AtomicLat => {
            let first = oob.key(&mine[0])?;
            let r = keys_round(&mut oob)?;
            if r[0] != first {
                return Err(
                    "out-of-band exchange: the peer's second message is not its first: \
                            do both sides run the same test?"
                        .into(),
                );
            }
            let ahs = connect(&r)?;
            again(&mut oob, &r)?;
            oob.key_again(&mine[0], &r[0])?;
            (r, ahs)
        }
    };
    oob.setup_done();
    for k in &rem {
        print_addr("remote", k, verb);
    }
    let srq = srq.map(|srq| {
        let index = qps.iter().enumerate().map(|(i, q)| (q.qpn(), i)).collect();
        (srq, index)
    });
    let s = Setup {
        cfg: cfg.clone(),
        qps,
        scq,
        rcq,
        mr,
        half,
        cycle,
        cache_line,
        rem,
        ahs,
        ud_peer_qpns,
        credit,
        srq,
    };
    let my0 = mine[0];
    let run = traffic(&s, oob, my0);
    if a.stats {
        print_transport_stats(&s.qps);
    }
    run
}

/// Prints the transport counters of the RoCEv2 QPs.
fn print_transport_stats(qps: &[Qp]) {
    for (i, qp) in qps.iter().enumerate() {
        if let Some(u) = qp.ud_stats() {
            eprintln!(
                "QP {i} (0x{:06x}) UD: {} datagrams sent, {} received; dropped: {} with no \
                 receive posted, {} with another Q_Key, {} others",
                qp.qpn(),
                u.sent,
                u.received,
                u.no_receive,
                u.qkey_mismatch,
                u.dropped,
            );
        }
        if let Some(t) = qp.stats() {
            eprintln!(
                "QP {i} (0x{:06x}) transport: {} requests sent, {} resent, {} timeouts, {} \
                 PSN sequence NAKs and {} RNR NAKs received, {} sent; {} responses sent, \
                 {} duplicates and {} dropped received; send window {} PSNs",
                qp.qpn(),
                t.requests_sent,
                t.retransmitted,
                t.timeouts,
                t.seq_naks_received,
                t.rnr_naks_received,
                t.seq_naks_sent + t.rnr_naks_sent,
                t.responses_sent,
                t.duplicates,
                t.dropped,
                t.window,
            );
        }
    }
}

/// The handshakes' last steps and the traffic of each test and role.
fn traffic(s: &Setup, mut oob: Oob, my0: Key) -> Result<(), String> {
    let cfg = &s.cfg;
    let verb = cfg.test.verb();
    match (cfg.test, cfg.client) {
        (Test::WriteBw | Test::ReadBw | Test::AtomicBw | Test::SendBw, client) if cfg.duplex => {
            outln!("{RESULT_LINE}\n{}", bw_header(cfg.gbits));
            for &size in &cfg.sizes {
                if verb == Verb::Send {
                    post_recvs(s, size, u64::from(cfg.rx_share()))?;
                }
                oob.key_again(&my0, &s.rem[0])?;
                let ours = if verb == Verb::Send {
                    // Both send and receive; the server sends once the client's
                    // first message is in.
                    let first_rx = AtomicBool::new(false);
                    std::thread::scope(|sc| {
                        let rx = sc.spawn(|| send_bw_server(s, size, Some(&first_rx)));
                        let deadline = Instant::now() + Duration::from_secs(60);
                        while !client && !first_rx.load(Ordering::Acquire) {
                            if Instant::now() > deadline || rx.is_finished() {
                                break;
                            }
                            std::thread::sleep(Duration::from_micros(50));
                        }
                        let sent = bw_client(s, size);
                        let got = rx.join().expect("the receiving thread");
                        got.and(sent)
                    })?
                } else {
                    bw_client(s, size)?
                };
                if cfg.sizes.len() > 1 {
                    oob.key_again(&my0, &s.rem[0])?;
                }
                let theirs = oob.report(&ours)?;
                print_bw(
                    &Report {
                        bw_peak: ours.bw_peak + theirs.bw_peak,
                        bw_avg: ours.bw_avg + theirs.bw_avg,
                        msg_rate: ours.msg_rate + theirs.msg_rate,
                        ..ours
                    },
                    cfg.gbits,
                );
            }
            outln!("{RESULT_LINE}");
            if cfg.verify {
                match verb {
                    Verb::Read => check_read(s)?,
                    _ => check_target(s, verb)?,
                }
            }
            oob.close(&my0)
        }
        (Test::WriteBw | Test::ReadBw | Test::AtomicBw, true) => {
            outln!("{RESULT_LINE}\n{}", bw_header(cfg.gbits));
            let mut last = Report::default();
            for &size in &cfg.sizes {
                last = bw_client(s, size)?;
                print_bw(&last, cfg.gbits);
            }
            outln!("{RESULT_LINE}");
            if cfg.verify && verb == Verb::Read {
                check_read(s)?;
            }
            oob.key_again(&my0, &s.rem[0])?;
            oob.report(&last)?;
            oob.close(&my0)
        }
        (Test::WriteBw | Test::ReadBw | Test::AtomicBw, false) => {
            outln!("{RESULT_LINE}\n{}", bw_header(cfg.gbits));
            // The end barrier: the client comes when it is done.
            oob.key_again(&my0, &s.rem[0])?;
            let theirs = oob.report(&Report::default())?;
            print_bw(&theirs, cfg.gbits);
            oob.close(&my0)?;
            outln!("{RESULT_LINE}");
            // A READ's data is checked where it lands: at the client.
            if cfg.verify && verb != Verb::Read {
                check_target(s, verb)?;
            }
            Ok(())
        }
        (Test::SendBw, client) => {
            outln!("{RESULT_LINE}\n{}", bw_header(cfg.gbits));
            for &size in &cfg.sizes {
                if !client {
                    post_recvs(s, size, u64::from(cfg.rx_share()))?;
                }
                oob.key_again(&my0, &s.rem[0])?;
                let r = if client {
                    bw_client(s, size)?
                } else {
                    send_bw_server(s, size, None)?
                };
                print_bw(&r, cfg.gbits);
                if cfg.sizes.len() > 1 {
                    oob.key_again(&my0, &s.rem[0])?;
                }
            }
            outln!("{RESULT_LINE}");
            if cfg.verify && !client {
                check_target(s, verb)?;
            }
            oob.close(&my0)
        }
        (Test::ReadLat | Test::AtomicLat, false) => {
            // The server only serves: its closing handshake waits for the client.
            oob.close(&my0)?;
            outln!("{RESULT_LINE}");
            Ok(())
        }
        (Test::ReadLat | Test::AtomicLat, true) => {
            outln!("{RESULT_LINE}\n{}", lat_header(cfg));
            for &size in &cfg.sizes {
                let clock = Window::new(cfg);
                let posted = lat_one_sided(s, size, clock)?;
                print_lat(size, cfg.iters, &posted, false, clock, cfg.list)?;
            }
            outln!("{RESULT_LINE}");
            if cfg.verify && verb == Verb::Read {
                check_lat(s, s.local(0), 0)?;
            }
            oob.close(&my0)
        }
        (Test::WriteLat, _) => {
            outln!("{RESULT_LINE}\n{}", lat_header(cfg));
            for &size in &cfg.sizes {
                let clock = Window::new(cfg);
                let posted = write_lat(s, size, clock)?;
                print_lat(size, cfg.iters, &posted, true, clock, cfg.list)?;
            }
            outln!("{RESULT_LINE}");
            // write_lat ends without a closing exchange: stay up until the
            // peer leaves, to acknowledge its last WRITE.
            oob.linger(Duration::from_secs(10));
            Ok(())
        }
        (Test::SendLat, _) => {
            outln!("{RESULT_LINE}\n{}", lat_header(cfg));
            for &size in &cfg.sizes {
                let posts = u64::from(cfg.rx_share()).min(cfg.iters);
                post_recvs_at(s, size, posts, true)?;
                oob.key_again(&my0, &s.rem[0])?;
                let clock = Window::new(cfg);
                let posted = send_lat(s, size, clock)?;
                print_lat(size, cfg.iters, &posted, true, clock, cfg.list)?;
            }
            outln!("{RESULT_LINE}");
            if cfg.verify {
                check_lat(s, s.target(0), if cfg.ud { GRH } else { 0 })?;
            }
            oob.close(&my0)
        }
    }
}

const WAITING: &str = "\n************************************\n* Waiting for client to connect... *\n************************************";

/// rdma_cm's MPA parameters for perftest's connections: IRD and ORD are its
/// outstanding reads on a READ test's data connections, else 0.
fn mpa_config(reads: u16) -> MpaConfig {
    MpaConfig {
        ird: reads,
        ord: reads,
        ..MpaConfig::default()
    }
}

/// How long a refused data-QP connection waits before its next attempt
/// (perftest's client: 100 ms).
const DATA_CONNECT_RETRY: Duration = Duration::from_millis(100);

/// rdma_cm's connection parameters over RoCE: READ depths as the MPA
/// configuration's IRD and ORD (at least 1).
fn rc_options(mpa: &MpaConfig) -> RcOptions {
    RcOptions {
        max_rd_atomic: mpa.ord.clamp(1, 128) as u8,
        max_dest_rd_atomic: mpa.ird.clamp(1, 128) as u8,
        ..RcOptions::default()
    }
}

/// Connects a QP with rdma_cm (over RoCE when `roce`); perftest's server
/// listens again for its data QPs only after a handshake, so a refused
/// connection is retried (10 times, [`DATA_CONNECT_RETRY`] apart, as
/// perftest's client does).
fn connect_data_qp(qp: &Qp, to: SocketAddrV4, mpa: &MpaConfig, roce: bool) -> Result<(), String> {
    let failed = |e: &dyn std::fmt::Display| format!("rdma_cm connection to {to}: {e}");
    if roce {
        retried(
            || roce::connect(qp, to, &[], &rc_options(mpa)),
            nothing_listens,
        )
        .map(drop)
        .map_err(|e| failed(&e))
    } else {
        retried(
            || iwarp::connect(qp, to, mpa),
            |e| {
                matches!(e, ConnectError::Tcp { source, .. }
                    if source.kind() == std::io::ErrorKind::ConnectionRefused)
            },
        )
        .map(drop)
        .map_err(|e| failed(&e))
    }
}

/// Runs `attempt` again while `unlistened` says nothing listens yet: 10
/// tries, [`DATA_CONNECT_RETRY`] apart, as perftest's client makes.
fn retried<T, E>(
    mut attempt: impl FnMut() -> Result<T, E>,
    unlistened: impl Fn(&E) -> bool,
) -> Result<T, E> {
    let mut tries = 0;
    loop {
        match attempt() {
            Err(e) if unlistened(&e) && tries < 9 => {
                tries += 1;
                std::thread::sleep(DATA_CONNECT_RETRY);
            }
            done => return done,
        }
    }
}

/// Over RoCE: nothing listens on the port (yet).
fn nothing_listens(e: &roce::ConnectError) -> bool {
    matches!(e, roce::ConnectError::Rejected { reason, .. } if *reason == REJ_INVALID_SERVICE_ID)
}

/// How long a UD server over rdma_cm waits for the client's handshake
/// datagram after answering its SIDR request.
const UD_HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// The handshake's work requests.
const UD_HANDSHAKE_WR: u64 = u64::MAX;

/// Finds the server's UD QP for `qp` with rdma_cm (SIDR), retried as
/// [`connect_data_qp`] while nothing listens; then, where the server
/// answers ([`Config::ud_cm_handshake`]), sends it the 4-byte SEND with
/// this QP's number as the immediate that tells it where to.
fn resolve_data_qp(
    cfg: &Config,
    (pd, mr, scq): (&Pd, &Mr, &Cq),
    qp: &Qp,
    to: SocketAddrV4,
) -> Result<roce_ud::Resolved, String> {
    let peer = retried(|| roce_ud::resolve(qp, to, &[]), nothing_listens)
        .map_err(|e| format!("rdma_cm UD resolution of {to}: {e}"))?;
    if !cfg.ud_cm_handshake() {
        return Ok(peer);
    }
    let ah = pd
        .create_ah(AhAttr {
            addr: SocketAddrV4::new(peer.peer, 4791),
        })
        .map_err(|e| e.to_string())?;
    qp.post_send(
        SendWr::new(
            UD_HANDSHAKE_WR,
            SendOp::SendWithImm(qp.qpn()),
            [mr.sge(0, 4)],
        )
        .to(ah.dest(peer.remote_qpn, peer.qkey)),
    )
    .map_err(|e| format!("the rdma_cm UD handshake: {e}"))?;
    match wait_one(scq, None, "client")? {
        Some(wc) if wc.wr_id == UD_HANDSHAKE_WR => Ok(peer),
        other => Err(format!("the rdma_cm UD handshake: unexpected {other:?}")),
    }
}

/// Answers the next SIDR request with `qp`; where the client sends a
/// handshake ([`Config::ud_cm_handshake`]), takes it (the receive posted
/// before the answer, to the SRQ if there is one, as perftest's server
/// does) and returns the QP it names in its immediate, as perftest's
/// server takes it.
fn accept_data_qp(
    cfg: &Config,
    l: &roce_ud::Listener,
    (rcq, mr, srq): (&Cq, &Mr, Option<&Srq>),
    qp: &Qp,
) -> Result<Option<u32>, String> {
    let handshake = cfg.ud_cm_handshake();
    if handshake {
        let at = mr.len() - (GRH + 4);
        let wr = RecvWr::new(UD_HANDSHAKE_WR, [mr.sge(at, (GRH + 4) as u32)]);
        match srq {
            Some(srq) => srq.post_recv(wr),
            None => qp.post_recv(wr),
        }
        .map_err(|e| e.to_string())?;
    }
    // The client is there (the exchange's handshake came): its requests
    // come at once.
    l.accept(
        qp,
        |_| roce::Decision::Accept(vec![]),
        Some(oob::SETUP_TIMEOUT),
    )
    .map_err(|e| format!("rdma_cm UD connection: {e}"))?;
    if !handshake {
        return Ok(None);
    }
    match rcq.wait(UD_HANDSHAKE_WAIT).map_err(|e| e.to_string())? {
        Some(wc) if wc.wr_id == UD_HANDSHAKE_WR && wc.status == WcStatus::Success => {
            Ok(Some(sender_qpn(&wc)))
        }
        Some(wc) => Err(format!(
            "the rdma_cm UD handshake: {:?} ({:?})",
            wc.status, wc.opcode
        )),
        None => Err(format!(
            "the rdma_cm UD handshake: no datagram from the client within {UD_HANDSHAKE_WAIT:?}"
        )),
    }
}

/// The QP a UD message's sender names in its immediate (udaddy's and
/// perftest's rdma_cm handshakes), else the one it came from.
pub(crate) fn sender_qpn(wc: &WorkCompletion) -> u32 {
    wc.imm.unwrap_or(wc.src_qp) & 0xff_ffff
}

/// Moves a RoCE QP to INIT, as rdma_create_qp leaves it: it takes
/// receives before rdma_cm connects it.
pub(crate) fn to_init(qp: &Qp) -> Result<(), String> {
    qp.modify(
        &QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC),
            ..QpAttr::default()
        },
        None,
    )
    .map_err(|e| e.to_string())
}

/// An rdma_cm listener: iWARP's or RoCE's.
enum CmListener {
    Iwarp(Listener),
    Roce(roce::Listener),
}

impl CmListener {
    fn bind(ctx: &Context, port: u16, roce: bool) -> Result<CmListener, String> {
        Ok(if roce {
            CmListener::Roce(roce::Listener::bind(ctx, port).map_err(|e| e.to_string())?)
        } else {
            CmListener::Iwarp(Listener::bind(ctx, port).map_err(|e| e.to_string())?)
        })
    }

    fn accept(&self, qp: &Qp, mpa: &MpaConfig) -> Result<(), String> {
        match self {
            CmListener::Iwarp(l) => l
                .accept(qp, mpa, |_| Decision::Accept)
                .map(drop)
                .map_err(|e| e.to_string()),
            CmListener::Roce(l) => l
                .accept(
                    qp,
                    &rc_options(mpa),
                    |_| roce::Decision::Accept(vec![]),
                    None,
                )
                .map(drop)
                .map_err(|e| e.to_string()),
        }
        .map_err(|e| format!("rdma_cm connection: {e}"))
    }
}

fn mtu_enum(m: Mtu) -> u8 {
    match m.bytes() {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    }
}

fn enum_mtu(e: u8) -> Mtu {
    Mtu::from_bytes(128 << e).unwrap_or(Mtu::Mtu1024)
}

/// Sources get the pattern; with --verify, targets start as zeros (so that a
/// transfer that did not happen shows).
fn fill(mr: &Mr, cfg: &Config, half: usize) -> Result<(), String> {
    let verb = cfg.test.verb();
    if cfg.test == Test::WriteLat {
        return Ok(()); // zeroed, as perftest's
    }
    let pat: Vec<u8> = (0..half).map(pattern).collect();
    let zeros = vec![0u8; half];
    for i in 0..2 * cfg.qps {
        let target_half = i >= cfg.qps;
        // Which half receives data on this side.
        // Bidirectional and latency runs receive on both sides.
        let both = cfg.duplex || cfg.test.is_lat();
        let receives = match verb {
            Verb::Read => !target_half && (cfg.client || both),
            Verb::Write | Verb::Send | Verb::Atomic => target_half && (!cfg.client || both),
        };
        let bytes = if cfg.verify && (receives || verb == Verb::Atomic) {
            &zeros
        } else {
            &pat
        };
        mr.write(i * half, bytes).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn print_header(cfg: &Config, a: &PerfArgs, dev: &str, mtu: Mtu) {
    let verb = cfg.test.verb();
    let name = match verb {
        Verb::Write => "RDMA_Write",
        Verb::Read => "RDMA_Read",
        Verb::Send => "Send",
        Verb::Atomic => "Atomic",
    };
    let atomic = match (verb, cfg.cas) {
        (Verb::Atomic, true) => "CMP_AND_SWAP ",
        (Verb::Atomic, false) => "FETCH_AND_ADD ",
        _ => "",
    };
    let kind = match (cfg.test.is_lat(), cfg.duplex) {
        (true, _) => "Latency",
        (false, true) => "Bidirectional BW",
        (false, false) => "BW",
    };
    outln!("{RESULT_LINE}");
    outln!("                    {name} {atomic}{kind} Test");
    outln!(" Dual-port       : OFF\t\tDevice         : {dev}");
    outln!(
        " Number of qps   : {}\t\tTransport type : {}",
        cfg.qps,
        match (cfg.cm && !cfg.roce_cm, cfg.shm) {
            (true, _) => "IW",
            (_, true) => "SHM",
            _ => "IB",
        }
    );
    outln!(
        " Connection type : {}\t\tUsing SRQ      : {}",
        if cfg.ud { "UD" } else { "RC" },
        if cfg.srq { "ON" } else { "OFF" }
    );
    outln!(" PCIe relax order: OFF");
    outln!(" ibv_wr* API     : OFF");
    if cfg.client || cfg.duplex {
        outln!(" TX depth        : {}", cfg.tx_depth);
    }
    if verb == Verb::Send && (!cfg.client || cfg.duplex) {
        outln!(" RX depth        : {}", cfg.rx_depth);
    }
    if !cfg.test.is_lat() {
        outln!(" CQ Moderation   : {}", cfg.cq_mod);
    }
    outln!(" Mtu             : {}[B]", mtu.bytes());
    outln!(" Link type       : Ethernet");
    outln!(" GID index       : {}", a.gid);
    if matches!(verb, Verb::Read | Verb::Atomic) {
        outln!(" Outstand reads  : {}", cfg.out_reads);
    } else {
        outln!(" Max inline data : {}[B]", cfg.inline);
    }
    if cfg.cm {
        outln!(" rdma_cm QPs\t : ON");
        outln!(" Data ex. method : rdma_cm");
    } else {
        outln!(" rdma_cm QPs\t : OFF");
        outln!(" Data ex. method : Ethernet");
    }
    outln!("{RESULT_LINE}");
}

fn print_addr(side: &str, k: &Key, verb: Verb) {
    let mut line = format!(
        " {side} address: LID {} QPN {} PSN {}",
        c_alt_hex(u64::from(k.lid), 4),
        c_alt_hex(u64::from(k.qpn), 6),
        c_alt_hex(u64::from(k.psn), 6)
    );
    if verb == Verb::Read {
        line.push_str(&format!(" OUT {}", c_alt_hex(u64::from(k.out_reads), 4)));
    }
    if matches!(verb, Verb::Read | Verb::Write) {
        line.push_str(&format!(
            " RKey {} VAddr {}",
            c_alt_hex(u64::from(k.rkey), 8),
            c_alt_hex(k.vaddr, 16)
        ));
    }
    outln!("{line}\n{}", gid_line(&k.gid));
}

fn print_bw(r: &Report, gbits: bool) {
    outln!(
        "{}",
        bw_row(r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate, gbits)
    );
}

fn lat_header(cfg: &Config) -> &'static str {
    if cfg.duration.is_some() {
        LAT_DURATION_HEADER
    } else {
        LAT_HEADER
    }
}

fn print_lat(
    size: u64,
    iters: u64,
    posted: &[Instant],
    halve: bool,
    clock: Option<Window>,
    list: Listing,
) -> Result<(), String> {
    if let Some(c) = clock {
        // perftest's duration report: the mean over the sampled iterations.
        let count = posted.iter().filter(|t| c.contains(**t)).count() as u64;
        if count == 0 {
            return Err("no iteration in the sampled part of the duration".into());
        }
        let avg = c.secs() * 1e6 / count as f64 / if halve { 2.0 } else { 1.0 };
        outln!(
            "{}",
            lat_duration_row(size, count, avg, count as f64 / c.secs())
        );
        return Ok(());
    }
    let deltas = post_deltas(posted, halve);
    if list != Listing::default() {
        use std::io::Write as _;
        // One lock and one buffer for what can be millions of lines.
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        if let Err(e) = write_lists(&mut out, &deltas, list).and_then(|()| out.flush()) {
            crate::output_failed(e);
        }
    }
    let stats = lat_stats(deltas).ok_or("too few iterations for latency figures")?;
    outln!("{}", lat_row(size, iters, &stats));
    Ok(())
}

fn completion_error(wc: &WorkCompletion, side: &str) -> String {
    format!(
        " Completion with error at {side}\n Failed status {}: wr_id {} syndrom 0x0 ({:?})",
        wc.status as u32, wc.wr_id, wc.status
    )
}

/// Duration mode's clock (perftest's): the run ends after the duration, and
/// the figures count what happens between margins of a quarter of it.
#[derive(Debug, Clone, Copy)]
struct Window {
    from: Instant,
    to: Instant,
    end: Instant,
}

impl Window {
    fn new(cfg: &Config) -> Option<Window> {
        let d = cfg.duration?;
        let start = Instant::now();
        Some(Window {
            from: start + d / 4,
            to: start + d - d / 4,
            end: start + d,
        })
    }

    fn over(&self) -> bool {
        Instant::now() >= self.end
    }

    fn contains(&self, t: Instant) -> bool {
        t >= self.from && t < self.to
    }

    fn secs(&self) -> f64 {
        (self.to - self.from).as_secs_f64().max(1e-9)
    }
}

/// How many send completions the bandwidth client waits for at once when
/// its queues are full: half of the signaled WRs in flight, so that a
/// blocking client wakes once per half queue, not once per completion (each
/// wake-up costs the thread that completes a few µs on these VMs), while the
/// other half keeps the wire busy. Busy-polling takes each as it comes.
fn reap_batch(s: &Setup, n: u64, scnt: &[u64], ccnt: &[u64]) -> usize {
    if s.cfg.busy_poll {
        return 1;
    }
    let m = u64::from(s.cfg.cq_mod);
    let signaled: u64 = scnt
        .iter()
        .zip(ccnt)
        .map(|(&sent, &done)| {
            // WR k is signaled when (k + 1) is a multiple of cq_mod, and the
            // last one always; completions come at those WRs.
            let last = u64::from(sent == n && done < n && !n.is_multiple_of(m));
            (sent / m - done / m) + last
        })
        .sum();
    (signaled / 2).max(1) as usize
}

/// How a wait for a completion ends after 60 s with none.
const NO_COMPLETION: &str = "no completion in 60 s: is the peer gone, or running another test?";
const NO_COMPLETION_LIMIT: Duration = Duration::from_secs(60);
/// How long a UD server waits for the next datagram once they flow: a
/// sender streams without pause, so a silence this long means the rest were
/// dropped (UD resends nothing). perftest waits 120 s to say so.
const UD_SILENCE: Duration = Duration::from_secs(10);

/// A sender that sees only RNR NAKs for two of these gives up: with
/// rnr_retry 7 (perftest's, "retry for good") a peer that posts no
/// receives, such as one running a WRITE test, would hold it for good.
const NO_RECEIVE_CHECK: Duration = Duration::from_secs(5);
const NO_RECEIVES: &str = "nothing completed in 10 s, and the peer answered with RNR NAKs \
     (it has no receive posted): does it run a SEND test too?";

/// RNR NAKs the RC QPs on RoCEv2 took (0 elsewhere).
fn rnr_naks_received(s: &Setup) -> u64 {
    s.qps
        .iter()
        .filter_map(|qp| qp.stats())
        .map(|t| t.rnr_naks_received)
        .sum()
}

/// How a wait in [`reap_until`] ended.
#[derive(Debug, PartialEq)]
enum Reaped {
    /// Completions are in the list.
    Got,
    /// The run's end came first.
    Ended,
    /// Nothing came within the limit.
    Silence,
}

/// Waits for at least `need` completions on `cq` (at least one), at most
/// `limit` or until `end`, and takes what is there.
fn reap_until(
    cq: &Cq,
    out: &mut Vec<WorkCompletion>,
    end: Option<Instant>,
    need: usize,
    limit: Duration,
) -> Result<Reaped, String> {
    out.clear();
    let mut more = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 64];
    // What is there already needs no clock (shm completes while posting).
    let n = cq.poll(&mut more).map_err(|e| e.to_string())?;
    if n > 0 {
        out.extend_from_slice(&more[..n]);
        return Ok(Reaped::Got);
    }
    let wait = end.map_or(limit, |e| {
        e.saturating_duration_since(Instant::now()).min(limit)
    });
    if need > 1 {
        out.extend(cq.wait_for(need, wait).map_err(|e| e.to_string())?);
    } else {
        // One at a time without a list (the blocking client's common case).
        out.extend(cq.wait(wait).map_err(|e| e.to_string())?);
    }
    if out.is_empty() {
        if end.is_some_and(|e| Instant::now() >= e) {
            return Ok(Reaped::Ended);
        }
        return Ok(Reaped::Silence);
    }
    let n = cq.poll(&mut more).map_err(|e| e.to_string())?;
    out.extend_from_slice(&more[..n]);
    Ok(Reaped::Got)
}

/// Waits for one completion (at most 60 s, or until `end`: then `None`).
fn wait_one(cq: &Cq, end: Option<Instant>, side: &str) -> Result<Option<WorkCompletion>, String> {
    // A completion already there (shm completes on the poster's thread)
    // needs no clock.
    if let Some(wc) = cq.poll_one().map_err(|e| e.to_string())? {
        if wc.status != WcStatus::Success {
            return Err(completion_error(&wc, side));
        }
        return Ok(Some(wc));
    }
    let limit = Duration::from_secs(60);
    let wait = end.map_or(limit, |e| {
        e.saturating_duration_since(Instant::now()).min(limit)
    });
    match cq.wait(wait).map_err(|e| e.to_string())? {
        Some(wc) if wc.status != WcStatus::Success => Err(completion_error(&wc, side)),
        Some(wc) => Ok(Some(wc)),
        None if end.is_some_and(|e| Instant::now() >= e) => Ok(None),
        None => Err(NO_COMPLETION.into()),
    }
}

/// As [`wait_one`], spinning (polling, now and then yielding) instead of
/// blocking.
fn spin_one(
    cq: &Cq,
    end: Option<Instant>,
    side: &str,
    pause: bool,
) -> Result<Option<WorkCompletion>, String> {
    // The clock is read only once the spin is long: a read costs as much
    // as the rest of a shared-memory post.
    let mut deadline = None;
    let mut spins = 0u32;
    loop {
        if let Some(wc) = cq.poll_one().map_err(|e| e.to_string())? {
            if wc.status != WcStatus::Success {
                return Err(completion_error(&wc, side));
            }
            return Ok(Some(wc));
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            let now = Instant::now();
            if end.is_some_and(|e| now >= e) {
                return Ok(None);
            }
            if now > *deadline.get_or_insert(now + Duration::from_secs(60)) {
                return Err(NO_COMPLETION.into());
            }
            std::thread::yield_now();
        } else if pause {
            std::hint::spin_loop();
        }
    }
}

fn send_op(s: &Setup, i: usize, size: u64, k: u64, signaled: bool) -> SendWr {
    let step = s.step(s.span(size), k);
    let sge = s.mr.sge(s.local(i) + step, size as u32);
    // A peer's absurd address wraps here, and the peer refuses the access.
    let remote_addr = s.rem[i].vaddr.wrapping_add(step as u64);
    let rkey = s.rem[i].rkey;
    let op = match s.cfg.test.verb() {
        Verb::Write => SendOp::Write { remote_addr, rkey },
        Verb::Read => SendOp::Read { remote_addr, rkey },
        Verb::Send => SendOp::Send,
        Verb::Atomic if s.cfg.cas => SendOp::CompareSwap {
            remote_addr,
            rkey,
            compare: 0,
            swap: 0,
        },
        Verb::Atomic => SendOp::FetchAdd {
            remote_addr,
            rkey,
            add: 1,
        },
    };
    let inline = (size <= u64::from(s.cfg.inline)
        && matches!(s.cfg.test.verb(), Verb::Write | Verb::Send))
    .then(|| {
        let mut data = InlineData::from_elem(0, size as usize);
        s.mr.read(s.local(i) + step, &mut data).ok().map(|_| data)
    })
    .flatten();
    let mut sgl = softrdma::engine::SgList::new();
    if inline.is_none() {
        sgl.push(sge);
    }
    // One struct expression, built in the caller's slot: the builder's
    // moves were a 136-byte memcpy per post (a fifth of the client's time
    // in an 8-byte shared-memory stream).
    SendWr {
        wr_id: ((i as u64) << 40) | k,
        op,
        sgl,
        flags: SendFlags {
            signaled,
            fence: false,
            solicited: false,
            inline: inline.is_some(),
        },
        inline_data: inline.unwrap_or_default(),
        ud: s.ahs.get(i).map(|ah| {
            let qpn = s.ud_peer_qpns.get(i).copied().flatten();
            ah.dest(qpn.unwrap_or(s.rem[i].qpn), s.cfg.qkey())
        }),
    }
}

/// A latency test's work request (always the same address, no stepping):
/// built once and copied for each post, as perftest posts the one WR it
/// built; built for each post only inline, whose bytes are read then.
struct LatencyWr(Option<SendWr>);

impl LatencyWr {
    fn new(s: &Setup, size: u64) -> LatencyWr {
        let wr = send_op(s, 0, size, 0, true);
        LatencyWr((!wr.flags.inline).then_some(wr))
    }

    fn post(&self, s: &Setup, size: u64, wr_id: u64) -> Result<(), String> {
        let mut wr = match &self.0 {
            Some(wr) => wr.clone(),
            None => send_op(s, 0, size, 0, true),
        };
        wr.wr_id = wr_id;
        s.qps[0].post_send(wr).map_err(|e| e.to_string())
    }
}

/// The client's side of a BW test: `iters` messages per QP (or until the
/// duration ends), tx_depth outstanding, one completion in cq_mod signaled.
fn bw_client(s: &Setup, size: u64) -> Result<Report, String> {
    let cfg = &s.cfg;
    let n = if cfg.duration.is_some() {
        u64::MAX
    } else {
        cfg.iters
    };
    let q = cfg.qps;
    let cq_mod = u64::from(cfg.cq_mod);
    let mut scnt = vec![0u64; q];
    let mut ccnt = vec![0u64; q];
    // Post time of the first WR of each signaled window, per QP.
    // perftest forces "no peak" above 20000 iterations and in duration
    // mode: then no window is timed.
    let track_peak = cfg.duration.is_none() && cfg.iters <= 20_000;
    let mut window_start: Vec<Vec<Instant>> = vec![Vec::new(); q];
    // Completed windows: post time of their first WR, completion, WRs.
    let mut windows: Vec<(Instant, Instant, u64)> = Vec::new();
    let start = Instant::now();
    let clock = Window::new(cfg);
    let mut sampled = 0u64;
    let mut wcs = Vec::new();
    loop {
        // Duration mode ends on time, with work still in flight (as
        // perftest: the peer may have stopped posting receives).
        if clock.is_some_and(|c| c.over()) {
            break;
        }
        let mut starved = false;
        for i in 0..q {
            while scnt[i] < n && scnt[i] - ccnt[i] < u64::from(cfg.tx_depth) {
                // The receiver refills before it counts, so it holds a
                // receive for each of the share beyond its count.
                if let Some(c) = &s.credit
                    && scnt[i].saturating_sub(c.received(i)) >= u64::from(cfg.rx_share())
                {
                    starved = true;
                    break;
                }
                let k = scnt[i];
                let signaled = k % cq_mod == cq_mod - 1 || k == n - 1;
                if k.is_multiple_of(cq_mod) && track_peak {
                    window_start[i].push(Instant::now());
                }
                s.qps[i]
                    .post_send(send_op(s, i, size, k, signaled))
                    .map_err(|e| e.to_string())?;
                scnt[i] += 1;
            }
        }
        if (0..q).all(|i| ccnt[i] >= n) {
            break;
        }
        if starved {
            // Credits arrive as RDMA WRITEs, which complete nothing here
            // (and unsignaled sends may be all that is in flight): look
            // again shortly.
            wcs.clear();
            let mut got = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 64];
            let n = s.scq.poll(&mut got).map_err(|e| e.to_string())?;
            wcs.extend_from_slice(&got[..n]);
            if n == 0 {
                // A peer that went away grants nothing more: its QP is in
                // ERR, with nothing of ours in flight to complete.
                if let Some(qp) = s.qps.iter().find(|qp| qp.state() == QpState::Err) {
                    return Err(format!(
                        "client: QP {:#x} failed while waiting for receive credits: \
                         the peer is gone?",
                        qp.qpn()
                    ));
                }
                std::thread::sleep(Duration::from_micros(20));
                continue;
            }
        } else {
            // The RNR count is read only in a silence: it takes the QPs'
            // locks, which the busy path should not.
            let mut silent = Duration::ZERO;
            let mut rnr_before = None;
            let ended = loop {
                match reap_until(
                    &s.scq,
                    &mut wcs,
                    clock.map(|c| c.end),
                    reap_batch(s, n, &scnt, &ccnt),
                    NO_RECEIVE_CHECK,
                )? {
                    Reaped::Got => break false,
                    Reaped::Ended => break true,
                    Reaped::Silence => {
                        // In duration mode a peer whose run ended first
                        // stops posting receives: the run's end decides.
                        if clock.is_none() {
                            let rnr = rnr_naks_received(s);
                            if rnr_before.is_some_and(|before| rnr > before) {
                                return Err(NO_RECEIVES.into());
                            }
                            rnr_before = Some(rnr);
                        }
                        silent += NO_RECEIVE_CHECK;
                        if silent >= NO_COMPLETION_LIMIT {
                            return Err(NO_COMPLETION.into());
                        }
                    }
                }
            };
            if ended {
                break;
            }
        }
        // The clock only where a figure needs it (perftest reads it per
        // completion only for the peak): at 64 KiB on shared memory a
        // reading is 2 % of an operation.
        let now = if clock.is_some() || track_peak {
            Instant::now()
        } else {
            start
        };
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                return Err(completion_error(wc, "client"));
            }
            let i = (wc.wr_id >> 40) as usize;
            let k = wc.wr_id & ((1 << 40) - 1);
            let done = k + 1 - ccnt[i];
            ccnt[i] = k + 1;
            match clock {
                Some(c) if c.contains(now) => sampled += done,
                Some(_) => {}
                None if track_peak => {
                    if let Some(t0) = window_start[i].get((k / cq_mod) as usize) {
                        windows.push((*t0, now, done));
                    }
                }
                None => {}
            }
        }
    }
    // The loop ends at the last completion.
    let last = Instant::now();
    let (msgs, secs) = match clock {
        Some(c) => (sampled, c.secs()),
        None => (n * q as u64, (last - start).as_secs_f64().max(1e-9)),
    };
    let bytes_per_sec = (msgs * size) as f64 / secs;
    let peak = if !track_peak {
        0.0
    } else {
        peak_rate(&windows, size)
    };
    Ok(Report {
        size,
        // perftest's rows count the iterations of all QPs.
        iters: if cfg.duration.is_some() {
            msgs
        } else {
            cfg.iters * q as u64
        },
        bw_peak: if cfg.duration.is_some() {
            0.0
        } else {
            bw_unit(peak, cfg.gbits)
        },
        bw_avg: bw_unit(bytes_per_sec, cfg.gbits),
        msg_rate: msgs as f64 / secs / 1e6,
    })
}

/// perftest's peak: the best rate over any run of consecutive completed
/// windows (from the first post of the run to its last completion). Runs
/// start at up to 512 evenly spread windows, to keep this quadratic search
/// short.
fn peak_rate(windows: &[(Instant, Instant, u64)], size: u64) -> f64 {
    let stride = windows.len().div_ceil(512).max(1);
    let mut best = 0f64;
    for i in (0..windows.len()).step_by(stride) {
        let mut first_post = windows[i].0;
        let mut count = 0;
        for w in &windows[i..] {
            first_post = first_post.min(w.0);
            count += w.2;
            let secs = (w.1 - first_post).as_secs_f64();
            if secs > 0.0 {
                best = best.max((count * size) as f64 / secs);
            }
        }
    }
    best
}

/// Posts `count` receives of `size` on each QP, stepping through the target
/// area (or all at its start).
fn post_recvs_at(s: &Setup, size: u64, count: u64, same_place: bool) -> Result<(), String> {
    for i in 0..s.qps.len() {
        for k in 0..count {
            let step = if same_place {
                0
            } else {
                s.step(s.span(size), k)
            };
            s.post_recv(
                i,
                RecvWr::new(
                    ((i as u64) << 40) | k,
                    [s.mr.sge(s.target(i) + step, s.span(size) as u32)],
                ),
            )?;
        }
    }
    Ok(())
}

fn post_recvs(s: &Setup, size: u64, count: u64) -> Result<(), String> {
    post_recvs_at(s, size, count.min(s.cfg.iters), false)
}

/// The send_bw server: counts the messages that landed after the first
/// poll that found any, over the time from that poll to the last.
fn send_bw_server(s: &Setup, size: u64, first_rx: Option<&AtomicBool>) -> Result<Report, String> {
    let cfg = &s.cfg;
    let q = cfg.qps;
    let clock = Window::new(cfg);
    let n = if clock.is_some() { u64::MAX } else { cfg.iters };
    let mut posted = vec![u64::from(cfg.rx_share()).min(n); q];
    let mut received = vec![0u64; q];
    let mut grants_in_flight = 0u32;
    let mut sampled = 0u64;
    let mut got = 0u64;
    let mut first = None;
    let mut first_batch = 0u64;
    let waiting_since = Instant::now();
    let mut last = waiting_since;
    let mut wcs = Vec::new();
    while got < n.saturating_mul(q as u64) {
        let ud_flowing = cfg.ud && got > 0 && clock.is_none();
        let limit = if ud_flowing {
            UD_SILENCE
        } else {
            NO_COMPLETION_LIMIT
        };
        match reap_until(&s.rcq, &mut wcs, clock.map(|c| c.end), 1, limit)? {
            Reaped::Got => {}
            Reaped::Ended => break,
            Reaped::Silence if ud_flowing => {
                let counted: Vec<_> = s.qps.iter().filter_map(|qp| qp.ud_stats()).collect();
                let dropped = if counted.is_empty() {
                    String::new()
                } else {
                    let n: u64 = counted.iter().map(|u| u.no_receive).sum();
                    format!(
                        " ({n} found no receive posted; any others were lost to a full \
                         socket buffer)"
                    )
                };
                return Err(format!(
                    "received {got} of {} datagrams, then none for {} s: UD resends nothing. \
                     Either the peer stopped sending, or this side took them slower than it \
                     sent{dropped}: fewer iterations (-n), a deeper receive queue (-r), busy \
                     polling or RC avoid that",
                    n.saturating_mul(q as u64),
                    UD_SILENCE.as_secs()
                ));
            }
            Reaped::Silence => return Err(NO_COMPLETION.into()),
        }
        let now = Instant::now();
        if clock.is_some_and(|c| c.contains(now)) {
            sampled += wcs.len() as u64;
        }
        if first.is_none() {
            first = Some(now);
            first_batch = wcs.len() as u64;
        }
        if let Some(f) = first_rx {
            f.store(true, Ordering::Release);
        }
        last = now;
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                return Err(completion_error(wc, "server"));
            }
            got += 1;
            // The receive is refilled for the QP that posted it; the
            // message is counted for the one that took it (another, on an
            // SRQ).
            let owner = (wc.wr_id >> 40) as usize;
            let i = s.receiving_qp(wc);
            received[i] += 1;
            if posted[owner] < n {
                let k = posted[owner];
                let span = s.span(size);
                s.post_recv(
                    owner,
                    RecvWr::new(
                        ((owner as u64) << 40) | k,
                        [s.mr.sge(s.target(owner) + s.step(span, k), span as u32)],
                    ),
                )?;
                posted[owner] += 1;
            }
            if let Some(c) = &s.credit
                && (received[i] % u64::from(cfg.rx_share())).is_multiple_of(c.every)
            {
                grant(s, i, received[i], &mut grants_in_flight)?;
            }
        }
    }
    let total = if clock.is_some() {
        sampled
    } else {
        n * q as u64
    };
    let (timed, secs) = match clock {
        Some(c) => (sampled, c.secs()),
        // The first poll's messages landed at some time before it: the
        // clock starts there.
        None if got > first_batch => (
            got - first_batch,
            (last - first.unwrap_or(last)).as_secs_f64().max(1e-9),
        ),
        None => {
            eprintln!(
                "softrdma perf: all {got} messages landed before the server's first poll: \
                 its rate counts from when it began to wait (more -n to time them)"
            );
            (got, (last - waiting_since).as_secs_f64().max(1e-9))
        }
    };
    Ok(Report {
        size,
        iters: total,
        bw_peak: 0.0,
        bw_avg: bw_unit((timed * size) as f64 / secs, cfg.gbits),
        msg_rate: timed as f64 / secs / 1e6,
    })
}

/// Sends the peer the credit of QP `i`: an RDMA WRITE of `count` into its
/// credit area, inline (so that later counts cannot tear it). At most
/// tx_depth of these are in flight.
fn grant(s: &Setup, i: usize, count: u64, in_flight: &mut u32) -> Result<(), String> {
    let mut done = [WorkCompletion::new(0, WcStatus::Success, WcOpcode::Send, 0); 16];
    loop {
        let n = if *in_flight >= s.cfg.tx_depth {
            match wait_one(&s.scq, None, "server")? {
                Some(_) => 1,
                None => 0,
            }
        } else {
            let n = s.scq.poll(&mut done).map_err(|e| e.to_string())?;
            if let Some(wc) = done[..n].iter().find(|w| w.status != WcStatus::Success) {
                return Err(completion_error(wc, "server"));
            }
            n
        };
        *in_flight -= n as u32;
        if *in_flight < s.cfg.tx_depth {
            break;
        }
    }
    let r = &s.rem[i];
    let wr = SendWr::new(
        u64::MAX,
        SendOp::Write {
            remote_addr: r.vaddr,
            rkey: r.rkey,
        },
        [],
    )
    .inline(&(count as u32).to_le_bytes());
    s.qps[i].post_send(wr).map_err(|e| e.to_string())?;
    *in_flight += 1;
    Ok(())
}

/// READ or atomic latency: one at a time; returns the post times.
fn lat_one_sided(s: &Setup, size: u64, clock: Option<Window>) -> Result<Vec<Instant>, String> {
    let n = if clock.is_some() {
        u64::MAX
    } else {
        s.cfg.iters
    };
    let end = clock.map(|c| c.end);
    let mut posted = Vec::new();
    let wr = LatencyWr::new(s, size);
    for k in 0..n {
        if clock.is_some_and(|c| c.over()) {
            break;
        }
        posted.push(Instant::now());
        wr.post(s, size, k)?;
        if wait_one(&s.scq, end, "client")?.is_none() {
            break;
        }
    }
    Ok(posted)
}

/// WRITE ping-pong: each side writes `size` bytes whose last byte counts the
/// iterations, and watches the last byte of its own target area.
fn write_lat(s: &Setup, size: u64, clock: Option<Window>) -> Result<Vec<Instant>, String> {
    let n = if clock.is_some() {
        u64::MAX
    } else {
        s.cfg.iters
    };
    let end = clock.map(|c| c.end);
    let last = size as usize - 1;
    let watch = s.target(0) + last;
    // The byte is polled through a plain load of its aligned word.
    let (word_at, byte) = (watch & !7, watch & 7);
    let mut posted = Vec::new();
    let wr = LatencyWr::new(s, size);
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    'run: while scnt < n || rcnt < n {
        // The server writes first; the client waits for it.
        let server_first = !s.cfg.client && scnt == 0;
        if rcnt < n && !server_first {
            rcnt += 1;
            let want = rcnt as u8;
            let mut deadline = None;
            let mut spins = 0u32;
            loop {
                let w = s.mr.load_u64(word_at).map_err(|e| e.to_string())?;
                if w.to_ne_bytes()[byte] == want {
                    break;
                }
                // perftest spins on the byte; so does this, looking at the
                // clock and giving the CPU away only now and then (in
                // busy-poll mode, receiving the peer's WRITE meanwhile).
                if s.cfg.busy_poll {
                    s.scq.progress();
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) {
                    if clock.is_some_and(|c| c.over()) {
                        break 'run;
                    }
                    let now = Instant::now();
                    if now > *deadline.get_or_insert(now + Duration::from_secs(60)) {
                        return Err(format!("no WRITE {rcnt} from the peer in 60 s"));
                    }
                    std::thread::yield_now();
                } else if s.cfg.pause_in_spins {
                    std::hint::spin_loop();
                }
            }
        }
        if scnt < n {
            scnt += 1;
            s.mr.write(s.local(0) + last, &[scnt as u8])
                .map_err(|e| e.to_string())?;
            posted.push(Instant::now());
            wr.post(s, size, scnt)?;
            // The send completion is spun for too, as perftest does: this
            // thread spins on the target memory anyway, and a blocking
            // wait would put a second wake-up (after the receiving
            // thread's) on every half round trip.
            if spin_one(&s.scq, end, side(s), s.cfg.pause_in_spins)?.is_none() {
                break;
            }
        }
    }
    Ok(posted)
}

/// The next completion of `cq`: spun for in busy-poll mode (as perftest's
/// polling does), waited for otherwise.
fn next_one(s: &Setup, cq: &Cq, end: Option<Instant>) -> Result<Option<WorkCompletion>, String> {
    if s.cfg.busy_poll {
        spin_one(cq, end, side(s), s.cfg.pause_in_spins)
    } else {
        wait_one(cq, end, side(s))
    }
}

fn side(s: &Setup) -> &'static str {
    if s.cfg.client { "client" } else { "server" }
}

/// SEND ping-pong: the client sends first; each side answers a receive.
fn send_lat(s: &Setup, size: u64, clock: Option<Window>) -> Result<Vec<Instant>, String> {
    let n = if clock.is_some() {
        u64::MAX
    } else {
        s.cfg.iters
    };
    let end = clock.map(|c| c.end);
    let rx_depth = u64::from(s.cfg.rx_share()).min(n);
    let mut posted = Vec::new();
    let wr = LatencyWr::new(s, size);
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    while scnt < n || rcnt < n {
        // The client sends first; the server waits for it.
        let client_first = s.cfg.client && scnt == 0;
        if rcnt < n && !client_first {
            if next_one(s, &s.rcq, end)?.is_none() {
                break;
            }
            rcnt += 1;
            if rcnt.saturating_add(rx_depth) <= n {
                s.post_recv(
                    0,
                    RecvWr::new(rcnt, [s.mr.sge(s.target(0), s.span(size) as u32)]),
                )?;
            }
        }
        if scnt < n {
            if clock.is_some_and(|c| c.over()) {
                break;
            }
            posted.push(Instant::now());
            wr.post(s, size, scnt)?;
            scnt += 1;
            if next_one(s, &s.scq, end)?.is_none() {
                break;
            }
        }
    }
    Ok(posted)
}

/// The slots a test's messages landed in (offsets within an area).
fn slots(s: &Setup, size: u64) -> Vec<usize> {
    let count = s.cfg.iters.min((s.cycle / 64) as u64 + 1);
    let mut v: Vec<usize> = (0..count).map(|k| s.step(s.span(size), k)).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// --verify on the target side: WRITE and SEND payloads are the source
/// pattern, FETCH_ADDs added up to the iterations.
fn check_target(s: &Setup, verb: Verb) -> Result<(), String> {
    let size = *s.cfg.sizes.last().expect("a size");
    for i in 0..s.cfg.qps {
        let base = s.target(i);
        if verb == Verb::Atomic {
            let sum: u64 = slots(s, size)
                .iter()
                .map(|&o| s.mr.load_u64(base + o).unwrap_or(0))
                .sum();
            let want = if s.cfg.cas { 0 } else { s.cfg.iters };
            if sum != want {
                return Err(format!(
                    "--verify: QP {i}'s counters add up to {sum}, expected {want} \
                     (does the peer run with --verify?)"
                ));
            }
            continue;
        }
        let grh = if s.cfg.ud { GRH } else { 0 };
        let all = slots(s, size);
        for &o in &all {
            let got =
                s.mr.read_vec(base + o + grh, size as usize)
                    .map_err(|e| e.to_string())?;
            // On an SRQ a message may land in a receive another QP posted,
            // at another step: it is then some slot's message, whole.
            let elsewhere =
                || s.srq.is_some() && all.iter().any(|&from| mismatch(&got, from).is_none());
            if let Some(j) = mismatch(&got, o)
                && !elsewhere()
            {
                return Err(format!(
                    "--verify: QP {i}, byte {} of the message at offset {o} is {:#04x}, \
                     expected {:#04x} (does the peer run with --verify?)",
                    j,
                    got[j],
                    pattern(o + j)
                ));
            }
        }
    }
    outln!(" Payload check (--verify): OK");
    Ok(())
}

/// --verify after a latency run: the last message (SEND received, or READ
/// returned) at `at` (after `skip` bytes of GRH) is the peer's pattern.
fn check_lat(s: &Setup, at: usize, skip: usize) -> Result<(), String> {
    let size = *s.cfg.sizes.last().expect("a size") as usize;
    let got = s.mr.read_vec(at + skip, size).map_err(|e| e.to_string())?;
    if let Some(j) = mismatch(&got, 0) {
        return Err(format!(
            "--verify: byte {j} of the last message is {:#04x}, expected {:#04x} \
             (does the peer run with --verify?)",
            got[j],
            pattern(j)
        ));
    }
    outln!(" Payload check (--verify): OK");
    Ok(())
}

/// --verify on a READ client: what came back is the target's pattern.
fn check_read(s: &Setup) -> Result<(), String> {
    let size = *s.cfg.sizes.last().expect("a size");
    for i in 0..s.cfg.qps {
        for o in slots(s, size) {
            let got =
                s.mr.read_vec(s.local(i) + o, size as usize)
                    .map_err(|e| e.to_string())?;
            if let Some(j) = mismatch(&got, o) {
                return Err(format!(
                    "--verify: QP {i}, byte {j} read at offset {o} is {:#04x}, expected \
                     {:#04x} (does the peer run with --verify?)",
                    got[j],
                    pattern(o + j)
                ));
            }
        }
    }
    outln!(" Payload check (--verify): OK");
    Ok(())
}

/// Where message `k` of `size` bytes goes in a `cycle`-byte cycle buffer:
/// perftest's INC (the size rounded up to whole cache lines) times `k`,
/// wrapped; 0 for messages larger than half the cycle (they do not step).
/// Every post asks, so where the sizes are powers of two (the usual page
/// and cache line) it shifts and masks: a division costs about as much as
/// the rest of a shared-memory post.
fn message_step(size: usize, k: usize, cycle: usize, line: usize) -> usize {
    if size > cycle / 2 {
        return 0;
    }
    let inc = if line.is_power_of_two() {
        ((size + line - 1) & !(line - 1)).max(line)
    } else {
        size.div_ceil(line).max(1) * line
    };
    let slot = if cycle.is_power_of_two() && inc.is_power_of_two() {
        k & ((cycle >> inc.trailing_zeros()) - 1)
    } else {
        k % (cycle / inc)
    };
    slot * inc
}

#[cfg(test)]
mod tests {
    use super::message_step;

    #[test]
    fn message_steps_match_perftests_formula() {
        for (cycle, line) in [
            (4096usize, 64usize),
            (8192, 128),
            (4096, 48),
            (6000, 64),
            (65536, 64),
        ] {
            for size in [
                0usize, 1, 2, 8, 63, 64, 65, 100, 128, 1000, 2048, 2049, 3000, 4096,
            ] {
                for k in [0usize, 1, 2, 3, 31, 63, 64, 65, 1000, 123_457] {
                    let want = if size > cycle / 2 {
                        0
                    } else {
                        let inc = size.div_ceil(line).max(1) * line;
                        (k % (cycle / inc)) * inc
                    };
                    assert_eq!(
                        message_step(size, k, cycle, line),
                        want,
                        "size {size} k {k} cycle {cycle} line {line}"
                    );
                }
            }
        }
    }
}
