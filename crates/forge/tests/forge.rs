//! `open_pull_request` against the fake forge (`tests/common/forge.rs`, a real HTTP server on
//! 127.0.0.1): the request shapes, reuse of an open pull request, the "already exists" race,
//! a refused token, rate limits, 5xx, timeouts and answers that cannot be read, per forge.

#[path = "../../../tests/common/forge.rs"]
mod fake;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use automaton_forge::{Config, Error, Forge, Kind, PullRequest, PullRequestSpec};
use fake::{FakeForge, FakeKind, TOKEN};

const HEAD: &str = "automaton/add-auth";
const BASE: &str = "main";

fn kind_of(k: FakeKind) -> Kind {
    match k {
        FakeKind::GitHub => Kind::Github,
        FakeKind::GitLab => Kind::Gitlab,
        FakeKind::Gitea => Kind::Gitea,
    }
}

fn repo_of(k: FakeKind) -> &'static str {
    match k {
        FakeKind::GitLab => "group/sub/widgets",
        _ => "acme/widgets",
    }
}

fn spec() -> PullRequestSpec {
    PullRequestSpec {
        head: HEAD.into(),
        base: BASE.into(),
        title: "Add auth".into(),
        body: "Task add-auth, done by an agent.".into(),
    }
}

struct Setup {
    fake: FakeForge,
    forge: Forge,
    token_file: PathBuf,
    _dir: tempfile::TempDir,
}

/// A fake `k` forge and a [`Forge`] for it, its token in a file; `tune` edits the config.
async fn setup(k: FakeKind, tune: impl FnOnce(&mut Config)) -> Setup {
    setup_with(FakeForge::start(k).await, tune)
}

fn setup_with(fake: FakeForge, tune: impl FnOnce(&mut Config)) -> Setup {
    let k = fake.kind();
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("forge.token");
    std::fs::write(&token_file, format!("\n{TOKEN}\n")).expect("write the token");
    let mut cfg = Config::new(kind_of(k), fake.api_url(), repo_of(k));
    cfg.token_file = Some(token_file.clone());
    cfg.timeout = Duration::from_secs(5);
    cfg.max_wait = Duration::from_secs(10);
    tune(&mut cfg);
    let forge = Forge::new(&cfg).expect("the forge");
    Setup {
        fake,
        forge,
        token_file,
        _dir: dir,
    }
}

fn web_url(s: &Setup, number: u64) -> String {
    let (web, repo) = (s.fake.web_url(), repo_of(s.fake.kind()));
    match s.fake.kind() {
        FakeKind::GitHub => format!("{web}/{repo}/pull/{number}"),
        FakeKind::GitLab => format!("{web}/{repo}/-/merge_requests/{number}"),
        FakeKind::Gitea => format!("{web}/{repo}/pulls/{number}"),
    }
}

/// The rate limit each forge answers with: GitHub's 403 with no requests left, a 429 else.
fn push_rate_limit(fake: &FakeForge, retry_after: &str) {
    match fake.kind() {
        FakeKind::GitHub => fake.push_answer(
            403,
            &[("retry-after", retry_after), ("x-ratelimit-remaining", "0")],
            r#"{"message":"API rate limit exceeded for installation ID 1.","documentation_url":"https://docs.github.com/rest"}"#,
        ),
        FakeKind::GitLab => fake.push_answer(
            429,
            &[("retry-after", retry_after), ("content-type", "text/plain")],
            "Retry later",
        ),
        FakeKind::Gitea => fake.push_answer(
            429,
            &[("retry-after", retry_after)],
            r#"{"message":"rate limit exceeded"}"#,
        ),
    }
}

/// Each test below runs once per forge: `github::name`, `gitlab::name`, `gitea::name`.
macro_rules! per_forge {
    ($($name:ident),* $(,)?) => {
        mod github { $( #[tokio::test] async fn $name() { super::$name(super::FakeKind::GitHub).await } )* }
        mod gitlab { $( #[tokio::test] async fn $name() { super::$name(super::FakeKind::GitLab).await } )* }
        mod gitea { $( #[tokio::test] async fn $name() { super::$name(super::FakeKind::Gitea).await } )* }
    };
}

per_forge!(
    requests_have_the_forges_shape_and_auth_header,
    a_new_pull_request_is_created_with_201,
    a_second_call_reuses_the_open_one_without_a_post,
    a_create_answering_already_exists_reuses_the_existing_one,
    a_bad_token_is_final_and_names_its_source_not_the_token,
    a_403_that_is_not_a_rate_limit_is_an_auth_error,
    a_rate_limit_with_retry_after_is_waited_out_then_succeeds,
    server_errors_are_retried_then_succeed,
    server_errors_past_the_retries_are_unavailable,
    a_rate_limit_past_max_wait_is_unavailable_without_waiting,
    rate_limits_that_add_up_past_max_wait_are_unavailable,
    a_refused_create_is_final_with_the_forges_message,
    garbage_answers_are_unavailable_never_a_panic,
);

async fn requests_have_the_forges_shape_and_auth_header(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    s.forge.open_pull_request(&spec()).await.expect("opened");
    let reqs = s.fake.requests();
    assert_eq!(
        reqs.iter().map(|r| r.method.as_str()).collect::<Vec<_>>(),
        ["GET", "POST"]
    );
    let (get, post) = (&reqs[0], &reqs[1]);
    for r in &reqs {
        match k {
            FakeKind::GitHub => {
                assert_eq!(
                    r.header("authorization"),
                    Some(format!("Bearer {TOKEN}").as_str())
                );
                assert_eq!(r.header("accept"), Some("application/vnd.github+json"));
                assert_eq!(r.header("x-github-api-version"), Some("2022-11-28"));
            }
            FakeKind::GitLab => {
                assert_eq!(r.header("private-token"), Some(TOKEN));
                assert_eq!(r.header("authorization"), None);
            }
            FakeKind::Gitea => {
                assert_eq!(
                    r.header("authorization"),
                    Some(format!("token {TOKEN}").as_str())
                );
            }
        }
        assert_eq!(r.header("user-agent"), Some("automaton"));
    }
    let query = |name: &str| get.query(name);
    match k {
        FakeKind::GitHub => {
            assert_eq!(get.route(), "/repos/acme/widgets/pulls");
            assert_eq!(query("head").as_deref(), Some("acme:automaton/add-auth"));
            assert_eq!(query("base").as_deref(), Some(BASE));
            assert_eq!(query("state").as_deref(), Some("open"));
            assert_eq!(post.route(), "/repos/acme/widgets/pulls");
        }
        FakeKind::GitLab => {
            let route = "/api/v4/projects/group%2Fsub%2Fwidgets/merge_requests";
            assert_eq!(get.route(), route);
            assert_eq!(query("source_branch").as_deref(), Some(HEAD));
            assert_eq!(query("target_branch").as_deref(), Some(BASE));
            assert_eq!(query("state").as_deref(), Some("opened"));
            assert_eq!(post.route(), route);
        }
        FakeKind::Gitea => {
            assert_eq!(get.route(), "/api/v1/repos/acme/widgets/pulls");
            assert_eq!(query("state").as_deref(), Some("open"));
            assert_eq!(query("page").as_deref(), Some("1"));
            assert_eq!(query("limit").as_deref(), Some("50"));
            assert_eq!(post.route(), "/api/v1/repos/acme/widgets/pulls");
        }
    }
    assert_eq!(post.header("content-type"), Some("application/json"));
    let want = match k {
        FakeKind::GitLab => serde_json::json!({
            "source_branch": HEAD, "target_branch": BASE, "title": "Add auth",
            "description": "Task add-auth, done by an agent.",
        }),
        _ => serde_json::json!({
            "title": "Add auth", "head": HEAD, "base": BASE,
            "body": "Task add-auth, done by an agent.",
        }),
    };
    assert_eq!(post.body, want);
}

async fn a_new_pull_request_is_created_with_201(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    s.fake.add_open(repo_of(k), "someone-else", BASE);
    let pr = s.forge.open_pull_request(&spec()).await.expect("opened");
    assert_eq!(
        pr,
        PullRequest {
            number: 2,
            url: web_url(&s, 2),
            reused: false
        }
    );
    let pulls = s.fake.pulls();
    let made = pulls.iter().find(|p| p.number == 2).expect("created");
    assert_eq!((made.head.as_str(), made.base.as_str()), (HEAD, BASE));
    assert_eq!(made.title, "Add auth");
    s.fake.shutdown().await;
}

async fn a_second_call_reuses_the_open_one_without_a_post(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    let first = s.forge.open_pull_request(&spec()).await.expect("opened");
    let second = s.forge.open_pull_request(&spec()).await.expect("reused");
    assert!(!first.reused && second.reused);
    assert_eq!((first.number, &first.url), (second.number, &second.url));
    assert_eq!(s.fake.count("POST"), 1);
    assert_eq!(s.fake.pulls().len(), 1);
}

async fn a_create_answering_already_exists_reuses_the_existing_one(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    // Another caller opened it between our look and our create: the first list misses it.
    let n = s.fake.add_open(repo_of(k), HEAD, BASE);
    s.fake.push_answer(200, &[], "[]");
    let pr = s.forge.open_pull_request(&spec()).await.expect("reused");
    assert_eq!(
        pr,
        PullRequest {
            number: n,
            url: web_url(&s, n),
            reused: true
        }
    );
    assert_eq!(
        s.fake
            .requests()
            .iter()
            .map(|r| r.method.as_str())
            .collect::<Vec<_>>(),
        ["GET", "POST", "GET"]
    );
    assert_eq!(s.fake.pulls().len(), 1, "no second pull request");
}

async fn a_bad_token_is_final_and_names_its_source_not_the_token(k: FakeKind) {
    let s = setup_with(
        FakeForge::start_with_token(k, "the-token-the-forge-knows").await,
        |_| {},
    );
    let err = s.forge.open_pull_request(&spec()).await.expect_err("401");
    assert!(matches!(err, Error::Auth { status: 401, .. }), "{err:?}");
    assert!(err.is_final());
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("token_file {}", s.token_file.display())),
        "{msg}"
    );
    assert!(!msg.contains(TOKEN), "{msg}");
    assert!(!format!("{err:?}").contains(TOKEN));
    assert_eq!(s.fake.requests().len(), 1, "a 401 is not retried");
}

async fn a_403_that_is_not_a_rate_limit_is_an_auth_error(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    s.fake.push_answer(
        403,
        &[("x-ratelimit-remaining", "4999")],
        r#"{"message":"Resource not accessible by integration"}"#,
    );
    let err = s.forge.open_pull_request(&spec()).await.expect_err("403");
    assert!(matches!(err, Error::Auth { status: 403, .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("Resource not accessible by integration")
    );
    assert_eq!(s.fake.requests().len(), 1);
}

async fn a_rate_limit_with_retry_after_is_waited_out_then_succeeds(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    push_rate_limit(&s.fake, "1");
    let pr = s.forge.open_pull_request(&spec()).await.expect("opened");
    assert!(!pr.reused);
    let reqs = s.fake.requests();
    assert_eq!(reqs.len(), 3, "the limited GET, again, then the POST");
    let waited = reqs[1].at.duration_since(reqs[0].at);
    assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
}

async fn server_errors_are_retried_then_succeed(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    s.fake
        .push_answer(500, &[], r#"{"message":"Internal Server Error"}"#);
    s.fake.push_answer(
        502,
        &[("content-type", "text/html")],
        "<html>bad gateway</html>",
    );
    let pr = s.forge.open_pull_request(&spec()).await.expect("opened");
    assert_eq!(pr.number, 1);
    assert_eq!((s.fake.count("GET"), s.fake.count("POST")), (3, 1));
}

async fn server_errors_past_the_retries_are_unavailable(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    for _ in 0..4 {
        s.fake.push_answer(503, &[], r#"{"message":"maintenance"}"#);
    }
    let err = s.forge.open_pull_request(&spec()).await.expect_err("down");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(!err.is_final());
    assert!(err.to_string().contains("503"), "{err}");
    assert_eq!((s.fake.count("GET"), s.fake.count("POST")), (4, 0));
}

async fn a_rate_limit_past_max_wait_is_unavailable_without_waiting(k: FakeKind) {
    let s = setup(k, |c| c.max_wait = Duration::from_secs(1)).await;
    push_rate_limit(&s.fake, "30");
    let start = Instant::now();
    let err = s
        .forge
        .open_pull_request(&spec())
        .await
        .expect_err("limited");
    assert!(start.elapsed() < Duration::from_secs(5), "it waited");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(!err.is_final());
    assert_eq!(err.retry_after(), Some(Duration::from_secs(30)));
    assert!(err.to_string().contains("max_wait"), "{err}");
    assert_eq!(s.fake.requests().len(), 1);
}

async fn rate_limits_that_add_up_past_max_wait_are_unavailable(k: FakeKind) {
    let s = setup(k, |c| c.max_wait = Duration::from_millis(1500)).await;
    push_rate_limit(&s.fake, "1");
    push_rate_limit(&s.fake, "1");
    let start = Instant::now();
    let err = s
        .forge
        .open_pull_request(&spec())
        .await
        .expect_err("limited");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "the first wait is taken"
    );
    assert_eq!(s.fake.requests().len(), 2);
}

async fn a_refused_create_is_final_with_the_forges_message(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    s.fake.push_answer(200, &[], "[]");
    let (status, body) = match k {
        FakeKind::GitHub => (
            422,
            r#"{"message":"Validation Failed","errors":[{"resource":"PullRequest","code":"custom","message":"No commits between main and automaton/add-auth"}]}"#,
        ),
        FakeKind::GitLab => (
            400,
            r#"{"message":{"base":["No commits between main and automaton/add-auth"]}}"#,
        ),
        FakeKind::Gitea => (
            422,
            r#"{"message":"No commits between main and automaton/add-auth","url":"x"}"#,
        ),
    };
    s.fake.push_answer(status, &[], body);
    let err = s
        .forge
        .open_pull_request(&spec())
        .await
        .expect_err("refused");
    assert!(matches!(err, Error::Refused { .. }), "{err:?}");
    assert!(err.is_final());
    let msg = err.to_string();
    assert!(
        msg.contains("No commits between main and automaton/add-auth"),
        "{msg}"
    );
    assert!(!msg.contains('\n'));
    assert!(s.fake.pulls().is_empty());
}

async fn garbage_answers_are_unavailable_never_a_panic(k: FakeKind) {
    let s = setup(k, |_| {}).await;
    let huge = "[".repeat(2 << 20);
    let answers: [(u16, &str); 5] = [
        (200, "<html>login</html>"),
        (200, r#"{"not": "a list"}"#),
        (200, &huge),
        (
            200,
            r#"[{"head":{"ref":"automaton/add-auth"},"base":{"ref":"main"},"source_branch":"automaton/add-auth","target_branch":"main","number":-3,"iid":-3}]"#,
        ),
        (200, "\u{0}\u{1}garbage"),
    ];
    for (status, body) in answers {
        s.fake.push_answer(status, &[], body);
        let err = s
            .forge
            .open_pull_request(&spec())
            .await
            .expect_err("garbage");
        assert!(
            matches!(err, Error::Unavailable { .. }),
            "{body:.40}: {err:?}"
        );
        assert!(err.to_string().len() < 1000);
    }
    // A created answer without its number: unavailable (the next call finds it by listing).
    s.fake.push_answer(200, &[], "[]");
    s.fake
        .push_answer(201, &[], r#"{"number": 18446744073709551616, "iid": "7"}"#);
    let err = s
        .forge
        .open_pull_request(&spec())
        .await
        .expect_err("no number");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    // And u64::MAX is a number like any other.
    s.fake.push_answer(200, &[], "[]");
    s.fake.push_answer(
        201,
        &[],
        r#"{"number": 18446744073709551615, "iid": 18446744073709551615, "html_url": "u", "web_url": "u"}"#,
    );
    let pr = s.forge.open_pull_request(&spec()).await.expect("opened");
    assert_eq!(pr.number, u64::MAX);
}

#[tokio::test]
async fn github_primary_rate_limit_waits_until_x_ratelimit_reset() {
    let s = setup(FakeKind::GitHub, |_| {}).await;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let reset = (now + 1).to_string();
    s.fake.push_answer(
        403,
        &[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", &reset),
        ],
        r#"{"message":"API rate limit exceeded for user ID 1."}"#,
    );
    s.forge.open_pull_request(&spec()).await.expect("opened");
    let reqs = s.fake.requests();
    let waited = reqs[1].at.duration_since(reqs[0].at);
    assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
}

#[tokio::test]
async fn github_secondary_rate_limit_without_headers_is_waited_out() {
    let s = setup(FakeKind::GitHub, |_| {}).await;
    s.fake.push_answer(
        403,
        &[],
        r#"{"message":"You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}"#,
    );
    s.forge.open_pull_request(&spec()).await.expect("opened");
    let reqs = s.fake.requests();
    assert!(reqs[1].at.duration_since(reqs[0].at) >= Duration::from_secs(1));
}

#[tokio::test]
async fn gitea_list_follows_pages() {
    let s = setup(FakeKind::Gitea, |_| {}).await;
    for i in 0..60 {
        s.fake
            .add_open(repo_of(FakeKind::Gitea), &format!("other-{i}"), BASE);
    }
    let n = s.fake.add_open(repo_of(FakeKind::Gitea), HEAD, BASE);
    let pr = s.forge.open_pull_request(&spec()).await.expect("found");
    assert_eq!((pr.number, pr.reused), (n, true));
    let pages: Vec<_> = s
        .fake
        .requests()
        .iter()
        .map(|r| r.query("page").unwrap_or_default())
        .collect();
    assert_eq!(pages, ["1", "2"]);
}

#[tokio::test]
async fn gitea_list_stops_at_the_total_count() {
    let s = setup(FakeKind::Gitea, |_| {}).await;
    for i in 0..3 {
        s.fake
            .add_open(repo_of(FakeKind::Gitea), &format!("other-{i}"), BASE);
    }
    s.forge.open_pull_request(&spec()).await.expect("opened");
    assert_eq!((s.fake.count("GET"), s.fake.count("POST")), (1, 1));
}

#[tokio::test]
async fn a_slow_answer_times_out_and_is_retried() {
    let s = setup(FakeKind::Gitea, |c| c.timeout = Duration::from_millis(300)).await;
    s.fake
        .push_slow_answer(Duration::from_secs(3), 200, &[], "[]");
    let start = Instant::now();
    s.forge.open_pull_request(&spec()).await.expect("opened");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "it waited for the slow answer"
    );
    assert_eq!(s.fake.count("GET"), 2);
}

#[tokio::test]
async fn an_unreachable_forge_is_unavailable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    drop(listener);
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("t");
    std::fs::write(&token, "x").expect("write");
    let mut cfg = Config::new(Kind::Github, format!("http://127.0.0.1:{port}"), "a/b");
    cfg.token_file = Some(token);
    let forge = Forge::new(&cfg).expect("forge");
    let err = forge
        .open_pull_request(&spec())
        .await
        .expect_err("no forge");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.to_string().contains("connect"), "{err}");
}

#[tokio::test]
async fn a_404_says_to_check_the_repository() {
    let s = setup(FakeKind::GitHub, |_| {}).await;
    s.fake
        .push_answer(404, &[], r#"{"message":"Not Found","status":"404"}"#);
    let err = s.forge.open_pull_request(&spec()).await.expect_err("404");
    assert!(matches!(err, Error::Refused { status: 404, .. }), "{err:?}");
    assert!(
        err.to_string().contains("check repository 'acme/widgets'"),
        "{err}"
    );
}

#[test]
fn an_unset_token_variable_is_a_config_error_naming_it() {
    let mut cfg = Config::new(Kind::Gitea, "http://127.0.0.1:9/api/v1", "a/b");
    cfg.token_env = Some("AUTOMATON_FORGE_TEST_SURELY_UNSET_7D1".into());
    let err = Forge::new(&cfg).expect_err("unset");
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("token_env AUTOMATON_FORGE_TEST_SURELY_UNSET_7D1"),
        "{err}"
    );
}

#[test]
fn an_empty_token_file_is_a_config_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("empty.token");
    std::fs::write(&file, " \n").expect("write");
    let mut cfg = Config::new(Kind::Github, "http://127.0.0.1:9", "a/b");
    cfg.token_file = Some(file.clone());
    let err = Forge::new(&cfg).expect_err("empty");
    assert_eq!(
        err.to_string(),
        format!(
            "[delivery.forge] token_file {} is empty: put the token in it",
            file.display()
        )
    );
}
