//! Shared receive queues: receive work requests that several QPs draw from.

use std::collections::VecDeque;

use super::{PostError, RecvWr};
use crate::memory::PdId;

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    /// Its receives' lkeys are of this PD, whichever QP takes them.
    pd: PdId,
    queue: VecDeque<RecvWr>,
    max_wr: u32,
    max_sge: u32,
    /// Armed limit: fire once when fewer WQEs than this remain.
    limit: Option<u32>,
    limit_reached: bool,
}

impl Srq {
    /// An SRQ of `pd` holding `max_wr` receives with up to `max_sge` SGEs
    /// each.
    pub fn new(pd: PdId, max_wr: u32, max_sge: u32) -> Srq {
        Srq {
            pd,
            queue: VecDeque::new(),
            max_wr,
            max_sge,
            limit: None,
            limit_reached: false,
        }
    }

    /// Posts a receive.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        if wr.sgl.len() > self.max_sge as usize {
            return Err(PostError::TooManySges {
                given: wr.sgl.len(),
                max: self.max_sge,
            });
        }
        if self.queue.len() >= self.max_wr as usize {
            return Err(PostError::QueueFull(self.max_wr));
        }
        self.queue.push_back(wr);
        Ok(())
    }

    /// The PD its receives' lkeys belong to.
    pub fn pd(&self) -> PdId {
        self.pd
    }

    /// Takes the next receive for a QP.
    pub fn take(&mut self) -> Option<RecvWr> {
        let wr = self.queue.pop_front()?;
        if let Some(l) = self.limit
            && (self.queue.len() as u32) < l
        {
            // IBV_EVENT_SRQ_LIMIT_REACHED: once, then the limit is disarmed.
            self.limit = None;
            self.limit_reached = true;
        }
        Some(wr)
    }

    /// Arms the limit (`ibv_modify_srq` with IBV_SRQ_LIMIT); 0 disarms it.
    pub fn arm_limit(&mut self, limit: u32) -> Result<(), PostError> {
        if limit > self.max_wr {
            return Err(PostError::Unsupported("an SRQ limit above its size"));
        }
        self.limit = (limit > 0).then_some(limit);
        Ok(())
    }

    /// Whether the limit fired since the last call.
    pub fn take_limit_event(&mut self) -> bool {
        std::mem::take(&mut self.limit_reached)
    }

    /// Receives waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// No receives waiting.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Largest number of receives.
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// The armed limit.
    pub fn limit(&self) -> u32 {
        self.limit.unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_fires_once_below_the_mark() {
        let mut s = Srq::new(1, 8, 1);
        for i in 0..5 {
            s.post_recv(RecvWr::new(i, [])).unwrap();
        }
        s.arm_limit(3).unwrap();
        assert_eq!(s.take().unwrap().wr_id, 0);
        assert!(!s.take_limit_event(), "4 left, not below 3");
        s.take();
        assert!(!s.take_limit_event(), "3 left, not below 3");
        s.take();
        assert!(s.take_limit_event(), "2 left: below 3");
        s.take();
        assert!(!s.take_limit_event(), "disarmed after firing");
        assert_eq!(s.limit(), 0);
        assert!(s.arm_limit(9).is_err());
        for i in 0..7 {
            s.post_recv(RecvWr::new(i, [])).unwrap();
        }
        assert_eq!(
            s.post_recv(RecvWr::new(9, [])),
            Err(PostError::QueueFull(8))
        );
    }
}
