//! Unit tests of `engine.rs`.

use super::*;

fn table(dp: u32) -> EngineTable {
    let mut c = Config::default();
    c.settings.engines.dp_size = dp;
    EngineTable::new(&c)
}

fn upd(rank: i128, boot: u64, seq: u64, counts: [u64; 5]) -> StatsUpdate {
    StatsUpdate { rank, boot, seq, counts, tokens: None, kv_usage: None, ttft_ms: None, tpot_ms: None }
}

fn ms(t0: Instant, ms: u64) -> Instant {
    t0 + Duration::from_millis(ms)
}

#[test]
fn first_update_brings_a_rank_up_and_bumps_epoch() {
    let mut t = table(4);
    let t0 = Instant::now();
    assert!(!t.is_routable(0));
    assert_eq!(t.apply(&upd(0, 1, 1, [0; 5]), t0), Ok(Accepted { rank: 0, restarted: false, received: 0, missed: 0 }));
    assert_eq!(t.apply(&upd(0, 1, 5, [0; 5]), t0).map(|a| a.missed), Ok(3));
    assert_eq!((t.get(0).status, t.epoch()), (Status::Up, 1));
    t.apply(&upd(1, 1, 1, [0; 5]), t0).unwrap();
    t.apply(&upd(1, 1, 2, [0; 5]), t0).unwrap();
    assert_eq!(t.epoch(), 2);
}

#[test]
fn rejects_leave_state_unchanged() {
    let mut t = table(2);
    let t0 = Instant::now();
    t.apply(&upd(0, 5, 10, [1, 1, 10, 5, 1]), t0).unwrap();
    let before = format!("{:?}", t.get(0));
    let cases = [
        (upd(2, 5, 11, [0; 5]), "unknown"),
        (upd(-1, 5, 11, [0; 5]), "unknown"),
        (upd(0, 4, 99, [0; 5]), "stale"),
        (upd(0, 5, 10, [0, 0, 10, 5, 1]), "stale"),
        (upd(0, 5, 11, [0, 0, 9, 5, 1]), "malformed"),
        (upd(0, 5, 11, [0, 0, 10, 4, 1]), "malformed"),
        (upd(0, 5, 11, [0, 0, 10, 5, 0]), "malformed"),
    ];
    for (u, want) in cases {
        let got = match t.apply(&u, ms(t0, 10)) {
            Err(StatsReject::UnknownRank(_)) => "unknown",
            Err(StatsReject::Stale(_)) => "stale",
            Err(StatsReject::Malformed(_)) => "malformed",
            Ok(_) => "accepted",
        };
        assert_eq!(got, want, "{u:?}");
        assert_eq!(format!("{:?}", t.get(0)), before);
    }
    // Gauges may go down within a boot.
    assert!(t.apply(&upd(0, 5, 11, [0, 0, 10, 5, 1]), t0).is_ok());
}

#[test]
fn restart_resets_counters_and_keeps_totals() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 5, 10, [0, 0, 10, 7, 2]), t0).unwrap();
    let a = t.apply(&upd(0, 6, 1, [0, 0, 1, 0, 0]), t0).unwrap();
    assert!(a.restarted);
    let e = t.get(0);
    assert_eq!((e.boot, e.seq, e.counts, e.finished_before, e.failed_before), (6, 1, [0, 0, 1, 0, 0], 7, 2));
}

#[test]
fn liveness_up_stale_down_and_readmission() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 1, 1, [0; 5]), t0).unwrap();
    t.tick(ms(t0, 999));
    assert_eq!(t.get(0).status, Status::Up);
    t.tick(ms(t0, 1000));
    assert_eq!((t.get(0).status, t.epoch()), (Status::Stale, 1));
    assert_eq!(t.get(0).penalty, 1.0);
    t.tick(ms(t0, 3000));
    assert_eq!((t.get(0).status, t.epoch()), (Status::Down, 2));
    // One update is not enough; a gap above stale_after restarts the count.
    t.apply(&upd(0, 1, 2, [0; 5]), ms(t0, 3100)).unwrap();
    assert_eq!(t.get(0).status, Status::Down);
    t.apply(&upd(0, 1, 3, [0; 5]), ms(t0, 4200)).unwrap();
    assert_eq!(t.get(0).status, Status::Down);
    t.apply(&upd(0, 1, 4, [0; 5]), ms(t0, 5200)).unwrap();
    assert_eq!((t.get(0).status, t.epoch()), (Status::Up, 3));
    assert_eq!(t.get(0).penalty, 0.0);
}

#[test]
fn ranks_going_down_on_one_tick_bump_the_epoch_once() {
    let mut t = table(3);
    let t0 = Instant::now();
    for r in 0..3 {
        t.apply(&upd(r, 1, 1, [0; 5]), t0).unwrap();
    }
    assert_eq!(t.epoch(), 3);
    t.tick(ms(t0, 3000));
    assert_eq!(t.epoch(), 4);
    assert!(!t.any_routable());
}

#[test]
fn a_down_rank_accepts_a_lower_boot_as_a_restart() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 500, 7, [0, 0, 9, 9, 0]), t0).unwrap();
    // While up, a lower boot is a stale incarnation.
    assert!(matches!(t.apply(&upd(0, 400, 1, [0; 5]), t0), Err(StatsReject::Stale(_))));
    t.tick(ms(t0, 3000));
    assert_eq!(t.get(0).status, Status::Down);
    // Down: the engine came back with a clock that stepped back.
    let a = t.apply(&upd(0, 400, 1, [0, 0, 1, 0, 0]), ms(t0, 3100)).unwrap();
    assert!(a.restarted);
    t.apply(&upd(0, 400, 2, [0, 0, 1, 0, 0]), ms(t0, 3200)).unwrap();
    let e = t.get(0);
    assert_eq!((e.status, e.boot, e.counts, e.finished_before), (Status::Up, 400, [0, 0, 1, 0, 0], 9));
}

#[test]
fn stale_rank_is_up_again_on_its_next_update() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 1, 1, [0; 5]), t0).unwrap();
    t.tick(ms(t0, 1500));
    t.apply(&upd(0, 1, 2, [0; 5]), ms(t0, 1600)).unwrap();
    assert_eq!((t.get(0).status, t.epoch()), (Status::Up, 1));
}

#[test]
fn ttft_far_above_the_median_is_penalized() {
    let mut t = table(3);
    let t0 = Instant::now();
    for (rank, ttft) in [(0, 100.0), (1, 100.0), (2, 400.0)] {
        t.apply(&StatsUpdate { ttft_ms: Some(ttft), ..upd(rank, 1, 1, [0; 5]) }, t0).unwrap();
    }
    t.tick(t0);
    let penalties: Vec<f64> = t.iter().map(|e| e.penalty).collect();
    assert_eq!(penalties, [0.0, 0.0, 3.0]);
}

#[test]
fn failed_health_reports_raise_penalty_which_decays() {
    let mut t = table(2);
    let t0 = Instant::now();
    t.apply(&upd(0, 1, 1, [0; 5]), t0).unwrap();
    t.record_health_report(0, false, t0);
    t.record_health_report(0, false, t0);
    t.record_health_report(0, true, t0);
    t.tick(t0);
    assert_eq!(t.get(0).penalty, 2.0);
    t.tick(ms(t0, 5000));
    assert!((t.get(0).penalty - 1.0).abs() < 1e-9, "{}", t.get(0).penalty);
    assert_eq!(t.get(1).penalty, 0.0);
}
