//! How a client — the CLI, a worker, the `status.py` shim's calls through the CLI — reaches
//! the leader among several coordinators of one project (`store = etcd`): given their URLs
//! (`--coordinator a,b,c`, `AUTOMATON_COORDINATOR`), it asks each one's health service; the
//! leader answers `SERVING`, a follower answers `UNAVAILABLE` with the leader's URL in the
//! `automaton-leader` metadata, which is asked next. During a failover nobody leads for a
//! few seconds: the search goes round until one does or its time is up. It owns finding the
//! leader only: how each client connects (TLS, timeouts) stays the client's own.

use std::future::Future;
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// The metadata key naming the leader's URL in a follower's answers.
pub const LEADER_METADATA: &str = "automaton-leader";

/// How long a search waits for a leader by default: an election takes the leadership TTL
/// (5 s by default) and a little more; this leaves room for a slow one.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

/// `a, b,c` → `[a, b, c]`: the coordinators a client was given (empty items dropped).
pub fn split(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

/// The leader's URL a follower named in its refusal, if it named one.
pub fn leader_named(status: &tonic::Status) -> Option<String> {
    (status.code() == tonic::Code::Unavailable)
        .then(|| status.metadata().get(LEADER_METADATA)?.to_str().ok())
        .flatten()
        .map(str::to_string)
}

/// Finds the leader among `urls` (and the URLs their followers name), trying for at most
/// `wait`; `endpoint` builds each URL's endpoint as the client configures it. One URL is
/// returned as it is, unasked: a single coordinator is its own leader, and the first call
/// says so if it is not.
pub async fn find_leader<E>(urls: &[String], wait: Duration, endpoint: E) -> Result<String, String>
where
    E: Fn(&str) -> Result<Endpoint, String>,
{
    match urls {
        [] => return Err("no coordinator given: pass --coordinator URL[,URL…]".into()),
        [one] => return Ok(one.clone()),
        _ => {}
    }
    let deadline = Instant::now() + wait;
    let mut heard: Vec<String> = Vec::new();
    loop {
        // Asked in the order given; a leader a follower names is asked next.
        let mut queue: Vec<String> = urls.iter().rev().cloned().collect();
        let mut asked = std::collections::HashSet::new();
        while let Some(url) = queue.pop() {
            if !asked.insert(url.clone()) {
                continue;
            }
            match ask(&url, &endpoint).await {
                Ok(()) => return Ok(url),
                Err(Answer::Follower(leader)) => {
                    heard.push(format!("{url}: a follower of {leader}"));
                    queue.push(leader);
                }
                Err(Answer::Other(why)) => heard.push(format!("{url}: {why}")),
            }
        }
        if Instant::now() >= deadline {
            heard.dedup();
            let last: Vec<&str> = heard
                .iter()
                .rev()
                .take(urls.len())
                .map(String::as_str)
                .collect();
            return Err(format!(
                "no coordinator leads among {} after {wait:?} (an election under way, or etcd unreachable): {}",
                urls.join(", "),
                last.join("; ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

enum Answer {
    Follower(String),
    Other(String),
}

/// One health check of `url`, bounded: a dead or frozen coordinator costs a second or two.
async fn ask<E>(url: &str, endpoint: &E) -> Result<(), Answer>
where
    E: Fn(&str) -> Result<Endpoint, String>,
{
    let e = endpoint(url).map_err(Answer::Other)?;
    let channel: Channel = bounded(e.connect(), "connect")
        .await?
        .map_err(|err| Answer::Other(format!("cannot connect: {err}")))?;
    let mut health = HealthClient::new(channel);
    let answer = bounded(
        health.check(HealthCheckRequest {
            service: String::new(),
        }),
        "health check",
    )
    .await?;
    match answer {
        Ok(r) if r.get_ref().status == 1 => Ok(()),
        Ok(r) => Err(Answer::Other(format!(
            "not serving ({})",
            r.get_ref().status
        ))),
        Err(s) => match leader_named(&s) {
            Some(l) => Err(Answer::Follower(l)),
            None => Err(Answer::Other(s.message().to_string())),
        },
    }
}

async fn bounded<T>(f: impl Future<Output = T>, what: &str) -> Result<T, Answer> {
    tokio::time::timeout(Duration::from_secs(2), f)
        .await
        .map_err(|_| Answer::Other(format!("no answer to the {what} within 2 s")))
}
