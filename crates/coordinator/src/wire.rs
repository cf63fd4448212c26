//! What every gRPC handler shares: the wire's forms of times, durations and leases, and
//! the checks of who calls and what they name (an operator, the agent a token is bound to,
//! a task name). Below the services, so dispatch and the streams use them too.

use std::time::{Duration, Instant, SystemTime};

use automaton_engine::{Error, Live};
use automaton_proto::prost_types;
use automaton_proto::v1 as pb;
use automaton_workflow::{AgentId, TaskName};
use tonic::{Request, Status};

use crate::IntoStatus;
use crate::auth::{Caller, caller};
use crate::config::Role;

/// A time as the wire carries it, within the range a `Timestamp` may hold in JSON (and the
/// files hold: 1970 to 9999), so that no client's JSON mapping refuses it.
pub(crate) fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    automaton_store::clamp_time(t).into()
}

/// A length of time as the wire carries it (saturating at the largest it can hold).
pub(crate) fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: d.subsec_nanos() as i32,
    }
}

/// A duration a request sent, checked: negative or with `nanos` outside 0..1e9 it is
/// INVALID_ARGUMENT (prost would normalise the latter silently).
pub(crate) fn duration_arg(field: &str, d: &prost_types::Duration) -> Result<Duration, Status> {
    if d.seconds < 0 || d.nanos < 0 {
        return Err(Error::Invalid(format!(
            "{field} is negative ({}s {}ns): send a positive duration, or leave {field} unset for the default",
            d.seconds, d.nanos
        ))
        .into_status());
    }
    if d.nanos >= 1_000_000_000 {
        return Err(Error::Invalid(format!(
            "{field}.nanos is {}, outside 0..999999999: carry whole seconds in {field}.seconds",
            d.nanos
        ))
        .into_status());
    }
    Ok(Duration::new(d.seconds as u64, d.nanos as u32))
}

pub(crate) fn require_operator(c: &Caller, what: &str) -> Result<(), Status> {
    if c.role == Role::Operator {
        Ok(())
    } else {
        Err(Error::PermissionDenied(format!(
            "{what} needs an operator token; '{}' is {}",
            c.name,
            if c.role == Role::Worker {
                "a worker"
            } else {
                "an agent"
            }
        ))
        .into_status())
    }
}

/// The caller of `req`, who must be an operator to make the call `what`.
pub(crate) fn operator<T>(req: &Request<T>, what: &str) -> Result<Caller, Status> {
    let who = caller(req);
    require_operator(&who, what)?;
    Ok(who)
}

/// The agent an agent or worker token is bound to; `None` for operators, who may act for
/// any agent.
pub(crate) fn bound_agent(who: &Caller) -> Result<Option<AgentId>, Status> {
    match who.role {
        Role::Agent | Role::Worker => agent_id(&who.name).map(Some),
        Role::Operator => Ok(None),
    }
}

/// A task name as a request sent it.
pub(crate) fn task_name(s: &str) -> Result<TaskName, Status> {
    s.parse::<TaskName>()
        .map_err(|e| Error::Store(e.into()).into_status())
}

/// An agent id as a request (or a token's name) gives it.
pub(crate) fn agent_id(s: &str) -> Result<AgentId, Status> {
    s.parse::<AgentId>()
        .map_err(|e| Error::Store(e.into()).into_status())
}

pub(crate) fn lease_pb(l: &Live, renewed: bool) -> pb::Lease {
    let now = Instant::now();
    pb::Lease {
        task: l.task.to_string(),
        agent: l.agent.to_string(),
        lease_id: l.lease_id.clone(),
        token: l.token,
        state: l.state.to_string(),
        ttl: Some(duration(l.ttl)),
        expires_at: Some(timestamp(l.expires_at(now))),
        remaining: Some(duration(l.deadline.saturating_duration_since(now))),
        renewed,
        session_id: l.session.as_deref().unwrap_or_default().to_string(),
        claimed_at: Some(timestamp(l.claimed)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(seconds: i64, nanos: i32) -> prost_types::Duration {
        prost_types::Duration { seconds, nanos }
    }

    #[test]
    fn duration_arg_refuses_negative_and_out_of_range_nanos_in_one_line() {
        for (bad, says) in [
            (d(-1, 0), "ttl is negative"),
            (d(0, -1), "ttl is negative"),
            (d(i64::MIN, -999_999_999), "ttl is negative"),
            (d(0, 1_000_000_000), "ttl.nanos is 1000000000"),
            (d(i64::MAX, i32::MAX), "outside 0..999999999"),
        ] {
            let s = duration_arg("ttl", &bad).expect_err("refused");
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{bad:?}");
            assert!(s.message().contains(says), "{bad:?}: {}", s.message());
            assert!(!s.message().contains('\n'));
        }
        assert_eq!(
            duration_arg("ttl", &d(i64::MAX, 999_999_999)).ok(),
            Some(Duration::new(i64::MAX as u64, 999_999_999))
        );
        assert_eq!(duration_arg("ttl", &d(0, 0)).ok(), Some(Duration::ZERO));
    }

    #[test]
    fn durations_out_saturate_and_round_trip() {
        assert_eq!(duration(Duration::MAX), d(i64::MAX, 999_999_999));
        let x = Duration::new(1800, 5);
        assert_eq!(duration_arg("x", &duration(x)).ok(), Some(x));
    }

    #[test]
    fn timestamps_out_stay_within_what_json_can_hold() {
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 40);
        assert_eq!(timestamp(far).seconds, 253_402_300_799);
        let before = SystemTime::UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(timestamp(before), prost_types::Timestamp::default());
    }
}
