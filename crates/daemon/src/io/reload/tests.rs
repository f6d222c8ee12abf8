//! The reload state machine with a read that blocks until the test lets it
//! go: time is an input, so the deadline is crossed without waiting for it.

use std::sync::mpsc;

use super::*;
use crate::engines::testing::settings;
use crate::observability::metrics::Metrics;
use crate::wire::OwnedId;

fn waiter(id: i64) -> Option<Waiter> {
    Some(Waiter { envelope: vec![vec![id as u8]], id: Some(OwnedId::Int(id)) })
}

/// The replies sent: `(id, Ok(dp_size) or Err(message))`.
type Sent = Vec<(i64, Result<u32, String>)>;

fn recorder(sent: &mut Sent) -> impl FnMut(&Coordinator, Waiter, &Result<(), WireError>) + '_ {
    move |coord, w, outcome| {
        let id = match w.id {
            Some(OwnedId::Int(i)) => i,
            other => panic!("unexpected id {other:?}"),
        };
        assert_eq!(w.envelope, vec![vec![id as u8]]);
        let out = match outcome {
            Ok(()) => Ok(coord.state_view(Instant::now()).ranks.len() as u32),
            Err(e) => Err(e.message.clone()),
        };
        sent.push((id, out));
    }
}

fn reloads_counted(coord: &Coordinator, result: &str) -> u64 {
    let families = coord.metrics().registry.gather();
    let family = families.iter().find(|f| f.name() == "dpcoord_config_reloads_total").unwrap();
    let m = family.get_metric().iter().find(|m| m.get_label()[0].value() == result).unwrap();
    m.get_counter().get_value() as u64
}

/// Polls until the reader has handed its result back (a deadline, not a sleep-and-hope).
fn until_idle(r: &mut Reloads, coord: &mut Coordinator, now: Instant, answer: &mut Answer<'_>) {
    let start = Instant::now();
    while !matches!(r.state, State::Idle) || r.next.is_some() {
        assert!(start.elapsed() < Duration::from_secs(10), "the read never came back");
        r.poll(coord, now, answer);
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_read_past_its_deadline_is_refused_and_its_late_result_dropped() {
    let t0 = Instant::now();
    let (gate, wait) = mpsc::channel::<()>();
    let source = ConfigSource::new("/etc/dpcoord.toml", move || {
        let _ = wait.recv();
        Config::from_table(Config::parse_toml("[engines]\ndp_size = 3\n")?)
    });
    let mut r = Reloads::start(source).unwrap();
    let mut coord = Coordinator::new(&settings(2), Metrics::new(2), t0).with_server(Config::default().server);
    let mut sent = Sent::new();
    let mut answer = recorder(&mut sent);
    r.ask(waiter(1), &mut coord, t0, &mut answer);
    r.ask(waiter(2), &mut coord, t0, &mut answer);
    r.ask(None, &mut coord, t0, &mut answer);
    assert_eq!(r.next_due(), Some(t0 + READ_DEADLINE));
    r.poll(&mut coord, t0 + Duration::from_millis(1999), &mut answer);
    r.poll(&mut coord, t0 + READ_DEADLINE, &mut answer);
    // Stuck: refused at once, no second read (the reader is busy).
    r.ask(waiter(3), &mut coord, t0 + READ_DEADLINE, &mut answer);
    assert_eq!(r.next_due(), None);
    gate.send(()).unwrap();
    until_idle(&mut r, &mut coord, t0 + READ_DEADLINE, &mut answer);
    // The late result was dropped: still two ranks. A new read applies.
    drop(gate);
    r.ask(waiter(4), &mut coord, t0 + READ_DEADLINE, &mut answer);
    until_idle(&mut r, &mut coord, t0 + READ_DEADLINE, &mut answer);
    drop(answer);
    let late = "config: reading /etc/dpcoord.toml took longer than 2 s; nothing changed".to_owned();
    let stuck = "config: an earlier read of /etc/dpcoord.toml has not finished; nothing changed".to_owned();
    assert_eq!(sent, vec![(1, Err(late.clone())), (2, Err(late)), (3, Err(stuck)), (4, Ok(3))]);
    assert_eq!((reloads_counted(&coord, "invalid"), reloads_counted(&coord, "ok")), (2, 1));
}

#[test]
fn reloads_asked_during_a_read_share_one_read_after_it() {
    let t0 = Instant::now();
    let (gate, wait) = mpsc::channel::<()>();
    let reads = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = std::sync::Arc::clone(&reads);
    let source = ConfigSource::new("f", move || {
        let _ = wait.recv();
        let n = counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 3;
        Config::from_table(Config::parse_toml(&format!("[engines]\ndp_size = {n}\n"))?)
    });
    let mut r = Reloads::start(source).unwrap();
    let mut coord = Coordinator::new(&settings(2), Metrics::new(2), t0).with_server(Config::default().server);
    let mut sent = Sent::new();
    let mut answer = recorder(&mut sent);
    r.ask(waiter(1), &mut coord, t0, &mut answer);
    for id in 2..2 + MAX_WAITING as i64 + 1 {
        r.ask(waiter(id), &mut coord, t0, &mut answer);
    }
    r.ask(None, &mut coord, t0, &mut answer);
    drop(gate);
    until_idle(&mut r, &mut coord, t0, &mut answer);
    drop(answer);
    // The first read for op 1 (3 ranks), one more for the 64 ops asked
    // during it (4 ranks); the 65th was refused at once.
    assert_eq!(reads.load(std::sync::atomic::Ordering::Relaxed), 2);
    let full = Err("config: 64 reloads wait already; nothing changed".to_owned());
    let mut expected: Sent = vec![(2 + MAX_WAITING as i64, full), (1, Ok(3))];
    expected.extend((2..2 + MAX_WAITING as i64).map(|id| (id, Ok(4))));
    assert_eq!(sent, expected);
    assert_eq!((reloads_counted(&coord, "invalid"), reloads_counted(&coord, "ok")), (1, 2));
}

#[test]
fn without_a_file_a_reload_is_refused_at_once() {
    let t0 = Instant::now();
    let mut r = Reloads::start(ConfigSource::none()).unwrap();
    let mut coord = Coordinator::new(&settings(2), Metrics::new(2), t0).with_server(Config::default().server);
    let mut sent = Sent::new();
    r.ask(waiter(1), &mut coord, t0, &mut recorder(&mut sent));
    let why = "config: dpcoord was started without --config: there is no file to re-read; nothing changed";
    assert_eq!(sent, vec![(1, Err(why.to_owned()))]);
    assert_eq!(r.bell_fd(), None);
}
