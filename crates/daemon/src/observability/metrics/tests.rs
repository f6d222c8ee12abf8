//! Unit tests of `metrics/mod.rs`: the metrics contract and the handles.

use prometheus::proto::MetricType;

use super::*;

/// The contract's Metrics table: name, type, label names.
const CONTRACT: [(&str, MetricType, &[&str]); 22] = [
    ("dpcoord_routed_total", MetricType::COUNTER, &["class", "dp_rank"]),
    ("dpcoord_route_errors_total", MetricType::COUNTER, &["code"]),
    ("dpcoord_route_duration_seconds", MetricType::HISTOGRAM, &["channel"]),
    ("dpcoord_engine_requests", MetricType::GAUGE, &["dp_rank", "state"]),
    ("dpcoord_engine_finished_total", MetricType::COUNTER, &["dp_rank"]),
    ("dpcoord_engine_failed_total", MetricType::COUNTER, &["dp_rank"]),
    ("dpcoord_engine_up", MetricType::GAUGE, &["dp_rank"]),
    ("dpcoord_engine_penalty", MetricType::GAUGE, &["dp_rank"]),
    ("dpcoord_engine_stats_age_seconds", MetricType::GAUGE, &["dp_rank"]),
    ("dpcoord_user_dispatch_stddev", MetricType::GAUGE, &[]),
    ("dpcoord_stats_messages_total", MetricType::COUNTER, &["result"]),
    ("dpcoord_tick_duration_seconds", MetricType::HISTOGRAM, &[]),
    ("dpcoord_epoch", MetricType::GAUGE, &[]),
    // Beyond the contract's table:
    ("dpcoord_stats_missed_total", MetricType::COUNTER, &[]),
    ("dpcoord_access_denied_total", MetricType::COUNTER, &["socket"]),
    ("dpcoord_config_reloads_total", MetricType::COUNTER, &["result"]),
    ("dpcoord_dp_size", MetricType::GAUGE, &[]),
    ("dpcoord_scrapes_total", MetricType::COUNTER, &["result"]),
    ("dpcoord_engine_routable_changes_total", MetricType::COUNTER, &["change", "dp_rank"]),
    ("dpcoord_rank_stalls_total", MetricType::COUNTER, &["cause", "dp_rank"]),
    ("dpcoord_engine_stalled", MetricType::GAUGE, &["dp_rank"]),
    ("dpcoord_engine_kv_usage", MetricType::GAUGE, &["dp_rank"]),
];

#[test]
fn every_contract_metric_exists_with_its_type_labels_and_series() {
    let m = Metrics::new(3);
    let families = m.registry.gather();
    assert_eq!(families.len(), CONTRACT.len());
    for (name, kind, labels) in CONTRACT {
        let f = families.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(f.get_field_type(), kind, "{name}");
        for series in f.get_metric() {
            let got: Vec<&str> = series.get_label().iter().map(|l| l.name()).collect();
            assert_eq!(got, labels, "{name}");
        }
    }
    // Every series exists from the start, so rates never see a gap.
    let count = |name: &str| families.iter().find(|f| f.name() == name).map_or(0, |f| f.get_metric().len());
    assert_eq!(count("dpcoord_routed_total"), 3 * 2);
    assert_eq!(count("dpcoord_engine_requests"), 3 * 3);
    assert_eq!(count("dpcoord_engine_routable_changes_total"), 3 * 3);
    assert_eq!(count("dpcoord_route_errors_total"), ErrorCode::ALL.len());
    assert_eq!(count("dpcoord_stats_messages_total"), StatsResult::ALL.len());
    assert_eq!(count("dpcoord_route_duration_seconds"), 2);
    assert_eq!(count("dpcoord_scrapes_total"), ScrapeResult::ALL.len());
}

#[test]
fn resize_adds_and_removes_every_series_of_a_rank() {
    let mut m = Metrics::new(2);
    let series = |m: &Metrics, name: &str| {
        let families = m.registry.gather();
        families.iter().find(|f| f.name() == name).map_or(0, |f| f.get_metric().len())
    };
    m.ranks[1].routed_user.inc();
    m.resize(4);
    assert_eq!((series(&m, "dpcoord_routed_total"), series(&m, "dpcoord_engine_requests")), (8, 12));
    assert_eq!(series(&m, "dpcoord_engine_kv_usage"), 4);
    m.resize(1);
    assert_eq!((series(&m, "dpcoord_routed_total"), series(&m, "dpcoord_engine_up")), (2, 1));
    assert_eq!(series(&m, "dpcoord_engine_kv_usage"), 1);
    assert_eq!(series(&m, "dpcoord_engine_routable_changes_total"), 3);
    // A rank that comes back starts over: no usage until it reports one.
    m.ranks[0].kv_usage.set(0.5);
    m.resize(2);
    assert_eq!(m.ranks[1].routed_user.get(), 0);
    assert_eq!(m.ranks[0].kv_usage.get(), 0.5);
    assert!(m.ranks[1].kv_usage.get().is_nan());
}

#[test]
fn error_and_stats_handles_count_under_their_own_label() {
    let m = Metrics::new(1);
    m.error(ErrorCode::TooLarge);
    m.stats(StatsResult::Stale);
    m.stats(StatsResult::Stale);
    m.scrapes.clone().count(ScrapeResult::Timeout);
    let families = m.registry.gather();
    let value = |name: &str, label: &str| {
        let f = families.iter().find(|f| f.name() == name).unwrap();
        let s = f.get_metric().iter().find(|s| s.get_label()[0].value() == label).unwrap();
        s.get_counter().get_value()
    };
    assert_eq!(value("dpcoord_route_errors_total", "too_large"), 1.0);
    assert_eq!(value("dpcoord_route_errors_total", "bad_request"), 0.0);
    assert_eq!(value("dpcoord_stats_messages_total", "stale"), 2.0);
    assert_eq!(value("dpcoord_stats_messages_total", "ok"), 0.0);
    assert_eq!(value("dpcoord_scrapes_total", "timeout"), 1.0);
    assert_eq!(value("dpcoord_scrapes_total", "ok"), 0.0);
}
