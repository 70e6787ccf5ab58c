//! Connecting iWARP QPs, as rdma_cm does on iWARP: a TCP connection from
//! the device's address, then the MPA exchange ([`super::mpa`]) carrying the
//! application's private data, then the QP runs on the connection.
//!
//! The same calls connect an RNIC's QPs (siw, an iWARP NIC) opened through
//! libibverbs: there the kernel's rdma_cm does the TCP and MPA parts
//! (librdmacm; `docs/ibverbs.md`), and the outcome says so
//! ([`MpaOutcome::through_kernel`]).

use std::io;
use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::backlog::Backlog;
use super::mpa::{self, Decision, MpaConfig, MpaError, MpaOutcome, MpaRequest};
use crate::provider::ibverbs::rdmacm::{self, CmFailure, CmListener, CmOutcome, CmParams};
use crate::provider::ibverbs::{HwContext, HwQp};
use crate::verbs::{Access, Context, Qp, VerbsError};

/// How long an initiator waits after the MPA Reply before its first FPDU
/// (see [`connect`]).
pub const FIRST_FPDU_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The TCP connection.
    #[error("TCP connection to {to}: {source}")]
    Tcp {
        /// Where to.
        to: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The MPA exchange (rejected, refused, malformed).
    #[error(transparent)]
    Mpa(#[from] MpaError),
    /// The QP.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// No connection came ready within the time `accept_timeout` was given.
    #[error("no connection with a whole MPA Request came within {waited:?}")]
    NoClient {
        /// How long it waited.
        waited: Duration,
    },
    /// rdma_cm through librdmacm (an RNIC of the ibverbs provider).
    #[error("rdma_cm: {0}")]
    Rdmacm(String),
}

/// The parameters of an RNIC's rdma_cm connection from `cfg`.
fn cm_params(cfg: &MpaConfig) -> CmParams {
    CmParams {
        private_data: cfg.private_data.clone(),
        responder_resources: cfg.ird.clamp(1, 255) as u8,
        initiator_depth: cfg.ord.clamp(1, 255) as u8,
        retry_count: 7,
        rnr_retry_count: 7,
        access: Access::REMOTE_WRITE | Access::REMOTE_READ,
        // iWARP has no ACK timeout or RNR: TCP's.
        timeout: None,
        min_rnr_timer: None,
    }
}

/// What the kernel's connection tells of its peer, as an MPA outcome.
fn kernel_outcome(out: CmOutcome, initiator: bool) -> MpaOutcome {
    let (peer_ird, peer_ord) = (
        u16::from(out.peer_responder_resources),
        u16::from(out.peer_initiator_depth),
    );
    MpaOutcome {
        revision: 0,
        crc: false,
        peer_ird_ord: Some((peer_ird, peer_ord)),
        ord: u16::from(out.initiator_depth),
        ird: u16::from(out.responder_resources),
        rtr: None,
        initiator,
        peer_private_data: out.private_data,
        large_fpdus: false,
        peer_is_softrdma: false,
        through_kernel: true,
    }
}

fn cm_error(to: SocketAddrV4, e: CmFailure) -> ConnectError {
    match e {
        // Refused at once: nothing listens (as TCP's refusal reads here).
        CmFailure::Refused => ConnectError::Tcp {
            to: to.into(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        },
        // iw_cm's REJECTED: the peer's MPA Reply said no. (siw reports a
        // reject as ECONNRESET, as it would a TCP reset during the MPA
        // exchange: the two read alike.)
        CmFailure::Rejected { private_data, .. } => MpaError::Rejected { private_data }.into(),
        CmFailure::Other(s) => ConnectError::Rdmacm(s),
    }
}

/// An RNIC of the ibverbs provider, or None; an error for a RoCE device.
fn rnic(qp: &Qp) -> Result<Option<(&HwContext, &Arc<HwQp>)>, ConnectError> {
    match (qp.context().hw(), qp.hw()) {
        (Some(hw), Some(hq)) if hw.iwarp => Ok(Some((hw, hq))),
        (Some(hw), _) => Err(VerbsError::Invalid(format!(
            "{} is a RoCE device: its QPs connect with cm::roce",
            hw.name
        ))
        .into()),
        _ => Ok(None),
    }
}

/// Connects `qp` (of an iWARP device, not yet connected) to a listener at
/// `to`: TCP from the device's address, MPA Request with `cfg`'s offer.
pub fn connect(qp: &Qp, to: SocketAddrV4, cfg: &MpaConfig) -> Result<MpaOutcome, ConnectError> {
    qp.check_unconnected()?;
    if let Some((hw, hq)) = rnic(qp)? {
        mpa::check_cfg(cfg)?;
        let out = rdmacm::connect(hw, hq, to, &cm_params(cfg)).map_err(|e| cm_error(to, e))?;
        return Ok(kernel_outcome(out, true));
    }
    let local = SocketAddrV4::new(*qp.context().local_addr().ip(), 0);
    let tcp = |source| ConnectError::Tcp {
        to: to.into(),
        source,
    };
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).map_err(tcp)?;
    sock.bind(&SocketAddr::V4(local).into()).map_err(tcp)?;
    if let Some(tos) = cfg.tos {
        sock.set_tos_v4(u32::from(tos)).map_err(tcp)?;
    }
    connect_through_signals(&sock, &SocketAddr::V4(to).into()).map_err(tcp)?;
    let mut stream: TcpStream = sock.into();
    let out = mpa::connect(&mut stream, cfg)?;
    // Linux siw (6.1) sends its MPA Reply before it hooks the socket's
    // data-ready callback to the QP; an FPDU arriving in between stays
    // unread until more data comes, and a client waiting for an answer
    // hangs. rdma_cm initiators are slower than that to post; so is this,
    // unless the responder said it is softrdma.
    if out.rtr.is_none() && !out.peer_is_softrdma {
        std::thread::sleep(FIRST_FPDU_DELAY);
    }
    qp.attach_iwarp(stream, &out)?;
    Ok(out)
}

/// A blocking `connect` that a signal interrupts goes on in the kernel:
/// waits for it to end, as the socket turns writable, and takes its outcome.
fn connect_through_signals(sock: &socket2::Socket, to: &socket2::SockAddr) -> io::Result<()> {
    match sock.connect(to) {
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
        done => return done,
    }
    loop {
        let mut fds = [rustix::event::PollFd::new(
            sock,
            rustix::event::PollFlags::OUT,
        )];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    match sock.take_error()? {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A listener for iWARP connections on a device's address. Connections are
/// taken, and their MPA Requests read, in the background, each on its own
/// (as the kernel's iw_cm does before it reports a connect request): a
/// client that connects and then says nothing holds up no other.
#[derive(Debug)]
pub struct Listener {
    at: SocketAddrV4,
    taking: Taking,
}

/// How a listener takes its connections.
#[derive(Debug)]
enum Taking {
    /// softrdma's iWARP: TCP and MPA in user space.
    Tcp(Backlog<TcpListener, Arrived, ConnectError>),
    /// An RNIC's: rdma_cm through librdmacm.
    Rdmacm(CmListener),
}

/// How long a connection may take to send its whole MPA Request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection whose MPA Request came whole.
#[derive(Debug)]
struct Arrived {
    stream: TcpStream,
    request: mpa::ArrivedRequest,
}

impl Listener {
    /// Listens on TCP `port` (0: any) of `ctx`'s address.
    pub fn bind(ctx: &Context, port: u16) -> Result<Listener, VerbsError> {
        if !ctx.is_iwarp() {
            return Err(VerbsError::Invalid(
                "an iWARP listener needs an iWARP device (Device::iwarp, or an RNIC's)".into(),
            ));
        }
        if let Some(hw) = ctx.hw() {
            let l = CmListener::bind(hw, port).map_err(VerbsError::Invalid)?;
            return Ok(Listener {
                at: l.local_addr(),
                taking: Taking::Rdmacm(l),
            });
        }
        let at = SocketAddrV4::new(*ctx.local_addr().ip(), port);
        let io = |what: String| move |source| VerbsError::Io { what, source };
        let tcp = TcpListener::bind(at).map_err(io(format!("cannot listen on {at}")))?;
        let at = match tcp.local_addr() {
            Ok(SocketAddr::V4(a)) => a,
            _ => at,
        };
        let backlog = Backlog::start(
            Arc::new(tcp),
            move |tcp: &TcpListener| {
                tcp.accept()
                    .map(|(s, _)| s)
                    .map_err(|source| ConnectError::Tcp {
                        to: at.into(),
                        source,
                    })
            },
            |mut stream: TcpStream| {
                let request = mpa::read_request(&mut stream, REQUEST_TIMEOUT)?;
                Ok(Arrived { stream, request })
            },
        )
        .map_err(io("cannot start the listener's thread".into()))?;
        Ok(Listener {
            at,
            taking: Taking::Tcp(backlog),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.at
    }

    /// Takes the next connection whose MPA Request has come for `qp`: lets
    /// `decide` accept or reject it (seeing the peer's private data), and
    /// on acceptance runs `qp` on the connection. A connection that is not
    /// MPA, or that sends no whole Request within [`REQUEST_TIMEOUT`], is
    /// dropped and its error returned (the listener goes on).
    ///
    /// It waits as long as it takes; moving `qp` to ERR from another thread
    /// ends the wait with an error.
    pub fn accept(
        &self,
        qp: &Qp,
        cfg: &MpaConfig,
        decide: impl FnOnce(&MpaRequest) -> Decision,
    ) -> Result<MpaOutcome, ConnectError> {
        self.accept_by(qp, cfg, decide, None)
    }

    /// [`accept`](Self::accept), giving up with [`ConnectError::NoClient`]
    /// when no connection is ready within `waited`.
    pub fn accept_timeout(
        &self,
        qp: &Qp,
        cfg: &MpaConfig,
        decide: impl FnOnce(&MpaRequest) -> Decision,
        waited: Duration,
    ) -> Result<MpaOutcome, ConnectError> {
        let deadline = crate::verbs::deadline_after(waited);
        self.accept_by(qp, cfg, decide, Some((deadline, waited)))
    }

    fn accept_by(
        &self,
        qp: &Qp,
        cfg: &MpaConfig,
        decide: impl FnOnce(&MpaRequest) -> Decision,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<MpaOutcome, ConnectError> {
        qp.check_unconnected()?;
        mpa::check_cfg(cfg)?;
        let backlog = match &self.taking {
            Taking::Tcp(b) => b,
            Taking::Rdmacm(l) => return self.accept_rdmacm(l, qp, cfg, decide, deadline),
        };
        let next = backlog.next_for(deadline.map(|d| d.0), || qp.check_unconnected())?;
        let Some(arrived) = next else {
            return Err(ConnectError::NoClient {
                waited: deadline.map_or(Duration::ZERO, |d| d.1),
            });
        };
        let Arrived {
            mut stream,
            request,
        } = arrived?;
        if let Some(tos) = cfg.tos {
            socket2::SockRef::from(&stream)
                .set_tos_v4(u32::from(tos))
                .map_err(|source| ConnectError::Tcp {
                    to: stream.peer_addr().unwrap_or(SocketAddr::V4(self.at)),
                    source,
                })?;
        }
        let out = mpa::answer(&mut stream, cfg, request, decide)?;
        // RFC 5044 7.1.2: a responder sends no FPDU before the initiator's
        // first. siw's initiator needs it: reading the Reply, it takes bytes
        // past it for a protocol error (it asks for four more than the
        // Reply's private data, or checks for more when it has none). A
        // server that speaks first must not wait for ever, so it waits this
        // long instead; what the initiator sends meanwhile waits in the socket.
        if out.rtr.is_none() {
            std::thread::sleep(FIRST_FPDU_DELAY);
        }
        qp.attach_iwarp(stream, &out)?;
        Ok(out)
    }
}

impl Listener {
    fn accept_rdmacm(
        &self,
        l: &CmListener,
        qp: &Qp,
        cfg: &MpaConfig,
        decide: impl FnOnce(&MpaRequest) -> Decision,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<MpaOutcome, ConnectError> {
        let Some((hw, hq)) = rnic(qp)? else {
            return Err(VerbsError::Invalid(
                "this listener is an RNIC's: accept a QP of that device".into(),
            )
            .into());
        };
        let mut said_no = false;
        let got = l.accept(
            hw,
            hq,
            &cm_params(cfg),
            |r| {
                let request = MpaRequest {
                    revision: 0,
                    crc: false,
                    ird_ord: Some(softrdma_wire::mpa::IrdOrd {
                        ird: u16::from(r.responder_resources),
                        ord: u16::from(r.initiator_depth),
                        ..softrdma_wire::mpa::IrdOrd::default()
                    }),
                    private_data: r.private_data.clone(),
                };
                match decide(&request) {
                    Decision::Accept => Ok(cfg.private_data.clone()),
                    Decision::Reject(pd) => {
                        said_no = true;
                        Err(pd)
                    }
                }
            },
            deadline.map(|d| d.0),
        );
        match got {
            Ok(Some(out)) => Ok(kernel_outcome(out, false)),
            Ok(None) => Err(ConnectError::NoClient {
                waited: deadline.map_or(Duration::ZERO, |d| d.1),
            }),
            Err(_) if said_no => Err(MpaError::RejectedHere {
                reason: "the application rejected the request".into(),
            }
            .into()),
            Err(e) => Err(cm_error(self.at, e)),
        }
    }
}
