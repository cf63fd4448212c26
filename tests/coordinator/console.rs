//! Issue 23's console, the coordinator's side: `--web-listen` / `web_listen` and its refusals.
//! The pages are `automaton-console`'s; the browser test is still to come.

use std::time::Duration;

use crate::harness::Env;

/// `web_listen` that cannot work is refused in one line before anything binds: on the gRPC
/// port, on a public address without tokens, and a trace URL without `{trace_id}`.
#[test]
fn bad_console_config_is_refused_in_one_line_before_anything_binds() {
    for (toml, says) in [
        (
            "metrics_listen = \"127.0.0.1:7393\"\nweb_listen = \"127.0.0.1:7393\"\n",
            "give the console another port",
        ),
        (
            "web_listen = \"0.0.0.0:0\"\n",
            "refusing to serve the console on 0.0.0.0:0 without authentication",
        ),
        (
            "web_listen = \"127.0.0.1:0\"\ntrace_url = \"http://jaeger:16686/trace/\"\n",
            "{trace_id}",
        ),
    ] {
        let env = Env::with_config(toml);
        let run = env.run_coordinator(&[], &[], Duration::from_secs(20));
        assert_ne!(run.code, 0, "{toml}: {run:?}");
        assert!(run.stderr.contains(says), "{toml}: {}", run.stderr);
        assert!(!run.stdout.contains("listening"), "{toml}: {run:?}");
        assert_eq!(
            run.stderr.trim().lines().count(),
            1,
            "{toml}: {}",
            run.stderr
        );
    }
}
