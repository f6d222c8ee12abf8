//! User routing: the coordinator and everything only it may reach.
//!
//! The user dispatcher, the placement ledgers, sessions, the dispatch
//! window and the policies are private to this module: code outside it
//! (the health channel above all) cannot name them. Only the coordinator,
//! the published snapshot and the policy names are public.

mod coordinator;
mod explain;
mod export;
mod kv;
mod ledger;
mod placement;
mod policy;
mod prefix;
mod published;
mod session;
mod user;
mod window;

pub use coordinator::{Answered, Coordinator};
pub use placement::Placement;
pub use policy::PolicyKind;
pub use published::Published;
