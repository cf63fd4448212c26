//! The conformance suite every backend passes: what the lease engine relies on, checked
//! through [`Backend`] and [`LeaseLog`] alone — what is acknowledged is durable and comes
//! back from [`Backend::load`] with the same meaning (by [`replay`]), in the order it was
//! queued; a fresh start holds exactly what it was given; a rewrite keeps its snapshot and
//! everything after it. It reads no backend's files or keys: it cannot tell one from another.
//!
//! The lease rules themselves (who may claim, stale tokens, TTL bounds) are the engine's and
//! are checked against the running coordinator by `automaton_store::check_lease_rules`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use automaton_workflow::{AgentId, State, TaskName};

use crate::{Backend, LeaseLog, Record, holders_in, replay};

/// Runs every check against `backend`, which must be empty (nothing was ever stored in it).
/// Returns the first check that failed, in words.
pub async fn check_lease_log(backend: &dyn Backend) -> Result<(), String> {
    let fresh = backend.load()?;
    if !fresh.is_empty() {
        return Err(format!(
            "the backend must start empty; it holds {} records",
            fresh.len()
        ));
    }
    let log = backend.start(&[])?;
    acknowledged_grants_come_back(backend, &*log).await?;
    ends_and_supersessions_replay(backend, &*log).await?;
    a_displaced_lease_stays_ended_once_its_successor_ends(backend, &*log).await?;
    order_is_the_order_queued(backend, &*log).await?;
    barriers_and_unawaited_ends(backend, &*log).await?;
    many_writers_lose_nothing(backend, &log).await?;
    let log = a_start_holds_exactly_what_it_is_given(backend, log).await?;
    a_rewrite_keeps_its_snapshot_and_what_follows(backend, &*log).await?;
    drop(log);
    marks_and_holders(backend).await?;
    Ok(())
}

fn name<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.parse()
        .map_err(|_| format!("'{s}' must parse in the suite"))
}

/// A grant record of `task` (in `implement`) with `token`.
fn grant(task: &str, agent: &str, token: u64, session: Option<&str>) -> Result<Record, String> {
    Ok(Record::Grant {
        task: name(task)?,
        agent: name(agent)?,
        lease_id: format!("{task}-{agent}-{token:016x}"),
        token,
        ttl: Duration::from_millis(1500 + token),
        state: name("implement")?,
        session: session.map(str::to_string),
    })
}

fn queue(log: &dyn LeaseLog, r: &Record) -> Result<crate::Commit, String> {
    if let Some(g) = r.as_grant() {
        return log.grant(g);
    }
    match r {
        Record::End { lease_id } => log.end(lease_id),
        other => Err(format!(
            "the suite queues grants and ends only, not {other:?}"
        )),
    }
}

async fn commit(log: &dyn LeaseLog, r: &Record) -> Result<(), String> {
    queue(log, r)?
        .await
        .map_err(|e| format!("a commit of {r:?} failed: {e}"))
}

/// The live grants after replaying what the backend holds, by task.
fn live(backend: &dyn Backend) -> Result<HashMap<TaskName, Record>, String> {
    Ok(replay(&backend.load()?).0)
}

fn expect_live(
    backend: &dyn Backend,
    what: &str,
    want: &[&Record],
) -> Result<HashMap<TaskName, Record>, String> {
    let got = live(backend)?;
    let mut want_map = HashMap::new();
    for r in want {
        if let Record::Grant { task, .. } = r {
            want_map.insert(task.clone(), (*r).clone());
        }
    }
    if got != want_map {
        let mut got: Vec<_> = got.values().collect();
        got.sort_by_key(|r| format!("{r:?}"));
        return Err(format!("{what}: live after replay {got:?}, want {want:?}"));
    }
    Ok(want_map)
}

fn end_of(r: &Record) -> Record {
    match r {
        Record::Grant { lease_id, .. } => Record::End {
            lease_id: lease_id.clone(),
        },
        other => other.clone(),
    }
}

async fn acknowledged_grants_come_back(
    backend: &dyn Backend,
    log: &dyn LeaseLog,
) -> Result<(), String> {
    let a = grant("ack-a", "agent-a", 1, None)?;
    let b = grant("ack-b", "agent-b", 2, Some("s-00ff"))?;
    commit(log, &a).await?;
    commit(log, &b).await?;
    // Every field back as it was given: TTL, state, session.
    expect_live(backend, "two acknowledged grants", &[&a, &b])?;
    commit(log, &end_of(&a)).await?;
    commit(log, &end_of(&b)).await?;
    expect_live(backend, "both ended", &[])?;
    Ok(())
}

async fn ends_and_supersessions_replay(
    backend: &dyn Backend,
    log: &dyn LeaseLog,
) -> Result<(), String> {
    // A later grant of the same task ends the earlier one without an end of its own.
    let first = grant("sup", "agent-a", 10, None)?;
    let second = grant("sup", "agent-b", 11, None)?;
    commit(log, &first).await?;
    commit(log, &second).await?;
    expect_live(backend, "a grant superseded by a later one", &[&second])?;
    // The end of the superseded lease changes nothing.
    commit(log, &end_of(&first)).await?;
    expect_live(backend, "the end of a superseded lease", &[&second])?;
    // A lease id never granted: nothing.
    commit(
        log,
        &Record::End {
            lease_id: "never-granted".into(),
        },
    )
    .await?;
    expect_live(backend, "the end of an unknown lease", &[&second])?;
    commit(log, &end_of(&second)).await?;
    expect_live(backend, "all ended", &[])?;
    Ok(())
}

/// A grant that displaces a lapsed lease ends it in the same write: once the new lease ends
/// too, nothing of the task is live, and the displaced lease's token never comes back (on
/// etcd its key would outlive the new lease's without the end).
async fn a_displaced_lease_stays_ended_once_its_successor_ends(
    backend: &dyn Backend,
    log: &dyn LeaseLog,
) -> Result<(), String> {
    let lapsed = grant("displaced", "agent-a", 15, None)?;
    let taker = grant("displaced", "agent-b", 16, None)?;
    commit(log, &lapsed).await?;
    let (Some(g), Record::Grant { lease_id, .. }) = (taker.as_grant(), &lapsed) else {
        return Err("the suite's grants are grants".into());
    };
    log.grant_displacing(g, lease_id)?
        .await
        .map_err(|e| format!("a displacing grant: {e}"))?;
    expect_live(backend, "a grant that displaced a lapsed lease", &[&taker])?;
    commit(log, &end_of(&taker)).await?;
    expect_live(
        backend,
        "the displacing lease ended (the displaced one must not come back)",
        &[],
    )?;
    Ok(())
}

async fn order_is_the_order_queued(
    backend: &dyn Backend,
    log: &dyn LeaseLog,
) -> Result<(), String> {
    // Queued back to back, awaited after: the end follows its grant, and the regrant its
    // end — whatever batches the backend makes of them.
    let g = grant("order", "agent-a", 20, None)?;
    let again = grant("order", "agent-a", 21, None)?;
    let c1 = queue(log, &g)?;
    let c2 = queue(log, &end_of(&g))?;
    let c3 = queue(log, &again)?;
    let c4 = log.ends(&mut ["x-never", "y-never"].into_iter())?;
    for c in [c1, c2, c3, c4] {
        c.await
            .map_err(|e| format!("a queued commit failed: {e}"))?;
    }
    expect_live(backend, "grant, end, grant queued together", &[&again])?;
    commit(log, &end_of(&again)).await?;
    Ok(())
}

async fn barriers_and_unawaited_ends(
    backend: &dyn Backend,
    log: &dyn LeaseLog,
) -> Result<(), String> {
    log.barrier()?
        .await
        .map_err(|e| format!("a barrier with nothing pending: {e}"))?;
    let g = grant("barrier", "agent-a", 30, None)?;
    let pending = queue(log, &g)?;
    // A barrier resolves only after what was queued before it.
    log.barrier()?
        .await
        .map_err(|e| format!("a barrier: {e}"))?;
    expect_live(backend, "a grant before a barrier", &[&g])?;
    pending.await.map_err(|e| format!("the grant: {e}"))?;
    if let Record::Grant { lease_id, .. } = &g {
        log.end_nowait(lease_id);
    }
    log.barrier()?
        .await
        .map_err(|e| format!("a barrier after an unawaited end: {e}"))?;
    expect_live(backend, "an end nobody awaited, then a barrier", &[])?;
    Ok(())
}

async fn many_writers_lose_nothing(
    backend: &dyn Backend,
    log: &Arc<dyn LeaseLog>,
) -> Result<(), String> {
    // 8 writers × 40 grants, at once: every acknowledged one comes back (the batches of a
    // group commit, and etcd's operations per transaction, are the backend's business).
    let mut handles = Vec::new();
    for w in 0..8u64 {
        let log = log.clone();
        handles.push(tokio::spawn(async move {
            let mut made = Vec::new();
            for i in 0..40u64 {
                let r = grant(&format!("many-{w}-{i}"), "agent-a", 100 + w * 40 + i, None)?;
                commit(&*log, &r).await?;
                made.push(r);
            }
            Ok::<_, String>(made)
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.map_err(|e| format!("a writer panicked: {e}"))??);
    }
    let want: Vec<&Record> = all.iter().collect();
    expect_live(backend, "320 grants from 8 writers at once", &want)?;
    let ends: Vec<String> = all
        .iter()
        .filter_map(|r| match r {
            Record::Grant { lease_id, .. } => Some(lease_id.clone()),
            _ => None,
        })
        .collect();
    log.ends(&mut ends.iter().map(String::as_str))?
        .await
        .map_err(|e| format!("320 ends as one write: {e}"))?;
    expect_live(backend, "320 ends as one write", &[])?;
    Ok(())
}

async fn a_start_holds_exactly_what_it_is_given(
    backend: &dyn Backend,
    log: Arc<dyn LeaseLog>,
) -> Result<Arc<dyn LeaseLog>, String> {
    let kept = grant("restart-kept", "agent-a", 500, Some("s-0a"))?;
    let dropped = grant("restart-dropped", "agent-b", 501, None)?;
    commit(&*log, &kept).await?;
    commit(&*log, &dropped).await?;
    drop(log);
    // What recovery keeps is what the next start holds; the rest is gone.
    let log = backend.start(&[Record::Mark { token: 501 }, kept.clone()])?;
    expect_live(backend, "a start with one of two leases", &[&kept])?;
    let (_, mark) = replay(&backend.load()?);
    if mark < 501 {
        return Err(format!("a start's mark comes back: {mark} < 501"));
    }
    commit(&*log, &end_of(&kept)).await?;
    expect_live(backend, "the kept lease ended", &[])?;
    Ok(log)
}

async fn a_rewrite_keeps_its_snapshot_and_what_follows(
    backend: &dyn Backend,
    log: &dyn LeaseLog,
) -> Result<(), String> {
    let mut snapshot = Vec::new();
    for i in 0..5 {
        let r = grant(&format!("rw-{i}"), "agent-a", 600 + i, None)?;
        commit(log, &r).await?;
        snapshot.push(r);
    }
    let gone = grant("rw-gone", "agent-a", 610, None)?;
    commit(log, &gone).await?;
    // The snapshot leaves `gone` out (its end was lost with the old contents, say) ...
    let mut with_holder = snapshot.clone();
    with_holder.push(Record::Holder {
        task: name("rw-0")?,
        agent: name("agent-z")?,
        state: name::<State>("implement")?,
    });
    let rewritten = log.rewrite(&with_holder);
    // ... and what is queued after the rewrite is kept after it.
    let after = grant("rw-after", "agent-b", 611, None)?;
    let queued_after = queue(log, &after)?;
    rewritten.await.map_err(|e| format!("a rewrite: {e}"))?;
    queued_after
        .await
        .map_err(|e| format!("a grant after a rewrite: {e}"))?;
    let mut want: Vec<&Record> = snapshot.iter().collect();
    want.push(&after);
    expect_live(backend, "a rewrite, then a grant", &want)?;
    let holders = holders_in(&backend.load()?);
    let z: AgentId = name("agent-z")?;
    if !holders
        .iter()
        .any(|(t, a, _)| t.to_string() == "rw-0" && *a == z)
    {
        return Err(format!("a rewrite's holder record comes back: {holders:?}"));
    }
    let mut ends: Vec<Record> = snapshot.iter().map(end_of).collect();
    ends.push(end_of(&after));
    for e in &ends {
        commit(log, e).await?;
    }
    expect_live(backend, "all ended after a rewrite", &[])?;
    Ok(())
}

async fn marks_and_holders(backend: &dyn Backend) -> Result<(), String> {
    // A start's holders and marks come back as given, the highest mark wins.
    let holder = Record::Holder {
        task: name("held")?,
        agent: name("agent-h")?,
        state: name::<State>("code_review")?,
    };
    let log = backend.start(&[
        Record::Mark { token: 900 },
        Record::Mark { token: 800 },
        holder.clone(),
    ])?;
    log.barrier()?
        .await
        .map_err(|e| format!("a barrier after a start: {e}"))?;
    let records = backend.load()?;
    let (live, mark) = replay(&records);
    if !live.is_empty() || mark != 900 {
        return Err(format!(
            "a start with marks 900 and 800 and a holder: live {live:?}, mark {mark}"
        ));
    }
    let want = (name("held")?, name("agent-h")?, name("code_review")?);
    if holders_in(&records) != vec![want] {
        return Err(format!("the holder comes back: {:?}", holders_in(&records)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Failpoints, FileBackend};

    #[tokio::test]
    async fn the_files_backend_conforms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let backend = FileBackend {
            path: dir.path().join("leases.wal"),
            compact_bytes: 1 << 20,
            failpoints: Failpoints::default(),
        };
        check_lease_log(&backend).await.expect("conforms");
    }

    /// The suite can fail: a backend that loses the records of a rewrite's aftermath.
    #[tokio::test]
    async fn a_backend_that_forgets_is_caught() {
        struct Forgetful(FileBackend);
        impl Backend for Forgetful {
            fn name(&self) -> &'static str {
                "forgetful"
            }
            fn load(&self) -> Result<Vec<Record>, String> {
                // Loses the last record, as a backend acknowledging before durability would
                // after a crash.
                let mut all = self.0.load()?;
                all.pop();
                Ok(all)
            }
            fn start(&self, live: &[Record]) -> Result<Arc<dyn LeaseLog>, String> {
                self.0.start(live)
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let backend = Forgetful(FileBackend {
            path: dir.path().join("leases.wal"),
            compact_bytes: 1 << 20,
            failpoints: Failpoints::default(),
        });
        let err = check_lease_log(&backend).await.expect_err("caught");
        assert!(err.contains("two acknowledged grants"), "{err}");
    }
}
