//! The three forges' REST shapes: URLs, headers and bodies of the two calls, and what their
//! answers say. No I/O: everything here takes bytes and gives values, and no answer panics it.

use bytes::Bytes;
use hyper::StatusCode;
use hyper::header::{ACCEPT, AUTHORIZATION, HeaderName, HeaderValue, USER_AGENT};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::{Value, json};

use crate::config::{Config, Kind, Token};
use crate::{PullRequest, PullRequestSpec};

/// Gitea's page size for the list of open pull requests (its default `MAX_RESPONSE_ITEMS`).
pub(crate) const GITEA_PAGE: usize = 50;
/// The most pages of Gitea's list read: 500 open pull requests.
pub(crate) const GITEA_PAGES: u32 = 10;
/// The longest excerpt of a forge's message, in characters.
const MAX_EXCERPT: usize = 200;

/// Everything but RFC 3986's unreserved characters: a branch or path fits in one segment or
/// one query value, whatever it holds (`/`, `+`, `#`, spaces).
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

fn enc(s: &str) -> String {
    utf8_percent_encode(s, COMPONENT).to_string()
}

/// One forge's repository as its API addresses it.
#[derive(Debug, Clone)]
pub(crate) struct Endpoints {
    kind: Kind,
    /// `api_url` without its trailing `/`.
    api: String,
    /// GitHub's `head` filter names the owner: `owner:branch`.
    owner: String,
    /// `repos/{owner}/{name}` or `projects/{group%2Fsub%2Fname}`.
    repo: String,
}

impl Endpoints {
    pub(crate) fn new(cfg: &Config) -> Result<Endpoints, String> {
        let parts = cfg.repository_parts()?;
        let repo = match cfg.kind {
            Kind::Gitlab => format!("projects/{}", enc(&cfg.repository)),
            Kind::Github | Kind::Gitea => format!("repos/{}/{}", enc(parts[0]), enc(parts[1])),
        };
        Ok(Endpoints {
            kind: cfg.kind,
            api: cfg.api_url.trim().trim_end_matches('/').to_string(),
            owner: parts[0].to_string(),
            repo,
        })
    }

    /// The list of open pull requests from `head` into `base` (page `page`, from 1, on Gitea,
    /// which cannot filter by branch).
    pub(crate) fn list_url(&self, head: &str, base: &str, page: u32) -> String {
        let (api, repo) = (&self.api, &self.repo);
        match self.kind {
            Kind::Github => format!(
                "{api}/{repo}/pulls?head={}&base={}&state=open",
                enc(&format!("{}:{head}", self.owner)),
                enc(base)
            ),
            Kind::Gitlab => format!(
                "{api}/{repo}/merge_requests?source_branch={}&target_branch={}&state=opened",
                enc(head),
                enc(base)
            ),
            Kind::Gitea => {
                format!("{api}/{repo}/pulls?state=open&page={page}&limit={GITEA_PAGE}")
            }
        }
    }

    pub(crate) fn create_url(&self) -> String {
        match self.kind {
            Kind::Gitlab => format!("{}/{}/merge_requests", self.api, self.repo),
            Kind::Github | Kind::Gitea => format!("{}/{}/pulls", self.api, self.repo),
        }
    }

    pub(crate) fn create_body(&self, spec: &PullRequestSpec) -> Bytes {
        let body = match self.kind {
            Kind::Gitlab => json!({
                "source_branch": spec.head,
                "target_branch": spec.base,
                "title": spec.title,
                "description": spec.body,
            }),
            Kind::Github | Kind::Gitea => json!({
                "title": spec.title,
                "head": spec.head,
                "base": spec.base,
                "body": spec.body,
            }),
        };
        Bytes::from(body.to_string())
    }

    /// The headers of every call: the token as the forge takes it (marked sensitive), and
    /// what each forge asks a client to send.
    pub(crate) fn headers(&self, token: &Token) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let (name, value) = match self.kind {
            Kind::Github => (AUTHORIZATION, format!("Bearer {}", token.expose())),
            Kind::Gitlab => (
                HeaderName::from_static("private-token"),
                token.expose().to_string(),
            ),
            Kind::Gitea => (AUTHORIZATION, format!("token {}", token.expose())),
        };
        let mut secret = HeaderValue::from_str(&value)
            .map_err(|_| "the token has a character a header cannot carry".to_string())?;
        secret.set_sensitive(true);
        let mut headers = vec![
            (name, secret),
            (USER_AGENT, HeaderValue::from_static("automaton")),
        ];
        match self.kind {
            Kind::Github => {
                headers.push((
                    ACCEPT,
                    HeaderValue::from_static("application/vnd.github+json"),
                ));
                headers.push((
                    HeaderName::from_static("x-github-api-version"),
                    HeaderValue::from_static("2022-11-28"),
                ));
            }
            Kind::Gitlab | Kind::Gitea => {
                headers.push((ACCEPT, HeaderValue::from_static("application/json")));
            }
        }
        Ok(headers)
    }
}

/// One page of the list: the open pull request from head into base if it is on it, and how
/// many entries the page had (Gitea's paging stops on an empty page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Listed {
    pub found: Option<PullRequest>,
    pub entries: usize,
}

/// Reads a list answer. An entry counts only if it is open and goes from `head` into `base`
/// (the forge filtered already, except Gitea; checked anyway). An entry that matches but
/// lacks its number or web URL is an error: creating another would be wrong.
pub(crate) fn listed(kind: Kind, body: &[u8], head: &str, base: &str) -> Result<Listed, String> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the list is not JSON ({e}): {}", excerpt(body)))?;
    let Value::Array(entries) = value else {
        return Err(format!("the list is not a JSON array: {}", excerpt(body)));
    };
    let open = match kind {
        Kind::Github | Kind::Gitea => "open",
        Kind::Gitlab => "opened",
    };
    let found = entries.iter().find(|e| {
        branches(kind, e) == (Some(head), Some(base))
            && e.get("state")
                .and_then(Value::as_str)
                .is_none_or(|s| s == open)
    });
    let found = match found {
        Some(e) => Some(pull_request(kind, e).map_err(|why| format!("the list's entry {why}"))?),
        None => None,
    };
    Ok(Listed {
        found,
        entries: entries.len(),
    })
}

/// An entry's head and base branches.
fn branches(kind: Kind, e: &Value) -> (Option<&str>, Option<&str>) {
    let get = |outer: &str, inner: Option<&str>| {
        let v = e.get(outer)?;
        match inner {
            Some(k) => v.get(k)?.as_str(),
            None => v.as_str(),
        }
    };
    match kind {
        Kind::Github | Kind::Gitea => (get("head", Some("ref")), get("base", Some("ref"))),
        Kind::Gitlab => (get("source_branch", None), get("target_branch", None)),
    }
}

/// Reads a create answer (a 2xx).
pub(crate) fn created(kind: Kind, body: &[u8]) -> Result<PullRequest, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        format!(
            "the answer to the create is not JSON ({e}): {}",
            excerpt(body)
        )
    })?;
    pull_request(kind, &value).map_err(|why| format!("the created pull request {why}"))
}

fn pull_request(kind: Kind, v: &Value) -> Result<PullRequest, String> {
    let (number, url) = match kind {
        Kind::Github | Kind::Gitea => ("number", "html_url"),
        Kind::Gitlab => ("iid", "web_url"),
    };
    let n = v
        .get(number)
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("has no '{number}' (a whole number)"))?;
    let web = v
        .get(url)
        .and_then(Value::as_str)
        .filter(|u| !u.is_empty())
        .ok_or_else(|| format!("has no '{url}'"))?;
    Ok(PullRequest {
        number: n,
        url: web.to_string(),
        reused: false,
    })
}

/// Whether a refused create says the pull request is there already: GitHub's 422 whose
/// errors say so, GitLab's 409, Gitea's 409 (422 before 1.17).
pub(crate) fn already_exists(kind: Kind, status: StatusCode, body: &[u8]) -> bool {
    match kind {
        Kind::Github => {
            status == StatusCode::UNPROCESSABLE_ENTITY
                && excerpt(body)
                    .to_ascii_lowercase()
                    .contains("a pull request already exists")
        }
        Kind::Gitlab => status == StatusCode::CONFLICT,
        Kind::Gitea => status == StatusCode::CONFLICT || status == StatusCode::UNPROCESSABLE_ENTITY,
    }
}

/// The forge's message in an answer, on one line of at most [`MAX_EXCERPT`] characters:
/// `message` (GitLab's may be a list or an object of lists), GitHub's `errors[].message`,
/// an OAuth `error_description`; else the body's text.
pub(crate) fn excerpt(body: &[u8]) -> String {
    let text = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| json_message(&v))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.is_empty() {
        return "(no message)".to_string();
    }
    match line.char_indices().nth(MAX_EXCERPT) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

fn json_message(v: &Value) -> Option<String> {
    fn flat(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(items) => items.iter().for_each(|i| flat(i, out)),
            Value::Object(fields) => {
                for (k, v) in fields {
                    let mut inner = Vec::new();
                    flat(v, &mut inner);
                    out.push(format!("{k}: {}", inner.join(", ")));
                }
            }
            Value::Number(n) => out.push(n.to_string()),
            Value::Bool(_) | Value::Null => {}
        }
    }
    let mut parts = Vec::new();
    if let Some(m) = v.get("message") {
        flat(m, &mut parts);
    }
    if let Some(Value::Array(errors)) = v.get("errors") {
        for e in errors {
            match e.get("message") {
                Some(m) => flat(m, &mut parts),
                None => flat(e, &mut parts),
            }
        }
    }
    if parts.is_empty() {
        for key in ["error_description", "error"] {
            if let Some(m) = v.get(key) {
                flat(m, &mut parts);
                break;
            }
        }
    }
    // Only control characters are squeezed out later: keep the text they separate.
    let parts: Vec<String> = parts
        .into_iter()
        .map(|p| p.replace(|c: char| c.is_control(), " "))
        .filter(|p| !p.trim().is_empty())
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(kind: Kind, api: &str, repo: &str) -> Endpoints {
        Endpoints::new(&Config::new(kind, api, repo)).expect("valid repository")
    }

    fn spec() -> PullRequestSpec {
        PullRequestSpec {
            head: "automaton/add-auth".into(),
            base: "main".into(),
            title: "Add auth".into(),
            body: "Done by an agent.".into(),
        }
    }

    #[test]
    fn urls_follow_each_forges_documented_shape() {
        let gh = endpoints(Kind::Github, "https://api.github.com/", "acme/widgets");
        assert_eq!(
            gh.list_url("automaton/add-auth", "main", 1),
            "https://api.github.com/repos/acme/widgets/pulls?head=acme%3Aautomaton%2Fadd-auth&base=main&state=open"
        );
        assert_eq!(
            gh.create_url(),
            "https://api.github.com/repos/acme/widgets/pulls"
        );
        let gl = endpoints(
            Kind::Gitlab,
            "https://gl.example/api/v4",
            "group/sub/widgets",
        );
        assert_eq!(
            gl.list_url("a+b c", "main", 1),
            "https://gl.example/api/v4/projects/group%2Fsub%2Fwidgets/merge_requests?source_branch=a%2Bb%20c&target_branch=main&state=opened"
        );
        assert_eq!(
            gl.create_url(),
            "https://gl.example/api/v4/projects/group%2Fsub%2Fwidgets/merge_requests"
        );
        let gt = endpoints(Kind::Gitea, "http://gitea:3000/api/v1", "acme/widgets");
        assert_eq!(
            gt.list_url("x", "y", 3),
            "http://gitea:3000/api/v1/repos/acme/widgets/pulls?state=open&page=3&limit=50"
        );
    }

    #[test]
    fn create_bodies_carry_each_forges_field_names() {
        let gh = endpoints(Kind::Github, "https://h", "a/b").create_body(&spec());
        let v: Value = serde_json::from_slice(&gh).expect("json");
        assert_eq!(
            v,
            json!({"title": "Add auth", "head": "automaton/add-auth", "base": "main", "body": "Done by an agent."})
        );
        let gl = endpoints(Kind::Gitlab, "https://h", "a/b").create_body(&spec());
        let v: Value = serde_json::from_slice(&gl).expect("json");
        assert_eq!(
            v,
            json!({"source_branch": "automaton/add-auth", "target_branch": "main", "title": "Add auth", "description": "Done by an agent."})
        );
    }

    #[test]
    fn lists_find_the_open_one_from_head_into_base() {
        let body = br#"[
            {"number": 3, "html_url": "u3", "state": "open", "head": {"ref": "other"}, "base": {"ref": "main"}},
            {"number": 4, "html_url": "u4", "state": "closed", "head": {"ref": "h"}, "base": {"ref": "main"}},
            {"number": 5, "html_url": "u5", "state": "open", "head": {"ref": "h"}, "base": {"ref": "dev"}},
            {"number": 6, "html_url": "u6", "state": "open", "head": {"ref": "h"}, "base": {"ref": "main"}}
        ]"#;
        let l = listed(Kind::Gitea, body, "h", "main").expect("parses");
        assert_eq!(l.entries, 4);
        assert_eq!(
            l.found,
            Some(PullRequest {
                number: 6,
                url: "u6".into(),
                reused: false
            })
        );
        let gl = br#"[{"iid": 18446744073709551615, "web_url": "w", "state": "opened",
                       "source_branch": "h", "target_branch": "main"}]"#;
        let l = listed(Kind::Gitlab, gl, "h", "main").expect("parses");
        assert_eq!(l.found.map(|p| p.number), Some(u64::MAX));
        assert_eq!(
            listed(Kind::Github, b"[]", "h", "main"),
            Ok(Listed {
                found: None,
                entries: 0
            })
        );
    }

    #[test]
    fn no_answer_panics_the_readers() {
        let huge = vec![b'['; 1 << 20];
        let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
        let garbage: Vec<&[u8]> = vec![
            b"",
            b"null",
            b"{}",
            b"\xff\xfe\x00",
            b"<html>502 Bad Gateway</html>",
            b"[1, \"x\", null, {\"head\": 5}]",
            b"[{\"head\": {\"ref\": \"h\"}, \"base\": {\"ref\": \"main\"}}]",
            b"[{\"head\": {\"ref\": \"h\"}, \"base\": {\"ref\": \"main\"}, \"number\": -1, \"html_url\": \"u\"}]",
            b"[{\"head\": {\"ref\": \"h\"}, \"base\": {\"ref\": \"main\"}, \"number\": 1.5, \"html_url\": \"u\"}]",
            b"[{\"head\": {\"ref\": \"h\"}, \"base\": {\"ref\": \"main\"}, \"number\": 18446744073709551616, \"html_url\": \"u\"}]",
            b"{\"number\": 1, \"html_url\": 7}",
            &huge,
            deep.as_bytes(),
        ];
        for kind in [Kind::Github, Kind::Gitlab, Kind::Gitea] {
            for body in &garbage {
                let l = listed(kind, body, "h", "main");
                assert!(
                    l.as_ref().map_or(true, |l| l.found.is_none()),
                    "{kind}: nothing found in garbage: {l:?}"
                );
                assert!(
                    created(kind, body).is_err(),
                    "{kind}: no pull request in garbage"
                );
                let e = excerpt(body);
                assert!(!e.contains('\n') && e.chars().count() <= MAX_EXCERPT + 1);
                let _ = already_exists(kind, StatusCode::UNPROCESSABLE_ENTITY, body);
            }
        }
        let err = listed(
            Kind::Github,
            br#"[{"head": {"ref": "h"}, "base": {"ref": "main"}, "number": -1, "html_url": "u"}]"#,
            "h",
            "main",
        )
        .expect_err("a matching entry without a number");
        assert!(err.contains("has no 'number'"), "{err}");
    }

    #[test]
    fn excerpts_take_each_forges_message_on_one_line() {
        assert_eq!(
            excerpt(br#"{"message":"Validation Failed","errors":[{"resource":"PullRequest","code":"custom","message":"A pull request already exists for acme:h."}]}"#),
            "Validation Failed; A pull request already exists for acme:h."
        );
        assert_eq!(
            excerpt(br#"{"message":["Another open merge request already exists for this source branch: !1"]}"#),
            "Another open merge request already exists for this source branch: !1"
        );
        assert_eq!(
            excerpt(br#"{"message":{"target_branch":["is invalid"]}}"#),
            "target_branch: is invalid"
        );
        assert_eq!(
            excerpt(br#"{"error":"invalid_token","error_description":"Token was revoked."}"#),
            "Token was revoked."
        );
        assert_eq!(excerpt(b"bad\r\ngateway\t!"), "bad gateway !");
        assert_eq!(excerpt(b"   "), "(no message)");
        let long = "é".repeat(500);
        let e = excerpt(long.as_bytes());
        assert_eq!(e.chars().count(), MAX_EXCERPT + 1);
        assert!(e.ends_with('…'));
    }

    #[test]
    fn already_exists_is_read_per_forge() {
        let gh = br#"{"message":"Validation Failed","errors":[{"message":"A pull request already exists for acme:h."}]}"#;
        assert!(already_exists(
            Kind::Github,
            StatusCode::UNPROCESSABLE_ENTITY,
            gh
        ));
        let no_commits = br#"{"message":"Validation Failed","errors":[{"message":"No commits between main and h"}]}"#;
        assert!(!already_exists(
            Kind::Github,
            StatusCode::UNPROCESSABLE_ENTITY,
            no_commits
        ));
        assert!(already_exists(Kind::Gitlab, StatusCode::CONFLICT, b""));
        assert!(!already_exists(
            Kind::Gitlab,
            StatusCode::UNPROCESSABLE_ENTITY,
            b""
        ));
        assert!(already_exists(Kind::Gitea, StatusCode::CONFLICT, b""));
        assert!(already_exists(
            Kind::Gitea,
            StatusCode::UNPROCESSABLE_ENTITY,
            b""
        ));
        assert!(!already_exists(Kind::Gitea, StatusCode::NOT_FOUND, b""));
    }
}
