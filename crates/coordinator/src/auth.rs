//! Authentication: bearer tokens from the config, checked by the [`crate::layers::Gate`]
//! layer before any handler runs. Handlers only ask the caller's role.

use std::collections::HashMap;

use tonic::codegen::http;
use tonic::{Request, Status};

use crate::config::{Role, Token};

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

/// The configured tokens, by token.
#[derive(Debug, Default)]
pub struct Callers(HashMap<String, Caller>);

impl Callers {
    pub fn new(tokens: &[Token]) -> Callers {
        Callers(
            tokens
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
        )
    }

    /// Without tokens everyone is the operator `user` (the server then listens on loopback
    /// only, unless started `--insecure`): `Ok(None)`. With tokens, a request needs
    /// `authorization: Bearer TOKEN`.
    pub fn check(&self, headers: &http::HeaderMap) -> Result<Option<Caller>, Status> {
        if self.0.is_empty() {
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
        match self.0.get(token) {
            Some(c) => Ok(Some(c.clone())),
            None => Err(Status::unauthenticated(
                "unknown bearer token: check AUTOMATON_TOKEN against the coordinator's config",
            )),
        }
    }
}
