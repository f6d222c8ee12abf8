//! A response on its way back to the client, and the placement it holds:
//! the rank's body passed through as it comes (nothing is held but the
//! frames already in, for one turn of the runtime: see [`Booked`]), and
//! `finished` told to the coordinator when the body ends, fails, or the
//! client goes away (the body is dropped).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};

use super::super::bridge::Bridge;
use super::super::decide::finished;
use super::super::metrics::GatewayMetrics;

/// The placement of a routed request, booked `finished` when dropped.
pub struct Booking {
    pub bridge: Bridge,
    pub metrics: GatewayMetrics,
    pub rank: u32,
    /// The body came to its end (not cut by the rank or the client).
    pub complete: bool,
}

impl Drop for Booking {
    fn drop(&mut self) {
        if !self.complete {
            self.metrics.rank_error(self.rank, "reset");
        }
        self.bridge.tell(finished(self.rank, self.rank));
    }
}

/// The rank's response body, with the booking of its request (none for a
/// request without a prompt).
///
/// hyper's client hands a body over one frame at a time, the next decoded
/// by the connection's task only once the last was taken; and hyper's
/// server writes to the client whenever the body has nothing ready. Passed
/// on as they come, the frames of one read from the rank (a short
/// response's every event) would cost a write each. So frames taken are
/// held until the runtime has had a turn (the connection's task has run),
/// and those then in are handed on together, into one write: none waits
/// for the rank.
pub struct Booked {
    inner: Incoming,
    booking: Option<Booking>,
    /// Frames taken, not yet handed on.
    held: VecDeque<Frame<Bytes>>,
    /// The body's end (`None`) or its failure, once `held` is handed on.
    end: Option<Option<hyper::Error>>,
    /// Frames are held until the turn since the last was taken has come.
    gathering: bool,
    turn: Arc<Turn>,
}

/// A turn of the runtime: the body's task woken once the tasks woken
/// before have run (tokio's `yield_now` defers the wake-up till then).
/// hyper polls a pending body again at once, in the same turn: only this
/// wake-up says the turn has come.
#[derive(Default)]
struct Turn {
    /// Asked for, not yet come.
    waiting: AtomicBool,
    task: Mutex<Option<Waker>>,
}

impl Turn {
    fn ask(self: &Arc<Self>, cx: &Context<'_>) {
        *self.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        self.waiting.store(true, Ordering::Release);
        let waker = Waker::from(Arc::clone(self));
        let _ = pin!(tokio::task::yield_now()).poll(&mut Context::from_waker(&waker));
    }
}

impl Wake for Turn {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.waiting.store(false, Ordering::Release);
        if let Some(task) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            task.wake();
        }
    }
}

impl Booked {
    pub fn new(inner: Incoming, booking: Option<Booking>) -> Booked {
        Booked { inner, booking, held: VecDeque::new(), end: None, gathering: false, turn: Arc::default() }
    }
}

impl Drop for Booked {
    fn drop(&mut self) {
        // A body that ended without being read to its end (an empty one
        // hyper does not poll) is complete all the same.
        if self.inner.is_end_stream() {
            if let Some(b) = &mut self.booking {
                b.complete = true;
            }
        }
    }
}

impl Body for Booked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let me = &mut *self;
        loop {
            if !me.gathering {
                if let Some(frame) = me.held.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(end) = me.end.take() {
                    return Poll::Ready(end.map(Err));
                }
            }
            match Pin::new(&mut me.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    me.held.push_back(frame);
                    me.gathering = true;
                    // A turn asked for before this frame was taken comes
                    // after the connection's task, woken by the taking.
                    if !me.turn.waiting.load(Ordering::Acquire) {
                        me.turn.ask(cx);
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    if let Some(mut b) = me.booking.take() {
                        b.complete = true;
                    }
                    (me.end, me.gathering) = (Some(None), false);
                }
                Poll::Ready(Some(Err(e))) => {
                    drop(me.booking.take());
                    (me.end, me.gathering) = (Some(Some(e)), false);
                }
                Poll::Pending if me.gathering && me.turn.waiting.load(Ordering::Acquire) => return Poll::Pending,
                Poll::Pending if me.gathering => me.gathering = false,
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty()
            && match &self.end {
                Some(end) => end.is_none(),
                None => self.inner.is_end_stream(),
            }
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self.held.iter().filter_map(Frame::data_ref).map(|d| d.len() as u64).sum();
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + held);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}
