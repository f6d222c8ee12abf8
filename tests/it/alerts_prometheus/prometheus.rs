//! The Prometheus server the test runs, and plain HTTP to it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Labels;
use crate::common::*;

/// GET over HTTP/1.0 (so the body is never chunked); (status, body).
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split(' ').nth(1)?.parse().ok()?;
    Some((status, raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

pub(crate) fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server on loopback with its config, rules, target list and
/// storage in a private directory; killed when dropped (its log is printed
/// if the test is failing).
pub(crate) struct Prometheus {
    addr: SocketAddr,
    dir: tempfile::TempDir,
    child: Option<Spawned>,
}

impl Prometheus {
    pub(crate) fn start(rules: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let p = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(p("dpcoord.rules.yml"), rules).unwrap();
        std::fs::write(p("targets.json"), "[]").unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n  - job_name: dpcoord\n    file_sd_configs:\n      - files: [\"{}\"]\n        refresh_interval: 1s\n",
            p("dpcoord.rules.yml"),
            p("targets.json"),
        );
        std::fs::write(p("prometheus.yml"), config).unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = std::fs::File::create(p("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", p("prometheus.yml")))
            .arg(format!("--storage.tsdb.path={}", p("data")))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `prometheus` ({e}): this test needs the real server, from Debian's \
                     `prometheus` package (apt-get install prometheus; .ci/run installs it)"
                )
            });
        let prom = Prometheus { addr, dir, child: Some(Spawned::from(child)) };
        let start = Instant::now();
        while get(addr, "/-/ready").map(|(s, _)| s) != Some(200) {
            assert!(start.elapsed() < Duration::from_secs(30), "prometheus did not become ready in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        prom
    }

    /// The `data` of a successful API answer.
    pub(crate) fn api(&self, path: &str) -> Value {
        let (status, body) = get(self.addr, path).unwrap_or_else(|| panic!("prometheus did not answer {path}"));
        assert_eq!(status, 200, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{path}: {body}");
        v["data"].clone()
    }

    /// An instant query's result vector.
    pub(crate) fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api(&format!("/api/v1/query?query={}", urlencode(expr)));
        assert_eq!(data["resultType"], "vector", "{expr}");
        data["result"].as_array().unwrap().clone()
    }

    /// Every pending or firing alert: (labels, state).
    pub(crate) fn alerts(&self) -> Vec<(Labels, String)> {
        let data = self.api("/api/v1/alerts");
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (serde_json::from_value(a["labels"].clone()).unwrap(), a["state"].as_str().unwrap().to_owned()))
            .collect()
    }

    /// Replaces the discovered targets (written whole, then renamed).
    pub(crate) fn set_targets(&self, targets: &BTreeMap<&str, SocketAddr>) {
        let list: Vec<Value> = targets
            .iter()
            .map(|(name, addr)| json!({"targets": [addr.to_string()], "labels": {"scenario": name}}))
            .collect();
        let tmp = self.dir.path().join("targets.json.tmp");
        std::fs::write(&tmp, serde_json::to_string(&list).unwrap()).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("targets.json")).unwrap();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        drop(self.child.take());
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default();
            eprintln!("--- prometheus log ---\n{log}");
        }
    }
}
