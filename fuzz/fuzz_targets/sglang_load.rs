//! SGLang's load message -> the decoder alone (no coordinator). An input is
//! the 8-byte seq frame then the `LoadStat` payload, as the compatibility
//! suite records what SGLang's own SchedulerLoadPublisher sent
//! (DPCOORD_RECORD_CORPUS). Checked for every input: decoding never panics
//! and is deterministic; a report carries the frame's seq, a KV usage in
//! [0, 1] and the KV in use as its running tokens; any other topic is
//! refused; and one more field appended to a decoded `LoadStat` changes
//! nothing past the eighth element (fields after it are ignored) and is
//! refused within the first eight (a nil count).
#![no_main]

use dpcoord_daemon::engines::Sequence;
use dpcoord_daemon::wire::{decode_sglang_load, SglangError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((seq, payload)) = data.split_first_chunk::<8>() else { return };
    let decoded = decode_sglang_load(b"load", seq, payload);
    assert_eq!(decode_sglang_load(b"load", seq, payload), decoded, "decoding is not deterministic");
    assert_eq!(decode_sglang_load(b"kv", seq, payload), Err(SglangError::Topic));
    let Ok(report) = decoded else { return };
    assert_eq!(report.sequence, Sequence::Restarting { seq: u64::from_be_bytes(*seq) });
    assert!(i64::from_be_bytes(*seq) >= 0, "a negative seq was accepted");
    if let Some(kv) = report.kv_usage {
        assert!((0.0..=1.0).contains(&kv), "KV usage {kv}");
    }
    assert!(report.tokens.is_some(), "SGLang reports a token load");
    let (len, grown) = grow(payload).expect("an accepted payload is an array");
    let again = decode_sglang_load(b"load", seq, &grown);
    if len >= 8 {
        assert_eq!(again, Ok(report), "a field past the eighth changed the report");
    } else {
        assert!(matches!(again, Err(SglangError::Field { .. })), "a nil count was accepted: {again:?}");
    }
});

/// The payload with a nil appended to its top-level array, and the array's
/// length before; `None` when it does not start with an array header.
fn grow(payload: &[u8]) -> Option<(u32, Vec<u8>)> {
    let (len, body) = match *payload.first()? {
        b @ 0x90..=0x9f => (u32::from(b & 0x0f), &payload[1..]),
        0xdc => (u32::from(u16::from_be_bytes(payload.get(1..3)?.try_into().ok()?)), &payload[3..]),
        0xdd => (u32::from_be_bytes(payload.get(1..5)?.try_into().ok()?), &payload[5..]),
        _ => return None,
    };
    let mut out = Vec::with_capacity(payload.len() + 5);
    rmp::encode::write_array_len(&mut out, len.checked_add(1)?).ok()?;
    out.extend_from_slice(body);
    out.push(0xc0);
    Some((len, out))
}
