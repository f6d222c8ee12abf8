//! What the coordinator shares with other threads (the HTTP server): a
//! snapshot of the engine table, replaced on every tick. Routing state
//! itself is never shared.

use std::sync::{Arc, Mutex};

use crate::wire::StateView;

#[derive(Debug, Default)]
pub struct Published {
    state: Mutex<Arc<StateView>>,
}

impl Published {
    /// The engine table as of the last tick.
    pub fn state(&self) -> Arc<StateView> {
        match self.state.lock() {
            Ok(s) => Arc::clone(&s),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    pub(super) fn set(&self, view: StateView) {
        let view = Arc::new(view);
        match self.state.lock() {
            Ok(mut s) => *s = view,
            Err(poisoned) => *poisoned.into_inner() = view,
        }
    }
}
