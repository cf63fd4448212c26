//! Leases in the task folder: the claim rules (`claimable`), the CLI's local `--claim` and
//! `--release` of `.state.lock`, the holders and implementers records a grant leaves
//! (`record_holder`), lease ids, and the `.state.lock` view the coordinator mirrors its own
//! leases into. Fencing tokens come from `fencing.rs`; the `LeaseStore` interface over these
//! files and the coordinator's table is `lease_store.rs`.

use std::fs;
use std::time::{Duration, SystemTime};

use automaton_workflow::{AgentId, Phase, Policy, State, TaskName, hex};
use sha2::{Digest, Sha256};

use crate::fsx::{self, io_err};
use crate::project::{HOLDERS, IMPLEMENTER, LOCK};
use crate::records::{Lease, render_holders};
use crate::{Error, Project};

impl Project {
    /// May `agent` hold `task` now, lease aside? The task must be tracked, neither waiting for
    /// approval nor finished, and `agent` must not be barred from its phase (reviewer ≠
    /// implementer). Returns the task's state.
    pub fn claimable(
        &self,
        task: &TaskName,
        agent: &AgentId,
        policy: &Policy,
    ) -> Result<State, Error> {
        let state = self.tracked_state(task)?;
        self.claimable_in(task, state, agent, policy, &[])?;
        Ok(state)
    }

    /// The claim rules for a task known to be in `state` (a caller that owns the project may
    /// know it without reading `.state`). Who implemented the task is `.state.implementer`
    /// plus `pending`: implementers the caller knows of that the file does not hold yet (the
    /// coordinator's lease log, until its holders are written).
    pub fn claimable_in(
        &self,
        task: &TaskName,
        state: State,
        agent: &AgentId,
        policy: &Policy,
        pending: &[AgentId],
    ) -> Result<(), Error> {
        let why = if state.is_awaiting_approval() {
            Some("it waits for a person's approval (--approve)")
        } else if state.is_terminal() {
            Some("the task is finished")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::NotClaimable {
                task: task.clone(),
                state,
                why,
            });
        }
        let mut implementers = self.implementers(&self.task_dir(task))?;
        implementers.extend(pending.iter().cloned());
        if let Err(duty) = automaton_workflow::separation(
            policy,
            state.phase,
            agent,
            &implementers,
            automaton_workflow::Duty::Claim,
        ) {
            return Err(Error::Separation {
                task: task.clone(),
                agent: agent.to_string(),
                phase: state.phase,
                action: duty.name(),
            });
        }
        Ok(())
    }

    /// Records durably that `agent` holds `task` in `state`, before the lease is granted:
    /// `{phase}|{agent}` in `.state.holders` for every phase (each holder of a phase is then
    /// refused as the approver of that phase's gate), and, for implement, `agent` in
    /// `.state.implementer` too (seed 001's format, which the separated phases read).
    /// Recording a holder twice changes nothing.
    pub fn record_holder(
        &self,
        task: &TaskName,
        agent: &AgentId,
        state: State,
    ) -> Result<(), Error> {
        let key = (task.clone(), state.phase, agent.clone());
        let recorded = || self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        if recorded().contains(&key) {
            return Ok(());
        }
        self.record_holder_files(task, agent, state)?;
        recorded().insert(key);
        Ok(())
    }

    fn record_holder_files(
        &self,
        task: &TaskName,
        agent: &AgentId,
        state: State,
    ) -> Result<(), Error> {
        let dir = self.task_dir(task);
        let mut holders = self.holders(&dir)?;
        if !holders.iter().any(|(p, a)| *p == state.phase && a == agent) {
            holders.push((state.phase, agent.clone()));
            self.write(&dir.join(HOLDERS), render_holders(&holders).as_bytes())?;
        }
        if state.phase != Phase::Implement {
            return Ok(());
        }
        let implementers = self.implementers(&dir)?;
        if implementers.contains(agent) {
            return Ok(());
        }
        let mut text: String = implementers.iter().map(|a| format!("{a}\n")).collect();
        text.push_str(&format!("{agent}\n"));
        self.write(&dir.join(IMPLEMENTER), text.as_bytes())
    }

    /// `status --claim` without a coordinator: grants (or, for the holder, renews) the
    /// task's lease in `.state.lock`.
    pub fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
        now: SystemTime,
    ) -> Result<(Lease, bool), Error> {
        let policy = self.policy()?;
        if !policy.multi_agent {
            return Err(Error::NotMultiAgent {
                project: self.root.clone(),
            });
        }
        let bounds = automaton_workflow::TtlBounds::DEFAULT;
        let ttl = match ttl {
            Some(t) => bounds
                .check(t)
                .map_err(|r| Error::from_refusal(task, r, now))?,
            None => bounds.clamp(policy.lock_timeout),
        };
        // The fencing counter is the project's: the whole project is locked.
        let _lock = self.lock_project(task)?;
        let state = self.claimable(task, agent, &policy)?;
        let dir = self.task_dir(task);
        let lock_path = dir.join(LOCK);
        if let Some(l) = self.lease(&dir)?.filter(|l| l.is_live(now)) {
            if &l.agent != agent {
                return Err(Error::Leased {
                    task: task.clone(),
                    holder: l.agent,
                    expires: l.expires,
                    token: l.token,
                });
            }
            let renewed = Lease {
                expires: now + ttl,
                ..l
            };
            self.write(&lock_path, renewed.render().as_bytes())?;
            return Ok((renewed, true));
        }
        let token = self.fencing_mark()? + 1;
        self.set_fencing_mark(token)?;
        self.record_holder(task, agent, state)?;
        let lease = Lease {
            agent: agent.clone(),
            phase: state,
            claimed: now,
            expires: now + ttl,
            lease_id: new_lease_id(task, agent, token, now),
            token,
        };
        self.write(&lock_path, lease.render().as_bytes())?;
        Ok((lease, false))
    }

    /// `status --release` without a coordinator: ends `agent`'s own lease.
    pub fn release(
        &self,
        task: &TaskName,
        agent: &AgentId,
        now: SystemTime,
    ) -> Result<Lease, Error> {
        self.policy()?;
        let _lock = self.lock(task)?;
        let (folder, _) = self.tracked(task)?;
        match self.lease(&folder.dir)? {
            // The holder may remove its own lock file, live or lapsed.
            Some(l) if &l.agent == agent => {
                self.remove_durably(&folder.dir.join(LOCK))?;
                Ok(l)
            }
            Some(l) if l.is_live(now) => {
                let presented = automaton_workflow::lease::Presented {
                    agent: Some(agent),
                    ..Default::default()
                };
                Err(
                    automaton_workflow::lease::check_release(l.holder(), &presented)
                        .err()
                        .map_or(
                            Error::NoLease {
                                task: task.clone(),
                                agent: agent.clone(),
                            },
                            |r| Error::from_refusal(task, r, l.expires),
                        ),
                )
            }
            _ => Err(Error::NoLease {
                task: task.clone(),
                agent: agent.clone(),
            }),
        }
    }

    /// The lease mirrored in a task's `.state.lock`, if any.
    pub fn read_lease(&self, task: &TaskName) -> Result<Option<Lease>, Error> {
        self.lease(&self.task_dir(task))
    }

    /// The coordinator's materialised view of a lease: `.state.lock` rewritten (or removed)
    /// atomically but without a sync of its own. The coordinator's log is what is durable;
    /// it repairs these files at start.
    pub fn write_lease_view(&self, task: &TaskName, lease: Option<&Lease>) -> Result<(), Error> {
        let dir = self.task_dir(task);
        // The task folder is gone: there is nothing to mirror into. A link: nothing is
        // written or removed through it.
        if !self.is_real_dir(&dir)? {
            return Ok(());
        }
        let path = dir.join(LOCK);
        match lease {
            None => match fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_err("remove", &path)(e)),
            },
            Some(l) => fsx::replace_unsynced(&self.tmp_dir(), &path, l.render().as_bytes()),
        }
    }
}

/// A lease id unique per grant: a hash of what makes this grant different from every other.
/// The CLI's local mode and the coordinator both name their leases with it.
pub fn new_lease_id(task: &TaskName, agent: &AgentId, token: u64, now: SystemTime) -> String {
    let nanos = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let seed = format!("{task}|{agent}|{token}|{nanos}|{}", std::process::id());
    hex(&Sha256::digest(seed.as_bytes())[..8])
}

#[cfg(test)]
mod tests {
    use std::fs;

    use automaton_workflow::{AgentId, State};

    use crate::project::tests::{name, project};

    #[test]
    fn record_holder_records_every_phase_and_implement_in_seed_001_format_too() {
        let (_d, p) = project();
        let t = name("t");
        p.create_task(&t).expect("create");
        let a: AgentId = "a".parse().expect("valid");
        let b: AgentId = "b".parse().expect("valid");
        let st = |s: &str| s.parse::<State>().expect("valid");
        p.record_holder(&t, &a, st("research")).expect("record");
        p.record_holder(&t, &a, st("research"))
            .expect("twice is once");
        p.record_holder(&t, &b, st("implement")).expect("record");
        let dir = p.task_dir(&t);
        assert_eq!(
            fs::read_to_string(dir.join(".state.holders")).expect("holders"),
            "research|a\nimplement|b\n"
        );
        assert_eq!(
            fs::read_to_string(dir.join(".state.implementer")).expect("implementer"),
            "b\n"
        );
    }
}
