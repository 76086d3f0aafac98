#!/usr/bin/env python3
"""Consistency checks of the Fly deployment artefacts (run by .ci/run).

promtool, amtool and hadolint check each file on its own; this checks that
the files agree with each other and with the config the image ships:

* fly.toml parses; its [metrics] port and every [checks] port are the port
  of `server.listen` in the config the Dockerfile bakes in; [metrics] path is
  /metrics and a check probes /healthz; no public service (no http_service,
  no services.ports); the volume is mounted where overlay.mirror_dir lives;
  restart policy always; a [[vm]] size.
* fly.toml's FLEET_CONFIG build arg (else the Dockerfile's default) names
  the config the image ships; the COPY destination and the CMD's --config
  agree; EXPOSE is the served port.
* Every secret the shipped config names (keys ending in `_env`, and the
  defaults) appears in a `fly secrets set` line of docs/deploy.md.
* Every alert rule has severity/team labels, summary/description/runbook_url
  annotations, a runbook anchor that exists in docs/operations.md, and unit
  tests both firing and not firing.
* The Grafana dashboard parses, queries only fleet_reconciler_* (and
  process_*) metrics, plots every metric the runbook's Metrics table
  (docs/operations.md) says it plots, and every panel query is valid PromQL
  (checked by promtool as recording rules); a stat of replicas' staleness
  shows the stalest replica. Whether each name is one the
  daemon exports is checked by `cargo test --test it metrics::every_metric_name`.
* No rule, route or panel reads `app` or `region` as the agents' app or
  region: a scrape sets those to the reconciler's own (use fly_app,
  fly_region).
* Relative links of the README and the docs reach existing files and headings.
* fly.toml turns on JSON logs (FLEET_RECONCILER_LOG_FORMAT).
* Every config key and every command (with its flags and `--output`
  values) the README and docs/*.md name exists: the keys as the built
  binary's config parser knows them, the commands and flags as its `--help`
  lists them (needs `cargo build` first; FLEET_RECONCILER_BIN names another
  binary). TOML examples in the docs are checked key by key too.
* Every reference to a design section ("docs/design.md §6.2", "design §5")
  in the README, the docs, the sources, tests, examples, benches and
  deploy/ names a numbered section of docs/design.md, and none points at the
  product spec outside the repository ("DESIGN §n", "shared/DESIGN.md").

Usage: python3 deploy/check.py   (from the repository root; Python >= 3.11)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PATH_IN_IMAGE = "/etc/fleet-reconciler/fleet-reconciler.toml"
# Labels a scrape sets on every series (Fly's managed Prometheus: app,
# region, instance; any scrape: instance, job). They name the reconciler
# itself, never the agents' app or region (those are fly_app, fly_region).
SCRAPE_LABELS = ("app", "region")
# Defaults of the config's *_env keys (README, configuration reference).
DEFAULT_SECRET_ENVS = {"FLEET_RECONCILER_FLY_TOKEN", "OVERLAY_GIT_TOKEN", "FLEET_ADMIN_TOKEN"}

errors: list[str] = []


def fail(msg: str) -> None:
    errors.append(msg)


def load_yaml(path: Path):
    try:
        import yaml  # PyYAML
    except ImportError:
        sys.exit("deploy/check.py needs PyYAML (pip install pyyaml)")
    return yaml.safe_load(path.read_text())


def port_of(listen: str) -> int:
    # "0.0.0.0:9090" or "[::]:9090"
    return int(listen.rsplit(":", 1)[1])


def dockerfile_facts() -> dict:
    text = (ROOT / "Dockerfile").read_text()
    facts: dict = {}
    m = re.search(r"^ARG FLEET_CONFIG=(\S+)$", text, re.M)
    facts["config_default"] = m.group(1) if m else None
    m = re.search(r"^COPY \$\{FLEET_CONFIG\} (\S+)$", text, re.M)
    facts["config_dest"] = m.group(1) if m else None
    m = re.search(r"^CMD (\[.*\])$", text, re.M)
    facts["cmd"] = json.loads(m.group(1)) if m else None
    m = re.search(r"^EXPOSE (\d+)$", text, re.M)
    facts["expose"] = int(m.group(1)) if m else None
    return facts


def check_fly_toml() -> dict:
    fly = tomllib.loads((ROOT / "fly.toml").read_text())
    docker = dockerfile_facts()

    config_rel = fly.get("build", {}).get("args", {}).get("FLEET_CONFIG") or docker["config_default"]
    if config_rel is None:
        fail("Dockerfile: no `ARG FLEET_CONFIG=…` default and no [build.args] FLEET_CONFIG in fly.toml")
        return {}
    if not docker["config_default"] or not (ROOT / docker["config_default"]).is_file():
        fail(f"Dockerfile: `ARG FLEET_CONFIG={docker['config_default']}` does not name a file of the repository")
    if docker["config_dest"] != CONFIG_PATH_IN_IMAGE:
        fail(f"Dockerfile copies the config to {docker['config_dest']}, expected {CONFIG_PATH_IN_IMAGE}")
    cmd = docker["cmd"] or []
    if "run" not in cmd or "--config" not in cmd or cmd[cmd.index("--config") + 1] != CONFIG_PATH_IN_IMAGE:
        fail(f"Dockerfile CMD {cmd} must be `run --config {CONFIG_PATH_IN_IMAGE}`")
    config_file = ROOT / config_rel
    if not config_file.is_file():
        fail(f"the config the image ships, {config_rel}, does not exist")
        return {}
    config = tomllib.loads(config_file.read_text())
    listen = config.get("server", {}).get("listen", "0.0.0.0:9090")
    port = port_of(listen)

    metrics = fly.get("metrics")
    if isinstance(metrics, list):  # [[metrics]] is allowed too
        metrics = metrics[0] if metrics else None
    if not metrics:
        fail("fly.toml has no [metrics] section: Fly's Prometheus would not scrape the daemon")
    else:
        if metrics.get("port") != port:
            fail(f"fly.toml [metrics] port {metrics.get('port')} != port of server.listen {listen!r} in {config_rel}")
        if metrics.get("path") != "/metrics":
            fail(f"fly.toml [metrics] path {metrics.get('path')!r} != '/metrics'")
    if docker["expose"] != port:
        fail(f"Dockerfile EXPOSE {docker['expose']} != port {port} of server.listen")

    checks = fly.get("checks", {})
    if not checks:
        fail("fly.toml has no [checks]: nothing probes /healthz")
    for name, check in checks.items():
        if check.get("port") != port:
            fail(f"fly.toml [checks.{name}] port {check.get('port')} != {port}")
    if not any(c.get("type") == "http" and c.get("path") == "/healthz" for c in checks.values()):
        fail("fly.toml: no http check on /healthz")

    # Internal only: nothing the proxy would expose publicly.
    if "http_service" in fly:
        fail("fly.toml has an [http_service]: that publishes the admin API on the internet")
    services = fly.get("services", [])
    if isinstance(services, dict):
        services = [services]
    for s in services:
        if s.get("ports"):
            fail("fly.toml has [[services.ports]]: the admin API must be reachable over 6PN only")

    mounts = fly.get("mounts")
    if isinstance(mounts, list):
        mounts = mounts[0] if mounts else None
    mirror = config.get("overlay", {}).get("mirror_dir", "")
    if not mounts:
        fail("fly.toml has no [mounts]: every restart would clone the overlay again")
    elif not (mirror + "/").startswith(mounts.get("destination", "").rstrip("/") + "/"):
        fail(f"overlay.mirror_dir {mirror!r} is not on the volume mounted at {mounts.get('destination')!r}")

    if not any(r.get("policy") == "always" for r in fly.get("restart", [])):
        fail("fly.toml: [[restart]] policy = \"always\" missing")
    if not any(v.get("size") for v in fly.get("vm", [])):
        fail("fly.toml: [[vm]] size missing")
    return config


def collect_envs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k.endswith("_env") and isinstance(v, str):
                out.add(v)
            else:
                collect_envs(v, out)
    elif isinstance(node, list):
        for v in node:
            collect_envs(v, out)


def check_secrets_documented(config: dict) -> None:
    envs = set(DEFAULT_SECRET_ENVS)
    collect_envs(config, envs)
    deploy_md = (ROOT / "docs/deploy.md").read_text()
    set_lines = "\n".join(l for l in deploy_md.splitlines() if "fly secrets set" in l or "fly secrets import" in l or re.match(r"\s*[A-Z_]+=", l))
    for env in sorted(envs):
        if env not in set_lines:
            fail(f"secret {env} (named by the shipped config) has no `fly secrets set` line in docs/deploy.md")


def github_anchors(markdown: str) -> set[str]:
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"`", "", m.group(1)).lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


def scrape_label_uses(text: str) -> list[str]:
    """Places where PromQL or a template reads a label a scrape overwrites."""
    names = "|".join(SCRAPE_LABELS)
    found = re.findall(rf"(?<![\w$.])(?:{names})\s*(?:=~|!~|!=|=|,|\))", text)
    found += re.findall(rf"\$labels\.(?:{names})\b", text)
    found += re.findall(rf"\{{\{{\s*(?:{names})\s*\}}\}}", text)
    return found


def check_scrape_labels() -> None:
    rules = load_yaml(ROOT / "deploy/prometheus/fleet-reconciler.rules.yml")
    for group in rules["groups"]:
        for r in group["rules"]:
            templates = " ".join(re.findall(r"\{\{.*?\}\}", json.dumps(r.get("annotations", {}))))
            for use in scrape_label_uses(r.get("expr", "") + " " + templates):
                fail(f"rule {r.get('alert') or r.get('record')}: reads {use!r}; the agents' app and region are fly_app, fly_region")
    route = load_yaml(ROOT / "deploy/alertmanager/route.example.yml")

    def walk(node: dict, where: str) -> None:
        for key in ("group_by",):
            for label in node.get(key, []) or []:
                if label in SCRAPE_LABELS:
                    fail(f"{where}: {key} {label}: a scrape sets it to the reconciler's own; use fly_app")
        for i, child in enumerate(node.get("routes", []) or []):
            walk(child, f"{where}.routes[{i}]")

    walk(route.get("route", {}), "route.example.yml route")
    for i, inhibit in enumerate(route.get("inhibit_rules", []) or []):
        for label in inhibit.get("equal", []) or []:
            if label in SCRAPE_LABELS:
                fail(f"route.example.yml inhibit_rules[{i}]: equal {label}: every alert has the same; use fly_app")
    dash = json.loads((ROOT / "deploy/grafana/fleet-reconciler.json").read_text())
    for p in dash.get("panels", []):
        for t in p.get("targets", []):
            for use in scrape_label_uses(t.get("expr", "") + " " + t.get("legendFormat", "")):
                fail(f"dashboard panel {p.get('title')!r}: reads {use!r}; use fly_app, fly_region")
    for var in dash.get("templating", {}).get("list", []):
        q = json.dumps(var.get("query", ""))
        if re.search(r"label_values\([^,]*,\s*(app|region)\s*\)", q):
            fail(f"dashboard variable {var.get('name')}: reads a scrape's label; use fly_app")


def check_rules() -> None:
    rules = load_yaml(ROOT / "deploy/prometheus/fleet-reconciler.rules.yml")
    tests = load_yaml(ROOT / "deploy/prometheus/fleet-reconciler.rules.test.yml")
    anchors = github_anchors((ROOT / "docs/operations.md").read_text())
    firing: set[str] = set()
    silent: set[str] = set()
    for t in tests.get("tests", []):
        for a in t.get("alert_rule_test", []):
            (firing if a.get("exp_alerts") else silent).add(a["alertname"])
    for group in rules["groups"]:
        for r in group["rules"]:
            name = r.get("alert")
            if not name:
                continue
            labels = r.get("labels", {})
            ann = r.get("annotations", {})
            if labels.get("severity") not in ("warning", "critical"):
                fail(f"alert {name}: label severity must be warning or critical")
            if not labels.get("team"):
                fail(f"alert {name}: no team label (Alertmanager routes on it)")
            for key in ("summary", "description", "runbook_url"):
                if not ann.get(key):
                    fail(f"alert {name}: annotation {key} missing")
            url = ann.get("runbook_url", "")
            if "docs/operations.md#" not in url:
                fail(f"alert {name}: runbook_url {url!r} does not point into docs/operations.md")
            elif url.split("#", 1)[1] not in anchors:
                fail(f"alert {name}: docs/operations.md has no heading for anchor #{url.split('#', 1)[1]}")
            if name not in firing:
                fail(f"alert {name}: no unit test where it fires")
            if name not in silent:
                fail(f"alert {name}: no unit test where it does not fire")


def check_dashboard() -> None:
    dash = json.loads((ROOT / "deploy/grafana/fleet-reconciler.json").read_text())
    for key in ("title", "uid", "panels"):
        if not dash.get(key):
            fail(f"dashboard: {key} missing")
    exprs: list[tuple[str, str]] = []
    for p in dash.get("panels", []):
        for t in p.get("targets", []):
            exprs.append((p.get("title", "?"), t["expr"]))
    used = set()
    for title, expr in exprs:
        names = set(re.findall(r"\b((?:fleet|process)_[a-z_]+)", expr))
        names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
        if not any(n.startswith("fleet_reconciler_") for n in names):
            fail(f"dashboard panel {title!r}: query uses no fleet_reconciler_ metric")
        for n in names:
            if not n.startswith(("fleet_reconciler_", "process_")):
                fail(f"dashboard panel {title!r}: {n} is not a fleet_reconciler_ metric")
        used |= names
    # A stat of several replicas' staleness shows the stalest replica, never
    # a fresh one hiding a stale one.
    for p in dash.get("panels", []):
        if p.get("type") != "stat":
            continue
        for t in p.get("targets", []):
            e = t["expr"]
            if "last_sweep_success_timestamp" in e and not re.search(r"\bmin\s*\(", e):
                fail(f"dashboard stat {p.get('title')!r}: {e} must take the oldest sweep (min) across replicas")
            if "tip_age_seconds" in e and not re.search(r"\bmax\s*\(", e):
                fail(f"dashboard stat {p.get('title')!r}: {e} must take the oldest tip (max) across replicas")
    # docs/operations.md: "The dashboard … plots all of them" (its table).
    ops = (ROOT / "docs/operations.md").read_text()
    section = ops.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(l for l in section.splitlines() if l.startswith("| `"))
    for n in sorted(set(re.findall(r"`((?:fleet_reconciler|process)_[a-z_]+)", table)) - used):
        fail(f"dashboard: {n} is in the runbook's Metrics table but on no panel")
    # PromQL syntax: every query as a recording rule, through promtool.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}",
         "expr": e.replace("$__rate_interval", "5m").replace("$app", ".+")}
        for i, (_, e) in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        json.dump(rules, f)  # JSON is YAML
        tmp = f.name
    try:
        r = subprocess.run(["promtool", "check", "rules", tmp], capture_output=True, text=True)
    except FileNotFoundError:
        fail("promtool not found: cannot check the dashboard's queries")
        return
    finally:
        Path(tmp).unlink(missing_ok=True)
    if r.returncode != 0:
        fail("dashboard queries are not valid PromQL:\n" + r.stdout + r.stderr)


DOCS = [
    "README.md",
    "deploy/README.md",
    "docs/agent-contract.md",
    "docs/alerts.md",
    "docs/deploy.md",
    "docs/design.md",
    "docs/observability.md",
    "docs/operations.md",
    "docs/reference.md",
    "docs/benchmarks.md",
    "docs/safety.md",
]


def check_doc_links() -> None:
    """Relative links of the README and the docs point at files and headings that exist."""
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                fail(f"{doc}: link to {target}: no such file")
                continue
            if anchor and dest.suffix == ".md":
                dest_text = dest.read_text()
                anchors = github_anchors(dest_text) | set(re.findall(r'<a id="([^"]+)"', dest_text))
                if anchor not in anchors:
                    fail(f"{doc}: link to {target}: no such heading")


DESIGN_REF_GLOBS = ["README.md", "docs/*.md", "src/**/*.rs", "tests/**/*.rs", "examples/*.rs", "benches/*.rs", "deploy/**/*"]


def design_sections(markdown: str) -> set[str]:
    """Section numbers of docs/design.md: `## 6. Rotation` gives 6, `### 6.2 Phases` 6.2."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", markdown, flags=re.M))


def check_design_refs() -> None:
    """References to design sections resolve inside the repository."""
    sections = design_sections((ROOT / "docs/design.md").read_text())
    files = sorted({p for g in DESIGN_REF_GLOBS for p in ROOT.glob(g) if p.is_file()})
    for path in files:
        if path == Path(__file__).resolve():
            continue  # this file names the patterns it looks for
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(ROOT)
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"DESIGN §|shared/DESIGN\.md", line):
                fail(f"{rel}:{n}: refers to the product spec outside the repository; point it at docs/design.md")
            for sec in re.findall(r"design(?:\.md)?\]?(?:\([^)]*\))? §(\d+(?:\.\d+)?)", line):
                if sec not in sections:
                    fail(f"{rel}:{n}: docs/design.md has no section §{sec}")


# --- config keys and commands named in the docs (issue 21 item 8) ---------------------------

DOCS_NAMING_KEYS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# Each table of the config as the docs name it, and a TOML stub that opens
# it: the binary's refusal of an unknown key in it lists the table's keys.
CONFIG_TABLES = {
    "": "",
    "fly": "[fly]",
    "overlay": "[overlay]",
    "sweep": "[sweep]",
    "probe": "[probe]",
    "apps[]": '[[apps]]\nname = "a"',
    "pools.NAME": "[pools.x]",
    "pools.NAME.actions": "[pools.x.actions]",
    "pools.NAME.windows[]": '[[pools.x.windows]]\nallow = "0 2 * * *"\nduration = "1h"',
    "severity[]": "[[severity]]",
    "rotation": "[rotation]",
    "release": "[release]",
    "gates": "[gates]",
    "gates.alertmanager": "[gates.alertmanager]",
    "alerts": "[alerts]",
    "alerts.webhooks[]": "[[alerts.webhooks]]",
    "alerts.alertmanager[]": "[[alerts.alertmanager]]",
    "alerts.heartbeat[]": "[[alerts.heartbeat]]",
    "metrics": "[metrics]",
    "server": "[server]",
    "records": "[records]",
}
# Tables whose keys are names the user chooses (a pool, a label).
FREE_MAPS = ("pools", "alerts.alertmanager[].labels")
FILE_SUFFIXES = (".toml", ".md", ".rs", ".yml", ".yaml", ".json", ".git", ".io", ".dev", ".py", ".sh", ".internal")


def binary() -> Path | None:
    path = Path(os.environ.get("FLEET_RECONCILER_BIN", ROOT / "target/debug/fleet-reconciler"))
    return path if path.is_file() else None


def config_keys(bin_path: Path) -> dict[str, set[str]]:
    """Each table's keys, from the binary's own refusal of an unknown one."""
    keys: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.toml"
        for table, stub in CONFIG_TABLES.items():
            probe.write_text(f"{stub}\nzz_not_a_key = 1\n")
            r = subprocess.run([str(bin_path), "validate-config", "--config", str(probe), "--output", "json"],
                               capture_output=True, text=True)
            try:
                error = json.loads(r.stdout)["error"]
            except (ValueError, KeyError):
                fail(f"validate-config gave no JSON error for an unknown key in [{table}]: {r.stdout}{r.stderr}")
                continue
            m = re.search(r"unknown field `zz_not_a_key`, expected (.*)$", error)
            if not m:
                fail(f"validate-config did not refuse an unknown key in [{table}]: {error}")
                continue
            keys[table] = set(re.findall(r"`([a-z_]+)`", m.group(1)))
    return keys


def document_paths() -> set[str]:
    """Field paths of the fleet document (`apps[].stale`), from its schema:
    the docs name them in the same dotted form as config keys."""
    path = ROOT / "docs/fleet.schema.json"
    if not path.is_file():
        return set()
    schema = json.loads(path.read_text())
    defs = schema.get("$defs", {})
    out: set[str] = set()

    def walk(node: dict, prefix: str, depth: int = 0) -> None:
        if depth > 6:
            return
        if "$ref" in node:
            node = defs.get(node["$ref"].rsplit("/", 1)[1], {})
        for k, v in node.get("properties", {}).items():
            p = f"{prefix}.{k}" if prefix else k
            out.add(p)
            if v.get("type") == "array" and isinstance(v.get("items"), dict):
                walk(v["items"], p + "[]", depth + 1)
            else:
                walk(v, p, depth + 1)

    walk(schema, "")
    return out


def normalise_key(path: str) -> str:
    """`apps[0].name` → `apps[].name`, `pools.gpu.actions` → `pools.NAME.actions`."""
    path = re.sub(r"\[\d*\]", "[]", path)
    parts = path.split(".")
    if parts[0] == "pools" and len(parts) > 1:
        parts[1] = "NAME"
    return ".".join(parts)


def key_known(path: str, keys: dict[str, set[str]]) -> bool:
    path = normalise_key(path)
    if path.endswith(".*"):
        return path[:-2] in keys
    if path in keys or path.rstrip("[]") in keys.get("", set()) and "." not in path:
        return True
    table, _, leaf = path.rpartition(".")
    if table in keys and leaf in keys[table]:
        return True
    # An array of tables named by its table: `alerts.webhooks[]`.
    return path in {t for t in keys if t.endswith("[]")}


def toml_blocks(text: str):
    for m in re.finditer(r"^```toml\n(.*?)^```", text, flags=re.M | re.S):
        yield text[: m.start()].count("\n") + 2, m.group(1)


def walk_toml(node, prefix: str):
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else k
            if prefix in FREE_MAPS:
                if isinstance(v, dict):
                    yield from walk_toml(v, path)
                continue  # a name of the user's, not a key
            if isinstance(v, dict) and not path.endswith(".actions") and path not in FREE_MAPS:
                yield path
                yield from walk_toml(v, path)
            elif isinstance(v, dict):
                if path in FREE_MAPS:
                    yield path
                yield from walk_toml(v, path)
            elif isinstance(v, list) and v and all(isinstance(i, dict) for i in v):
                for item in v:
                    yield from walk_toml(item, path + "[]")
            else:
                yield path


def cli_surface(bin_path: Path) -> tuple[dict[str, set[str]], set[str]]:
    """Each command's flags, and the global flags, from `--help`."""
    def flags(help_text: str) -> set[str]:
        return set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z-]*)", help_text, flags=re.M))

    top = subprocess.run([str(bin_path), "--help"], capture_output=True, text=True).stdout
    section = top.split("Commands:", 1)[1].split("Options:", 1)[0] if "Commands:" in top else ""
    commands = [c for c in re.findall(r"^  ([a-z][a-z-]*)\s", section, flags=re.M) if c != "help"]
    surface = {c: flags(subprocess.run([str(bin_path), c, "--help"], capture_output=True, text=True).stdout)
               for c in commands}
    return surface, flags(top) | {"--help", "--version"}


def check_command_line(where: str, words: list[str], surface: dict[str, set[str]], global_flags: set[str]) -> None:
    if not words:
        return
    command = words[0]
    if command not in surface:
        fail(f"{where}: `fleet-reconciler {command}`: no such command (commands: {', '.join(sorted(surface))})")
        return
    for i, w in enumerate(words[1:], 1):
        flag = w.split("=", 1)[0].strip("[]").rstrip(".,;:)")
        if flag.startswith("--") and re.fullmatch(r"--[a-z][a-z-]*", flag) and flag not in surface[command] | global_flags:
            fail(f"{where}: `{command} {flag}`: {command} has no such flag")
        if flag in ("--output", "-o") and i + 1 < len(words) and not words[i + 1].startswith(("<", "-")):
            for value in re.split(r"\\?\|", words[i + 1].strip("[]`")):
                if value and value not in ("text", "json"):
                    fail(f"{where}: `{command} {flag} {words[i + 1]}`: --output is text or json")


def check_fly_logs_json() -> None:
    """The deployed daemon logs JSON lines (issue 21 item 6)."""
    env = tomllib.loads((ROOT / "fly.toml").read_text()).get("env", {})
    if env.get("FLEET_RECONCILER_LOG_FORMAT") != "json":
        fail("fly.toml [env] must set FLEET_RECONCILER_LOG_FORMAT = \"json\": Fly's log shipper gets one JSON object per line")


def check_docs_name_real_config_keys_and_commands() -> None:
    """Every config key and command the README and docs name exists in the built binary."""
    bin_path = binary()
    if bin_path is None:
        fail("no built binary to check the docs' config keys and commands against: run `cargo build` first")
        return
    keys = config_keys(bin_path)
    sections = keys.get("", set())
    surface, global_flags = cli_surface(bin_path)
    if not surface:
        fail(f"{bin_path} --help lists no commands")
        return
    json_fields = document_paths()
    key_span = re.compile(r"^\[{0,2}([a-z_]+(?:\[\d*\])?(?:\.(?:[a-z_]+|NAME|<[a-z_]+>|\*)(?:\[\d*\])?)+)\]{0,2}(?:\s+=\s+(?!=).*)?$")
    for doc in DOCS_NAMING_KEYS:
        text = (ROOT / doc).read_text()
        prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
        for n, line in enumerate(prose.splitlines(), 1):
            for span in re.findall(r"`([^`\n]+)`", line):
                m = key_span.match(span.strip())
                if m and m.group(1).split(".")[0].split("[")[0] in sections and not span.strip().endswith(FILE_SUFFIXES):
                    key = re.sub(r"<[a-z_]+>", "NAME", m.group(1))
                    if not key_known(key, keys) and normalise_key(key) not in json_fields:
                        fail(f"{doc}:{n}: config key `{key}` does not exist")
            # Commands: `fleet-reconciler CMD …`, `cargo run … -- CMD …`, and
            # the README's command table (`CMD …` in its first column).
            for span in re.findall(r"`([^`\n]+)`", line):
                for m in re.finditer(r"(?:fleet-reconciler|cargo run(?: --release)? --) ([a-z][a-z-]*(?: [^|;&#]*)?)", span):
                    check_command_line(f"{doc}:{n}", m.group(1).split(), surface, global_flags)
            # A table of commands: `CMD …` in the first column.
            m = re.match(r"^\| `([a-z][a-z-]*)((?: [^`]*)?)`", line)
            if m and (m.group(1) in surface or m.group(2).lstrip().startswith(("[", "MACHINE"))):
                check_command_line(f"{doc}:{n}", [m.group(1), *m.group(2).split()], surface, global_flags)
        # Command lines in code blocks: `$ fleet-reconciler …`, `fly ssh
        # console -C "fleet-reconciler …"`, `VAR=x fleet-reconciler …`.
        in_code = False
        for n, raw in enumerate(text.splitlines(), 1):
            if raw.startswith("```"):
                in_code = not in_code
                continue
            if not in_code:
                continue
            for m in re.finditer(r"(?:^|[\s\"/])(?:fleet-reconciler|cargo run(?: --release)? --) ([a-z][a-z-]*(?: [^|;&#\"]*)?)", raw):
                check_command_line(f"{doc}:{n}", m.group(1).split(), surface, global_flags)
        for line_no, block in toml_blocks(text):
            if "fly.toml" in "\n".join(text.splitlines()[max(0, line_no - 5): line_no - 1]):
                continue  # a fly.toml snippet, not the config
            try:
                parsed = tomllib.loads(block)
            except tomllib.TOMLDecodeError:
                continue  # a fragment, not a file
            if not parsed or any(k not in sections for k in parsed):
                continue  # not a fleet-reconciler config (fly.toml, …)
            for key in walk_toml(parsed, ""):
                if not key_known(key, keys):
                    fail(f"{doc}:{line_no}: the TOML example sets `{key}`, which is not a config key")


def main() -> int:
    config = check_fly_toml()
    if config:
        check_secrets_documented(config)
    check_rules()
    check_scrape_labels()
    check_dashboard()
    check_doc_links()
    check_design_refs()
    check_docs_name_real_config_keys_and_commands()
    check_fly_logs_json()
    if errors:
        for e in errors:
            print(f"deploy/check.py: {e}", file=sys.stderr)
        return 1
    print("deploy/check.py: fly.toml, Dockerfile, config, alert rules, runbooks, dashboard, doc links, design references, and the config keys and commands the docs name agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
