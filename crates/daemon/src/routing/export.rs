//! What the coordinator shows: per-rank gauges on every tick, and the
//! `state` view (the `state` op and `/state`). Reads only.

use std::time::Instant;

use super::kv::KvStreams;
use super::user::UserDispatcher;
use crate::engines::kv::Medium;
use crate::engines::{EngineTable, StallCause, Status};
use crate::observability::metrics::Metrics;
use crate::wire::{Instance, RankView, StateView};

/// Engines may report anything up to u64::MAX: saturate, never wrap.
fn gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Sets every per-rank gauge and counter from the engine table and ledgers.
pub(super) fn export(engines: &EngineTable, user: &UserDispatcher, metrics: &Metrics, now: Instant) {
    for (rank, (e, m)) in engines.iter().zip(&metrics.ranks).enumerate() {
        m.waiting.set(gauge(e.counts.waiting));
        m.running.set(gauge(e.counts.running));
        m.pending.set(gauge(user.pending(rank as u32)));
        let finished = e.finished_before.saturating_add(e.counts.finished);
        let failed = e.failed_before.saturating_add(e.counts.failed);
        m.finished.inc_by(finished.saturating_sub(m.finished.get()));
        m.failed.inc_by(failed.saturating_sub(m.failed.get()));
        m.up.set(i64::from(e.status.is_routable()));
        m.penalty.set(e.penalty);
        m.age.set(e.age(now).map_or(f64::NAN, |a| a.as_secs_f64()));
        m.kv_usage.set(e.kv_usage.unwrap_or(f64::NAN));
        m.joined.inc_by(e.changes.joined.saturating_sub(m.joined.get()));
        m.lost.inc_by(e.changes.lost.saturating_sub(m.lost.get()));
        m.readmitted.inc_by(e.changes.readmitted.saturating_sub(m.readmitted.get()));
        m.stalled.set(i64::from(e.status == Status::Stalled));
        for (c, &n) in m.stalls.iter().zip(&e.stalls) {
            c.inc_by(n.saturating_sub(c.get()));
        }
    }
    metrics.dispatch_stddev.set(user.dispatch_stddev(engines));
    metrics.epoch.set(engines.epoch() as i64);
}

/// The engine table with dpcoord's own books beside each rank.
pub(super) fn state_view(
    engines: &EngineTable,
    user: &UserDispatcher,
    streams: &KvStreams,
    instance: Instance,
    now: Instant,
) -> StateView {
    let kv = streams.index();
    let ranks = engines
        .iter()
        .enumerate()
        .map(|(rank, e)| {
            let rank = rank as u32;
            RankView {
                rank,
                status: e.status.as_str(),
                stall: e.stall.map(StallCause::as_str),
                counts: e.counts,
                pending: user.pending(rank),
                routed: user.routed(rank),
                penalty: e.penalty,
                age_ms: e.age(now).map(|a| a.as_millis() as u64),
                boot: e.last_update.is_some().then_some(e.boot),
                load: user.load(rank, engines),
                kv_blocks: Medium::ALL
                    .into_iter()
                    .map(|m| (m.as_str(), kv.blocks(rank, m) as u64))
                    .filter(|&(_, n)| n > 0)
                    .collect(),
                kv_block_size: kv.rank_block_size(rank),
                kv_index: streams.has_events(rank).then_some(match streams.degraded(rank) {
                    true => "degraded",
                    false => "exact",
                }),
                kv_usage: e.kv_usage,
            }
        })
        .collect();
    let (epoch, policy, kv_block_size) = (engines.epoch(), user.policy().as_str(), kv.block_size());
    StateView { epoch, instance, policy, ranks, kv_block_size }
}
