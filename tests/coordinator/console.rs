//! Issue 23's console, the coordinator's side: `--web-listen` / `web_listen` and its refusals.
//! The pages are `automaton-console`'s; the browser test is still to come.

/// `web_listen` that cannot work is refused in one line before anything binds: on the metrics
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
        crate::harness::refused_before_binding(toml, says);
    }
}
