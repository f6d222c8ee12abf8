//! Reloads off the routing thread: the configuration is read and checked on
//! a reader thread of its own, so a file that is slow to read (or a path
//! swapped for something that never ends) cannot hold routing.
//!
//! A reload (SIGHUP or the `reload` op) starts a read; the routing loop
//! serves on, and applies what was read when it arrives (the reader rings a
//! bell the loop polls), then answers every `reload` op that waited for it.
//! One read at a time: reloads asked while one is in flight are coalesced
//! into one read after it (a reload reads the file as it is after it was
//! asked), at most [`MAX_WAITING`] ops waiting. A read that takes longer
//! than [`READ_DEADLINE`] is refused, its waiters answered; the reader is
//! left in it (never joined: a stop does not wait for it either), and
//! reloads are refused at once until it comes back, its late result
//! discarded.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use crate::config::{err, Config, ConfigError};
use crate::routing::Coordinator;
use crate::wire::{OwnedId, WireError};

/// How long a read may take before its reload is refused.
pub const READ_DEADLINE: Duration = Duration::from_secs(2);
/// `reload` ops that may wait for the next read; one more is refused at once.
pub const MAX_WAITING: usize = 64;

type ReadFn = Box<dyn FnMut() -> Result<Config, ConfigError> + Send>;

/// Where a reload reads the configuration: as at start, the file again with
/// the same flags folded in (so flags still win).
pub struct ConfigSource {
    /// What is read, as messages name it (the file's path), and how; `None`
    /// when dpcoord was started without a file: a reload is refused.
    file: Option<(String, ReadFn)>,
}

impl ConfigSource {
    pub fn new(what: impl Into<String>, read: impl FnMut() -> Result<Config, ConfigError> + Send + 'static) -> Self {
        ConfigSource { file: Some((what.into(), Box::new(read))) }
    }

    /// Started without a configuration file: nothing to re-read.
    pub fn none() -> Self {
        ConfigSource { file: None }
    }
}

/// A `reload` op waiting for its read: the envelope its reply goes back
/// along, and its `id`.
pub struct Waiter {
    pub envelope: Vec<Vec<u8>>,
    pub id: Option<OwnedId>,
}

/// Sends a reload's reply to one waiter.
pub type Answer<'a> = dyn FnMut(&Coordinator, Waiter, &Result<(), WireError>) + 'a;

/// The reader thread's ends: a read asked, a result back, a bell rung.
struct Reader {
    what: String,
    jobs: Sender<()>,
    done: Receiver<Result<Config, ConfigError>>,
    bell: UnixStream,
}

enum State {
    Idle,
    /// A read in flight since `since`, for these waiters (SIGHUP waits as no one).
    Reading {
        since: Instant,
        waiters: Vec<Waiter>,
    },
    /// A read past its deadline, refused; the reader is still in it.
    Stuck,
}

pub struct Reloads {
    reader: Option<Reader>,
    state: State,
    /// Asked while a read was in flight, for one read after it; `Some`
    /// when that read is due.
    next: Option<Vec<Waiter>>,
    stopping: bool,
}

fn read_loop(jobs: Receiver<()>, done: Sender<Result<Config, ConfigError>>, mut bell: UnixStream, mut read: ReadFn) {
    for () in jobs {
        if done.send(read()).is_err() {
            return;
        }
        // A full socket buffer means the bell is ringing already.
        let _ = bell.write(&[1]);
    }
}

impl Reloads {
    /// Starts the reader thread when there is a file to read. The thread is
    /// never joined: it ends after its read once `Reloads` is dropped.
    pub fn start(source: ConfigSource) -> std::io::Result<Reloads> {
        let reader = match source.file {
            None => None,
            Some((what, read)) => {
                let (bell, ringer) = UnixStream::pair()?;
                bell.set_nonblocking(true)?;
                ringer.set_nonblocking(true)?;
                let (jobs, rx) = mpsc::channel();
                let (tx, done) = mpsc::channel();
                std::thread::Builder::new()
                    .name("config-read".into())
                    .spawn(move || read_loop(rx, tx, ringer, read))?;
                Some(Reader { what, jobs, done, bell })
            }
        };
        Ok(Reloads { reader, state: State::Idle, next: None, stopping: false })
    }

    /// The descriptor that becomes readable when a read has finished.
    pub fn bell_fd(&self) -> Option<RawFd> {
        self.reader.as_ref().map(|r| r.bell.as_raw_fd())
    }

    /// When the read in flight passes its deadline.
    pub fn next_due(&self) -> Option<Instant> {
        match self.state {
            State::Reading { since, .. } => Some(since + READ_DEADLINE),
            State::Idle | State::Stuck => None,
        }
    }

    /// A reload asked (`waiter` for the op, `None` for SIGHUP): a read
    /// starts, or joins the next one, or is refused at once.
    pub fn ask(&mut self, waiter: Option<Waiter>, coord: &mut Coordinator, now: Instant, answer: &mut Answer<'_>) {
        let why = match (&self.reader, &self.state) {
            _ if self.stopping => "dpcoord is stopping".to_owned(),
            (None, _) => "dpcoord was started without --config: there is no file to re-read".to_owned(),
            (Some(r), State::Stuck) => format!("an earlier read of {} has not finished", r.what),
            (Some(_), State::Idle) => return self.begin(waiter.into_iter().collect(), coord, now, answer),
            (Some(_), State::Reading { .. }) => {
                let next = self.next.get_or_insert_with(Vec::new);
                match waiter {
                    Some(w) if next.len() < MAX_WAITING => return next.push(w),
                    Some(_) => format!("{MAX_WAITING} reloads wait already"),
                    None => return,
                }
            }
        };
        let outcome = coord.reloaded(Err(err("config", why)), now);
        if let Some(w) = waiter {
            answer(coord, w, &outcome);
        }
    }

    fn begin(&mut self, waiters: Vec<Waiter>, coord: &mut Coordinator, now: Instant, answer: &mut Answer<'_>) {
        let Some(reader) = &self.reader else { return };
        if reader.jobs.send(()).is_ok() {
            self.state = State::Reading { since: now, waiters };
            return;
        }
        let outcome = coord.reloaded(Err(err("config", "the reader thread has ended")), now);
        waiters.into_iter().for_each(|w| answer(coord, w, &outcome));
    }

    /// Applies a finished read and answers its waiters, or refuses a read
    /// past its deadline; then starts the read asked meanwhile, if any.
    pub fn poll(&mut self, coord: &mut Coordinator, now: Instant, answer: &mut Answer<'_>) {
        let Some(reader) = &self.reader else { return };
        let read = match reader.done.try_recv() {
            Ok(read) => Some(read),
            Err(TryRecvError::Empty) => None,
            // Only a panic in the read ends the thread while `jobs` is open.
            Err(TryRecvError::Disconnected) => Some(Err(err("config", "the reader thread has ended"))),
        };
        if read.is_none() && self.next_due().is_none_or(|due| now < due) {
            return;
        }
        let what = reader.what.clone();
        match (std::mem::replace(&mut self.state, State::Idle), read) {
            (State::Reading { waiters, .. }, Some(read)) => {
                let outcome = coord.reloaded(read, now);
                waiters.into_iter().for_each(|w| answer(coord, w, &outcome));
            }
            (State::Reading { waiters, .. }, None) => {
                let why = format!("reading {what} took longer than {} s", READ_DEADLINE.as_secs());
                let outcome = coord.reloaded(Err(err("config", why)), now);
                let queued = self.next.take().unwrap_or_default();
                waiters.into_iter().chain(queued).for_each(|w| answer(coord, w, &outcome));
                self.state = State::Stuck;
            }
            (State::Stuck, Some(_)) => {
                tracing::info!("a read of {what} past its deadline finished; its result is dropped")
            }
            (state, _) => self.state = state,
        }
        if matches!(self.state, State::Idle) {
            if let Some(waiters) = self.next.take() {
                self.begin(waiters, coord, now, answer);
            }
        }
    }

    /// Empties the bell, when its descriptor was readable.
    pub fn quiet(&mut self) {
        if let Some(reader) = &mut self.reader {
            let mut buf = [0u8; 64];
            while matches!(reader.bell.read(&mut buf), Ok(n) if n > 0) {}
        }
    }

    /// Refuses the reloads still waiting, and those asked from now on.
    pub fn stop(&mut self, coord: &mut Coordinator, now: Instant, answer: &mut Answer<'_>) {
        self.stopping = true;
        let waiting = match std::mem::replace(&mut self.state, State::Idle) {
            State::Reading { waiters, .. } => waiters,
            State::Idle | State::Stuck => Vec::new(),
        };
        let waiting: Vec<Waiter> = waiting.into_iter().chain(self.next.take().unwrap_or_default()).collect();
        if !waiting.is_empty() {
            let outcome = coord.reloaded(Err(err("config", "dpcoord is stopping")), now);
            waiting.into_iter().for_each(|w| answer(coord, w, &outcome));
        }
    }
}

#[cfg(test)]
mod tests;
