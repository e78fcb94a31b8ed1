"""Prometheus exposition: names, values, tolerance of missing sections, the HTTP endpoint."""

from __future__ import annotations

import math
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shadefs.ops import prom
from tests.conftest import make_tree

FULL = {
    "version": 1,
    "pid": 4242,
    "mountpoint": "/mnt/shade",
    "source": "/mnt/nfs",
    "uptime_s": 12.5,
    "policy": "epoch",
    "policy_state": {"name": "epoch", "entries": 3, "epoch": 2, "epoch_source": "inferred"},
    "hits": 30,
    "misses": 10,
    "hit_ratio": 0.75,
    "bytes_served": 123456,
    "bytes_from_source": 65432,
    "ram_bytes": 1000,
    "ram_capacity": 4096,
    "ram_max_entry": 512,
    "files_cached": 3,
    "admitted": 10,
    "evictions": 7,
    "refused": 1,
    "passthrough_opens": 2,
    "fetches_shared": 4,
    "inodes_known": 50,
    "directories_listed": 5,
    "source_healthy": False,
    "source_timeouts": 3,
    "source_errors": 1,
    "corrupt_entries": 2,
    "control_errors": 0,
    "brand_new_counter": 17,
    "a_string": "ignored",
    "tiers": {
        "ram": {"hits": 20, "bytes": 1000, "capacity": 4096, "entries": 3},
        "ssd": {"hits": 10, "bytes": 9000, "capacity": 90000, "entries": 8, "evictions": 1},
    },
    "source_latency": {
        "buckets": {"0.1": 9, "0.001": 2, "0.01": 6, "+Inf": 10},
        "sum": 0.42,
        "count": 10,
    },
    "prefetch": {"queued": 5, "inflight": 2, "fetched": 40, "bytes": 4000, "wasted": 1},
    "restore": {"done": True, "entries": 8},
    "sampler": {"samples": 100, "epoch": 3, "replay": 2.5, "orders_served": 6, "table": {}},
    "jobs": {"train-a": {"hits": 12, "misses": 3}, "4711": {"hits": 18, "misses": 7}},
}


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text.decode())}


def test_top_level_counters_and_gauges_agree_with_the_dict() -> None:
    s = samples(prom.render(FULL))
    assert s[("shadefs_hits_total", ())] == 30
    assert s[("shadefs_misses_total", ())] == 10
    assert s[("shadefs_bytes_served_total", ())] == 123456
    assert s[("shadefs_bytes_from_source_total", ())] == 65432
    assert s[("shadefs_evictions_total", ())] == 7
    assert s[("shadefs_source_timeouts_total", ())] == 3
    assert s[("shadefs_corrupt_entries_total", ())] == 2
    assert s[("shadefs_ram_bytes", ())] == 1000
    assert s[("shadefs_ram_capacity_bytes", ())] == 4096
    assert s[("shadefs_files_cached", ())] == 3
    assert s[("shadefs_hit_ratio", ())] == 0.75
    assert s[("shadefs_source_healthy", ())] == 0
    assert s[("shadefs_uptime_seconds", ())] == 12.5
    assert s[("shadefs_policy_epoch", ())] == 2
    assert s[("shadefs_up", ())] == 1
    info = (("mountpoint", "/mnt/shade"), ("policy", "epoch"), ("source", "/mnt/nfs"))
    assert s[("shadefs_info", info)] == 1
    types = families(prom.render(FULL))
    assert types["shadefs_hits"] == "counter"  # the parser strips _total from family names
    assert types["shadefs_ram_bytes"] == "gauge"


def test_sections_become_labelled_families_and_a_histogram() -> None:
    text = prom.render(FULL)
    s = samples(text)
    assert s[("shadefs_tier_hits_total", (("tier", "ram"),))] == 20
    assert s[("shadefs_tier_hits_total", (("tier", "ssd"),))] == 10
    assert s[("shadefs_tier_capacity_bytes", (("tier", "ssd"),))] == 90000
    assert s[("shadefs_tier_entries", (("tier", "ram"),))] == 3
    assert s[("shadefs_tier_evictions_total", (("tier", "ssd"),))] == 1
    assert s[("shadefs_job_hits_total", (("job", "train-a"),))] == 12
    assert s[("shadefs_job_misses_total", (("job", "4711"),))] == 7
    assert s[("shadefs_prefetch_fetched_total", ())] == 40
    assert s[("shadefs_prefetch_queued", ())] == 5
    assert s[("shadefs_restore_done", ())] == 1
    assert s[("shadefs_restore_entries", ())] == 8
    assert s[("shadefs_sampler_replay", ())] == 2.5
    assert s[("shadefs_sampler_orders_served_total", ())] == 6
    buckets = {
        dict(labels)["le"]: v
        for (name, labels), v in s.items()
        if name == "shadefs_source_latency_seconds_bucket"
    }
    assert buckets == {"0.001": 2, "0.01": 6, "0.1": 9, "+Inf": 10}
    assert s[("shadefs_source_latency_seconds_count", ())] == 10
    assert math.isclose(s[("shadefs_source_latency_seconds_sum", ())], 0.42)
    assert families(text)["shadefs_source_latency_seconds"] == "histogram"


def test_unknown_numbers_are_gauges_and_other_fields_are_ignored() -> None:
    text = prom.render(FULL)
    s = samples(text)
    assert s[("shadefs_brand_new_counter", ())] == 17
    assert families(text)["shadefs_brand_new_counter"] == "gauge"
    names = {name for name, _ in s}
    assert not any("a_string" in n or "pid" in n or n == "shadefs_version" for n in names)


def test_absent_and_malformed_sections_are_skipped() -> None:
    minimal = {"hits": 1, "misses": 2}
    s = samples(prom.render(minimal))
    assert s[("shadefs_hits_total", ())] == 1
    assert not any(name.startswith(("shadefs_tier", "shadefs_job")) for name, _ in s)
    odd = {
        "hits": 1,
        "tiers": "not a mapping",
        "jobs": {"x": None},
        "source_latency": {"buckets": {"nonsense": 1}},
        "restore": [],
        "hit_ratio": None,
    }
    s = samples(prom.render(odd))
    assert s[("shadefs_hits_total", ())] == 1
    assert ("shadefs_hit_ratio", ()) not in s
    assert not any("latency" in name for name, _ in s)


def test_a_histogram_without_inf_bucket_gets_it_from_count() -> None:
    s = samples(prom.render({"source_latency": {"buckets": {"0.5": 3}, "sum": 1.0, "count": 4}}))
    assert s[("shadefs_source_latency_seconds_bucket", (("le", "+Inf"),))] == 4


def test_an_unknown_field_never_takes_a_documented_name() -> None:
    # "up" would collide with shadefs_up; "tier_bytes" with the labelled tier family.
    s = samples(prom.render({"up": 0, "tier_bytes": 5, "tiers": {"ram": {"bytes": 7}}}))
    assert s[("shadefs_up", ())] == 1
    assert s[("shadefs_tier_bytes", (("tier", "ram"),))] == 7
    assert ("shadefs_tier_bytes", ()) not in s


def test_a_failing_stats_callable_reports_down() -> None:
    def broken() -> dict:
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

    def stats() -> dict:
        calls.append(threading.current_thread().name)
        return {"hits": 5 + len(calls), "misses": 1}

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
        (m.mnt / name).read_bytes()
    stats = m.stats()
    s = samples(prom.render(stats))
    assert s[("shadefs_hits_total", ())] == stats["hits"] == 1
    assert s[("shadefs_misses_total", ())] == stats["misses"] == 2
    # The kernel page cache may serve a warm re-read, so the daemon counts 150..250 bytes.
    assert s[("shadefs_bytes_served_total", ())] == stats["bytes_served"] >= 150
    assert s[("shadefs_ram_capacity_bytes", ())] == 1 << 20
    # The daemon serves the same exposition in its control directory.
    served = samples((m.mnt / ".shadefs" / "metrics").read_bytes())
    assert served[("shadefs_misses_total", ())] == 2
    assert served[("shadefs_up", ())] == 1
