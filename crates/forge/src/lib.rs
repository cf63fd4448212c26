//! Pull requests on GitHub, GitLab and Gitea/Forgejo through their REST APIs, for a task the
//! coordinator delivers as a pull request (`[delivery.forge]`).
//!
//! What it owns: the [`Config`] and its validation, reading the token, and
//! [`Forge::open_pull_request`]: look for an open pull request from the task's branch into its
//! base and reuse it, else create one, so that calling it again (after a crash, a retry, a
//! second coordinator) never opens a second. Rate limits are waited out as the forge asks,
//! within `max_wait`; an [`Error`] says whether trying later can help ([`Error::is_final`]).
//!
//! What it must not do: any git (the branch is pushed before this is called, by whoever
//! pushes), decide anything about tasks (when to open, what to do on an error: the
//! coordinator's), or show the token: not in a log line, an error, or `Debug`; a forge's
//! message that echoes it is redacted.
//!
//! Why no octocrab or gitlab crate: the three forges need a GET and a POST each, which go over
//! the HTTP client the webhooks already build (`automaton_webhooks::http`, hyper over rustls).
//! Those crates would add a second HTTP stack and cover one forge each.

mod api;
mod call;
mod config;

use std::time::Duration;

use hyper::Method;

pub use config::{Config, Kind, MAX_DURATION};

/// The pull request to open: from branch `head` into branch `base`, both in the configured
/// repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequestSpec {
    pub head: String,
    pub base: String,
    pub title: String,
    pub body: String,
}

/// An open pull request (a merge request on GitLab).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequest {
    /// Its number in the repository (GitLab's `iid`).
    pub number: u64,
    /// Its web page.
    pub url: String,
    /// It was open already (this call created nothing).
    pub reused: bool,
}

/// What a failed call was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Find,
    Create,
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Action::Find => "looking for an open pull request",
            Action::Create => "opening a pull request",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `[delivery.forge]` cannot work: the reason says what to write instead. Final.
    #[error("[delivery.forge] {0}")]
    Config(String),
    /// The pull request asked for cannot be opened as given (no branch, head is base). Final.
    #[error("pull request: {0}")]
    Invalid(String),
    /// The forge refused the token (401, or a 403 that is not a rate limit). Final until a
    /// person fixes the token.
    #[error(
        "{forge} refused the token while {action} ({status}: {message}): check the token in \
         {token_source} (valid, unexpired, for this repository); {}", forge.scopes()
    )]
    Auth {
        forge: Kind,
        action: Action,
        status: u16,
        message: String,
        token_source: String,
    },
    /// Any other 4xx (or a redirect): asking again would get the same. Final.
    #[error("{forge} answered {status} while {action}: {message}")]
    Refused {
        forge: Kind,
        action: Action,
        status: u16,
        message: String,
    },
    /// No usable answer: connection errors, timeouts, 5xx, an answer that cannot be read, or a
    /// rate limit past `max_wait`. Trying later may work; `retry_after` is the forge's wait.
    #[error("{forge} unavailable while {action}: {reason}")]
    Unavailable {
        forge: Kind,
        action: Action,
        reason: String,
        retry_after: Option<Duration>,
    },
}

impl Error {
    /// Whether trying again later cannot help (a person must change something first).
    pub fn is_final(&self) -> bool {
        !matches!(self, Error::Unavailable { .. })
    }

    /// How long the forge asked to wait before the next try, when it said.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// One repository on one forge, with its token. `Debug` shows where the token is, never it.
#[derive(Debug)]
pub struct Forge {
    endpoints: api::Endpoints,
    client: call::Client,
}

impl Forge {
    /// Validates `cfg`, reads the token (from the file or the variable, trimmed) and, for
    /// https, the CA bundle. Needs no runtime; sends nothing.
    pub fn new(cfg: &Config) -> Result<Forge, Error> {
        cfg.validate().map_err(Error::Config)?;
        let token = config::read_token(cfg, |var| std::env::var_os(var)).map_err(Error::Config)?;
        let tls = if cfg.api_url.trim().starts_with("https://") {
            Some(
                automaton_webhooks::http::tls_connector(cfg.ca_file.as_deref())
                    .map_err(Error::Config)?,
            )
        } else {
            None
        };
        let endpoints = api::Endpoints::new(cfg).map_err(Error::Config)?;
        let headers = endpoints
            .headers(&token)
            .map_err(|why| Error::Config(format!("{}: {why}", cfg.token_source())))?;
        Ok(Forge {
            endpoints,
            client: call::Client {
                kind: cfg.kind,
                repository: cfg.repository.clone(),
                headers,
                token,
                token_source: cfg.token_source(),
                tls,
                timeout: cfg.timeout,
                max_wait: cfg.max_wait,
            },
        })
    }

    pub fn kind(&self) -> Kind {
        self.client.kind
    }

    pub fn repository(&self) -> &str {
        &self.client.repository
    }

    /// The open pull request from `spec.head` into `spec.base`: the one already open if there
    /// is one (`reused`), else a new one. A create the forge refuses as a duplicate (another
    /// caller won a race) is answered by looking again.
    #[tracing::instrument(skip_all, fields(forge = %self.kind(), head = %spec.head, base = %spec.base))]
    pub async fn open_pull_request(&self, spec: &PullRequestSpec) -> Result<PullRequest, Error> {
        check(spec)?;
        if let Some(pr) = self.find_open(spec).await? {
            tracing::info!(number = pr.number, "pull request already open: reused");
            return Ok(pr);
        }
        let r = self
            .client
            .call(
                Action::Create,
                Method::POST,
                &self.endpoints.create_url(),
                Some(self.endpoints.create_body(spec)),
            )
            .await?;
        if r.status.is_success() {
            let pr = api::created(self.kind(), &r.body).map_err(|why| {
                // It may exist now: the next try finds it by listing.
                self.client.unavailable(Action::Create, why, None)
            })?;
            tracing::info!(number = pr.number, "pull request opened");
            return Ok(pr);
        }
        if api::already_exists(self.kind(), r.status, &r.body)
            && let Some(pr) = self.find_open(spec).await?
        {
            tracing::info!(number = pr.number, "pull request opened meanwhile: reused");
            return Ok(pr);
        }
        Err(self.client.refusal(Action::Create, &r))
    }

    async fn find_open(&self, spec: &PullRequestSpec) -> Result<Option<PullRequest>, Error> {
        let kind = self.kind();
        let pages = if kind == Kind::Gitea {
            api::GITEA_PAGES
        } else {
            1
        };
        let mut seen = 0usize;
        for page in 1..=pages {
            let url = self.endpoints.list_url(&spec.head, &spec.base, page);
            let r = self
                .client
                .call(Action::Find, Method::GET, &url, None)
                .await?;
            if !r.status.is_success() {
                return Err(self.client.refusal(Action::Find, &r));
            }
            if r.truncated {
                return Err(self.client.unavailable(
                    Action::Find,
                    format!(
                        "the list is over {} bytes: it was not read",
                        automaton_webhooks::http::MAX_BODY
                    ),
                    None,
                ));
            }
            let listed = api::listed(kind, &r.body, &spec.head, &spec.base)
                .map_err(|why| self.client.unavailable(Action::Find, why, None))?;
            if let Some(pr) = listed.found {
                return Ok(Some(PullRequest { reused: true, ..pr }));
            }
            seen = seen.saturating_add(listed.entries);
            // Gitea says how many there are in all; without it, an empty page is the end.
            let total = r
                .headers
                .get("x-total-count")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<usize>().ok());
            if listed.entries == 0 || total.is_some_and(|t| seen >= t) {
                break;
            }
        }
        Ok(None)
    }
}

fn check(spec: &PullRequestSpec) -> Result<(), Error> {
    let branch = |what: &str, name: &str| {
        if name.trim().is_empty() || name.chars().any(|c| c.is_control()) {
            return Err(Error::Invalid(format!(
                "{what} branch '{}' is not a branch name",
                name.escape_debug()
            )));
        }
        Ok(())
    };
    branch("head", &spec.head)?;
    branch("base", &spec.base)?;
    if spec.head == spec.base {
        return Err(Error::Invalid(format!(
            "head and base are both '{}': a pull request needs two branches",
            spec.head
        )));
    }
    if spec.title.trim().is_empty() {
        return Err(Error::Invalid("the title is empty".to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(head: &str, base: &str, title: &str) -> PullRequestSpec {
        PullRequestSpec {
            head: head.into(),
            base: base.into(),
            title: title.into(),
            body: String::new(),
        }
    }

    #[test]
    fn a_spec_needs_two_branches_and_a_title() {
        assert!(check(&spec("h", "main", "t")).is_ok());
        for bad in [
            spec("", "main", "t"),
            spec("h", " ", "t"),
            spec("h\n", "main", "t"),
            spec("main", "main", "t"),
            spec("h", "main", "  "),
        ] {
            let e = check(&bad).expect_err("refused");
            assert!(e.is_final() && matches!(e, Error::Invalid(_)), "{e}");
        }
    }

    #[test]
    fn debug_never_shows_the_token() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("token");
        std::fs::write(&file, "glpat-very-secret\n").expect("write");
        let mut cfg = Config::new(Kind::Gitlab, "http://127.0.0.1:9/api/v4", "g/p");
        cfg.token_file = Some(file.clone());
        let forge = Forge::new(&cfg).expect("forge");
        let shown = format!("{forge:?} {forge:#?} {cfg:?}");
        assert!(!shown.contains("glpat-very-secret"), "{shown}");
        assert!(shown.contains(&file.display().to_string()), "{shown}");
    }

    #[test]
    fn only_unavailable_is_worth_a_later_try() {
        let refused = Error::Refused {
            forge: Kind::Github,
            action: Action::Create,
            status: 422,
            message: "Validation Failed".into(),
        };
        let unavailable = Error::Unavailable {
            forge: Kind::Gitea,
            action: Action::Find,
            reason: "connect: refused".into(),
            retry_after: Some(Duration::from_secs(3)),
        };
        assert!(refused.is_final() && Error::Config(String::new()).is_final());
        assert!(!unavailable.is_final());
        assert_eq!(unavailable.retry_after(), Some(Duration::from_secs(3)));
        assert_eq!(
            refused.to_string(),
            "GitHub answered 422 while opening a pull request: Validation Failed"
        );
        let auth = Error::Auth {
            forge: Kind::Gitlab,
            action: Action::Find,
            status: 401,
            message: "401 Unauthorized".into(),
            token_source: "token_env GITLAB_TOKEN".into(),
        };
        assert_eq!(
            auth.to_string(),
            "GitLab refused the token while looking for an open pull request (401: 401 \
             Unauthorized): check the token in token_env GITLAB_TOKEN (valid, unexpired, for \
             this repository); it needs the 'api' scope and at least the Developer role"
        );
    }
}
