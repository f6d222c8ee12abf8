//! Unit tests of `query/mod.rs`.

use super::*;
use std::collections::BTreeMap;

const LIM: QueryLimits = QueryLimits {
    dp_size: 8,
    max_dp_size: 1024,
    max_batch: 1024,
    max_message_bytes: 65536,
    max_prompt_tokens: 262_144,
};

/// Encodes a map from (key, value) pairs of any serializable values.
fn q(pairs: &[(&str, rmpv::Value)]) -> Vec<u8> {
    let map = rmpv::Value::Map(pairs.iter().map(|(k, v)| ((*k).into(), v.clone())).collect());
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &map).unwrap();
    out
}

/// [`super::decode_route_query`] with a token buffer of its own (leaked,
/// as some tests leak the query bytes, so a test keeps what it decoded).
fn decode_route_query<'a>(bytes: &'a [u8], lim: &QueryLimits) -> Result<Query<'a, RouteOp<'a>>, Rejected<'a>> {
    super::decode_route_query(bytes, lim, Box::leak(Box::default()))
}

/// [`super::decode_health_query`] as [`decode_route_query`].
fn decode_health_query<'a>(bytes: &'a [u8], lim: &QueryLimits) -> Result<Query<'a, HealthOp<'a>>, Rejected<'a>> {
    super::decode_health_query(bytes, lim, Box::leak(Box::default()))
}

fn code(bytes: &[u8], ch: Channel) -> ErrorCode {
    let rejected = match ch {
        Channel::Route => decode_route_query(bytes, &LIM).map(|_| ()),
        Channel::Health => decode_health_query(bytes, &LIM).map(|_| ()),
    };
    rejected.unwrap_err().error.code
}

#[test]
fn route_with_all_fields() {
    let b = q(&[
        ("v", 1.into()),
        ("op", "route".into()),
        ("id", "req-7".into()),
        ("n", 3.into()),
        ("prompt_tokens", 512.into()),
        ("session", "s1".into()),
        ("extra", rmpv::Value::Array(vec![1.into(), 2.into()])),
    ]);
    let got = decode_route_query(&b, &LIM).unwrap();
    assert_eq!(got.id, Some(Id::Str("req-7")));
    assert_eq!(
        got.op,
        RouteOp::Route(RouteRequest {
            n: 3,
            prompt_tokens: Some(512),
            target: Target::Policy,
            session: Some("s1"),
            prompt: None,
            explain: false,
            among: None,
            fallbacks: 0,
            shed_waiting: None,
        })
    );
}

#[test]
fn nil_counts_as_absent_and_rank_wins_over_room() {
    let b = q(&[
        ("v", 1.into()),
        ("op", "route".into()),
        ("n", rmpv::Value::Nil),
        ("rank", 5.into()),
        ("bootstrap_room", 3.into()),
    ]);
    let RouteOp::Route(r) = decode_route_query(&b, &LIM).unwrap().op else { panic!() };
    assert_eq!((r.n, r.target), (1, Target::Pinned(5)));
    assert_eq!(Target::Room(19).fixed_rank(8), Some(3));
}

#[test]
fn every_error_code_from_decoding() {
    let base = |extra: &[(&str, rmpv::Value)]| {
        let mut v = vec![("v", rmpv::Value::from(1)), ("op", "route".into())];
        v.extend_from_slice(extra);
        q(&v)
    };
    assert_eq!(code(b"\xc1", Channel::Route), ErrorCode::BadRequest);
    assert_eq!(code(&rmp_serde::to_vec(&[1, 2]).unwrap(), Channel::Route), ErrorCode::BadRequest);
    assert_eq!(code(&q(&[("op", "route".into())]), Channel::Route), ErrorCode::BadRequest);
    assert_eq!(code(&q(&[("v", 2.into()), ("op", "route".into())]), Channel::Route), ErrorCode::UnsupportedVersion);
    assert_eq!(code(&q(&[("v", 1.into()), ("op", "fly".into())]), Channel::Route), ErrorCode::UnknownOp);
    assert_eq!(code(&q(&[("v", 1.into()), ("op", "route".into())]), Channel::Health), ErrorCode::UnknownOp);
    assert_eq!(code(&q(&[("v", 1.into()), ("op", "health_route".into())]), Channel::Route), ErrorCode::UnknownOp);
    assert_eq!(code(&base(&[("n", 0.into())]), Channel::Route), ErrorCode::BadRequest);
    assert_eq!(code(&base(&[("n", "2".into())]), Channel::Route), ErrorCode::BadRequest);
    assert_eq!(code(&base(&[("n", 1025.into())]), Channel::Route), ErrorCode::TooLarge);
    assert_eq!(code(&base(&[("rank", 8.into())]), Channel::Route), ErrorCode::InvalidRank);
    assert_eq!(code(&base(&[("rank", (-1).into())]), Channel::Route), ErrorCode::InvalidRank);
    assert_eq!(code(&base(&[("session", 3.into())]), Channel::Route), ErrorCode::BadRequest);
    assert_eq!(code(&base(&[("bootstrap_room", (-3).into())]), Channel::Route), ErrorCode::BadRequest);
    let big = base(&[("pad", rmpv::Value::Binary(vec![0; 70_000]))]);
    assert_eq!(code(&big, Channel::Route), ErrorCode::TooLarge);
}

#[test]
fn id_is_echoed_even_when_rejected() {
    let b = q(&[("v", 9.into()), ("op", "route".into()), ("id", 42.into())]);
    let rej = decode_route_query(&b, &LIM).unwrap_err();
    assert_eq!(rej.id, Some(Id::Int(42)));
    assert!(rej.error.message.contains("version 9"), "{}", rej.error.message);
    let big = q(&[("id", "big".into()), ("pad", rmpv::Value::Binary(vec![0; 70_000]))]);
    let rej = decode_route_query(&big, &LIM).unwrap_err();
    assert_eq!((rej.id, rej.error.code), (Some(Id::Str("big")), ErrorCode::TooLarge));
}

#[test]
fn an_id_above_the_cap_or_not_a_string_or_int_is_refused_without_echo() {
    let at_cap = "i".repeat(MAX_ID_BYTES);
    let b = q(&[("v", 1.into()), ("op", "ping".into()), ("id", at_cap.as_str().into())]);
    assert_eq!(decode_route_query(&b, &LIM).unwrap().id, Some(Id::Str(&at_cap)));
    let long = "i".repeat(MAX_ID_BYTES + 1);
    for id in
        [long.as_str().into(), rmpv::Value::Binary(vec![1; 4]), rmpv::Value::Array(vec![]), rmpv::Value::Map(vec![])]
    {
        let b = q(&[("v", 1.into()), ("op", "ping".into()), ("id", id.clone())]);
        let rej = decode_route_query(&b, &LIM).unwrap_err();
        assert_eq!((rej.id, rej.error.code), (None, ErrorCode::BadRequest), "{id}");
        assert!(rej.error.message.starts_with("`id`"), "{}", rej.error.message);
        assert!(!rej.error.message.contains("iiii"), "{}", rej.error.message);
    }
    // Nor is it echoed when the query is also too large.
    let b = q(&[("id", long.as_str().into()), ("pad", rmpv::Value::Binary(vec![0; 70_000]))]);
    assert_eq!(decode_route_query(&b, &LIM).unwrap_err().id, None);
    let b = q(&[("id", long.as_str().into()), ("v", 2.into())]);
    assert_eq!(
        decode_route_query(&b, &LIM).unwrap_err().error.message,
        format!("`id` is a string of 129 bytes; at most 128 are allowed")
    );
}

#[test]
fn an_unreadable_query_still_carries_the_id_read_before_the_fault() {
    let id_first = q(&[("id", "a".into()), ("v", 1.into()), ("op", "ping".into())]);
    // Cut inside the op's value: the id was read, the rest is truncated.
    let cut = &id_first[..id_first.len() - 2];
    let rej = decode_route_query(cut, &LIM).unwrap_err();
    assert_eq!((rej.id, rej.error.code), (Some(Id::Str("a")), ErrorCode::BadRequest));
    assert!(rej.error.message.contains("MessagePack"), "{}", rej.error.message);
    // Trailing bytes: the whole map was read.
    let trailing = [id_first.as_slice(), &[0xc0]].concat();
    assert_eq!(decode_route_query(&trailing, &LIM).unwrap_err().id, Some(Id::Str("a")));
    // A non-string key is skipped, so an id after it is still read.
    let odd = rmpv::Value::Map(vec![(1.into(), 2.into()), ("id".into(), 7.into()), ("v".into(), 1.into())]);
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, &odd).unwrap();
    let rej = decode_route_query(&b, &LIM).unwrap_err();
    assert_eq!((rej.id, rej.error.message.as_str()), (Some(Id::Int(7)), "map keys must be strings, got an integer"));
    // The id after a truncation is not reached.
    let id_last = q(&[("v", 1.into()), ("op", "ping".into()), ("id", "z".into())]);
    assert_eq!(decode_route_query(&id_last[..5], &LIM).unwrap_err().id, None);
}

#[test]
fn a_long_op_name_is_quoted_cut() {
    let op = "o".repeat(10_000);
    let b = q(&[("v", 1.into()), ("op", op.as_str().into())]);
    let rej = decode_route_query(&b, &LIM).unwrap_err();
    assert_eq!(rej.error.code, ErrorCode::UnknownOp);
    let quoted = format!("unknown op `{}... (10000 bytes)`", "o".repeat(64));
    assert!(rej.error.message.starts_with(&quoted), "{}", rej.error.message);
}

#[test]
fn health_report_needs_rank_and_bool() {
    let h = |extra: &[(&str, rmpv::Value)]| {
        let mut v = vec![("v", rmpv::Value::from(1)), ("op", "health_report".into())];
        v.extend_from_slice(extra);
        // Leaked so the decoded op, which may borrow it, can leave the closure.
        let bytes: &'static [u8] = Vec::leak(q(&v));
        decode_health_query(bytes, &LIM).map(|q| q.op).map_err(|r| r.error.code)
    };
    assert_eq!(
        h(&[("rank", 2.into()), ("ok", false.into())]),
        Ok(HealthOp::Probe(Probe::Report { rank: 2, ok: false }))
    );
    assert_eq!(h(&[("ok", false.into())]), Err(ErrorCode::BadRequest));
    assert_eq!(h(&[("rank", 2.into()), ("ok", 1.into())]), Err(ErrorCode::BadRequest));
    assert_eq!(h(&[("rank", 9.into()), ("ok", true.into())]), Err(ErrorCode::InvalidRank));
}

#[test]
fn trailing_bytes_are_rejected() {
    let mut m = BTreeMap::new();
    m.insert("v", 1);
    let mut b = rmp_serde::to_vec_named(&m).unwrap();
    b.push(0xc0);
    assert_eq!(code(&b, Channel::Route), ErrorCode::BadRequest);
}

#[test]
fn admin_ops_on_the_health_socket_only() {
    let h = |pairs: &[(&str, rmpv::Value)]| {
        let bytes: &'static [u8] = Vec::leak(q(pairs));
        decode_health_query(bytes, &LIM).map(|q| q.op).map_err(|r| r.error.code)
    };
    let resize = |n: rmpv::Value| h(&[("v", 1.into()), ("op", "resize".into()), ("dp_size", n)]);
    assert_eq!(resize(12.into()), Ok(HealthOp::Admin(Admin::Resize(12))));
    // max_batch 1024: 256 ranks are the most within MAX_QUERY_WORK (2^18).
    assert_eq!(resize(256.into()), Ok(HealthOp::Admin(Admin::Resize(256))));
    assert_eq!(resize(257.into()), Err(ErrorCode::BadRequest));
    let small = QueryLimits { max_batch: 64, ..LIM };
    let bytes = q(&[("v", 1.into()), ("op", "resize".into()), ("dp_size", 1024.into())]);
    assert_eq!(decode_health_query(&bytes, &small).map(|q| q.op), Ok(HealthOp::Admin(Admin::Resize(1024))));
    let bytes = q(&[("v", 1.into()), ("op", "resize".into()), ("dp_size", 1025.into())]);
    assert_eq!(decode_health_query(&bytes, &small).map(|_| ()).unwrap_err().error.code, ErrorCode::BadRequest);
    // The ceiling of the start: up to it, and not one rank above.
    let capped = QueryLimits { max_dp_size: 12, ..LIM };
    let to = |n: u32| q(&[("v", 1.into()), ("op", "resize".into()), ("dp_size", n.into())]);
    assert_eq!(decode_health_query(&to(12), &capped).map(|q| q.op), Ok(HealthOp::Admin(Admin::Resize(12))));
    let refused = decode_health_query(&to(13), &capped).map(|_| ()).unwrap_err().error;
    assert_eq!(
        (refused.code, refused.message.as_str()),
        (
            ErrorCode::BadRequest,
            "`dp_size` 13 is above engines.max_dp_size = 12: the reply queues are sized for it at start; \
             raise it and restart to grow further"
        )
    );
    assert_eq!(resize(0.into()), Err(ErrorCode::BadRequest));
    assert_eq!(resize("8".into()), Err(ErrorCode::BadRequest));
    assert_eq!(h(&[("v", 1.into()), ("op", "resize".into())]), Err(ErrorCode::BadRequest));
    assert_eq!(h(&[("v", 1.into()), ("op", "reload".into())]), Ok(HealthOp::Admin(Admin::Reload)));
    assert_eq!(
        code(&q(&[("v", 1.into()), ("op", "resize".into()), ("dp_size", 4.into())]), Channel::Route),
        ErrorCode::UnknownOp
    );
    assert_eq!(code(&q(&[("v", 1.into()), ("op", "reload".into())]), Channel::Route), ErrorCode::UnknownOp);
}

#[test]
fn prompts_on_route_and_prefix_are_checked_the_same_way() {
    let lim = QueryLimits { max_prompt_tokens: 32, ..LIM };
    let ints = |xs: &[i64]| rmpv::Value::Array(xs.iter().map(|&x| x.into()).collect());
    let decode = |op: &str, pairs: &[(&str, rmpv::Value)]| {
        let mut v = vec![("v", rmpv::Value::from(1)), ("op", op.into())];
        v.extend_from_slice(pairs);
        let bytes: &'static [u8] = Vec::leak(q(&v));
        let prompt = match op {
            "route" => decode_route_query(bytes, &lim).map(|q| match q.op {
                RouteOp::Route(r) => r.prompt,
                _ => unreachable!(),
            }),
            _ => decode_health_query(bytes, &lim).map(|q| match q.op {
                HealthOp::Prefix(p) => Some(p),
                _ => unreachable!(),
            }),
        };
        prompt.map_err(|r| (r.error.code, r.error.message))
    };
    for op in ["route", "prefix"] {
        let Ok(Some(p)) = decode(op, &[("tokens", ints(&[1, 2, 4_000_000_000])), ("lora", "a".into())]) else {
            panic!("{op} refused")
        };
        assert_eq!(p, Prompt::Tokens { tokens: &[1, 2, 4_000_000_000], lora: Some("a"), salt: None });
        let Ok(Some(k)) = decode(op, &[("block_keys", rmpv::Value::Array(vec![u64::MAX.into(), 7.into()]))]) else {
            panic!("{op} refused keys")
        };
        let mut keys = Vec::new();
        k.keys_into(&mut keys);
        assert_eq!(keys, vec![u64::MAX, 7]);
        // Non-negative ints in signed encodings are ids and keys too.
        let signed = {
            let mut b = Vec::new();
            rmp::encode::write_map_len(&mut b, 3).unwrap();
            for (k, v) in [("v", 1i64), ("op", -1)] {
                rmp::encode::write_str(&mut b, k).unwrap();
                match v {
                    1 => rmp::encode::write_uint(&mut b, 1).map(|_| ()).unwrap(),
                    _ => rmp::encode::write_str(&mut b, op).unwrap(),
                }
            }
            rmp::encode::write_str(&mut b, "tokens").unwrap();
            rmp::encode::write_array_len(&mut b, 3).unwrap();
            rmp::encode::write_i8(&mut b, 5).unwrap();
            rmp::encode::write_i32(&mut b, 70_000).unwrap();
            rmp::encode::write_u64(&mut b, 9).unwrap();
            Vec::leak(b) as &'static [u8]
        };
        let p = match op {
            "route" => match decode_route_query(signed, &lim).unwrap().op {
                RouteOp::Route(r) => r.prompt.unwrap(),
                _ => unreachable!(),
            },
            _ => match decode_health_query(signed, &lim).unwrap().op {
                HealthOp::Prefix(p) => p,
                _ => unreachable!(),
            },
        };
        assert_eq!(p, Prompt::Tokens { tokens: &[5, 70_000, 9], lora: None, salt: None });
        let err = |pairs: &[(&str, rmpv::Value)]| decode(op, pairs).unwrap_err();
        assert_eq!(err(&[("tokens", ints(&[1, -1]))]).1, "`tokens[1]` must be a token id in 0..2^32, got -1");
        assert_eq!(err(&[("tokens", ints(&[1 << 32]))]).1, "`tokens[0]` must be a token id in 0..2^32, got 4294967296");
        assert_eq!(err(&[("block_keys", ints(&[-3]))]).1, "`block_keys[0]` must be an unsigned 64-bit key, got -3");
        assert_eq!(err(&[("tokens", "abc".into())]).1, "`tokens` must be an array, got a string");
        assert_eq!(err(&[("tokens", ints(&[1])), ("salt", 5.into())]).1, "`salt` must be a string, got an integer");
        assert_eq!(
            err(&[("tokens", ints(&[1])), ("block_keys", ints(&[1]))]).1,
            "send `tokens` or `block_keys`, not both"
        );
        assert_eq!(
            err(&[("block_keys", ints(&[1])), ("lora", "a".into())]).1,
            "`lora` and `salt` are already in `block_keys`; send them only with `tokens`"
        );
        assert_eq!(
            err(&[("tokens", ints(&[0; 33]))]),
            (ErrorCode::TooLarge, "`tokens` has 33 elements, above the limit of 32".into())
        );
        assert_eq!(err(&[("block_keys", ints(&[0; 3]))]).0, ErrorCode::TooLarge, "32 / 16 keys at most");
        // The buffer takes the limit's worth of ids at most, and the last
        // `tokens` of a map is its prompt.
        let with_buffer = |bytes: &[u8], buf: &mut Vec<u32>| {
            let got = match op {
                "route" => super::decode_route_query(bytes, &lim, buf).map(|q| match q.op {
                    RouteOp::Route(r) => r.prompt.map(|p| format!("{p:?}")),
                    _ => unreachable!(),
                }),
                _ => super::decode_health_query(bytes, &lim, buf).map(|q| match q.op {
                    HealthOp::Prefix(p) => Some(format!("{p:?}")),
                    _ => unreachable!(),
                }),
            };
            got.map_err(|r| r.error.code)
        };
        let mut buf = Vec::new();
        let long = q(&[("v", 1.into()), ("op", op.into()), ("tokens", ints(&[7; 40]))]);
        assert_eq!((with_buffer(&long, &mut buf), buf.len()), (Err(ErrorCode::TooLarge), 32));
        let twice = q(&[("v", 1.into()), ("op", op.into()), ("tokens", ints(&[1, 2])), ("tokens", ints(&[3]))]);
        let last = Prompt::Tokens { tokens: &[3], lora: None, salt: None };
        assert_eq!(with_buffer(&twice, &mut buf), Ok(Some(format!("{last:?}"))));
    }
    assert_eq!(decode("route", &[]), Ok(None), "old clients send no prompt");
    assert_eq!(decode("prefix", &[]).unwrap_err().1, "`prefix` needs `tokens` (token ids) or `block_keys`");
    // `prefix` only on the health socket.
    let route: &'static [u8] = Vec::leak(q(&[("v", 1.into()), ("op", "prefix".into()), ("tokens", ints(&[1]))]));
    assert_eq!(decode_route_query(route, &LIM).unwrap_err().error.code, ErrorCode::UnknownOp);
}

#[test]
fn explain_is_a_bool_and_anything_else_is_refused() {
    let route = |v: rmpv::Value| q(&[("v", 1.into()), ("op", "route".into()), ("explain", v)]);
    for (v, want) in [(true.into(), true), (false.into(), false), (rmpv::Value::Nil, false)] {
        let bytes = route(v);
        let RouteOp::Route(r) = decode_route_query(&bytes, &LIM).unwrap().op else { panic!() };
        assert_eq!(r.explain, want);
    }
    let err = decode_route_query(&route(1.into()), &LIM).unwrap_err().error;
    assert_eq!(
        (err.code, err.message.as_str()),
        (ErrorCode::BadRequest, "`explain` must be a boolean, got an integer")
    );
}

#[test]
fn delivered_carries_a_rank_and_two_token_counts() {
    let report = |pairs: &[(&str, rmpv::Value)]| {
        let mut all = vec![("v", 1.into()), ("op", "delivered".into())];
        all.extend(pairs.iter().cloned());
        q(&all)
    };
    let full = report(&[("rank", 7.into()), ("predicted", 64.into()), ("delivered", 48.into())]);
    let got = decode_route_query(&full, &LIM).unwrap().op;
    assert_eq!(got, RouteOp::Delivered(Delivered { rank: 7, predicted: 64, delivered: 48 }));
    let refused = |pairs: &[(&str, rmpv::Value)]| {
        let e = decode_route_query(&report(pairs), &LIM).unwrap_err().error;
        (e.code, e.message)
    };
    let bad = ErrorCode::BadRequest;
    assert_eq!(refused(&[("predicted", 1.into()), ("delivered", 1.into())]), (bad, "`delivered` needs `rank`".into()));
    assert_eq!(refused(&[("rank", 0.into()), ("delivered", 1.into())]), (bad, "`delivered` needs `predicted`".into()));
    assert_eq!(
        refused(&[("rank", 0.into()), ("predicted", 1.into()), ("delivered", (-1).into())]),
        (bad, "`delivered` must be a non-negative integer, got -1".into())
    );
    assert_eq!(
        refused(&[("rank", 8.into()), ("predicted", 1.into()), ("delivered", 1.into())]).0,
        ErrorCode::InvalidRank
    );
    assert_eq!(code(&full, Channel::Health), ErrorCode::UnknownOp);
}

#[test]
fn fallbacks_and_shed_waiting_are_bounded_counts() {
    let route = |k: &str, v: rmpv::Value| q(&[("v", 1.into()), ("op", "route".into()), (k, v)]);
    let decoded = |bytes: &[u8]| match decode_route_query(bytes, &LIM).map(|q| q.op) {
        Ok(RouteOp::Route(r)) => Ok((r.fallbacks, r.shed_waiting)),
        Ok(other) => panic!("{other:?}"),
        Err(e) => Err((e.error.code, e.error.message)),
    };
    assert_eq!(decoded(&route("fallbacks", 16.into())), Ok((16, None)));
    assert_eq!(decoded(&route("fallbacks", rmpv::Value::Nil)), Ok((0, None)));
    assert_eq!(decoded(&route("shed_waiting", 5.into())), Ok((0, Some(5))));
    let refused = [
        (route("fallbacks", 17.into()), "`fallbacks` is 17; at most 16 are listed"),
        (route("fallbacks", (-1).into()), "`fallbacks` must be a non-negative integer, got -1"),
        (route("shed_waiting", 0.into()), "`shed_waiting` must be at least 1 (leave it out to never shed)"),
        (route("shed_waiting", "4".into()), "`shed_waiting` must be an integer, got a string"),
    ];
    for (bytes, message) in refused {
        assert_eq!(decoded(&bytes), Err((ErrorCode::BadRequest, message.to_owned())));
    }
}
