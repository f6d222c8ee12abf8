use rmpv::Value as M;

use super::*;

fn enc(v: &M) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> M {
    M::from(x)
}

fn map(pairs: Vec<(&str, M)>) -> M {
    M::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints(xs: &[i64]) -> M {
    M::Array(xs.iter().map(|&x| M::from(x)).collect())
}

/// vLLM 0.33's shape: an array batch of map events tagged `type`.
fn vllm_stored(hashes: &[i64], parent: Option<i64>, tokens: &[i64], extra: M) -> M {
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(hashes)),
        ("parent_block_hash", parent.map_or(M::Nil, M::from)),
        ("token_ids", ints(tokens)),
        ("block_size", M::from(2)),
        ("lora_id", M::Nil),
        ("medium", s("GPU")),
        ("lora_name", s("adapter")),
        ("extra_keys", extra),
        ("group_idx", M::from(0)),
    ])
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> KvEvent {
    KvEvent::Stored(Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.to_vec(),
        block_size: 2,
        medium: Medium::Gpu,
        lora: lora.map(str::to_owned),
        salt: salt.map(str::to_owned),
        unmatchable: None,
        group: 0,
    })
}

#[test]
fn vllm_array_batch_with_map_events_salt_from_the_first_blocks_extra_keys() {
    // Extra keys per block: LoRA name, an (mm id, offset) pair, the salt.
    let extra = M::Array(vec![
        M::Array(vec![s("adapter"), M::Array(vec![s("img0"), M::from(0)]), s("tenant-a")]),
        M::Array(vec![s("adapter")]),
    ]);
    let batch = M::Array(vec![
        M::F64(1.5),
        M::Array(vec![
            vllm_stored(&[11, -12], None, &[1, 2, 3, 4], extra),
            map(vec![("type", s("BlockRemoved")), ("block_hashes", ints(&[11])), ("medium", M::Nil)]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]),
        M::from(3),
    ]);
    let got = decode_batch(&enc(&batch)).unwrap();
    assert_eq!(got.rank, Some(3));
    let mut first = stored(&[11, (-12i64) as u64], None, &[1, 2, 3, 4], Some("adapter"), Some("tenant-a"));
    let KvEvent::Stored(st) = &mut first else { unreachable!() };
    st.unmatchable = Some((0, OPAQUE_EXTRA)); // the image's identity is in the hash, not the tokens
    assert_eq!(
        got.events,
        vec![first, KvEvent::Removed { hashes: vec![11], medium: Medium::Gpu, group: 0 }, KvEvent::Cleared,]
    );
}

#[test]
fn a_continued_chain_takes_no_salt_and_sglang_names_it() {
    // vLLM puts the salt in a chain's first block only: a string here is an
    // identity dpcoord does not know, so the block is unmatchable.
    let extra = M::Array(vec![M::Array(vec![s("adapter"), s("not-a-salt-here")])]);
    let batch = M::Array(vec![M::F64(0.0), M::Array(vec![vllm_stored(&[5], Some(4), &[9, 9], extra)]), M::Nil]);
    let got = decode_batch(&enc(&batch)).unwrap();
    let mut want = stored(&[5], Some(4), &[9, 9], Some("adapter"), None);
    let KvEvent::Stored(st) = &mut want else { unreachable!() };
    st.unmatchable = Some((0, UNKNOWN_EXTRA));
    assert_eq!((got.rank, got.events), (None, vec![want]));
    // SGLang: signed hashes, `cache_salt`, `medium` CPU_PINNED, the rank as `attn_dp_rank` in a map batch.
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[-7])),
        ("parent_block_hash", M::Nil),
        ("token_ids", ints(&[1, 2])),
        ("block_size", M::from(2)),
        ("lora_id", M::Nil),
        ("medium", s("CPU_PINNED")),
        ("cache_salt", s("t")),
    ]);
    let batch = map(vec![("ts", M::F64(0.0)), ("events", M::Array(vec![ev])), ("attn_dp_rank", M::from(1))]);
    let got = decode_batch(&enc(&batch)).unwrap();
    let KvEvent::Stored(st) = &got.events[0] else { panic!("{got:?}") };
    assert_eq!(
        (got.rank, st.hashes[0], st.medium, st.salt.as_deref()),
        (Some(1), (-7i64) as u64, Medium::Cpu, Some("t"))
    );
}

#[test]
fn tagged_array_events_and_byte_hashes() {
    let mut raw = [0u8; 32];
    raw[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let stored_arr = M::Array(vec![
        s("BlockStored"),
        M::Array(vec![M::Binary(raw.to_vec())]),
        M::Nil,
        ints(&[1, 2]),
        M::from(2),
        M::Nil,
        s("STORAGE"),
    ]);
    let removed_arr = M::Array(vec![s("BlockRemoved"), M::Array(vec![M::Binary(raw.to_vec())]), s("STORAGE")]);
    let batch =
        M::Array(vec![M::F64(0.0), M::Array(vec![stored_arr, removed_arr, M::Array(vec![s("AllBlocksCleared")])])]);
    let got = decode_batch(&enc(&batch)).unwrap();
    let h = 0x0102_0304_0506_0708u64;
    let KvEvent::Stored(st) = &got.events[0] else { panic!("{got:?}") };
    assert_eq!((st.hashes.as_slice(), st.medium, st.lora.as_deref()), (&[h][..], Medium::Disk, None));
    assert_eq!(got.events[1], KvEvent::Removed { hashes: vec![h], medium: Medium::Disk, group: 0 });
    assert_eq!(got.events[2], KvEvent::Cleared);
}

#[test]
fn bad_batches_say_why() {
    let cases = [
        (M::from(1), "`KVEventBatch` must be an array or a map, got an integer"),
        (M::Array(vec![M::F64(0.0)]), "the batch has no `events`"),
        (M::Array(vec![M::F64(0.0), M::Array(vec![map(vec![("type", s("Nope"))])])]), "\"Nope\""),
        (M::Array(vec![M::F64(0.0), M::Array(vec![map(vec![("block_size", M::from(2))])])]), "no `type`"),
        (M::Array(vec![M::F64(0.0), M::Array(vec![map(vec![("type", s("BlockStored"))])])]), "lacks `block_hashes`"),
        (
            M::Array(vec![M::F64(0.0), M::Array(vec![map(vec![("type", s("BlockRemoved")), ("medium", s("TAPE"))])])]),
            "\"TAPE\"",
        ),
        (
            M::Array(vec![M::F64(0.0), M::Array(vec![]), M::from(-1)]),
            "`dp_rank` must be a rank (0..2^32), got an integer",
        ),
        (
            M::Array(vec![
                M::F64(0.0),
                M::Array(vec![map(vec![("type", s("BlockStored")), ("token_ids", ints(&[-1]))])]),
            ]),
            "token ids in 0..2^32",
        ),
    ];
    for (v, want) in cases {
        let e = decode_batch(&enc(&v)).unwrap_err().to_string();
        assert!(e.contains(want), "{e} lacks {want}");
    }
    assert_eq!(decode_batch(&[0x91]), Err(BatchError::Msgpack(ReadError::Truncated)));
    let mut trailing = enc(&M::Array(vec![M::F64(0.0), M::Array(vec![])]));
    trailing.push(0xc0);
    assert_eq!(decode_batch(&trailing), Err(BatchError::Trailing));
}

#[test]
fn frames_live_replayed_and_the_end_marker() {
    let payload = enc(&M::Array(vec![M::F64(0.0), M::Array(vec![]), M::from(0)]));
    let seq = 7u64.to_be_bytes();
    let live = [&b"kv"[..], &seq[..], &payload[..]];
    let m = decode_kv_message(2, false, &live, 1 << 20).unwrap();
    assert_eq!(m.stream, 2);
    assert_eq!(m.body, KvBody::Batch { seq: 7, batch: Ok(KvBatch { rank: Some(0), events: vec![] }) });
    let replayed = [&b""[..], &b"kv"[..], &seq[..], &payload[..]];
    assert!(decode_kv_message(2, true, &replayed, 1 << 20).unwrap().from_replay);
    let end = [&b""[..], &b""[..], &[0xff; 8][..], &b""[..]];
    assert_eq!(decode_kv_message(0, true, &end, 1 << 20).unwrap().body, KvBody::ReplayEnd);
    // The seq counts even when the payload does not decode or is too large.
    let big = decode_kv_message(0, false, &live, 4).unwrap();
    assert!(matches!(big.body, KvBody::Batch { seq: 7, batch: Err(ref e) } if e.contains("max_batch_bytes")));
    let bad = [&b""[..], &seq[..], &b"\xc1"[..]];
    assert!(matches!(decode_kv_message(0, false, &bad, 64).unwrap().body, KvBody::Batch { seq: 7, batch: Err(_) }));
    assert_eq!(decode_kv_message(0, false, &live[..2], 64), Err(KvFrameError::Frames { got: 2, want: 3 }));
    assert_eq!(decode_kv_message(0, true, &live, 64), Err(KvFrameError::Delimiter));
    let short_seq = [&b""[..], &b"\x01"[..], &payload[..]];
    assert_eq!(decode_kv_message(0, false, &short_seq, 64), Err(KvFrameError::SeqBytes(1)));
}

#[test]
fn token_pairs_and_malformed_groups_are_events_the_index_skips_other_groups_are_kept() {
    // SGLang with EAGLE: token_ids are bigrams. vLLM's hybrid models: group_idx > 0.
    let pairs = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("parent_block_hash", M::Nil),
        ("token_ids", M::Array(vec![ints(&[5, 6])])),
        ("block_size", M::from(1)),
        ("lora_id", M::Nil),
    ]);
    let removed = |group: M| map(vec![("type", s("BlockRemoved")), ("block_hashes", ints(&[1])), ("group_idx", group)]);
    let mut stored = vllm_stored(&[1], None, &[5, 6], M::Nil);
    if let M::Map(fields) = &mut stored {
        fields.last_mut().unwrap().1 = M::from(7);
    }
    let batch = M::Array(vec![
        M::F64(0.0),
        M::Array(vec![
            pairs,
            removed(M::from(1)),
            removed(M::from(0)),
            removed(M::Nil),
            removed(M::from(1u64 << 40)),
            removed(M::from(-1)),
            removed(s("1")),
            stored,
            map(vec![("type", s("AllBlocksCleared"))]),
        ]),
    ]);
    let got = decode_batch(&enc(&batch)).unwrap();
    let gone = |group| KvEvent::Removed { hashes: vec![1], medium: Medium::Gpu, group };
    let KvEvent::Stored(st) = &got.events[7] else { panic!("{:?}", got.events[7]) };
    assert_eq!((st.group, &st.lora), (7, &Some("adapter".to_owned())));
    assert_eq!(
        got.events[..7],
        [
            KvEvent::Unindexable("token pairs (EAGLE bigram pages) are not keyed"),
            gone(1),
            gone(0),
            gone(0),
            gone(u32::MAX),
            KvEvent::Unindexable(BAD_GROUP),
            KvEvent::Unindexable(BAD_GROUP),
        ]
    );
    assert_eq!(got.events[8], KvEvent::Cleared);
}

/// The `unmatchable` of one vLLM event with these extra keys (and lookahead tokens).
fn unmatchable_of(parent: Option<i64>, extra: M, lookahead: Option<M>) -> Option<(usize, &'static str)> {
    let mut ev = vllm_stored(&[1, 2, 3], parent, &[1, 2, 3, 4, 5, 6], extra);
    if let (M::Map(fields), Some(l)) = (&mut ev, lookahead) {
        fields.push((s("lookahead_token_ids"), l));
    }
    let got = decode_batch(&enc(&M::Array(vec![M::F64(0.0), M::Array(vec![ev])]))).unwrap();
    match &got.events[..] {
        [KvEvent::Stored(st)] => st.unmatchable,
        other => panic!("{other:?}"),
    }
}

#[test]
fn blocks_whose_identity_is_more_than_tokens_lora_and_salt_are_unmatchable_from_the_first() {
    let a = |xs: Vec<M>| M::Array(xs);
    let lora = || s("adapter");
    let mm = |id: &str, off: i64| a(vec![s(id), M::from(off)]);
    // LoRA name in every block, the salt in the first: all keyed.
    assert_eq!(unmatchable_of(None, a(vec![a(vec![lora(), s("t")]), a(vec![lora()]), a(vec![lora()])]), None), None);
    assert_eq!(unmatchable_of(None, M::Nil, None), None);
    assert_eq!(unmatchable_of(Some(9), a(vec![a(vec![lora()]), M::Nil, a(vec![lora()])]), None), None);
    // vLLM's lookahead hashes (EAGLE): each block's hash covers the next tokens.
    let look = a(vec![ints(&[7]), ints(&[8]), ints(&[9])]);
    assert_eq!(unmatchable_of(None, M::Nil, Some(look)), Some((0, LOOKAHEAD)));
    assert_eq!(unmatchable_of(None, M::Nil, Some(M::Nil)), None, "nil: lookahead hashing is off");
    // An image in the second block: the first is keyed, the second and third are not.
    let image = a(vec![a(vec![lora()]), a(vec![lora(), mm("img", 0)]), a(vec![lora()])]);
    assert_eq!(unmatchable_of(None, image, None), Some((1, OPAQUE_EXTRA)));
    // Prompt embeddings: a digest (bytes) per block.
    let embeds = a(vec![M::Nil, M::Nil, a(vec![M::Binary(vec![1; 32])])]);
    assert_eq!(unmatchable_of(None, embeds, None), Some((2, OPAQUE_EXTRA)));
    // A string that is neither the LoRA name nor a chain's first-block salt.
    let odd = a(vec![a(vec![lora()]), a(vec![lora(), s("other")]), a(vec![lora()])]);
    assert_eq!(unmatchable_of(None, odd, None), Some((1, UNKNOWN_EXTRA)));
    let two_salts = a(vec![a(vec![lora(), s("t"), s("u")])]);
    assert_eq!(unmatchable_of(None, two_salts, None), Some((0, UNKNOWN_EXTRA)));
    // The earliest block wins whichever kind comes first in the list.
    let both = a(vec![a(vec![lora()]), a(vec![lora(), mm("img", 3)]), a(vec![s("x")])]);
    assert_eq!(unmatchable_of(None, both, None), Some((1, OPAQUE_EXTRA)));
}
