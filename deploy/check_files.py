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
  compose-ha FILE      the etcd setup of a compose file: an odd number (3 or more) of etcd
                       members whose names, URLs and --initial-cluster agree, health checks,
                       pinned images; every coordinator on etcd with its own project volume,
                       advertising its own service URL, depending on healthy members, its
                       endpoints the members; every worker given every coordinator
  k8s-ha ETCD COORD [--only FILE]
                       the same for the Kubernetes manifests: the etcd StatefulSet and its
                       headless Service, the coordinators' StatefulSet (its own volume per
                       pod, --advertise from the pod's stable name, readiness on gRPC health
                       and liveness not), the client Service and the disruption budgets
  etcd-config BIN TOML [ARGS...]
                       `BIN --config TOML ARGS --print-config` succeeds and says store = etcd
                       with endpoints, a name and an advertised URL
  configs DIR          writes the coordinator configurations the compose files and the
                       Kubernetes manifests hand the coordinator into DIR, one .toml each
                       (and, for the etcd ones, NAME.args: the flags each coordinator's
                       command adds, one a line), for deploy/check to start the real
                       coordinator on
"""

import json
import os
import re
import subprocess
import sys
import tomllib

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
    # High availability: compose-ha.yaml's shared config and each coordinator's own flags.
    ha = os.path.join(here, "compose-ha.yaml")
    doc = load_yaml(ha)
    with open(os.path.join(out, "compose-ha.toml"), "w", encoding="utf-8") as f:
        f.write(compose_config(ha, "coordinator_ha_toml"))
    for name, svc in (doc.get("services") or {}).items():
        if command(svc)[:1] == ["automaton-coordinator"]:
            write_args(os.path.join(out, f"compose-ha-{name}.args"), command(svc)[1:])
    # 35-coordinator-ha.yaml's init container: the ConfigMap, the Secret, then [etcd].
    text, args = k8s_ha_config(k8s)
    with open(os.path.join(out, "k8s-ha.toml"), "w", encoding="utf-8") as f:
        f.write(text)
    write_args(os.path.join(out, "k8s-ha.args"), args)


# Flags deploy/check sets itself when it starts a coordinator (a throw-away project on
# 127.0.0.1:0, the config it extracted), left out of the flags it takes from a command.
OWN_FLAGS = ("--config", "--project", "--listen", "--metrics-listen")


def write_args(path, args):
    kept = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in OWN_FLAGS:
            skip = True
            continue
        if a.split("=", 1)[0] in OWN_FLAGS:
            continue
        kept.append(a)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(a + "\n" for a in kept))


def command(container):
    """A service's or container's command as a list of words."""
    cmd = container.get("command") or []
    return [str(c) for c in cmd] if isinstance(cmd, list) else str(cmd).split()


def flag_map(args):
    """`--k=v` and `--k v` of a command; a flag without a value maps to True."""
    out = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
                out[k] = v
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[a] = args[i + 1]
                i += 1
            else:
                out[a] = True
        i += 1
    return out


def env_value(env):
    """The env example's values, standing in for deploy/.env."""
    here = os.path.dirname(os.path.abspath(__file__))
    values = {}
    with open(os.path.join(here, env), encoding="utf-8") as f:
        for line in f:
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.strip().split("=", 1)
                values[k] = v
    return values


def compose_config(path, name):
    """A compose file's configs.NAME.content, its ${VAR}s from the env example."""
    content = load_yaml(path)["configs"][name]["content"]
    env = env_value("compose.env.example")
    return VAR.sub(lambda m: env.get(m.group(1), ""), content).replace("$$", "$")


def k8s_docs(*paths):
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs.extend((path, d) for d in yaml.safe_load_all(f) if d)
    return docs


def k8s_ha_config(k8s):
    """35-coordinator-ha.yaml's coordinator: its configuration as its init container writes it
    (10-config.yaml, 20-secret.yaml's tokens, the [etcd] ConfigMap) and its flags, with
    $(POD_NAME) the first pod's name."""
    config = load_yaml(os.path.join(k8s, "10-config.yaml"))["data"]["coordinator.toml"]
    tokens = next(
        d for _, d in k8s_docs(os.path.join(k8s, "20-secret.yaml"))
        if d["metadata"]["name"] == "automaton-coordinator-tokens"
    )["stringData"]["tokens.toml"]
    docs = [d for _, d in k8s_docs(os.path.join(k8s, "35-coordinator-ha.yaml"))]
    etcd = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "automaton-coordinator-etcd"
    )["data"]["etcd.toml"]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    container = next(
        c for c in sts["spec"]["template"]["spec"]["containers"]
        if command(c)[:1] == ["automaton-coordinator"]
    )
    pod = f"{sts['metadata']['name']}-0"
    args = [a.replace("$(POD_NAME)", pod) for a in command(container)[1:]]
    return config + tokens + etcd, args


def parse_ms(text):
    """`100ms`, `5s`, `2m` as milliseconds (None if it is none of those)."""
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h)?\s*", str(text))
    if not m:
        return None
    return int(m.group(1)) * {"ms": 1, "s": 1000, "m": 60000, "h": 3600000, None: 1000}[m.group(2)]


def image_pinned(path, where, image):
    last = str(image).rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    if not tag or tag == "latest":
        fail(path, f"{where}: image {image} has no pinned tag")


def check_etcd_flags(path, where, f):
    for key in ("--data-dir", "--initial-cluster", "--initial-cluster-state", "--heartbeat-interval",
                "--election-timeout", "--auto-compaction-mode", "--auto-compaction-retention"):
        if key not in f:
            fail(path, f"{where}: no {key}")
    hb, el = f.get("--heartbeat-interval"), f.get("--election-timeout")
    if str(hb).isdigit() and str(el).isdigit() and int(el) < 5 * int(hb):
        fail(path, f"{where}: --election-timeout {el} ms is under 5 heartbeats ({hb} ms each)")


def check_ha_config(path, where, cfg, flags, etcd_election_ms):
    """A coordinator's etcd settings: store, endpoints, name, election_ttl vs etcd's election."""
    etcd = cfg.get("etcd") or {}
    store = flags.get("--store") or cfg.get("store")
    if store != "etcd":
        fail(path, f"{where}: store is {store or 'files'}, not etcd")
    endpoints = flags["--etcd"].split(",") if "--etcd" in flags else list(etcd.get("endpoints") or [])
    if not endpoints:
        fail(path, f"{where}: no etcd endpoints")
    if "name" not in etcd:
        fail(path, f"{where}: no [etcd] name: a coordinator with store = etcd refuses to start without it (the same name on every coordinator of the project)")
    ttl = parse_ms(etcd.get("election_ttl", "5s"))
    if ttl is not None and etcd_election_ms and ttl < 2 * etcd_election_ms:
        fail(path, f"{where}: election_ttl {etcd.get('election_ttl')} is under twice etcd's --election-timeout "
                   f"({etcd_election_ms} ms): an etcd election would depose the leader")
    return endpoints, etcd.get("name"), flags.get("--advertise") or etcd.get("advertise")


def check_compose_ha(path):
    doc = load_yaml(path)
    services = doc.get("services") or {}
    named_volumes = set(doc.get("volumes") or {})
    etcd = {n: s for n, s in services.items() if command(s)[:1] == ["etcd"]}
    coords = {n: s for n, s in services.items() if command(s)[:1] == ["automaton-coordinator"]}
    workers = {n: s for n, s in services.items() if command(s)[:1] == ["automaton-worker"]}
    if len(etcd) < 3 or len(etcd) % 2 == 0:
        fail(path, f"{len(etcd)} etcd members: run 3 or 5 (a majority must be up)")
    want_cluster = {f"{n}=http://{n}:2380" for n in etcd}
    election_ms = 0
    data_sources = {}
    for name, svc in etcd.items():
        where = f"service {name}"
        f = flag_map(command(svc)[1:])
        image_pinned(path, where, svc.get("image", ""))
        check_etcd_flags(path, where, f)
        for key, want in (("--name", name), ("--advertise-client-urls", f"http://{name}:2379"),
                          ("--initial-advertise-peer-urls", f"http://{name}:2380")):
            if f.get(key) != want:
                fail(path, f"{where}: {key} is {f.get(key)}, expected {want}")
        cluster = set(str(f.get("--initial-cluster", "")).split(","))
        if cluster != want_cluster:
            fail(path, f"{where}: --initial-cluster {sorted(cluster)} is not the members {sorted(want_cluster)}")
        election_ms = max(election_ms, int(f.get("--election-timeout", 1000)))
        if not (svc.get("healthcheck") or {}).get("test"):
            fail(path, f"{where}: no healthcheck (the coordinators wait for healthy members)")
        data = str(f.get("--data-dir", ""))
        mounts = [v.split(":") for v in svc.get("volumes") or [] if isinstance(v, str)]
        source = next((m[0] for m in mounts if len(m) > 1 and data.startswith(m[1])), None)
        if source not in named_volumes:
            fail(path, f"{where}: --data-dir {data} is not on a named volume")
        elif source in data_sources:
            fail(path, f"{where}: shares its data volume {source} with {data_sources[source]}")
        else:
            data_sources[source] = name
    if len(coords) < 2:
        fail(path, f"{len(coords)} coordinator(s): high availability needs 2 or more")
    advertised = set()
    names = set()
    projects = {}
    configs = doc.get("configs") or {}
    for name, svc in coords.items():
        where = f"service {name}"
        f = flag_map(command(svc)[1:])
        target = f.get("--config")
        source = next((c.get("source") for c in svc.get("configs") or []
                       if isinstance(c, dict) and c.get("target") == target), None)
        if source not in configs:
            fail(path, f"{where}: --config {target} is not one of its configs")
            continue
        try:
            cfg = tomllib.loads(compose_config(path, source))
        except tomllib.TOMLDecodeError as e:
            fail(path, f"{where}: configs.{source} is not TOML: {e}")
            continue
        endpoints, etcd_name, advertise = check_ha_config(path, where, cfg, f, election_ms)
        names.add(etcd_name)
        port = str(f.get("--listen") or cfg.get("listen", "127.0.0.1:7070")).rsplit(":", 1)[-1]
        want = f"http://{name}:{port}"
        if advertise != want:
            fail(path, f"{where}: advertises {advertise}, expected its own service URL {want}")
        advertised.add(advertise)
        members = {f"http://{n}:2379" for n in etcd}
        if set(endpoints) != members:
            fail(path, f"{where}: etcd endpoints {endpoints} are not the members {sorted(members)}")
        project = cfg.get("project")
        mounts = [v.split(":") for v in svc.get("volumes") or [] if isinstance(v, str)]
        source = next((m[0] for m in mounts if len(m) > 1 and m[1] == project), None)
        if source not in named_volumes:
            fail(path, f"{where}: its project {project} is not on a named volume of its own")
        elif source in projects:
            fail(path, f"{where}: shares the project volume {source} with {projects[source]}: each coordinator keeps its own folder")
        else:
            projects[source] = name
        deps = svc.get("depends_on") or {}
        for member in etcd:
            if not isinstance(deps, dict) or (deps.get(member) or {}).get("condition") != "service_healthy":
                fail(path, f"{where}: does not wait for {member} to be healthy")
    if len(names) > 1:
        fail(path, f"the coordinators name the project differently in etcd: {sorted(map(str, names))}")
    for name, svc in workers.items():
        f = flag_map(command(svc)[1:])
        env = svc.get("environment") or {}
        given = f.get("--coordinator") or (env.get("AUTOMATON_COORDINATOR") if isinstance(env, dict) else None)
        if set(str(given or "").split(",")) != advertised:
            fail(path, f"service {name}: --coordinator {given} is not every coordinator {sorted(advertised)}")


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_k8s_ha(etcd_path, coord_path):
    docs = k8s_docs(etcd_path, coord_path)
    services = [d for _, d in docs if d["kind"] == "Service"]
    pdbs = [d for _, d in docs if d["kind"] == "PodDisruptionBudget"]

    def statefulset(first_word):
        for p, d in docs:
            if d["kind"] != "StatefulSet":
                continue
            for c in d["spec"]["template"]["spec"].get("containers") or []:
                if command(c)[:1] == [first_word]:
                    return p, d, c
        return None, None, None

    def headless(path, sts):
        name = sts["spec"].get("serviceName")
        svc = next((s for s in services if s["metadata"]["name"] == name), None)
        if svc is None:
            fail(path, f"StatefulSet {sts['metadata']['name']}: serviceName {name} is no Service here")
            return name
        if svc["spec"].get("clusterIP") != "None":
            fail(path, f"Service {name}: not headless (clusterIP: None): the pods get no stable names")
        if svc["spec"].get("publishNotReadyAddresses") is not True:
            fail(path, f"Service {name}: publishNotReadyAddresses is not true: pods that are not ready have no name")
        return name

    def common(path, sts, container, min_replicas):
        where = f"StatefulSet {sts['metadata']['name']}"
        spec = sts["spec"]
        if spec.get("podManagementPolicy") != "Parallel":
            fail(path, f"{where}: podManagementPolicy is not Parallel: OrderedReady waits on a pod that is not ready")
        if int(spec.get("replicas", 1)) < min_replicas:
            fail(path, f"{where}: {spec.get('replicas', 1)} replicas, fewer than {min_replicas}")
        if not spec.get("volumeClaimTemplates"):
            fail(path, f"{where}: no volumeClaimTemplates: the pods need volumes of their own")
        pod_name = [e for e in container.get("env") or []
                    if e.get("name") == "POD_NAME"
                    and ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") == "metadata.name"]
        if not pod_name:
            fail(path, f"{where}: no POD_NAME from the downward API (fieldRef metadata.name)")
        labels = spec["template"]["metadata"].get("labels") or {}
        if not any(selects((b["spec"].get("selector") or {}).get("matchLabels"), labels) for b in pdbs):
            fail(path, f"{where}: no PodDisruptionBudget selects its pods")
        return where, labels

    etcd_path, etcd, etcd_c = statefulset("etcd")
    members, election_ms = set(), 0
    if etcd is None:
        fail(etcd_path, "no StatefulSet runs etcd")
    else:
        where, _ = common(etcd_path, etcd, etcd_c, 3)
        replicas = int(etcd["spec"].get("replicas", 1))
        if replicas % 2 == 0:
            fail(etcd_path, f"{where}: {replicas} members: run an odd number (a majority must be up)")
        image_pinned(etcd_path, where, etcd_c.get("image", ""))
        svc = headless(etcd_path, etcd)
        ns = etcd["metadata"].get("namespace", "default")
        f = flag_map(command(etcd_c)[1:])
        check_etcd_flags(etcd_path, where, f)
        dns = f"{svc}.{ns}.svc"
        for key, want in (("--name", "$(POD_NAME)"),
                          ("--advertise-client-urls", f"http://$(POD_NAME).{dns}:2379"),
                          ("--initial-advertise-peer-urls", f"http://$(POD_NAME).{dns}:2380")):
            if f.get(key) != want:
                fail(etcd_path, f"{where}: {key} is {f.get(key)}, expected {want}")
        base = etcd["metadata"]["name"]
        want = {f"{base}-{i}=http://{base}-{i}.{dns}:2380" for i in range(replicas)}
        cluster = set(str(f.get("--initial-cluster", "")).split(","))
        if cluster != want:
            fail(etcd_path, f"{where}: --initial-cluster {sorted(cluster)} is not its {replicas} pods {sorted(want)}")
        members = {f"http://{base}-{i}.{dns}:2379" for i in range(replicas)}
        election_ms = int(f.get("--election-timeout", 1000))
        live = ((etcd_c.get("livenessProbe") or {}).get("httpGet") or {}).get("path", "")
        if live.split("?")[0] == "/health" and "serializable=true" not in live:
            fail(etcd_path, f"{where}: the liveness probe {live} needs quorum: a lost quorum would restart every member")

    coord_path_, coord, coord_c = statefulset("automaton-coordinator")
    if coord is None:
        return fail(coord_path, "no StatefulSet runs automaton-coordinator")
    where, labels = common(coord_path, coord, coord_c, 2)
    if (coord["spec"].get("updateStrategy") or {}).get("type", "RollingUpdate") == "RollingUpdate":
        fail(coord_path, f"{where}: a RollingUpdate waits forever on the first follower it replaces (never ready): use OnDelete")
    svc = headless(coord_path, coord)
    ns = coord["metadata"].get("namespace", "default")
    f = flag_map(command(coord_c)[1:])
    text, _ = k8s_ha_config(os.path.dirname(coord_path))
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return fail(coord_path, f"{where}: the coordinator's configuration is not TOML: {e}")
    endpoints, _, advertise = check_ha_config(coord_path, where, cfg, f, election_ms)
    port = str(f.get("--listen") or cfg.get("listen", "127.0.0.1:7070")).rsplit(":", 1)[-1]
    want = f"http://$(POD_NAME).{svc}.{ns}.svc:{port}"
    if advertise != want:
        fail(coord_path, f"{where}: --advertise is {advertise}, expected the pod's stable name {want}")
    if members and set(endpoints) != members:
        fail(coord_path, f"{where}: etcd endpoints {endpoints} are not {os.path.basename(etcd_path)}'s members {sorted(members)}")
    if "grpc" not in (coord_c.get("readinessProbe") or {}):
        fail(coord_path, f"{where}: the readiness probe is not gRPC health: followers would get traffic")
    for probe in ("startupProbe", "livenessProbe"):
        if "grpc" in (coord_c.get(probe) or {}):
            fail(coord_path, f"{where}: {probe} on gRPC health would restart every follower (they answer UNAVAILABLE)")
    claims = {t["metadata"]["name"] for t in coord["spec"].get("volumeClaimTemplates") or []}
    project = cfg.get("project")
    mount = next((m for m in coord_c.get("volumeMounts") or [] if m.get("mountPath") == project), None)
    if mount is None or mount.get("name") not in claims:
        fail(coord_path, f"{where}: its project {project} is not on a volume claim of its own")
    clients = [s for s in services if s["spec"].get("clusterIP") != "None" and selects(s["spec"].get("selector"), labels)]
    if not clients:
        fail(coord_path, f"{where}: no Service for clients selects its pods")
    for s in clients:
        if s["spec"].get("publishNotReadyAddresses"):
            fail(coord_path, f"Service {s['metadata']['name']}: publishes followers, which refuse every call")


def check_etcd_config(binary, toml_path, args):
    r = subprocess.run([binary, "--config", toml_path, *args, "--print-config"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return fail(toml_path, f"--print-config failed: {(r.stderr or r.stdout).strip()}")
    try:
        cfg = tomllib.loads(r.stdout)
    except tomllib.TOMLDecodeError as e:
        return fail(toml_path, f"--print-config printed no TOML: {e}")
    etcd = cfg.get("etcd") or {}
    if cfg.get("store") != "etcd":
        fail(toml_path, f"store is {cfg.get('store')}, not etcd")
    if not etcd.get("endpoints"):
        fail(toml_path, "no [etcd] endpoints")
    for e in etcd.get("endpoints") or []:
        if not str(e).startswith(("http://", "https://")):
            fail(toml_path, f"etcd endpoint {e} is not a URL")
    if not etcd.get("name"):
        fail(toml_path, "no [etcd] name: a coordinator with store = etcd refuses to start without it (the same name on every coordinator of the project)")
    if not str(etcd.get("advertise", "")).startswith(("http://", "https://")):
        fail(toml_path, f"no advertised URL (advertise = {etcd.get('advertise')}): followers could not name this one")


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
        elif cmd == "compose-ha" and len(args) == 1:
            check_compose_ha(*args)
        elif cmd == "k8s-ha" and len(args) in (2, 4) and args[2:3] in ([], ["--only"]):
            check_k8s_ha(args[0], args[1])
            if len(args) == 4:
                # The problems of one of the two files (deploy/check names each file).
                problems[:] = [p for p in problems if p.startswith(args[3] + ":")]
        elif cmd == "etcd-config" and len(args) >= 2:
            check_etcd_config(args[0], args[1], args[2:])
        elif cmd == "configs" and len(args) == 1:
            write_configs(*args)
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, StopIteration,
            subprocess.TimeoutExpired) as e:
        problems.append(f"{cmd} {' '.join(args)}: cannot read: {type(e).__name__}: {e}")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
