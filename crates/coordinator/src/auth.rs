//! Authentication: bearer tokens from the config, and tokens minted from a worker pool's
//! secret, checked by the [`crate::layers::Gate`] layer before any handler runs. Either way the
//! caller is a name and a role; handlers only ask those.

use std::collections::HashMap;

use tonic::codegen::http;
use tonic::{Request, Status};

use crate::config::{Role, Token, WorkerPool};

/// Who is calling, as the gate established it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// The caller of a request that went through the gate.
pub fn caller<T>(req: &Request<T>) -> Caller {
    req.extensions().get::<Caller>().cloned().unwrap_or(Caller {
        name: "user".into(),
        role: Role::Operator,
    })
}

/// The configured tokens, by token, and the worker pools whose minted tokens are accepted.
#[derive(Debug, Default)]
pub struct Callers {
    tokens: HashMap<String, Caller>,
    /// Secrets trimmed, as the workers that mint from them trim theirs.
    pools: Vec<WorkerPool>,
}

impl Callers {
    pub fn new(tokens: &[Token], pools: &[WorkerPool]) -> Callers {
        Callers {
            tokens: tokens
                .iter()
                .map(|t| {
                    (
                        t.token.clone(),
                        Caller {
                            name: t.name.clone(),
                            role: t.role,
                        },
                    )
                })
                .collect(),
            pools: pools
                .iter()
                .map(|p| WorkerPool {
                    prefix: p.prefix.clone(),
                    secret: p.secret.trim().to_string(),
                })
                .collect(),
        }
    }

    /// The worker a pool token speaks for: its name is an agent id that a pool admits, and
    /// its MAC is that pool's for the name.
    fn pool_member(&self, token: &str) -> Option<Caller> {
        let (name, mac) = automaton_workflow::pool_token::split(token)?;
        name.parse::<automaton_workflow::AgentId>().ok()?;
        self.pools
            .iter()
            .filter(|p| p.admits(name))
            .any(|p| automaton_workflow::pool_token::verify(p.secret.as_bytes(), name, mac))
            .then(|| Caller {
                name: name.to_string(),
                role: Role::Worker,
            })
    }

    /// Whom `token` speaks for: a configured token's caller, or a pool member's.
    pub fn who(&self, token: &str) -> Option<Caller> {
        if token.is_empty() {
            return None;
        }
        self.tokens
            .get(token)
            .cloned()
            .or_else(|| self.pool_member(token))
    }

    /// Without tokens everyone is the operator `user` (the server then listens on loopback
    /// only, unless started `--insecure`): `Ok(None)`. With tokens, a request needs
    /// `authorization: Bearer TOKEN`.
    pub fn check(&self, headers: &http::HeaderMap) -> Result<Option<Caller>, Status> {
        if self.tokens.is_empty() && self.pools.is_empty() {
            return Ok(None);
        }
        let Some(header) = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return Err(Status::unauthenticated(
                "no bearer token: send 'authorization: Bearer TOKEN' (the CLI reads AUTOMATON_TOKEN)",
            ));
        };
        let token = header.strip_prefix("Bearer ").unwrap_or("");
        if let Some(c) = self.who(token) {
            return Ok(Some(c));
        }
        Err(Status::unauthenticated(
            if token.starts_with(automaton_workflow::pool_token::PREFIX) {
                "pool token refused: its name is in no worker pool, or it was not minted from that pool's secret: check --pool-secret-file and --name against the coordinator's worker_pools"
            } else {
                "unknown bearer token: check AUTOMATON_TOKEN against the coordinator's config"
            },
        ))
    }
}
