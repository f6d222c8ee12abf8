//! Facts about engines: what each DP rank reported, whether it is routable,
//! and its penalty. Nothing here knows about user placements.

pub mod penalty;
mod table;

pub use table::{
    Accepted, EngineState, EngineTable, StatsReject, Status, FAILED, FINISHED, RECEIVED, RUNNING, WAITING,
};
