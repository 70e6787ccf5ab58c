//! A listener's background work: a thread takes connections, and each one
//! is readied (its first message awaited, its peer checked) on a thread of
//! its own, so that a client that connects and then says nothing holds up
//! no other; `accept` takes them as they come ready. As the kernel's
//! iw_cm and rdma_cm do before they report a connect request.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections being readied or waiting for `accept`, at most; more are
/// closed at once (a flood of idle connections must not cost a thread each).
const MAX_PENDING: usize = 64;

/// How often a waiting `accept` checks whether to give up (its QP moved to
/// ERR by another thread).
const GIVE_UP_CHECK: Duration = Duration::from_millis(50);

#[derive(Debug)]
struct Shared<T, E> {
    queue: Mutex<VecDeque<Result<T, E>>>,
    ready: Condvar,
    /// Connections taken and not yet handed to `accept`.
    pending: AtomicUsize,
    stop: AtomicBool,
}

impl<T, E> Shared<T, E> {
    fn push(&self, item: Result<T, E>) {
        self.queue.lock().expect("backlog lock").push_back(item);
        self.ready.notify_one();
    }
}

/// Connections of a listening socket `L`, readied into `T`s in the
/// background.
#[derive(Debug)]
pub(crate) struct Backlog<L: AsFd, T, E> {
    listening: Arc<L>,
    shared: Arc<Shared<T, E>>,
    acceptor: Option<JoinHandle<()>>,
}

impl<L, T, E> Backlog<L, T, E>
where
    L: AsFd + Send + Sync + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    /// Starts taking connections from `listening` with `take`, and readies
    /// each with `ready` on a thread of its own.
    pub(crate) fn start<S: Send + 'static>(
        listening: Arc<L>,
        take: impl Fn(&L) -> Result<S, E> + Send + 'static,
        ready: impl Fn(S) -> Result<T, E> + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let ready = Arc::new(ready);
        let acceptor = std::thread::Builder::new()
            .name("softrdma-listen".into())
            .spawn({
                let (listening, shared) = (listening.clone(), shared.clone());
                move || take_connections(&*listening, &shared, take, ready)
            })?;
        Ok(Backlog {
            listening,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The next connection for an `accept` whose QP `usable` checks:
    /// `Ok(None)` once `deadline` passes; `usable`'s error when the QP can
    /// take none, checked while this waits and again when one comes (moved
    /// to ERR just then: the connection, not yet answered, is left for the
    /// next accept).
    pub(crate) fn next_for<Q>(
        &self,
        deadline: Option<Instant>,
        usable: impl Fn() -> Result<(), Q>,
    ) -> Result<Option<Result<T, E>>, Q> {
        let Some(next) = self.next(deadline, || usable().is_err()) else {
            usable()?;
            return Ok(None);
        };
        match next {
            Ok(conn) => match usable() {
                Ok(()) => Ok(Some(Ok(conn))),
                Err(e) => {
                    self.put_back(conn);
                    Err(e)
                }
            },
            Err(e) => Ok(Some(Err(e))),
        }
    }

    /// Puts a connection taken by [`next`](Self::next) back at the front,
    /// for the next `accept` (this one's QP could not take it).
    fn put_back(&self, conn: T) {
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        self.shared
            .queue
            .lock()
            .expect("backlog lock")
            .push_front(Ok(conn));
        self.shared.ready.notify_one();
    }

    /// The next connection readied, or the error of one that failed to be;
    /// `None` once `deadline` passes or `give_up` says so (asked every
    /// [`GIVE_UP_CHECK`] while none comes).
    fn next(&self, deadline: Option<Instant>, give_up: impl Fn() -> bool) -> Option<Result<T, E>> {
        let lock = || self.shared.queue.lock().expect("backlog lock");
        let next = loop {
            if let Some(next) = lock().pop_front() {
                break next;
            }
            // Asked with the queue unlocked: it takes the QP's locks.
            if give_up() {
                return None;
            }
            let wait = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(GIVE_UP_CHECK),
                    _ => return None,
                },
                None => GIVE_UP_CHECK,
            };
            // Looked at again under the lock the wait releases: a push since
            // the last look notified no one.
            let mut queue = lock();
            if let Some(next) = queue.pop_front() {
                break next;
            }
            let (mut queue, _) = self
                .shared
                .ready
                .wait_timeout(queue, wait)
                .expect("backlog lock");
            if let Some(next) = queue.pop_front() {
                break next;
            }
        };
        self.shared.pending.fetch_sub(1, Ordering::AcqRel);
        Some(next)
    }
}

impl<L: AsFd, T, E> Drop for Backlog<L, T, E> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Ends the background thread's `accept` (EINVAL on Linux).
        let _ = rustix::net::shutdown(&*self.listening, rustix::net::Shutdown::Read);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn take_connections<L, S, T, E>(
    listening: &L,
    shared: &Arc<Shared<T, E>>,
    take: impl Fn(&L) -> Result<S, E>,
    ready: Arc<impl Fn(S) -> Result<T, E> + Send + Sync + 'static>,
) where
    S: Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    loop {
        let taken = take(listening);
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if shared.pending.load(Ordering::Acquire) >= MAX_PENDING {
            // Full: the connection closes; a failing `take` waits a little.
            if taken.is_err() {
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        shared.pending.fetch_add(1, Ordering::AcqRel);
        let conn = match taken {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: `accept` hears of it; no spinning.
                shared.push(Err(e));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let (mine, ready) = (shared.clone(), ready.clone());
        let readying = std::thread::Builder::new()
            .name("softrdma-conn".into())
            .spawn(move || mine.push(ready(conn)));
        if readying.is_err() {
            // No thread for it: the connection is closed, as when full.
            shared.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
