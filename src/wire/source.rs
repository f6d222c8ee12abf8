//! Engine sources: which wire format a socket carries, and the one place
//! that turns a received message (all its frames) into an engine event.
//!
//! Adding a source is a variant here, its decoder beside this file, and a
//! config entry that names its endpoints; the transport polls every source
//! the same way and the coordinator applies what comes out.

use std::fmt;
use std::ops::Deref;

use super::sglang::{decode_sglang_load, SglangError};
use super::stats::{decode_stats, StatsError};
use crate::engines::EngineEvent;

/// The wire format of one engine source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// dpcoord's own `StatsUpdate`: one MessagePack frame per message.
    Stats,
    /// SGLang's scheduler load stream: `[b"load", seq, LoadStat]`.
    SglangLoad,
}

impl SourceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Stats => "stats",
            SourceKind::SglangLoad => "sglang_load",
        }
    }
}

/// Why a source message was dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SourceError {
    /// Above `limits.max_message_bytes` (all frames together).
    TooLarge {
        bytes: usize,
        max: usize,
    },
    /// The format takes `want` frames per message.
    Frames {
        got: usize,
        want: usize,
    },
    /// More frames than the transport keeps of one message.
    TooManyFrames,
    Stats(StatsError),
    Sglang(SglangError),
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceError::TooLarge { bytes, max } => write!(f, "update is {bytes} bytes, above max_message_bytes {max}"),
            SourceError::Frames { got, want } => write!(f, "a message of this source is {want} frame(s), got {got}"),
            SourceError::TooManyFrames => write!(f, "a message with more frames than any source uses"),
            SourceError::Stats(e) => e.fmt(f),
            SourceError::Sglang(e) => e.fmt(f),
        }
    }
}

/// Decodes one message of `kind`. `frames` is every frame received, or
/// `None` when the message had more frames than the transport keeps.
pub fn decode_source<F: Deref<Target = [u8]>>(
    kind: SourceKind,
    frames: Option<&[F]>,
    max_bytes: usize,
) -> Result<EngineEvent, SourceError> {
    let frames = frames.ok_or(SourceError::TooManyFrames)?;
    let bytes: usize = frames.iter().map(|f| f.len()).sum();
    if bytes > max_bytes {
        return Err(SourceError::TooLarge { bytes, max: max_bytes });
    }
    match (kind, frames) {
        (SourceKind::Stats, [one]) => decode_stats(one).map(EngineEvent::Load).map_err(SourceError::Stats),
        (SourceKind::Stats, _) => Err(SourceError::Frames { got: frames.len(), want: 1 }),
        (SourceKind::SglangLoad, [topic, seq, payload]) => {
            decode_sglang_load(topic, seq, payload).map(EngineEvent::Load).map_err(SourceError::Sglang)
        }
        (SourceKind::SglangLoad, _) => Err(SourceError::Frames { got: frames.len(), want: 3 }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::LoadReport;

    fn update() -> Vec<u8> {
        let m = serde_json::json!({"v": 1, "rank": 2, "boot": 1, "seq": 3, "counts": [0, 0, 0, 0, 0]});
        rmp_serde::to_vec_named(&m).unwrap()
    }

    #[test]
    fn one_frame_within_the_size_limit_decodes() {
        let u = update();
        let got = decode_source(SourceKind::Stats, Some(&[&u[..]][..]), 1024);
        assert_eq!(got, Ok(EngineEvent::Load(LoadReport::new(2, 1, 3))));
        let two = [&u[..], &u[..]];
        assert_eq!(
            decode_source(SourceKind::Stats, Some(&two[..]), 1024),
            Err(SourceError::Frames { got: 2, want: 1 })
        );
        assert_eq!(
            decode_source(SourceKind::Stats, Some(&[&u[..]][..]), 8),
            Err(SourceError::TooLarge { bytes: u.len(), max: 8 })
        );
        assert_eq!(decode_source::<&[u8]>(SourceKind::Stats, None, 1024), Err(SourceError::TooManyFrames));
        let garbage = [&b"\xc1"[..]];
        assert!(matches!(decode_source(SourceKind::Stats, Some(&garbage[..]), 1024), Err(SourceError::Stats(_))));
    }
}
