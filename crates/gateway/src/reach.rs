//! Ranks failing through the gateway, fed back to routing: a connection
//! to a rank's server that fails (the proxy's) and a 5xx answer (seen by
//! the proxy, or by the gateway behind the picker) are each reported to
//! the coordinator as a failed `health_report`, so the rank's health
//! penalty rises and after `engines.probe_failures` in a row it is
//! `stalled` and no longer routed. While a rank is so marked, its server's
//! `GET /health` is tried every [`EVERY`] and each outcome reported (any
//! answer below 500 is a success: vLLM and SGLang answer 200 while their
//! engine runs, another server at least answers), so a rank that is back
//! is routed again within about that; an answer below 500 to a request
//! clears the mark too.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dpcoord_daemon::io::probe;

use crate::bridge::{Query, Socket};
use crate::Decider;

/// How often a marked rank's server is tried.
pub const EVERY: Duration = Duration::from_secs(1);
/// The path tried.
const HEALTH: &str = "/health";

#[derive(Default)]
pub struct Reach {
    failing: Mutex<BTreeSet<u32>>,
}

impl Reach {
    fn marked(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.failing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `rank` failed a request (no connection, or a 5xx): reported, and
    /// its server tried until it answers.
    pub async fn failed(&self, decider: &Decider, rank: u32) {
        self.marked().insert(rank);
        report(decider, rank, false).await;
    }

    /// `rank`'s server answered a request below 500: reported if marked.
    pub async fn reached(&self, decider: &Decider, rank: u32) {
        if self.marked().remove(&rank) {
            report(decider, rank, true).await;
        }
    }

    /// Whether a response of `status` from `rank` has anything to report:
    /// a 5xx, or a success of a marked rank (most responses have none).
    pub fn reports(&self, rank: u32, status: u16) -> bool {
        status >= 500 || self.marked().contains(&rank)
    }

    /// A response's status from `rank`: a 5xx fails it, anything else
    /// reaches it.
    pub async fn answered(&self, decider: &Decider, rank: u32, status: u16) {
        if status >= 500 {
            self.failed(decider, rank).await;
        } else {
            self.reached(decider, rank).await;
        }
    }

    /// Tries each marked rank's server (its endpoint as configured now)
    /// every [`EVERY`], each try within `timeout`; runs until aborted.
    pub async fn watch(self: Arc<Self>, decider: Arc<Decider>, timeout: Duration) {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let marked: Vec<u32> = self.marked().iter().copied().collect();
            let gateway = decider.gateway();
            for rank in marked {
                let Some(endpoint) = gateway.endpoint(rank) else { continue };
                match health(endpoint, timeout).await {
                    Some(status) if status < 500 => self.reached(&decider, rank).await,
                    _ => report(&decider, rank, false).await,
                }
            }
        }
    }
}

/// The status of `GET /health` at `endpoint` within `timeout` (the GET of
/// `dpcoord probe`, on the blocking pool); `None` when nothing answered.
async fn health(endpoint: &str, timeout: Duration) -> Option<u16> {
    let url = probe::Url::parse(&format!("http://{endpoint}{HEALTH}")).ok()?;
    tokio::task::spawn_blocking(move || probe::get(&url, timeout)).await.ok()?.ok().map(|r| r.status)
}

async fn report(decider: &Decider, rank: u32, ok: bool) {
    let q = Query { op: "health_report", rank: Some(rank), ok: Some(ok), ..Query::default() };
    if decider.bridge.ask_on(Socket::Health, q).await.is_none_or(|r| !r.ok) {
        tracing::debug!(rank, ok, "a gateway health report was not booked");
    }
}
