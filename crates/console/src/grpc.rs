//! The console as a client of the coordinator: every call carries the signed-in operator's
//! token as `authorization: Bearer …` (as the CLI's calls do), so the coordinator applies
//! the same checks to a button as to a command.

use std::time::Duration;

use automaton_proto::v1 as pb;
use axum::http::StatusCode;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// How long a unary call may take (streams have no deadline).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What every call carries: the bearer token, if any, and a deadline for unary calls.
#[derive(Clone, Debug)]
pub struct Stamp {
    bearer: Option<AsciiMetadataValue>,
    deadline: Option<Duration>,
}

impl Stamp {
    /// The stamp for `token` (`None` when the coordinator has no tokens). A token a header
    /// cannot carry is refused here, before any call.
    pub fn new(token: Option<&str>, deadline: Option<Duration>) -> Result<Stamp, String> {
        let bearer = match token {
            Some(t) if !t.is_empty() => Some(
                format!("Bearer {t}")
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| "the token has characters a header cannot carry".to_string())?,
            ),
            _ => None,
        };
        Ok(Stamp { bearer, deadline })
    }
}

impl Interceptor for Stamp {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.bearer {
            req.metadata_mut().insert("authorization", v.clone());
        }
        if let Some(d) = self.deadline {
            req.set_timeout(d);
        }
        Ok(req)
    }
}

type Intercepted = InterceptedService<Channel, Stamp>;

/// The Tasks client for one caller.
pub fn tasks(channel: &Channel, stamp: Stamp) -> pb::tasks_client::TasksClient<Intercepted> {
    pb::tasks_client::TasksClient::with_interceptor(channel.clone(), stamp)
}

/// The Workers client for one caller.
pub fn workers(channel: &Channel, stamp: Stamp) -> pb::workers_client::WorkersClient<Intercepted> {
    pb::workers_client::WorkersClient::with_interceptor(channel.clone(), stamp)
}

/// The Events client for one caller.
pub fn events(channel: &Channel, stamp: Stamp) -> pb::events_client::EventsClient<Intercepted> {
    pb::events_client::EventsClient::with_interceptor(channel.clone(), stamp)
}

/// A coordinator's refusal as the HTTP status that says the same, and its one-line message.
pub fn http_status(status: &tonic::Status) -> (StatusCode, String) {
    use tonic::Code;
    let code = match status.code() {
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::FailedPrecondition | Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        _ => StatusCode::BAD_GATEWAY,
    };
    let msg = status.message().lines().next().unwrap_or("").trim();
    let msg = if msg.is_empty() {
        format!("the coordinator answered {:?}", status.code())
    } else {
        msg.to_string()
    };
    (code, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_http() {
        let cases = [
            (
                tonic::Status::permission_denied("no"),
                StatusCode::FORBIDDEN,
            ),
            (tonic::Status::not_found("no"), StatusCode::NOT_FOUND),
            (
                tonic::Status::invalid_argument("no"),
                StatusCode::BAD_REQUEST,
            ),
            (
                tonic::Status::failed_precondition("no"),
                StatusCode::CONFLICT,
            ),
            (
                tonic::Status::unavailable("no"),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
        ];
        for (s, want) in cases {
            assert_eq!(http_status(&s).0, want);
        }
        assert_eq!(http_status(&tonic::Status::not_found("a\nb")).1, "a");
        assert!(
            http_status(&tonic::Status::internal(""))
                .1
                .contains("Internal")
        );
    }

    #[test]
    fn stamp_refuses_odd_tokens() {
        assert!(Stamp::new(Some("good-token"), None).is_ok());
        assert!(Stamp::new(Some("bad\ntoken"), None).is_err());
        assert!(Stamp::new(None, None).is_ok());
    }
}
