#!/usr/bin/env python3
"""Structural checks for deploy/ files that have no validator of their own offline.

Called by deploy/check (one subcommand per kind of file); prints one line per problem and
exits 1 if there was any. Needs PyYAML (yamllint brings it: deploy/check-requirements.txt).

  otel FILE            an OpenTelemetry Collector config: the documented structure
                       (receivers/processors/exporters/extensions, service.pipelines), every
                       pipeline component defined, every defined component used
  grafana DASHBOARD PROVISIONING_DIR
                       a dashboard JSON (panels, unique ids, every query with a datasource)
                       and Grafana's provisioning files (apiVersion 1, their keys)
  compose FILE ENV_EXAMPLE
                       what the schema cannot see: every ${VAR} has a line in the env
                       example, every bind-mounted file exists, every build has an image
  k8s-shell FILE...    every container command of the form `sh -c SCRIPT` parses (`sh -n`)
  configs DIR          writes the coordinator configurations the compose file and the
                       Kubernetes manifests hand the coordinator into DIR, one .toml each,
                       for deploy/check to start the real coordinator on
"""

import json
import os
import re
import subprocess
import sys

import yaml

problems = []


def fail(path, msg):
    problems.append(f"{path}: {msg}")


def load_yaml(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


# The collector's component kinds and the pipeline signals it knows
# (https://opentelemetry.io/docs/collector/configuration/).
KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
SIGNALS = ("traces", "metrics", "logs")
SERVICE_KEYS = {"pipelines", "extensions", "telemetry"}
PIPELINE_KEYS = {"receivers", "processors", "exporters"}
COMPONENT_ID = re.compile(r"^[a-z][a-z0-9_]*(/[^/\s]+)?$")


def check_otel(path):
    cfg = load_yaml(path)
    if not isinstance(cfg, dict):
        return fail(path, "not a mapping")
    for key in cfg:
        if key not in KINDS and key != "service":
            fail(path, f"unknown top-level key '{key}' (expected {', '.join(KINDS)}, service)")
    defined = {}
    for kind in KINDS:
        section = cfg.get(kind) or {}
        if not isinstance(section, dict):
            fail(path, f"'{kind}' must be a mapping of component ids")
            continue
        for cid in section:
            if not COMPONENT_ID.match(str(cid)):
                fail(path, f"{kind}: '{cid}' is not a component id (type[/name])")
        defined[kind] = set(section)
    service = cfg.get("service")
    if not isinstance(service, dict):
        return fail(path, "no 'service' section: nothing would run")
    for key in service:
        if key not in SERVICE_KEYS:
            fail(path, f"service: unknown key '{key}'")
    pipelines = service.get("pipelines")
    if not isinstance(pipelines, dict) or not pipelines:
        return fail(path, "service.pipelines is empty: nothing would run")
    used = {kind: set() for kind in KINDS}
    for ext in service.get("extensions") or []:
        used["extensions"].add(ext)
        if ext not in defined["extensions"]:
            fail(path, f"service.extensions names '{ext}', which 'extensions' does not define")
    for name, pipe in pipelines.items():
        signal = str(name).split("/", 1)[0]
        if signal not in SIGNALS:
            fail(path, f"pipeline '{name}': the signal must be one of {', '.join(SIGNALS)}")
        if not isinstance(pipe, dict):
            fail(path, f"pipeline '{name}' must be a mapping")
            continue
        for key in pipe:
            if key not in PIPELINE_KEYS:
                fail(path, f"pipeline '{name}': unknown key '{key}'")
        for key in ("receivers", "exporters"):
            if not pipe.get(key):
                fail(path, f"pipeline '{name}' has no {key}")
        for key in PIPELINE_KEYS:
            for cid in pipe.get(key) or []:
                # A connector is an exporter of one pipeline and a receiver of another.
                ok = cid in defined[key] or cid in defined["connectors"]
                used[key].add(cid)
                used["connectors"].add(cid)
                if not ok:
                    fail(path, f"pipeline '{name}' names {key[:-1]} '{cid}', which '{key}' does not define")
    for kind in KINDS:
        for cid in sorted(defined[kind] - used[kind]):
            fail(path, f"{kind[:-1]} '{cid}' is defined but no pipeline uses it")
    for cid, exp in (cfg.get("exporters") or {}).items():
        if str(cid).split("/")[0] in ("otlp", "otlphttp") and not (exp or {}).get("endpoint"):
            fail(path, f"exporter '{cid}' has no endpoint")
    for cid, rec in (cfg.get("receivers") or {}).items():
        if str(cid).split("/")[0] == "otlp":
            protocols = (rec or {}).get("protocols") or {}
            if not protocols:
                fail(path, f"receiver '{cid}' enables no protocol (grpc, http)")
            for proto, conf in protocols.items():
                if proto not in ("grpc", "http"):
                    fail(path, f"receiver '{cid}': unknown protocol '{proto}'")
                endpoint = (conf or {}).get("endpoint", "")
                if not endpoint or endpoint.startswith(("localhost", "127.")):
                    fail(path, f"receiver '{cid}' {proto}: listens on localhost only (set endpoint: 0.0.0.0:PORT)")


PANEL_KEYS = {"type", "title", "gridPos"}


def check_grafana(dashboard, provisioning):
    try:
        with open(dashboard, encoding="utf-8") as f:
            dash = json.load(f)
    except (OSError, ValueError) as e:
        return fail(dashboard, f"not JSON: {e}")
    for key in ("uid", "title", "panels", "schemaVersion"):
        if key not in dash:
            fail(dashboard, f"no '{key}'")
    ids = set()
    queries = 0
    panels = list(dash.get("panels") or [])
    for p in panels:
        panels.extend(p.get("panels") or [])
    for p in panels:
        title = p.get("title", "?")
        for key in PANEL_KEYS:
            if key not in p:
                fail(dashboard, f"panel '{title}' has no '{key}'")
        pid = p.get("id")
        if pid in ids:
            fail(dashboard, f"panel id {pid} is used twice")
        ids.add(pid)
        if p.get("type") == "row":
            continue
        targets = p.get("targets") or []
        if not targets:
            fail(dashboard, f"panel '{title}' has no query")
        for t in targets:
            queries += 1
            if not str(t.get("expr", "")).strip():
                fail(dashboard, f"panel '{title}' query {t.get('refId')} has no expr")
            if not (t.get("datasource") or p.get("datasource")):
                fail(dashboard, f"panel '{title}' query {t.get('refId')} has no datasource")
            if str(t.get("expr", "")).count("(") != str(t.get("expr", "")).count(")"):
                fail(dashboard, f"panel '{title}' query {t.get('refId')}: unbalanced parentheses")
    if queries == 0:
        fail(dashboard, "no queries at all")
    variables = {v.get("name") for v in (dash.get("templating") or {}).get("list") or []}
    for m in re.finditer(r"\$\{(\w+)\}", json.dumps(dash)):
        if m.group(1) not in variables:
            fail(dashboard, f"uses ${{{m.group(1)}}}, which is not a dashboard variable")
    for kind, item_key, required in (
        ("datasources", "datasources", ("name", "type", "url")),
        ("dashboards", "providers", ("name", "type", "options")),
    ):
        folder = os.path.join(provisioning, kind)
        files = sorted(f for f in os.listdir(folder) if f.endswith((".yaml", ".yml")))
        if not files:
            fail(folder, "no provisioning file")
        for name in files:
            path = os.path.join(folder, name)
            doc = load_yaml(path) or {}
            if doc.get("apiVersion") != 1:
                fail(path, "apiVersion must be 1")
            items = doc.get(item_key)
            if not items:
                fail(path, f"no '{item_key}'")
            for item in items or []:
                for key in required:
                    if key not in item:
                        fail(path, f"{item_key} entry {item.get('name', '?')} has no '{key}'")
                if kind == "dashboards" and not (item.get("options") or {}).get("path"):
                    fail(path, f"provider {item.get('name', '?')} has no options.path")


VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-?+][^}]*)?\}")


def check_compose(path, env_example):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    doc = yaml.safe_load(text)
    with open(env_example, encoding="utf-8") as f:
        # `VAR=value`, or `# VAR=value` for an optional one.
        documented = set(re.findall(r"^#?\s*([A-Za-z_][A-Za-z0-9_]*)=", f.read(), re.M))
    for name in sorted(set(VAR.findall(text))):
        if name not in documented:
            fail(path, f"${{{name}}} has no line in {os.path.basename(env_example)}")
    base = os.path.dirname(path)
    for name, svc in (doc.get("services") or {}).items():
        if "build" in svc and "image" not in svc:
            fail(path, f"service {name}: a build without an image name is built once per service")
        for vol in svc.get("volumes") or []:
            source = vol.split(":", 1)[0] if isinstance(vol, str) else vol.get("source", "")
            if source.startswith((".", "/")) and not os.path.exists(os.path.join(base, source)):
                fail(path, f"service {name}: mounts {source}, which does not exist")
        for cfg in svc.get("configs") or []:
            src = cfg if isinstance(cfg, str) else cfg.get("source")
            if src not in (doc.get("configs") or {}):
                fail(path, f"service {name}: config '{src}' is not defined under configs")


def check_k8s_shell(paths):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for doc in docs:
            spec = (((doc.get("spec") or {}).get("template") or {}).get("spec")) or {}
            for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
                cmd = c.get("command") or []
                if len(cmd) >= 3 and cmd[0] in ("sh", "bash") and cmd[1] == "-c":
                    r = subprocess.run([cmd[0], "-n", "-c", cmd[2]], capture_output=True, text=True)
                    if r.returncode != 0:
                        fail(path, f"container {c.get('name')}: {cmd[0]} -c script: {r.stderr.strip()}")


def write_configs(out):
    """The coordinator configurations as the coordinator will read them, placeholders filled."""
    here = os.path.dirname(os.path.abspath(__file__))
    compose = load_yaml(os.path.join(here, "compose.yaml"))
    content = compose["configs"]["coordinator_toml"]["content"]
    # The env example's values stand in for deploy/.env; ${VAR:?msg} takes them.
    env = {}
    with open(os.path.join(here, "compose.env.example"), encoding="utf-8") as f:
        for line in f:
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.strip().split("=", 1)
                env[k] = v
    content = VAR.sub(lambda m: env.get(m.group(1), ""), content).replace("$$", "$")
    with open(os.path.join(out, "compose.toml"), "w", encoding="utf-8") as f:
        f.write(content)
    k8s = os.path.join(here, "k8s")
    config = load_yaml(os.path.join(k8s, "10-config.yaml"))["data"]["coordinator.toml"]
    tokens = next(
        d for d in yaml.safe_load_all(open(os.path.join(k8s, "20-secret.yaml"), encoding="utf-8"))
        if d["metadata"]["name"] == "automaton-coordinator-tokens"
    )["stringData"]["tokens.toml"]
    # What the coordinator's init container does: the ConfigMap, then the Secret.
    with open(os.path.join(out, "k8s.toml"), "w", encoding="utf-8") as f:
        f.write(config + tokens)


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[1], argv[2:]
    try:
        if cmd == "otel" and len(args) == 1:
            check_otel(*args)
        elif cmd == "grafana" and len(args) == 2:
            check_grafana(*args)
        elif cmd == "compose" and len(args) == 2:
            check_compose(*args)
        elif cmd == "k8s-shell" and args:
            check_k8s_shell(args)
        elif cmd == "configs" and len(args) == 1:
            write_configs(*args)
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (OSError, yaml.YAMLError, KeyError, TypeError, StopIteration) as e:
        problems.append(f"{cmd} {' '.join(args)}: cannot read: {type(e).__name__}: {e}")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
