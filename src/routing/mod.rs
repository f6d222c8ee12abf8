//! User routing: the coordinator and everything only it may reach.

mod coordinator;
mod ledger;
pub mod policy;
mod session;
mod user;
mod window;

pub use coordinator::{Coordinator, Published};
