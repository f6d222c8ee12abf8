//! Decoding of `StatsUpdate`, dpcoord's own engine -> dpcoord message, into
//! an engine event.
//!
//! Structural rules (map, keys, types, version, 5 counts, finite floats in
//! range) are checked here; rules that need the current engine state (rank in
//! range, boot/seq ordering, counters not going backwards) are checked by the
//! engine table when it applies the report. Errors hold facts, not text:
//! a flood of bad updates costs no formatting unless a warning is logged.

use std::fmt;

use super::msgpack::{ReadError, Reader, Value};
use std::time::Duration;

use crate::engines::{LoadReport, Sequence, TokenLoad};

/// Why an update could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StatsError {
    Msgpack(ReadError),
    NotAMap(&'static str),
    KeyNotString(&'static str),
    Trailing,
    Version(u64),
    Missing(&'static str),
    /// `name` holds a value of the wrong type (`got` names it).
    Type {
        name: &'static str,
        want: &'static str,
        got: &'static str,
    },
    Negative {
        name: &'static str,
        value: i128,
    },
    NotFinite {
        name: &'static str,
        value: f64,
    },
    Range {
        name: &'static str,
        value: f64,
        max: f64,
    },
    Length {
        name: &'static str,
        want: usize,
        got: u32,
    },
}

impl fmt::Display for StatsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            StatsError::Msgpack(e) => write!(f, "not valid MessagePack: {e}"),
            StatsError::NotAMap(got) => write!(f, "update must be a map, got {got}"),
            StatsError::KeyNotString(got) => write!(f, "map keys must be strings, got {got}"),
            StatsError::Trailing => write!(f, "trailing bytes after the update map"),
            StatsError::Version(v) => write!(f, "protocol version {v} is not supported (want 1)"),
            StatsError::Missing(k) => write!(f, "missing `{k}`"),
            StatsError::Type { name, want, got } => write!(f, "`{name}` must be {want}, got {got}"),
            StatsError::Negative { name, value } => write!(f, "`{name}` must be a non-negative integer, got {value}"),
            StatsError::NotFinite { name, value } => write!(f, "`{name}` must be finite, got {value}"),
            StatsError::Range { name, value, max } => write!(f, "`{name}` must be within 0..={max}, got {value}"),
            StatsError::Length { name, want, got } => {
                write!(f, "`{name}` must hold exactly {want} integers, got {got}")
            }
        }
    }
}

impl From<ReadError> for StatsError {
    fn from(e: ReadError) -> Self {
        StatsError::Msgpack(e)
    }
}

fn uint(name: &'static str, v: Value<'_>) -> Result<u64, StatsError> {
    match v {
        Value::Int(i) => u64::try_from(i).map_err(|_| StatsError::Negative { name, value: i }),
        other => Err(StatsError::Type { name, want: "an integer", got: other.type_name() }),
    }
}

fn float(name: &'static str, v: Value<'_>, max: f64) -> Result<f64, StatsError> {
    let x = match v {
        Value::Float(x) => x,
        Value::Int(i) => i as f64,
        other => return Err(StatsError::Type { name, want: "a number", got: other.type_name() }),
    };
    if !x.is_finite() {
        return Err(StatsError::NotFinite { name, value: x });
    }
    if !(0.0..=max).contains(&x) {
        return Err(StatsError::Range { name, value: x, max });
    }
    Ok(x)
}

fn uint_array<const N: usize>(name: &'static str, v: Value<'_>, r: &mut Reader<'_>) -> Result<[u64; N], StatsError> {
    match v {
        Value::Array(len) if len as usize == N => {
            let mut out = [0u64; N];
            for slot in out.iter_mut() {
                *slot = uint(name, r.read()?)?;
            }
            Ok(out)
        }
        Value::Array(len) => Err(StatsError::Length { name, want: N, got: len }),
        other => Err(StatsError::Type { name, want: "an array of integers", got: other.type_name() }),
    }
}

#[derive(Default)]
struct Partial {
    v: Option<u64>,
    rank: Option<i128>,
    boot: Option<u64>,
    seq: Option<u64>,
    counts: Option<[u64; 5]>,
    tokens: Option<[u64; 2]>,
    kv_usage: Option<f64>,
    ttft_ms: Option<f64>,
    tpot_ms: Option<f64>,
    progress: Option<u64>,
}

fn read_entry<'a>(key: &str, v: Value<'a>, r: &mut Reader<'a>, p: &mut Partial) -> Result<(), StatsError> {
    if v == Value::Nil {
        return Ok(()); // nil counts as absent
    }
    match key {
        "v" => p.v = Some(uint("v", v)?),
        "rank" => match v {
            Value::Int(i) => p.rank = Some(i),
            other => return Err(StatsError::Type { name: "rank", want: "an integer", got: other.type_name() }),
        },
        "boot" => p.boot = Some(uint("boot", v)?),
        "seq" => p.seq = Some(uint("seq", v)?),
        "counts" => p.counts = Some(uint_array("counts", v, r)?),
        "tokens" => p.tokens = Some(uint_array("tokens", v, r)?),
        "kv_usage" => p.kv_usage = Some(float("kv_usage", v, 1.0)?),
        "ttft_ms" => p.ttft_ms = Some(float("ttft_ms", v, f64::MAX)?),
        "tpot_ms" => p.tpot_ms = Some(float("tpot_ms", v, f64::MAX)?),
        "progress" => p.progress = Some(uint("progress", v)?),
        _ => r.skip_rest(v)?, // unknown keys are ignored
    }
    Ok(())
}

/// Decodes one update into a load report, or says which rule it broke.
pub fn decode_stats(bytes: &[u8]) -> Result<LoadReport, StatsError> {
    let mut r = Reader::new(bytes);
    let len = match r.read()? {
        Value::Map(n) => n,
        other => return Err(StatsError::NotAMap(other.type_name())),
    };
    let mut p = Partial::default();
    for _ in 0..len {
        let key = match r.read()? {
            Value::Str(k) => k,
            other => return Err(StatsError::KeyNotString(other.type_name())),
        };
        let value = r.read()?;
        read_entry(key, value, &mut r, &mut p)?;
    }
    if !r.at_end() {
        return Err(StatsError::Trailing);
    }
    match p.v {
        Some(1) => {}
        Some(v) => return Err(StatsError::Version(v)),
        None => return Err(StatsError::Missing("v")),
    }
    Ok(LoadReport {
        rank: p.rank.ok_or(StatsError::Missing("rank"))?,
        sequence: Sequence::Boot {
            boot: p.boot.ok_or(StatsError::Missing("boot"))?,
            seq: p.seq.ok_or(StatsError::Missing("seq"))?,
        },
        counts: p.counts.ok_or(StatsError::Missing("counts"))?.into(),
        cumulative: true,
        heartbeat: Duration::ZERO,
        tokens: p.tokens.map(|[waiting, running]| TokenLoad { waiting, running }),
        kv_usage: p.kv_usage,
        ttft_ms: p.ttft_ms,
        tpot_ms: p.tpot_ms,
        progress: p.progress,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value as V;

    fn enc(pairs: &[(&str, V)]) -> Vec<u8> {
        let map = V::Map(pairs.iter().map(|(k, v)| ((*k).into(), v.clone())).collect());
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &map).unwrap();
        out
    }

    fn good() -> Vec<(&'static str, V)> {
        vec![
            ("v", 1.into()),
            ("rank", 3.into()),
            ("boot", 1700.into()),
            ("seq", 9.into()),
            ("counts", V::Array(vec![1.into(), 2.into(), 10.into(), 6.into(), 1.into()])),
        ]
    }

    fn with(key: &'static str, v: V) -> Vec<u8> {
        let mut p = good();
        p.retain(|(k, _)| *k != key);
        p.push((key, v));
        enc(&p)
    }

    fn without(key: &str) -> Vec<u8> {
        let mut p = good();
        p.retain(|(k, _)| *k != key);
        enc(&p)
    }

    #[test]
    fn decodes_required_and_optional_fields() {
        let mut p = good();
        p.push(("tokens", V::Array(vec![100.into(), 200.into()])));
        p.push(("kv_usage", 0.25.into()));
        p.push(("ttft_ms", 12.into()));
        p.push(("tpot_ms", V::Nil));
        p.push(("future", V::Map(vec![])));
        let u = decode_stats(&enc(&p)).unwrap();
        let want = LoadReport { kv_usage: Some(0.25), ..LoadReport::new(3, 1700, 9).counts([1, 2, 10, 6, 1]) };
        assert_eq!(u, want.tokens([100, 200]).ttft_ms(12.0));
    }

    #[test]
    fn every_structural_rule_is_enforced() {
        let bad: Vec<(&str, Vec<u8>)> = vec![
            ("not a map", rmp_serde::to_vec(&[1u8]).unwrap()),
            ("garbage", vec![0xc1, 0x00]),
            ("missing v", without("v")),
            ("version 2", with("v", 2.into())),
            ("missing rank", without("rank")),
            ("missing boot", without("boot")),
            ("missing seq", without("seq")),
            ("missing counts", without("counts")),
            ("rank string", with("rank", "3".into())),
            ("negative seq", with("seq", (-1).into())),
            ("4 counts", with("counts", V::Array(vec![0.into(); 4]))),
            ("6 counts", with("counts", V::Array(vec![0.into(); 6]))),
            ("negative count", with("counts", V::Array(vec![0.into(), (-1).into(), 0.into(), 0.into(), 0.into()]))),
            ("float count", with("counts", V::Array(vec![0.5.into(), 0.into(), 0.into(), 0.into(), 0.into()]))),
            ("counts not array", with("counts", 5.into())),
            ("3 tokens", with("tokens", V::Array(vec![0.into(); 3]))),
            ("NaN ttft", with("ttft_ms", f64::NAN.into())),
            ("inf tpot", with("tpot_ms", f64::INFINITY.into())),
            ("negative ttft", with("ttft_ms", (-1.0).into())),
            ("kv above 1", with("kv_usage", 1.5.into())),
            ("kv NaN", with("kv_usage", f64::NAN.into())),
            ("kv negative", with("kv_usage", (-0.25).into())),
            ("kv infinite", with("kv_usage", f64::INFINITY.into())),
            ("kv string", with("kv_usage", "x".into())),
        ];
        for (what, bytes) in bad {
            assert!(decode_stats(&bytes).is_err(), "{what} was accepted");
        }
        let msg = |b: &[u8]| decode_stats(b).unwrap_err().to_string();
        assert_eq!(msg(&with("counts", V::Array(vec![0.into(); 4]))), "`counts` must hold exactly 5 integers, got 4");
        assert_eq!(msg(&with("seq", (-1).into())), "`seq` must be a non-negative integer, got -1");
        assert_eq!(msg(&with("kv_usage", 1.5.into())), "`kv_usage` must be within 0..=1, got 1.5");
        assert_eq!(msg(&with("kv_usage", (-0.25).into())), "`kv_usage` must be within 0..=1, got -0.25");
        assert_eq!(msg(&without("boot")), "missing `boot`");
        assert_eq!(msg(&[0xc1, 0x00]), "not valid MessagePack: message uses a reserved MessagePack marker");
    }
}
