//! `[delivery.forge]`: which forge, where its API is, which repository, where the token is.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use automaton_webhooks::http::{BadUrl, Target};
use hyper::header::HeaderValue;
use serde::{Deserialize, Serialize};

/// The longest `timeout` or `max_wait`: a day is already more than a pull request needs.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// Which REST API the forge speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// github.com (`https://api.github.com`) or GitHub Enterprise (`https://HOST/api/v3`).
    Github,
    /// gitlab.com or self-managed (`https://HOST/api/v4`).
    Gitlab,
    /// Gitea or Forgejo, which speaks Gitea's API (`https://HOST/api/v1`).
    #[serde(alias = "forgejo")]
    Gitea,
}

impl Kind {
    /// The forge's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Github => "GitHub",
            Kind::Gitlab => "GitLab",
            Kind::Gitea => "Gitea",
        }
    }

    /// What a token needs to open a pull request, as the forge names it.
    pub(crate) fn scopes(self) -> &'static str {
        match self {
            Kind::Github => {
                "a fine-grained token needs 'Pull requests: read and write' on the repository, \
                 a classic one the 'repo' scope"
            }
            Kind::Gitlab => "it needs the 'api' scope and at least the Developer role",
            Kind::Gitea => "it needs the 'write:repository' scope",
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `[delivery.forge]`. The token itself is never in it: `token_file` or `token_env` says
/// where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `github`, `gitlab`, or `gitea` (`forgejo` is the same).
    pub kind: Kind,
    /// The API's root: `https://api.github.com`, `https://gitlab.example.com/api/v4`,
    /// `https://gitea.example.com/api/v1`. `http://` is taken too (tests, in-house forges).
    pub api_url: String,
    /// `owner/name`; on GitLab the project's full path, `group/sub/name`.
    pub repository: String,
    /// A file holding the token (its surrounding whitespace is not part of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// An environment variable holding the token. Exactly one of `token_file`, `token_env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// For `https://`: the PEM file of the CA certificates to trust instead of the system's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// One request, from connecting to the answer's last byte (default 30s).
    #[serde(default = "default_timeout", with = "automaton_webhooks::duration")]
    pub timeout: Duration,
    /// The most time one call spends waiting out rate limits and retrying errors (default
    /// 5m); past it the call fails as retryable ([`crate::Error::Unavailable`]).
    #[serde(default = "default_max_wait", with = "automaton_webhooks::duration")]
    pub max_wait: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_wait() -> Duration {
    Duration::from_secs(300)
}

impl Config {
    /// A config for `repository` on the forge at `api_url`, with no token source yet and every
    /// other field its default.
    pub fn new(kind: Kind, api_url: impl Into<String>, repository: impl Into<String>) -> Config {
        Config {
            kind,
            api_url: api_url.into(),
            repository: repository.into(),
            token_file: None,
            token_env: None,
            ca_file: None,
            timeout: default_timeout(),
            max_wait: default_max_wait(),
        }
    }

    /// Checks all that can be checked without reading the token (`Forge::new` reads it);
    /// the error is one line that says what to write instead.
    pub fn validate(&self) -> Result<(), String> {
        let api = self.api_url.trim();
        if api.is_empty() {
            return Err(format!(
                "api_url is empty: write the API's root, e.g. {}",
                example_api(self.kind)
            ));
        }
        let example = example_api(self.kind);
        Target::parse(api).map_err(|e| match e {
            BadUrl::Scheme => format!(
                "api_url '{api}': write http://host[:port]/path or https://…, e.g. {example}"
            ),
            BadUrl::NotUrl(why) => {
                format!("api_url '{api}' is not a URL ({why}): write e.g. {example}")
            }
            BadUrl::NoHost => format!("api_url '{api}' has no host: write e.g. {example}"),
            // Not echoed: the password would be in the message.
            BadUrl::UserInfo => "api_url carries a user or password: leave them out (the \
                                 token goes in token_file or token_env)"
                .to_string(),
            BadUrl::PortZero => {
                format!("api_url '{api}': port 0 cannot be reached: write the forge's port")
            }
        })?;
        if api.contains(['?', '#']) {
            return Err(format!(
                "api_url '{}' has a query or fragment: write the API's root only, e.g. {}",
                self.api_url,
                example_api(self.kind)
            ));
        }
        self.repository_parts()?;
        match (&self.token_file, &self.token_env) {
            (Some(_), Some(_)) => {
                return Err("token_file and token_env are both set: keep one of them".to_string());
            }
            (None, None) => {
                return Err(
                    "no token: set token_file (a file holding it) or token_env (a variable \
                     holding it)"
                        .to_string(),
                );
            }
            (Some(path), None) if path.as_os_str().is_empty() => {
                return Err(
                    "token_file is empty: write the path of the file holding the token".to_string(),
                );
            }
            (None, Some(var)) if var.is_empty() || var.contains(['=', '\0']) => {
                return Err(format!(
                    "token_env '{var}' is not a variable name: write e.g. \"GITHUB_TOKEN\""
                ));
            }
            _ => {}
        }
        if let Some(ca) = &self.ca_file {
            if !api.starts_with("https://") {
                return Err("ca_file is only for an https:// api_url: leave it out".to_string());
            }
            if !ca.is_file() {
                return Err(format!(
                    "ca_file {}: no such file: write the path of a PEM file of CA certificates",
                    ca.display()
                ));
            }
        }
        if self.timeout.is_zero() || self.timeout > MAX_DURATION {
            return Err(format!(
                "timeout '{}': write a duration above 0 and at most a day, e.g. '30s'",
                humantime::format_duration(self.timeout)
            ));
        }
        if self.max_wait > MAX_DURATION {
            return Err(format!(
                "max_wait '{}': write at most a day, e.g. '5m'",
                humantime::format_duration(self.max_wait)
            ));
        }
        Ok(())
    }

    /// The repository's path segments: two on GitHub and Gitea, two or more on GitLab.
    pub(crate) fn repository_parts(&self) -> Result<Vec<&str>, String> {
        let example = match self.kind {
            Kind::Gitlab => "\"group/name\" or \"group/sub/name\"",
            _ => "\"owner/name\"",
        };
        let repo = self.repository.as_str();
        if repo.trim().is_empty() {
            return Err(format!("repository is empty: write {example}"));
        }
        let parts: Vec<&str> = repo.split('/').collect();
        let bad = parts.iter().any(|p| {
            p.is_empty()
                || *p == "."
                || *p == ".."
                || p.chars().any(|c| c.is_whitespace() || c.is_control())
                || p.contains(['?', '#', '%'])
        });
        let count_ok = match self.kind {
            Kind::Gitlab => parts.len() >= 2,
            _ => parts.len() == 2,
        };
        if bad || !count_ok {
            return Err(format!(
                "repository '{}' is not a {} repository path: write {example}",
                self.repository,
                self.kind.name()
            ));
        }
        Ok(parts)
    }

    /// Where the token is, for messages: `token_file /path` or `token_env NAME`.
    pub(crate) fn token_source(&self) -> String {
        match (&self.token_file, &self.token_env) {
            (Some(path), _) => format!("token_file {}", path.display()),
            (None, Some(var)) => format!("token_env {var}"),
            (None, None) => "(no token source)".to_string(),
        }
    }
}

fn example_api(kind: Kind) -> &'static str {
    match kind {
        Kind::Github => "https://api.github.com",
        Kind::Gitlab => "https://gitlab.example.com/api/v4",
        Kind::Gitea => "https://gitea.example.com/api/v1",
    }
}

/// The token, never printed.
#[derive(Clone)]
pub(crate) struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// `text` with every occurrence of the token replaced (a forge may echo a request back).
    pub(crate) fn redact(&self, text: &str) -> String {
        text.replace(&self.0, "(token)")
    }
}

/// Reads the token from `cfg`'s source (`env` looks a variable up), trimmed; an error names
/// the file or variable and says what to do, never shows what it read.
pub(crate) fn read_token(
    cfg: &Config,
    env: impl Fn(&str) -> Option<OsString>,
) -> Result<Token, String> {
    let (raw, source) = match (&cfg.token_file, &cfg.token_env) {
        (Some(path), None) => {
            let bytes = std::fs::read(path).map_err(|e| {
                format!(
                    "token_file {}: {e}: write the path of a file that holds the token",
                    path.display()
                )
            })?;
            (bytes, cfg.token_source())
        }
        (None, Some(var)) => {
            let value = env(var).ok_or_else(|| {
                format!("token_env {var}: the variable is not set: export the token in it")
            })?;
            (value.into_encoded_bytes(), cfg.token_source())
        }
        _ => return Err("set exactly one of token_file and token_env".to_string()),
    };
    let text = String::from_utf8(raw)
        .map_err(|_| format!("{source}: the token is not UTF-8 text: write the token only"))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("{source} is empty: put the token in it"));
    }
    // It goes into a header as it is: no line breaks or other control characters inside.
    if token.chars().any(|c| c.is_control()) || HeaderValue::from_str(token).is_err() {
        return Err(format!(
            "{source}: the token has a character a header cannot carry (a line break inside?): \
             write the token alone on one line"
        ));
    }
    Ok(Token(token.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Config {
        let mut c = Config::new(Kind::Github, "https://api.github.com", "acme/widgets");
        c.token_env = Some("GITHUB_TOKEN".into());
        c
    }

    #[test]
    fn toml_takes_defaults_and_the_forgejo_alias() {
        let c: Config = toml::from_str(
            r#"
            kind = "forgejo"
            api_url = "https://code.example.com/api/v1"
            repository = "acme/widgets"
            token_file = "/run/secrets/forge"
            "#,
        )
        .expect("parses");
        assert_eq!(c.kind, Kind::Gitea);
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(c.max_wait, Duration::from_secs(300));
        c.validate().expect("valid");

        let c: Config = toml::from_str(
            r#"
            kind = "gitlab"
            api_url = "http://127.0.0.1:8080/api/v4"
            repository = "group/sub/name"
            token_env = "GITLAB_TOKEN"
            timeout = "2s"
            max_wait = "90"
            "#,
        )
        .expect("parses");
        assert_eq!(
            (c.kind, c.timeout, c.max_wait),
            (
                Kind::Gitlab,
                Duration::from_secs(2),
                Duration::from_secs(90)
            )
        );
        c.validate().expect("valid");
    }

    #[test]
    fn unknown_keys_and_kinds_are_refused() {
        let base = "api_url = \"https://h\"\nrepository = \"a/b\"\ntoken_env = \"T\"\n";
        assert!(
            toml::from_str::<Config>(&format!("kind = \"github\"\n{base}token = \"x\"")).is_err()
        );
        assert!(toml::from_str::<Config>(&format!("kind = \"bitbucket\"\n{base}")).is_err());
        assert!(
            toml::from_str::<Config>(&format!("kind = \"github\"\n{base}timeout = \"soon\""))
                .is_err()
        );
    }

    #[test]
    fn bad_configs_get_one_line_errors_that_say_what_to_do() {
        let with = |f: &dyn Fn(&mut Config)| {
            let mut c = good();
            f(&mut c);
            c
        };
        let cases: Vec<(Config, &str)> = vec![
            (
                with(&|c| c.repository = String::new()),
                "repository is empty: write \"owner/name\"",
            ),
            (
                with(&|c| c.repository = "widgets".into()),
                "write \"owner/name\"",
            ),
            (
                with(&|c| c.repository = "a/b/c".into()),
                "not a GitHub repository path",
            ),
            (
                with(&|c| c.repository = "a//b".into()),
                "write \"owner/name\"",
            ),
            (
                with(&|c| c.repository = "a/b c".into()),
                "write \"owner/name\"",
            ),
            (
                with(&|c| {
                    c.kind = Kind::Gitlab;
                    c.repository = "name".into()
                }),
                "\"group/sub/name\"",
            ),
            (with(&|c| c.api_url = String::new()), "api_url is empty"),
            (
                with(&|c| c.api_url = "ftp://h".into()),
                "write http://host[:port]/path",
            ),
            (
                with(&|c| c.api_url = "api.github.com".into()),
                "write http://host[:port]/path",
            ),
            (
                with(&|c| c.api_url = "https://u:p@h".into()),
                "user or password",
            ),
            (
                with(&|c| c.api_url = "https://h/api?x=1".into()),
                "query or fragment",
            ),
            (
                with(&|c| c.token_file = Some("/t".into())),
                "token_file and token_env are both set: keep one",
            ),
            (with(&|c| c.token_env = None), "no token: set token_file"),
            (
                with(&|c| c.token_env = Some("A=B".into())),
                "not a variable name",
            ),
            (
                with(&|c| c.ca_file = Some("/nonexistent.pem".into())),
                "no such file",
            ),
            (
                with(&|c| {
                    c.api_url = "http://h".into();
                    c.ca_file = Some("/etc/hosts".into())
                }),
                "only for an https:// api_url",
            ),
            (with(&|c| c.timeout = Duration::ZERO), "timeout '0s'"),
            (
                with(&|c| c.max_wait = Duration::from_secs(90_000)),
                "max_wait",
            ),
        ];
        for (cfg, want) in cases {
            let err = cfg.validate().expect_err(&format!("{cfg:?} is refused"));
            assert!(err.contains(want), "{err:?} should say {want:?}");
            assert!(!err.contains('\n'), "one line: {err:?}");
        }
        good().validate().expect("the base is valid");
    }

    #[test]
    fn a_token_file_is_trimmed_and_its_errors_never_show_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        let mut c = good();
        c.token_env = None;
        c.token_file = Some(path.clone());
        let no_env = |_: &str| None;

        let err = read_token(&c, no_env).expect_err("missing");
        assert!(err.contains(&path.display().to_string()), "{err}");

        std::fs::write(&path, "  \n\t").expect("write");
        let err = read_token(&c, no_env).expect_err("empty");
        assert!(err.ends_with("is empty: put the token in it"), "{err}");

        std::fs::write(&path, "\n  ghp_secret123  \n").expect("write");
        let t = read_token(&c, no_env).expect("read");
        assert_eq!(t.expose(), "ghp_secret123");
        assert_eq!(format!("{t:?}"), "Token(..)");
        assert_eq!(t.redact("bad ghp_secret123!"), "bad (token)!");

        std::fs::write(&path, "ghp_sec\nret123").expect("write");
        let err = read_token(&c, no_env).expect_err("two lines");
        assert!(err.contains("a line break inside"), "{err}");
        assert!(!err.contains("ghp_sec"), "{err}");
    }

    #[test]
    fn a_token_variable_must_be_set_and_not_empty() {
        let c = good();
        let err = read_token(&c, |_| None).expect_err("unset");
        assert_eq!(
            err,
            "token_env GITHUB_TOKEN: the variable is not set: export the token in it"
        );
        let err = read_token(&c, |_| Some(" ".into())).expect_err("empty");
        assert_eq!(err, "token_env GITHUB_TOKEN is empty: put the token in it");
        let t = read_token(&c, |v| (v == "GITHUB_TOKEN").then(|| " tok \n".into())).expect("set");
        assert_eq!(t.expose(), "tok");
    }
}
