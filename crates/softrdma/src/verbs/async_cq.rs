//! The asynchronous face of a CQ (feature `tokio`): its completions as a
//! `Stream`, awaited without a thread of their own. The completion channel's
//! eventfd wakes the task through tokio's reactor, as an application using
//! libibverbs registers `ibv_comp_channel`'s fd with its event loop.

use std::future::poll_fn;
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::cq::{Cq, CqError, CqInner};
use crate::engine::WorkCompletion;

/// The completion channel's eventfd, kept open by the CQ it belongs to.
struct Channel(Arc<CqInner>);

impl AsRawFd for Channel {
    fn as_raw_fd(&self) -> RawFd {
        self.0.event.as_fd().as_raw_fd()
    }
}

/// A CQ whose completions are awaited (`next`) or streamed
/// (`futures_core::Stream`): a task waits for them on tokio's reactor, and
/// no thread polls. The stream ends after an error (a CQ overrun), which it
/// yields first.
///
/// ```no_run
/// # async fn f(cq: softrdma::verbs::Cq) -> Result<(), Box<dyn std::error::Error>> {
/// let mut cq = softrdma::verbs::AsyncCq::new(cq)?;
/// let wc = cq.next().await.expect("a completion")?;
/// # Ok(()) }
/// ```
pub struct AsyncCq {
    cq: Cq,
    channel: AsyncFd<Channel>,
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
    /// Takes `cq` over; must run inside a tokio runtime with I/O enabled.
    /// Its completion channel is this one's: no other thread should wait
    /// on a clone of `cq` meanwhile.
    pub fn new(cq: Cq) -> io::Result<AsyncCq> {
        // SAFETY: `Channel` holds the CQ's `CqInner`, which owns the eventfd:
        // it stays open, and `as_raw_fd` names it, for as long as the
        // `AsyncFd` owns the `Channel`.
        let channel = unsafe {
            AsyncFd::register_with_interest(Channel(cq.inner.clone()), Interest::READABLE)
        }
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

    /// Gives the CQ back.
    pub fn into_inner(self) -> Cq {
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
        loop {
            if let Some(done) = self.look() {
                return Poll::Ready(Some(done));
            }
            // Armed, then looked at again: a completion that came between
            // the first look and the arm fires no event.
            self.cq.req_notify(false);
            if let Some(done) = self.look() {
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
