//! A response on its way back to the client, and the placement it holds:
//! the rank's body passed through frame by frame as it comes (nothing is
//! buffered beyond hyper's own), and `finished` told to the coordinator
//! when the body ends, fails, or the client goes away (the body is dropped).

use std::pin::Pin;
use std::task::{Context, Poll};

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
pub struct Booked {
    pub inner: Incoming,
    pub booking: Option<Booking>,
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
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some(mut b) = self.booking.take() {
                    b.complete = true;
                }
            }
            Poll::Ready(Some(Err(_))) => drop(self.booking.take()),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
