//! A response on its way back to the client, and the placement it holds:
//! the rank's body passed through as it comes (nothing is held but the
//! frames already in, for one turn of the runtime: see [`Booked`]), and
//! `finished` told to the coordinator when the body ends, fails, or the
//! client goes away (the body is dropped); and, for a prediction, what the
//! engine says it served from its cache (`delivered`), read from the end
//! of a successful response.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};

use crate::bridge::Bridge;
use crate::decide::{delivered, finished};
use crate::metrics::GatewayMetrics;

/// The placement of a routed request, booked `finished` when dropped.
pub struct Booking {
    pub bridge: Bridge,
    pub metrics: GatewayMetrics,
    pub rank: u32,
    /// The body came to its end (not cut by the rank or the client).
    pub complete: bool,
    /// Prompt tokens predicted cached on `rank`, for a successful response
    /// whose engine's count of cached tokens is to be reported.
    pub predicted: Option<u64>,
}

/// How much of a response's end is kept to read the engine's count of
/// cached prompt tokens from: its usage comes last (a JSON body's `usage`,
/// a stream's last event before `[DONE]`) and is a few hundred bytes.
const TAIL: usize = 4 << 10;

/// The last [`TAIL`] bytes of a response, at most twice that held.
#[derive(Default)]
struct Tail(Vec<u8>);

impl Tail {
    fn push(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(TAIL)..];
        if self.0.len() + data.len() > 2 * TAIL {
            self.0.drain(..self.0.len() - TAIL.saturating_sub(data.len()).min(self.0.len()));
        }
        self.0.extend_from_slice(data);
    }

    /// The last `"cached_tokens": N` (vLLM's and SGLang's
    /// `usage.prompt_tokens_details`); `None` when there is none, or it is
    /// `null` or not a whole number.
    fn cached_tokens(&self) -> Option<u64> {
        const KEY: &[u8] = b"\"cached_tokens\"";
        let at = self.0.windows(KEY.len()).rposition(|w| w == KEY)?;
        let rest = self.0[at + KEY.len()..].trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
    }
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
    /// The response's end so far, kept while a prediction awaits its report.
    tail: Tail,
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
        Booked {
            inner,
            booking,
            tail: Tail::default(),
            held: VecDeque::new(),
            end: None,
            gathering: false,
            turn: Arc::default(),
        }
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
                    if let (Some(data), Some(Booking { predicted: Some(_), .. })) = (frame.data_ref(), &me.booking) {
                        me.tail.push(data);
                    }
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
                        if let (Some(p), Some(d)) = (b.predicted, me.tail.cached_tokens()) {
                            b.bridge.tell(delivered(b.rank, p, d));
                        }
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

#[cfg(test)]
mod tests {
    use super::Tail;

    fn tail(parts: &[&str]) -> Tail {
        let mut t = Tail::default();
        for p in parts {
            t.push(p.as_bytes());
        }
        t
    }

    #[test]
    fn the_last_count_of_cached_tokens_is_read_across_frames() {
        let body = r#"{"usage":{"prompt_tokens":90,"prompt_tokens_details":{"cached_tokens": 64}}}"#;
        assert_eq!(tail(&[body]).cached_tokens(), Some(64));
        let (a, b) = body.split_at(40);
        assert_eq!(tail(&[a, b]).cached_tokens(), Some(64));
        let stream = [
            "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n",
            "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
            "data: [DONE]\n\n",
        ];
        assert_eq!(tail(&stream).cached_tokens(), Some(32));
    }

    #[test]
    fn no_count_null_or_not_a_number_is_none() {
        assert_eq!(tail(&[r#"{"choices":[{"text":"ok"}]}"#]).cached_tokens(), None);
        assert_eq!(tail(&[r#"{"prompt_tokens_details":{"cached_tokens":null}}"#]).cached_tokens(), None);
        assert_eq!(tail(&[r#"{"prompt_tokens_details":{"cached_tokens":-3}}"#]).cached_tokens(), None);
        assert_eq!(tail(&[r#"{"cached_tokens":99999999999999999999999}"#]).cached_tokens(), None);
    }

    #[test]
    fn only_the_end_is_kept() {
        let early = r#"{"cached_tokens":7}"#;
        let mut t = tail(&[early]);
        for _ in 0..100 {
            t.push(&[b'y'; 1000]);
            assert!(t.0.len() <= 2 * super::TAIL);
        }
        assert_eq!(t.cached_tokens(), None, "a count long before the end is gone");
        t.push(&vec![b'z'; 3 * super::TAIL]);
        assert!(t.0.len() <= 2 * super::TAIL);
        t.push(early.as_bytes());
        assert_eq!(t.cached_tokens(), Some(7));
    }
}
