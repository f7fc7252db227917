"""The verdict: per cache under test, which properties hold, which fail and how badly.

Each kit test's report carries one entry (the cache, the property, pass / FAIL / skipped,
and for a failure its severity and first line) in ``report.user_properties``, which
pytest-xdist carries from the workers to the controller. The controller gathers them and,
at the end of the run, prints a short table per cache and writes ``--kv-report PATH``.
A cache "holds every property" only where each property of the kit (``kvcheck.properties``)
of the contract version the run is held to ran and passed or is not offered; where some did
not run (a ``-k``, a deselect, a skip) its line says how many of the kit's ran instead, and
so does the JSON (``run`` of ``kit properties``; ``holds`` counts those that passed).

Compare two reports, e.g. before and after a refactor::

    python -m kvcheck.verdict OLD.json NEW.json

prints what changed and exits 1 if a property that held in OLD fails in NEW. Each report
names the contract version its run was held to (``kvcheck.contract``); what a run held to
an earlier version ran beyond it is listed under "not counted" and changes none of its
counts. The comparison judges each property by every test of it that ran, counted or not (a
pin changes what counts, not what the cache did), and marks a property the OLD run did not
run that arrived after the version it was held to as "new in contract X".
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import textwrap
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import pytest

KEY = "kvcheck"
PROPERTIES_KEY = "kvcheck-properties"
TESTS_KEY = "kvcheck-tests"  # a worker's kit tests: node id -> [cache label, name, property]
PASS, FAIL, SKIPPED, NOT_OFFERED = "pass", "FAIL", "skipped", "not offered"
# A property that passed on some of the paths the cache offers and did not run on the others
# (a -k or a deselect): never a pass.
PARTLY = "partly run"
# What the plugin keeps on a kit test's item for its entry: the edges its plans reached
# (kvcheck.reach), and what an exhaustive block ran (kvcheck.exhaustive.recording).
REACHED = pytest.StashKey[set]()
EXHAUSTED = pytest.StashKey[dict]()


def entry_for(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> dict | None:
    """What ``report`` says about a kit property on one cache, or None for other tests."""
    prop = item.get_closest_marker("kv_property")
    cache = item.get_closest_marker("kv_cache")
    if prop is None or cache is None:
        return None
    if report.when != "call" and not (report.when == "setup" and not report.passed):
        return None  # a passed setup says nothing yet; teardown never decides a property
    entry = {"cache": cache.args[0], "name": cache.args[1], "property": prop.args[0]}
    if getattr(cache, "kwargs", {}).get("kind") == "engine":  # held to the engine properties
        entry["kind"] = "engine"
    entry["test"] = item.nodeid
    if path := item.get_closest_marker("kv_path"):  # the model's path, of those offered
        entry.update(path=path.args[0], paths=list(path.args[1]))
    # Here: the plugin imports this module in every run.
    from kvcheck import failures, sizes

    factory = item.callspec.params.get("cache_factory") if hasattr(item, "callspec") else None
    if (domain := sizes.declared_by(factory, getattr(item, "cls", None)).supports).declared:
        entry["domain"] = domain.as_json()

    from kvcheck import contract

    # The version the property arrived in; for a test not counted, its own (its case's).
    entry["since"] = contract.of_property(prop)
    if newer := item.get_closest_marker("kv_not_counted"):  # after the pinned version
        entry.update(since=newer.args[0], counted=False)
    stash = getattr(item, "stash", {})  # a stand-in item (the plugin's tests) may have none
    if (record := stash.get(EXHAUSTED, {})).get("tokens"):  # one block of plans
        block = item.callspec.params["kv_block"]
        # Its test with the block left out of the id (mid-id where the property has cases).
        entry["exhaustive"] = {**record, "group": item.nodeid.replace(f"-{block}", "")}
    elif record.get("searched"):  # an exhaustive run's search of a property it cannot enumerate
        entry["searched"] = True
    if report.passed:
        pairs = _pairs(item, entry["property"], factory)
        return {**entry, **_reach(item, entry["property"], factory), **pairs, "outcome": PASS}
    expected = hasattr(report, "wasxfail")  # an xfail: the user's, or ours (not counted)
    if expected and newer is None:  # the user's: their call, not a verdict
        return {**entry, "outcome": SKIPPED, "reason": f"xfail: {report.wasxfail}".strip()}
    if report.skipped and not expected:  # ours failed: a failure, below
        reason = _skip_reason(report)
        outcome = NOT_OFFERED if reason.startswith(NOT_OFFERED) else SKIPPED
        return {**entry, "outcome": outcome, "reason": reason}
    error = call.excinfo.value if call.excinfo is not None else None
    if error is None:  # e.g. XPASS(strict): a failure pytest made, not the cache
        reason = report.longreprtext.strip().splitlines()[-1] if report.longreprtext else "?"
        return {**entry, "outcome": FAIL, "severity": failures.CRASH, "reason": reason}
    from kvcheck.properties import BY_NAME

    default = BY_NAME[entry["property"]].severity if entry["property"] in BY_NAME else FAIL
    severity, culprit = failures.worst(error, default)
    reason = failures.first_line(culprit)
    entry["message"] = failures.whole_message(culprit)  # the report's JSON: every line of it
    if report.when == "setup":  # a fixture failed (the factory, or one of the user's own)
        reason = f"in setup, before the property ran: {reason}"
    if root := failures.root_of(culprit):  # the first row the cache got wrong
        entry["root"] = root
    return {**entry, "outcome": FAIL, "severity": severity, "reason": reason}


def _reach(item: pytest.Item, name: str, factory) -> dict:
    """The edges the property names that its passed test reached, and those it never did
    that the cache could reach (``kvcheck.reach``); nothing for a property naming none."""
    from kvcheck import kit, reach, sizes
    from kvcheck.properties import BY_NAME

    if getattr(item.get_closest_marker("kv_cache"), "kwargs", {}).get("kind") == "engine":
        from kvcheck import engines

        declared = engines.BY_NAME[name].reaches if name in engines.BY_NAME else ()
        offered = item.stash.get(engines.OFFERED, frozenset())
        hit, missed = reach.split(declared, item.stash.get(REACHED, set()), offered)
        return {"reached": hit, "not reached": missed} if declared else {}
    declared = BY_NAME[name].reaches if name in BY_NAME else ()
    if not declared or factory is None:
        return {}
    offered: set[str] = set()
    if any(edge.needs for edge in declared):
        with sizes.aiming_at(sizes.declared_by(factory, getattr(item, "cls", None))):
            offered = kit.offered_and_methods(factory)
    hit, missed = reach.split(declared, item.stash.get(REACHED, set()), offered)
    return {"reached": hit, "not reached": missed}


def _pairs(item: pytest.Item, name: str, factory) -> dict:
    """The pairs of events (``kvcheck.interplay``) a passed test ran; for the property that
    runs them by construction, also every pair the cache offers (the verdict's N)."""
    from kvcheck import interplay

    reached = item.stash.get(REACHED, set()) if hasattr(item, "stash") else set()
    found = {
        "pairs ran": sorted(
            n.removeprefix(interplay.PREFIX) for n in reached if n.startswith(interplay.PREFIX)
        )
    }
    if hasattr(item, "stash") and (pairs := item.stash.get(_engine_pairs(), None)) is not None:
        found["pairs offered"] = pairs  # an engine's (kvcheck.engine_interplay)
    elif name == "interactions" and factory is not None:
        from kvcheck import sizes
        from kvcheck.properties.interactions import pairs_offered

        with sizes.aiming_at(sizes.declared_by(factory, getattr(item, "cls", None))):
            found["pairs offered"] = pairs_offered(factory)
    return found if found["pairs ran"] or "pairs offered" in found else {}


def _engine_pairs():
    from kvcheck import engines

    return engines.PAIRS_OFFERED


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr)


def configure(config: pytest.Config, held_to: str) -> None:
    """Gather the verdict of a run that holds its caches to contract version ``held_to``."""
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(Verdict(config, held_to), "kvcheck-verdict")


class Verdict:
    """Gathers the entries of a run (on the controller) and reports them at its end."""

    def __init__(self, config: pytest.Config, held_to: str) -> None:
        self.config = config
        self.contract = held_to  # the contract version the run holds the caches to
        self.entries: list[dict] = []
        self.workers_lines: list[str] = []  # the kit's lines after collection, from a worker
        # kvcheck.properties.SINCE (each property's contract version, in order), from a worker
        self.kit_properties: dict[str, str] | None = None
        self.unreached_lines: list[str] = []  # --kv-require-reach's finding
        self.kit_tests: dict[str, list[str]] = {}  # from the workers: node id -> its cache
        self.unreported: set[str] = set()  # failed with no entry: a worker died in them

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entries = [value for key, value in report.user_properties if key == KEY]
        self.entries.extend(entries)
        if report.failed and not entries:
            self.unreported.add(report.nodeid)

    @pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: a worker is done
    def pytest_testnodedown(self, node, error) -> None:
        # Under xdist only the workers collect, so the controller prints no lines after
        # collection: a worker sends the kit's (kvcheck.plugin) at its end, for the verdict.
        output = getattr(node, "workeroutput", {})
        self.workers_lines = self.workers_lines or output.get(KEY, [])
        # And the kit's properties in order: the controller need not import them (and torch).
        self.kit_properties = self.kit_properties or output.get(PROPERTIES_KEY)
        self.kit_tests.update(output.get(TESTS_KEY, {}))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.entries:
            return
        terminalreporter.section("kv cache verdict")
        for line in [*self.workers_lines, *render(self.caches()), *self.unreached_lines]:
            terminalreporter.write_line(line)
        path = self.config.getoption("--kv-report")
        if path:
            terminalreporter.write_line(f"(written as JSON to {path})")

    def caches(self) -> dict[str, dict]:
        return tabulate([*self.entries, *self.crashed()], self.kit_properties, self.contract)

    def crashed(self) -> list[dict]:
        """An entry for each kit test that failed without one: its process died while it ran
        (a native crash of the cache, say, which pytest-xdist reports for it)."""
        from kvcheck import failures  # no torch

        return [
            {
                "cache": label,
                "name": name,
                "property": prop,
                "test": nodeid,
                "outcome": FAIL,
                "severity": failures.CRASH,
                "reason": "its process died while the test ran, before it could report",
            }
            for nodeid in sorted(self.unreported)
            if (found := self.kit_tests.get(nodeid)) is not None
            for label, name, prop in [found]
        ]

    def never_reached(self) -> dict[str, list[str]]:
        """Per property that passed somewhere in the run, the edges it names that some cache
        of the run could reach (it offers what they need) and no passing test reached
        (``--kv-require-reach``)."""
        named: dict[str, dict[str, bool]] = {}
        for entry in self.entries:
            if "reached" in entry:
                edges = named.setdefault(entry["property"], {})
                for edge in [*entry["reached"], *entry["not reached"]]:
                    edges[edge] = edges.get(edge, False) or edge in entry["reached"]
        missed = {
            name: missed
            for name, edges in named.items()
            if (missed := [edge for edge, reached in edges.items() if not reached])
        }
        for label, cache in self.caches().items():  # the pairs of events each cache offers
            if never := cache.get("interactions", {}).get("never"):
                missed[f"interactions on {label}"] = never
        return missed

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.config.getoption("--kv-require-reach") and (missed := self.never_reached()):
            lines = [f"  {name}: {'; '.join(edges)}" for name, edges in missed.items()]
            self.unreached_lines = [
                "--kv-require-reach: edges the properties name that no passing test reached "
                "(their draws never got there; see kvcheck.reach):",
                *lines,
            ]
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        path = self.config.getoption("--kv-report")
        if path and self.entries:
            from kvcheck import contract, profiles

            report = {
                "kvcache-verify": _version(),
                "contract": {"version": contract.VERSION, "held to": self.contract},
                "kit_profile": self.config.getoption("--kv-profile") or profiles.default_name(),
                "environment": environment(self.config.getoption("--kv-device") or "cpu"),
                "caches": self.caches(),
            }
            Path(path).write_text(json.dumps(report, indent=2) + "\n")


def tabulate(
    entries: list[dict],
    kit_properties: dict[str, str] | Sequence[str] | None = None,
    held_to: str | None = None,
) -> dict[str, dict]:
    """Per cache label: its name and, per property in the kit's order (``kit_properties``,
    name to the contract version it arrived in, else ``kvcheck.properties.SINCE``), the
    outcome; how many properties hold, failed and are not offered; how many ran (passed or
    failed: not skipped, not offered, nor left out by a -k or a deselect) of the kit's at
    contract ``held_to`` (default the kit's own). Tests that a run held to an earlier version
    does not count go to ``not counted``, by property, and change no count."""
    from kvcheck import contract

    if kit_properties is None:
        from kvcheck.properties import SINCE as kit_properties
    if not isinstance(kit_properties, dict):  # names alone: all of them counted
        kit_properties = dict.fromkeys(kit_properties, "1.0")

    # The kit's properties the run holds the caches to (those it counts), in order; an
    # engine's are the engine properties (contract, section 13).
    held = held_to or contract.VERSION
    kinds = {"cache": kit_properties}
    if any(entry.get("kind") == "engine" for entry in entries):
        from kvcheck.engines import SINCE as engine_properties

        kinds["engine"] = engine_properties
    order = {kind: {name: i for i, name in enumerate(names)} for kind, names in kinds.items()}
    counted_by_kind = {
        kind: sum(not contract.newer(v, held) for v in names.values())
        for kind, names in kinds.items()
    }
    caches: dict[str, dict] = {}
    # Sorted by test id, so that the first failure named is the same under any -n.
    for entry in sorted(entries, key=lambda e: e["test"]):
        cache = caches.setdefault(
            entry["cache"],
            {"name": entry["name"], "properties": {}, "kind": entry.get("kind", "cache")},
        )
        if "domain" in entry:  # what the cache declares it supports: all that was drawn
            cache["domain"] = entry["domain"]
        if entry["outcome"] == PASS:  # the pairs of events it ran, and those offered
            pairs = cache.setdefault("interactions", {"ran": set(), "offered": None})
            pairs["ran"].update(entry.get("pairs ran", ()))
            if "pairs offered" in entry:
                pairs["offered"] = entry["pairs offered"]
        counted = entry.get("counted", True)
        rows = cache["properties"] if counted else cache.setdefault("not counted", {})
        row = rows.setdefault(entry["property"], {"result": PASS, "tests": 0, "failed": 0})
        row["since"] = max(row.get("since", "1.0"), entry.get("since", "1.0"), key=contract.key)
        _add(row, entry)
    for cache in caches.values():
        if (pairs := cache.pop("interactions", None)) and pairs["offered"] is not None:
            ran = [pair for pair in pairs["offered"] if pair in pairs["ran"]]
            never = [pair for pair in pairs["offered"] if pair not in pairs["ran"]]
            cache["interactions"] = {"offered": len(pairs["offered"]), "ran": ran, "never": never}
        rows = cache["properties"]
        for row in [*rows.values(), *cache.get("not counted", {}).values()]:
            if "blocks" in row:  # the bounded-exhaustive mode ran its plans
                row["exhaustive"] = _exhaustive(row.pop("blocks"))
                cache["scope"] = row.pop("scope")
                if row["result"] == PASS and not row["exhaustive"]["complete"]:
                    row["result"] = PARTLY  # some blocks not run (a -k, a deselect)
            # A path outside the cache's declared domain is not offered, as a capability is.
            if row["result"] == PASS and any(
                outcome not in (PASS, NOT_OFFERED) for outcome in row.get("paths", {}).values()
            ):
                row["result"] = PARTLY
        newer = cache.get("not counted", {})
        for name, row in rows.items():
            _count_cases(row, newer.get(name))
        for name, row in newer.items():
            if name not in rows:  # a property new since the contract the run is held to
                _count_cases(row, None)
        rank = order[cache.get("kind", "cache")]
        cache["properties"] = dict(sorted(rows.items(), key=lambda kv: rank.get(kv[0], 99)))
        cache["holds"] = sum(row["result"] == PASS for row in rows.values())
        cache["failed"] = sum(row["result"] == FAIL for row in rows.values())
        cache["not offered"] = sum(row["result"] == NOT_OFFERED for row in rows.values())
        cache["run"] = sum(row["result"] in (PASS, FAIL) for row in rows.values())
        cache["kit properties"] = counted_by_kind[cache["kind"]]
        if cache["kind"] == "cache":  # the JSON report names the kind of an engine alone
            del cache["kind"]
    return caches


def _count_cases(row: dict, newer: dict | None) -> None:
    """How many of a property's tests ran (passed, failed, or were found not offered: a skip
    of the user's, an xfail, a tier's skip did not run) of those collection made
    (``planned``, per test class), its cases of a newer contract (``newer``, not counted)
    included: a property that passed where some did not run (a -k, a deselect, a test id)
    is partly run, "pass (K of N cases)", and does not hold."""
    planned, ran = row.pop("planned", {}), row.pop("ran", set())
    if newer is not None:
        planned = {**newer.pop("planned", {}), **planned}
        ran = ran | newer.pop("ran", set())
    if not planned:  # entries from a kit that did not count them (an older report)
        return
    of = sum(planned.values())
    row["cases"] = {"run": min(len(ran), of), "of": of}
    if row["result"] == PASS and len(ran) < of:
        row["result"] = PARTLY
    if row["result"] == PARTLY:
        row["partly"] = f"pass ({row['cases']['run']} of {of} cases)"


def _add(row: dict, entry: dict) -> None:
    """One test's outcome into its property's row: the first sets it, a later one replaces it
    where it ranks below (``_ranks_below``: a failure, the worst severity first; a pass over
    a skip)."""
    row["tests"] += 1
    if "planned" in entry:  # the property's tests on the cache per class, before any left out
        row.setdefault("planned", {}).update(entry["planned"])
    if entry["outcome"] in (PASS, FAIL, NOT_OFFERED):  # ran, or the kit found it not offered
        row.setdefault("ran", set()).add(entry["test"])  # once, however often it ran
    if "path" in entry:
        paths = row.setdefault("paths", dict.fromkeys(entry["paths"], "not run"))
        if paths[entry["path"]] != FAIL:
            paths[entry["path"]] = entry["outcome"]
    if "reached" in entry:  # a pass: what every test of the property ran, together
        reached = dict.fromkeys([*row.get("reached", []), *entry["reached"]])
        missed = [*row.get("not reached", []), *entry["not reached"]]
        row["reached"] = list(reached)
        row["not reached"] = [name for name in dict.fromkeys(missed) if name not in reached]
    outcome = entry["outcome"]
    if entry.get("searched"):
        row["searched"] = True
    if record := entry.get("exhaustive"):
        scope = {key: value for key, value in record["scope"].items() if key != "tokens"}
        row["scope"] = scope
        group = row.setdefault("blocks", {}).setdefault(
            record["group"],
            {"tokens": record["tokens"], "plans": record["total"], "of": record["blocks"]},
        )
        if outcome == PASS:
            group.setdefault("ran", []).append(record["first"])
            for key in ("held", "outside", "not_offered"):
                group[key] = group.get(key, 0) + record.get(key, 0)
            if record.get("resumed"):
                group["resumed"] = group.get("resumed", 0) + record["held"]
    if outcome == FAIL:
        row["failed"] += 1
    if row["tests"] > 1 and not _ranks_below(row, {**entry, "result": outcome}):
        return
    row["result"] = outcome
    if outcome == FAIL:
        row.update(severity=entry["severity"], reason=entry["reason"], test=entry["test"])
        row.pop("message", None)
        if "message" in entry:
            row["message"] = entry["message"]
        row.pop("root", None)
        if "root" in entry:
            row["root"] = entry["root"]
    elif outcome == PASS:
        row.pop("reason", None)
    else:
        row["reason"] = entry["reason"]


def _exhaustive(groups: dict[str, dict]) -> dict:
    """What a property's exhaustive blocks ran, over its tests (its paths and cases, each
    every plan): the tokens, the plans of one test, the runs that held, and whether every
    block of every test ran and held (``complete``)."""
    tokens = sorted({group["tokens"] for group in groups.values()})
    return {
        "tokens": tokens[0] if len(tokens) == 1 else tokens,
        "plans": max(group["plans"] for group in groups.values()),
        "runs held": sum(group.get("held", 0) for group in groups.values()),
        "resumed": sum(group.get("resumed", 0) for group in groups.values()),
        "outside the domain": sum(group.get("outside", 0) for group in groups.values()),
        "not offered": sum(group.get("not_offered", 0) for group in groups.values()),
        "blocks run": sum(len(group.get("ran", [])) for group in groups.values()),
        "blocks": sum(group["of"] for group in groups.values()),
        "complete": all(len(set(group.get("ran", []))) == group["of"] for group in groups.values()),
    }


def _exhaustive_lines(cache: dict, width: int) -> list[str]:
    """The lines of an exhaustive run: per token count, the properties whose every plan held
    and how many; the properties it searched instead (they enumerate no plans)."""
    rows = cache["properties"]
    held: dict[int, list[str]] = {}
    for name, row in rows.items():
        if row["result"] == PASS and "exhaustive" in row:
            ran = row["exhaustive"]
            resumed = f", {ran['resumed']:,} runs resumed" if ran["resumed"] else ""
            apart = ""
            for key in ("outside the domain", "not offered"):  # counted apart, not run
                apart += f", {ran[key]:,} {key}" if ran.get(key) else ""
            held.setdefault(ran["tokens"], []).append(f"{name} {ran['plans']:,}{resumed}{apart}")
    if not held:
        return []
    scope = cache.get("scope", {})
    models = f"{len(scope.get('models', []))} models, {scope.get('dtype', '?')}"
    lines = [
        f"  exhaustive   to {tokens} tokens ({models}), every plan holds: {', '.join(names)}"
        for tokens, names in sorted(held.items(), key=lambda kv: str(kv[0]))
    ]
    searched = [
        name
        for name, row in rows.items()
        if row["result"] == PASS and row.get("searched") and "exhaustive" not in row
    ]
    if searched:
        lines.append(f"  searched     {', '.join(searched)} (no enumeration of their plans)")
    return [fitted for line in lines for fitted in _fitted(line, width)]


def _worse(severity: str, than: str) -> bool:
    from kvcheck import failures

    ranks = failures.SEVERITIES
    return ranks.index(severity) < ranks.index(than) if than in ranks else True


def render(caches: dict[str, dict], width: int = 200) -> list[str]:
    lines = []
    for label, cache in caches.items():
        rows = cache["properties"]
        named = label if label == cache["name"] else f"{label} ({cache['name']})"
        offered = len(rows) - cache["not offered"]
        skipped = sum(row["result"] == SKIPPED for row in rows.values())
        # Every property of the kit ran or is not offered: else the count of those that ran.
        every = cache["run"] + cache["not offered"] >= cache["kit properties"]
        ran = f"{cache['run']} of {cache['kit properties']} properties run"
        if cache["failed"]:
            verdict = f"{cache['failed']} FAIL"
        elif skipped:  # skipped (an unavailable device, say): not shown to hold
            verdict = f"{skipped} skipped"
        elif partly := sum(row["result"] == PARTLY for row in rows.values()):
            verdict = f"{partly} partly run"  # some of their cases left out: none shown to hold
        elif not cache["run"]:  # nothing offered (outside its domain, say): nothing holds
            verdict = "no property run"
        else:
            verdict = "holds every property" if every else ran
        line = f"{named}: {verdict} ({cache['holds']} of {offered} pass)"
        lines.append(line if every or verdict == ran else f"{line}; {ran}")
        if domain := cache.get("domain"):
            lines.append(f"  domain       {'; '.join(domain['tested'])}")
            if domain["not tested"]:
                lines.append(f"  not tested   {', '.join(domain['not tested'])}")
        passed = [_with_paths(name, row) for name, row in rows.items() if row["result"] == PASS]
        if passed:
            lines.append(f"  pass         {', '.join(passed)}")
        named = [row for row in rows.values() if row["result"] == PASS and "reached" in row]
        if named:
            hit = sum(len(row["reached"]) for row in named)
            missed = [
                f"{name}: {edge}"
                for name, row in rows.items()
                if row["result"] == PASS
                for edge in row.get("not reached", [])
            ]
            line = f"  reached      {hit} of {hit + len(missed)} edges the passing properties name"
            line += f"; never: {'; '.join(missed)}" if missed else ""
            lines.append(line)
        if pairs := cache.get("interactions"):
            line = f"  interactions {len(pairs['ran'])} of {pairs['offered']} pairs of events ran"
            lines.append(line + (f"; never: {'; '.join(pairs['never'])}" if pairs["never"] else ""))
        lines += _exhaustive_lines(cache, width)
        absent = [
            _with_domain(name, row) for name, row in rows.items() if row["result"] == NOT_OFFERED
        ]
        if absent:
            lines.append(f"  not offered  {', '.join(absent)}")
        for name, row in rows.items():
            if row["result"] == FAIL:
                tests = f"{row['failed']} of {row['tests']} tests"
                line = f"  FAIL         {name} [{row['severity']}] ({tests}): {row['reason']}"
                lines.append(line)
            elif row["result"] == SKIPPED:
                lines.append(f"  skipped      {name}: {row['reason']}")
            elif row["result"] == PARTLY and not row.get("exhaustive", {}).get("complete", 1):
                ran = row["exhaustive"]  # some of its exhaustive blocks did not run
                lines.append(
                    f"  partly run   {name}: {ran['blocks run']} of {ran['blocks']} blocks of "
                    f"its plans to {ran['tokens']} tokens held; the others did not run"
                )
            elif row["result"] == PARTLY:
                paths = "; ".join(
                    f"{path} {outcome}" for path, outcome in row.get("paths", {}).items()
                )
                said = ", ".join(part for part in (row.get("partly", "pass"), paths) if part)
                lines.append(f"  partly run   {name}: {said}; the others did not run")
        lines += _roots(rows, width)
        for name, row in cache.get("not counted", {}).items():
            result = _state(row) + (f": {row['reason']}" if row["result"] == FAIL else "")
            what = f"{name}'s cases" if name in rows else name  # a counted property's new cases
            line = f"  not counted  {what} (new in contract {row['since']}): {result}"
            lines.append(line)
    return [fitted for line in lines for fitted in _fitted(line, width)]


# A verdict line's continuation starts under its text, past the column of its label.
CONTINUED = " " * len("  not offered  ")


def _fitted(line: str, width: int) -> list[str]:
    """``line`` in lines of at most ``width`` characters, broken between words, never cut
    (the JSON report holds each failure's whole message)."""
    return textwrap.wrap(
        line, width, subsequent_indent=CONTINUED, break_long_words=False, break_on_hyphens=False
    ) or [line]


def _roots(rows: dict[str, dict], width: int) -> list[str]:
    """A line for each root (``failures.set_root``) that several failed properties share:
    one bug, seen by each of them; fix it first and run again."""
    by_root: dict[str, list[str]] = {}
    for name, row in rows.items():
        if row["result"] == FAIL and "root" in row:
            by_root.setdefault(row["root"], []).append(name)
    lines = []
    for root, names in by_root.items():
        if len(names) > 1:
            line = f"  one root     {root}: the first divergence of {', '.join(names)}"
            lines += _fitted(line, width)
    return lines


def _with_domain(name: str, row: dict) -> str:
    """A property not offered, with why where that is the cache's declared domain."""
    reason = row.get("reason", "")
    outside = reason.partition("outside the declared domain: ")[2]
    return f"{name} (outside the declared domain: {outside})" if outside else name


def _with_paths(name: str, row: dict) -> str:
    """A property's name, with the paths it ran on where the cache offers more than one."""
    paths = row.get("paths", {})
    if len(paths) < 2:
        return name
    ran = [path for path, outcome in paths.items() if outcome == PASS]
    absent = [f"{path} not offered" for path, outcome in paths.items() if outcome == NOT_OFFERED]
    return f"{name} ({', '.join([*ran, *absent])})"


def _version(package: str = "kvcache-verify") -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def environment(device: str) -> dict[str, str]:
    """What a run's results depend on beside the cache: the versions of what computes and
    searches (read from the installed metadata: the controller imports no torch) and the
    device, so that a comparison can tell an upgrade's change from the cache's."""
    versions = {package: _version(package) for package in ("torch", "hypothesis", "pytest")}
    return {"python": platform.python_version(), **versions, "kv device": device}


def compare(old: dict, new: dict) -> tuple[list[str], bool]:
    """What changed from report ``old`` to ``new``; True if something got worse: a property
    that held and now fails or is gone, or a failure of a worse severity. Each property is
    judged by all its tests that ran, counted or not (a pin changes what counts, not what
    the cache did); a line says where a property is not counted, and where one the old run
    did not run arrived after the contract version it was held to ("new in contract X")."""
    lines, regressed = _setting_changes(old, new), False
    was_held, now_held = (_held_to(report) for report in (old, new))
    if was_held != now_held:
        lines.append(f"contract: held to {was_held or 'an unnamed version'} -> {now_held}")
    for label in sorted(set(old["caches"]) | set(new["caches"])):
        was_in, now_in = (_domain(report["caches"].get(label, {})) for report in (old, new))
        if was_in != now_in:  # what was drawn changed: say so before the results it explains
            lines.append(f"{label}: domain: {was_in} -> {now_in}")
        before, after = (_ran(report["caches"].get(label, {})) for report in (old, new))
        for name in [*before, *(name for name in after if name not in before)]:
            (was, was_counted), (now, now_counted) = (
                rows.get(name, (None, True)) for rows in (before, after)
            )
            if _state(was) == _state(now) and was_counted == now_counted:
                continue
            why = f": {now['reason']}" if now and now["result"] == FAIL else ""
            line = f"{label}: {name}: {_state(was)} -> {_state(now)}{why}"
            if was_counted != now_counted:
                line += " (not counted in the new run)" if was_counted else " (counted now)"
            if was is None and now is not None and _new_rule(now.get("since"), was_held):
                line += f" (new in contract {now['since']}; the old run was held to {was_held})"
            lines.append(line)
            regressed |= _state(was) != _state(now) and _got_worse(was, now)
    return lines, regressed


def _setting_changes(old: dict, new: dict) -> list[str]:
    """A line for each setting of the run that differs between two reports (the kit's
    version, its profile, each item of the environment): said first, since it may explain
    what follows; none is a regression by itself. A setting one report does not record (one
    from an older kit) is not compared."""

    def settings(report: dict) -> dict[str, str]:
        named = {"kit": report.get("kvcache-verify"), "kit profile": report.get("kit_profile")}
        return {**named, **report.get("environment", {})}

    was, now = settings(old), settings(new)
    return [
        f"{name}: {was[name]} -> {now[name]}"
        for name in was
        if was[name] is not None and now.get(name) is not None and was[name] != now[name]
    ]


def _ran(cache: dict) -> dict[str, tuple[dict, bool]]:
    """Each property of a report's cache as all its tests ran, counted or not (the worse of
    its two rows), and whether the run counted it."""
    counted = cache.get("properties", {})
    rows = {name: (row, True) for name, row in counted.items()}
    for name, row in cache.get("not counted", {}).items():
        if name not in counted:
            rows[name] = (row, False)
        elif _ranks_below(counted[name], row):  # a counted property's new cases fared worse
            rows[name] = (row, True)
    return rows


def _ranks_below(row: dict, other: dict) -> bool:
    """Whether ``other`` says worse than ``row``: a failure over anything else, a worse
    severity over a milder one, a run over one that did not run."""
    if other["result"] == FAIL:
        return row["result"] != FAIL or _worse(other["severity"], row["severity"])
    return row["result"] not in (PASS, FAIL) and other["result"] == PASS


def _held_to(report: dict) -> str | None:
    """The contract version a report's run was held to; None for a report from before the
    contract had versions."""
    return report.get("contract", {}).get("held to")


def _new_rule(since: str | None, held: str | None) -> bool:
    from kvcheck import contract

    return since is not None and held is not None and contract.newer(since, held)


def _domain(cache: dict) -> str:
    """What a report's cache declared it supports, as the verdict prints it."""
    return cache["domain"]["described"] if "domain" in cache else "everything the kit draws"


def _state(row: dict | None) -> str:
    if row is None:
        return "absent"
    if row["result"] == FAIL:
        return f"FAIL [{row['severity']}]"
    return row["result"]


def _got_worse(was: dict | None, now: dict | None) -> bool:
    if was is None or was["result"] not in (PASS, FAIL):
        return False
    if was["result"] == PASS:  # failing, skipped, not offered or gone: all lost ground
        return True
    failing = now is not None and now["result"] == FAIL
    return failing and _worse(now["severity"], was["severity"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcheck.verdict", description="compare two --kv-report files"
    )
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    reports = []
    for path in (args.old, args.new):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            parser.error(f"{path}: {error}")
    lines, regressed = compare(*reports)
    print("\n".join(lines) if lines else "no property changed")
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
