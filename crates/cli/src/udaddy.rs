//! `softrdma udaddy`: rdma-core's `udaddy` (librdmacm's UD example) over
//! RoCEv2, so that either side can be softrdma and the other `udaddy` on
//! Linux rxe. The client finds the server's UD QP with rdma_cm's SIDR
//! (port 7174 of the UDP port space) and SENDs it its messages, each with
//! its own QP number as the immediate; the server answers each connection
//! with as many messages, to the QP the first immediate names.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::ExitCode;
use std::time::Duration;

use softrdma::cm::roce;
use softrdma::cm::roce_ud::{self, Listener};
use softrdma::verbs::*;
use softrdma::wire::cm::RDMA_CM_UDP_QKEY;

/// Options, spelled as udaddy spells them.
#[derive(Debug, Clone, clap::Args)]
pub struct UdaddyArgs {
    /// The server's address: be the client (without it, the server).
    #[arg(short = 's', value_name = "ADDR")]
    pub server: Option<Ipv4Addr>,
    /// The local address (default: the client's route to the server; the
    /// server's first non-loopback device).
    #[arg(short = 'b', value_name = "ADDR")]
    pub bind: Option<Ipv4Addr>,
    /// Connections.
    #[arg(short = 'c', default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub connections: u32,
    /// Messages each way per connection.
    #[arg(short = 'C', default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(0..=4096))]
    pub count: u32,
    /// Message size (0: no messages); at most the path MTU.
    #[arg(short = 'S', default_value_t = 100)]
    pub size: usize,
    /// rdma_cm port (ours: udaddy's is always 7174).
    #[arg(long, default_value_t = 7174,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
}

/// The GRH area at the start of a UD receive buffer.
const GRH: usize = 40;
/// The longest wait for a peer's message or a completion: udaddy waits for
/// good; a peer that vanished must not keep this side.
const WAIT: Duration = Duration::from_secs(10);

pub fn run(a: &UdaddyArgs) -> ExitCode {
    let r = match a.server {
        Some(server) => {
            println!("udaddy: starting client");
            client(a, server)
        }
        None => {
            println!("udaddy: starting server");
            serve(a)
        }
    };
    let status = match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("softrdma udaddy: {e}");
            1
        }
    };
    println!("test complete");
    println!("return status {status}");
    ExitCode::from(status)
}

/// One connection's QP, CQ and buffers: the receive buffer (GRH and
/// message) at 0, the send buffer after it.
struct Node {
    /// Where to send: the peer's address, QP and Q_Key.
    dest: Option<(Ah, u32, u32)>,
    // Dropped in this order: the QP before the memory its receives use.
    qp: Qp,
    cq: Cq,
    mr: Mr,
    pd: Pd,
}

impl Node {
    fn new(ctx: &Context, a: &UdaddyArgs) -> Result<Node, String> {
        let e = |e: VerbsError| e.to_string();
        let pd = ctx.alloc_pd().map_err(e)?;
        let mr = pd
            .register(2 * a.size + GRH, Access::LOCAL_WRITE)
            .map_err(e)?;
        let depth = a.count.max(1);
        let cq = ctx.create_cq(2 * depth as usize).map_err(e)?;
        let qp = pd
            .create_qp(&QpInit::ud(&cq, &cq).caps(QpCaps {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            }))
            .map_err(e)?;
        // As rdma_create_qp readies a UD QP: it takes receives before SIDR.
        softrdma::cm::ready_ud(&qp, RDMA_CM_UDP_QKEY, 0).map_err(e)?;
        Ok(Node {
            dest: None,
            qp,
            cq,
            mr,
            pd,
        })
    }

    /// Posts the receives for the peer's messages, all into the one
    /// buffer, as udaddy does (their bytes are not looked at).
    fn post_recvs(&self, a: &UdaddyArgs) -> Result<(), String> {
        for i in 0..a.count {
            let sge = self.mr.sge(0, (a.size + GRH) as u32);
            self.qp
                .post_recv(RecvWr::new(u64::from(i), [sge]))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// SENDs the messages, each with this QP's number as the immediate;
    /// the last one signaled (`signaled_all`: each).
    fn post_sends(&self, a: &UdaddyArgs, signaled_all: bool) -> Result<(), String> {
        let Some((ah, qpn, qkey)) = &self.dest else {
            return Err("no peer to send to".into());
        };
        for i in 0..a.count {
            let wr = SendWr::new(
                u64::from(i),
                SendOp::SendWithImm(self.qp.qpn()),
                [self.mr.sge(a.size + GRH, a.size as u32)],
            )
            .to(ah.dest(*qpn, *qkey));
            let wr = if signaled_all || i + 1 == a.count {
                wr
            } else {
                wr.unsignaled()
            };
            self.qp.post_send(wr).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Waits for `n` completions, each within [`WAIT`] of the last;
    /// returns the first receive's.
    fn completions(&self, n: u32, what: &str) -> Result<Option<WorkCompletion>, String> {
        let mut first = None;
        for got in 0..n {
            match self.cq.wait(WAIT).map_err(|e| e.to_string())? {
                Some(wc) if wc.status == WcStatus::Success => {
                    if wc.opcode == WcOpcode::Recv {
                        first.get_or_insert(wc);
                    }
                }
                Some(wc) => return Err(format!("{what}: {:?} ({:?})", wc.status, wc.opcode)),
                None => {
                    return Err(format!(
                        "{what}: {got} of {n}, then none for {} s",
                        WAIT.as_secs()
                    ));
                }
            }
        }
        Ok(first)
    }
}

fn open(ip: Ipv4Addr, a: &UdaddyArgs) -> Result<Context, String> {
    let ctx = Device::udp(SocketAddrV4::new(ip, 4791).into())
        .open()
        .map_err(|e| e.to_string())?;
    let mtu = ctx.query_port().active_mtu.bytes();
    if a.size > mtu {
        return Err(format!(
            "-S {}: larger than the path MTU ({mtu}): a UD message is one packet",
            a.size
        ));
    }
    Ok(ctx)
}

fn client(a: &UdaddyArgs, server: Ipv4Addr) -> Result<(), String> {
    let source = match a.bind {
        Some(b) => b,
        None => crate::device::route_to(server)?,
    };
    let ctx = open(source, a)?;
    println!("udaddy: connecting");
    let mut nodes = Vec::new();
    for _ in 0..a.connections {
        let mut node = Node::new(&ctx, a)?;
        let found = roce_ud::resolve(&node.qp, SocketAddrV4::new(server, a.port), &[])
            .map_err(|e| format!("rdma_cm UD resolution of {server}:{}: {e}", a.port))?;
        node.post_recvs(a)?;
        let ah = node
            .pd
            .create_ah(AhAttr {
                addr: SocketAddrV4::new(found.peer, 4791),
            })
            .map_err(|e| e.to_string())?;
        node.dest = Some((ah, found.remote_qpn, found.qkey));
        nodes.push(node);
    }
    if a.count == 0 || a.size == 0 {
        return Ok(());
    }
    println!("initiating data transfers");
    for node in &nodes {
        node.post_sends(a, false)?;
    }
    println!("receiving data transfers");
    for node in &nodes {
        node.completions(
            a.count + 1,
            "the server's messages and this side's last send",
        )?;
    }
    println!("data transfers complete");
    Ok(())
}

fn serve(a: &UdaddyArgs) -> Result<(), String> {
    let ip = match a.bind {
        Some(b) => b,
        None => crate::device::choose(None, 0, None, None)?.addr,
    };
    let ctx = open(ip, a)?;
    let listener = Listener::bind(&ctx, a.port).map_err(|e| e.to_string())?;
    let mut nodes = Vec::new();
    for k in 0..a.connections {
        let node = Node::new(&ctx, a)?;
        node.post_recvs(a)?;
        // The first client may take as long as it likes, as udaddy's; its
        // other connections come at once.
        let waited = (k > 0).then_some(WAIT);
        listener
            .accept(&node.qp, |_| roce::Decision::Accept(vec![]), waited)
            .map_err(|e| format!("rdma_cm UD connection {}: {e}", k + 1))?;
        nodes.push(node);
    }
    if a.count == 0 || a.size == 0 {
        return Ok(());
    }
    println!("receiving data transfers");
    for node in &mut nodes {
        let first = node
            .completions(a.count, "the client's messages")?
            .ok_or("no message from the client")?;
        let qpn = crate::perf::sender_qpn(&first);
        // As udaddy: the reply goes to the datagrams' sender, from the GRH
        // (every message landed in the one buffer, from the same sender).
        let mut grh = [0u8; GRH];
        node.mr.read(0, &mut grh).map_err(|e| e.to_string())?;
        let ah = node
            .pd
            .create_ah_from_wc(&first, &grh)
            .map_err(|e| e.to_string())?;
        let qkey = node.qp.query().qkey.unwrap_or(RDMA_CM_UDP_QKEY);
        node.dest = Some((ah, qpn, qkey));
    }
    println!("sending replies");
    for node in &nodes {
        node.post_sends(a, true)?;
        node.completions(a.count, "the replies' completions")?;
    }
    println!("data transfers complete");
    Ok(())
}
