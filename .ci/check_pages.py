#!/usr/bin/env python3
"""Asserts on the status page and one machine page as a browser rendered them.

Usage: check_pages.py STATUS_DOM MACHINE_DOM MACHINE_ID MARKUP DRIFTED_DOM DRIFTED_ID

STATUS_DOM and MACHINE_DOM are `chromium --headless --dump-dom` output of
`GET /` and `GET /machines/MACHINE_ID` of a running `fleet-reconciler demo`;
MARKUP is a string with markup one demo agent reports (its ref). Checks:
coherence figures and their charts are on the status page; the machine page
is that machine's, with its report fields and decision; the agent's markup
is text on both pages (escaped in the serialized DOM), never an element; and
neither page has a script or a form. DRIFTED_DOM is the page of DRIFTED_ID,
a machine with critical drift: it shows the planner's decision and the
sweep's reason (the matched rule, its evidence, the missing commits).
"""

import re
import sys
from html import escape
from html.parser import HTMLParser


class Elements(HTMLParser):
    """Tags and text of a document, with the text of <dt> and <dd> pairs."""

    def __init__(self):
        super().__init__()
        self.tags = []
        self.text = []
        self.fields = {}
        self._dt = None
        self._in = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("dt", "dd"):
            self._in = [tag, ""]

    def handle_endtag(self, tag):
        if self._in and tag == self._in[0]:
            kind, text = self._in
            text = " ".join(text.split())
            if kind == "dt":
                self._dt = text
            elif self._dt is not None:
                self.fields.setdefault(self._dt, text)
                self._dt = None
            self._in = None

    def handle_data(self, data):
        self.text.append(data)
        if self._in:
            self._in[1] += data


def parse(path):
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    doc = Elements()
    doc.feed(raw)
    return raw, doc


def fail(msg):
    print(f"check_pages: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def no_active_content(name, doc):
    for tag, _ in doc.tags:
        if tag in ("script", "form", "iframe", "object", "embed"):
            fail(f"{name}: a <{tag}> element")
    for tag, attrs in doc.tags:
        for attr in attrs:
            if attr.startswith("on"):
                fail(f"{name}: <{tag} {attr}=...>")


def markup_is_text(name, raw, doc, markup):
    text = "".join(doc.text)
    if markup not in text:
        fail(f"{name}: the agent's {markup!r} is not shown as text")
    if markup in raw:
        fail(f"{name}: the agent's {markup!r} is in the DOM unescaped")
    if escape(markup, quote=False) not in raw:
        fail(f"{name}: the agent's {markup!r} is not in the DOM escaped")


def main():
    if len(sys.argv) != 7:
        fail(__doc__.strip().splitlines()[2])
    status_path, machine_path, machine_id, markup, drifted_path, drifted_id = sys.argv[1:]

    raw, status = parse(status_path)
    text = " ".join("".join(status.text).split())
    if "Fleet coherence" not in text:
        fail("status page: no fleet coherence card")
    # The big number of each card: the fleet's and one per app.
    figures = re.findall(r'<div class="big">([^<]*)</div>', raw)
    if len(figures) < 3 or not all(re.fullmatch(r"\d+(?:\.\d)?%", f) for f in figures):
        fail(f"status page: coherence figures missing (found {figures})")
    for app in ("agents-dispatch", "agents-chat"):
        if app not in text:
            fail(f"status page: no card for {app}")
    charts = [a for t, a in status.tags if t == "svg" and a.get("role") == "img"]
    if len(charts) < 3:
        fail(f"status page: {len(charts)} coherence charts, want one per card")
    for chart in charts:
        label = chart.get("aria-label", "")
        if not re.search(r"over the last \d+ sweeps .*latest \d+(\.\d)?%", label):
            fail(f"status page: chart label {label!r} names no figures")
    if not any(t == "polyline" for t, _ in status.tags):
        fail("status page: the charts draw no line")
    if not any(t == "a" and a.get("href") == f"/machines/{machine_id}" for t, a in status.tags):
        fail(f"status page: no link to /machines/{machine_id}")
    no_active_content("status page", status)
    markup_is_text("status page", raw, status, markup)

    raw, machine = parse(machine_path)
    fields = machine.fields
    if fields.get("Machine") != machine_id:
        fail(f"machine page: Machine is {fields.get('Machine')!r}, want {machine_id!r}")
    for field in ("App", "Name", "Region", "Pool", "State", "Status", "Ref", "Commit",
                  "Behind / ahead", "Severity", "Action", "Detail", "Decision", "Drifting for",
                  "Hold", "Approval"):
        if field not in fields:
            fail(f"machine page: no {field!r} field (have {sorted(fields)})")
    if not fields["Status"]:
        fail("machine page: empty status")
    if fields["Decision"] in ("", "–", "-"):
        fail("machine page: no decision")
    commands = " ".join("".join(machine.text).split())
    if f"fleet-reconciler hold {machine_id} --reason" not in commands:
        fail("machine page: no hold command for a machine without a hold")
    no_active_content("machine page", machine)
    markup_is_text("machine page", raw, machine, markup)

    raw, drifted = parse(drifted_path)
    fields = drifted.fields
    if fields.get("Machine") != drifted_id:
        fail(f"drifted page: Machine is {fields.get('Machine')!r}, want {drifted_id!r}")
    if fields.get("Status") != "drifted":
        fail(f"drifted page: status {fields.get('Status')!r}, want 'drifted'")
    if fields.get("Decision") in (None, "", "–", "-"):
        fail("drifted page: no decision")
    rule = fields.get("Rule", "")
    if not re.match(r"rule #\d+: level = ", rule):
        fail(f"drifted page: no matched rule in the reason (Rule {rule!r})")
    evidence = fields.get("Evidence", "")
    if not re.match(r"(trailer|path) \S+ (in|changed by) [0-9a-f]{12} ", evidence):
        fail(f"drifted page: no evidence commit (Evidence {evidence!r})")
    text = " ".join("".join(drifted.text).split())
    missing = re.search(r"Missing commits \((\d+), newest (\d+) shown\)", text)
    if not missing or int(missing.group(2)) == 0 or int(missing.group(2)) > 20:
        fail("drifted page: no list of missing commits (at most 20)")
    no_active_content("drifted page", drifted)

    print(
        f"check_pages: ok: status page ({len(charts)} charts, coherence {' / '.join(figures)}), "
        f"machine page of {machine_id} (status {machine.fields['Status']!r}, "
        f"decision {machine.fields['Decision']!r}); {markup!r} shown as text on both; "
        f"{drifted_id}: {rule!r}, evidence {evidence!r}, {missing.group(1)} missing"
    )


if __name__ == "__main__":
    main()
