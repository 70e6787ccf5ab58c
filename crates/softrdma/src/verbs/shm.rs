//! Shared-memory QPs in the verbs: created unconnected in a PD, connected by
//! `cm::shm` (a Unix socket to a peer process of this host), then the same
//! `post_send`, `post_recv` and CQs as the other providers.

use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::cq::CqInner;
use super::early::{BeforeConnect, Kept};
use super::{Pd, Provider, Qp, QpInit, QpKind, QpType, Result, VerbsError};
use crate::engine::rc::QpCaps;
use crate::engine::{PostError, QpState, RecvWr, SendWr, WcOpcode};
use crate::memory::Access;
use crate::provider::shm::{self, AccessFlags, MAX_RECV_SGE, QpParts, ShmQp};

/// What the verbs keep of a shm QP.
#[derive(Debug)]
pub(crate) struct ShmSlot {
    pub(crate) qpn: u32,
    pd: crate::memory::PdId,
    caps: QpCaps,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    /// Set once, when connected: read without a lock on every post.
    conn: OnceLock<Arc<ShmQp>>,
    /// The remote operations the QP allows (`qp_access_flags`).
    access: Arc<AccessFlags>,
    pub(super) before: BeforeConnect,
    /// Last: the number is given back after the connection is gone.
    _qpn: super::QpnLease,
}

impl ShmSlot {
    pub(crate) fn state(&self) -> QpState {
        match self.conn.get() {
            Some(c) => c.state(),
            None => self.before.state(),
        }
    }

    fn conn(&self) -> Option<&Arc<ShmQp>> {
        self.conn.get()
    }

    pub(crate) fn access(&self) -> Access {
        self.access.get()
    }

    /// The remote operations the QP allows from now on, connected or not.
    pub(crate) fn set_access(&self, access: Access) {
        self.access.set(access);
    }

    /// `modify` to ERR: a connection is closed (its work flushed, the peer
    /// sees it go), receives kept for one are flushed.
    pub(crate) fn to_error(&self) {
        let _ = self.before.fail_and_flush(self.qpn, &self.recv_cq);
        if let Some(c) = self.conn() {
            c.close();
        }
    }

    #[inline]
    pub(crate) fn post_send(&self, wr: &SendWr) -> Result<(), PostError> {
        match self.conn() {
            Some(c) => c.post_send(wr),
            None if self.state() == QpState::Err => {
                crate::engine::check_post_send(wr, &self.caps)?;
                self.send_cq
                    .push_flushed(wr.wr_id, wr.op.wc_opcode(), self.qpn);
                Ok(())
            }
            None => Err(PostError::BadState(self.state())),
        }
    }

    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<(), PostError> {
        if let Some(c) = self.conn() {
            return c.post_recv(wr);
        }
        let max_sge = self.caps.max_recv_sge.min(MAX_RECV_SGE as u32);
        match self.before.post_recv(wr, max_sge, self.caps.max_recv_wr)? {
            Kept::Yes => Ok(()),
            Kept::Late(wr) => match self.conn() {
                Some(c) => c.post_recv(wr),
                None => {
                    self.recv_cq
                        .push_flushed(wr.wr_id, WcOpcode::Recv, self.qpn);
                    Ok(())
                }
            },
        }
    }
}

impl Drop for ShmSlot {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            c.close();
        }
    }
}

impl Pd {
    pub(super) fn create_shm_qp(&self, init: &QpInit<'_>) -> Result<Qp> {
        if init.qp_type != QpType::Rc {
            return Err(VerbsError::Invalid(
                "the shared-memory provider has RC QPs only".into(),
            ));
        }
        if init.caps.max_recv_sge as usize > MAX_RECV_SGE {
            // A receive's SGEs live in a fixed slot of the shared ring.
            return Err(VerbsError::Invalid(format!(
                "shared-memory receives take at most {MAX_RECV_SGE} scatter/gather elements"
            )));
        }
        let lease = self.ctx.inner.take_cm_qpn()?;
        let qpn = lease.qpn();
        Ok(Qp {
            ctx: self.ctx.clone(),
            kind: QpKind::Shm(Arc::new(ShmSlot {
                qpn,
                pd: self.id,
                caps: init.caps,
                send_cq: init.send_cq.inner.clone(),
                recv_cq: init.recv_cq.inner.clone(),
                conn: OnceLock::new(),
                // Unless told otherwise, what `cm::RcOptions` allows.
                access: Arc::new(AccessFlags::new(crate::cm::RcOptions::default().access)),
                before: BeforeConnect::default(),
                _qpn: lease,
            })),
        })
    }
}

impl Qp {
    /// Runs the shm exchange on a connected Unix socket and starts the QP.
    pub(crate) fn attach_shm(
        &self,
        sock: OwnedFd,
        timeout: Duration,
        reads_first: bool,
    ) -> Result<()> {
        let QpKind::Shm(slot) = &self.kind else {
            return Err(VerbsError::Invalid(
                "cm::shm needs a QP of a shared-memory device (Device::shm)".into(),
            ));
        };
        let Provider::Shm(dev) = &self.ctx.inner.dev else {
            unreachable!("shm QPs live on shm devices")
        };
        let parts = QpParts {
            qpn: slot.qpn,
            pd: slot.pd,
            caps: slot.caps,
            mrs: self.ctx.inner.mrs().clone(),
            send_cq: slot.send_cq.clone(),
            recv_cq: slot.recv_cq.clone(),
            events: self.ctx.inner.events().clone(),
            access: slot.access.clone(),
        };
        // The exchange runs before the QP is claimed, so that its state and
        // posts don't wait on it; a QP claimed meanwhile (another connect,
        // a modify to ERR) closes this connection.
        let conn = shm::establish(&dev.shm, sock, parts, timeout, reads_first).map_err(|e| {
            VerbsError::Io {
                what: "the shared-memory connection".into(),
                source: e,
            }
        })?;
        let Some(mut connecting) = slot.before.connecting() else {
            conn.close();
            return Err(VerbsError::Invalid(
                "this shm QP was connected before or moved to ERR: create a new one".into(),
            ));
        };
        let mut early = connecting.receives().into_iter();
        while let Some(wr) = early.next() {
            if let Err(e) = conn.post_recv(wr) {
                // Those taken are flushed by the close; the rest stay. The
                // close waits for the peer (up to a second): not with the
                // QP's state held.
                connecting.restore(early.collect());
                drop(connecting);
                conn.close();
                return Err(e.into());
            }
        }
        // Set before the QP is marked connected: whoever sees it marked
        // finds the connection.
        let _ = slot.conn.set(conn);
        connecting.done();
        Ok(())
    }
}

#[cfg(test)]
impl Qp {
    /// The shm connection, for the provider's tests.
    pub(crate) fn shm_conn(&self) -> Option<Arc<ShmQp>> {
        match &self.kind {
            QpKind::Shm(s) => s.conn().cloned(),
            _ => None,
        }
    }
}
