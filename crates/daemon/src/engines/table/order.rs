//! The ordering rules a load report must pass before the engine table takes
//! it (boot, seq, cumulative counters), and [`Reject`], why one was dropped.
//! Apart from the table because they judge a report against one rank's state
//! and change nothing: the table applies what they let through.

use std::fmt;

use super::{EngineState, Status};
use crate::engines::event::{LoadReport, Sequence};

/// Why a report was dropped. It holds the facts, not a message: the text
/// is formatted only when a warning is actually logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// The rank is outside `0..dp_size`.
    UnknownRank { rank: i128, dp_size: u32 },
    /// A boot older than the current one, on a rank that is not down.
    OldBoot { boot: u64, current: u64 },
    /// A seq not above the last accepted one within the boot.
    OldSeq { seq: u64, last: u64 },
    /// A cumulative counter went backwards within a boot.
    Backwards { counter: &'static str, boot: u64, from: u64, to: u64 },
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::UnknownRank { rank, dp_size } => write!(f, "rank {rank} is outside 0..{dp_size}"),
            Reject::OldBoot { boot, current } => write!(f, "boot {boot} is older than the current boot {current}"),
            Reject::OldSeq { seq, last } => write!(f, "seq {seq} is not above the last accepted seq {last}"),
            Reject::Backwards { counter, boot, from, to } => {
                write!(f, "counter `{counter}` went backwards within boot {boot} ({from} -> {to})")
            }
        }
    }
}

/// How a report relates to the rank's current incarnation.
pub(super) enum Step {
    /// The first report of the rank.
    First { boot: u64 },
    /// The same incarnation; `missed` reports never arrived (a seq gap).
    Same { missed: u64 },
    /// The engine (or its publisher) restarted: counters start over.
    Restart { boot: u64 },
}

/// The ordering rules. With a `boot`: a lower `boot` is a stale
/// incarnation, except for a rank that is `down` (its last incarnation is
/// gone, so whatever publishes now is the live engine, one whose clock
/// stepped back across a restart), and `seq` rises within a boot. Without
/// (a restarting stream): a `seq` not above the last means the publisher
/// restarted, and dpcoord numbers the incarnations itself.
pub(super) fn step(e: &EngineState, u: &LoadReport) -> Result<Step, Reject> {
    let (boot, seq) = match u.sequence {
        Sequence::Boot { boot, seq } => (boot, seq),
        Sequence::Restarting { .. } if e.status == Status::Unknown => return Ok(Step::First { boot: 1 }),
        Sequence::Restarting { seq } if seq > e.seq => return Ok(Step::Same { missed: seq - e.seq - 1 }),
        Sequence::Restarting { .. } => return Ok(Step::Restart { boot: e.boot.saturating_add(1) }),
    };
    if e.status == Status::Unknown {
        return Ok(Step::First { boot });
    }
    if boot > e.boot || (boot < e.boot && e.status == Status::Down) {
        return Ok(Step::Restart { boot });
    }
    if boot < e.boot {
        return Err(Reject::OldBoot { boot, current: e.boot });
    }
    if seq <= e.seq {
        return Err(Reject::OldSeq { seq, last: e.seq });
    }
    if let Some((from, to)) = e.progress.zip(u.progress).filter(|(from, to)| to < from) {
        return Err(Reject::Backwards { counter: "progress", boot, from, to });
    }
    if u.cumulative {
        for ((counter, from), (_, to)) in e.counts.cumulative().into_iter().zip(u.counts.cumulative()) {
            if to < from {
                return Err(Reject::Backwards { counter, boot, from, to });
            }
        }
    }
    Ok(Step::Same { missed: seq - e.seq - 1 })
}

/// The `seq` a report carries, whatever its numbering.
pub(super) fn seq_of(u: &LoadReport) -> u64 {
    match u.sequence {
        Sequence::Boot { seq, .. } | Sequence::Restarting { seq } => seq,
    }
}
