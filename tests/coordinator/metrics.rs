//! Issue 13, metrics: the real coordinator's and the real worker's Prometheus endpoints,
//! scraped over plain TCP and parsed strictly as text format 0.0.4, while real claims,
//! refusals, expiries and a real scripted run happen.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::work::{FLEET, git_init};
use crate::workers::Worker;

/// One sample: its name, labels and value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed scrape.
#[derive(Debug, Default)]
pub(crate) struct Exposition {
    /// Family name → its `# TYPE`.
    types: HashMap<String, String>,
    samples: Vec<Sample>,
}

fn valid_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    chars.next().is_some_and(ok_first)
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|_| format!("bad value '{s}'")),
    }
}

/// The labels in `{…}` (without the braces): `k="v"` pairs, values escaped with `\\`, `\"`,
/// `\n` only.
fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let eq = rest.find('=').ok_or(format!("label without '=': {rest}"))?;
        let key = &rest[..eq];
        if !valid_name(key, false) {
            return Err(format!("bad label name '{key}'"));
        }
        let after = &rest[eq + 1..];
        let mut chars = after.char_indices();
        if chars.next().map(|(_, c)| c) != Some('"') {
            return Err(format!("label value not quoted: {after}"));
        }
        let mut value = String::new();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next().map(|(_, c)| c) {
                    Some('\\') => value.push('\\'),
                    Some('"') => value.push('"'),
                    Some('n') => value.push('\n'),
                    other => return Err(format!("bad escape \\{other:?}")),
                },
                '"' => {
                    end = Some(i);
                    break;
                }
                '\n' => return Err("raw newline in a label value".into()),
                c => value.push(c),
            }
        }
        let end = end.ok_or("unterminated label value")?;
        if out.insert(key.to_string(), value).is_some() {
            return Err(format!("label '{key}' twice"));
        }
        rest = &after[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
            if rest.is_empty() {
                return Err("trailing comma in labels".into());
            }
        } else if !rest.is_empty() {
            return Err(format!("junk after a label value: {rest}"));
        }
    }
    Ok(out)
}

/// Parses `text` strictly: every line is `# HELP`, `# TYPE` or a sample of the family its
/// `# TYPE` declared just before; no series twice; histograms cumulative with `+Inf` equal to
/// `_count`.
fn parse(text: &str) -> Result<Exposition, String> {
    let mut e = Exposition::default();
    let mut current: Option<(String, String)> = None;
    let mut helped: Option<String> = None;
    let mut seen = std::collections::HashSet::new();
    if !text.is_empty() && !text.ends_with('\n') {
        return Err("the text does not end with a newline".into());
    }
    for (n, line) in text.lines().enumerate() {
        let bad = |why: String| format!("line {}: {why}: {line:?}", n + 1);
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            if !valid_name(name, true) || rest.len() <= name.len() {
                return Err(bad("bad HELP".into()));
            }
            helped = Some(name.to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let (Some(name), Some(kind), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad("bad TYPE".into()));
            };
            if !matches!(
                kind,
                "counter" | "gauge" | "histogram" | "summary" | "untyped"
            ) {
                return Err(bad(format!("unknown type {kind}")));
            }
            if helped.as_deref() != Some(name) {
                return Err(bad("TYPE without its HELP just before".into()));
            }
            if e.types.insert(name.into(), kind.into()).is_some() {
                return Err(bad("family declared twice".into()));
            }
            current = Some((name.into(), kind.into()));
        } else if line.starts_with('#') || line.is_empty() {
            return Err(bad("not HELP, TYPE or a sample".into()));
        } else {
            let (series, value) = line.rsplit_once(' ').ok_or(bad("no value".into()))?;
            let value = parse_value(value).map_err(bad)?;
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let inner = rest
                        .strip_suffix('}')
                        .ok_or(bad("unclosed labels".into()))?;
                    (name, parse_labels(inner).map_err(bad)?)
                }
                None => (series, BTreeMap::new()),
            };
            if !valid_name(name, true) {
                return Err(bad("bad metric name".into()));
            }
            let Some((family, kind)) = &current else {
                return Err(bad("sample before any TYPE".into()));
            };
            let belongs = match kind.as_str() {
                "histogram" => [
                    format!("{family}_bucket"),
                    format!("{family}_sum"),
                    format!("{family}_count"),
                ]
                .contains(&name.to_string()),
                _ => name == family,
            };
            if !belongs {
                return Err(bad(format!("sample outside its family {family}")));
            }
            if name.ends_with("_bucket") && !labels.contains_key("le") {
                return Err(bad("bucket without le".into()));
            }
            if !seen.insert(format!("{name}{labels:?}")) {
                return Err(bad("series twice".into()));
            }
            e.samples.push(Sample {
                name: name.into(),
                labels,
                value,
            });
        }
    }
    check_histograms(&e)?;
    Ok(e)
}

fn check_histograms(e: &Exposition) -> Result<(), String> {
    for (family, kind) in &e.types {
        if kind != "histogram" {
            continue;
        }
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for s in e
            .samples
            .iter()
            .filter(|s| s.name == format!("{family}_bucket"))
        {
            let mut key = s.labels.clone();
            let le = key.remove("le").unwrap_or_default();
            series
                .entry(format!("{key:?}"))
                .or_default()
                .push((parse_value(&le)?, s.value));
        }
        for (key, buckets) in series {
            if buckets
                .windows(2)
                .any(|w| w[0].0 >= w[1].0 || w[0].1 > w[1].1)
            {
                return Err(format!(
                    "{family}{key}: buckets not cumulative: {buckets:?}"
                ));
            }
            let inf = buckets.last().filter(|b| b.0.is_infinite()).map(|b| b.1);
            let count = e
                .samples
                .iter()
                .find(|s| {
                    s.name == format!("{family}_count") && { format!("{:?}", s.labels) == key }
                })
                .map(|s| s.value);
            if inf.is_none() || inf != count {
                return Err(format!("{family}{key}: +Inf {inf:?} != count {count:?}"));
            }
        }
    }
    Ok(())
}

impl Exposition {
    /// The value of the series `name{labels}` (exactly those labels).
    pub(crate) fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no {name}{labels:?} in the scrape"))
    }

    /// The sum over every series of `name` whose labels include `labels`.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }
}

/// One HTTP request, `raw`, on a fresh connection: the status code, the headers and the body.
fn http(addr: SocketAddr, raw: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    // A large request may be cut off by the server's answer: write from another thread.
    let mut w = s.try_clone().expect("clone");
    let raw = raw.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&raw);
    });
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let _ = writer.join();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, head.to_string(), body.to_string())
}

/// Scrapes `addr` and parses the answer strictly.
pub(crate) fn scrape(addr: SocketAddr) -> Exposition {
    let (status, head, body) = http(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    parse(&body).unwrap_or_else(|e| panic!("the scrape is not Prometheus text: {e}\n{body}"))
}

/// Scrapes until `ok` holds (10 s at most); the last scrape.
fn scrape_until(addr: SocketAddr, what: &str, ok: impl Fn(&Exposition) -> bool) -> Exposition {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = scrape(addr);
        if ok(&e) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "never: {what}; last scrape: {e:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The metrics address a process logged (`metrics listening on http://ADDR/metrics`).
pub(crate) fn metrics_addr(log: impl Fn() -> String) -> SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = log();
        if let Some(rest) = text.split("metrics listening on http://").nth(1)
            && let Some(addr) = rest.split("/metrics").next()
            && let Ok(a) = addr.parse()
        {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "no metrics address logged:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn metrics_count_claims_refusals_releases_expiries_and_leases_held() {
    let env = Env::new();
    let coord = Coord::start(
        &env,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--no-dispatch",
            "--lease-ttl-min",
            "100ms",
        ],
    );
    let at = metrics_addr(|| coord.stderr());
    let mut api = coord.api().await;
    for t in ["m-1", "m-2", "m-3", "m-4"] {
        api.claimable_task(t).await;
    }
    let before = scrape(at);
    let claims = |e: &Exposition| e.value("automaton_lease_claims_total", &[]);
    let held = |e: &Exposition| e.value("automaton_leases_held", &[]);
    assert_eq!(held(&before), 0.0);
    assert_eq!(
        before.value("automaton_tasks", &[("phase", "research")]),
        4.0
    );

    let mut leases = Vec::new();
    for t in ["m-1", "m-2", "m-3"] {
        leases.push(api.claim(t, "agent-a", 60_000).await.expect("claim"));
    }
    let after = scrape(at);
    assert_eq!(claims(&after) - claims(&before), 3.0, "three claims");
    assert_eq!(held(&after), 3.0);

    // Refused: another agent holds it.
    let refused =
        |e: &Exposition, r: &str| e.value("automaton_lease_refusals_total", &[("reason", r)]);
    api.claim("m-1", "agent-b", 60_000)
        .await
        .expect_err("held by agent-a");
    let e = scrape(at);
    assert_eq!(refused(&e, "held") - refused(&after, "held"), 1.0);
    assert_eq!(claims(&e), claims(&after), "a refusal grants nothing");

    // A renewal with a stale token is refused as such; a good one counts as a renewal.
    let l = &leases[0];
    api.renew(&l.lease_id, l.token + 1000)
        .await
        .expect_err("stale token");
    api.renew(&l.lease_id, l.token).await.expect("renew");
    let e2 = scrape(at);
    assert_eq!(
        refused(&e2, "stale_token") - refused(&e, "stale_token"),
        1.0
    );
    assert_eq!(
        e2.value("automaton_lease_renewals_total", &[])
            - e.value("automaton_lease_renewals_total", &[]),
        1.0
    );

    // Down: a release.
    api.release(&leases[1].lease_id, leases[1].token)
        .await
        .expect("release");
    let e3 = scrape(at);
    assert_eq!(held(&e3), 2.0);
    assert_eq!(
        e3.value("automaton_lease_releases_total", &[])
            - e2.value("automaton_lease_releases_total", &[]),
        1.0
    );

    // Down: an expiry.
    let expired =
        |e: &Exposition| e.value("automaton_lease_expiries_total", &[("reason", "expired")]);
    api.claim("m-4", "agent-a", 200).await.expect("short claim");
    // One scrape reads the held gauge before the counters: an expiry finishing in between
    // shows in the counter and not yet in the gauge, so both are waited for.
    let e4 = scrape_until(at, "the short lease expired", |e| {
        expired(e) - expired(&e3) == 1.0 && held(e) == 2.0
    });
    assert_eq!(held(&e4), 2.0);
    assert_eq!(claims(&e4) - claims(&e3), 1.0);
    // Its life, grant to expiry, is in the phase durations.
    assert_eq!(
        e4.value(
            "automaton_phase_duration_seconds_count",
            &[("phase", "research"), ("outcome", "expired")]
        ),
        1.0
    );
}

#[tokio::test]
async fn metrics_show_a_connected_worker_by_gpu_model_waiting_tasks_and_the_workers_runs() {
    let env = Env::new();
    git_init(&env);
    let mut args = FLEET.to_vec();
    args.extend(["--metrics-listen", "127.0.0.1:0"]);
    let coord = Coord::start(&env, &args);
    let at = metrics_addr(|| coord.stderr());
    let mut api = coord.api().await;

    // No worker yet: the task waits, and says why.
    api.create("solo").await.expect("create");
    let waiting = scrape_until(at, "the task waits for a worker", |e| {
        e.get("automaton_tasks_waiting", &[("reason", "no_worker")]) == Some(1.0)
    });
    assert_eq!(
        waiting.get("automaton_workers_connected", &[("gpu_model", "sim-h100")]),
        None
    );

    let worker = Worker::start(
        &coord.url,
        &[
            "--name",
            "gpu-box",
            "--simulate-gpu",
            "sim-h100:80GiB",
            "--agent",
            "scripted",
            "--kill-grace",
            "300ms",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let wat = metrics_addr(|| worker.stderr());
    let e = scrape_until(at, "the research run ended", |e| {
        e.sum(
            "automaton_phase_duration_seconds_count",
            &[("phase", "research")],
        ) >= 1.0
    });
    assert_eq!(
        e.value("automaton_workers_connected", &[("gpu_model", "sim-h100")]),
        1.0
    );
    assert_eq!(
        e.sum("automaton_workers", &[]),
        1.0,
        "one worker, in one state"
    );
    assert_eq!(
        e.value(
            "automaton_dispatch_assignments_total",
            &[("phase", "research")]
        ),
        1.0
    );
    assert!(e.value("automaton_dispatch_latency_seconds_count", &[]) >= 1.0);
    // The round that gave the task its worker decided, and its deciding took time.
    assert!(e.value("automaton_dispatch_decisions_total", &[]) >= 1.0);
    assert!(e.value("automaton_dispatch_decide_seconds_total", &[]) > 0.0);
    // The worker accepted it: its answer's wait is counted.
    assert_eq!(
        e.value(
            "automaton_dispatch_answer_seconds_count",
            &[("answer", "accepted")]
        ),
        1.0
    );
    assert_eq!(e.value("automaton_lease_claims_total", &[]), 1.0);
    assert_eq!(
        e.value("automaton_tasks_waiting", &[("reason", "no_worker")]),
        0.0
    );
    // The run left the task awaiting approval: phase research (tasks by phase may be up to
    // 5 s old).
    scrape_until(at, "the task counted under research", |e| {
        e.get("automaton_tasks", &[("phase", "research")]) == Some(1.0)
    });
    assert_eq!(api.state("solo").await, "research:awaiting_approval");

    let w = scrape_until(wat, "the worker counted its run", |w| {
        w.get(
            "automaton_worker_runs_total",
            &[("phase", "research"), ("outcome", "completed")],
        ) == Some(1.0)
    });
    assert_eq!(w.value("automaton_worker_connected", &[]), 1.0);
    assert_eq!(w.value("automaton_worker_runs_active", &[]), 0.0);
    assert_eq!(
        w.value(
            "automaton_worker_run_duration_seconds_count",
            &[("phase", "research")]
        ),
        1.0
    );
    assert_eq!(
        w.value(
            "automaton_worker_gpu_memory_bytes",
            &[("gpu", "0"), ("kind", "total")]
        ),
        (80u64 << 30) as f64
    );
    assert!(w.value("automaton_worker_budget_tokens", &[]) > 0.0);
    let w = scrape_until(wat, "a heartbeat round trip", |w| {
        w.value("automaton_worker_heartbeat_rtt_seconds_count", &[]) >= 1.0
    });
    assert!(w.value("automaton_worker_heartbeat_rtt_seconds_sum", &[]) > 0.0);

    // The Grafana dashboard (deploy/) is built on a list of names and labels: it is exactly
    // what the two real endpoints expose, no more, no less.
    let exposed: BTreeMap<&str, &str> = e
        .types
        .iter()
        .chain(&w.types)
        .map(|(name, kind)| (name.as_str(), kind.as_str()))
        .collect();
    let listed: std::collections::BTreeSet<&str> = crate::deploy::METRICS
        .iter()
        .map(|(name, _)| *name)
        .collect();
    let unlisted: Vec<_> = exposed.keys().filter(|n| !listed.contains(*n)).collect();
    let missing: Vec<_> = listed
        .iter()
        .filter(|n| !exposed.contains_key(*n))
        .collect();
    assert!(
        unlisted.is_empty() && missing.is_empty(),
        "deploy's metric list and the endpoints differ: exposed but not listed {unlisted:?}; \
         listed but not exposed {missing:?}"
    );
    for s in e.samples.iter().chain(&w.samples) {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                s.name
                    .strip_suffix(suffix)
                    .filter(|f| exposed.get(f) == Some(&"histogram"))
            })
            .unwrap_or(&s.name);
        let labels = crate::deploy::METRICS
            .iter()
            .find(|(name, _)| *name == family)
            .map(|(_, labels)| *labels)
            .unwrap_or_default();
        for label in s.labels.keys().filter(|l| *l != "le") {
            assert!(
                labels.contains(&label.as_str()),
                "{} has label {label}, which deploy's list does not name",
                s.name
            );
        }
    }
    drop(worker);
}

#[tokio::test]
async fn metrics_endpoint_refuses_other_paths_methods_and_huge_requests_and_keeps_serving() {
    let env = Env::new();
    let coord = Coord::start(&env, &["--metrics-listen", "127.0.0.1:0", "--no-dispatch"]);
    let at = metrics_addr(|| coord.stderr());
    let (status, _, _) = http(at, b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_eq!(status, 404);
    let (status, head, _) = http(at, b"POST /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_eq!(status, 405);
    assert!(head.contains("Allow: GET, HEAD"), "{head}");
    let (status, _, _) = http(at, b"nonsense\r\n\r\n");
    assert_eq!(status, 400);
    // A 1 MiB request line: an error status, not a hang or a crash.
    let mut huge = b"GET /".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 1 << 20));
    huge.extend_from_slice(b" HTTP/1.1\r\n\r\n");
    let (status, _, _) = http(at, &huge);
    assert_eq!(status, 414);
    // Headers too large.
    let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 64 << 10));
    big.extend_from_slice(b"\r\n\r\n");
    let (status, _, _) = http(at, &big);
    assert_eq!(status, 431);
    // And it still serves.
    let e = scrape(at);
    assert_eq!(e.value("automaton_leases_held", &[]), 0.0);
}

/// How one scrape of a flood ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scraped {
    /// An HTTP answer with this status.
    Answered(u16),
    /// Closed without an answer: the endpoint shed the connection.
    Shed,
    /// No answer within the client's timeout.
    Hung,
}

/// One `GET /metrics` on a fresh connection, raw, tolerating a connection shed by the server.
fn scrape_raw(addr: SocketAddr) -> Scraped {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return Scraped::Shed;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: flood\r\n\r\n")
        .is_err()
    {
        return Scraped::Shed;
    }
    let mut out = Vec::new();
    match s.read_to_end(&mut out) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Scraped::Hung
        }
        _ if out.is_empty() => Scraped::Shed,
        _ => String::from_utf8_lossy(&out)
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .map_or(Scraped::Shed, Scraped::Answered),
    }
}

/// Copies the task folder `from` to `to` on disk, behind the coordinator's back: a task it has
/// never touched, whose state a scrape must read from its file.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("create a task folder");
    for entry in std::fs::read_dir(from).expect("read a task folder") {
        let entry = entry.expect("entry");
        let dest = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).expect("copy a task file");
        }
    }
}

#[tokio::test]
async fn a_flood_of_scrapes_starves_neither_dispatch_nor_the_api() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    const TASKS: usize = 5000;
    const SCRAPERS: usize = 64;
    const BOUND: Duration = Duration::from_secs(2);
    let env = Env::new();
    let coord = Coord::start(&env, &["--metrics-listen", "127.0.0.1:0", "--no-dispatch"]);
    let at = metrics_addr(|| coord.stderr());
    let mut api = coord.api().await;
    api.create("seed").await.expect("create the seed task");
    for i in 0..TASKS {
        copy_dir(&env.task_dir("seed"), &env.task_dir(&format!("t-{i:04}")));
    }
    for t in ["c-1", "c-2", "c-3", "c-4", "c-5", "c-6", "c-7", "c-8"] {
        api.claimable_task(t).await;
    }

    // Tasks by phase are read from the store once, then reused: a second scrape within the
    // cache window does not read the store again.
    let reads = |e: &Exposition| e.value("automaton_scrape_store_reads_total", &[]);
    let first = scrape(at);
    assert_eq!(
        first.sum("automaton_tasks", &[]),
        (TASKS + 9) as f64,
        "every task counted"
    );
    let second = scrape(at);
    assert!(reads(&first) >= 1.0);
    assert_eq!(
        reads(&second),
        reads(&first),
        "a scrape within the cache window read the store again"
    );
    assert_eq!(second.sum("automaton_tasks", &[]), (TASKS + 9) as f64);

    // The flood: 64 clients scraping as fast as they are answered, every fourth connection
    // left open without a request for a while.
    let stop = Arc::new(AtomicBool::new(false));
    let scrapers: Vec<_> = (0..SCRAPERS)
        .map(|n| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    if (n + i).is_multiple_of(4) {
                        if let Ok(idle) = TcpStream::connect(at) {
                            std::thread::sleep(Duration::from_millis(700));
                            drop(idle);
                        }
                    } else {
                        seen.push(scrape_raw(at));
                    }
                    i += 1;
                }
                seen
            })
        })
        .collect();

    // Meanwhile, for longer than the cache window: GetTask (of tasks the coordinator has not
    // touched: a store read each), ListTasks and claims each answer within the bound.
    let flood = Instant::now();
    let mut slowest: Vec<(String, Duration)> = Vec::new();
    let mut calls = 0;
    let mut claims = ["c-1", "c-2", "c-3", "c-4", "c-5", "c-6", "c-7", "c-8"].into_iter();
    while flood.elapsed() < Duration::from_secs(12) {
        let t = Instant::now();
        let task = format!("t-{:04}", (calls * 37) % TASKS);
        api.get(&task).await.expect("GetTask");
        slowest.push((format!("GetTask {task}"), t.elapsed()));
        let t = Instant::now();
        let listed = api.list().await.expect("ListTasks");
        slowest.push(("ListTasks".into(), t.elapsed()));
        assert!(listed.tasks.len() > TASKS, "{}", listed.tasks.len());
        if let Some(c) = claims.next() {
            let t = Instant::now();
            api.claim(c, "agent-a", 60_000).await.expect("claim");
            slowest.push((format!("Claim {c}"), t.elapsed()));
        }
        calls += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let flooded = flood.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    for s in scrapers {
        for o in s.join().expect("a scraper thread") {
            *outcomes.entry(format!("{o:?}")).or_insert(0) += 1;
        }
    }
    slowest.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
    eprintln!(
        "{calls} rounds of calls under the flood; slowest: {:?}; scrapes: {outcomes:?}",
        &slowest[..slowest.len().min(5)]
    );
    let late: Vec<_> = slowest.iter().filter(|(_, d)| *d > BOUND).collect();
    assert!(
        late.is_empty(),
        "calls slower than {BOUND:?} under a flood of scrapes: {late:?}"
    );
    assert_eq!(
        outcomes.get("Hung"),
        None,
        "scrapes left unanswered: {outcomes:?}"
    );
    assert!(
        outcomes.get("Answered(200)").copied().unwrap_or(0) > SCRAPERS,
        "the scrapes were not served: {outcomes:?}"
    );

    // And the store was read at most once per cache window, one read at a time.
    let after = scrape(at);
    let windows = flooded.as_secs_f64() / 5.0;
    assert!(
        reads(&after) - reads(&second) <= windows.ceil() + 1.0,
        "{} store reads for scrapes in {flooded:?}",
        reads(&after) - reads(&second)
    );
}

#[test]
fn metrics_listen_is_in_the_printed_config() {
    let env = Env::new();
    let out = env.run_coordinator(
        &["--print-config", "--metrics-listen", "127.0.0.1:9464"],
        &[],
        Duration::from_secs(20),
    );
    assert!(
        out.stdout.contains("metrics_listen = \"127.0.0.1:9464\""),
        "{out:?}"
    );
}

#[test]
fn the_strict_parser_rejects_malformed_text() {
    let ok = "# HELP a_total x\n# TYPE a_total counter\na_total{r=\"x\\\"y\"} 3\n";
    let parsed = parse(ok).expect("valid");
    assert_eq!(parsed.value("a_total", &[("r", "x\"y")]), 3.0);
    for bad in [
        "a_total 3\n",                                  // no TYPE
        "# HELP a x\n# TYPE a gauge\nb 3\n",            // another family
        "# HELP a x\n# TYPE a gauge\na{r=\"x} 3\n",     // unterminated
        "# HELP a x\n# TYPE a gauge\na{r=x} 3\n",       // unquoted
        "# HELP a x\n# TYPE a gauge\na three\n",        // bad value
        "# HELP a x\n# TYPE a gauge\na 1\na 2\n",       // series twice
        "# HELP a x\n# TYPE a gauge\na 1",              // no final newline
        "# HELP a x\n# TYPE a gauge\n\na 1\n",          // blank line
        "# HELP a x\n# TYPE a gauge\na{r=\"\\t\"} 1\n", // bad escape
        "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\nh_sum 0\n", // not cumulative
        "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 1\nh_sum 0\n", // +Inf != count
    ] {
        assert!(parse(bad).is_err(), "accepted: {bad:?}");
    }
}
