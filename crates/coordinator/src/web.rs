//! The operator's console in the coordinator process (`--web-listen`, `web_listen`;
//! docs/console.md). The page itself is `automaton-console`'s: a client of this
//! coordinator's own gRPC API, so every action it offers is the call the CLI makes, checked
//! by the same gate and handlers. This module only hands it what it cannot know: how to
//! reach the API from inside the process, and whose token may sign in.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use crate::Error;
use crate::auth::Callers;
use crate::config::{Config, Role};

/// Sign-in for the console: a token the coordinator knows, of an operator.
struct Operators(Callers);

impl automaton_console::Authenticate for Operators {
    fn operator(&self, token: &str) -> Result<String, String> {
        match self.0.who(token.trim()) {
            Some(c) if c.role == Role::Operator => Ok(c.name),
            Some(c) => Err(format!(
                "'{}' is {} token: the console is for operators; sign in with an operator's token",
                c.name,
                if c.role == Role::Worker {
                    "a worker's"
                } else {
                    "an agent's"
                }
            )),
            None => Err(
                "unknown token: use a token of role \"operator\" from the coordinator's [[tokens]]"
                    .into(),
            ),
        }
    }
}

/// Where the console reaches the gRPC API the coordinator serves on `grpc`: the same
/// address, or loopback when it listens on every address.
fn api_address(grpc: SocketAddr) -> SocketAddr {
    match grpc.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, grpc.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, grpc.port()).into(),
        _ => grpc,
    }
}

/// The console's options for a coordinator configured as `cfg` and serving gRPC on `grpc`.
/// With `[tls]` the console serves https with the same certificate and reaches the API over
/// TLS, trusting that certificate for the name `localhost` (docs/console.md).
pub fn console_options(
    cfg: &Config,
    grpc: SocketAddr,
    project: String,
) -> Result<automaton_console::Options, Error> {
    let addr = api_address(grpc);
    let scheme = if cfg.tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| Error::Internal(format!("console: bad API address {addr}: {e}")))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .tcp_nodelay(true);
    let mut tls = None;
    if let Some(t) = &cfg.tls {
        let read = |p: &std::path::Path| {
            std::fs::read(p)
                .map_err(|e| Error::Config(format!("console: cannot read {}: {e}", p.display())))
        };
        let (cert, key) = (read(&t.cert)?, read(&t.key)?);
        endpoint = endpoint
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&cert))
                    .domain_name("localhost"),
            )
            .map_err(|e| Error::Config(format!("console: TLS to the API: {e}")))?;
        tls = Some((cert, key));
    }
    Ok(automaton_console::Options {
        channel: endpoint.connect_lazy(),
        auth: cfg.authenticates().then(|| {
            Arc::new(Operators(Callers::new(&cfg.tokens, &cfg.worker_pools)))
                as Arc<dyn automaton_console::Authenticate>
        }),
        trace_url: cfg.trace_url.clone(),
        project,
        tls,
        streams: automaton_console::StreamLimits {
            per_session: cfg.web_max_streams,
            stall_timeout: cfg.web_stall_timeout,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Token;
    use automaton_console::Authenticate;

    fn operators() -> Operators {
        let t = |name: &str, token: &str, role| Token {
            name: name.into(),
            token: token.into(),
            role,
        };
        Operators(Callers::new(
            &[
                t("ops", "op-secret", Role::Operator),
                t("agent-1", "agent-secret", Role::Agent),
                t("gpu-1", "worker-secret", Role::Worker),
            ],
            &[],
        ))
    }

    #[test]
    fn only_an_operators_token_signs_in_and_the_refusal_says_why() {
        let ops = operators();
        assert_eq!(ops.operator("op-secret").as_deref(), Ok("ops"));
        let agent = ops.operator("agent-secret").expect_err("agent");
        assert!(agent.contains("an agent's token"), "{agent}");
        let worker = ops.operator("worker-secret").expect_err("worker");
        assert!(worker.contains("a worker's token"), "{worker}");
        let unknown = ops.operator("nope").expect_err("unknown");
        assert!(unknown.starts_with("unknown token"), "{unknown}");
        assert!(ops.operator("").is_err());
    }

    #[test]
    fn the_api_is_reached_on_loopback_when_listening_everywhere() {
        let a: SocketAddr = "0.0.0.0:7070".parse().expect("addr");
        assert_eq!(api_address(a), "127.0.0.1:7070".parse().expect("addr"));
        let b: SocketAddr = "[::]:7070".parse().expect("addr");
        assert_eq!(api_address(b), "[::1]:7070".parse().expect("addr"));
        let c: SocketAddr = "10.0.0.5:7070".parse().expect("addr");
        assert_eq!(api_address(c), c);
    }
}
