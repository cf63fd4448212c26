//! Authentication: bearer tokens from the config, checked by an interceptor before any
//! handler runs. Handlers only ask the caller's role.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Status};

use crate::config::{Role, Token};

/// Who is calling, as the interceptor established it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// The caller of a request that went through [`interceptor`].
pub fn caller<T>(req: &Request<T>) -> Caller {
    req.extensions().get::<Caller>().cloned().unwrap_or(Caller {
        name: "user".into(),
        role: Role::Operator,
    })
}

/// Without tokens everyone is the operator `user` (the server then listens on loopback only,
/// unless started `--insecure`). With tokens, a request needs `authorization: Bearer TOKEN`.
pub fn interceptor(
    tokens: &[Token],
) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone + Send + Sync + 'static {
    let table: Arc<HashMap<String, Caller>> = Arc::new(
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
    );
    move |mut req: Request<()>| {
        if table.is_empty() {
            return Ok(req);
        }
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let Some(header) = header else {
            return Err(Status::unauthenticated(
                "no bearer token: send 'authorization: Bearer TOKEN' (the CLI reads AUTOMATON_TOKEN)",
            ));
        };
        let token = header.strip_prefix("Bearer ").unwrap_or("");
        match table.get(token) {
            Some(c) => {
                req.extensions_mut().insert(c.clone());
                Ok(req)
            }
            None => Err(Status::unauthenticated(
                "unknown bearer token: check AUTOMATON_TOKEN against the coordinator's config",
            )),
        }
    }
}
