"""Prometheus exposition: names, values, absent sections, the schema paths, the HTTP endpoint."""

from __future__ import annotations

import dataclasses
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shadefs.ops import prom
from shadefs.stats import JobStats, Stats
from tests.conftest import drop_kernel_pages, make_tree
from tests.sample_stats import full, minimal, numeric_leaves, schema_type, with_counters


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text.decode())}


def test_mount_wide_counters_and_gauges_agree_with_the_stats() -> None:
    s = samples(prom.render(full()))
    assert s[("shadefs_hits_total", ())] == 30
    assert s[("shadefs_misses_total", ())] == 10
    assert s[("shadefs_bytes_served_total", ())] == 123456
    assert s[("shadefs_bytes_from_source_total", ())] == 65432
    assert s[("shadefs_evictions_total", ())] == 7
    assert s[("shadefs_source_timeouts_total", ())] == 3
    assert s[("shadefs_corrupt_entries_total", ())] == 2
    assert s[("shadefs_blocked_seconds_total", ())] == 0.125
    assert s[("shadefs_ram_bytes", ())] == 1000
    assert s[("shadefs_ram_capacity_bytes", ())] == 4096
    assert s[("shadefs_files_cached", ())] == 3 + 8  # RAM and SSD entries
    assert s[("shadefs_hit_ratio", ())] == 0.75
    assert s[("shadefs_source_healthy", ())] == 0
    assert s[("shadefs_uptime_seconds", ())] == 12.5
    assert s[("shadefs_policy_epoch", ())] == 2
    assert s[("shadefs_policy_max_score", ())] == 0.9
    assert s[("shadefs_up", ())] == 1
    info = (("mountpoint", "/mnt/shade"), ("policy", "shade"), ("source", "/mnt/nfs"))
    assert s[("shadefs_info", info)] == 1
    types = families(prom.render(full()))
    assert types["shadefs_hits"] == "counter"  # the parser strips _total from family names
    assert types["shadefs_ram_bytes"] == "gauge"
    names = {name for name, _ in s}
    assert not any("pid" in n or n == "shadefs_version" for n in names)


def test_sections_become_labelled_and_prefixed_families() -> None:
    s = samples(prom.render(full()))
    assert s[("shadefs_tier_hits_total", (("tier", "ram"),))] == 20
    assert s[("shadefs_tier_hits_total", (("tier", "ssd"),))] == 10
    assert s[("shadefs_tier_capacity_bytes", (("tier", "ssd"),))] == 90000
    assert s[("shadefs_tier_entries", (("tier", "ram"),))] == 3
    assert s[("shadefs_tier_evictions_total", (("tier", "ssd"),))] == 1
    assert s[("shadefs_tier_queued_writes", (("tier", "ssd"),))] == 3
    assert s[("shadefs_prefetch_fetched_total", ())] == 40
    assert s[("shadefs_prefetch_served_total", ())] == 30
    assert s[("shadefs_prefetch_staged", ())] == 5
    assert s[("shadefs_restore_done", ())] == 1
    assert s[("shadefs_restore_entries", ())] == 8
    assert s[("shadefs_sampler_replay", ())] == 2.5
    assert s[("shadefs_sampler_orders_served_total", ())] == 6


def test_absent_sections_and_unset_fields_are_skipped() -> None:
    s = samples(prom.render(minimal()))
    assert s[("shadefs_hits_total", ())] == 30
    assert s[("shadefs_tier_bytes", (("tier", "ram"),))] == 1000
    assert s[("shadefs_policy_entries", ())] == 3
    names = {name for name, _ in s}
    for absent in ("ssd", "restore", "prefetch", "policy_epoch", "policy_min_score"):
        assert not any(absent in n for n in names), absent
    assert not any(
        labels
        for name, labels in s
        if name.startswith("shadefs_tier_") and ("tier", "ssd") in labels
    )


def test_every_exported_path_is_in_the_schema_and_every_number_is_exported() -> None:
    exported = [m.path for m in prom.METRICS] + list(prom.INFO.values())
    for path in exported + list(prom.NOT_EXPORTED):
        schema_type(path)  # KeyError: a field that nothing produces
    for path in exported:
        assert prom.resolve(full(), path) is not None, path
    skipped = tuple(prom.NOT_EXPORTED)
    forgotten = [
        p
        for p in numeric_leaves()
        if p not in exported
        and not p.startswith(tuple(k + "." for k in skipped))
        and p not in skipped
    ]
    assert forgotten == []


def test_the_schema_check_catches_an_invented_field() -> None:
    with pytest.raises(KeyError):
        schema_type("jobs_running")
    with pytest.raises(KeyError):
        schema_type("cache.ssd.source_latency")
    assert schema_type("cache.ssd.restore.done") is bool


def test_each_metric_name_has_one_kind_and_one_label_set() -> None:
    seen: dict[str, tuple[str, tuple[str, ...]]] = {}
    for m in prom.METRICS:
        shape = (m.kind, tuple(k for k, _ in m.labels))
        assert seen.setdefault(m.name, shape) == shape, m.name
    assert len({(m.name, m.labels) for m in prom.METRICS}) == len(prom.METRICS)


def test_a_failing_stats_callable_reports_down() -> None:
    def broken() -> Stats:
        raise RuntimeError("trio loop is gone")

    fams = list(prom.StatsCollector(broken).collect())
    assert [(f.name, f.samples[0].value) for f in fams] == [("shadefs_up", 0.0)]


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("9567", ("127.0.0.1", 9567)),
        (":9567", ("127.0.0.1", 9567)),
        ("0.0.0.0:9100", ("0.0.0.0", 9100)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9567", ("::1", 9567)),
    ],
)
def test_parse_address(addr: str, expected: tuple[str, int]) -> None:
    assert prom.parse_address(addr) == expected


@pytest.mark.parametrize(
    "addr", ["", "abc", "host:", "host:port", "1.2.3.4:99999", "[::1", "::1:80", "[nope]:1", ":-1"]
)
def test_bad_addresses_raise_value_error(addr: str) -> None:
    with pytest.raises(ValueError):
        prom.start_server(addr, dict)


def test_http_scrape_calls_the_stats_function_in_the_server_thread() -> None:
    calls: list[str] = []

    def stats() -> Stats:
        calls.append(threading.current_thread().name)
        return with_counters(full(), hits=5 + len(calls))

    host, port = prom.start_server("127.0.0.1:0", stats)
    assert host == "127.0.0.1" and port > 0
    assert calls == []  # registering must not collect
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read()
    assert samples(body)[("shadefs_hits_total", ())] == 6
    assert calls and calls[0] != threading.current_thread().name


@pytest.mark.mount
def test_render_of_a_real_mounts_stats(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a/1.bin": b"x" * 100, "a/2.bin": b"y" * 50})
    m = mounter(src, "--ram", "1M")
    for name in ("a/1.bin", "a/2.bin", "a/1.bin"):
        drop_kernel_pages()  # (with kernel hits, the kernel would serve the third read)
        (m.mnt / name).read_bytes()
    stats = m.stats()
    s = samples(prom.render(Stats.from_json(stats)))  # the daemon's document parses back
    assert s[("shadefs_hits_total", ())] == stats["hits"] == 1
    assert s[("shadefs_misses_total", ())] == stats["misses"] == 2
    # The kernel page cache may serve a warm re-read, so the daemon counts 150..250 bytes.
    assert s[("shadefs_bytes_served_total", ())] == stats["bytes_served"] >= 150
    assert s[("shadefs_ram_capacity_bytes", ())] == 1 << 20
    # The daemon serves the same exposition in its control directory.
    served = samples((m.mnt / ".shadefs" / "metrics").read_bytes())
    assert served[("shadefs_misses_total", ())] == 2
    assert served[("shadefs_up", ())] == 1


def test_jobs_become_families_with_a_job_label() -> None:
    s = samples(prom.render(full()))
    job = (("group", "sweep"), ("job", "pid:4242"))
    assert s[("shadefs_job_hits_total", job)] == 12
    assert s[("shadefs_job_misses_total", job)] == 4
    assert s[("shadefs_job_epoch", job)] == 3
    assert s[("shadefs_job_bytes_served_total", job)] == 160000
    # An expired job is gone from the stats, and so from the metrics.
    names = {labels for name, labels in samples(prom.render(full(jobs=()))) if "job" in name}
    assert names == set()


def test_every_numeric_job_field_is_exported() -> None:
    numeric = [f.name for f in dataclasses.fields(JobStats) if f.type in ("int", "float")]
    assert sorted(numeric) == sorted(prom.JOB_METRICS)
