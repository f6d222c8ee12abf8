//! The `[kv_events]` section: the engines' KV-event publishers, written one
//! by one or as `tcp://HOST:PORT+rank[A-B]` (one per rank, the engines'
//! port + rank layout), and the index's limits.

use super::{err, keys, ConfigError, Section};
use crate::config::{KvEndpoint, KvSettings};

/// An endpoint as written: plain, or a port + rank range.
fn expand(written: &str, dp_size: u32, key: &keys::ListKey) -> Result<Vec<(String, Option<u32>)>, ConfigError> {
    let bad = |why: &str| err(key.key.path(), format!("`{written}`: {why}"));
    let Some(at) = written.find("+rank") else {
        super::check_endpoint(written).map_err(|p| err(key.key.path(), p))?;
        return Ok(vec![(written.to_owned(), None)]);
    };
    let (base, range) = (&written[..at], &written[at + "+rank".len()..]);
    let (host, port) = base
        .strip_prefix("tcp://")
        .and_then(|b| b.rsplit_once(':'))
        .ok_or_else(|| bad("the +rank form is tcp://HOST:PORT+rank or tcp://HOST:PORT+rank[A-B]"))?;
    let port: u32 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let (first, last) = match range {
        "" => (0, dp_size.saturating_sub(1)),
        r => {
            let inner =
                r.strip_prefix('[').and_then(|r| r.strip_suffix(']')).ok_or_else(|| bad("write the ranks as [A-B]"))?;
            let (a, b) = inner.split_once('-').ok_or_else(|| bad("write the ranks as [A-B]"))?;
            let (a, b) = (a.parse::<u32>(), b.parse::<u32>());
            let (Ok(a), Ok(b)) = (a, b) else { return Err(bad("the ranks are not numbers")) };
            if a > b {
                return Err(bad("the first rank is above the last"));
            }
            (a, b)
        }
    };
    if port + last > u32::from(u16::MAX) {
        return Err(bad(&format!("port {port} + rank {last} is above 65535")));
    }
    Ok((first..=last).map(|r| (format!("tcp://{host}:{}", port + r), Some(r))).collect())
}

/// The publishers (each with its replay endpoint, paired by position after
/// expansion), the topic, and the index's limits.
pub(in crate::config) fn parse_kv_events(
    mut s: Section<'_>,
    dp_size: u32,
) -> Result<(Vec<KvEndpoint>, String, KvSettings), ConfigError> {
    let mut connect = Vec::new();
    for written in s.strings(&keys::KV_CONNECT)? {
        connect.extend(expand(&written, dp_size, &keys::KV_CONNECT)?);
    }
    let mut replay = Vec::new();
    for written in s.strings(&keys::KV_REPLAY)? {
        replay.extend(expand(&written, dp_size, &keys::KV_REPLAY)?);
    }
    if !replay.is_empty() && replay.len() != connect.len() {
        return Err(err(
            keys::KV_REPLAY.key.path(),
            format!(
                "names {} endpoints after expansion, {} has {}; they pair by position",
                replay.len(),
                keys::KV_CONNECT.key.path(),
                connect.len()
            ),
        ));
    }
    if connect.len() > usize::from(u16::MAX) {
        return Err(err(keys::KV_CONNECT.key.path(), "more than 65535 publishers"));
    }
    let topic = s.string(&keys::KV_TOPIC)?;
    let settings = KvSettings {
        max_batch_bytes: s.int(&keys::KV_MAX_BATCH_BYTES)? as usize,
        replay_timeout: s.ms(&keys::KV_REPLAY_TIMEOUT_MS)?,
    };
    s.finish()?;
    let mut replay = replay.into_iter().map(|(ep, _)| ep);
    let endpoints =
        connect.into_iter().map(|(connect, rank)| KvEndpoint { connect, replay: replay.next(), rank }).collect();
    Ok((endpoints, topic, settings))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, dp: u32) -> Result<(Vec<KvEndpoint>, String, KvSettings), ConfigError> {
        let t: toml::Table = text.parse().unwrap();
        parse_kv_events(super::super::section(&t, "kv_events")?, dp)
    }

    #[test]
    fn plain_and_port_plus_rank_forms_pair_with_replay() {
        let (eps, topic, kv) = parse(
            "[kv_events]\nconnect = [\"tcp://a:5557+rank\", \"tcp://b:7000+rank[2-3]\", \"ipc:///tmp/x\"]\n\
             replay = [\"tcp://a:6000+rank[0-1]\", \"tcp://b:8000+rank[2-3]\", \"ipc:///tmp/y\"]\ntopic = \"kv\"",
            2,
        )
        .unwrap();
        let got: Vec<(&str, Option<&str>, Option<u32>)> =
            eps.iter().map(|e| (e.connect.as_str(), e.replay.as_deref(), e.rank)).collect();
        assert_eq!(
            got,
            vec![
                ("tcp://a:5557", Some("tcp://a:6000"), Some(0)),
                ("tcp://a:5558", Some("tcp://a:6001"), Some(1)),
                ("tcp://b:7002", Some("tcp://b:8002"), Some(2)),
                ("tcp://b:7003", Some("tcp://b:8003"), Some(3)),
                ("ipc:///tmp/x", Some("ipc:///tmp/y"), None),
            ]
        );
        assert_eq!((topic.as_str(), kv.replay_timeout.as_millis()), ("kv", 2000));
    }

    #[test]
    fn bad_forms_name_the_key_and_say_why() {
        let cases = [
            (
                "connect = [\"tcp://a:5557+rank[3-1]\"]",
                "kv_events.connect: `tcp://a:5557+rank[3-1]`: the first rank is above the last",
            ),
            ("connect = [\"tcp://a:65535+rank\"]", "port 65535 + rank 1 is above 65535"),
            ("connect = [\"ipc:///x+rank\"]", "the +rank form is tcp://HOST:PORT+rank"),
            ("connect = [\"tcp://a:1+rank(0-1)\"]", "write the ranks as [A-B]"),
            ("connect = [\"nope\"]", "kv_events.connect: `nope` is not an endpoint"),
            (
                "connect = [\"tcp://a:1\"]\nreplay = [\"tcp://a:2\", \"tcp://a:3\"]",
                "kv_events.replay: names 2 endpoints after expansion, kv_events.connect has 1",
            ),
            ("max_batch_bytes = 10", "kv_events.max_batch_bytes: must be between 1024"),
        ];
        for (body, want) in cases {
            let e = parse(&format!("[kv_events]\n{body}"), 2).unwrap_err().to_string();
            assert!(e.contains(want), "{e}\n lacks {want}");
        }
    }
}
