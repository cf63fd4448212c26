//! The plain-text output of each status command (004 §2, §7, §10, §11).

use std::fmt::Write;

use automaton_store::{
    ApprovalView, ApproveOutcome, AuditReport, Category3, FolderReport, Lease, ListEntry, Listing,
    Project, ProjectFolders, TaskView, TransitionOutcome, Unaddressable, Upgraded, format_time,
};
use automaton_workflow::{Severity, State, TaskName};

fn join_states(states: &[State], sep: &str) -> String {
    if states.is_empty() {
        return "—".into();
    }
    states
        .iter()
        .map(State::to_string)
        .collect::<Vec<_>>()
        .join(sep)
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

/// A coordinator's word on a task's agent runs (after the spec's block; empty when there is
/// nothing to say, so prompts that read the block see it unchanged).
pub fn runs(runs: &[automaton_proto::v1::Run], held: &str) -> String {
    let mut out = String::new();
    if !held.is_empty() {
        let _ = writeln!(out, "Held from dispatch: {held}");
    }
    if !runs.is_empty() {
        let _ = writeln!(out, "Last runs:");
        for r in runs {
            let reason = if r.stop_reason.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.stop_reason)
            };
            let detail = if r.detail.is_empty() {
                String::new()
            } else {
                format!(": {}", r.detail)
            };
            // What the run used against what it was sized for, and who said so.
            let source = if r.peak_context_source.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.peak_context_source)
            };
            let peak = match (r.peak_context_tokens, r.estimated_tokens) {
                (0, 0) => String::new(),
                (0, e) => format!(", sized {e} tokens"),
                (p, 0) => format!(", peak {p} tokens{source}"),
                (p, e) => format!(", peak {p} of {e} tokens sized{source}"),
            };
            // The commit it was served: what a review read.
            let read = if r.commit.is_empty() {
                String::new()
            } else {
                format!(", read {}", short(&r.commit))
            };
            let _ = writeln!(
                out,
                "  - {} by {} (token {}): {}{reason}{detail}, started {}{peak}{read}",
                r.phase,
                r.worker,
                r.token,
                r.state,
                crate::from_wire::time_text(r.started_at.as_ref())
            );
            for w in &r.warnings {
                let _ = writeln!(out, "      warning: {w}");
            }
        }
        // The newest failed run's output: what the agent said last is most often why.
        if let Some(r) = runs.iter().rev().find(|r| !r.output_tail.trim().is_empty()) {
            let lines: Vec<&str> = r.output_tail.trim_end().lines().collect();
            let shown = &lines[lines.len().saturating_sub(TAIL_LINES)..];
            let _ = writeln!(
                out,
                "Output of the {} run by {} (token {}), last {} of {} lines:",
                r.phase,
                r.worker,
                r.token,
                shown.len(),
                lines.len()
            );
            for l in shown {
                let _ = writeln!(out, "      {l}");
            }
        }
    }
    out
}

/// How many lines of a failed run's output `runs` shows.
const TAIL_LINES: usize = 20;

pub fn task(v: &TaskView, multi_agent: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Task: {}", v.task);
    let phase = match (v.tracked, v.state) {
        (true, Some(st)) => format!("{st} (from .state)"),
        (false, Some(st)) => format!(
            "{st} (inferred from artifacts; untracked: no .state file. Run --upgrade --task {} to track it)",
            v.task
        ),
        (_, None) => "unknown (no .state file found)".to_string(),
    };
    let _ = writeln!(s, "Phase: {phase}");
    let _ = writeln!(s, "State file: {}", v.state_file.display());
    if let Some((parent, pstate)) = &v.parent {
        let ps = pstate.map_or("unknown".to_string(), |p| p.to_string());
        let _ = writeln!(s, "Parent task: {parent} (phase: {ps})");
    }
    if let Some(a) = &v.approval {
        let line = match a {
            ApprovalView::Required { artifact } => format!(
                "required: {artifact} needs a person's sign-off once written ({}:awaiting_approval)",
                v.state.map_or(String::new(), |s| s.phase.to_string())
            ),
            ApprovalView::Awaiting { artifact } => {
                format!("awaiting approval of {artifact}: a person runs --approve")
            }
            ApprovalView::Approved {
                artifact,
                record: None,
                ..
            } => {
                format!(
                    "NOT RECORDED: .state.approvals has no record of approving {artifact}, so this state cannot be left. A person runs --approve"
                )
            }
            ApprovalView::Approved {
                artifact,
                record: Some(r),
                stale: true,
            } => match &r.commit {
                Some(c) => format!(
                    "STALE: {artifact} or the task branch changed after {} approved it at {} (commit {}). The code review runs again on the new head, or a person who read it runs --approve --revision HEAD",
                    r.approver,
                    format_time(r.at),
                    short(c)
                ),
                None => format!(
                    "STALE: {artifact} changed after {} approved it at {}. Run --approve to approve the new content",
                    r.approver,
                    format_time(r.at)
                ),
            },
            ApprovalView::Approved {
                artifact,
                record: Some(r),
                stale: false,
            } => match &r.sha256 {
                Some(h) => format!(
                    "approved by {} at {} ({artifact} sha256 {}{})",
                    r.approver,
                    format_time(r.at),
                    short(h),
                    r.commit
                        .as_deref()
                        .map(|c| format!(", commit {}", short(c)))
                        .unwrap_or_default()
                ),
                None => format!(
                    "approved by {} at {} (no content hash recorded)",
                    r.approver,
                    format_time(r.at)
                ),
            },
        };
        let _ = writeln!(s, "Approval: {line}");
    }
    match &v.lease {
        Some(l) => {
            let _ = writeln!(
                s,
                "Lease: held by {} until {} (lease {}, token {})",
                l.agent,
                format_time(l.expires),
                l.lease_id,
                l.token
            );
        }
        None if multi_agent => {
            let _ = writeln!(s, "Lease: none (claim with --claim --agent ID)");
        }
        None => {}
    }
    if !v.implementers.is_empty() {
        let names: Vec<_> = v.implementers.iter().map(|a| a.as_str()).collect();
        let _ = writeln!(s, "Implementer: {}", names.join(", "));
    }
    let arts: Vec<String> = v
        .artifacts
        .iter()
        .map(|a| {
            if a.blank {
                format!("{} (empty)", a.artifact)
            } else {
                a.artifact.to_string()
            }
        })
        .collect();
    let _ = writeln!(
        s,
        "Artifacts: {}",
        if arts.is_empty() {
            "none".to_string()
        } else {
            arts.join(", ")
        }
    );
    if !v.subtasks.is_empty() {
        let subs: Vec<_> = v.subtasks.iter().map(TaskName::to_string).collect();
        let _ = writeln!(s, "Sub-tasks: {}", subs.join(", "));
    }
    if let Some(verdicts) = &v.verdicts {
        let _ = writeln!(s, "Sub-task verdicts: {}", verdicts_text(verdicts));
    }
    if let Some(g) = &v.guidance {
        let _ = writeln!(s, "Allowed actions:");
        for a in &g.allowed {
            let _ = writeln!(s, "  - {a}");
        }
        let _ = writeln!(s, "Forbidden actions:");
        for a in &g.forbidden {
            let _ = writeln!(s, "  - {a}");
        }
        let _ = writeln!(
            s,
            "Next artifact needed: {}",
            g.next_artifact.as_deref().unwrap_or("—")
        );
        let _ = writeln!(s, "Next phase: {}", join_states(&g.next, " or "));
        let _ = writeln!(s, "Command to proceed: {}", g.command);
    } else {
        let _ = writeln!(s, "Next artifact needed: SPEC.md");
        let _ = writeln!(
            s,
            "Command to proceed: automaton status --upgrade --task {} (writes .state = new)",
            v.task
        );
    }
    s
}

/// Seed 002's counts, and the sub-tasks not terminal yet.
pub fn verdicts_text(v: &automaton_store::SubtaskVerdicts) -> String {
    if v.not_terminal.is_empty() {
        v.summary.clone()
    } else {
        format!(
            "{} (not terminal yet: {})",
            v.summary,
            v.not_terminal.join(", ")
        )
    }
}

fn phase_cell(e: &ListEntry) -> String {
    if e.error.is_some() {
        return "(unreadable)".to_string();
    }
    let mut cell = match (e.tracked, e.state) {
        (true, Some(s)) => s.to_string(),
        (false, Some(s)) => format!("{s} (untracked)"),
        (_, None) => "unknown (no .state)".to_string(),
    };
    if e.approval_stale {
        cell.push_str(" (stale approval)");
    }
    if e.approval_missing {
        cell.push_str(" (no approval record)");
    }
    if let Some(a) = &e.lease_holder {
        let _ = write!(cell, " [leased: {a}]");
    }
    cell
}

fn next_step(e: &ListEntry) -> String {
    if let Some(err) = &e.error {
        return format!("ERROR: {err}");
    }
    match e.state.and_then(State::approval_target) {
        Some(approved) => format!("{approved} (needs --approve)"),
        None => join_states(&e.next, " or "),
    }
}

/// An unaddressable folder's Phase and Next Step cells.
fn unaddressable_cells(u: &Unaddressable) -> (String, String) {
    (
        "(invalid name)".to_string(),
        format!("{}: {}", u.advice(), u.why),
    )
}

pub fn list(project: &Project, listing: &Listing) -> String {
    let entries = &listing.tasks;
    if entries.is_empty() && listing.unaddressable.is_empty() {
        return format!(
            "No tasks in {}/. Create one with --create-task NAME.\n",
            project.tasks_dir().display()
        );
    }
    let mut rows: Vec<(String, String, String)> = Vec::new();
    for e in entries {
        rows.push((e.task.to_string(), phase_cell(e), next_step(e)));
        for sub in &e.subtasks {
            rows.push((format!("  {}", sub.task), phase_cell(sub), next_step(sub)));
        }
    }
    for u in &listing.unaddressable {
        let (phase, next) = unaddressable_cells(u);
        rows.push((u.folder.clone(), phase, next));
    }
    // 004's column widths (25, 20), wider when a cell needs it.
    let w1 = (rows.iter().map(|r| r.0.len()).max().unwrap_or(0) + 2).max(25);
    let w2 = (rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0) + 2).max(20);
    let mut s = format!("{:<w1$}{:<w2$}{}\n", "Task", "Phase", "Next Step");
    for (t, p, n) in rows {
        let _ = writeln!(s, "{t:<w1$}{p:<w2$}{n}");
    }
    s
}

pub fn folder(r: &FolderReport) -> String {
    let mut s = format!("Task: {}\n", r.task);
    let Some(state) = r.state else {
        s.push_str("Phase: unknown (no .state file found)\n");
        s.push_str("Folder validation: FAIL — task was created manually (no .state file). Use 'automaton status --create-task' to create tasks properly (or --upgrade for a task from before .state).\n");
        return s;
    };
    let _ = writeln!(s, "Phase: {state} (from .state)");
    if r.out_of_order.is_empty() {
        s.push_str("Folder validation: PASS — no out-of-order artifacts found\n");
        return s;
    }
    s.push_str("Folder validation: FAIL — found out-of-order artifacts:\n");
    for a in &r.out_of_order {
        let _ = writeln!(
            s,
            "  - {a} (belongs to {} phase, not yet reached)",
            a.phase()
        );
    }
    let _ = writeln!(
        s,
        "These artifacts indicate phase-skipping. The task is in {} phase but has artifacts from future phases.",
        state.phase
    );
    s.push_str("Remove the out-of-order artifacts or revert to the correct phase.\n");
    s
}

/// `--validate-folder` without `--task`: one block per task, then the verdict for all.
pub fn folders(project: &Project, all: &ProjectFolders) -> String {
    let total = all.reports.len() + all.errors.len() + all.unaddressable.len();
    if total == 0 {
        return format!(
            "No tasks in {}/: nothing to validate.\nFolder validation: PASS — no out-of-order artifacts found\n",
            project.tasks_dir().display()
        );
    }
    let mut blocks: Vec<String> = all.reports.iter().map(folder).collect();
    for e in &all.errors {
        blocks.push(format!(
            "Task: {}\nFolder validation: ERROR — {}\n",
            e.task, e.error
        ));
    }
    for u in &all.unaddressable {
        blocks.push(format!(
            "Task folder: {}\nFolder validation: FAIL — task folder created manually: {}. {}.\n",
            u.folder,
            u.why,
            u.advice()
        ));
    }
    let failed = all.reports.iter().filter(|r| !r.passed()).count() + all.unaddressable.len();
    let mut s = blocks.join("\n");
    s.push('\n');
    if !all.errors.is_empty() {
        let _ = writeln!(
            s,
            "Folder validation of {total} task folders: ERROR — {} could not be read, {failed} failed",
            all.errors.len()
        );
    } else if failed == 0 {
        let _ = writeln!(s, "Folder validation of {total} task folders: PASS");
    } else {
        let _ = writeln!(
            s,
            "Folder validation of {total} task folders: FAIL — {failed} failed"
        );
    }
    s
}

pub fn audit(r: &AuditReport) -> String {
    let mut s = format!("Audit Report for {}\n", r.project.display());
    s.push_str("\n=== Category 1: Out-of-order Artifacts ===\n");
    for t in r.tasks.iter().filter(|t| t.tracked) {
        let state = t.state.map_or(String::new(), |s| s.to_string());
        if t.out_of_order.is_empty() {
            let _ = writeln!(s, "[PASS] {}: no violations", t.task);
        } else {
            let found: Vec<String> = t
                .out_of_order
                .iter()
                .map(|a| format!("{a} ({} phase artifact)", a.phase()))
                .collect();
            let _ = writeln!(
                s,
                "[FAIL] {} (phase: {state}): found {}",
                t.task,
                found.join(", ")
            );
        }
    }
    s.push_str("\n=== Category 2: State-Artifact Inconsistency ===\n");
    for t in r.tasks.iter().filter(|t| t.tracked) {
        let Some(state) = t.state else { continue };
        if let Some(e) = &t.error {
            let _ = writeln!(s, "[ERROR] {}: not checked: {e}", t.task);
            continue;
        }
        if t.consistency.is_empty() {
            let arts: Vec<String> = t.present.iter().map(|a| a.to_string()).collect();
            let what = if arts.is_empty() {
                "no artifacts yet".to_string()
            } else {
                format!(
                    "{} exist{}",
                    arts.join(", "),
                    if arts.len() == 1 { "s" } else { "" }
                )
            };
            let _ = writeln!(
                s,
                "[PASS] {}: .state (\"{state}\") matches artifacts ({what})",
                t.task
            );
        }
        for f in &t.consistency {
            let tag = if f.severity == Severity::Fail {
                "FAIL"
            } else {
                "WARN"
            };
            let fix = f
                .suggestion
                .map(|x| format!(" — suggested correction: {x}"))
                .unwrap_or_default();
            let _ = writeln!(s, "[{tag}] {}: {}{fix}", t.task, f.message);
        }
    }
    s.push_str("\n=== Category 3: Unauthorized Modifications ===\n");
    match &r.category3 {
        Category3::Skipped { reason } => {
            let _ = writeln!(s, "Skipped: {reason}");
        }
        Category3::Checked {
            checked,
            modifications,
        } => {
            if checked.is_empty() {
                s.push_str("No task is in a phase that forbids code edits; nothing to check.\n");
            }
            for t in checked {
                let mods: Vec<_> = modifications.iter().filter(|m| &m.task == t).collect();
                if mods.is_empty() {
                    let _ = writeln!(
                        s,
                        "[PASS] {t}: no code modifications outside implement phase"
                    );
                }
                for m in mods {
                    let tag = if m.attributed { "FAIL" } else { "WARN" };
                    let note = if m.attributed {
                        ""
                    } else {
                        "; another task is in an edit phase, so it may be that task's"
                    };
                    let _ = writeln!(
                        s,
                        "[{tag}] {t}: {} was modified during {} phase (state: {}, commit {} at {}{note})",
                        m.path, m.state.phase, m.state, m.commit, m.commit_time
                    );
                }
            }
        }
    }
    s.push_str("\n=== Category 4: Manually Created Task Folders ===\n");
    let untracked: Vec<_> = r
        .tasks
        .iter()
        .filter(|t| !t.tracked && t.error.is_none())
        .collect();
    if untracked.is_empty() && r.unaddressable.is_empty() {
        s.push_str("[PASS] every task folder has a .state file\n");
    }
    for u in &r.unaddressable {
        let _ = writeln!(
            s,
            "[FAIL] {}: manually created task folder — {}. {}",
            u.folder,
            u.why,
            u.advice()
        );
    }
    for t in untracked {
        let _ = writeln!(
            s,
            "[FAIL] {}: no .state file — task was created manually. Use --create-task for new tasks, or --upgrade to track a task from before .state",
            t.task
        );
    }
    for e in &r.errors {
        let _ = writeln!(s, "ERROR: {e}");
    }
    s.push_str("\n=== Summary ===\n");
    let _ = writeln!(s, "{} tasks audited", r.tasks.len() + r.unaddressable.len());
    let _ = writeln!(s, "{} violations found", r.violations.len());
    for v in &r.violations {
        let _ = writeln!(s, "  - {v}");
    }
    if !r.errors.is_empty() {
        let _ = writeln!(s, "{} errors", r.errors.len());
    }
    s
}

pub fn transitioned(o: &TransitionOutcome) -> String {
    let mut s = format!(
        "Transitioned task '{}' from '{}' to '{}'.",
        o.task, o.from, o.to
    );
    if let Some(l) = &o.released {
        let _ = write!(s, " Released the lease of {} (token {}).", l.agent, l.token);
    }
    s.push('\n');
    s
}

pub fn approved(o: &ApproveOutcome) -> String {
    let sha = o.approval.sha256.as_deref().map(short).unwrap_or("-");
    let commit = o
        .approval
        .commit
        .as_deref()
        .map(|c| format!(", commit {}", short(c)))
        .unwrap_or_default();
    format!(
        "Approved task '{}': '{}' → '{}' by {} at {} ({} sha256 {sha}{commit}).\n",
        o.task,
        o.from,
        o.to,
        o.approval.approver,
        format_time(o.approval.at),
        o.from
            .phase
            .artifact()
            .map_or("artifact", |a| a.file_name()),
    )
}

pub fn claimed(task: &TaskName, l: &Lease, renewed: bool) -> String {
    let verb = if renewed {
        "Renewed the lease on"
    } else {
        "Claimed"
    };
    format!(
        "{verb} task '{task}' for {} until {} (lease {}, token {}).\n",
        l.agent,
        format_time(l.expires),
        l.lease_id,
        l.token
    )
}

pub fn upgraded(done: &[Upgraded], skipped: &[Unaddressable]) -> String {
    let mut s = String::new();
    for u in skipped {
        let _ = writeln!(
            s,
            "Skipped '{}': {}. {}; --upgrade leaves it alone.",
            u.folder,
            u.why,
            u.advice()
        );
    }
    if done.is_empty() {
        s.push_str("Nothing to upgrade: every task has a .state file.\n");
        return s;
    }
    for u in done {
        let how = if u.inferred {
            "inferred from artifacts"
        } else {
            "no artifacts: starts as new"
        };
        let _ = writeln!(
            s,
            "Upgraded '{}': wrote .state = {} ({how})",
            u.task, u.state
        );
    }
    s
}
