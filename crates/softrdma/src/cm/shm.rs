//! Connecting shared-memory QPs: a Unix seqpacket socket in the abstract
//! namespace, named by the listener (`softrdma-shm/NAME`); the provider then
//! exchanges the inboxes and regions over it (the provider's `shm` module) and
//! keeps it to see the peer go.

use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::net::{SocketAddrUnix, SocketFlags};

use crate::verbs::{Context, Qp, Result, VerbsError};

/// How long either side waits for the other's part of the exchange.
const TIMEOUT: Duration = Duration::from_secs(10);

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
    rustix::net::connect(&sock, &addr)
        .map_err(|e| io_err(format!("no shm listener {name:?} on this host"), e.into()))?;
    same_user(&sock)?;
    qp.attach_shm(sock, TIMEOUT, false)
}

/// A listener for shm connections.
#[derive(Debug)]
pub struct Listener {
    sock: OwnedFd,
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
        Ok(Listener {
            sock,
            name: name.to_string(),
        })
    }

    /// The name it listens under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Takes the next connection for `qp`.
    pub fn accept(&self, qp: &Qp) -> Result<()> {
        qp.check_unconnected()?;
        let sock = rustix::net::accept_with(&self.sock, SocketFlags::CLOEXEC)
            .map_err(|e| io_err(format!("accepting on {:?}", self.name), e.into()))?;
        same_user(&sock)?;
        qp.attach_shm(sock, TIMEOUT, true)
    }
}
