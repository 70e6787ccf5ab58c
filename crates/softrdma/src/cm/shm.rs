//! Connecting shared-memory QPs: a Unix seqpacket socket in the abstract
//! namespace, named by the listener (`softrdma-shm/NAME`); the provider then
//! exchanges the inboxes and regions over it (the provider's `shm` module) and
//! keeps it to see the peer go.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use rustix::net::{SocketAddrUnix, SocketFlags};

use super::backlog::Backlog;
use crate::verbs::{Context, Qp, Result, VerbsError};

/// How long either side waits for the other's part of the exchange.
const TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connect waits for the listener to take the connection.
#[cfg(not(test))]
const CONNECT_WAIT: Duration = TIMEOUT;
#[cfg(test)]
const CONNECT_WAIT: Duration = Duration::from_secs(1);

fn address(name: &str) -> Result<SocketAddrUnix> {
    if name.is_empty() || name.len() > 90 {
        return Err(VerbsError::Invalid(
            "a shm listener's name is 1 to 90 bytes".into(),
        ));
    }
    SocketAddrUnix::new_abstract_name(format!("softrdma-shm/{name}").as_bytes())
        .map_err(|e| io_err(format!("the name {name:?}"), e.into()))
}

fn io_err(what: String, source: std::io::Error) -> VerbsError {
    VerbsError::Io { what, source }
}

fn socket() -> Result<OwnedFd> {
    crate::provider::unix_seqpacket(SocketFlags::empty())
        .map_err(|e| io_err("a Unix socket".into(), e))
}

/// A PD's regions are mapped into its peers, so a peer must be a process of
/// this user: any user can reach an abstract socket, whose name is no
/// secret.
fn same_user(sock: &OwnedFd) -> Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(sock)
        .map_err(|e| io_err("the shm peer's credentials".into(), e.into()))?;
    let me = rustix::process::geteuid();
    if peer.uid != me {
        return Err(VerbsError::Invalid(format!(
            "the shm peer (process {}) runs as user {}, this process as {}: shared \
             memory connects processes of one user",
            peer.pid.as_raw_nonzero(),
            peer.uid.as_raw(),
            me.as_raw()
        )));
    }
    Ok(())
}

/// Connects `qp` (of a shm device, not yet connected) to the listener
/// `name` on this host.
pub fn connect(qp: &Qp, name: &str) -> Result<()> {
    qp.check_unconnected()?;
    let addr = address(name)?;
    let sock = socket()?;
    crate::provider::connect_unix_within(&sock, &addr, CONNECT_WAIT).map_err(|e| {
        let what = match e.kind() {
            std::io::ErrorKind::TimedOut => format!(
                "the shm listener {name:?} took no connection in {} s",
                CONNECT_WAIT.as_secs()
            ),
            _ => format!("no shm listener {name:?} on this host"),
        };
        io_err(what, e)
    })?;
    same_user(&sock)?;
    qp.attach_shm(sock, TIMEOUT, false)
}

/// A listener for shm connections. Connections are taken, their peers
/// checked and their first message awaited in the background, each on its
/// own: a client that connects and then says nothing holds up no other.
#[derive(Debug)]
pub struct Listener {
    backlog: Backlog<OwnedFd, OwnedFd, VerbsError>,
    name: String,
}

impl Listener {
    /// Listens under `name` (an abstract Unix socket: gone with the
    /// listener, nothing in the file system).
    pub fn bind(ctx: &Context, name: &str) -> Result<Listener> {
        if !ctx.is_shm() {
            return Err(VerbsError::Invalid(
                "a shm listener needs a shared-memory device (Device::shm)".into(),
            ));
        }
        let addr = address(name)?;
        let sock = socket()?;
        rustix::net::bind(&sock, &addr)
            .map_err(|e| io_err(format!("cannot listen as {name:?}"), e.into()))?;
        rustix::net::listen(&sock, 64).map_err(|e| io_err("listen".into(), e.into()))?;
        let taking = format!("accepting on {name:?}");
        let backlog = Backlog::start(
            std::sync::Arc::new(sock),
            move |sock: &OwnedFd| loop {
                match rustix::net::accept_with(sock, SocketFlags::CLOEXEC) {
                    Err(rustix::io::Errno::INTR) => {}
                    r => return r.map_err(|e| io_err(taking.clone(), e.into())),
                }
            },
            |sock: OwnedFd| {
                same_user(&sock)?;
                first_message(&sock)?;
                Ok(sock)
            },
        )
        .map_err(|e| io_err("the listener's thread".into(), e))?;
        Ok(Listener {
            backlog,
            name: name.to_string(),
        })
    }

    /// The name it listens under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Takes the next connection whose first message has come, for `qp`. A
    /// peer of another user, or one that sends nothing within ten seconds,
    /// is dropped and its error returned (the listener goes on).
    ///
    /// It waits as long as it takes; moving `qp` to ERR from another thread
    /// ends the wait with an error.
    pub fn accept(&self, qp: &Qp) -> Result<()> {
        self.accept_by(qp, None)
    }

    /// [`accept`](Self::accept), giving up with an error of kind
    /// `TimedOut` when no connection is ready within `waited`.
    pub fn accept_timeout(&self, qp: &Qp, waited: Duration) -> Result<()> {
        let deadline = crate::verbs::deadline_after(waited);
        self.accept_by(qp, Some((deadline, waited)))
    }

    fn accept_by(&self, qp: &Qp, deadline: Option<(Instant, Duration)>) -> Result<()> {
        qp.check_unconnected()?;
        let next = self
            .backlog
            .next_for(deadline.map(|d| d.0), || qp.check_unconnected())?;
        let Some(sock) = next else {
            let waited = deadline.map_or(Duration::ZERO, |d| d.1);
            return Err(io_err(
                format!("no shm connection came within {waited:?}"),
                std::io::ErrorKind::TimedOut.into(),
            ));
        };
        qp.attach_shm(sock?, TIMEOUT, true)
    }
}

/// Waits up to [`TIMEOUT`] for the connecting side's first message (the
/// listening side reads first).
fn first_message(sock: &OwnedFd) -> Result<()> {
    use rustix::event::{PollFd, PollFlags};
    let deadline = crate::verbs::deadline_after(TIMEOUT);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io_err(
                "the shm peer".into(),
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("sent nothing in {} s", TIMEOUT.as_secs()),
                ),
            ));
        }
        let ts = rustix::time::Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [PollFd::new(sock, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => {}
            Ok(_) => return Ok(()),
            Err(e) => return Err(io_err("waiting for the shm peer".into(), e.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{Device, QpInit};

    /// A name held by something that never takes connections (another
    /// process squatting on it, or a listener stopped with its backlog
    /// full): connect times out instead of blocking for good.
    #[test]
    fn a_listener_that_takes_no_connection_times_the_connect_out() {
        let name = format!("test-{}-squatted", std::process::id());
        let addr = address(&name).unwrap();
        let squatter = socket().unwrap();
        rustix::net::bind(&squatter, &addr).unwrap();
        rustix::net::listen(&squatter, 0).unwrap();
        // The one connection a backlog of 0 holds.
        let first = socket().unwrap();
        rustix::net::connect(&first, &addr).unwrap();
        let ctx = Device::shm().open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let qp = pd.create_qp(&QpInit::rc(&cq, &cq)).unwrap();
        let t = std::time::Instant::now();
        let e = connect(&qp, &name).unwrap_err();
        assert!(e.to_string().contains("took no connection"), "{e}");
        assert!(t.elapsed() >= CONNECT_WAIT - Duration::from_millis(50));
        assert!(t.elapsed() < CONNECT_WAIT + Duration::from_secs(5));
    }
}
