//! What a QP connected by a connection manager (iWARP, shared memory) keeps
//! until its connection is up: the receives posted before it (rdma_cm users
//! post them first), and whether it was connected once (or moved to ERR).

use std::sync::{Mutex, MutexGuard};

use super::cq::CqInner;
use crate::engine::{PostError, QpState, RecvWr, WcOpcode, WcStatus, WorkCompletion};

#[derive(Debug, Default)]
pub(crate) struct BeforeConnect {
    early: Mutex<Vec<RecvWr>>,
    /// Connected once, or moved to ERR (a QP is not reused for a second
    /// connection).
    used: Mutex<bool>,
}

/// A connection being brought up: the receives to hand over; `done` marks
/// the QP connected.
pub(crate) struct Connecting<'a> {
    used: MutexGuard<'a, bool>,
    early: MutexGuard<'a, Vec<RecvWr>>,
}

impl Connecting<'_> {
    /// The receives posted before the connection, oldest first.
    pub(crate) fn receives(&mut self) -> std::vec::Drain<'_, RecvWr> {
        self.early.drain(..)
    }

    pub(crate) fn done(mut self) {
        *self.used = true;
    }
}

impl BeforeConnect {
    /// The state of the QP while it has no connection: ERR once one ended,
    /// else INIT.
    pub(crate) fn state(&self) -> QpState {
        if *self.used.lock().expect("lock") {
            QpState::Err
        } else {
            QpState::Init
        }
    }

    /// Keeps a receive for the connection.
    pub(crate) fn post_recv(&self, wr: RecvWr, max_sge: u32, max_wr: u32) -> Result<(), PostError> {
        if *self.used.lock().expect("lock") {
            return Err(PostError::BadState(QpState::Err));
        }
        if wr.sgl.len() > max_sge as usize {
            return Err(PostError::TooManySges {
                given: wr.sgl.len(),
                max: max_sge,
            });
        }
        let mut early = self.early.lock().expect("lock");
        if early.len() >= max_wr as usize {
            return Err(PostError::QueueFull(max_wr));
        }
        early.push(wr);
        Ok(())
    }

    /// Moves the QP to ERR (`modify` to ERR): no connection will be made,
    /// and the receives kept for one are returned, to be flushed. Waits for
    /// a connection being brought up (after which there are none).
    pub(crate) fn fail(&self) -> Vec<RecvWr> {
        let mut used = self.used.lock().expect("lock");
        *used = true;
        std::mem::take(&mut *self.early.lock().expect("lock"))
    }

    /// [`fail`](Self::fail), with the receives flushed to `cq`.
    pub(crate) fn fail_and_flush(&self, qpn: u32, cq: &CqInner) {
        let mut signal = false;
        for wr in self.fail() {
            signal |= cq.push(WorkCompletion::new(
                wr.wr_id,
                WcStatus::WrFlushErr,
                WcOpcode::Recv,
                qpn,
            ));
        }
        if signal {
            cq.signal();
        }
    }

    /// Starts bringing the connection up; `None` if the QP was connected
    /// before or moved to ERR. Held until `done` or dropped, so two connects cannot race.
    pub(crate) fn connecting(&self) -> Option<Connecting<'_>> {
        let used = self.used.lock().expect("lock");
        if *used {
            return None;
        }
        Some(Connecting {
            used,
            early: self.early.lock().expect("lock"),
        })
    }
}
