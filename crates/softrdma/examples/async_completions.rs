//! Completions awaited on tokio: two RC queue pairs on loopback, one task
//! that streams the receiver's completions and another that sends, on one
//! thread. No thread polls: the receiving task sleeps on tokio's reactor
//! until the CQ's completion channel fires.
//!
//!     cargo run -p softrdma --example async_completions [MESSAGES]

use softrdma::cm::{self, ConnInfo, RcOptions};
use softrdma::verbs::*;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let messages: u64 = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 1000,
    };
    // Two RoCEv2 devices on loopback (ephemeral UDP ports), a QP on each.
    let open = || Device::udp("127.0.0.1:0".parse().unwrap()).open();
    let (a, b) = (open()?, open()?);
    let (pa, pb) = (a.alloc_pd()?, b.alloc_pd()?);
    let (ma, mb) = (
        pa.register(64, Access::LOCAL_WRITE)?,
        pb.register(64 * 256, Access::LOCAL_WRITE)?,
    );
    let (sent, received) = (a.create_cq(256)?, b.create_cq(256)?);
    let caps = QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
        ..QpCaps::default()
    };
    let qa = pa.create_qp(&QpInit::rc(&sent, &sent).caps(caps))?;
    let qb = pb.create_qp(&QpInit::rc(&received, &received).caps(caps))?;
    let (ia, ib) = (ConnInfo::local(&qa, None)?, ConnInfo::local(&qb, None)?);
    cm::connect(&qa, &ia, &ib, &RcOptions::default())?;
    cm::connect(&qb, &ib, &ia, &RcOptions::default())?;
    for slot in 0..256u64 {
        qb.post_recv(RecvWr::new(slot, [mb.sge(64 * slot as usize, 64)]))?;
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    rt.block_on(async move {
        let mut receives = AsyncCq::new(received)?;
        let mut sends = AsyncCq::new(sent)?;
        // The sender: one message in flight at a time, each awaited.
        let sender = tokio::spawn(async move {
            for k in 0..messages {
                ma.write(0, &k.to_le_bytes())?;
                qa.post_send(SendWr::new(k, SendOp::Send, [ma.sge(0, 8)]))?;
                let wc = sends.next().await.ok_or("the send CQ ended")??;
                if wc.status != WcStatus::Success {
                    return Err(format!("send {k}: {:?}", wc.status).into());
                }
            }
            Ok::<_, Error>(())
        });
        // The receiver: each message checked, its receive posted again.
        for k in 0..messages {
            let wc = receives.next().await.ok_or("the receive CQ ended")??;
            let got = mb.read_vec(64 * wc.wr_id as usize, 8)?;
            if wc.status != WcStatus::Success || got != k.to_le_bytes() {
                return Err(format!("message {k}: {:?} {got:?}", wc.status).into());
            }
            qb.post_recv(RecvWr::new(wc.wr_id, [mb.sge(64 * wc.wr_id as usize, 64)]))?;
        }
        sender.await??;
        println!("{messages} messages sent and received, every completion awaited");
        Ok::<_, Error>(())
    })
}
