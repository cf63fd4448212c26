//! Webhooks when a person is needed (`[[webhooks]]`, docs/webhooks.md): the coordinator's
//! event feed read like any watcher's, the events that need a person turned into
//! `automaton-webhooks` notifications (and where finished work went: `merged`,
//! `pull_request_opened`, `delivery_failed`). Delivery (queues, retries, signatures) is that
//! crate's; this file only decides which events count and what they say. It runs while the
//! coordinator serves (with `store = etcd`, on the leader only), and must never slow a
//! request: `notify` does not wait.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use automaton_engine::Event;
use automaton_webhooks::{Event as Hook, Notification, Webhooks};
use automaton_workflow::{EventKind, Gate, Phase};
use tokio::sync::{broadcast, watch};

use crate::state::Coordinator;

/// The same task's `human_intervention` twice within this is one notification (the
/// transition and the verdict's own event say the same thing).
const SAME_NEED: Duration = Duration::from_secs(10);

/// What a coordinator event tells a person, if anything.
fn need(e: &Event) -> Option<Hook> {
    let entered = e.moved.map(|(_, to)| to);
    Some(match e.kind {
        EventKind::Transitioned => match entered {
            Some(to) if to.gate == Gate::AwaitingApproval => Hook::AwaitingApproval,
            Some(to) if to.phase == Phase::HumanIntervention => Hook::HumanIntervention,
            _ => return None,
        },
        EventKind::HumanIntervention => Hook::HumanIntervention,
        EventKind::TaskHeld => Hook::Held,
        EventKind::WorkerLost => Hook::WorkerLost,
        EventKind::SubtaskTooLarge => Hook::SubtaskTooLarge,
        EventKind::Merged => Hook::Merged,
        EventKind::PullRequestOpened => Hook::PullRequestOpened,
        EventKind::DeliveryFailed => Hook::DeliveryFailed,
        _ => return None,
    })
}

/// The one line a person reads first.
fn summary(hook: Hook, e: &Event) -> String {
    let state = e.moved.map(|(_, to)| to.to_string()).unwrap_or_default();
    match hook {
        Hook::AwaitingApproval => format!(
            "task '{}' waits for approval ({state}): automaton approve {}",
            e.task, e.task
        ),
        Hook::HumanIntervention => format!("task '{}' needs a person: {}", e.task, e.detail),
        Hook::Held => format!(
            "task '{}' is held from dispatch: {} (automaton stop {} --resume lets it go)",
            e.task, e.detail, e.task
        ),
        Hook::WorkerLost => format!("worker '{}' was lost: {}", e.agent, e.detail),
        Hook::SubtaskTooLarge => format!(
            "sub-task '{}' is too large for every worker: {}",
            e.task, e.detail
        ),
        Hook::Merged => format!("task '{}' is delivered: {}", e.task, e.detail),
        Hook::PullRequestOpened => {
            format!("task '{}' has a pull request: {}", e.task, e.detail)
        }
        Hook::DeliveryFailed => format!(
            "task '{}''s delivery failed: {} (automaton status --task {} says where it stands)",
            e.task, e.detail, e.task
        ),
    }
}

fn notification(hook: Hook, e: &Event, link: Option<&str>) -> Notification {
    let mut n = Notification::new(hook, summary(hook, e))
        .detail("kind", e.kind.name())
        .detail("detail", e.detail.as_str());
    n.time = e.at;
    if !e.task.is_empty() {
        n = n.task(e.task.as_str());
        if let Some(base) = link {
            n = n.link(format!("{}/task/{}", base.trim_end_matches('/'), e.task));
        }
    }
    if !e.agent.is_empty() {
        n = n.worker(e.agent.as_str());
    }
    n
}

/// Reads `coord`'s events until `stop`, notifying `hooks`; closes them (bounded) at the end.
/// `link`: the console's URL, for a link to the task's page.
pub(crate) fn spawn(
    coord: &Arc<Coordinator>,
    hooks: Webhooks,
    link: Option<String>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let mut sub = coord.engine.subscribe_events();
    tokio::spawn(async move {
        let mut recent: HashMap<String, Instant> = HashMap::new();
        loop {
            let e = tokio::select! {
                e = sub.rx.recv() => e,
                _ = stop.changed() => break,
            };
            let e = match e {
                Ok(e) => e,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(
                        missed = n,
                        "webhooks: the event feed ran ahead; events that needed a person may not have been sent"
                    );
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break,
            };
            let Some(hook) = need(&e) else {
                continue;
            };
            if hook == Hook::HumanIntervention {
                let now = Instant::now();
                recent.retain(|_, at| now.duration_since(*at) < SAME_NEED);
                if recent.insert(e.task.clone(), now).is_some() {
                    continue;
                }
            }
            hooks.notify(notification(hook, &e, link.as_deref()));
        }
        drop(sub);
        hooks.close(Duration::from_secs(5)).await;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: &str, task: &str, agent: &str, detail: &str) -> Event {
        let moved = detail
            .split_once(" → ")
            .and_then(|(from, to)| Some((from.parse().ok()?, to.parse().ok()?)));
        Event {
            seq: 1,
            at: std::time::SystemTime::now(),
            kind: kind.parse().expect("an event kind"),
            task: task.into(),
            agent: agent.into(),
            token: 0,
            detail: detail.into(),
            moved,
        }
    }

    #[test]
    fn only_what_needs_a_person_or_says_where_work_went_is_a_webhook() {
        let cases = [
            (
                ev("transitioned", "t", "a", "new → research:awaiting_approval"),
                Some(Hook::AwaitingApproval),
            ),
            (ev("transitioned", "t", "a", "new → research"), None),
            (
                ev("transitioned", "t", "a", "referee → human_intervention"),
                Some(Hook::HumanIntervention),
            ),
            (ev("task_held", "t", "", "2 failed runs"), Some(Hook::Held)),
            (
                ev("worker_lost", "", "gpu-a", "silent"),
                Some(Hook::WorkerLost),
            ),
            (
                ev("subtask_too_large", "p/s", "", "needs 90k"),
                Some(Hook::SubtaskTooLarge),
            ),
            (
                ev(
                    "merged",
                    "t",
                    "",
                    "automaton/t into main at abc (fast-forward)",
                ),
                Some(Hook::Merged),
            ),
            (
                ev("pull_request_opened", "t", "", "#3 https://forge/pr/3"),
                Some(Hook::PullRequestOpened),
            ),
            (
                ev("delivery_failed", "t", "", "the remote refused the push"),
                Some(Hook::DeliveryFailed),
            ),
            (
                ev("delivery_requested", "t", "", "automaton/t into main"),
                None,
            ),
            (ev("lease_granted", "t", "a", ""), None),
        ];
        for (e, want) in cases {
            assert_eq!(need(&e), want, "{e:?}");
        }
    }

    #[test]
    fn a_notification_names_the_task_the_worker_and_links_the_console() {
        let e = ev(
            "transitioned",
            "t",
            "gpu-a",
            "new → research:awaiting_approval",
        );
        let n = notification(Hook::AwaitingApproval, &e, Some("http://console:8080/"));
        assert_eq!(n.task.as_deref(), Some("t"));
        assert_eq!(n.worker.as_deref(), Some("gpu-a"));
        assert_eq!(n.link.as_deref(), Some("http://console:8080/task/t"));
        assert!(
            n.summary.contains("research:awaiting_approval"),
            "{}",
            n.summary
        );
        assert!(n.summary.contains("automaton approve t"), "{}", n.summary);
    }
}
