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

/// What [`BeforeConnect::post_recv`] did with a receive.
pub(crate) enum Kept {
    /// Kept for the connection.
    Yes,
    /// Too late: the QP is connected (or in ERR); the receive is the
    /// connection's.
    Late(RecvWr),
}

impl Connecting<'_> {
    /// The receives posted before the connection, oldest first.
    pub(crate) fn receives(&mut self) -> Vec<RecvWr> {
        std::mem::take(&mut *self.early)
    }

    /// Keeps `receives` (taken by [`receives`](Self::receives)) again: the
    /// connection failed to start, the QP stays unconnected.
    pub(crate) fn restore(&mut self, receives: Vec<RecvWr>) {
        let later = std::mem::replace(&mut *self.early, receives);
        self.early.extend(later);
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

    /// Keeps a receive for the connection; gives it back if the QP was
    /// connected (or moved to ERR) since the caller looked.
    pub(crate) fn post_recv(
        &self,
        wr: RecvWr,
        max_sge: u32,
        max_wr: u32,
    ) -> Result<Kept, PostError> {
        // Held until the receive is kept (the order `connecting` takes the
        // locks in): a connection that comes up meanwhile would take the
        // receives before this one joined them, and it would be lost.
        let used = self.used.lock().expect("lock");
        if *used {
            return Ok(Kept::Late(wr));
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
        drop(used);
        Ok(Kept::Yes)
    }

    /// Moves the QP to ERR (`modify` to ERR): no connection will be made,
    /// and the receives kept for one are returned, to be flushed; `true` if
    /// this call was the one that ended a QP never connected. Waits for a
    /// connection being brought up (after which there are none).
    pub(crate) fn fail(&self) -> (Vec<RecvWr>, bool) {
        let mut used = self.used.lock().expect("lock");
        let ended = !std::mem::replace(&mut *used, true);
        (
            std::mem::take(&mut *self.early.lock().expect("lock")),
            ended,
        )
    }

    /// [`fail`](Self::fail), with the receives flushed to `cq`.
    pub(crate) fn fail_and_flush(&self, qpn: u32, cq: &CqInner) -> bool {
        let mut signal = false;
        let (early, ended) = self.fail();
        for wr in early {
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
        ended
    }

    /// Starts bringing the connection up; `None` if the QP was connected
    /// before or moved to ERR. Held until `done` or dropped, so two connects
    /// cannot race.
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
