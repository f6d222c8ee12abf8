//! Decoding of `StatsUpdate`, the engine -> dpcoord message.
//!
//! Structural rules (map, keys, types, version, 5 counts, finite floats in
//! range) are checked here; rules that need the current engine state (rank in
//! range, boot/seq ordering, counters not going backwards) are checked by the
//! engine table when it applies the update.

use super::msgpack::{ReadError, Reader, Value};

/// One validated stats update. `rank` is not yet checked against `dp_size`.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsUpdate {
    pub rank: i128,
    pub boot: u64,
    pub seq: u64,
    /// `[waiting, running, received, finished, failed]`.
    pub counts: [u64; 5],
    /// `[waiting_tokens, running_tokens]`.
    pub tokens: Option<[u64; 2]>,
    pub kv_usage: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

fn read_err(e: ReadError) -> String {
    format!("not valid MessagePack: {e}")
}

fn uint(name: &str, v: Value<'_>) -> Result<u64, String> {
    match v {
        Value::Int(i) => u64::try_from(i).map_err(|_| format!("`{name}` must be a non-negative integer, got {i}")),
        other => Err(format!("`{name}` must be an integer, got {}", other.type_name())),
    }
}

fn float(name: &str, v: Value<'_>, max: f64) -> Result<f64, String> {
    let x = match v {
        Value::Float(x) => x,
        Value::Int(i) => i as f64,
        other => return Err(format!("`{name}` must be a number, got {}", other.type_name())),
    };
    if !x.is_finite() {
        return Err(format!("`{name}` must be finite, got {x}"));
    }
    if !(0.0..=max).contains(&x) {
        return Err(format!("`{name}` must be within 0..={max}, got {x}"));
    }
    Ok(x)
}

fn uint_array<const N: usize>(name: &str, v: Value<'_>, r: &mut Reader<'_>) -> Result<[u64; N], String> {
    match v {
        Value::Array(len) if len as usize == N => {
            let mut out = [0u64; N];
            for slot in out.iter_mut() {
                *slot = uint(name, r.read().map_err(read_err)?)?;
            }
            Ok(out)
        }
        Value::Array(len) => Err(format!("`{name}` must hold exactly {N} integers, got {len}")),
        other => Err(format!("`{name}` must be an array of {N} integers, got {}", other.type_name())),
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
}

fn read_entry<'a>(key: &str, v: Value<'a>, r: &mut Reader<'a>, p: &mut Partial) -> Result<(), String> {
    if v == Value::Nil {
        return Ok(()); // nil counts as absent
    }
    match key {
        "v" => p.v = Some(uint("v", v)?),
        "rank" => match v {
            Value::Int(i) => p.rank = Some(i),
            other => return Err(format!("`rank` must be an integer, got {}", other.type_name())),
        },
        "boot" => p.boot = Some(uint("boot", v)?),
        "seq" => p.seq = Some(uint("seq", v)?),
        "counts" => p.counts = Some(uint_array("counts", v, r)?),
        "tokens" => p.tokens = Some(uint_array("tokens", v, r)?),
        "kv_usage" => p.kv_usage = Some(float("kv_usage", v, 1.0)?),
        "ttft_ms" => p.ttft_ms = Some(float("ttft_ms", v, f64::MAX)?),
        "tpot_ms" => p.tpot_ms = Some(float("tpot_ms", v, f64::MAX)?),
        _ => r.skip_rest(v).map_err(read_err)?, // unknown keys are ignored
    }
    Ok(())
}

/// Decodes one update; the error string says which rule it broke.
pub fn decode_stats(bytes: &[u8]) -> Result<StatsUpdate, String> {
    let mut r = Reader::new(bytes);
    let len = match r.read().map_err(read_err)? {
        Value::Map(n) => n,
        other => return Err(format!("update must be a map, got {}", other.type_name())),
    };
    let mut p = Partial::default();
    for _ in 0..len {
        let key = match r.read().map_err(read_err)? {
            Value::Str(k) => k,
            other => return Err(format!("map keys must be strings, got {}", other.type_name())),
        };
        let value = r.read().map_err(read_err)?;
        read_entry(key, value, &mut r, &mut p)?;
    }
    if !r.at_end() {
        return Err("trailing bytes after the update map".into());
    }
    match p.v {
        Some(1) => {}
        Some(v) => return Err(format!("protocol version {v} is not supported (want 1)")),
        None => return Err("missing `v`".into()),
    }
    let missing = |k: &str| format!("missing `{k}`");
    Ok(StatsUpdate {
        rank: p.rank.ok_or_else(|| missing("rank"))?,
        boot: p.boot.ok_or_else(|| missing("boot"))?,
        seq: p.seq.ok_or_else(|| missing("seq"))?,
        counts: p.counts.ok_or_else(|| missing("counts"))?,
        tokens: p.tokens,
        kv_usage: p.kv_usage,
        ttft_ms: p.ttft_ms,
        tpot_ms: p.tpot_ms,
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
        assert_eq!(
            u,
            StatsUpdate {
                rank: 3,
                boot: 1700,
                seq: 9,
                counts: [1, 2, 10, 6, 1],
                tokens: Some([100, 200]),
                kv_usage: Some(0.25),
                ttft_ms: Some(12.0),
                tpot_ms: None,
            }
        );
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
            ("kv string", with("kv_usage", "x".into())),
        ];
        for (what, bytes) in bad {
            assert!(decode_stats(&bytes).is_err(), "{what} was accepted");
        }
    }
}
