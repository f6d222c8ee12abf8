//! Engine sources: which wire format a socket carries, and the one place
//! that turns a received message (all its frames) into an engine event.
//!
//! Adding a source is a variant here, its decoder beside this file, a row
//! in `io::sockets::SOURCES` and the config key that names its endpoints;
//! the transport polls every source the same way and the coordinator
//! applies what comes out.

use std::fmt;
use std::ops::Deref;
use std::time::Duration;

use super::kv_events::{decode_kv_message, KvFrameError};
use super::sglang::{decode_sglang_load, SglangError};
use super::stats::{decode_stats, StatsError};
use super::vllm_metrics::{self, decode_vllm_gauges, VllmMetricsError};
use crate::engines::EngineEvent;

/// The wire format of one engine source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// dpcoord's own `StatsUpdate`: one MessagePack frame per message.
    Stats,
    /// SGLang's scheduler load stream: `[b"load", seq, LoadStat]`, from
    /// the endpoint of rank `rank` (the i-th of `engines.sglang_load_connect`
    /// is rank i): a `LoadStat` naming another rank is refused.
    SglangLoad { rank: u32 },
    /// vLLM's `/metrics`, scraped and read every `interval` by the
    /// scraper: `[rank, seq, gauges]`.
    VllmMetrics { interval: Duration },
    /// KV-cache events of publisher `stream` (its place in
    /// `kv_events.connect`): `[topic, seq, batch]`, or from its replay
    /// socket `["", topic, seq, batch]`.
    KvEvents { stream: u16, replay: bool },
}

/// A message dpcoord sends to a source, to the socket of kind `to`: an
/// empty delimiter, then `body`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceRequest {
    pub to: SourceKind,
    pub body: [u8; 8],
}

impl SourceRequest {
    /// Asks KV publisher `stream`'s replay socket for its batches from
    /// `from` on (the seq as 8 bytes big-endian: vLLM's replay protocol).
    pub fn kv_replay(stream: u16, from: u64) -> SourceRequest {
        SourceRequest { to: SourceKind::KvEvents { stream, replay: true }, body: from.to_be_bytes() }
    }
}

/// The size limits of source messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceLimits {
    /// `limits.max_message_bytes`.
    pub message: usize,
    /// `kv_events.max_batch_bytes`.
    pub kv_batch: usize,
}

impl SourceLimits {
    /// No limit, for decoders driven directly (fuzzing).
    pub const NONE: SourceLimits = SourceLimits { message: usize::MAX, kv_batch: usize::MAX };
}

/// Room for a KV message's frames besides the batch (topic, seq, delimiter).
const KV_FRAMES_BYTES: usize = 4096;

impl SourceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Stats => "stats",
            SourceKind::SglangLoad { .. } => "sglang_load",
            SourceKind::VllmMetrics { .. } => "vllm_metrics",
            SourceKind::KvEvents { replay: false, .. } => "kv_events",
            SourceKind::KvEvents { replay: true, .. } => "kv_replay",
        }
    }

    /// The largest message of this kind, all frames together: the
    /// configured limit, or the scraper's fixed size. A KV message within
    /// it whose batch alone is above `kv_batch` still counts its `seq`.
    pub fn max_bytes(self, limits: &SourceLimits) -> usize {
        match self {
            SourceKind::Stats | SourceKind::SglangLoad { .. } => limits.message,
            SourceKind::VllmMetrics { .. } => vllm_metrics::GAUGES_BYTES + vllm_metrics::HEADER_BYTES,
            SourceKind::KvEvents { .. } => limits.kv_batch.saturating_mul(2).saturating_add(KV_FRAMES_BYTES),
        }
    }
}

/// Why a source message was dropped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SourceError {
    /// Above the kind's limit (all frames together; see `SourceKind::max_bytes`).
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
    /// A per-rank source's message naming another rank.
    WrongRank {
        named: i128,
        own: u32,
    },
    VllmMetrics(VllmMetricsError),
    Kv(KvFrameError),
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceError::TooLarge { bytes, max } => write!(f, "update is {bytes} bytes, above the limit of {max}"),
            SourceError::Frames { got, want } => write!(f, "a message of this source is {want} frame(s), got {got}"),
            SourceError::TooManyFrames => write!(f, "a message with more frames than any source uses"),
            SourceError::Stats(e) => e.fmt(f),
            SourceError::Sglang(e) => e.fmt(f),
            SourceError::WrongRank { named, own } => {
                write!(f, "a message naming rank {named} from the endpoint of rank {own}")
            }
            SourceError::VllmMetrics(e) => e.fmt(f),
            SourceError::Kv(e) => e.fmt(f),
        }
    }
}

/// Decodes one message of `kind`. `frames` is every frame received, or
/// `None` when the message had more frames than the transport keeps.
pub fn decode_source<F: Deref<Target = [u8]>>(
    kind: SourceKind,
    frames: Option<&[F]>,
    limits: &SourceLimits,
) -> Result<EngineEvent, SourceError> {
    let frames = frames.ok_or(SourceError::TooManyFrames)?;
    let bytes: usize = frames.iter().map(|f| f.len()).sum();
    let max_bytes = kind.max_bytes(limits);
    if bytes > max_bytes {
        return Err(SourceError::TooLarge { bytes, max: max_bytes });
    }
    match (kind, frames) {
        (SourceKind::Stats, [one]) => decode_stats(one).map(EngineEvent::Load).map_err(SourceError::Stats),
        (SourceKind::Stats, _) => Err(SourceError::Frames { got: frames.len(), want: 1 }),
        (SourceKind::SglangLoad { rank }, [topic, seq, payload]) => {
            let report = decode_sglang_load(topic, seq, payload).map_err(SourceError::Sglang)?;
            if report.rank != i128::from(rank) {
                return Err(SourceError::WrongRank { named: report.rank, own: rank });
            }
            Ok(EngineEvent::Load(report))
        }
        (SourceKind::SglangLoad { .. }, _) => Err(SourceError::Frames { got: frames.len(), want: 3 }),
        (SourceKind::VllmMetrics { interval }, [rank, seq, gauges]) => {
            decode_vllm_gauges(rank, seq, gauges, interval).map(EngineEvent::Load).map_err(SourceError::VllmMetrics)
        }
        (SourceKind::VllmMetrics { .. }, _) => Err(SourceError::Frames { got: frames.len(), want: 3 }),
        (SourceKind::KvEvents { stream, replay }, _) => {
            decode_kv_message(stream, replay, frames, limits.kv_batch).map(EngineEvent::Kv).map_err(SourceError::Kv)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::LoadReport;

    fn lim(message: usize) -> SourceLimits {
        SourceLimits { message, kv_batch: 1 << 20 }
    }

    fn update() -> Vec<u8> {
        let m = serde_json::json!({"v": 1, "rank": 2, "boot": 1, "seq": 3, "counts": [0, 0, 0, 0, 0]});
        rmp_serde::to_vec_named(&m).unwrap()
    }

    #[test]
    fn one_frame_within_the_size_limit_decodes() {
        let u = update();
        let got = decode_source(SourceKind::Stats, Some(&[&u[..]][..]), &lim(1024));
        assert_eq!(got, Ok(EngineEvent::Load(LoadReport::new(2, 1, 3))));
        let two = [&u[..], &u[..]];
        assert_eq!(
            decode_source(SourceKind::Stats, Some(&two[..]), &lim(1024)),
            Err(SourceError::Frames { got: 2, want: 1 })
        );
        assert_eq!(
            decode_source(SourceKind::Stats, Some(&[&u[..]][..]), &lim(8)),
            Err(SourceError::TooLarge { bytes: u.len(), max: 8 })
        );
        assert_eq!(decode_source::<&[u8]>(SourceKind::Stats, None, &lim(1024)), Err(SourceError::TooManyFrames));
        let garbage = [&b"\xc1"[..]];
        assert!(matches!(decode_source(SourceKind::Stats, Some(&garbage[..]), &lim(1024)), Err(SourceError::Stats(_))));
    }

    #[test]
    fn an_sglang_load_endpoint_speaks_for_its_own_rank_only() {
        let stat = |rank: u32| rmp_serde::to_vec(&("LoadStat", 1u64, 2u64, 3u64, 10u64, rank)).unwrap();
        let (own, other) = (stat(1), stat(2));
        let frames = |p: &[u8]| [b"load".to_vec(), 5i64.to_be_bytes().to_vec(), p.to_vec()];
        let kind = SourceKind::SglangLoad { rank: 1 };
        let Ok(EngineEvent::Load(r)) = decode_source(kind, Some(&frames(&own)[..]), &lim(1024)) else { panic!() };
        assert_eq!((r.rank, r.counts.running, r.counts.waiting), (1, 1, 2));
        let got = decode_source(kind, Some(&frames(&other)[..]), &lim(1024));
        assert_eq!(got, Err(SourceError::WrongRank { named: 2, own: 1 }));
        assert_eq!(got.unwrap_err().to_string(), "a message naming rank 2 from the endpoint of rank 1");
    }

    #[test]
    fn the_coordinator_gets_the_scrapers_gauges_never_a_body() {
        let kind = SourceKind::VllmMetrics { interval: std::time::Duration::from_millis(250) };
        let body = format!("# {}\nvllm:num_requests_waiting 1\nvllm:num_requests_running 2\n", "p".repeat(70_000));
        let gauges = crate::wire::read_vllm_metrics(body.as_bytes()).unwrap().to_frame();
        let frames = [&7u32.to_be_bytes()[..], &1u64.to_be_bytes()[..], &gauges[..]];
        let Ok(EngineEvent::Load(r)) = decode_source(kind, Some(&frames[..]), &lim(65_536)) else { panic!("refused") };
        assert_eq!((r.rank, r.counts.waiting, r.counts.running, r.kv_usage), (7, 1, 2, None));
        let frames = [&7u32.to_be_bytes()[..], &1u64.to_be_bytes()[..], body.as_bytes()];
        assert!(matches!(decode_source(kind, Some(&frames[..]), &lim(65_536)), Err(SourceError::TooLarge { .. })));
        let short = [&7u32.to_be_bytes()[..], &1u64.to_be_bytes()[..], &gauges[..23]];
        assert_eq!(
            decode_source(kind, Some(&short[..]), &lim(65_536)),
            Err(SourceError::VllmMetrics(VllmMetricsError::Gauges(23)))
        );
        assert_eq!(decode_source(kind, Some(&frames[..1]), &lim(65_536)), Err(SourceError::Frames { got: 1, want: 3 }));
    }
}
