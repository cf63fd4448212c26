//! The coordinator's typed answers turned back into the store's types, in this one place, so
//! that a command forwarded to a coordinator renders through the same code, byte for byte,
//! as one carried out on the files. Times are cut to the second, as the files hold them.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use automaton_proto::prost_types;
use automaton_proto::v1 as pb;
use automaton_store::{
    Approval, ApprovalView, ArtifactInfo, AuditReport, AuditTask, Category3, FolderReport, Lease,
    ListEntry, Modification, ProjectFolders, SubtaskVerdicts, TaskError, TaskView, Unaddressable,
    format_time,
};
use automaton_workflow::{AgentId, Artifact, Finding, Guidance, Severity, State, TaskName};

use crate::backend::Failure;

fn bad(what: &str, value: &str) -> Failure {
    Failure::Usage(format!(
        "the coordinator sent an unreadable {what} '{}': use an automaton built from the same proto as the coordinator",
        automaton_workflow::excerpt(value)
    ))
}

pub fn state(s: &str) -> Result<State, Failure> {
    s.parse().map_err(|_| bad("state", s))
}

/// An empty string is "none".
fn maybe_state(s: &str) -> Result<Option<State>, Failure> {
    (!s.is_empty()).then(|| state(s)).transpose()
}

fn task(s: &str) -> Result<TaskName, Failure> {
    s.parse().map_err(|_| bad("task name", s))
}

fn agent(s: &str) -> Result<AgentId, Failure> {
    s.parse().map_err(|_| bad("agent", s))
}

fn artifact(s: &str) -> Result<Artifact, Failure> {
    Artifact::from_file_name(s).ok_or_else(|| bad("artifact", s))
}

fn artifacts(list: &[String]) -> Result<Vec<Artifact>, Failure> {
    list.iter().map(|a| artifact(a)).collect()
}

fn opt(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

/// A wire time, to the second; `None` when unset or outside what this machine's clock holds.
pub fn time(t: Option<&prost_types::Timestamp>) -> Option<SystemTime> {
    let t = t?;
    SystemTime::try_from(prost_types::Timestamp {
        seconds: t.seconds,
        nanos: 0,
    })
    .ok()
}

/// A wire time as the CLI prints times (RFC 3339, seconds); empty when unset.
pub fn time_text(t: Option<&prost_types::Timestamp>) -> String {
    time(t).map(format_time).unwrap_or_default()
}

/// A wire duration in whole milliseconds (0 when unset or negative).
pub fn millis(d: Option<&prost_types::Duration>) -> u64 {
    d.and_then(|d| Duration::try_from(*d).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn lease(l: &pb::Lease) -> Result<Lease, Failure> {
    Ok(Lease {
        agent: agent(&l.agent)?,
        phase: state(&l.state)?,
        claimed: time(l.claimed_at.as_ref()).unwrap_or_else(SystemTime::now),
        expires: time(l.expires_at.as_ref()).ok_or_else(|| bad("lease", "no expires_at"))?,
        lease_id: l.lease_id.clone(),
        token: l.token,
    })
}

fn approval(a: &pb::ApprovalStatus) -> Result<ApprovalView, Failure> {
    let artifact = artifact(&a.artifact)?;
    Ok(match a.status.as_str() {
        "required" => ApprovalView::Required { artifact },
        "awaiting" => ApprovalView::Awaiting { artifact },
        "approved" => ApprovalView::Approved {
            artifact,
            record: a
                .record
                .as_ref()
                .map(|r| -> Result<Approval, Failure> {
                    Ok(Approval {
                        phase: r.phase.parse().map_err(|_| bad("phase", &r.phase))?,
                        at: time(r.approved_at.as_ref())
                            .ok_or_else(|| bad("approval", "no approved_at"))?,
                        approver: r.approver.clone(),
                        sha256: opt(&r.sha256),
                        commit: opt(&r.commit),
                    })
                })
                .transpose()?,
            stale: a.stale,
        },
        other => return Err(bad("approval status", other)),
    })
}

/// `status --task`'s view from a `GetTask` answer.
pub fn view(d: &pb::TaskDetail) -> Result<TaskView, Failure> {
    let s = d
        .summary
        .as_ref()
        .ok_or_else(|| bad("task", "no summary"))?;
    Ok(TaskView {
        task: task(&s.task)?,
        state_file: PathBuf::from(&d.state_file),
        tracked: s.tracked,
        state: maybe_state(&s.state)?,
        parent: d
            .parent
            .as_ref()
            .map(|p| Ok::<_, Failure>((task(&p.task)?, maybe_state(&p.state)?)))
            .transpose()?,
        artifacts: d
            .artifacts
            .iter()
            .map(|a| {
                Ok(ArtifactInfo {
                    artifact: artifact(&a.artifact)?,
                    bytes: a.bytes,
                    blank: a.blank,
                })
            })
            .collect::<Result<_, Failure>>()?,
        approval: d.approval.as_ref().map(approval).transpose()?,
        lease: d.lease.as_ref().map(lease).transpose()?,
        implementers: d
            .implementers
            .iter()
            .map(|a| agent(a))
            .collect::<Result<_, _>>()?,
        subtasks: d
            .subtasks
            .iter()
            .map(|t| task(t))
            .collect::<Result<_, _>>()?,
        guidance: d
            .guidance
            .as_ref()
            .map(|g| -> Result<Guidance, Failure> {
                Ok(Guidance {
                    allowed: g.allowed.clone(),
                    forbidden: g.forbidden.clone(),
                    next_artifact: opt(&g.next_artifact),
                    next: g.next.iter().map(|s| state(s)).collect::<Result<_, _>>()?,
                    command: g.command.clone(),
                })
            })
            .transpose()?,
        verdicts: s.verdicts.as_ref().map(verdicts),
        attention: opt(&s.attention),
    })
}

fn verdicts(v: &pb::SubtaskVerdicts) -> SubtaskVerdicts {
    SubtaskVerdicts {
        pass: v.pass,
        fail: v.fail,
        needs_review: v.needs_review,
        no_verdict: v.no_verdict,
        not_terminal: v.not_terminal.clone(),
        summary: v.summary.clone(),
    }
}

/// A `--list` row (and its sub-tasks') from a `ListTasks` answer.
pub fn list_entry(s: &pb::TaskSummary) -> Result<ListEntry, Failure> {
    Ok(ListEntry {
        task: task(&s.task)?,
        state: maybe_state(&s.state)?,
        tracked: s.tracked,
        next: s.next.iter().map(|n| state(n)).collect::<Result<_, _>>()?,
        approval_stale: s.approval_stale,
        approval_missing: s.approval_missing,
        lease_holder: (!s.lease_holder.is_empty())
            .then(|| agent(&s.lease_holder))
            .transpose()?,
        subtasks: s
            .subtasks
            .iter()
            .map(list_entry)
            .collect::<Result<_, _>>()?,
        error: opt(&s.error),
        verdicts: s.verdicts.as_ref().map(verdicts),
        attention: opt(&s.attention),
    })
}

pub fn folder_report(r: &pb::FolderReport) -> Result<FolderReport, Failure> {
    Ok(FolderReport {
        task: task(&r.task)?,
        state: maybe_state(&r.state)?,
        tracked: r.tracked,
        out_of_order: artifacts(&r.out_of_order)?,
    })
}

fn unaddressable(u: &pb::Unaddressable) -> Unaddressable {
    Unaddressable {
        folder: u.folder.clone(),
        path: PathBuf::from(&u.path),
        why: u.why.clone(),
        rename_to: opt(&u.rename_to),
    }
}

pub fn project_folders(r: &pb::ValidateFolderResponse) -> Result<ProjectFolders, Failure> {
    Ok(ProjectFolders {
        reports: r
            .reports
            .iter()
            .map(folder_report)
            .collect::<Result<_, _>>()?,
        errors: r
            .errors
            .iter()
            .map(|e| {
                Ok(TaskError {
                    task: task(&e.task)?,
                    error: e.error.clone(),
                })
            })
            .collect::<Result<_, Failure>>()?,
        unaddressable: r.unaddressable.iter().map(unaddressable).collect(),
    })
}

pub fn audit(r: &pb::AuditResponse) -> Result<AuditReport, Failure> {
    let category3 = match r.code_edits.as_ref().and_then(|c| c.result.as_ref()) {
        Some(pb::code_edits::Result::Skipped(reason)) => Category3::Skipped {
            reason: reason.clone(),
        },
        Some(pb::code_edits::Result::Checked(c)) => Category3::Checked {
            checked: c
                .checked
                .iter()
                .map(|t| task(t))
                .collect::<Result<_, _>>()?,
            modifications: c
                .modifications
                .iter()
                .map(|m| {
                    Ok(Modification {
                        task: task(&m.task)?,
                        state: state(&m.state)?,
                        path: m.path.clone(),
                        commit: m.commit.clone(),
                        commit_time: time_text(m.commit_time.as_ref()),
                        attributed: m.attributed,
                    })
                })
                .collect::<Result<_, Failure>>()?,
        },
        None => return Err(bad("audit", "no code_edits")),
    };
    Ok(AuditReport {
        project: PathBuf::from(&r.project),
        tasks: r
            .tasks
            .iter()
            .map(|t| {
                Ok(AuditTask {
                    task: task(&t.task)?,
                    state: maybe_state(&t.state)?,
                    tracked: t.tracked,
                    present: artifacts(&t.present)?,
                    out_of_order: artifacts(&t.out_of_order)?,
                    consistency: t
                        .consistency
                        .iter()
                        .map(|f| {
                            Ok(Finding {
                                severity: match f.severity.as_str() {
                                    "warn" => Severity::Warn,
                                    "fail" => Severity::Fail,
                                    other => return Err(bad("severity", other)),
                                },
                                message: f.message.clone(),
                                suggestion: maybe_state(&f.suggestion)?,
                            })
                        })
                        .collect::<Result<_, Failure>>()?,
                    error: opt(&t.error),
                })
            })
            .collect::<Result<_, Failure>>()?,
        category3,
        violations: r.violations.clone(),
        errors: r.errors.clone(),
        unaddressable: r.unaddressable.iter().map(unaddressable).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_cut_to_the_second_as_the_files_hold_them() {
        let t = prost_types::Timestamp {
            seconds: 1_796_083_200,
            nanos: 999_999_999,
        };
        assert_eq!(time_text(Some(&t)), "2026-12-01T00:00:00Z");
        assert_eq!(time_text(None), "");
    }

    #[test]
    fn durations_read_as_whole_milliseconds_and_never_negative() {
        let d = |seconds, nanos| prost_types::Duration { seconds, nanos };
        assert_eq!(millis(Some(&d(1, 999_999))), 1000);
        assert_eq!(millis(Some(&d(-1, 0))), 0);
        assert_eq!(millis(None), 0);
        assert_eq!(millis(Some(&d(i64::MAX, 0))), u64::MAX);
    }

    #[test]
    fn an_unreadable_state_from_the_coordinator_is_a_usage_error() {
        let row = pb::TaskSummary {
            task: "t".into(),
            state: "not-a-phase".into(),
            ..Default::default()
        };
        match list_entry(&row) {
            Err(Failure::Usage(m)) => assert!(m.contains("unreadable state 'not-a-phase'"), "{m}"),
            _ => panic!("accepted an unknown state"),
        }
    }
}
