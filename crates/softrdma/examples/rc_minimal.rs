//! A minimal RC program: a server and a client (two threads here; two
//! processes or machines work the same) register memory, connect a queue pair
//! each over a TCP exchange, and the client WRITEs into the server's memory,
//! READs it back and waits for the completions. The server's CPU does nothing
//! for either: its progress thread serves them.
//!
//!     cargo run -p softrdma --example rc_minimal [SERVER_IP CLIENT_IP]
//!
//! Defaults: server 127.0.0.1, client 127.0.0.2, both on UDP port 4791.

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

fn server(ip: String, ready: std::sync::mpsc::Sender<()>) -> std::result::Result<(), VerbsError> {
    // 1. Open the device: a RoCEv2 device is an IP address and UDP port 4791.
    let ctx = Device::udp(format!("{ip}:4791").parse().unwrap()).open()?;
    // 2. A protection domain, and 4 KiB of memory the client may write and read.
    let pd = ctx.alloc_pd()?;
    let mr = pd.register(
        4096,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    // 3. A completion queue and an RC queue pair.
    let cq = ctx.create_cq(16)?;
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq))?;
    // 4. Swap QP number, PSN, address and the region's key over TCP; go to RTS.
    let listener = TcpListener::bind((ip.as_str(), 18515)).expect("TCP listen");
    ready.send(()).unwrap();
    let (mut tcp, _) = listener.accept().expect("TCP accept");
    let local = ConnInfo::local(&qp, Some(&mr))?;
    let remote = cm::exchange(&mut tcp, &local)?;
    cm::connect(&qp, &local, &remote, &RcOptions::default())?;
    // 5. Nothing to do while the client writes and reads: wait for its "done".
    let mut done = [0u8; 1];
    std::io::Read::read_exact(&mut tcp, &mut done).expect("client done");
    let text = mr.read_vec(0, 13)?;
    println!(
        "server: my memory now holds {:?}",
        String::from_utf8_lossy(&text)
    );
    Ok(())
}

fn client(server_ip: &str, ip: &str) -> std::result::Result<(), VerbsError> {
    let ctx = Device::udp(format!("{ip}:4791").parse().unwrap()).open()?;
    let pd = ctx.alloc_pd()?;
    // The client's own buffer: the source of the WRITE, the sink of the READ.
    let mr = pd.register(4096, Access::LOCAL_WRITE)?;
    let cq = ctx.create_cq(16)?;
    let qp = pd.create_qp(&QpInit::rc(&cq, &cq))?;
    let mut tcp = TcpStream::connect((server_ip, 18515)).expect("TCP connect");
    let local = ConnInfo::local(&qp, None)?;
    let remote = cm::exchange(&mut tcp, &local)?;
    cm::connect(&qp, &local, &remote, &RcOptions::default())?;

    // RDMA WRITE 13 bytes into the server's region (its rkey and address came
    // in the exchange).
    mr.write(0, b"hello, server")?;
    qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            remote_addr: remote.va,
            rkey: remote.rkey,
        },
        vec![mr.sge(0, 13)],
    ))?;
    // RDMA READ them back into another part of our buffer. Completions come in
    // posting order, so the READ sees the WRITE.
    qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            remote_addr: remote.va,
            rkey: remote.rkey,
        },
        vec![mr.sge(1024, 13)],
    ))?;
    for _ in 0..2 {
        let wc = cq.wait(Duration::from_secs(5))?.expect("a completion");
        println!(
            "client: work request {} finished: {} ({:?})",
            wc.wr_id, wc.status, wc.opcode
        );
        assert_eq!(wc.status, WcStatus::Success);
    }
    println!(
        "client: read back {:?}",
        String::from_utf8_lossy(&mr.read_vec(1024, 13)?)
    );
    std::io::Write::write_all(&mut tcp, b"d").expect("tell the server");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let server_ip = args.first().cloned().unwrap_or_else(|| "127.0.0.1".into());
    let client_ip = args.get(1).cloned().unwrap_or_else(|| "127.0.0.2".into());
    let (tx, rx) = std::sync::mpsc::channel();
    let s = server_ip.clone();
    let server = std::thread::spawn(move || server(s, tx));
    rx.recv().expect("server ready");
    if let Err(e) = client(&server_ip, &client_ip) {
        eprintln!("client: {e}");
        std::process::exit(1);
    }
    if let Err(e) = server.join().unwrap() {
        eprintln!("server: {e}");
        std::process::exit(1);
    }
}
