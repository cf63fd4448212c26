//! Finished work, delivered (issue 31): a top-level task at `complete` gets a delivery record
//! (`.state.delivery`, seed 003's worktree lifecycle) and dispatch rounds drive it, one step
//! at a time under the task's guard, each step recorded durably before the next one acts:
//! REQUESTED (waiting for `automaton deliver` with `approve = true`) → PREPARING (the merge
//! built in memory, or the branch pushed for a pull request) → READY (the commit recorded) →
//! MERGING (the base moved by compare-and-swap, or the pull request opened) → MERGED / OPENED.
//! A step that fails goes back (a base that moved: PREPARING; anything else: READY, retried
//! with a growing pause), and a merge that would not be the reviewed tree sends the task back
//! to implement on the base's head (`rework`) or waits for a person. `rework` is also how a
//! sub-task whose merge into its parent's branch conflicts goes back to implement.

use automaton_proto::vocab::RunVocab;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use automaton_store::{DeliveryRecord, DeliveryState, Prepared, Strategy};
use automaton_workflow::{EventKind, Phase, State, TaskName};

use crate::Error;
use crate::config::{DeliveryMode, OnConflict};
use crate::state::Coordinator;

/// The first pause after a failed step; doubled with each failure, at most [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_secs(1);
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// Steps one round may take for one delivery (a base that keeps moving waits a round).
const STEPS_PER_ROUND: usize = 8;
/// The most of an abandon's reason kept.
const MAX_REASON: usize = 500;

/// What a rework came to.
pub(crate) enum Reworked {
    /// The task is back in implement on the new head.
    Sent,
    /// No more reworks (or `on_conflict = person`): a person decides, for this reason.
    ForAPerson(String),
}

/// What a delivery's step asks of its caller, outside the task's guard.
enum Next {
    Done,
    Rework {
        onto: String,
        why: String,
    },
    /// The record says `merging` a pull request: the forge is asked outside the guard.
    OpenPullRequest(Box<DeliveryRecord>),
}

fn from_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, automaton_store::Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("a delivery step failed: {e}")))?
        .map_err(Error::from)
}

/// The record as the wire shows it.
pub(crate) fn delivery_pb(r: &DeliveryRecord, reworks: u32) -> automaton_proto::v1::Delivery {
    automaton_proto::v1::Delivery {
        state: r.state.name().into(),
        delivery_state: automaton_proto::v1::DeliveryState::from(r.state) as i32,
        mode: r.mode.clone(),
        strategy: r.strategy.clone(),
        base: r.base.clone(),
        branch: r.branch.clone(),
        remote: r.remote.clone(),
        revision: r.revision.clone(),
        commit: r.commit.clone(),
        how: r.how.clone(),
        url: r.url.clone(),
        number: r.number,
        approved_by: r.approved_by.clone(),
        waiting: r.waiting.clone(),
        failure: r.failure.clone(),
        failures: r.failures,
        abandoned_by: r.abandoned_by.clone(),
        reworks,
        requested_at: (r.requested_ms > 0).then(|| crate::wire::timestamp(from_ms(r.requested_ms))),
        updated_at: (r.updated_ms > 0).then(|| crate::wire::timestamp(from_ms(r.updated_ms))),
    }
}

impl Coordinator {
    /// Where finished work lands: `[delivery] remote`, else (with `store = etcd`) the shared
    /// remote, else this repository.
    fn delivery_remote(&self) -> Option<String> {
        self.options
            .delivery
            .remote
            .clone()
            .or_else(|| self.options.shared_remote.clone())
    }

    /// The delivery record of `task` as this coordinator knows it (read once).
    pub(crate) async fn delivery_of(&self, task: &TaskName) -> Option<DeliveryRecord> {
        if let Some(known) = self.work.inner().deliveries.get(task) {
            return known.clone();
        }
        let t = task.clone();
        let read = self.engine.read(move |p| p.read_delivery(&t)).await;
        match read {
            Ok(r) => {
                self.work.inner().deliveries.insert(task.clone(), r.clone());
                r
            }
            Err(e) => {
                tracing::warn!(task = %task, error = %e, "cannot read a delivery record");
                None
            }
        }
    }

    /// Whether a round should look at `task`'s delivery: a top-level task at `complete` whose
    /// delivery has not ended and is not pausing after a failure.
    pub(crate) async fn delivery_due(&self, task: &TaskName) -> bool {
        if task.parent().is_some() {
            return false;
        }
        if let Some(until) = self.work.inner().delivery_pause.get(task).map(|p| p.0)
            && until > Instant::now()
        {
            return false;
        }
        match self.delivery_of(task).await {
            Some(r) => !r.state.is_final() && r.waiting.is_empty(),
            None => self.options.delivery.mode != DeliveryMode::Branch,
        }
    }

    /// Drives `task`'s delivery as far as it goes now.
    pub(crate) async fn advance_delivery(self: &Arc<Self>, task: &TaskName) -> Result<(), Error> {
        // Read before the guard is taken (reading it may take the guard).
        if self.state_now(task).await? != State::open(Phase::Complete) {
            return Ok(());
        }
        // The base's turn is taken before the task's guard, never under it: the guards are
        // shared by many tasks (sharded), and a guard held through a merge queue held up
        // every change to the tasks of its shard (claims waited 1.7 s in the bench).
        let known = self.delivery_of(task).await;
        let base = match &known {
            Some(r) => r.base.clone(),
            None => match self.options.delivery.base.clone() {
                Some(b) => b,
                None => {
                    let t = task.clone();
                    self.engine
                        .read(move |p| p.base_of(&t))
                        .await?
                        .unwrap_or_else(|| "main".into())
                }
            },
        };
        let merging = match &known {
            Some(r) => r.mode == "merge",
            None => self.options.delivery.mode == DeliveryMode::Merge,
        };
        let remote = match &known {
            Some(r) => r.remote.clone(),
            None => self.delivery_remote().unwrap_or_default(),
        };
        let turn = self.work.base_lock(&remote, &base);
        let _turn = if merging {
            Some(turn.lock().await)
        } else {
            None
        };
        let me = self.clone();
        let t = task.clone();
        let next = self
            .engine
            .to_completion(
                task,
                move |_| async move { me.delivery_steps(&t, base).await },
            )
            .await;
        // A pull request: the forge (its rate limits waited out for minutes, perhaps) is
        // asked with no guard held; what it answers is recorded under the guard.
        let next = match next {
            Ok(Next::OpenPullRequest(r)) => {
                self.open_pull_request(task, *r).await.map(|()| Next::Done)
            }
            other => other,
        };
        let next = match next {
            Ok(n) => n,
            Err(e) => {
                let why = e.to_string();
                let me = self.clone();
                let t = task.clone();
                let w = why.clone();
                let recorded = self
                    .engine
                    .to_completion(task, move |_| async move {
                        if let Some(mut r) = me.delivery_of(&t).await {
                            r.failure = w;
                            r.failures = r.failures.saturating_add(1);
                            me.save_delivery(&t, r).await?;
                        }
                        Ok(())
                    })
                    .await;
                if let Err(e) = recorded {
                    tracing::warn!(task = %task, error = %e, "cannot record a delivery's failure");
                }
                self.delivery_failed(task, why).await;
                return Ok(());
            }
        };
        if let Next::Rework { onto, why } = next {
            let outcome = self.rework(task, onto, why.clone()).await?;
            let me = self.clone();
            let t = task.clone();
            let waits = self
                .engine
                .to_completion(task, move |_| async move {
                    let Some(mut r) = me.delivery_of(&t).await else {
                        return Ok(None);
                    };
                    let waits = match outcome {
                        Reworked::Sent => {
                            r.state = DeliveryState::Requested;
                            r.failure = format!("sent back to implement: {why}");
                            None
                        }
                        Reworked::ForAPerson(line) => {
                            r.waiting = line.clone();
                            Some(line)
                        }
                    };
                    me.save_delivery(&t, r).await?;
                    Ok(waits)
                })
                .await?;
            // A person is needed: said once it is recorded (a webhook can tell them).
            if let Some(line) = waits {
                self.engine
                    .emit(EventKind::DeliveryFailed, &task.to_string(), "", 0, line);
            }
        }
        Ok(())
    }

    /// Writes `r` (stamped) durably, then remembers it.
    async fn save_delivery(&self, task: &TaskName, mut r: DeliveryRecord) -> Result<(), Error> {
        r.updated_ms = now_ms();
        let (t, rec) = (task.clone(), r.clone());
        self.engine
            .read(move |p| p.write_delivery(&t, &rec))
            .await?;
        self.work.inner().deliveries.insert(task.clone(), Some(r));
        Ok(())
    }

    /// A failed step: recorded, an event, and a growing pause before the next try.
    async fn delivery_failed(&self, task: &TaskName, why: String) {
        let pause = {
            let mut inner = self.work.inner();
            let last = inner
                .delivery_pause
                .get(task)
                .map_or(FIRST_PAUSE / 2, |p| p.1);
            let pause = (last * 2).clamp(FIRST_PAUSE, MAX_PAUSE);
            inner
                .delivery_pause
                .insert(task.clone(), (Instant::now() + pause, pause));
            pause
        };
        tracing::warn!(task = %task, error = %why, "delivery step failed");
        self.engine.emit(
            EventKind::DeliveryFailed,
            &task.to_string(),
            "",
            0,
            format!(
                "{why} (tried again in {}s)",
                pause.as_secs_f64().round() as u64
            ),
        );
    }

    /// The steps of `task`'s delivery, under its guard, until it waits, ends or fails.
    async fn delivery_steps(
        self: &Arc<Self>,
        task: &TaskName,
        base: String,
    ) -> Result<Next, Error> {
        if self.engine.states().get(task).copied() != Some(State::open(Phase::Complete)) {
            return Ok(Next::Done);
        }
        let d = self.options.delivery.clone();
        let project = self.engine.project().clone();
        let mut r = match self.delivery_of(task).await {
            Some(r) => r,
            None => {
                if d.mode == DeliveryMode::Branch {
                    return Ok(Next::Done);
                }
                let (p, t) = (project.clone(), task.clone());
                let head = blocking(move || p.branch_head(&t)).await?;
                if head.is_none() {
                    // No code: nothing to deliver, and nothing recorded.
                    self.work.inner().deliveries.insert(task.clone(), None);
                    return Ok(Next::Done);
                }
                let r = DeliveryRecord {
                    mode: match d.mode {
                        DeliveryMode::PullRequest => "pull_request".into(),
                        _ => "merge".into(),
                    },
                    strategy: d.strategy.clone(),
                    base,
                    branch: automaton_store::branch_name(task),
                    remote: self.delivery_remote().unwrap_or_default(),
                    requested_ms: now_ms(),
                    ..DeliveryRecord::default()
                };
                self.save_delivery(task, r.clone()).await?;
                self.engine.emit(
                    EventKind::DeliveryRequested,
                    &task.to_string(),
                    "",
                    0,
                    format!("{} into {} ({})", r.branch, r.base, r.mode),
                );
                self.crash_point("requested").await;
                r
            }
        };
        // One merge into a base at a time (the caller holds the base's turn): each builds on
        // the head the last one left, rather than all on one head and all but one again.
        let remote = (!r.remote.is_empty()).then(|| r.remote.clone());
        for _ in 0..STEPS_PER_ROUND {
            match r.state {
                DeliveryState::Merged | DeliveryState::Opened | DeliveryState::Abandoned => break,
                DeliveryState::Requested => {
                    if d.approve && r.approved_by.is_empty() {
                        let line = format!(
                            "awaiting an operator: `automaton deliver {task}` lets {} land on {}",
                            r.branch, r.base
                        );
                        if r.waiting != line {
                            r.waiting = line.clone();
                            self.save_delivery(task, r.clone()).await?;
                            self.engine.emit(
                                EventKind::DeliveryAwaitingApproval,
                                &task.to_string(),
                                "",
                                0,
                                line,
                            );
                        }
                        break;
                    }
                    let (p, t) = (project.clone(), task.clone());
                    r.revision = blocking(move || p.branch_head(&t))
                        .await?
                        .unwrap_or_default();
                    // The revision that lands is the one the referee read (issue 36): a branch
                    // that moved after the verdict is not delivered blind.
                    let refereed = self
                        .work
                        .runs(task)
                        .into_iter()
                        .rev()
                        .find(|run| {
                            run.completed()
                                && run
                                    .phase
                                    .parse::<State>()
                                    .is_ok_and(|s| s.phase == Phase::Referee)
                        })
                        .map(|run| run.commit)
                        .filter(|c| !c.is_empty());
                    // A person's `automaton deliver` authorizes the revision as it is now.
                    if let Some(read) = refereed
                        && read != r.revision
                        && r.approved_by.is_empty()
                    {
                        let line = automaton_store::human_intervention_line(&format!(
                            "{task}'s branch is at {} but its referee read {read}: the verdict is not of the code that would land; review the new commits and `automaton deliver {task}` to deliver the branch as it is now, or reset it to what was reviewed",
                            r.revision
                        ));
                        if r.waiting != line {
                            r.waiting = line.clone();
                            self.save_delivery(task, r.clone()).await?;
                            self.engine.emit(
                                EventKind::DeliveryFailed,
                                &task.to_string(),
                                "",
                                0,
                                line,
                            );
                        }
                        break;
                    }
                    r.state = DeliveryState::Preparing;
                    self.save_delivery(task, r.clone()).await?;
                    self.crash_point("preparing").await;
                }
                DeliveryState::Preparing => {
                    if r.mode == "pull_request" {
                        let Some(remote) = remote.clone() else {
                            return Err(Error::Refused(
                                "a pull request needs [delivery] remote".into(),
                            ));
                        };
                        let (p, t, rev) = (project.clone(), task.clone(), r.revision.clone());
                        blocking(move || p.push_task_branch(&t, &rev, &remote)).await?;
                        r.state = DeliveryState::Ready;
                        self.save_delivery(task, r.clone()).await?;
                        continue;
                    }
                    let strategy = Strategy::parse(&r.strategy).unwrap_or(Strategy::Merge);
                    let title = self.delivery_title(task).await;
                    let (p, t, base, rev, rem) = (
                        project.clone(),
                        task.clone(),
                        r.base.clone(),
                        r.revision.clone(),
                        remote.clone(),
                    );
                    let prepared = blocking(move || {
                        p.prepare_delivery(&t, &base, strategy, &rev, rem.as_deref(), &title)
                    })
                    .await?;
                    match prepared {
                        Prepared::Already { commit } => {
                            r.commit = commit;
                            r.how = "already on the base".into();
                            r.state = DeliveryState::Merged;
                            self.save_delivery(task, r.clone()).await?;
                            self.merged(task, &r);
                        }
                        Prepared::Ready {
                            base_before,
                            commit,
                            how,
                        } => {
                            r.base_before = base_before;
                            r.commit = commit;
                            r.how = how.into();
                            r.state = DeliveryState::Ready;
                            self.save_delivery(task, r.clone()).await?;
                            self.crash_point("ready").await;
                        }
                        Prepared::NotAsReviewed { base_head, why, .. } => {
                            r.failure = why.clone();
                            r.failures = r.failures.saturating_add(1);
                            self.save_delivery(task, r.clone()).await?;
                            return Ok(Next::Rework {
                                onto: base_head,
                                why: format!("{task} cannot land on {}: {why}", r.base),
                            });
                        }
                    }
                }
                DeliveryState::Ready => {
                    r.state = DeliveryState::Merging;
                    self.save_delivery(task, r.clone()).await?;
                    self.crash_point("merging").await;
                }
                DeliveryState::Merging => {
                    if r.mode == "pull_request" {
                        return Ok(Next::OpenPullRequest(Box::new(r)));
                    }
                    // A leader that cannot prove it still leads moves no base (with etcd, a
                    // deposed one's record writes are refused too; this is before the push).
                    self.engine.leading()?;
                    // Built by another leader and never pushed: built again (the same inputs
                    // make the same commit), or found landed.
                    let (p, c) = (project.clone(), r.commit.clone());
                    if !blocking(move || p.has_commit(&c)).await? {
                        r.state = DeliveryState::Preparing;
                        self.save_delivery(task, r.clone()).await?;
                        continue;
                    }
                    let (p, t, base, before, commit, rem) = (
                        project.clone(),
                        task.clone(),
                        r.base.clone(),
                        r.base_before.clone(),
                        r.commit.clone(),
                        remote.clone(),
                    );
                    let landed = blocking(move || {
                        p.land_delivery(&t, &base, &before, &commit, rem.as_deref())
                    })
                    .await;
                    match landed {
                        Ok(_) => {
                            self.crash_point("landed").await;
                            r.state = DeliveryState::Merged;
                            r.waiting.clear();
                            self.save_delivery(task, r.clone()).await?;
                            self.work.inner().delivery_pause.remove(task);
                            self.merged(task, &r);
                        }
                        Err(Error::Store(e @ automaton_store::Error::BaseMoved { .. })) => {
                            // Built again on the new head, at once.
                            r.failure = e.to_string();
                            r.failures = r.failures.saturating_add(1);
                            r.state = DeliveryState::Preparing;
                            self.save_delivery(task, r.clone()).await?;
                        }
                        Err(e) => {
                            r.state = DeliveryState::Ready;
                            self.save_delivery(task, r.clone()).await?;
                            return Err(e);
                        }
                    }
                }
            }
        }
        Ok(Next::Done)
    }

    /// Opens (or finds open) the pull request of `r` (its record says `merging`), with no
    /// guard held; then records what the forge answered under the task's guard. A final
    /// refusal is recorded as what a person must fix; a retryable failure is an error.
    async fn open_pull_request(
        self: &Arc<Self>,
        task: &TaskName,
        r: DeliveryRecord,
    ) -> Result<(), Error> {
        let config = self.options.delivery.forge.clone().ok_or_else(|| {
            Error::Refused(
                "pull_request delivery needs [delivery.forge]: name the forge, its API URL, the repository and the token".into(),
            )
        })?;
        let spec = automaton_forge::PullRequestSpec {
            head: r.branch.clone(),
            base: r.base.clone(),
            title: self.delivery_title(task).await,
            body: self.pull_request_body(task, &r).await,
        };
        self.engine.leading()?;
        let opened = match automaton_forge::Forge::new(&config) {
            Ok(forge) => forge.open_pull_request(&spec).await,
            Err(e) => Err(e),
        };
        let me = self.clone();
        let t = task.clone();
        let (event, detail, retry) = self
            .engine
            .to_completion(task, move |_| async move {
                // As it is now: an operator may have given it up meanwhile.
                let Some(mut r) = me.delivery_of(&t).await else {
                    return Ok((None, String::new(), None));
                };
                if r.state != DeliveryState::Merging {
                    return Ok((None, String::new(), None));
                }
                match opened {
                    Ok(pr) => {
                        r.url = pr.url;
                        r.number = pr.number;
                        r.how = if pr.reused { "reused" } else { "opened" }.into();
                        r.state = DeliveryState::Opened;
                        r.waiting.clear();
                        me.save_delivery(&t, r.clone()).await?;
                        me.work.inner().delivery_pause.remove(&t);
                        let detail = format!(
                            "#{} {} ({} into {}{})",
                            r.number,
                            r.url,
                            r.branch,
                            r.base,
                            if pr.reused {
                                ", the one already open"
                            } else {
                                ""
                            }
                        );
                        Ok((Some(EventKind::PullRequestOpened), detail, None))
                    }
                    Err(e) if e.is_final() => {
                        let why = e.to_string();
                        r.state = DeliveryState::Ready;
                        r.failure = why.clone();
                        r.failures = r.failures.saturating_add(1);
                        r.waiting = format!("{why}: fix it, then `automaton deliver {t}`");
                        me.save_delivery(&t, r.clone()).await?;
                        Ok((Some(EventKind::DeliveryFailed), r.waiting, None))
                    }
                    Err(e) => {
                        r.state = DeliveryState::Ready;
                        me.save_delivery(&t, r).await?;
                        Ok((None, String::new(), Some(e.to_string())))
                    }
                }
            })
            .await?;
        if let Some(kind) = event {
            self.engine.emit(kind, &task.to_string(), "", 0, detail);
        }
        match retry {
            Some(why) => Err(Error::Unavailable(why)),
            None => Ok(()),
        }
    }

    /// A pull request's body: the verdict, the artifacts, a parent's sub-task verdicts, the
    /// console's page of the task.
    async fn pull_request_body(&self, task: &TaskName, r: &DeliveryRecord) -> String {
        let t = task.clone();
        let view = self
            .engine
            .read(move |p| p.view(&t, SystemTime::now()))
            .await
            .ok();
        let t = task.clone();
        let verdict = self
            .engine
            .read(move |p| p.read_artifact_text(&t, automaton_workflow::Artifact::Verdict))
            .await
            .ok()
            .flatten()
            .and_then(|v| automaton_workflow::parse_verdict(&v))
            .map_or("none readable".to_string(), |v| v.to_string());
        let mut body = format!(
            "automaton delivers task `{task}`: branch `{}` at {} into `{}`, exactly as reviewed.\n\n**Verdict**: {verdict}\n",
            r.branch, r.revision, r.base
        );
        if let Some(v) = &view {
            if let Some(s) = &v.verdicts {
                body.push_str(&format!("\n**Sub-task verdicts**: {}\n", s.summary));
            }
            if !v.artifacts.is_empty() {
                body.push_str("\n**Artifacts** (in the task's folder on the coordinator):\n");
                for a in &v.artifacts {
                    body.push_str(&format!("- {} ({} bytes)\n", a.artifact, a.bytes));
                }
            }
        }
        if let Some(url) = &self.options.delivery.console_url {
            body.push_str(&format!(
                "\n**Console**: {}/task/{task}\n",
                url.trim_end_matches('/')
            ));
        }
        body
    }

    /// Tests: stops the process right here, as a `kill -9` would
    /// (`AUTOMATON_FAILPOINTS=delivery-crash-after=STEP`).
    async fn crash_point(&self, step: &str) {
        let f = &self.options.engine.failpoints;
        if f.delivery_crash_after == Some(step) {
            eprintln!("failpoint delivery-crash-after={step}: the coordinator stops here");
            std::process::abort();
        }
        if f.delivery_stall_after == Some(step) {
            eprintln!("failpoint delivery-stall-after={step}: the delivery stalls here");
            // The step is stuck; the rest of the process (its leadership's keepalives) is not.
            tokio::time::sleep(automaton_backend::DELIVERY_STALL).await;
        }
    }

    fn merged(&self, task: &TaskName, r: &DeliveryRecord) {
        self.engine.emit(
            EventKind::Merged,
            &task.to_string(),
            "",
            0,
            format!(
                "{} into {}{} at {} ({})",
                r.branch,
                r.base,
                if r.remote.is_empty() {
                    String::new()
                } else {
                    format!(" on {}", r.remote)
                },
                r.commit,
                r.how
            ),
        );
    }

    /// The first heading of the task's `SPEC.md`, else its name.
    async fn delivery_title(&self, task: &TaskName) -> String {
        let t = task.clone();
        let spec = self
            .engine
            .read(move |p| p.read_artifact_text(&t, automaton_workflow::Artifact::Spec))
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        spec.lines()
            .map(|l| l.trim().trim_start_matches('#').trim())
            .find(|l| !l.is_empty())
            .map(|l| automaton_workflow::excerpt(l).to_string())
            .unwrap_or_else(|| format!("automaton: {task}"))
    }

    /// Sends `task` back to implement on `onto` for `why` — or, past `max_reworks` (or with
    /// `on_conflict = person`), says why a person decides. The decision is durable (its
    /// dispatch record) before anything moves, and a decided rework is finished after a
    /// crash ([`Coordinator::resume_rework`]).
    pub(crate) async fn rework(
        self: &Arc<Self>,
        task: &TaskName,
        onto: String,
        why: String,
    ) -> Result<Reworked, Error> {
        self.load_dispatch(task).await;
        let d = &self.options.delivery;
        let pending = self.work.inner().rework.get(task).cloned();
        if pending.is_none() {
            let n = self.work.inner().reworks.get(task).copied().unwrap_or(0);
            if d.on_conflict == OnConflict::Person || n >= d.max_reworks {
                let line = automaton_store::human_intervention_line(&format!(
                    "{why}; {}: resolve it on the branch by hand, then `automaton deliver` (a top-level task) or `automaton stop PARENT --resume` (a sub-task)",
                    if d.on_conflict == OnConflict::Person {
                        "on_conflict = person".to_string()
                    } else {
                        format!(
                            "sent back to implement {n} time(s) already (max_reworks {})",
                            d.max_reworks
                        )
                    }
                ));
                return Ok(Reworked::ForAPerson(line));
            }
            // Seed 002's loop limits count the runs of one revision: a rework (itself bounded
            // by max_reworks) starts them again, as a person's resume does.
            let iterations = {
                let mut inner = self.work.inner();
                inner
                    .rework
                    .insert(task.clone(), (onto.clone(), why.clone()));
                *inner.reworks.entry(task.clone()).or_insert(0) += 1;
                inner.iterations.remove(task)
            };
            if let Err(e) = self.save_dispatch(task).await {
                let mut inner = self.work.inner();
                inner.rework.remove(task);
                if let Some(n) = inner.reworks.get_mut(task) {
                    *n = n.saturating_sub(1);
                }
                if let Some(n) = iterations {
                    inner.iterations.insert(task.clone(), n);
                }
                return Err(e);
            }
        }
        self.resume_rework(task).await?;
        Ok(Reworked::Sent)
    }

    /// Carries out the rework decided for `task`, if one is (each step can run again).
    pub(crate) async fn resume_rework(self: &Arc<Self>, task: &TaskName) -> Result<bool, Error> {
        let Some((onto, why)) = self.work.inner().rework.get(task).cloned() else {
            return Ok(false);
        };
        let t = task.clone();
        let t2 = task.clone();
        let w = why.clone();
        let done = self
            .engine
            .to_completion(task, move |c| async move {
                let project = c.project().clone();
                let out = tokio::task::spawn_blocking(move || project.rework_onto(&t2, &onto, &w))
                    .await
                    .map_err(|e| Error::Internal(format!("a rework failed: {e}")))?
                    .map_err(Error::from)?;
                c.states().insert(t.clone(), State::open(Phase::Implement));
                Ok(out)
            })
            .await?;
        self.work.inner().rework.remove(task);
        self.work.inner().settled.remove(task);
        self.save_dispatch(task).await?;
        if done.moved {
            self.engine.emit_moved(
                &task.to_string(),
                "",
                0,
                (State::open(Phase::Complete), State::open(Phase::Implement)),
                "rework",
            );
        }
        self.engine.emit(
            EventKind::Rework,
            &task.to_string(),
            "",
            0,
            format!(
                "{why}: back to implement on {} (paths both changed: {}); CONFLICTS.md says what to do, and its reviews run again",
                &done.head.get(..12).unwrap_or(&done.head),
                if done.paths.is_empty() {
                    "none named".to_string()
                } else {
                    done.paths.join(", ")
                }
            ),
        );
        self.work.poke();
        Ok(true)
    }

    /// `task`'s delivery as the wire shows it.
    pub(crate) fn delivery_shown(
        &self,
        task: &TaskName,
        r: &DeliveryRecord,
    ) -> automaton_proto::v1::Delivery {
        let reworks = self.work.inner().reworks.get(task).copied().unwrap_or(0);
        delivery_pb(r, reworks)
    }

    /// `automaton deliver TASK`: lets its delivery go on (the approval `approve = true` waits
    /// for, or a retry after a person's fix). Durable before it is answered.
    pub(crate) async fn deliver(
        self: &Arc<Self>,
        task: &TaskName,
        by: &str,
    ) -> Result<DeliveryRecord, Error> {
        let me = self.clone();
        let (t, by) = (task.clone(), by.to_string());
        let state = self.state_now(task).await?;
        let r = self
            .engine
            .to_completion(task, move |_| async move {
                let Some(mut r) = me.delivery_of(&t).await else {
                    return Err(Error::Refused(if state == State::open(Phase::Complete) {
                        format!(
                            "{t} has no delivery: [delivery] mode is branch, or it holds no code (its work is on {})",
                            automaton_store::branch_name(&t)
                        )
                    } else {
                        format!("{t} is {state}: its delivery starts when it is complete")
                    }));
                };
                if r.state.is_final() {
                    return Err(Error::Refused(format!(
                        "{t}'s delivery is {} already{}",
                        r.state.name(),
                        if r.commit.is_empty() { String::new() } else { format!(" (at {})", r.commit) }
                    )));
                }
                if r.state != DeliveryState::Merging {
                    r.state = DeliveryState::Requested;
                }
                r.approved_by = by.clone();
                r.waiting.clear();
                me.save_delivery(&t, r.clone()).await?;
                Ok(r)
            })
            .await?;
        self.work.inner().delivery_pause.remove(task);
        self.engine.emit(
            EventKind::DeliveryApproved,
            &task.to_string(),
            "",
            0,
            format!("by {}", r.approved_by),
        );
        self.work.poke();
        Ok(r)
    }

    /// `automaton abandon TASK`: gives its delivery up. Durable before it is answered.
    pub(crate) async fn abandon(
        self: &Arc<Self>,
        task: &TaskName,
        by: &str,
        reason: &str,
    ) -> Result<DeliveryRecord, Error> {
        let me = self.clone();
        let (t, by) = (task.clone(), by.to_string());
        // One line of at most MAX_REASON bytes: it is shown in listings and events.
        let line: String = reason
            .split(['\n', '\r'])
            .next()
            .unwrap_or_default()
            .chars()
            .filter(|c| !c.is_control())
            .collect();
        let mut reason = line.trim().to_string();
        if reason.len() > MAX_REASON {
            let mut end = MAX_REASON;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.truncate(end);
            reason.push('…');
        }
        if reason.is_empty() {
            reason = "abandoned by an operator".to_string();
        }
        let why = reason.clone();
        let r = self
            .engine
            .to_completion(task, move |_| async move {
                let Some(mut r) = me.delivery_of(&t).await else {
                    return Err(Error::Refused(format!(
                        "{t} has no delivery to abandon (it is not complete, or [delivery] mode is branch)"
                    )));
                };
                match r.state {
                    DeliveryState::Merged | DeliveryState::Opened => {
                        return Err(Error::Refused(format!(
                            "{t}'s delivery is {} already ({}): nothing to abandon; revert it on {} if it must go",
                            r.state.name(),
                            if r.url.is_empty() { &r.commit } else { &r.url },
                            r.base
                        )));
                    }
                    DeliveryState::Abandoned => return Ok(r),
                    DeliveryState::Merging => {
                        return Err(Error::Unavailable(format!(
                            "{t}'s base is being moved right now: retry in a few seconds"
                        )));
                    }
                    _ => {}
                }
                r.state = DeliveryState::Abandoned;
                r.abandoned_by = by.clone();
                r.failure = why.clone();
                r.waiting.clear();
                me.save_delivery(&t, r.clone()).await?;
                Ok(r)
            })
            .await?;
        self.engine.emit(
            EventKind::DeliveryAbandoned,
            &task.to_string(),
            "",
            0,
            format!("by {}: {reason}", r.abandoned_by),
        );
        Ok(r)
    }
}
