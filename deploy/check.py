#!/usr/bin/env python3
"""Structural checks of the deployment files; run by .ci/deploy-check.

    python3 deploy/check.py files WORKDIR     # everything below, writing WORKDIR/*
    python3 deploy/check.py metrics FILE      # names used by rules and dashboard exist in FILE
    python3 deploy/check.py context DIR       # copy the Docker build context (.dockerignore applied)
    python3 deploy/check.py targets JSON      # every target in `cargo metadata` output has its source
    python3 deploy/check.py prometheusrule    # print deploy/kubernetes/base/prometheusrule.yaml, made from
                                              # deploy/prometheus/dpcoord.rules.yml

`files` parses every YAML and JSON file under deploy/ and checks that the
pieces agree with each other and with the contract's defaults: the
Dockerfile's ports and user, the Kubernetes pod's ports, probes, labels,
selectors, volumes and the NetworkPolicy, the ConfigMap's binds, the
ServiceMonitor, the PrometheusRule against deploy/prometheus/dpcoord.rules.yml,
the scrape config, the Grafana dashboard and the systemd unit. It writes,
for the shell side to check with tools:

    WORKDIR/configmap-dpcoord.toml   the ConfigMap's dpcoord.toml (dpcoord check-config)
    WORKDIR/grafana.rules.yml        every dashboard query as a recording rule (promtool check rules)
    WORKDIR/prometheus-nosd.yml      prometheus.yml with kubernetes_sd_configs replaced by
                                     static_configs, for a promtool built without Kubernetes
                                     discovery (Debian's)

Prints one line per problem and exits 1 if there was any. Needs PyYAML.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes" / "base"
PROM = DEPLOY / "prometheus"

problems: list[str] = []


def problem(where: str, what: str) -> None:
    problems.append(f"{where}: {what}")


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def port_of(endpoint: str) -> int | None:
    m = re.search(r":(\d+)$", endpoint)
    return int(m.group(1)) if m else None


def contract_ports() -> dict[str, int]:
    """The default ports of config/dpcoord.toml (the contract's defaults)."""
    server = tomllib.loads((ROOT / "config" / "dpcoord.toml").read_text())["server"]
    return {k: port_of(server[f"{k}_bind"]) for k in ("route", "health", "stats", "metrics")}


# -- YAML ---------------------------------------------------------------------------


def load_yaml_files() -> dict[Path, list]:
    docs = {}
    for p in sorted(list(DEPLOY.rglob("*.yml")) + list(DEPLOY.rglob("*.yaml"))):
        try:
            loaded = [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
        except yaml.YAMLError as e:
            problem(rel(p), f"not valid YAML: {e}")
            continue
        if not loaded:
            problem(rel(p), "holds no YAML document")
        docs[p] = loaded
    return docs


# -- Dockerfile ---------------------------------------------------------------------


def check_dockerfile(ports: dict[str, int]) -> str | None:
    where = "Dockerfile"
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    froms = [ln for ln in lines if ln.upper().startswith("FROM ")]
    if len(froms) < 2:
        problem(where, "expected a multi-stage build (a build stage and a runtime stage)")
    elif not re.match(r"FROM\s+debian:\S*slim", froms[-1], re.I):
        problem(where, f"the runtime stage should be a slim Debian image, got `{froms[-1]}`")
    runtime = lines[lines.index(froms[-1]) :] if froms else lines
    exposed = {int(p.split("/")[0]) for ln in runtime if ln.upper().startswith("EXPOSE ") for p in ln.split()[1:]}
    if exposed != set(ports.values()):
        problem(where, f"EXPOSE {sorted(exposed)} differs from the contract's ports {sorted(ports.values())}")
    users = [ln.split()[1] for ln in runtime if ln.upper().startswith("USER ")]
    if not users or not re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]):
        problem(where, "the runtime stage must end as a numeric non-root USER (runAsNonRoot checks it)")
    health = [ln for ln in runtime if ln.upper().startswith("HEALTHCHECK ")]
    if not health or "/healthz" not in text or f":{ports['metrics']}/healthz" not in text:
        problem(where, f"HEALTHCHECK must probe /healthz on the metrics port {ports['metrics']}")
    entry = [ln for ln in runtime if ln.upper().startswith("ENTRYPOINT ")]
    if not entry or "dpcoord" not in entry[-1]:
        problem(where, "ENTRYPOINT must run dpcoord")
    cmd = [ln for ln in runtime if ln.upper().startswith("CMD ")]
    if not cmd or '"--config"' not in cmd[-1]:
        problem(where, "CMD must pass --config")
    copies = [ln for ln in runtime if ln.upper().startswith("COPY ")]
    for ln in copies:
        src = ln.split()[-2]
        if "--from=" in ln:
            if not src.endswith("/dpcoord"):
                problem(where, f"the runtime stage copies more than the binary from the build: `{ln}`")
        elif src.rstrip("/") != "config":
            problem(where, f"the runtime stage copies more than config/: `{ln}`")
    if not (ROOT / ".dockerignore").exists() or "target" not in (ROOT / ".dockerignore").read_text():
        problem(".dockerignore", "must keep target/ out of the build context")
    return users[-1].split(":")[0] if users else None


# -- Kubernetes ---------------------------------------------------------------------


def subset(sel: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (sel or {}).items())


def check_kubernetes(docs: dict[Path, list], ports: dict[str, int], image_uid: str | None, work: Path) -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust.get("resources", []))
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    if listed != present:
        problem("deploy/kubernetes/base/kustomization.yaml", f"resources {sorted(listed)} != files {sorted(present)}")

    by_kind: dict[str, list[tuple[Path, dict]]] = {}
    for p, ds in docs.items():
        if p.parent != K8S or p.name == "kustomization.yaml":
            continue
        for d in ds:
            if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= d.keys():
                problem(rel(p), "a document without apiVersion, kind and metadata")
                continue
            if not d["metadata"].get("name"):
                problem(rel(p), f"{d['kind']} without metadata.name")
            by_kind.setdefault(d["kind"], []).append((p, d))

    def one(kind: str) -> tuple[Path, dict] | tuple[None, None]:
        found = by_kind.get(kind, [])
        if len(found) != 1:
            problem("deploy/kubernetes/base", f"expected one {kind}, found {len(found)}")
            return None, None
        return found[0]

    dp, dep = one("Deployment")
    cp, cm = one("ConfigMap")
    sp, svc = one("Service")
    np_, pol = one("NetworkPolicy")
    mp, mon = one("ServiceMonitor")
    rp, rule = one("PrometheusRule")
    if not all([dep, cm, svc, pol, mon, rule]):
        return

    where = rel(dp)
    tmpl = dep["spec"]["template"]
    pod_labels = tmpl["metadata"].get("labels", {})
    if not subset(dep["spec"]["selector"].get("matchLabels"), pod_labels):
        problem(where, "spec.selector does not match the pod template's labels")
    pod = tmpl["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    co = containers.get("dpcoord")
    if co is None or len(containers) < 2:
        problem(where, "expected an engine container and a `dpcoord` sidecar")
        return
    named = {p["name"]: p["containerPort"] for p in co.get("ports", []) if "name" in p}
    for k in ("route", "health", "metrics"):
        if named.get(k) != ports[k]:
            problem(where, f"dpcoord port `{k}` should be {ports[k]}, got {named.get(k)}")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = co.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") not in ("metrics", ports["metrics"]):
            problem(where, f"dpcoord {probe} should GET {path} on the metrics port")
    res = co.get("resources", {})
    if not {"cpu", "memory"} <= res.get("requests", {}).keys() or not {"cpu", "memory"} <= res.get("limits", {}).keys():
        problem(where, "dpcoord needs cpu and memory requests and limits")
    sc = co.get("securityContext", {})
    if not sc.get("runAsNonRoot") or str(sc.get("runAsUser")) != str(image_uid):
        problem(where, f"dpcoord should run as non-root UID {image_uid} (the image's USER)")
    ann = tmpl["metadata"].get("annotations", {})
    if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(ports["metrics"]):
        problem(where, f"pod annotations should ask Prometheus to scrape port {ports['metrics']}")

    # Volumes: the config from the ConfigMap, the ipc directory shared by all containers.
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {c: {m["name"]: m["mountPath"] for m in containers[c].get("volumeMounts", [])} for c in containers}
    args = co.get("args", [])
    config_path = args[args.index("--config") + 1] if "--config" in args else None
    cm_vol = [n for n, v in vols.items() if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    if not cm_vol or config_path is None or not config_path.startswith(mounts["dpcoord"].get(cm_vol[0], "?") + "/"):
        problem(where, "dpcoord's --config must point into the mounted ConfigMap")
    toml_text = cm.get("data", {}).get(Path(config_path or "dpcoord.toml").name)
    if toml_text is None:
        problem(rel(cp), f"no key {Path(config_path or 'dpcoord.toml').name} in data")
        return
    (work / "configmap-dpcoord.toml").write_text(toml_text)
    server = tomllib.loads(toml_text).get("server", {})
    for k in ("route", "health"):
        if port_of(server.get(f"{k}_bind", "")) != named.get(k):
            problem(rel(cp), f"server.{k}_bind's port differs from the container's `{k}` port")
    if port_of(server.get("metrics_bind", "")) != named.get("metrics"):
        problem(rel(cp), "server.metrics_bind's port differs from the container's `metrics` port")
    stats = server.get("stats_bind", "")
    ipc_dirs = [n for n, v in vols.items() if "emptyDir" in v]
    shared = [n for n in ipc_dirs if all(n in mounts[c] for c in containers)]
    if not shared:
        problem(where, "no emptyDir mounted in every container (for the ipc:// endpoints)")
    elif not stats.startswith(f"ipc://{mounts['dpcoord'][shared[0]]}/"):
        problem(rel(cp), f"server.stats_bind should be an ipc:// path in the shared emptyDir, got `{stats}`")
    env = {e["name"]: e.get("value") for c in containers.values() if c is not co for e in c.get("env", [])}
    if stats and stats not in env.values():
        problem(where, f"the engine container is not told the stats endpoint {stats}")

    # Service, ServiceMonitor, NetworkPolicy.
    if not subset(svc["spec"].get("selector"), pod_labels):
        problem(rel(sp), "spec.selector does not select the pod")
    all_named = {p["name"]: p["containerPort"] for c in containers.values() for p in c.get("ports", []) if "name" in p}
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for name, p in svc_ports.items():
        if p.get("targetPort") not in all_named and p.get("targetPort") not in all_named.values():
            problem(rel(sp), f"port {name}'s targetPort is no container port")
    if not subset(mon["spec"]["selector"].get("matchLabels"), svc["metadata"].get("labels", {})):
        problem(rel(mp), "spec.selector does not select the Service")
    for ep in mon["spec"].get("endpoints", []):
        if ep.get("port") not in svc_ports:
            problem(rel(mp), f"endpoint port {ep.get('port')} is not a Service port name")
    job = svc["metadata"].get("labels", {}).get(mon["spec"].get("jobLabel", ""))
    if job != "dpcoord":
        problem(rel(mp), f"jobLabel gives job={job!r}; the alert rules select job=\"dpcoord\"")
    if not subset(pol["spec"]["podSelector"].get("matchLabels"), pod_labels):
        problem(rel(np_), "spec.podSelector does not select the pod")
    admitted = {p.get("port") for r in pol["spec"].get("ingress", []) for p in r.get("ports", [])}
    for c in containers.values():
        for p in c.get("ports", []):
            if p["containerPort"] not in admitted and p.get("name") not in admitted:
                problem(rel(np_), f"container port {p['containerPort']} ({c['name']}) is admitted by no rule")
    if any(not r.get("from") for r in pol["spec"].get("ingress", [])):
        problem(rel(np_), "an ingress rule without `from` admits everyone")

    groups = yaml.safe_load((PROM / "dpcoord.rules.yml").read_text())["groups"]
    if rule["spec"].get("groups") != groups or rp.read_text() != prometheus_rule():
        problem(
            rel(rp),
            "is not what deploy/prometheus/dpcoord.rules.yml makes: "
            "python3 deploy/check.py prometheusrule > deploy/kubernetes/base/prometheusrule.yaml",
        )


# -- Prometheus ---------------------------------------------------------------------


PROMETHEUS_RULE_HEAD = """\
# Made from deploy/prometheus/dpcoord.rules.yml (its groups, indented under
# spec) by `python3 deploy/check.py prometheusrule`; do not edit, regenerate.
# CI checks that the two agree. Add the labels your Prometheus' ruleSelector
# needs under metadata.labels (and to PROMETHEUS_RULE_HEAD in deploy/check.py).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: dpcoord
  labels:
    app.kubernetes.io/name: dpcoord
    app.kubernetes.io/part-of: llm-serving
spec:
"""


def prometheus_rule() -> str:
    """The PrometheusRule: the rules file from its `groups:` line on, indented under spec."""
    lines = (PROM / "dpcoord.rules.yml").read_text().splitlines()
    start = lines.index("groups:")
    body = "".join(f"  {ln}\n" if ln else "\n" for ln in lines[start:])
    return PROMETHEUS_RULE_HEAD + body


def check_prometheus(work: Path) -> None:
    p = PROM / "prometheus.yml"
    cfg = yaml.safe_load(p.read_text())
    files = cfg.get("rule_files", [])
    for f in files:
        if not (PROM / f).exists():
            problem(rel(p), f"rule file {f} does not exist")
    for job in cfg.get("scrape_configs", []):
        relabel_job = any(r.get("target_label") == "job" and r.get("replacement") == "dpcoord" for r in job.get("relabel_configs", []))
        if job["job_name"] != "dpcoord" and not relabel_job:
            problem(rel(p), f"job {job['job_name']} does not label its targets job=\"dpcoord\" (the alerts select it)")
        if "kubernetes_sd_configs" in job:
            del job["kubernetes_sd_configs"]
            job["static_configs"] = [{"targets": []}]
    cfg["rule_files"] = [str(PROM / f) for f in files]
    (work / "prometheus-nosd.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))


# -- Grafana ------------------------------------------------------------------------


def dashboard_exprs() -> list[tuple[str, str]]:
    p = DEPLOY / "grafana" / "dpcoord.json"
    try:
        dash = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        problem(rel(p), f"not valid JSON: {e}")
        return []
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problem(rel(p), "needs a `datasource` variable of type datasource for prometheus")
    ids, exprs = set(), []
    for panel in dash.get("panels", []):
        if panel.get("id") in ids:
            problem(rel(p), f"panel id {panel.get('id')} is used twice")
        ids.add(panel.get("id"))
        g = panel.get("gridPos", {})
        if not g or g.get("x", 0) + g.get("w", 0) > 24:
            problem(rel(p), f"panel {panel.get('title')!r} has no gridPos or is wider than the grid")
        if panel.get("type") == "row":
            continue
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            problem(rel(p), f"panel {panel.get('title')!r} does not use the datasource variable")
        if not panel.get("targets"):
            problem(rel(p), f"panel {panel.get('title')!r} has no query")
        for t in panel.get("targets", []):
            if t.get("datasource", {}).get("uid") != "${datasource}":
                problem(rel(p), f"a query of {panel.get('title')!r} does not use the datasource variable")
            exprs.append((panel["title"], t["expr"]))
    return exprs


def write_dashboard_rules(work: Path, exprs: list[tuple[str, str]]) -> None:
    rules = []
    for i, (_, e) in enumerate(exprs):
        e = e.replace("$__rate_interval", "5m").replace("$instance", "127.0.0.1:9570")
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    (work / "grafana.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))


# -- systemd ------------------------------------------------------------------------


def check_systemd() -> None:
    p = DEPLOY / "systemd" / "dpcoord.service"
    keys: dict[str, list[str]] = {}
    for ln in p.read_text().splitlines():
        if "=" in ln and not ln.startswith(("#", ";", "[")):
            k, v = ln.split("=", 1)
            keys.setdefault(k.strip(), []).append(v.strip())
    want = {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "RuntimeDirectory": "dpcoord",
        "Restart": "on-failure",
    }
    for k, v in want.items():
        if keys.get(k) != [v]:
            problem(rel(p), f"{k}={v} expected, got {keys.get(k)}")
    if not keys.get("RestrictAddressFamilies"):
        problem(rel(p), "RestrictAddressFamilies missing")
    if "--config" not in " ".join(keys.get("ExecStart", [])):
        problem(rel(p), "ExecStart must pass --config")
    # The single-node example puts its ipc:// endpoints in the RuntimeDirectory.
    vllm = tomllib.loads((ROOT / "config" / "vllm-8rank.toml").read_text())["server"]
    if not vllm["stats_bind"].startswith("ipc:///run/dpcoord/"):
        problem("config/vllm-8rank.toml", "stats_bind should live in /run/dpcoord (the unit's RuntimeDirectory)")


# -- metric names -------------------------------------------------------------------


def used_metric_names() -> set[str]:
    text = (PROM / "dpcoord.rules.yml").read_text() + (DEPLOY / "grafana" / "dpcoord.json").read_text()
    return set(re.findall(r"\bdpcoord_[a-z_]+\b", text))


def check_metrics(path: Path) -> None:
    exposed = set()
    for ln in path.read_text().splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", ln)
        if m:
            exposed.add(m.group(1))
            if m.group(2) == "histogram":
                exposed |= {m.group(1) + s for s in ("_bucket", "_sum", "_count")}
    for name in sorted(used_metric_names() - exposed):
        problem("deploy/", f"uses {name}, which dpcoord's /metrics does not expose")


# -- Docker build context -----------------------------------------------------------


def ignored(relpath: str, patterns: list[str]) -> bool:
    """.dockerignore matching, for the patterns used here (`dir/`, `**/name/`, globs)."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(part, pat[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch(pre, pat) for pre in prefixes):
            return True
    return False


def copy_context(dest: Path) -> int:
    patterns = [
        ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    n = 0
    for d, dirs, files in os.walk(ROOT):
        base = Path(d).relative_to(ROOT).as_posix()
        join = (lambda name: name) if base == "." else (lambda name: f"{base}/{name}")
        dirs[:] = [x for x in dirs if not ignored(join(x), patterns)]
        for f in files:
            r = join(f)
            if not ignored(r, patterns):
                (dest / r).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / r, dest / r)
                n += 1
    return n


def check_targets(metadata: Path) -> int:
    meta = json.loads(metadata.read_text())
    n = 0
    for pkg in meta["packages"]:
        for t in pkg["targets"]:
            n += 1
            if not Path(t["src_path"]).exists():
                problem("Docker build context", f"{t['kind'][0]} target {t['name']}: {t['src_path']} is missing")
    return n


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "files":
        work = Path(argv[2])
        ports = contract_ports()
        docs = load_yaml_files()
        uid = check_dockerfile(ports)
        check_kubernetes(docs, ports, uid, work)
        check_prometheus(work)
        exprs = dashboard_exprs()
        write_dashboard_rules(work, exprs)
        check_systemd()
        summary = f"{sum(len(d) for d in docs.values())} YAML documents in {len(docs)} files, {len(exprs)} dashboard queries"
    elif len(argv) == 3 and argv[1] == "metrics":
        check_metrics(Path(argv[2]))
        summary = f"{len(used_metric_names())} metric names used by rules and dashboard"
    elif len(argv) == 3 and argv[1] == "context":
        summary = f"{copy_context(Path(argv[2]))} files in the Docker build context"
    elif len(argv) == 2 and argv[1] == "prometheusrule":
        sys.stdout.write(prometheus_rule())
        return 0
    elif len(argv) == 3 and argv[1] == "targets":
        summary = f"{check_targets(Path(argv[2]))} cargo targets have their sources"
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(f"deploy-check: {p}")
    print(f"{argv[1]}: {summary}; problems: {len(problems)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
