//! **Sync mode** (for reproducible runs): before each user placement the
//! link polls `state` until dpcoord shows the counts the engines last
//! published, so a load-aware policy decides on the same facts in every run.
//! `state` on the health socket changes no user routing state. With load
//! streams, whose counts may repeat, it also waits until dpcoord has taken
//! every message sent (its `dpcoord_stats_messages_total`). A stepped
//! coordinator (`stepped`) has taken each message before its send returns,
//! so nothing waits, and engines' heartbeats are events of virtual time.
//!
//! Apart from `link`, which holds the sockets, because this is the waiting:
//! it compares what dpcoord has taken (its `state`, its message counters)
//! with what the link sent.

use std::time::{Duration, Instant};

use super::Link;
use crate::error::NetError;
use crate::kv_pub::KvPub;
use crate::publisher::Publisher;

/// Longest wait for dpcoord to catch up with published stats in sync mode.
const SYNC_WAIT: Duration = Duration::from_millis(500);

impl Link {
    pub(super) fn sync(&mut self) -> Result<(), NetError> {
        if !(self.sync && self.dirty) || self.is_stepped() {
            return Ok(());
        }
        let start = Instant::now();
        loop {
            let seen = self.observer.state()?;
            let shown = seen.iter().zip(&self.pubs).all(|(s, p)| s.counts == p.shown());
            if shown && self.all_taken() && self.all_kv_taken() {
                self.dirty = false;
                return Ok(());
            }
            if start.elapsed() > SYNC_WAIT {
                self.sync_timeouts += 1;
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Messages dpcoord has taken from every source, if it lends its registry.
    fn taken(&self) -> Option<u64> {
        let families = self.registry.as_ref()?.gather();
        let f = families.iter().find(|f| f.name() == "dpcoord_stats_messages_total")?;
        Some(f.get_metric().iter().map(|m| m.get_counter().get_value() as u64).sum())
    }

    fn sent(&self) -> u64 {
        self.pubs.iter().map(|p| p.sent).sum()
    }

    /// Starts the message count once the bring-up's messages have landed
    /// (a PUB drops what it sends before the subscription is wired).
    pub(super) fn settle(&mut self) {
        if self.is_stepped() || !self.pubs.iter().any(Publisher::is_load) {
            return;
        }
        let last = still(|| self.taken());
        self.counted_from = (last.unwrap_or(0), self.sent());
    }

    /// Whether dpcoord has taken every load message sent since the count started.
    fn all_taken(&self) -> bool {
        if !self.pubs.iter().any(Publisher::is_load) {
            return true;
        }
        let (taken, sent) = self.counted_from;
        self.taken().is_none_or(|t| t.saturating_sub(taken) >= self.sent() - sent)
    }

    /// KV batches dpcoord has taken, whatever their outcome.
    pub(super) fn kv_taken(&self) -> u64 {
        let Some(families) = self.registry.as_ref().map(prometheus::Registry::gather) else { return 0 };
        let f = families.iter().find(|f| f.name() == "dpcoord_kv_batches_total");
        f.map_or(0, |f| f.get_metric().iter().map(|m| m.get_counter().get_value() as u64).sum())
    }

    pub(super) fn kv_sent(&self) -> u64 {
        self.kv.iter().map(KvPub::sent).sum()
    }

    /// Whether dpcoord has taken every KV batch sent since the count started.
    fn all_kv_taken(&self) -> bool {
        if self.kv.is_empty() || self.registry.is_none() {
            return true;
        }
        let (taken, sent) = self.kv_counted_from;
        self.kv_taken().saturating_sub(taken) >= self.kv_sent() - sent
    }
}

/// Reads `read` every 20 ms until two reads in a row agree; that value.
pub(super) fn still<T: PartialEq>(mut read: impl FnMut() -> T) -> T {
    let mut last = read();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
}
