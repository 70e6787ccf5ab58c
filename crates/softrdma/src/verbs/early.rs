//! What a QP connected by a connection manager (iWARP, shared memory) keeps
//! until its connection is up: the receives posted before it (rdma_cm users
//! post them first), and whether it was connected once.

use std::sync::{Mutex, MutexGuard};

use crate::engine::{PostError, QpState, RecvWr};

#[derive(Debug, Default)]
pub(crate) struct BeforeConnect {
    early: Mutex<Vec<RecvWr>>,
    /// Connected once (a QP is not reused for a second connection).
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

    /// Starts bringing the connection up; `None` if the QP was connected
    /// before. Held until `done` or dropped, so two connects cannot race.
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
