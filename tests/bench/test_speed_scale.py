"""bench/speed_scale.py: bench/speed.py's scale keys (time per event and its growth per tenfold, peaks,
disk, the cache against its source) from hand-made stage results."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("speed_scale", BENCH / "speed_scale.py")
scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scale)


def _dataset(events: int, foundation_s: float, peak: float, ratio: float, gen_peak: float = 9.0) -> dict:
    return {"generate": {"seconds": 1.0, "purchases": events, "peak_rss_gb": gen_peak, "disk_kept_bytes": 100,
                         "disk_folder_bytes": 100},
            "extract": {"seconds": events / 1e6, "events": events, "peak_rss_gb": 0.5, "disk_kept_bytes": 40,
                        "disk_folder_bytes": 140},
            "duckdb": {"scan_seconds": 0.1, "groupby_seconds": 0.3, "events": events, "peak_rss_gb": 0.3},
            "cache": {"seconds": 2.0, "events": events, "peak_rss_gb": 0.6, "cache_to_source_ratio": ratio,
                      "disk_kept_bytes": 30, "disk_folder_bytes": 170},
            "foundation": {"seconds": foundation_s, "peak_rss_gb": peak, "disk_kept_bytes": 5, "disk_folder_bytes": 175},
            "finetune_churn": {"error": "exit 1: killed", "peak_rss_gb": 3.0}}


RESULTS = {"1m": _dataset(1_000_000, 10.0, 1.0, 0.8), "10m": _dataset(10_000_000, 110.0, 1.4, 0.9),
           "100m": _dataset(100_000_000, 1_500.0, 2.0, 0.95), "tafeng": _dataset(800_000, 5.0, 7.0, 1.3)}


def test_seconds_per_event_and_growth_per_tenfold():
    per_event = scale.seconds_per_event(RESULTS)
    assert per_event["foundation"] == pytest.approx({"1m": 1e-5, "10m": 1.1e-5, "100m": 1.5e-5})
    assert per_event["duckdb"]["1m"] == pytest.approx(0.4 / 1e6)  # scan and group-by together
    assert "tafeng" not in per_event["foundation"]  # not one of the tenfold sizes
    assert "finetune_churn" not in per_event  # a failed stage has no time
    g = scale.growth(per_event)
    assert g["foundation"] == {"1m->10m": 1.1, "10m->100m": pytest.approx(1.364, abs=1e-3)}
    assert g["extract"] == {"1m->10m": 1.0, "10m->100m": 1.0}
    assert g["cache"]["10m->100m"] == pytest.approx(0.1)
    assert scale.over_linear(g) == ["foundation 10m->100m 1.36x"]


def test_growth_needs_both_sizes():
    only = {"1m": RESULTS["1m"], "100m": RESULTS["100m"]}
    assert scale.growth(scale.seconds_per_event(only)) == {}


def test_peaks_leave_the_generator_out_and_name_their_stage():
    keys = scale.scale_keys(RESULTS)
    assert keys["peak_rss_gb_100m"] == 3.0  # the failed stage's peak counts: it is what the process took
    assert keys["peak_stage"]["100m"] == "finetune_churn"
    assert keys["peak_ratio_10m_1m"] == 1.0 and keys["peak_ratio_100m_10m"] == 1.0
    assert keys["peak_rss_gb_generate"] == {"1m": 9.0, "10m": 9.0, "100m": 9.0}
    assert scale.peak_gb({"generate": {"peak_rss_gb": 5.0}}) is None


def test_cache_ratio_is_the_worst_dataset_and_disk_per_size():
    keys = scale.scale_keys(RESULTS)
    assert keys["cache_to_source_ratio"] == 1.3
    assert keys["cache_to_source_ratio_by_dataset"] == {"1m": 0.8, "10m": 0.9, "100m": 0.95, "tafeng": 1.3}
    assert keys["disk_bytes"]["100m"] == {"generate": 100, "extract": 40, "cache": 30, "foundation": 5, "total": 175}


def test_nothing_measured():
    keys = scale.scale_keys({})
    assert keys["peak_rss_gb_100m"] is None and keys["cache_to_source_ratio"] is None
    assert keys["seconds_per_event_growth"] == {} and keys["disk_bytes"] == {}


def test_the_16k_cost_per_entity_compares_a_sample_at_100m_with_all_of_10m():
    results = {"10m": {"cache": {"events": 10_000_000}, "finetune_16k": {"seconds": 200.0, "entities": 100_000}},
               "100m": {"cache": {"events": 100_000_000},
                        "finetune_16k_sample": {"seconds": 250.0, "entities": 100_000, "entity_share": 0.1}}}
    keys = scale.scale_keys(results)
    assert keys["finetune_16k_per_entity"]["growth_10m_100m"] == 1.25
    assert keys["finetune_16k_per_entity"]["100m"]["stage"] == "finetune_16k_sample"
    assert "finetune_16k_sample" not in keys["seconds_per_event"]  # its time is a sample's, not the events'
    assert keys["seconds_per_event"]["finetune_16k"] == {"10m": 2e-5}
