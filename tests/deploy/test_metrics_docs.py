"""docs/metrics.md against a live scrape of every service of the compose stack, in both directions: each metric
a service exports is documented, and each documented metric is exported."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.localstack import REPO

DOC = REPO / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(fleetrl_[a-z0-9_<>]+)` \| (counter|gauge|histogram) \|")


def documented() -> dict[str, str]:
    """name -> type of every metric row in docs/metrics.md (`<...>` parts are name patterns)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if m := ROW.match(line):
            assert m.group(1) not in rows, f"documented twice: {m.group(1)}"
            rows[m.group(1)] = m.group(2)
    return rows


def documented_names() -> set[str]:
    return set(documented())


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"<[a-z_]+>", "[a-z0-9_]+", name) + "$")


def matches_documented(series: str, names: set[str]) -> bool:
    """Whether a queried series name belongs to a documented metric (histogram parts included)."""
    candidates = {series, re.sub(r"_(bucket|sum|count)$", "", series)}
    return any(c in names or any(_pattern(n).match(c) for n in names if "<" in n) for c in candidates)


def exported(scrapes: dict[str, str]) -> dict[str, str]:
    """name -> type as queried (counters with _total) of every fleetrl metric in the scrapes."""
    out = {}
    for text in scrapes.values():
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("fleetrl_") or family.name.endswith("_created"):
                continue  # x_created: the client library's start time of counter/histogram x
            name = family.name + "_total" if family.type == "counter" else family.name
            out[name] = family.type
    return out


def test_doc_rows_parse():
    rows = documented()
    assert len(rows) > 60
    assert rows["fleetrl_controller_rollout_queue_depth"] == "gauge"
    assert all(name.endswith("_total") for name, kind in rows.items() if kind == "counter")


@pytest.mark.integration
@pytest.mark.slow
def test_every_exported_metric_is_documented_and_every_documented_one_exported(compose_run):
    assert set(compose_run.scrapes) >= {"controller", "inference", "reference", "trainer"}
    assert {"gateway_1", "gateway_2"} & set(compose_run.scrapes)
    live = exported(compose_run.scrapes)
    docs = documented()
    undocumented = sorted(n for n in live if not matches_documented(n, set(docs)))
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
    wrong_type = sorted(n for n, kind in live.items() if n in docs and docs[n] != kind)
    assert not wrong_type, f"documented with another type: {wrong_type}"
    missing = sorted(n for n in docs if "<" not in n and n not in live)
    assert not missing, f"documented but not exported: {missing}"
    patterns = [n for n in docs if "<" in n]
    for pattern in patterns:  # each pattern row is backed by at least one live metric
        assert any(_pattern(pattern).match(n) for n in live), pattern


STEP_KEY_ROW = re.compile(r"^\| `([a-z_]+(?:/[a-z0-9_<>]+)*)` \| (trainer|controller|both|evaluator) \|")


def documented_step_keys() -> set[str]:
    """Every key of the per-step record table in docs/metrics.md (`<...>` parts are name patterns)."""
    keys = set()
    for line in DOC.read_text().splitlines():
        if m := STEP_KEY_ROW.match(line):
            assert m.group(1) not in keys, f"documented twice: {m.group(1)}"
            keys.add(m.group(1))
    return keys


def undocumented_step_keys(lines: list[dict]) -> list[str]:
    """The keys of metrics.jsonl lines that docs/metrics.md's per-step table does not list."""
    keys = documented_step_keys()
    patterns = [re.compile("^" + re.sub(r"<[a-z_]+>", "[^/]+", k) + "$") for k in keys if "<" in k]
    seen = {key for line in lines for key in line}
    return sorted(k for k in seen if k not in keys and not any(p.match(k) for p in patterns))


def test_step_key_rows_parse_and_name_the_shared_metric_names():
    from fleetrl import metric_names

    keys = documented_step_keys()
    assert len(keys) > 50 and "env/all/<metric>" in keys
    shared = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    shared |= set(metric_names.LOSS_METRIC_KEYS.values())
    assert not sorted(shared - keys), "fleetrl/metric_names.py names a key docs/metrics.md does not list"
    assert undocumented_step_keys([{"env/all/even_frac": 1.0, "eval/accuracy": 0.5, "train/loss": 0.1}]) == []
    assert undocumented_step_keys([{"loss": 0.1}]) == ["loss"]
