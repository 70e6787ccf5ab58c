//! Completion queues: a bounded queue of work completions with blocking
//! waits, and notification through a file descriptor (an eventfd) that works
//! with epoll and async runtimes, like a libibverbs completion channel.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, eventfd};
use spin::mutex::SpinMutex;
use spin::relax::Yield;

use crate::engine::{CqKind, WorkCompletion};

/// Why polling a CQ failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CqError {
    /// More completions arrived than the CQ holds: some were lost, and the
    /// queue pairs that lost them are unreliable now. Create larger CQs.
    #[error("completion queue overrun: more than {0} completions were waiting; some are lost")]
    Overrun(usize),
    /// A device through libibverbs failed to poll the CQ (its return
    /// code), or is gone (0): its QPs make no more progress.
    #[error("the device failed to poll the completion queue ({0}); see its async events")]
    Device(i32),
}

#[derive(Debug)]
struct State {
    queue: VecDeque<WorkCompletion>,
    /// Notification requested: Some(solicited_only).
    armed: Option<bool>,
    /// Threads blocked in `wait` (a push with none wakes nobody: no futex
    /// call on the shm provider's path).
    waiters: usize,
    /// How many queued completions wake them: the least any of them waits
    /// for (one wake-up for a batch, as a NIC's CQ moderation).
    wake_at: usize,
}

/// The shared part of a CQ, which the provider fills.
#[derive(Debug)]
pub(crate) struct CqInner {
    /// The CQ's number, for events.
    pub(crate) id: u64,
    /// Where a CQ error is reported.
    events: Option<std::sync::Arc<super::events::EventQueue>>,
    capacity: usize,
    /// Held for a push or a poll only, so it spins (giving the CPU away
    /// while it waits), as rdma-core's providers lock their CQs: its unlock
    /// is a plain store, where a futex mutex's is a locked instruction (and
    /// the first locked instruction after a large copy waits for the copy's
    /// stores to drain).
    state: SpinMutex<State, Yield>,
    /// The queue's length, stored under the lock at every change: an empty
    /// CQ's poll reads this and takes no lock.
    len: AtomicUsize,
    overrun: AtomicBool,
    /// Blocked waiters sleep on `ready` with this held; a push that sees
    /// waiters takes it before notifying, so no wake-up is lost.
    sleep: Mutex<()>,
    ready: Condvar,
    pub(crate) event: OwnedFd,
}

impl CqInner {
    pub(crate) fn new(
        capacity: usize,
        id: u64,
        events: Option<std::sync::Arc<super::events::EventQueue>>,
    ) -> std::io::Result<CqInner> {
        Ok(CqInner {
            id,
            events,
            capacity,
            state: SpinMutex::new(State {
                queue: VecDeque::with_capacity(capacity.min(4096)),
                armed: None,
                waiters: 0,
                wake_at: usize::MAX,
            }),
            len: AtomicUsize::new(0),
            overrun: AtomicBool::new(false),
            sleep: Mutex::new(()),
            ready: Condvar::new(),
            // A semaphore: each read takes one event, so two threads waiting
            // on the channel take one each (as `ibv_get_cq_event` gives them).
            event: eventfd(
                0,
                EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK | EventfdFlags::SEMAPHORE,
            )?,
        })
    }

    /// Whether the CQ reports its events to `events` (is of that context).
    pub(crate) fn reports_to(&self, events: &Arc<super::events::EventQueue>) -> bool {
        self.events.as_ref().is_some_and(|e| Arc::ptr_eq(e, events))
    }

    /// Adds a completion; returns whether the completion channel must be
    /// signalled (call [`CqInner::signal`] after dropping other locks).
    pub(crate) fn push(&self, wc: WorkCompletion) -> bool {
        let mut s = self.state.lock();
        // Past an overrun nothing more is taken: what was queued before it
        // is polled, then every poll says the CQ overran.
        if s.queue.len() >= self.capacity || self.overrun.load(Ordering::Acquire) {
            if !self.overrun.swap(true, Ordering::AcqRel)
                && let Some(e) = &self.events
            {
                e.push(super::events::AsyncEvent::CqError { cq: self.id });
            }
            return false;
        }
        s.queue.push_back(wc);
        self.len.store(s.queue.len(), Ordering::Release);
        let fire = match s.armed {
            Some(solicited_only) => {
                !solicited_only || wc.solicited || wc.status != crate::engine::WcStatus::Success
            }
            None => false,
        };
        if fire {
            s.armed = None;
        }
        let waiters = s.waiters > 0 && s.queue.len() >= s.wake_at;
        drop(s);
        if waiters {
            drop(self.sleep.lock().expect("CQ sleep lock"));
            self.ready.notify_all();
        }
        fire
    }

    /// Completes one work request flushed (posted to a QP in ERR: flushed
    /// at once, as siw and rxe do; how `ib_drain_qp` drains a QP), and
    /// signals the channel if that fires it.
    pub(crate) fn push_flushed(&self, wr_id: u64, opcode: crate::engine::WcOpcode, qpn: u32) {
        let wc = WorkCompletion::new(wr_id, crate::engine::WcStatus::WrFlushErr, opcode, qpn);
        if self.push(wc) {
            self.signal();
        }
    }

    /// Whether the CQ overran: whatever pushes to it now loses completions.
    pub(crate) fn overran(&self) -> bool {
        self.overrun.load(Ordering::Acquire)
    }

    /// Moves a QP's completion to its send or receive CQ (`cqs`, in that
    /// order), noting in `signal` whether that CQ's channel must be
    /// signalled. `false` if the CQ overran: the completion is lost, and the
    /// QP must fail.
    pub(crate) fn deliver(
        cqs: [&CqInner; 2],
        kind: CqKind,
        wc: WorkCompletion,
        signal: &mut [bool; 2],
    ) -> bool {
        let i = match kind {
            CqKind::Send => 0,
            CqKind::Recv => 1,
        };
        signal[i] |= cqs[i].push(wc);
        !cqs[i].overran()
    }

    /// Whether no completion waits (read without the lock).
    #[inline]
    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    /// Takes the oldest completion; an empty queue's answer takes no lock.
    /// Inline, as [`Cq::poll_one`]: a call across the crate boundary copies
    /// the completion through the stack (18 ns more an shm post and poll).
    #[inline]
    fn pop(&self) -> Option<WorkCompletion> {
        if self.is_empty() {
            return None;
        }
        let mut s = self.state.lock();
        let wc = s.queue.pop_front();
        self.len.store(s.queue.len(), Ordering::Release);
        wc
    }

    /// Takes up to `n` of the oldest completions into `out`.
    fn take_into(&self, n: usize, out: &mut impl Extend<WorkCompletion>) {
        if self.is_empty() {
            return;
        }
        let mut s = self.state.lock();
        let take = n.min(s.queue.len());
        out.extend(s.queue.drain(..take));
        self.len.store(s.queue.len(), Ordering::Release);
    }

    /// Signals the completion channel.
    pub(crate) fn signal(&self) {
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }
}

/// A completion queue.
#[derive(Debug, Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
    /// The RoCEv2 device whose receiving a poll may do (busy-poll mode).
    /// Held as QPs and PDs hold their device (a weak reference cost every
    /// look of a spinning poll two atomic read-modify-writes).
    driver: Option<Arc<crate::provider::udp::Shared>>,
    /// The iWARP device's connections, whose receiving a poll may do, and
    /// its busy-poll flag.
    connections: Option<(Arc<crate::provider::tcp::Connections>, Arc<AtomicBool>)>,
    /// A libibverbs device's CQ, which every call goes to instead.
    pub(crate) hw: Option<Arc<crate::provider::ibverbs::HwCq>>,
}

impl Cq {
    pub(crate) fn new(
        capacity: usize,
        id: u64,
        events: Option<Arc<super::events::EventQueue>>,
    ) -> std::io::Result<Cq> {
        Ok(Cq {
            inner: Arc::new(CqInner::new(capacity, id, events)?),
            driver: None,
            connections: None,
            hw: None,
        })
    }

    /// A libibverbs device's CQ.
    pub(crate) fn on_hardware(mut self, hw: Arc<crate::provider::ibverbs::HwCq>) -> Cq {
        self.hw = Some(hw);
        self
    }

    /// A CQ of an iWARP device: in the device's busy-poll mode, polling it
    /// receives for the device's connections.
    pub(crate) fn polls_connections(
        mut self,
        connections: &Arc<crate::provider::tcp::Connections>,
        busy_poll: &Arc<AtomicBool>,
    ) -> Cq {
        self.connections = Some((connections.clone(), busy_poll.clone()));
        self
    }

    /// The iWARP device's connections, in busy-poll mode.
    fn busy_connections(&self) -> Option<&crate::provider::tcp::Connections> {
        self.connections
            .as_ref()
            .filter(|(_, busy)| busy.load(Ordering::Relaxed))
            .map(|(c, _)| &**c)
    }

    /// A CQ of a RoCEv2 device: in the device's busy-poll mode, polling it
    /// receives for the device.
    pub(crate) fn driven_by(mut self, device: &Arc<crate::provider::udp::Shared>) -> Cq {
        self.driver = Some(device.clone());
        self
    }

    /// In busy-poll mode (`Device::busy_poll`), receives and handles what
    /// waits for the CQ's device (RoCEv2) or its QPs' connections (iWARP) on
    /// this thread, as every poll of an empty CQ does; a thread spinning on
    /// memory (a WRITE ping-pong) calls this between looks. Otherwise, and
    /// on shm, does nothing.
    pub fn progress(&self) {
        if let Some(d) = &self.driver {
            crate::provider::udp::poll_now(d);
        }
        if let Some(c) = self.busy_connections() {
            c.poll();
        }
    }

    /// A thread that polled is going to sleep on the channel: in busy-poll
    /// mode the receiving becomes the progress thread's (RoCEv2) or the
    /// connections' threads' (iWARP, until the guard drops).
    pub(crate) fn going_to_sleep(&self) -> Option<crate::provider::tcp::AppAsleep> {
        if let Some(d) = self.busy_device() {
            crate::provider::udp::app_sleeps(d);
        }
        self.busy_connections().map(|c| c.app_sleeps())
    }

    /// The CQ's device, if it is in busy-poll mode.
    fn busy_device(&self) -> Option<&crate::provider::udp::Shared> {
        self.driver.as_deref().filter(|d| d.busy_poll())
    }

    fn busy(&self) -> bool {
        self.busy_device().is_some()
    }

    /// Busy-poll mode: an empty CQ's poll receives for the device first (the
    /// CQ lock is taken only in that mode).
    fn poll_device_if_empty(&self) {
        if let Some(d) = self.busy_device()
            && self.is_empty()
        {
            crate::provider::udp::poll_now(d);
        }
        if let Some(c) = self.busy_connections()
            && self.is_empty()
        {
            c.poll();
        }
    }

    /// The CQ's number (as async events name it).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// How many completions the CQ holds.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Takes up to `out.len()` completions (`ibv_poll_cq`); returns how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, CqError> {
        if let Some(hw) = &self.hw {
            return hw.poll(out);
        }
        self.poll_device_if_empty();
        if self.inner.is_empty() {
            return self.overran().map(|()| 0);
        }
        let mut s = self.inner.state.lock();
        let n = out.len().min(s.queue.len());
        for (slot, wc) in out.iter_mut().zip(s.queue.drain(..n)) {
            *slot = wc;
        }
        self.inner.len.store(s.queue.len(), Ordering::Release);
        Ok(n)
    }

    /// Takes one completion, if there is one.
    // Inline: called across the crate boundary, the completion went through
    // two stack copies that held most of this function's samples (an shm
    // 8-byte post and poll took 66 ns, inline 51).
    #[inline]
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>, CqError> {
        if let Some(hw) = &self.hw {
            return hw.poll_one();
        }
        self.poll_device_if_empty();
        match self.inner.pop() {
            Some(wc) => Ok(Some(wc)),
            None => self.overran().map(|()| None),
        }
    }

    /// `Err` once the CQ overran (asked when its queue is empty: the
    /// completions queued before the overrun are polled first).
    #[inline]
    fn overran(&self) -> Result<(), CqError> {
        if self.inner.overrun.load(Ordering::Acquire) {
            return Err(CqError::Overrun(self.inner.capacity));
        }
        Ok(())
    }

    fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// Waits until a completion is there, then takes it; `Ok(None)` after
    /// `timeout`. Blocks, except in busy-poll mode, where it polls (and so
    /// receives for the device) until then.
    pub fn wait(&self, timeout: Duration) -> Result<Option<WorkCompletion>, CqError> {
        let deadline = super::deadline_after(timeout);
        if let Some(hw) = &self.hw {
            return Ok(hw.wait_for(1, deadline)?.pop());
        }
        if self.busy() {
            let mut spins = 0u32;
            loop {
                if let Some(wc) = self.poll_one()? {
                    return Ok(Some(wc));
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && Instant::now() >= deadline {
                    return Ok(None);
                }
                std::hint::spin_loop();
            }
        }
        // iWARP in busy-poll mode: a thread that sleeps here leaves the
        // receiving to the connections' receive threads meanwhile.
        let _sleeping = self.busy_connections().map(|c| c.app_sleeps());
        loop {
            self.sleep_until(deadline, 1)?;
            if let Some(wc) = self.inner.pop() {
                return Ok(Some(wc));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// Sleeps until `need` completions are queued (at most the CQ's
    /// capacity) or `deadline`.
    fn sleep_until(&self, deadline: Instant, need: usize) -> Result<(), CqError> {
        let need = need.clamp(1, self.inner.capacity.max(1));
        let mut asleep = self.inner.sleep.lock().expect("CQ sleep lock");
        loop {
            let now = Instant::now();
            {
                let mut s = self.inner.state.lock();
                if s.queue.len() >= need || now >= deadline {
                    return Ok(());
                }
                // Overrun: no more will come; what is queued is taken first.
                if self.inner.overrun.load(Ordering::Acquire) {
                    return if s.queue.is_empty() {
                        Err(CqError::Overrun(self.inner.capacity))
                    } else {
                        Ok(())
                    };
                }
                s.waiters += 1;
                s.wake_at = s.wake_at.min(need);
            }
            asleep = self
                .inner
                .ready
                .wait_timeout(asleep, deadline - now)
                .expect("CQ sleep lock")
                .0;
            let mut s = self.inner.state.lock();
            s.waiters -= 1;
            if s.waiters == 0 {
                s.wake_at = usize::MAX;
            }
        }
    }

    /// Waits for `n` completions (or `timeout`); returns those that came.
    /// A blocking wait sleeps until all `n` are there: one wake-up, not `n`.
    /// (A libibverbs device's CQ wakes it at each channel event instead.)
    pub fn wait_for(&self, n: usize, timeout: Duration) -> Result<Vec<WorkCompletion>, CqError> {
        let deadline = super::deadline_after(timeout);
        if let Some(hw) = &self.hw {
            return hw.wait_for(n, deadline);
        }
        // More than the CQ holds may come over time, but needn't be reserved.
        let mut got = Vec::with_capacity(n.min(self.capacity()));
        let busy = self.busy();
        while got.len() < n {
            if busy {
                let left = deadline.saturating_duration_since(Instant::now());
                match self.wait(left)? {
                    Some(wc) => got.push(wc),
                    None => break,
                }
                continue;
            }
            let _sleeping = self.busy_connections().map(|c| c.app_sleeps());
            if let Err(e) = self.sleep_until(deadline, n - got.len()) {
                // Those taken are returned; the next call gets the error.
                if got.is_empty() {
                    return Err(e);
                }
                break;
            }
            self.inner.take_into(n - got.len(), &mut got);
            if Instant::now() >= deadline {
                break;
            }
        }
        Ok(got)
    }

    /// Asks for one event on the completion channel at the next completion
    /// (`ibv_req_notify_cq`); with `solicited_only`, only at a solicited one
    /// or an error. If completions are already waiting, the event fires now.
    /// An arm for any completion is not narrowed by a later solicited-only
    /// one (as rdmavt's `req_notify_cq` keeps NEXT_COMP).
    /// On a libibverbs device the device's rule holds instead: rxe fires
    /// only for completions that come after the arming, so arm, then poll
    /// once more before waiting (as libibverbs programs do).
    pub fn req_notify(&self, solicited_only: bool) {
        if let Some(hw) = &self.hw {
            return hw.req_notify(solicited_only);
        }
        let mut s = self.inner.state.lock();
        let solicited_only = solicited_only && s.armed != Some(false);
        let pending = s.queue.iter().any(|wc| {
            !solicited_only || wc.solicited || wc.status != crate::engine::WcStatus::Success
        });
        if pending {
            s.armed = None;
            drop(s);
            self.inner.signal();
        } else {
            s.armed = Some(solicited_only);
        }
    }

    /// Consumes the pending events of the completion channel (`ibv_get_cq_event`
    /// plus `ibv_ack_cq_events`); returns how many there were (0 if none).
    pub fn take_events(&self) -> u64 {
        if let Some(hw) = &self.hw {
            return hw.take_events();
        }
        let mut n = 0;
        while self.take_event() {
            n += 1;
        }
        n
    }

    /// Consumes one pending event of the channel, if there is one.
    fn take_event(&self) -> bool {
        let mut b = [0u8; 8];
        matches!(rustix::io::read(&self.inner.event, &mut b), Ok(8))
    }

    /// Blocks until the completion channel fires or `timeout` passes; `true`
    /// if it fired.
    pub fn wait_event(&self, timeout: Duration) -> bool {
        if let Some(hw) = &self.hw {
            return hw.wait_event(timeout);
        }
        let mut fds = [rustix::event::PollFd::new(
            &self.inner.event,
            rustix::event::PollFlags::IN,
        )];
        // A timeout beyond what a timespec holds waits without one.
        let mut ts = i64::try_from(timeout.as_secs())
            .ok()
            .map(|tv_sec| rustix::time::Timespec {
                tv_sec,
                tv_nsec: i64::from(timeout.subsec_nanos()),
            });
        let _sleeping = self.going_to_sleep();
        let deadline = super::deadline_after(timeout);
        loop {
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(0) => return false,
                Ok(_) if self.take_event() => return true,
                // Another thread took the event first: this one waits on,
                // as `ibv_get_cq_event` does; and a signal is not the
                // channel firing, nor the timeout. Either way the wait goes
                // on for what is left of its time (signals faster than the
                // timeout would otherwise hold it forever).
                Ok(_) | Err(rustix::io::Errno::INTR) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    ts = ts.map(|_| rustix::time::Timespec {
                        tv_sec: left.as_secs() as i64,
                        tv_nsec: i64::from(left.subsec_nanos()),
                    });
                }
                Err(_) => return false,
            }
        }
    }
}

impl AsFd for Cq {
    /// The completion channel: readable when an event fired.
    fn as_fd(&self) -> BorrowedFd<'_> {
        if let Some(hw) = &self.hw {
            return hw.as_fd();
        }
        self.inner.event.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{WcOpcode, WcStatus};
    use std::sync::mpsc;

    fn wc(id: u64) -> WorkCompletion {
        WorkCompletion::new(id, WcStatus::Success, WcOpcode::Send, 1)
    }

    #[test]
    fn a_wait_for_several_sleeps_until_all_are_there() {
        let cq = Cq::new(16, 1, None).unwrap();
        let (done_tx, done) = mpsc::channel();
        let waiter = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                let got = cq.wait_for(3, Duration::from_secs(10)).unwrap();
                done_tx.send(()).unwrap();
                got
            })
        };
        // Asleep with a threshold of 3: the first two wake nobody.
        while cq.inner.state.lock().waiters == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(cq.inner.state.lock().wake_at, 3);
        for id in [1, 2] {
            cq.inner.push(wc(id));
        }
        assert!(done.recv_timeout(Duration::from_millis(100)).is_err());
        cq.inner.push(wc(3));
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        let ids: Vec<u64> = waiter.join().unwrap().iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, [1, 2, 3]);
        assert_eq!(cq.inner.state.lock().wake_at, usize::MAX, "reset");
        // A single wait wakes at the first.
        let waiter = {
            let cq = cq.clone();
            std::thread::spawn(move || cq.wait(Duration::from_secs(10)).unwrap())
        };
        while cq.inner.state.lock().waiters == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        cq.inner.push(wc(4));
        assert_eq!(waiter.join().unwrap().map(|w| w.wr_id), Some(4));
    }

    #[test]
    fn a_wait_for_more_than_come_returns_what_came_at_its_timeout() {
        let cq = Cq::new(4, 1, None).unwrap();
        cq.inner.push(wc(1));
        let t = Instant::now();
        // More than the CQ holds counts as its capacity.
        let got = cq.wait_for(9, Duration::from_millis(50)).unwrap();
        assert_eq!(got.len(), 1);
        assert!(t.elapsed() >= Duration::from_millis(50));
    }
}
