//! The `softrdma` command.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// `println!` for output that may go to a pipe which closes early (`softrdma
/// perf ... | head`): a closed pipe ends the tool quietly, as SIGPIPE ends
/// the C tools, instead of a panic. (SIGPIPE itself stays ignored: the
/// providers' sockets must report a vanished peer as an error.)
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            $crate::output_failed(e);
        }
    }};
}

/// Ends the tool after a failed write to stdout: quietly (status 0) when the
/// reader has gone, with a message otherwise.
fn output_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("softrdma: writing the output: {e}");
    std::process::exit(1)
}

mod decode;
mod demo;
mod device;
mod exchange;
mod perf;
mod ping;
mod rping;
mod udaddy;

/// RDMA verbs in Rust over RoCEv2, iWARP and shared memory.
#[derive(Debug, Parser)]
#[command(name = "softrdma", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Ping-pong SENDs with a peer, as ibv_rc_pingpong / ibv_ud_pingpong do
    /// (same out-of-band exchange on TCP 18515, same traffic, same report).
    ///
    /// Without HOST, wait for a client. Both sides' devices use UDP port 4791
    /// unless --udp-port says otherwise, so two processes on one host need two
    /// addresses (e.g. --bind 127.0.0.1 and --bind 127.0.0.2), or
    /// --shared-port on both.
    Ping(ping::PingArgs),
    /// Run every RC operation between two endpoints over RoCEv2 on loopback,
    /// from 1 byte to 1 MiB, and verify each result.
    ///
    /// Two devices on the given address (ephemeral UDP ports), one RC queue pair
    /// each: SEND, SEND with immediate, RDMA WRITE (with immediate), RDMA READ,
    /// compare-and-swap and fetch-and-add. Exits 0 only if everything verified.
    Demo {
        /// Local IPv4 address for both endpoints.
        #[arg(long, default_value = "127.0.0.1")]
        addr: std::net::Ipv4Addr,
        /// Busy-poll: the demo thread spins on completions and receives the devices' packets itself instead of sleeping (lower latency, burns CPU).
        #[arg(long)]
        busy_poll: bool,
        /// Run it on this libibverbs device instead (rxe0, mlx5_0): both queue
        /// pairs on it, the device looping back (--addr is then unused).
        #[arg(long, value_name = "DEVICE")]
        ibverbs: Option<String>,
    },
    /// perftest's bandwidth and latency tests (ib_write_bw, ib_read_lat ...),
    /// compatible with perftest 4.5 in both roles: same flags, same TCP
    /// exchange on port 18515, same output.
    ///
    /// Without HOST, wait for a client. Completion waits block unless
    /// --busy-poll. --verify (both sides softrdma) checks the payload.
    Perf(perf::PerfArgs),
    /// rdma-core's rping over iWARP (TCP, MPA): the client SENDs its buffer's
    /// address, the server READs it, then WRITEs it back; compatible with
    /// rping on Linux siw in both roles.
    Rping(rping::RpingArgs),
    /// rdma-core's udaddy over RoCEv2: the client finds the server's UD QP
    /// with rdma_cm (SIDR, port 7174 of the UDP port space) and SENDs it
    /// messages, which the server answers; compatible with udaddy on Linux
    /// rxe in both roles.
    Udaddy(udaddy::UdaddyArgs),
    /// List the RoCEv2 devices (one per IPv4 address of each interface that
    /// is up, named roce_<netdev>) with their GID tables.
    Devices,
    /// Share one RoCEv2 address (IP and UDP port 4791) among the processes
    /// of this host: own the port and hand each datagram to the process
    /// whose QPs carry the destination QPN's top byte.
    ///
    /// Processes join with `Device::shared_port`, `--shared-port` or
    /// SOFTRDMA_PORT_SHARING=hostd; the first to find no daemon starts one.
    Hostd {
        /// The address to share, e.g. 10.0.0.1:4791.
        addr: std::net::SocketAddrV4,
        /// Leave after this many seconds with no process connected.
        #[arg(long, value_name = "SECS")]
        exit_when_idle: Option<f64>,
    },
    /// Print the RoCEv2 and iWARP packets of a pcap or pcapng capture, one per line.
    ///
    /// RoCEv2 is UDP to port 4791 (add more with --roce-port); iWARP is found on TCP
    /// streams that start with an MPA Request/Reply. Every ICRC and MPA CRC32c is
    /// checked. The exit status is 1 if any packet fails to decode or a check fails.
    Decode {
        /// The capture file (pcap or pcapng; Ethernet, Linux cooked or raw IP).
        file: PathBuf,
        /// Also decode UDP datagrams to this port as RoCEv2 (repeatable).
        #[arg(long = "roce-port", value_name = "PORT")]
        roce_ports: Vec<u16>,
        /// Print only the problems and the summary.
        #[arg(short, long)]
        quiet: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Decode {
            file,
            roce_ports,
            quiet,
        } => decode::run(&file, &roce_ports, quiet),
        Command::Ping(args) => ping::run(&args),
        Command::Devices => device::list(),
        Command::Perf(args) => perf::run(&args),
        Command::Rping(args) => rping::run(&args),
        Command::Udaddy(args) => udaddy::run(&args),
        Command::Demo {
            addr,
            busy_poll,
            ibverbs,
        } => demo::run(&addr.to_string(), busy_poll, ibverbs.as_deref()),
        Command::Hostd {
            addr,
            exit_when_idle,
        } => hostd(addr, exit_when_idle),
    }
}

fn hostd(addr: std::net::SocketAddrV4, exit_when_idle: Option<f64>) -> ExitCode {
    let linger = match exit_when_idle.map(std::time::Duration::try_from_secs_f64) {
        None => None,
        Some(Ok(d)) => Some(d),
        Some(Err(_)) => {
            eprintln!("softrdma hostd: --exit-when-idle needs a number of seconds >= 0");
            return ExitCode::from(2);
        }
    };
    let mut daemon = match softrdma::provider::hostd::Hostd::bind(addr) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("softrdma hostd: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(l) = linger {
        daemon = daemon.exit_when_idle(l);
    }
    let stats = daemon.stats();
    let result = daemon.run();
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "softrdma hostd {addr}: {} processes joined ({} of another user refused), {} \
         datagrams forwarded, {} with no owner, {} dropped on a full connection, {} CM \
         requests refused",
        n(&stats.joined),
        n(&stats.refused),
        n(&stats.forwarded),
        n(&stats.no_owner),
        n(&stats.overflow),
        n(&stats.cm_rejects)
    );
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softrdma hostd: {e}");
            ExitCode::FAILURE
        }
    }
}
