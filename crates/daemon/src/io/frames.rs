//! Receiving one multipart message, and the envelope rules of the query
//! sockets (docs/PROTOCOL.md §1): a reply goes back along the request's
//! envelope, so every envelope frame is bounded in size and count before
//! anything is echoed; a message that breaks the bounds is dropped unanswered.

use std::time::Instant;

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use crate::observability::metrics::{built, register};
use crate::observability::ratelimit::LogLimiter;
use crate::wire::Channel;

/// Frames before the empty delimiter, the peer's identity included, that
/// a query may carry (REQ peers send none; each proxy in between adds one).
pub const MAX_ENVELOPE_FRAMES: usize = 8;
/// The longest envelope frame: libzmq's routing ids are at most 255 bytes.
pub const MAX_ENVELOPE_FRAME_BYTES: usize = 255;
/// Frames kept of one message: a full envelope, its delimiter and one body
/// frame. Frames past these are read and released at once.
const KEPT: usize = MAX_ENVELOPE_FRAMES + 2;

crate::names! {
    /// Why a query was dropped without a reply.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Dropped {
        /// An envelope frame above [`MAX_ENVELOPE_FRAME_BYTES`].
        FrameTooLarge => "frame_too_large",
        /// More than [`MAX_ENVELOPE_FRAMES`] frames before the delimiter.
        TooManyFrames => "too_many_frames",
    }
}

/// What one received query is.
pub enum Parsed<'a> {
    /// The envelope to echo and the frames after it (one is a query).
    Query { envelope: &'a [zmq::Message], body: &'a [zmq::Message], frames: usize },
    /// Not answered: its envelope breaks a bound.
    Drop(Dropped, usize),
}

/// Reusable frames of one multipart message, and what was seen of them.
pub struct Frames {
    frames: Vec<zmq::Message>,
    /// Frames in the message (also those not kept).
    total: usize,
    /// The first empty frame after the identity.
    delimiter: Option<usize>,
    /// The longest frame before the delimiter (or in all, when there is none yet).
    longest: usize,
    pub reply: Vec<u8>,
}

impl Frames {
    pub fn new() -> Self {
        Frames {
            frames: (0..KEPT).map(|_| zmq::Message::new()).collect(),
            total: 0,
            delimiter: None,
            longest: 0,
            reply: Vec::with_capacity(4096),
        }
    }

    /// Receives one whole multipart message; `false` when none is waiting.
    /// libzmq hands over a multipart message only once all of it arrived,
    /// so reading its later frames never blocks.
    pub fn recv(&mut self, s: &zmq::Socket) -> Result<bool, zmq::Error> {
        self.total = 0;
        self.delimiter = None;
        self.longest = 0;
        let mut scratch = zmq::Message::new();
        loop {
            let flags = if self.total == 0 { zmq::DONTWAIT } else { 0 };
            let msg = if self.total < KEPT { &mut self.frames[self.total] } else { &mut scratch };
            match s.recv(msg, flags) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) if self.total == 0 => return Ok(false),
                Err(e) => return Err(e),
            }
            if self.delimiter.is_none() {
                if self.total > 0 && msg.is_empty() {
                    self.delimiter = Some(self.total);
                } else {
                    self.longest = self.longest.max(msg.len());
                }
            }
            self.total += 1;
            if !msg.get_more() {
                return Ok(true);
            }
        }
    }

    /// Every frame of the message just received, or `None` when it had
    /// more than are kept (a source message).
    pub fn whole(&self) -> Option<&[zmq::Message]> {
        (self.total <= KEPT).then(|| &self.frames[..self.total])
    }

    /// Takes the frames of the message just received, for another thread
    /// (`None` when it had more than are kept); fresh ones take their place.
    pub fn take_whole(&mut self) -> Option<Vec<zmq::Message>> {
        let total = self.total;
        self.total = 0;
        (total <= KEPT)
            .then(|| self.frames[..total].iter_mut().map(|m| std::mem::replace(m, zmq::Message::new())).collect())
    }

    /// Splits a query at the first empty frame after the identity (REQ, or
    /// DEALER with a delimiter), after checking the envelope's bounds;
    /// without a delimiter, the envelope is the identity alone (which
    /// libzmq bounds) and everything after it is the body.
    pub fn parse(&self) -> Parsed<'_> {
        let kept = self.total.min(KEPT);
        let env = match self.delimiter {
            Some(d) if d > MAX_ENVELOPE_FRAMES => return Parsed::Drop(Dropped::TooManyFrames, d),
            Some(_) if self.longest > MAX_ENVELOPE_FRAME_BYTES => {
                return Parsed::Drop(Dropped::FrameTooLarge, self.longest)
            }
            Some(d) => d + 1,
            None => 1.min(kept),
        };
        Parsed::Query { envelope: &self.frames[..env], body: &self.frames[env..kept], frames: self.total - env }
    }
}

/// `dpcoord_queries_dropped_total` and the rate limit of its warning.
pub struct Drops {
    /// By channel (route, health), then by [`Dropped::ALL`].
    counters: [[IntCounter; 2]; 2],
    log: LogLimiter<4>,
}

impl Drops {
    /// Registers the series, every one at zero.
    pub fn new(registry: &Registry) -> Self {
        let opts = Opts::new(
            "dpcoord_queries_dropped_total",
            "Queries dropped unanswered because their envelope broke a bound, by socket and reason.",
        );
        let family = register(registry, built(IntCounterVec::new(opts, &["socket", "reason"])));
        let counters = [Channel::Route, Channel::Health]
            .map(|ch| Dropped::ALL.map(|why| family.with_label_values(&[ch.as_str(), why.as_str()])));
        Drops { counters, log: LogLimiter::default() }
    }

    /// Counts one dropped query, and logs it at most once a second per cause.
    pub fn count(&mut self, ch: Channel, why: Dropped, size: usize, now: Instant) {
        let (c, w) = (usize::from(ch == Channel::Health), usize::from(why == Dropped::TooManyFrames));
        self.counters[c][w].inc();
        if let Some(suppressed) = self.log.allow(c * 2 + w, now) {
            let (limit, what) = match why {
                Dropped::FrameTooLarge => (MAX_ENVELOPE_FRAME_BYTES, "an envelope frame of this many bytes"),
                Dropped::TooManyFrames => (MAX_ENVELOPE_FRAMES, "this many frames before the delimiter"),
            };
            tracing::warn!(
                socket = ch.as_str(),
                reason = why.as_str(),
                size,
                limit,
                suppressed,
                "dropped a query unanswered: {what}, above the limit"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DEALER sends `frames` to a ROUTER; returns what the ROUTER's side parses.
    fn parsed(frames: &[&[u8]]) -> Result<(usize, usize, usize), (Dropped, usize)> {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("inproc://frames").unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.connect("inproc://frames").unwrap();
        dealer.send_multipart(frames, 0).unwrap();
        let mut f = Frames::new();
        router.set_rcvtimeo(5000).unwrap();
        let mut items = [router.as_poll_item(zmq::POLLIN)];
        zmq::poll(&mut items, 5000).unwrap();
        assert!(f.recv(&router).unwrap());
        match f.parse() {
            Parsed::Query { envelope, body, frames } => Ok((envelope.len(), body.len(), frames)),
            Parsed::Drop(why, size) => Err((why, size)),
        }
    }

    #[test]
    fn envelopes_within_bounds_split_at_the_delimiter() {
        assert_eq!(parsed(&[b"", b"q"]), Ok((2, 1, 1)));
        assert_eq!(parsed(&[b"q"]), Ok((1, 1, 1)));
        assert_eq!(parsed(&[b"q", b"r"]), Ok((1, 2, 2)));
        let hop = [7u8; MAX_ENVELOPE_FRAME_BYTES];
        // The identity and 7 more frames, then the delimiter: the most allowed.
        let mut most: Vec<&[u8]> = vec![&hop; MAX_ENVELOPE_FRAMES - 1];
        most.extend([&b""[..], b"q"]);
        assert_eq!(parsed(&most), Ok((MAX_ENVELOPE_FRAMES + 1, 1, 1)));
        // Body frames past those kept are counted, not kept.
        let many: Vec<&[u8]> = [&b""[..]].into_iter().chain([&b"q"[..]; 20]).collect();
        assert_eq!(parsed(&many), Ok((2, KEPT - 2, 20)));
    }

    #[test]
    fn envelopes_past_a_bound_are_dropped() {
        let big = [7u8; MAX_ENVELOPE_FRAME_BYTES + 1];
        assert_eq!(parsed(&[&big, b"", b"q"]), Err((Dropped::FrameTooLarge, MAX_ENVELOPE_FRAME_BYTES + 1)));
        let mut deep: Vec<&[u8]> = vec![b"hop"; MAX_ENVELOPE_FRAMES];
        deep.extend([&b""[..], b"q"]);
        assert_eq!(parsed(&deep), Err((Dropped::TooManyFrames, MAX_ENVELOPE_FRAMES + 1)));
        // Without a delimiter a long frame is body, not envelope: refused, not dropped.
        assert_eq!(parsed(&[&big, b"q"]), Ok((1, 2, 2)));
    }
}
