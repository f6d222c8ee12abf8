//! A simulated engine's KV-event publisher, as vLLM's: a PUB the engine
//! binds, sending `[topic, seq (8 bytes BE, from 0), msgpack [ts, events,
//! dp_rank]]` with events as maps tagged `type` (docs/PROTOCOL.md §11a).
//! dpcoord subscribes with its `kv_events.connect`, so the real ingestion
//! path runs. No replay socket: the simulator never drops a batch.

use serde::Serialize;

use super::error::NetError;
use super::prefix_cache::KvEvent;
use super::stepped::{SourcePeer, Wiring};
use dpcoord_daemon::wire::SourceKind;

pub struct KvPub {
    peer: SourcePeer,
    rank: u32,
    /// The next batch's `seq`.
    seq: u64,
}

/// One event as vLLM's msgspec encodes it: a map tagged `type`.
#[derive(Serialize)]
#[serde(tag = "type")]
enum Wire<'a> {
    BlockStored {
        block_hashes: &'a [u64],
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
        lora_id: Option<u32>,
        medium: &'static str,
    },
    BlockRemoved {
        block_hashes: &'a [u64],
        medium: &'static str,
    },
}

/// A `KVEventBatch` payload: `[ts, events, dp_rank]`.
pub fn encode(events: &[KvEvent], block: u32, rank: u32, ts: f64) -> Result<Vec<u8>, NetError> {
    let wire: Vec<Wire<'_>> = events
        .iter()
        .map(|e| match e {
            KvEvent::Stored { hashes, parent, tokens } => Wire::BlockStored {
                block_hashes: hashes,
                parent_block_hash: *parent,
                token_ids: tokens,
                block_size: block,
                lora_id: None,
                medium: "GPU",
            },
            KvEvent::Removed { hashes } => Wire::BlockRemoved { block_hashes: hashes, medium: "GPU" },
        })
        .collect();
    Ok(rmp_serde::to_vec_named(&(ts, wire, rank))?)
}

impl KvPub {
    /// Engine `rank`'s PUB at `endpoint`, the `rank`-th of `kv_events.connect`.
    pub fn bind(wiring: &Wiring, endpoint: &str, rank: u32) -> Result<KvPub, NetError> {
        let kind = SourceKind::KvEvents { stream: rank as u16, replay: false };
        Ok(KvPub { peer: wiring.publisher(endpoint, kind, true, 1_000_000)?, rank, seq: 0 })
    }

    /// Sends one batch (which may be empty) at virtual time `ts` seconds.
    pub fn send(&mut self, events: &[KvEvent], block: u32, ts: f64) -> Result<(), NetError> {
        let payload = encode(events, block, self.rank, ts)?;
        self.peer.send(&[b"", &self.seq.to_be_bytes(), &payload])?;
        self.seq += 1;
        Ok(())
    }

    /// Batches sent so far.
    pub fn sent(&self) -> u64 {
        self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_vllm_shaped() {
        let stored = KvEvent::Stored { hashes: vec![7, 8], parent: Some(6), tokens: vec![1, 2, 3, 4] };
        let bytes = encode(&[stored, KvEvent::Removed { hashes: vec![5] }], 2, 3, 1.5).unwrap();
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        use rmpv::Value as M;
        let M::Array(top) = v else { panic!("{v}") };
        assert_eq!((top[0].as_f64(), top[2].as_u64()), (Some(1.5), Some(3)));
        let field = |i: usize, k: &str| {
            let events = top[1].as_array().unwrap();
            events[i].as_map().unwrap().iter().find(|(key, _)| key.as_str() == Some(k)).unwrap().1.clone()
        };
        assert_eq!(field(0, "type").as_str(), Some("BlockStored"));
        assert_eq!((field(0, "parent_block_hash").as_u64(), field(0, "block_size").as_u64()), (Some(6), Some(2)));
        assert_eq!(field(0, "token_ids").as_array().map(Vec::len), Some(4));
        assert_eq!(field(1, "type").as_str(), Some("BlockRemoved"));
        assert_eq!(field(1, "block_hashes"), M::Array(vec![M::from(5u64)]));
    }
}
