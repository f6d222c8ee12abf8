//! What the coordinator shares with other threads (the HTTP server, the
//! gateway endpoint picker): a snapshot of the engine table, replaced on
//! every tick, and the gateway's endpoints of the settings in force.
//! Routing state itself is never shared.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::Gateway;
use crate::wire::StateView;

#[derive(Debug, Default)]
pub struct Published {
    state: Mutex<Arc<StateView>>,
    gateway: Mutex<Arc<Gateway>>,
    /// The rank count in force, set the moment it changes (the snapshot
    /// follows at the next tick).
    dp_size: AtomicU32,
    /// `limits.max_prompt_tokens` in force.
    max_prompt_tokens: AtomicU32,
    /// The process is stopping (SIGTERM, SIGINT): not ready, whatever the ranks.
    stopping: AtomicBool,
}

fn read<T>(m: &Mutex<Arc<T>>) -> Arc<T> {
    match m.lock() {
        Ok(s) => Arc::clone(&s),
        Err(poisoned) => Arc::clone(&poisoned.into_inner()),
    }
}

fn write<T>(m: &Mutex<Arc<T>>, value: T) {
    let value = Arc::new(value);
    match m.lock() {
        Ok(mut s) => *s = value,
        Err(poisoned) => *poisoned.into_inner() = value,
    }
}

impl Published {
    /// Says, from now on, that the process is stopping: `/readyz` and the
    /// gateway picker's health answer not ready, so load balancers and
    /// gateways stop sending before the ports close.
    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Whether the process is stopping.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// The engine table as of the last tick.
    pub fn state(&self) -> Arc<StateView> {
        read(&self.state)
    }

    pub(super) fn set(&self, view: StateView) {
        write(&self.state, view)
    }

    /// The gateway's ranks and endpoints (`[gateway]`) as of the last reload.
    pub fn gateway(&self) -> Arc<Gateway> {
        read(&self.gateway)
    }

    pub(super) fn set_gateway(&self, gateway: Gateway) {
        write(&self.gateway, gateway)
    }

    /// The rank count in force now.
    pub fn dp_size(&self) -> u32 {
        self.dp_size.load(Ordering::Relaxed)
    }

    pub(super) fn set_dp_size(&self, dp_size: u32) {
        self.dp_size.store(dp_size, Ordering::Relaxed)
    }

    /// The most token ids a route query may carry now
    /// (`limits.max_prompt_tokens`; block keys, a sixteenth of it).
    pub fn max_prompt_tokens(&self) -> u32 {
        self.max_prompt_tokens.load(Ordering::Relaxed)
    }

    pub(super) fn set_max_prompt_tokens(&self, tokens: u32) {
        self.max_prompt_tokens.store(tokens, Ordering::Relaxed)
    }
}
