#!/usr/bin/env python3
"""The shipped rules, route example and dashboard in a real Prometheus and
Alertmanager, against `fleet-reconciler demo` (issue 20, item 6).

Runs `fleet-reconciler demo`, a Prometheus (Debian's `prometheus`) scraping
it and evaluating deploy/prometheus/fleet-reconciler.rules.yml, and an
Alertmanager (Debian's `prometheus-alertmanager`) with
deploy/alertmanager/route.example.yml whose PagerDuty and Slack receivers
post to a receiver on loopback. Then asserts:

* which alerts fire: the coherence alerts once per agents' app (not once per
  replica), FleetReconcilerReplicaDown for each lost replica, nothing else;
* that they arrive grouped in Alertmanager (one PagerDuty incident per
  (alertname, fly_app), the lost replicas in one), with a non-empty
  PagerDuty summary even for a group whose alerts have different summaries,
  and the warning inhibited by the critical of the same app only;
* that they resolve when the demo's fleet converges (agents-dispatch climbs
  above 80 %: its critical resolves, in Alertmanager and at the receiver);
* that Prometheus' coherence, drifted and not-probeable figures equal the
  daemon's own API, per app and for the fleet;
* that every dashboard query returns data, and the per-app ones one series
  per agents' app;
* that when the daemon dies, the coherence alerts do not resolve, and
  FleetReconcilerMetricsAbsent fires and inhibits FleetReconcilerReplicaDown;
* that the daemon's own alerts (`demo --alertmanager`) arrive
  in the same Alertmanager (skipped, saying so, when the flag is missing).

The demo is scraped twice at once, as two replicas would be: job
`fleet-reconciler` plainly, and job `fleet-reconciler-fly` with Fly-style
target labels (`app`, `region`, `instance` set by the scrape, as Fly's
managed Prometheus does). Two more targets of job `fleet-reconciler-lost`
listen nowhere: replicas that died.

Test overrides (the only changes to the shipped files):
* rules: the `for:` of the alerts in TEST_FOR, shortened so that a run takes
  about two minutes; every other line is loaded as shipped;
* route: group_wait / group_interval shortened (GROUP_TIMING); the
  PagerDuty receiver's routing_key_file and the Slack receiver's
  api_url_file point at files naming the loopback receiver, and the
  PagerDuty receiver gets `url:` (its Events API URL) on loopback. Routes,
  matchers, grouping, inhibitions and templates are as shipped.

Usage: python3 .ci/prometheus_check.py BINARY   (from the repository root;
python3 stdlib only; needs `prometheus` and `prometheus-alertmanager`)
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy/prometheus/fleet-reconciler.rules.yml"
ROUTE = ROOT / "deploy/alertmanager/route.example.yml"
DASHBOARD = ROOT / "deploy/grafana/fleet-reconciler.json"

# alert -> the `for:` used here instead of the shipped one.
TEST_FOR = {
    "FleetOverlayCoherenceBelowTarget": "5s",
    "FleetOverlayCoherenceCritical": "5s",
    "FleetReconcilerReplicaDown": "5s",
    "FleetReconcilerMetricsAbsent": "5s",
}
GROUP_TIMING = {"group_wait": "1s", "group_interval": "2s"}
APPS = {"agents-dispatch", "agents-chat"}
# The demo's fleet: agents-dispatch converges past 80 % within about a
# minute of the release; agents-chat (manual machines, ones it cannot probe)
# stays below 80 % even after its canary-held pool rotates.
CONVERGING_APP = "agents-dispatch"
STUCK_APP = "agents-chat"
FLY_STYLE = {"app": "fleet-reconciler", "region": "iad", "instance": "e784079b449483"}


class Failed(Exception):
    pass


def log(msg: str) -> None:
    print(f"prometheus_check: {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def post_json(url: str, body) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()


def wait_for(what: str, timeout: float, probe, interval: float = 1.0):
    """Polls `probe` until it returns something truthy; fails naming `what`."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
        except Exception as e:  # noqa: BLE001 - a service still starting
            last_error = e
        time.sleep(interval)
    raise Failed(f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last error: {last_error})" if last_error else ""))


# ---- test overrides ------------------------------------------------------------

def override_rules(text: str) -> str:
    """The shipped rules with the `for:` of TEST_FOR's alerts replaced."""
    out, alert, seen = [], None, set()
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*- alert:\s*(\S+)", line)
        if m:
            alert = m.group(1)
        m = re.match(r"(\s*for:\s*)(\S+)(\s*)$", line)
        if m and alert in TEST_FOR:
            line = f"{m.group(1)}{TEST_FOR[alert]}{m.group(3)}"
            seen.add(alert)
        out.append(line)
    missing = set(TEST_FOR) - seen
    if missing:
        raise Failed(f"rules file has no `for:` for {sorted(missing)}: TEST_FOR is out of date")
    return "".join(out)


def override_route(text: str, receiver_url: str, secrets: Path) -> str:
    """The shipped route example, its receivers posting to `receiver_url`."""
    key = secrets / "pagerduty-routing-key"
    key.write_text("ci-routing-key\n")
    slack = secrets / "slack-webhook-url"
    slack.write_text(f"{receiver_url}/slack\n")
    out, replaced = [], set()
    for line in text.splitlines(keepends=True):
        m = re.match(r"(\s*)(group_wait|group_interval):\s*\S+\s*$", line)
        if m and m.group(2) in GROUP_TIMING:
            line = f"{m.group(1)}{m.group(2)}: {GROUP_TIMING[m.group(2)]}\n"
            replaced.add(m.group(2))
        m = re.match(r"(\s*(?:- )?)routing_key_file:\s*\S+\s*$", line)
        if m:
            indent = " " * len(m.group(1))
            line = f"{m.group(1)}routing_key_file: {key}\n{indent}url: {receiver_url}/pagerduty\n"
            replaced.add("routing_key_file")
        m = re.match(r"(\s*(?:- )?)api_url_file:\s*\S+\s*$", line)
        if m:
            line = f"{m.group(1)}api_url_file: {slack}\n"
            replaced.add("api_url_file")
        out.append(line)
    missing = {"group_wait", "group_interval", "routing_key_file", "api_url_file"} - replaced
    if missing:
        raise Failed(f"route example has no {sorted(missing)} to override")
    return "".join(out)


# ---- the loopback receiver ------------------------------------------------------

class Receiver:
    """Records every PagerDuty event and Slack message Alertmanager posts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[tuple[str, dict]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    doc = json.loads(body)
                except ValueError:
                    doc = {"unparsed": body.decode(errors="replace")}
                with outer.lock:
                    outer.received.append((self.path, doc))
                answer = b'{"status":"success","message":"Event processed","dedup_key":"x"}'
                self.send_response(202 if self.path.startswith("/pagerduty") else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, path: str) -> list[dict]:
        with self.lock:
            return [d for p, d in self.received if p.startswith(path)]

    def stop(self) -> None:
        self.server.shutdown()


# ---- processes -----------------------------------------------------------------

class Processes:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str], logdir: Path) -> subprocess.Popen:
        logfile = logdir / f"{name}.log"
        p = subprocess.Popen(args, stdout=logfile.open("w"), stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, cwd=ROOT)
        self.procs.append((name, p, logfile))
        return p

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        for _, p, _ in reversed(self.procs):
            self.stop(p)

    def dump_logs(self) -> None:
        for name, _, logfile in self.procs:
            text = logfile.read_text(errors="replace") if logfile.exists() else ""
            print(f"---- {name} (last 40 lines of {logfile}) ----")
            print("\n".join(text.splitlines()[-40:]))


# ---- queries -------------------------------------------------------------------

class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        doc = get_json(f"{self.url}/api/v1/query?{q}")
        if doc.get("status") != "success":
            raise Failed(f"query {expr!r}: {doc}")
        return doc["data"]["result"]

    def firing(self) -> list[dict]:
        alerts = get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["state"] == "firing"]


def key_of(alert_labels: dict) -> tuple[str, str]:
    """(alertname, fly_app or instance): what one alert is about."""
    return (alert_labels["alertname"], alert_labels.get("fly_app") or alert_labels.get("instance", ""))


def am_alerts(am_url: str) -> list[dict]:
    return get_json(f"{am_url}/api/v2/alerts")


def fleet(api: str) -> dict:
    return get_json(f"{api}api/v1/fleet")


# ---- the check -----------------------------------------------------------------

def run(binary: str, work: Path, procs: Processes, receiver: Receiver) -> None:
    for tool in ("prometheus", "prometheus-alertmanager"):
        if not shutil.which(tool):
            raise Failed(f"{tool} not found (Debian package {tool if tool == 'prometheus' else 'prometheus-alertmanager'})")

    # The demo, posting its own alerts to the same Alertmanager.
    am_port, prom_port = free_port(), free_port()
    am_url, prom_url = f"http://127.0.0.1:{am_port}", f"http://127.0.0.1:{prom_port}"
    demo_args = [binary, "demo", "--sweeps", "200", "--alertmanager", am_url]
    demo = procs.start("demo", demo_args, work)
    demo_log = work / "demo.log"

    def demo_url():
        if demo.poll() is not None:
            raise Failed("the demo exited early")
        m = re.search(r"^status page: (http://\S+/) ", demo_log.read_text(), re.M)
        return m.group(1) if m else None

    api = wait_for("the demo's status page line", 120, demo_url, 0.5)
    target = urllib.parse.urlparse(api).netloc
    log(f"demo at {api}")

    # Alertmanager with the shipped routes; receivers on loopback.
    secrets = work / "secrets"
    secrets.mkdir()
    am_config = work / "alertmanager.yml"
    am_config.write_text(override_route(ROUTE.read_text(), receiver.url, secrets))
    procs.start("alertmanager", ["prometheus-alertmanager", f"--config.file={am_config}",
                                 f"--storage.path={work / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                                 "--cluster.listen-address="], work)
    wait_for("Alertmanager ready", 60, lambda: urllib.request.urlopen(f"{am_url}/-/ready", timeout=2).status == 200, 0.5)

    # Prometheus with the shipped rules (TEST_FOR durations).
    rules = work / "fleet-reconciler.rules.yml"
    rules.write_text(override_rules(RULES.read_text()))
    lost = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    prom_config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(rules)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [
            {"job_name": "fleet-reconciler", "static_configs": [{"targets": [target]}]},
            # Fly-style: the scrape sets app, region and instance itself.
            {"job_name": "fleet-reconciler-fly", "static_configs": [{"targets": [target], "labels": FLY_STYLE}]},
            {"job_name": "fleet-reconciler-lost", "static_configs": [{"targets": lost}]},
        ],
    }
    prom_yml = work / "prometheus.yml"
    prom_yml.write_text(json.dumps(prom_config))  # JSON is YAML
    procs.start("prometheus", ["prometheus", f"--config.file={prom_yml}", f"--storage.tsdb.path={work / 'prom-data'}",
                               f"--web.listen-address=127.0.0.1:{prom_port}"], work)
    wait_for("Prometheus ready", 60, lambda: urllib.request.urlopen(f"{prom_url}/-/ready", timeout=2).status == 200, 0.5)
    prom = Prom(prom_url)
    wait_for("both demo scrapes up", 60,
             lambda: len([r for r in prom.query('up{job=~"fleet-reconciler|fleet-reconciler-fly"} == 1')]) == 2)
    log(f"Prometheus at {prom_url} and Alertmanager at {am_url} up; receiver at {receiver.url}")

    # 1. What fires: coherence once per app, the lost replicas each; and in
    #    Alertmanager, the warning inhibited by the critical of its app.
    expected = {("FleetOverlayCoherenceCritical", a) for a in APPS} | {
        ("FleetOverlayCoherenceBelowTarget", a) for a in APPS} | {("FleetReconcilerReplicaDown", t) for t in lost}
    seen: set[tuple[str, str]] = set()

    def all_fired():
        firing = prom.firing()
        keys = [key_of(a["labels"]) for a in firing]
        dup = {k for k in keys if keys.count(k) > 1}
        if dup:
            raise Failed(f"alerts firing more than once (once per replica?): {sorted(dup)}: {firing}")
        seen.update(keys)
        return expected <= set(keys)

    wait_for(f"Prometheus firing {sorted(expected)}", 90, all_fired)
    for a in prom.firing():
        if a["labels"]["alertname"].startswith("FleetOverlayCoherence"):
            for label in ("app", "region", "instance", "job"):
                if label in a["labels"]:
                    raise Failed(f"coherence alert carries the scrape's {label}: {a['labels']}")
    log("firing in Prometheus: " + ", ".join(f"{n}{{{k}}}" for n, k in sorted(expected)))

    def inhibited():
        warnings = [a for a in am_alerts(am_url) if a["labels"]["alertname"] == "FleetOverlayCoherenceBelowTarget"]
        state = {a["labels"].get("fly_app"): a["status"] for a in warnings}
        if set(state) != APPS:
            return False
        return all(s["state"] == "suppressed" and s["inhibitedBy"] for s in state.values())

    wait_for("each app's warning inhibited by its critical in Alertmanager", 30, inhibited)
    log("Alertmanager: each FleetOverlayCoherenceBelowTarget is inhibited by the critical of its own app")

    # 2. Grouped at the receiver: one PagerDuty incident per group, the two
    #    lost replicas in one, each with a summary. (Only the rules' alerts:
    #    the daemon's own may page too.)
    rule_names = set(re.findall(r"^\s*- alert:\s*(\S+)", RULES.read_text(), re.M))

    def pagerduty_groups():
        triggers = [e for e in receiver.events("/pagerduty") if e.get("event_action") == "trigger"
                    and e["payload"]["custom_details"].get("alertname") in rule_names]
        groups: dict[str, dict] = {}
        for e in triggers:  # the latest notification of each incident
            groups[e["dedup_key"]] = e
        names = [g["payload"]["custom_details"].get("summaries", "") for g in groups.values()]
        want = [f"App {a}:" for a in APPS] + [f"fleet-reconciler {t} is down" for t in lost]
        return groups if all(any(w in n for n in names) for w in want) else None

    groups = wait_for("PagerDuty incidents for every critical group", 60, pagerduty_groups)
    for key, e in groups.items():
        summary = e["payload"].get("summary", "")
        if not summary.strip():
            raise Failed(f"PagerDuty event with an empty summary (Events v2 requires one): {e}")
    by_name: dict[str, list[dict]] = {}
    for e in groups.values():
        by_name.setdefault(e["payload"]["custom_details"]["summaries"].split(":")[0], []).append(e)
    down = [e for e in groups.values() if "is down" in e["payload"]["custom_details"]["summaries"]]
    if len(down) != 1 or not all(t in down[0]["payload"]["custom_details"]["summaries"] for t in lost):
        raise Failed(f"the lost replicas should be one PagerDuty incident naming both: {down}")
    for app in APPS:
        incidents = [e for e in groups.values() if f"App {app}:" in e["payload"]["custom_details"]["summaries"]]
        if len(incidents) != 1 or incidents[0]["payload"]["custom_details"].get("firing") != "1":
            raise Failed(f"{app}: expected one incident with one firing alert (two replicas scrape it): {incidents}")
    if len(groups) != 3:
        raise Failed(f"expected 3 PagerDuty incidents (critical per app, replicas down), got {len(groups)}: "
                     + json.dumps([e["payload"]["summary"] for e in groups.values()]))
    log("PagerDuty receiver: 3 incidents; one per app's critical; the two lost replicas in one, summary "
        + repr(down[0]["payload"]["summary"]))
    if not any("FleetOverlayCoherenceCritical" in json.dumps(m) for m in receiver.events("/slack")):
        raise Failed("the Slack receiver got no critical coherence message (routes: critical → PagerDuty and Slack)")

    # 3. Convergence: agents-dispatch climbs past 80 %: its critical resolves
    #    (Prometheus, Alertmanager, receiver); agents-chat's does not.
    dispatch_key, chat_key = (next(k for k, e in groups.items() if f"App {app}:" in e["payload"]["custom_details"]["summaries"])
                              for app in (CONVERGING_APP, STUCK_APP))

    def resolved():
        firing = {key_of(a["labels"]) for a in prom.firing()}
        if ("FleetOverlayCoherenceCritical", CONVERGING_APP) in firing:
            return False
        return any(e.get("event_action") == "resolve" and e.get("dedup_key") == dispatch_key
                   for e in receiver.events("/pagerduty"))

    wait_for(f"{CONVERGING_APP}'s critical to resolve as its fleet converges", 150, resolved)
    firing = {key_of(a["labels"]) for a in prom.firing()}
    if ("FleetOverlayCoherenceCritical", STUCK_APP) not in firing:
        raise Failed(f"{STUCK_APP} never converges past 80 %, yet its critical is not firing: {firing}")
    log(f"{CONVERGING_APP} converged: its critical resolved at the PagerDuty receiver; {STUCK_APP}'s still fires")

    def warning_delivered():
        return any("FleetOverlayCoherenceBelowTarget" in json.dumps(m) and CONVERGING_APP in json.dumps(m)
                   for m in receiver.events("/slack"))

    wait_for(f"{CONVERGING_APP}'s warning delivered to Slack once its critical no longer inhibits it", 30, warning_delivered)

    # 4. Prometheus' figures equal the API's, under both scrapes.
    def figures_agree():
        doc = fleet(api)
        want = {a["name"]: a["coherence"] for a in doc["apps"]}
        per_app = {r["metric"]["fly_app"]: float(r["value"][1])
                   for r in prom.query("max by (fly_app) (fleet_reconciler_overlay_coherence_ratio)")}
        fleet_ratio = float(prom.query("max(fleet_reconciler_fleet_overlay_coherence_ratio)")[0]["value"][1])
        drifted = float(prom.query('sum(max by (fly_app) (fleet_reconciler_machines{status="drifted"}))')[0]["value"][1])
        unprobeable = float(prom.query(
            'sum(max by (fly_app, status) (fleet_reconciler_machines{status=~"unreachable|bad_report"}))')[0]["value"][1])
        statuses = [m["status"] for m in doc["machines"]]
        ok = (set(per_app) == set(want) and all(abs(per_app[a] - want[a]) < 1e-9 for a in want)
              and abs(fleet_ratio - doc["coherence"]) < 1e-9
              and drifted == statuses.count("drifted")
              and unprobeable == statuses.count("unreachable") + statuses.count("bad_report"))
        return (per_app, fleet_ratio, drifted, unprobeable) if ok else None

    agreed = wait_for("Prometheus' coherence and counts equal to /api/v1/fleet", 30, figures_agree)
    for job in ("fleet-reconciler", "fleet-reconciler-fly"):
        for app, ratio in agreed[0].items():
            got = prom.query(f'fleet_reconciler_overlay_coherence_ratio{{job="{job}",fly_app="{app}"}}')
            if len(got) != 1 or abs(float(got[0]["value"][1]) - ratio) > 1e-9:
                raise Failed(f"job {job}: {app}'s coherence is {got}, the API says {ratio}")
    log(f"Prometheus = API: per app {agreed[0]}, fleet {agreed[1]}, drifted {agreed[2]:.0f}, not probeable {agreed[3]:.0f}")

    # 5. Every dashboard query returns data; per-app panels one series per app;
    #    the headline stats say what the API says.
    dash = json.loads(DASHBOARD.read_text())
    doc = fleet(api)
    statuses = [m["status"] for m in doc["machines"]]
    panel_means = {
        "Fleet coherence": doc["coherence"],
        "Machines drifted": statuses.count("drifted"),
        "Not probeable": statuses.count("unreachable") + statuses.count("bad_report"),
    }
    n = 0
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$app", ".+")
            result = prom.query(expr)
            if not result:
                raise Failed(f"dashboard panel {panel['title']!r}: {expr} returns no data")
            # One line per legend (not one per replica), and a per-app
            # legend names the agents' apps, whatever the scrape's labels.
            legend = re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))
            lines = [tuple(r["metric"].get(k) for k in legend) for r in result]
            if legend and len(set(lines)) != len(lines):
                raise Failed(f"dashboard panel {panel['title']!r}: several series per line {legend}: {result}")
            if panel["title"] in panel_means:
                got = [float(r["value"][1]) for r in result]
                if len(got) != 1 or abs(got[0] - panel_means[panel["title"]]) > 1e-9:
                    raise Failed(f"dashboard stat {panel['title']!r} shows {got}, the API says {panel_means[panel['title']]}")
            apps = {r["metric"].get("fly_app") for r in result} - {None}
            if apps - APPS or ("fly_app" in legend and apps != APPS):
                raise Failed(f"dashboard panel {panel['title']!r}: lines for {[r['metric'] for r in result]}, not the agents' apps")
            n += 1
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "app")
    m = re.match(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
    values = get_json(f"{prom_url}/api/v1/label/{m.group(2)}/values?" + urllib.parse.urlencode({"match[]": m.group(1)}))["data"]
    if set(values) != APPS:
        raise Failed(f"dashboard variable $app offers {values}, not the agents' apps {sorted(APPS)}")
    log(f"dashboard: {n} queries return data; {panel_means} as the API; $app offers {sorted(values)}")

    # 6. The daemon's own alerts in the same Alertmanager.
    # Whatever the rules do not define came from the daemon's sink.
    def daemon_alerts():
        got = [a for a in am_alerts(am_url) if a["labels"].get("alertname") not in rule_names]
        return got if any(a["labels"].get("fly_app") in APPS for a in got) else None

    got = wait_for("the daemon's own alerts in Alertmanager", 30, daemon_alerts)
    log(f"the daemon's sink: {len(got)} alerts in Alertmanager, e.g. {got[0]['labels']}")
    # The route example pages high and critical drift.
    paging = {a["labels"]["alertname"] for a in got if a["labels"].get("severity") in ("high", "critical")}
    if paging:
        wait_for(f"the daemon's {sorted(paging)} routed to PagerDuty", 30, lambda: paging <= {
            e["payload"]["custom_details"].get("alertname") for e in receiver.events("/pagerduty")})
        log(f"the daemon's {sorted(paging)} reached the PagerDuty receiver through the route example")

    # 7. The daemon dies: no false "resolved" for coherence; every replica
    #    gone pages once (metrics absent), the per-replica alerts inhibited.
    all_fired()
    unexpected = seen - expected
    if unexpected:
        raise Failed(f"alerts fired that the demo does not call for: {sorted(unexpected)}")
    procs.stop(demo)
    log("demo stopped")

    def absent_and_inhibited():
        names = {a["labels"]["alertname"] for a in prom.firing()}
        if "FleetReconcilerMetricsAbsent" not in names:
            return False
        down = [a for a in am_alerts(am_url) if a["labels"]["alertname"] == "FleetReconcilerReplicaDown"]
        return down and all(a["status"]["state"] == "suppressed" for a in down)

    wait_for("FleetReconcilerMetricsAbsent firing and inhibiting FleetReconcilerReplicaDown", 60, absent_and_inhibited)
    firing = {key_of(a["labels"]) for a in prom.firing()}
    if ("FleetOverlayCoherenceCritical", STUCK_APP) not in firing:
        raise Failed(f"the daemon's death resolved {STUCK_APP}'s critical coherence alert: {firing}")
    if any(e.get("event_action") == "resolve" and e.get("dedup_key") == chat_key for e in receiver.events("/pagerduty")):
        raise Failed(f"a false resolve of {STUCK_APP}'s incident reached PagerDuty when the daemon died")
    log(f"daemon gone: metrics absent pages, replica-down inhibited, {STUCK_APP}'s critical still firing")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    binary = str(Path(sys.argv[1]).resolve())
    work = Path(tempfile.mkdtemp(prefix="prometheus-check-"))
    procs, receiver = Processes(), Receiver()
    started = time.monotonic()
    try:
        run(binary, work, procs, receiver)
    except Failed as e:
        procs.stop_all()
        procs.dump_logs()
        print("---- received by the loopback receiver ----")
        for path, doc in receiver.received[-20:]:
            print(path, json.dumps(doc)[:600])
        print(f"prometheus_check: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        receiver.stop()
    shutil.rmtree(work, ignore_errors=True)
    log(f"ok ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
