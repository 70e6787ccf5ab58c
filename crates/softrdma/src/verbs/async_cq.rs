//! The asynchronous face of a CQ (feature `tokio`): its completions as a
//! `Stream`, awaited without a thread of their own. The completion channel's
//! eventfd wakes the task through tokio's reactor, as an application using
//! libibverbs registers `ibv_comp_channel`'s fd with its event loop.

use std::future::poll_fn;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::task::coop;

use super::cq::{Cq, CqError};
use crate::engine::WorkCompletion;

/// A CQ whose completions are awaited (`next`) or streamed
/// (`futures_core::Stream`): a task waits for them on tokio's reactor, and
/// no thread polls. The stream ends after an error (a CQ overrun), which it
/// yields first, or without one if the reactor drops the descriptor (the
/// runtime shutting down). A CQ that always has a completion ready still
/// yields to the runtime when the task's budget runs out (tokio's `coop`).
///
/// ```no_run
/// # async fn f(cq: softrdma::verbs::Cq) -> Result<(), Box<dyn std::error::Error>> {
/// let mut cq = softrdma::verbs::AsyncCq::new(cq)?;
/// let wc = cq.next().await.expect("a completion")?;
/// # Ok(()) }
/// ```
pub struct AsyncCq {
    cq: Cq,
    /// A duplicate of the completion channel's eventfd: each `AsyncCq` of
    /// one CQ registers its own with the reactor.
    channel: AsyncFd<OwnedFd>,
    /// In busy-poll mode, iWARP's receive threads receive while this waits.
    asleep: Option<crate::provider::tcp::AppAsleep>,
    ended: bool,
}

impl std::fmt::Debug for AsyncCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCq")
            .field("cq", &self.cq.id())
            .field("ended", &self.ended)
            .finish()
    }
}

impl AsyncCq {
    /// Takes `cq` over. Its completion channel's events are this one's to
    /// consume: others waiting on the channel of a clone of `cq` (another
    /// `AsyncCq`, `Cq::wait_event`) take events it would have woken for,
    /// and the one that polls first gets a completion.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime with I/O enabled (as `AsyncFd`).
    pub fn new(cq: Cq) -> io::Result<AsyncCq> {
        // The CQ's channel: a libibverbs device's, else softrdma's eventfd.
        let fd = std::os::fd::AsFd::as_fd(&cq).try_clone_to_owned()?;
        // SAFETY: the `AsyncFd` owns `fd`, a descriptor of its own (a
        // duplicate): it stays open and the same until the `AsyncFd` drops
        // it or gives it back.
        let channel = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(AsyncCq {
            cq,
            channel,
            asleep: None,
            ended: false,
        })
    }

    /// The CQ.
    pub fn cq(&self) -> &Cq {
        &self.cq
    }

    /// Gives the CQ back, its channel's pending events consumed (it may
    /// still be armed for one more).
    pub fn into_inner(self) -> Cq {
        self.cq.take_events();
        self.cq
    }

    /// The next completion; `None` once the stream has ended (after an
    /// error).
    pub async fn next(&mut self) -> Option<Result<WorkCompletion, CqError>> {
        poll_fn(|cx| self.poll_completion(cx)).await
    }

    /// Polls for the next completion, registering the task for a wake-up
    /// when there is none.
    pub fn poll_completion(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<WorkCompletion, CqError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let budget = ready!(coop::poll_proceed(cx));
        loop {
            if let Some(done) = self.look() {
                budget.made_progress();
                return Poll::Ready(Some(done));
            }
            // Armed, then looked at again: a completion that came between
            // the first look and the arm fires no event.
            self.cq.req_notify(false);
            if let Some(done) = self.look() {
                budget.made_progress();
                return Poll::Ready(Some(done));
            }
            if self.asleep.is_none() {
                self.asleep = self.cq.going_to_sleep();
            }
            let mut ready = match ready!(self.channel.poll_read_ready(cx)) {
                Ok(r) => r,
                // The reactor failed this fd: waiting can't go on.
                Err(_) => {
                    self.ended = true;
                    return Poll::Ready(None);
                }
            };
            // Emptied before readiness is cleared: tokio keeps an edge that
            // came after this readiness was seen.
            self.cq.take_events();
            ready.clear_ready();
        }
    }

    /// One look at the CQ.
    fn look(&mut self) -> Option<Result<WorkCompletion, CqError>> {
        let got = self.cq.poll_one().transpose()?;
        self.asleep = None;
        if got.is_err() {
            self.ended = true;
        }
        Some(got)
    }
}

impl futures_core::Stream for AsyncCq {
    type Item = Result<WorkCompletion, CqError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_completion(cx)
    }
}
