//! One interface for every store of task leases: the files (`Project`, the CLI's local mode)
//! and the coordinator (its table over its backend's log, files or etcd:
//! `automaton-backend`). Each applies the same rules (`automaton_workflow::lease`);
//! [`check_lease_rules`] holds every implementation to them.
//!
//! A claim grants a live lease or renews the holder's own, a release needs the holder and
//! its current token, and tokens strictly increase. Expiry is the store's own clock, never the
//! reader's: the files' wall clock, the coordinator's monotonic one (with etcd too: task
//! leases are data there, not etcd leases — `docs/backends.md`). Loss notices stay with each
//! store: the coordinator's are its KeepAlive streams, and the files have none.

use std::future::Future;
use std::time::{Duration, SystemTime};

use automaton_workflow::lease::{Presented, check_release};
use automaton_workflow::{AgentId, TaskName};

use crate::{Error, Lease, Project};

/// A store of task leases.
pub trait LeaseStore {
    type Error: std::error::Error + Send + 'static;

    /// Grants `task` to `agent` unless another agent's live lease stands; the holder's own
    /// claim renews it (same lease, same token). `ttl`: the store's default when `None`;
    /// refused outside the store's bounds. Returns the lease and whether it was a renewal.
    fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<(Lease, bool), Self::Error>> + Send;

    /// The live lease on `task`, if any.
    fn live(
        &self,
        task: &TaskName,
    ) -> impl Future<Output = Result<Option<Lease>, Self::Error>> + Send;

    /// Ends `agent`'s live lease on `task`, if `token` is still its token: only the holder
    /// may, and a stale token changes nothing.
    fn release(
        &self,
        task: &TaskName,
        agent: &AgentId,
        token: u64,
    ) -> impl Future<Output = Result<Lease, Self::Error>> + Send;
}

/// The files: each call is one short, synchronous, durable change under the project's lock.
impl LeaseStore for Project {
    type Error = Error;

    fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<(Lease, bool), Error>> + Send {
        std::future::ready(Project::claim(self, task, agent, ttl, SystemTime::now()))
    }

    fn live(&self, task: &TaskName) -> impl Future<Output = Result<Option<Lease>, Error>> + Send {
        let now = SystemTime::now();
        std::future::ready(self.read_lease(task).map(|l| l.filter(|l| l.is_live(now))))
    }

    fn release(
        &self,
        task: &TaskName,
        agent: &AgentId,
        token: u64,
    ) -> impl Future<Output = Result<Lease, Error>> + Send {
        let now = SystemTime::now();
        let checked = match self.read_lease(task) {
            Ok(Some(l)) if l.is_live(now) => {
                let presented = Presented {
                    agent: Some(agent),
                    lease_id: None,
                    token: Some(token),
                };
                check_release(l.holder(), &presented)
                    .map_err(|r| Error::from_refusal(task, r, l.expires))
            }
            Ok(_) => Err(Error::NoLease {
                task: task.clone(),
                agent: agent.clone(),
            }),
            Err(e) => Err(e),
        };
        std::future::ready(checked.and_then(|()| Project::release(self, task, agent, now)))
    }
}

/// Holds a lease store to the rules every store shares. `task` must exist, be claimable and
/// have no lease; the store's TTL bounds must refuse `u64::MAX` ms. Returns what failed.
#[doc(hidden)]
pub async fn check_lease_rules<S: LeaseStore>(store: &S, task: &TaskName) -> Result<(), String> {
    let (a, b): (AgentId, AgentId) = match ("agent-a".parse(), "agent-b".parse()) {
        (Ok(a), Ok(b)) => (a, b),
        _ => return Err("agent ids".into()),
    };
    let fail = |what: &str| Err::<(), String>(what.to_string());
    let ttl = Some(Duration::from_secs(600));
    let expect_refused = |r: Result<(), S::Error>, what: &str, says: &str| match r {
        Ok(()) => Err(format!("{what}: accepted")),
        Err(e) if !e.to_string().contains(says) => Err(format!(
            "{what}: refused with '{e}', which does not say '{says}'"
        )),
        Err(_) => Ok(()),
    };
    if store.live(task).await.map_err(|e| e.to_string())?.is_some() {
        return fail("the task must start without a lease");
    }
    expect_refused(
        store
            .claim(task, &a, Some(Duration::from_millis(u64::MAX)))
            .await
            .map(drop),
        "a TTL of u64::MAX ms",
        "outside the allowed",
    )?;
    let (first, renewed) = store
        .claim(task, &a, ttl)
        .await
        .map_err(|e| e.to_string())?;
    if renewed || first.agent != a {
        return fail("a first claim is a fresh grant to its agent");
    }
    expect_refused(
        store.claim(task, &b, ttl).await.map(drop),
        "another agent's claim of a held task",
        "leased to agent-a",
    )?;
    let (again, renewed) = store
        .claim(task, &a, ttl)
        .await
        .map_err(|e| e.to_string())?;
    if !renewed || again.token != first.token || again.lease_id != first.lease_id {
        return fail("the holder's claim renews the same lease");
    }
    match store.live(task).await.map_err(|e| e.to_string())? {
        Some(l) if l.agent == a && l.token == first.token => {}
        other => return Err(format!("the live lease is the holder's: {other:?}")),
    }
    expect_refused(
        store.release(task, &b, first.token).await.map(drop),
        "a release by another agent",
        "only the holder can release it",
    )?;
    expect_refused(
        store.release(task, &a, first.token + 1).await.map(drop),
        "a release with a stale token",
        "is stale",
    )?;
    store
        .release(task, &a, first.token)
        .await
        .map_err(|e| e.to_string())?;
    if store.live(task).await.map_err(|e| e.to_string())?.is_some() {
        return fail("a released lease is gone");
    }
    let (next, _) = store
        .claim(task, &b, ttl)
        .await
        .map_err(|e| e.to_string())?;
    if next.token <= first.token {
        return Err(format!(
            "tokens strictly increase: {} after {}",
            next.token, first.token
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls a future that must be ready at once (the files' store never waits).
    fn ready<F: Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        match f
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => panic!("the files' lease store never waits"),
        }
    }

    #[test]
    fn the_files_follow_the_lease_rules() {
        let dir = tempfile::tempdir().expect("tempdir");
        let project = Project::open(dir.path(), None);
        std::fs::create_dir_all(dir.path().join(".automaton")).expect("meta");
        std::fs::write(
            dir.path().join(".automaton/.agent.md"),
            "Mode: multi-agent\n",
        )
        .expect(".agent.md");
        let task: TaskName = "t".parse().expect("name");
        project.create_task(&task).expect("create");
        project
            .transition(
                &task,
                "research".parse().expect("state"),
                None,
                None,
                SystemTime::now(),
            )
            .expect("to research");
        ready(check_lease_rules(&project, &task)).expect("the files follow the rules");
    }
}
