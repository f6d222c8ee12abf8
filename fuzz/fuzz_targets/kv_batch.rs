//! A `KVEventBatch` payload -> the decoder alone (no coordinator, so many
//! inputs a second). Seeded with the payloads vLLM's and SGLang's own
//! publishers sent in the compatibility suite (DPCOORD_RECORD_CORPUS).
//! Checked for every input: decoding never panics and is deterministic; a
//! batch holds no more events, hashes and tokens than its bytes can carry;
//! a decoded batch written back (as the map form, where the engines sent
//! arrays) decodes to itself; and the message framing around the payload
//! (live, replayed, over the size cap) gives the same batch or the cap's refusal.
//! And the batch applied to a prefix index a slice at a time (a budget of 1
//! to 5 blocks per call, as the routing thread applies it per poll round)
//! leaves the index and the counts exactly as applying it whole does.
#![no_main]

use dpcoord_daemon::engines::kv::{KvBatch, KvBody, KvEvent, Medium};
use dpcoord_daemon::engines::prefix::{PrefixIndex, Progress};
use dpcoord_daemon::wire::{decode_kv_batch, decode_kv_message, BAD_GROUP, LOOKAHEAD, OPAQUE_EXTRA};
use libfuzzer_sys::fuzz_target;
use rmp::encode;

fuzz_target!(|data: &[u8]| {
    let decoded = decode_kv_batch(data);
    assert_eq!(decode_kv_batch(data), decoded, "decoding is not deterministic");
    if let Ok(batch) = &decoded {
        assert!(batch.events.len() <= data.len(), "{} events from {} bytes", batch.events.len(), data.len());
        for event in &batch.events {
            if let KvEvent::Stored(s) = event {
                assert!(s.hashes.len() + s.tokens.len() <= data.len(), "more hashes and tokens than bytes");
            }
        }
        let again = encode_batch(batch);
        assert_eq!(decode_kv_batch(&again).as_ref(), Ok(batch), "the batch written back decodes otherwise");
        sliced(batch, 1 + data.len() % 5);
    }
    framing(data, &decoded);
});

/// `batch` applied whole and `budget` blocks at a time, to a rank that
/// holds a few blocks already and a cap the batch can pass (so the cap runs
/// too): the same index, the same counts.
fn sliced(batch: &KvBatch, budget: usize) {
    let index = || PrefixIndex::new(1, 64);
    let (mut whole, mut parts) = (index(), index());
    let applied = whole.apply(0, &batch.events);
    let mut at = Progress::default();
    loop {
        let evicted = at.applied.evicted;
        let (used, done) = parts.apply_some(0, &batch.events, &mut at, budget);
        // A step of the cap's sweep may pass the budget by what it drops.
        let swept = (at.applied.evicted - evicted) as usize;
        assert!(used <= budget + swept, "{used} blocks touched, budget {budget}, {swept} swept");
        if done {
            break;
        }
    }
    assert_eq!(at.applied, applied, "sliced counts differ");
    assert_eq!(parts.distinct_keys(), whole.distinct_keys(), "sliced holders differ");
    for m in Medium::ALL {
        assert_eq!(parts.blocks(0, m), whole.blocks(0, m), "sliced {m:?} blocks differ");
    }
}

/// The payload inside a live and a replayed message: the same batch (or the
/// same refusal), and a payload over `max_payload` refused whatever it holds.
fn framing(data: &[u8], decoded: &Result<KvBatch, dpcoord_daemon::wire::BatchError>) {
    let seq = 41u64.to_be_bytes();
    let want = KvBody::Batch { seq: 41, batch: decoded.clone().map_err(|e| format!("KV events: {e}")) };
    let live = decode_kv_message(3, false, &[&b"kv"[..], &seq, data], data.len()).expect("well-framed");
    assert_eq!(live.body, want);
    let replayed = decode_kv_message(3, true, &[&b""[..], b"kv", &seq, data], data.len()).expect("well-framed");
    assert_eq!(replayed.body, want);
    if let Some(cap) = data.len().checked_sub(1) {
        let over = decode_kv_message(3, false, &[&b"kv"[..], &seq, data], cap).expect("well-framed");
        assert!(matches!(over.body, KvBody::Batch { seq: 41, batch: Err(_) }), "a payload over the cap was decoded");
    }
}

fn encode_batch(batch: &KvBatch) -> Vec<u8> {
    let mut w = Vec::new();
    encode::write_map_len(&mut w, 2).unwrap();
    encode::write_str(&mut w, "events").unwrap();
    encode::write_array_len(&mut w, batch.events.len() as u32).unwrap();
    for event in &batch.events {
        encode_event(&mut w, event);
    }
    encode::write_str(&mut w, "dp_rank").unwrap();
    match batch.rank {
        Some(r) => drop(encode::write_uint(&mut w, r.into()).unwrap()),
        None => encode::write_nil(&mut w).unwrap(),
    }
    w
}

/// The field that makes block `first` on unmatchable for `why`: a lookahead
/// token, or in block `first`'s extra keys a multimodal pair or a string
/// other than the LoRA name (the salt, if any, is in `cache_salt` already).
fn unmatchable(w: &mut Vec<u8>, first: usize, why: &str, lora: Option<&str>) {
    if why == LOOKAHEAD {
        encode::write_str(w, "lookahead_token_ids").unwrap();
        encode::write_array_len(w, 1).unwrap();
        encode::write_array_len(w, 1).unwrap();
        encode::write_uint(w, 0).unwrap();
        return;
    }
    encode::write_str(w, "extra_keys").unwrap();
    encode::write_array_len(w, first as u32 + 1).unwrap();
    for _ in 0..first {
        encode::write_nil(w).unwrap();
    }
    encode::write_array_len(w, 1).unwrap();
    if why == OPAQUE_EXTRA {
        encode::write_array_len(w, 0).unwrap();
    } else {
        encode::write_str(w, &format!("{}~", lora.unwrap_or(""))).unwrap();
    }
}

fn opt_str(w: &mut Vec<u8>, key: &str, v: Option<&str>) {
    encode::write_str(w, key).unwrap();
    match v {
        Some(s) => encode::write_str(w, s).unwrap(),
        None => encode::write_nil(w).unwrap(),
    }
}

fn hashes(w: &mut Vec<u8>, hashes: &[u64]) {
    encode::write_str(w, "block_hashes").unwrap();
    encode::write_array_len(w, hashes.len() as u32).unwrap();
    for &h in hashes {
        encode::write_uint(w, h).unwrap();
    }
}

/// One event as a map; the kind the decoder only infers is written as the
/// input that makes it: token pairs, or a negative KV cache group.
fn encode_event(w: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::Stored(s) => {
            encode::write_map_len(w, 9 + u32::from(s.unmatchable.is_some())).unwrap();
            encode::write_str(w, "type").unwrap();
            encode::write_str(w, "BlockStored").unwrap();
            hashes(w, &s.hashes);
            encode::write_str(w, "parent_block_hash").unwrap();
            match s.parent {
                Some(p) => drop(encode::write_uint(w, p).unwrap()),
                None => encode::write_nil(w).unwrap(),
            }
            encode::write_str(w, "token_ids").unwrap();
            encode::write_array_len(w, s.tokens.len() as u32).unwrap();
            for &t in &s.tokens {
                encode::write_uint(w, t.into()).unwrap();
            }
            encode::write_str(w, "block_size").unwrap();
            encode::write_uint(w, s.block_size.into()).unwrap();
            opt_str(w, "medium", Some(s.medium.as_str()));
            opt_str(w, "lora_name", s.lora.as_deref());
            opt_str(w, "cache_salt", s.salt.as_deref());
            encode::write_str(w, "group_idx").unwrap();
            encode::write_uint(w, s.group.into()).unwrap();
            if let Some((first, why)) = s.unmatchable {
                unmatchable(w, first, why, s.lora.as_deref());
            }
        }
        KvEvent::Removed { hashes: h, medium, group } => {
            encode::write_map_len(w, 4).unwrap();
            encode::write_str(w, "type").unwrap();
            encode::write_str(w, "BlockRemoved").unwrap();
            hashes(w, h);
            opt_str(w, "medium", Some(medium.as_str()));
            encode::write_str(w, "group_idx").unwrap();
            encode::write_uint(w, (*group).into()).unwrap();
        }
        KvEvent::Cleared => {
            encode::write_map_len(w, 1).unwrap();
            encode::write_str(w, "type").unwrap();
            encode::write_str(w, "AllBlocksCleared").unwrap();
        }
        KvEvent::Unindexable(why) if *why == BAD_GROUP => {
            encode::write_map_len(w, 2).unwrap();
            encode::write_str(w, "type").unwrap();
            encode::write_str(w, "BlockRemoved").unwrap();
            encode::write_str(w, "group_idx").unwrap();
            encode::write_sint(w, -1).unwrap();
        }
        KvEvent::Unindexable(_) => {
            encode::write_map_len(w, 2).unwrap();
            encode::write_str(w, "type").unwrap();
            encode::write_str(w, "BlockStored").unwrap();
            encode::write_str(w, "token_ids").unwrap();
            encode::write_array_len(w, 1).unwrap();
            encode::write_array_len(w, 2).unwrap();
            encode::write_uint(w, 1).unwrap();
            encode::write_uint(w, 2).unwrap();
        }
    }
}
