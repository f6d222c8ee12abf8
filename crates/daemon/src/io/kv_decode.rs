//! The KV decoder: a thread that turns the KV publishers' messages into
//! engine events, so the routing thread never decodes a batch.
//!
//! The transport receives a KV message (libzmq hands its frames over
//! without a copy), passes it here, and later takes the decoded event back
//! in the order the messages were passed; the coordinator then applies it
//! a slice at a time. Memory between the two threads is bounded in bytes:
//! while the messages passed and not yet taken back add up to
//! [`queue_bytes`], the transport reads no KV socket, so the backlog waits
//! in libzmq's own receive queue, bounded by its byte high-water mark, and
//! past that a publisher drops at its end. Dropping here instead would
//! lose batches whose `seq` dpcoord has seen, a loss it would have to
//! recover some other way; a publisher's drop is a `seq` gap, recovered by
//! replay as any other. At most one decoded event waits for the routing
//! thread, and the decoder holds one more.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::thread::JoinHandle;

use crate::engines::EngineEvent;
use crate::wire::{decode_source, SourceError, SourceKind, SourceLimits};

/// The bytes of KV messages that may wait for the decoder: two batches at
/// `kv_events.max_batch_bytes` (8 MiB at the defaults). One message more
/// may cross it: the one read while there was room.
pub fn queue_bytes(kv_batch: usize) -> usize {
    kv_batch.saturating_mul(2)
}

/// One decoded KV message.
pub struct Decoded {
    pub kind: SourceKind,
    pub event: Result<EngineEvent, SourceError>,
    /// The bytes of its frames, counted in the queue until taken.
    bytes: usize,
}

struct Job {
    kind: SourceKind,
    /// `None`: more frames than the transport keeps.
    frames: Option<Vec<zmq::Message>>,
    limits: SourceLimits,
    bytes: usize,
}

pub struct KvDecoder {
    jobs: Option<mpsc::Sender<Job>>,
    done: Option<Receiver<Decoded>>,
    /// Taken from `done` to learn that one is there, not yet handed on.
    ready: Option<Decoded>,
    /// Rung (one byte) after each event decoded, to wake the poll.
    bell: UnixStream,
    thread: Option<JoinHandle<()>>,
    /// Bytes of messages passed and not yet taken back.
    queued: usize,
    max_queued: usize,
}

fn decode(jobs: Receiver<Job>, done: SyncSender<Decoded>, mut bell: UnixStream) {
    super::niceness::lower_this_thread();
    for job in jobs {
        let event = decode_source(job.kind, job.frames.as_deref(), &job.limits);
        drop(job.frames);
        if done.send(Decoded { kind: job.kind, event, bytes: job.bytes }).is_err() {
            return;
        }
        // A full socket buffer means the bell is ringing already.
        let _ = bell.write(&[1]);
    }
}

impl KvDecoder {
    /// Starts the thread; `max_queued` is [`queue_bytes`] of the batch limit.
    pub fn start(max_queued: usize) -> std::io::Result<KvDecoder> {
        let (bell, ringer) = UnixStream::pair()?;
        bell.set_nonblocking(true)?;
        ringer.set_nonblocking(true)?;
        let (jobs, rx) = mpsc::channel();
        let (tx, done) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new().name("kv-decode".into()).spawn(move || decode(rx, tx, ringer))?;
        Ok(KvDecoder {
            jobs: Some(jobs),
            done: Some(done),
            ready: None,
            bell,
            thread: Some(thread),
            queued: 0,
            max_queued,
        })
    }

    /// The descriptor that becomes readable when an event was decoded.
    pub fn bell_fd(&self) -> RawFd {
        self.bell.as_raw_fd()
    }

    /// Empties the bell, before [`KvDecoder::take`] looks for events.
    pub fn quiet(&mut self) {
        let mut buf = [0u8; 256];
        while matches!(self.bell.read(&mut buf), Ok(n) if n > 0) {}
    }

    /// Whether another message may be passed.
    pub fn has_room(&self) -> bool {
        self.queued < self.max_queued
    }

    /// Passes one message to the decoder.
    pub fn send(&mut self, kind: SourceKind, frames: Option<Vec<zmq::Message>>, limits: SourceLimits) {
        let bytes = frames.as_ref().map_or(0, |f| f.iter().map(|m| m.len()).sum());
        self.queued += bytes;
        if let Some(jobs) = &self.jobs {
            // The thread ends only when a decoder panics; `take` reports it.
            let _ = jobs.send(Job { kind, frames, limits, bytes });
        }
    }

    /// Whether a decoded event is waiting.
    pub fn has_ready(&mut self) -> bool {
        if self.ready.is_none() {
            self.ready = match self.done.as_ref().map(Receiver::try_recv) {
                Some(Ok(d)) => Some(d),
                Some(Err(TryRecvError::Empty)) | None => None,
                Some(Err(TryRecvError::Disconnected)) => self.rethrow(),
            };
        }
        self.ready.is_some()
    }

    /// The next decoded event, in the order the messages were passed.
    pub fn take(&mut self) -> Option<Decoded> {
        self.has_ready();
        let d = self.ready.take()?;
        self.queued -= d.bytes;
        Some(d)
    }

    /// The thread is gone: only a panic ends it while the jobs are open,
    /// which is resumed here as it would have been on the routing thread.
    fn rethrow(&mut self) -> ! {
        if let Some(Err(panic)) = self.thread.take().map(JoinHandle::join) {
            std::panic::resume_unwind(panic);
        }
        panic!("the KV decoder thread ended");
    }
}

impl Drop for KvDecoder {
    fn drop(&mut self) {
        // Closing both channels ends the thread, waiting or blocked.
        drop(self.jobs.take());
        drop(self.done.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
