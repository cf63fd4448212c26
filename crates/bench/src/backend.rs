//! What a system under test must offer, and the load loops that drive it.
//!
//! Claim and release are measured in rounds: every client claims `per_client` leases of its
//! own (distinct tasks or keys, so nobody contends and every call is a real grant), the
//! clock stops when the last client is done, then every client releases what it claimed,
//! timed the same way. Rounds repeat, reusing the released tasks, until the claim and
//! release phases together have run `2 × duration` (or `4 × duration` of wall time passed).
//! ops/s = successful operations / summed phase wall time.
//!
//! Renew is measured on one lease per client: each client claims one, opens one stream,
//! makes one unmeasured round trip, and once all clients are ready, sends one renewal and
//! awaits its one response, again and again, for `duration`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use tokio::sync::Barrier;

use crate::stats::{ClientSample, Sample};

/// Upper bounds on every loop, whatever the clock says.
const MAX_ROUNDS: usize = 100_000;
const MAX_RENEWALS_PER_CLIENT: usize = 20_000_000;
/// No single operation may take longer than this.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

async fn bounded<T>(what: &str, f: impl Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(OP_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(anyhow!("{what} timed out after {OP_TIMEOUT:?}")),
    }
}

pub trait Backend: Send + Sync + 'static {
    type Lease: Send + 'static;
    type Renewer: Renewer;

    /// Claims slot `slot` (0..per_client) of `client`: its own task or key.
    fn claim(&self, client: usize, slot: usize)
    -> impl Future<Output = Result<Self::Lease>> + Send;
    fn release(&self, client: usize, lease: Self::Lease)
    -> impl Future<Output = Result<()>> + Send;
    /// Opens `client`'s renewal stream for `lease`, with one unmeasured round trip.
    fn renewer(
        &self,
        client: usize,
        lease: &Self::Lease,
    ) -> impl Future<Output = Result<Self::Renewer>> + Send;
}

pub trait Renewer: Send + 'static {
    /// One request, one response.
    fn renew(&mut self) -> impl Future<Output = Result<()>> + Send;
}

/// Claim and release figures, measured in rounds.
pub async fn claim_release<B: Backend>(
    backend: Arc<B>,
    clients: usize,
    per_client: usize,
    duration: Duration,
) -> Result<(Sample, Sample)> {
    let mut claims = Sample::default();
    let mut releases = Sample::default();
    let start = Instant::now();
    for _round in 0..MAX_ROUNDS {
        if claims.wall + releases.wall >= 2 * duration || start.elapsed() >= 4 * duration {
            break;
        }
        // Claim phase.
        let t0 = Instant::now();
        let mut handles = Vec::with_capacity(clients);
        for c in 0..clients {
            let b = backend.clone();
            handles.push(tokio::spawn(async move {
                let mut s = ClientSample::with_capacity(per_client);
                let mut leases = Vec::with_capacity(per_client);
                for slot in 0..per_client {
                    let t = Instant::now();
                    match bounded("claim", b.claim(c, slot)).await {
                        Ok(l) => {
                            s.latencies.push(t.elapsed());
                            leases.push(l);
                        }
                        Err(e) => s.error(&e),
                    }
                }
                (s, leases)
            }));
        }
        let mut held = Vec::with_capacity(clients);
        let mut granted = 0usize;
        for h in handles {
            let (s, leases) = h.await.context("a claim task panicked")?;
            granted += leases.len();
            claims.merge(s);
            held.push(leases);
        }
        claims.wall += t0.elapsed();

        // Release phase.
        let t0 = Instant::now();
        let mut handles = Vec::with_capacity(clients);
        for (c, leases) in held.into_iter().enumerate() {
            let b = backend.clone();
            handles.push(tokio::spawn(async move {
                let mut s = ClientSample::with_capacity(leases.len());
                for l in leases {
                    let t = Instant::now();
                    match bounded("release", b.release(c, l)).await {
                        Ok(()) => s.latencies.push(t.elapsed()),
                        Err(e) => s.error(&e),
                    }
                }
                s
            }));
        }
        for h in handles {
            releases.merge(h.await.context("a release task panicked")?);
        }
        releases.wall += t0.elapsed();

        if granted == 0 {
            // Nothing works: stop rather than spin; the errors say why.
            break;
        }
    }
    Ok((claims, releases))
}

/// Renew figures: one lease and one stream per client.
pub async fn renew<B: Backend>(
    backend: Arc<B>,
    clients: usize,
    duration: Duration,
) -> Result<Sample> {
    let ready = Arc::new(Barrier::new(clients + 1));
    let mut handles = Vec::with_capacity(clients);
    for c in 0..clients {
        let b = backend.clone();
        let ready = ready.clone();
        handles.push(tokio::spawn(async move {
            let setup = async {
                let lease = bounded("claim", b.claim(c, 0))
                    .await
                    .context("claim before renewing")?;
                match bounded("open stream", b.renewer(c, &lease)).await {
                    Ok(r) => Ok((lease, r)),
                    Err(e) => {
                        let _ = bounded("release", b.release(c, lease)).await;
                        Err(e.context("open the renewal stream"))
                    }
                }
            }
            .await;
            ready.wait().await;
            let mut s = ClientSample::default();
            let (lease, mut renewer) = match setup {
                Ok(x) => x,
                Err(e) => {
                    s.error(&e);
                    return (s, None);
                }
            };
            let deadline = Instant::now() + duration;
            let mut ended = None;
            for _ in 0..MAX_RENEWALS_PER_CLIENT {
                if Instant::now() >= deadline {
                    break;
                }
                let t = Instant::now();
                match bounded("renew", renewer.renew()).await {
                    Ok(()) => {
                        let now = Instant::now();
                        s.latencies.push(now - t);
                        ended = Some(now);
                    }
                    Err(e) => {
                        s.error(&e);
                        break;
                    }
                }
            }
            drop(renewer);
            if let Err(e) = bounded("release", b.release(c, lease)).await {
                eprintln!("warning: release after renewing failed: {e:#}");
            }
            (s, ended)
        }));
    }
    ready.wait().await;
    let t0 = Instant::now();
    let mut sample = Sample::default();
    let mut last = t0;
    for h in handles {
        let (s, ended) = h.await.map_err(|e| anyhow!("a renew task panicked: {e}"))?;
        last = last.max(ended.unwrap_or(t0));
        sample.merge(s);
    }
    // The clock stops when the last measured renewal returned, not after the clean-up
    // releases.
    sample.wall = last - t0;
    Ok(sample)
}
