//! Asynchronous events of a device (`ibv_get_async_event`): a queue with a
//! blocking wait and an eventfd that becomes readable when events are waiting.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, eventfd};

/// An asynchronous event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncEvent {
    /// A QP went to ERR because of an error (IBV_EVENT_QP_FATAL).
    QpFatal {
        /// The QP.
        qpn: u32,
    },
    /// A QP on an SRQ went to ERR; it takes no more receives
    /// (IBV_EVENT_QP_LAST_WQE_REACHED).
    QpLastWqeReached {
        /// The QP.
        qpn: u32,
    },
    /// A QP moved from RTS to SQD has no sends outstanding: all it had
    /// started are acknowledged (IBV_EVENT_SQ_DRAINED). Once per move.
    SqDrained {
        /// The QP.
        qpn: u32,
    },
    /// An RC QP still in RTR received its first request: the peer is in RTS
    /// (IBV_EVENT_COMM_EST). Once per connection.
    CommEstablished {
        /// The QP.
        qpn: u32,
    },
    /// A CQ overran: completions were lost (IBV_EVENT_CQ_ERR).
    CqError {
        /// The CQ's number.
        cq: u64,
    },
    /// An SRQ fell below its armed limit (IBV_EVENT_SRQ_LIMIT_REACHED); the
    /// limit is disarmed until armed again.
    SrqLimitReached {
        /// The SRQ's number.
        srq: u64,
    },
    /// The port is up (IBV_EVENT_PORT_ACTIVE).
    PortActive,
    /// The port went down: the device's address is gone or unreachable
    /// (IBV_EVENT_PORT_ERR).
    PortDown,
    /// The device failed and makes no more progress; its QPs are in ERR
    /// (IBV_EVENT_DEVICE_FATAL). Open it again to go on.
    DeviceFatal,
}

/// The event queue of a device.
#[derive(Debug)]
pub(crate) struct EventQueue {
    queue: Mutex<VecDeque<AsyncEvent>>,
    /// Events dropped for room.
    dropped: AtomicU64,
    ready: Condvar,
    fd: OwnedFd,
}

/// Events kept at most; older ones are dropped first (an application that never
/// reads events must not grow memory without bound).
const MAX_EVENTS: usize = 4096;

impl EventQueue {
    pub(crate) fn new() -> std::io::Result<EventQueue> {
        Ok(EventQueue {
            queue: Mutex::new(VecDeque::new()),
            dropped: AtomicU64::new(0),
            ready: Condvar::new(),
            fd: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        })
    }

    pub(crate) fn push(&self, e: AsyncEvent) {
        let mut q = self.queue.lock().expect("event lock");
        if q.len() >= MAX_EVENTS {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(e);
        drop(q);
        self.ready.notify_all();
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn poll(&self) -> Option<AsyncEvent> {
        self.pop(&mut self.queue.lock().expect("event lock"))
    }

    /// Takes the oldest event from the locked queue; the descriptor goes
    /// quiet with the last.
    fn pop(&self, q: &mut VecDeque<AsyncEvent>) -> Option<AsyncEvent> {
        let e = q.pop_front();
        if q.is_empty() {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&self.fd, &mut b);
        }
        e
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Option<AsyncEvent> {
        let deadline = super::deadline_after(timeout);
        let mut q = self.queue.lock().expect("event lock");
        loop {
            // Taken under the lock that saw it: two waiters woken by one
            // event can't both see it and one come back with nothing.
            if !q.is_empty() {
                return self.pop(&mut q);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            q = self
                .ready
                .wait_timeout(q, deadline - now)
                .expect("event lock")
                .0;
        }
    }
}

impl AsFd for EventQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_the_oldest_and_counts_it() {
        let q = EventQueue::new().unwrap();
        for qpn in 0..MAX_EVENTS as u32 + 3 {
            q.push(AsyncEvent::QpFatal { qpn });
        }
        assert_eq!(q.dropped(), 3);
        assert_eq!(q.poll(), Some(AsyncEvent::QpFatal { qpn: 3 }));
    }
}
