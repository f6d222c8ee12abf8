//! The MessagePack bytes tests send: queries, maps and `StatsUpdate`s.

use rmpv::Value as M;
use serde_json::Value;

/// A JSON value as the named MessagePack map dpcoord reads.
pub fn encode(v: &Value) -> Vec<u8> {
    rmp_serde::to_vec_named(v).unwrap()
}

/// Encodes any MessagePack value, for messages JSON cannot express (NaN, binary, odd keys).
pub fn msgpack(v: &M) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// A MessagePack map from (key, value) pairs, in that order.
pub fn map(pairs: &[(&str, M)]) -> Vec<u8> {
    msgpack(&M::Map(pairs.iter().map(|(k, v)| (M::from(*k), v.clone())).collect()))
}

/// A query `{v: 1, op, id}` plus `extra`, in that order.
pub fn query(op: &str, id: impl Into<M>, extra: &[(&str, M)]) -> Vec<u8> {
    let mut pairs = vec![("v", M::from(1)), ("op", M::from(op)), ("id", id.into())];
    pairs.extend_from_slice(extra);
    map(&pairs)
}

/// A MessagePack array of integers.
pub fn ints<T: Copy + Into<M>>(xs: &[T]) -> M {
    M::Array(xs.iter().map(|&x| x.into()).collect())
}

/// A valid `StatsUpdate`.
pub fn update(rank: u32, boot: u64, seq: u64, counts: [u64; 5]) -> Value {
    Update::new(rank, boot, seq).counts(counts).value()
}

/// A `StatsUpdate` built field by field, e.g.
/// `Update::new(rank, boot, seq).counts([..]).tokens([..]).ttft(x).value()`.
/// It starts as `{v: 1, rank, boot, seq, counts: [0; 5]}`; later fields
/// follow in the order they are set, and setting a key again replaces it.
#[derive(Clone, Debug)]
pub struct Update(Vec<(&'static str, M)>);

impl Update {
    pub fn new(rank: impl Into<i64>, boot: u64, seq: u64) -> Update {
        let (rank, zeros) = (rank.into(), ints(&[0u64; 5]));
        Update(vec![
            ("v", 1.into()),
            ("rank", rank.into()),
            ("boot", boot.into()),
            ("seq", seq.into()),
            ("counts", zeros),
        ])
    }

    /// Sets `key` to `v` (in place if present, else last): any value, valid or not.
    pub fn set(mut self, key: &'static str, v: M) -> Update {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = v,
            None => self.0.push((key, v)),
        }
        self
    }

    /// Leaves `key` out.
    pub fn without(mut self, key: &str) -> Update {
        self.0.retain(|(k, _)| *k != key);
        self
    }

    /// `[waiting, running, received, finished, failed]` (any length, for bad updates).
    pub fn counts<const N: usize>(self, counts: [u64; N]) -> Update {
        self.set("counts", ints(&counts))
    }

    /// `[waiting_tokens, running_tokens]`.
    pub fn tokens(self, tokens: [u64; 2]) -> Update {
        self.set("tokens", ints(&tokens))
    }

    pub fn ttft(self, ms: f64) -> Update {
        self.set("ttft_ms", ms.into())
    }

    pub fn tpot(self, ms: f64) -> Update {
        self.set("tpot_ms", ms.into())
    }

    pub fn kv_usage(self, usage: f64) -> Update {
        self.set("kv_usage", usage.into())
    }

    /// The fields in order, to pad or reshape.
    pub fn pairs(self) -> Vec<(&'static str, M)> {
        self.0
    }

    /// The update encoded as a map, fields in order.
    pub fn bytes(&self) -> Vec<u8> {
        map(&self.0)
    }

    /// The update as the JSON value [`Publisher::send`] takes.
    pub fn value(&self) -> Value {
        rmp_serde::from_slice(&self.bytes()).expect("an update JSON can hold")
    }
}
