//! Ranks whose server the proxy could not connect to. Each failed
//! connection is reported to the coordinator as a failed `health_report`
//! (the rank's health penalty rises; after `engines.probe_failures` in a
//! row it is `stalled` and no longer routed). While a rank is so marked,
//! the proxy connects to its endpoint every [`EVERY`] and reports each
//! outcome, so a server that is back is routed again within about that.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::bridge::{Query, Socket};
use crate::Decider;

/// How often a rank marked unreachable is tried.
pub const EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct Reach {
    failing: Mutex<BTreeSet<u32>>,
}

impl Reach {
    /// A connection to `rank`'s server failed: reported, and the rank tried
    /// until one succeeds.
    pub async fn failed(&self, decider: &Decider, rank: u32) {
        self.failing.lock().unwrap_or_else(|p| p.into_inner()).insert(rank);
        report(decider, rank, false).await;
    }

    /// A connection to `rank`'s server succeeded: reported if it was marked.
    pub async fn reached(&self, decider: &Decider, rank: u32) {
        if self.failing.lock().unwrap_or_else(|p| p.into_inner()).remove(&rank) {
            report(decider, rank, true).await;
        }
    }

    /// Tries each marked rank's endpoint (as configured now) every
    /// [`EVERY`], each attempt within `timeout`; runs until aborted.
    pub async fn watch(self: Arc<Self>, decider: Arc<Decider>, timeout: Duration) {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let marked: Vec<u32> = self.failing.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
            let gateway = decider.gateway();
            for rank in marked {
                let Some(endpoint) = gateway.endpoint(rank) else { continue };
                let connected = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(endpoint)).await;
                match connected {
                    Ok(Ok(_)) => self.reached(&decider, rank).await,
                    _ => report(&decider, rank, false).await,
                }
            }
        }
    }
}

async fn report(decider: &Decider, rank: u32, ok: bool) {
    let q = Query { op: "health_report", rank: Some(rank), ok: Some(ok), ..Query::default() };
    if decider.bridge.ask_on(Socket::Health, q).await.is_none_or(|r| !r.ok) {
        tracing::debug!(rank, ok, "a proxy health report was not booked");
    }
}
