//! Unit tests of `table/mod.rs`.

use super::*;
use crate::engines::testing::settings;
use crate::engines::Sequence;

fn table(dp: u32) -> EngineTable {
    EngineTable::new(&settings(dp))
}

fn upd(rank: i128, boot: u64, seq: u64, counts: [u64; 5]) -> LoadReport {
    LoadReport::new(rank, boot, seq).counts(counts)
}

fn ms(t0: Instant, ms: u64) -> Instant {
    t0 + Duration::from_millis(ms)
}

#[test]
fn first_update_brings_a_rank_up_and_bumps_epoch() {
    let mut t = table(4);
    let t0 = Instant::now();
    assert!(!t.is_routable(0));
    assert_eq!(
        t.apply(&upd(0, 1, 1, [0; 5]), t0),
        Ok(Accepted { rank: 0, restarted: false, received: Some(0), missed: 0 })
    );
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
            Err(Reject::UnknownRank { .. }) => "unknown",
            Err(Reject::OldBoot { .. } | Reject::OldSeq { .. }) => "stale",
            Err(Reject::Backwards { .. }) => "malformed",
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
    assert_eq!((e.boot, e.seq, e.counts.to_array(), e.finished_before, e.failed_before), (6, 1, [0, 0, 1, 0, 0], 7, 2));
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
    // Up -> stale is no change of routability; each flip counts once.
    assert_eq!(t.get(0).changes, RoutableChanges { joined: 1, lost: 1, readmitted: 1 });
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
    // The epoch moved once; the counters see all three ranks go.
    for r in 0..3 {
        assert_eq!(t.get(r).changes, RoutableChanges { joined: 1, lost: 1, readmitted: 0 });
    }
}

#[test]
fn a_down_rank_accepts_a_lower_boot_as_a_restart() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 500, 7, [0, 0, 9, 9, 0]), t0).unwrap();
    // While up, a lower boot is a stale incarnation.
    assert!(matches!(t.apply(&upd(0, 400, 1, [0; 5]), t0), Err(Reject::OldBoot { boot: 400, current: 500 })));
    t.tick(ms(t0, 3000));
    assert_eq!(t.get(0).status, Status::Down);
    // Down: the engine came back with a clock that stepped back.
    let a = t.apply(&upd(0, 400, 1, [0, 0, 1, 0, 0]), ms(t0, 3100)).unwrap();
    assert!(a.restarted);
    t.apply(&upd(0, 400, 2, [0, 0, 1, 0, 0]), ms(t0, 3200)).unwrap();
    let e = t.get(0);
    assert_eq!((e.status, e.boot, e.counts.to_array(), e.finished_before), (Status::Up, 400, [0, 0, 1, 0, 0], 9));
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
        t.apply(&upd(rank, 1, 1, [0; 5]).ttft_ms(ttft), t0).unwrap();
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
    let mut health = t.health_handle();
    health.record(0, false, t0);
    health.record(0, false, t0);
    health.record(0, true, t0);
    health.record(7, false, t0); // out of range: ignored
    t.tick(t0);
    assert_eq!(t.get(0).penalty, 2.0);
    t.tick(ms(t0, 5000));
    assert!((t.get(0).penalty - 1.0).abs() < 1e-9, "{}", t.get(0).penalty);
    assert_eq!(t.get(1).penalty, 0.0);
}

#[test]
fn reject_messages_name_the_rule() {
    let mut t = table(2);
    let t0 = Instant::now();
    t.apply(&upd(0, 5, 10, [0, 0, 10, 5, 1]), t0).unwrap();
    let msg = |u: LoadReport, t: &mut EngineTable| t.apply(&u, t0).unwrap_err().to_string();
    assert_eq!(msg(upd(2, 5, 11, [0; 5]), &mut t), "rank 2 is outside 0..2");
    assert_eq!(msg(upd(0, 4, 11, [0; 5]), &mut t), "boot 4 is older than the current boot 5");
    assert_eq!(msg(upd(0, 5, 10, [0; 5]), &mut t), "seq 10 is not above the last accepted seq 10");
    assert_eq!(
        msg(upd(0, 5, 11, [0, 0, 10, 4, 1]), &mut t),
        "counter `finished` went backwards within boot 5 (5 -> 4)"
    );
}

#[test]
fn resize_grows_unknown_ranks_shrinks_and_moves_the_epoch_once_each() {
    let mut t = table(2);
    let t0 = Instant::now();
    t.apply(&upd(1, 1, 1, [0; 5]), t0).unwrap();
    assert_eq!(t.epoch(), 1);
    t.resize(4);
    assert_eq!((t.dp_size(), t.get(3).status, t.epoch()), (4, Status::Unknown, 2));
    t.apply(&upd(3, 1, 1, [0; 5]), t0).unwrap();
    assert_eq!(t.epoch(), 3);
    t.resize(2);
    assert_eq!((t.dp_size(), t.epoch()), (2, 4));
    assert!(matches!(t.apply(&upd(3, 1, 2, [0; 5]), t0), Err(Reject::UnknownRank { rank: 3, dp_size: 2 })));
    // The same size is no change.
    t.resize(2);
    assert_eq!(t.epoch(), 4);
}

#[test]
fn reloaded_liveness_applies_from_the_next_tick() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 1, 1, [0; 5]), t0).unwrap();
    let mut s = settings(1);
    s.engines.stale_after = Duration::from_millis(200);
    s.engines.down_after = Duration::from_millis(400);
    t.reload(&s);
    t.tick(ms(t0, 250));
    assert_eq!(t.get(0).status, Status::Stale);
    t.tick(ms(t0, 400));
    assert_eq!(t.get(0).status, Status::Down);
}

/// A gauge-only report numbered by a restarting stream, with a heartbeat.
fn stream(rank: i128, seq: u64, running: u64) -> LoadReport {
    LoadReport {
        sequence: Sequence::Restarting { seq },
        cumulative: false,
        heartbeat: Duration::from_secs(1),
        ..LoadReport::new(rank, 0, 0).counts([0, running, 0, 0, 0])
    }
}

#[test]
fn a_restarting_stream_counts_gaps_and_takes_a_lower_seq_as_a_restart() {
    let mut t = table(1);
    let t0 = Instant::now();
    assert_eq!(t.apply(&stream(0, 0, 1), t0).map(|a| (a.restarted, a.received)), Ok((false, None)));
    assert_eq!(t.apply(&stream(0, 4, 2), t0).map(|a| a.missed), Ok(3));
    assert_eq!((t.get(0).boot, t.get(0).counts.running), (1, 2));
    // The publisher restarted: its seq starts at 0 again; dpcoord numbers the incarnation.
    let a = t.apply(&stream(0, 0, 5), t0).unwrap();
    assert_eq!((a.restarted, t.get(0).boot, t.get(0).seq), (true, 2, 0));
}

#[test]
fn liveness_allows_two_and_a_half_heartbeats_of_silence() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&stream(0, 0, 0), t0).unwrap();
    // stale_after 1000 ms and down_after 3000 ms, but the source re-sends
    // an unchanged report only every second: stale at 2.5 s, down at 4.5 s.
    t.tick(ms(t0, 2499));
    assert_eq!(t.get(0).status, Status::Up);
    t.tick(ms(t0, 2500));
    assert_eq!(t.get(0).status, Status::Stale);
    t.tick(ms(t0, 4499));
    assert_eq!(t.get(0).status, Status::Stale);
    t.tick(ms(t0, 4500));
    assert_eq!(t.get(0).status, Status::Down);
}

/// A rank that keeps reporting work and no progress for `stall_after` is
/// `stalled`, not routable; an idle rank never is; progress brings it back
/// after `readmit_updates` updates in a row that show it.
#[test]
fn work_without_progress_stalls_a_rank_and_progress_readmits_it() {
    let mut s = settings(2);
    s.engines.stall_after = Duration::from_millis(500);
    s.engines.stale_after = Duration::from_secs(60);
    s.engines.down_after = Duration::from_secs(120);
    let mut t = EngineTable::new(&s);
    let t0 = Instant::now();
    let busy = |seq, p| upd(0, 1, seq, [0, 2, 2, 0, 0]).progress(p);
    let idle = |seq| upd(1, 1, seq, [0, 0, 0, 0, 0]).progress(7);
    for (seq, at) in [(1, 0), (2, 250), (3, 499)] {
        t.apply(&busy(seq, 40), ms(t0, at)).unwrap();
        t.apply(&idle(seq), ms(t0, at)).unwrap();
        t.tick(ms(t0, at));
    }
    assert_eq!((t.get(0).status, t.get(1).status), (Status::Up, Status::Up), "499 ms without progress");
    let epoch = t.epoch();
    t.apply(&busy(4, 40), ms(t0, 500)).unwrap();
    t.apply(&idle(4), ms(t0, 500)).unwrap();
    t.tick(ms(t0, 500));
    assert_eq!(
        (t.get(0).status, t.get(0).stall, t.get(0).stalls),
        (Status::Stalled, Some(StallCause::Progress), [1, 0])
    );
    assert_eq!((t.get(1).status, t.epoch()), (Status::Up, epoch + 1), "idle never stalls");
    assert!(!t.is_routable(0));
    // Still reporting, still stuck; then progress, twice in a row.
    t.apply(&busy(5, 40), ms(t0, 600)).unwrap();
    t.apply(&busy(6, 41), ms(t0, 700)).unwrap();
    assert_eq!(t.get(0).status, Status::Stalled, "one update with progress is not enough");
    t.apply(&busy(7, 41), ms(t0, 800)).unwrap();
    t.apply(&busy(8, 42), ms(t0, 900)).unwrap();
    assert_eq!(t.get(0).status, Status::Stalled, "the streak starts over without progress");
    t.apply(&busy(9, 43), ms(t0, 1000)).unwrap();
    assert_eq!((t.get(0).status, t.get(0).stall, t.get(0).changes.readmitted), (Status::Up, None, 1));
    assert_eq!(t.epoch(), epoch + 2);
}

#[test]
fn progress_going_backwards_is_refused_and_changes_nothing() {
    let mut t = table(1);
    let t0 = Instant::now();
    t.apply(&upd(0, 1, 1, [0, 1, 1, 0, 0]).progress(10), t0).unwrap();
    let before = format!("{:?}", t.get(0));
    let r = t.apply(&upd(0, 1, 2, [0, 1, 1, 0, 0]).progress(9), t0);
    assert_eq!(r, Err(Reject::Backwards { counter: "progress", boot: 1, from: 10, to: 9 }));
    assert_eq!(format!("{:?}", t.get(0)), before);
    t.apply(&upd(0, 2, 1, [0, 1, 1, 0, 0]).progress(0), t0).expect("a new boot starts over");
}

/// `probe_failures` failed probes in a row stall a rank; a success clears it.
#[test]
fn failed_probes_in_a_row_stall_a_rank_until_one_succeeds() {
    let mut t = table(2);
    let t0 = Instant::now();
    t.apply(&upd(0, 1, 1, [0; 5]), t0).unwrap();
    let epoch = t.epoch();
    let mut h = t.health_handle();
    h.record(0, false, t0);
    h.record(0, false, t0);
    h.record(0, true, t0);
    h.record(0, false, t0);
    h.record(0, false, t0);
    assert_eq!(t.get(0).status, Status::Up, "two in a row, then a success, then two");
    t.health_handle().record(0, false, t0);
    assert_eq!((t.get(0).status, t.get(0).stall, t.get(0).stalls), (Status::Stalled, Some(StallCause::Probe), [0, 1]));
    assert_eq!(t.epoch(), epoch + 1);
    t.apply(&upd(0, 1, 2, [0; 5]), t0).unwrap();
    assert_eq!(t.get(0).status, Status::Stalled, "reports do not clear a probe stall");
    t.health_handle().record(0, true, t0);
    assert_eq!((t.get(0).status, t.get(0).stall, t.epoch()), (Status::Up, None, epoch + 2));
    t.health_handle().record(1, false, t0);
    t.health_handle().record(1, false, t0);
    t.health_handle().record(1, false, t0);
    assert_eq!(t.get(1).status, Status::Unknown, "a rank that is not routable is not stalled");
}
