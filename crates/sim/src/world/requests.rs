//! A request's way from its frontend to an engine: issued (at an open-loop
//! arrival, or when a closed-loop frontend's last one finished), placed (by
//! the oracle, by the frontend itself from a stale snapshot, or by dpcoord's
//! route socket; over nodes, by the API server the front balancer picked,
//! among its node's ranks), carried over the hop, then admitted by the engine or
//! retried (also when its frontend gives up on it after a timeout); under
//! a delayed handoff, dpcoord's `pending` is checked against the truth
//! before each placement.
//!
//! Apart from `world`, which runs the event queue and the engines' side
//! (steps, deaths, resizes, probes, samples), because this is the frontends'
//! side of the same loop.

use std::sync::Arc;

use rand::Rng;

use super::{Event, World, RETRY_AFTER};
use crate::error::NetError;
use crate::model::Job;
use crate::net::Answer;
use crate::oracle;
use crate::prompts::Source;
use crate::record::Request;
use crate::workload::Load;

impl World<'_> {
    pub(super) fn arrival(&mut self, f: u32) -> Result<(), NetError> {
        self.issue(f)?;
        let fe = &mut self.frontends[f as usize];
        if !matches!(fe.load(), Load::Closed { .. }) && !fe.exhausted() {
            if let Some(gap) = fe.next_gap() {
                let t = self.arrivals[f as usize] + gap;
                self.arrivals[f as usize] = t;
                self.at(t, Event::Arrival(f));
            }
        }
        Ok(())
    }

    /// Frontend `f` sends its next request, if it has one.
    pub(super) fn issue(&mut self, f: u32) -> Result<(), NetError> {
        let Some((mut prompt, mut output)) = self.frontends[f as usize].next_request() else { return Ok(()) };
        let content = match self.replays.get_mut(f as usize) {
            Some(q) => q.pop_front(),
            None => self.sources.get_mut(f as usize).map(Source::next_prompt),
        };
        if let Some(c) = &content {
            (prompt, output) = (c.prompt_len, c.output_len());
        }
        let id = self.rec.requests.len() as u64;
        self.rec.requests.push(Request {
            frontend: f,
            prompt,
            output,
            issued: self.now,
            first_token: None,
            done: None,
            attempts: 0,
            content,
            cached: 0,
        });
        if let Some(n) = self.split {
            let nth = self.issued[f as usize];
            self.issued[f as usize] += 1;
            self.servers.push(n.server_for(f, nth));
        }
        self.dispatch(id)
    }

    /// Asks dpcoord where request `id` goes and hands it to that engine
    /// (after the hop, if there is one).
    pub(super) fn dispatch(&mut self, id: u64) -> Result<(), NetError> {
        let r = &mut self.rec.requests[id as usize];
        r.attempts += 1;
        let (f, prompt, content, attempt) = (r.frontend, r.prompt, r.content.clone(), r.attempts);
        if self.spec.handoff.is_delayed() {
            self.check_pending()?;
        }
        let p = self.spec.prompts_of;
        let pin = match (p.oracle, &content) {
            (Some(w), Some(c)) => {
                let block = self.spec.engine.cache.map_or(16, |c| c.block);
                let pick = oracle::pick(&self.cluster.engines, self.link.ranks(), c, block, w, self.cursor);
                self.cursor = pick.map_or(self.cursor, |r| (r + 1) % self.link.ranks().max(1));
                pick
            }
            _ => None,
        };
        // Over nodes, the request's API server asks, for its node's ranks only.
        let (server, among) = match self.split {
            Some(n) => {
                let server = self.servers[id as usize];
                (server, Some(n.ranks_of(n.node_of(server)).collect::<Vec<u32>>()))
            }
            None => (f, None),
        };
        let pin = match (pin, &mut self.local) {
            (None, Some(l)) => Some(l.pick(server as usize, id, self.now, &self.cluster.engines, self.link.ranks())),
            (pin, _) => pin,
        };
        let tokens = content.as_ref().filter(|_| p.on_wire && pin.is_none()).map(|c| c.prompt());
        self.watch_death()?;
        self.watch_hang()?;
        match self.link.route(server as usize, prompt, tokens, pin, among.as_deref())? {
            Answer::Rank(rank) => {
                self.rec.placements[rank as usize] += 1;
                self.rec.off_node += u64::from(among.as_ref().is_some_and(|m| !m.contains(&rank)));
                for d in [&mut self.rec.death, &mut self.rec.hang].into_iter().flatten() {
                    d.placed(rank);
                }
                if let Some(t) = self.spec.timeout {
                    let progress = self.cluster.engines[rank as usize].progress();
                    self.at(self.now + t, Event::Timeout(id, rank, attempt, progress));
                }
                let (lo, hi) = self.spec.handoff.transit;
                if hi == 0 {
                    return self.deliver(id, rank);
                }
                let hop = self.rng.random_range(lo..=hi.max(lo));
                self.at(self.now + hop, Event::Deliver(id, rank));
            }
            Answer::Refused(code) => {
                tracing::debug!(request = id, code = %code, "placement refused; retrying");
                self.rec.refusals += 1;
                self.at(self.now + RETRY_AFTER, Event::Retry(id));
            }
        }
        Ok(())
    }

    /// Request `id` reaches rank `rank`.
    pub(super) fn deliver(&mut self, id: u64, rank: u32) -> Result<(), NetError> {
        let r = &self.rec.requests[id as usize];
        let job = match &r.content {
            Some(c) => Job::with_content(id, Arc::clone(c), self.now),
            None => Job::new(id, r.prompt, r.output, self.now),
        };
        if self.cluster.admit(rank, job) {
            self.link.publish(rank, &self.cluster.engines[rank as usize])
        } else {
            // The engine is gone: the frontend sees the failure and retries.
            self.at(self.now + RETRY_AFTER, Event::Retry(id));
            Ok(())
        }
    }

    /// Request `id`'s frontend checks its placement on `rank` (attempt
    /// `attempt`) a timeout after it, or after the last check: it gives up
    /// without a first token, or without a token since the last check (a
    /// decoding job gets one at each step of its engine, so then the
    /// rank's `progress`, `then`, has not moved). The engine drops it (a
    /// hung one cannot) and the frontend places it again at once.
    pub(super) fn timeout(&mut self, id: u64, rank: u32, attempt: u32, then: u64) -> Result<(), NetError> {
        let r = &self.rec.requests[id as usize];
        if r.attempts != attempt || r.done.is_some() {
            return Ok(());
        }
        let progress = self.cluster.engines[rank as usize].progress();
        if let (Some(t), true) = (self.spec.timeout, r.first_token.is_some() && progress != then) {
            self.at(self.now + t, Event::Timeout(id, rank, attempt, progress));
            return Ok(());
        }
        self.rec.timeouts += 1;
        self.cluster.engines[rank as usize].abort(id);
        self.link.publish(rank, &self.cluster.engines[rank as usize])?;
        self.dispatch(id)
    }

    /// Compares dpcoord's `pending` per rank with the truth: the rank's
    /// placements that its latest report, as dpcoord has it, does not include.
    fn check_pending(&mut self) -> Result<(), NetError> {
        let estimate = self.link.pending()?;
        let truth: Vec<u64> =
            (0..self.link.ranks()).map(|r| self.rec.placements[r as usize] - self.link.reported_received(r)).collect();
        self.rec.pending.add(&estimate, &truth);
        Ok(())
    }
}
