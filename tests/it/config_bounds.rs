//! `engines.dp_size` (at most 1,024) and its product with `limits.max_batch`
//! (at most `MAX_QUERY_WORK` = 262,144 rank weighings per query) are bounded:
//! `check-config` and the daemon exit 2 naming the key, a `resize` past them
//! is refused and changes nothing.

use crate::common::*;
use serde_json::json;

const TOO_MANY_RANKS: &str = "engines.dp_size: must be between 1 and 1024, got 1025";
const TOO_MUCH_WORK: &str = "limits.max_batch: engines.dp_size = 512 with limits.max_batch = 1024 is 524288 \
     rank weighings per query, above 262144; with this dp_size, max_batch may be at most 512";

#[test]
fn check_config_and_the_daemon_refuse_too_many_ranks_or_too_much_work_per_query() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let many = file("many.toml", "[engines]\ndp_size = 1025\n");
    let work = file("work.toml", "[engines]\ndp_size = 512\n");
    let edge = file("edge.toml", "[engines]\ndp_size = 1024\n[limits]\nmax_batch = 256\n");
    let over = file("over.toml", "[engines]\ndp_size = 1024\n[limits]\nmax_batch = 257\n");
    let over_why = "limits.max_batch: engines.dp_size = 1024 with limits.max_batch = 257 is 263168 \
         rank weighings per query, above 262144; with this dp_size, max_batch may be at most 256";
    let low = file("low.toml", "[engines]\nmax_dp_size = 4\n");
    let low_why = "engines.max_dp_size: must be 0 or at least engines.dp_size (8), got 4";
    for (path, why) in [(&many, TOO_MANY_RANKS), (&work, TOO_MUCH_WORK), (&over, over_why), (&low, low_why)] {
        let (code, err) = run_to_end(&["check-config", path]);
        assert_eq!((code, err.trim_end()), (Some(2), format!("dpcoord: error: {why}").as_str()), "{path}");
        // The daemon refuses it the same way, before binding anything.
        let (code, err) = run_to_end(&["--config", path, "--metrics-bind", &free_addr().to_string()]);
        assert_eq!((code, err.trim_end()), (Some(2), format!("dpcoord: error: {why}").as_str()), "{path}");
    }
    // The flags are checked the same way.
    let (code, err) = run_to_end(&["--dp-size", "512", "--metrics-bind", &free_addr().to_string()]);
    assert_eq!((code, err.trim_end()), (Some(2), format!("dpcoord: error: {TOO_MUCH_WORK}").as_str()));
    let (code, err) = run_to_end(&["check-config", &edge]);
    assert_eq!((code, err), (Some(0), String::new()));
}

#[test]
fn resize_past_the_bounds_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ceiling.toml");
    std::fs::write(&config, "[engines]\nmax_dp_size = 1024\n").unwrap();
    let d = Daemon::frozen("8", &["--config", config.to_str().unwrap()]);
    d.bring_up(&d.publisher(), &[0, 1]);
    let health = d.health_client();
    let before = d.books();
    let cases = [
        (1025, "`dp_size` must be between 1 and 1024, got 1025"),
        (
            257,
            "`dp_size`: engines.dp_size = 257 with limits.max_batch = 1024 is 263168 rank weighings per query, \
             above 262144; with this dp_size, max_batch may be at most 1020",
        ),
    ];
    for (dp, why) in cases {
        let r = health.call(json!({"v": 1, "op": "resize", "dp_size": dp, "id": 7}));
        assert_eq!(
            (r["ok"].clone(), r["error"].clone(), r["id"].clone()),
            (json!(false), json!({"code": "bad_request", "message": why}), json!(7)),
            "{r}"
        );
        assert_eq!(d.books(), before);
        assert_eq!(d.metric("dpcoord_dp_size"), Some(8.0));
    }
    // The largest within the bound is taken.
    let r = health.call(json!({"v": 1, "op": "resize", "dp_size": 256}));
    assert_eq!((r["ok"].clone(), r["dp_size"].clone()), (json!(true), json!(256)), "{r}");
}

/// Without `engines.max_dp_size`, the sockets' reply queues are sized for
/// the starting `dp_size`: a resize may shrink and grow back to it, not
/// past it; a reload whose file asks for more is refused the same way.
#[test]
fn resize_and_reload_stop_at_the_starting_size_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("dpcoord.toml");
    std::fs::write(&config, "[engines]\ndp_size = 8\n").unwrap();
    // No --dp-size flag: a flag would win over the file at every reload.
    let mut args = vec!["--config", config.to_str().unwrap()];
    args.extend_from_slice(&FROZEN);
    let d = Daemon::start(&args);
    let health = d.health_client();
    let resize = |dp: u32| health.call(json!({"v": 1, "op": "resize", "dp_size": dp}));
    assert_eq!(resize(4)["dp_size"], json!(4));
    assert_eq!(resize(8)["dp_size"], json!(8));
    let r = resize(9);
    assert_eq!(
        (r["ok"].clone(), r["error"].clone()),
        (
            json!(false),
            json!({"code": "bad_request", "message": "`dp_size` 9 is above engines.max_dp_size = 8: the reply \
                queues are sized for it at start; raise it and restart to grow further"})
        ),
        "{r}"
    );
    assert_eq!(d.metric("dpcoord_dp_size"), Some(8.0));
    std::fs::write(&config, "[engines]\ndp_size = 12\n").unwrap();
    let r = health.call(json!({"v": 1, "op": "reload"}));
    assert_eq!(
        (r["ok"].clone(), r["error"].clone()),
        (
            json!(false),
            json!({"code": "invalid_config", "message": "engines.dp_size 12 is above engines.max_dp_size = 8, \
                which the reply queues are sized for at start: cannot change without a restart; nothing changed"})
        ),
        "{r}"
    );
    std::fs::write(&config, "[engines]\ndp_size = 8\n[limits]\nmax_batch = 2048\n").unwrap();
    let r = health.call(json!({"v": 1, "op": "reload"}));
    assert_eq!(
        r["error"]["message"],
        json!(
            "limits.max_batch 2048 is above 1024, which the reply queues are sized for at start: cannot change \
            without a restart; nothing changed"
        ),
        "{r}"
    );
    assert_eq!(d.metric("dpcoord_dp_size"), Some(8.0));
}
