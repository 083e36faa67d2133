"""bench/speed.py's scale keys, from its per-dataset stage results: time per event and its growth per
tenfold, peak memory per size, disk per size, and the cache against its source.

Pure functions of the results dict ({dataset: {stage key: stage result}}), so they are tested without
running a stage (tests/bench/test_speed_scale.py).
"""

SIZES = ("1m", "10m", "100m")  # the generated datasets, each ten times the one before
LINEAR_GROWTH = 1.2  # seconds per event may grow at most this much per tenfold ("linear")


def events(r: dict) -> int | None:
    """The dataset's events: the cache's count (what every stage reads), else the extraction's."""
    for stage in ("cache", "extract"):
        n = r.get(stage, {}).get("events")
        if n:
            return n
    return None


def stage_seconds(s: dict) -> float | None:
    """The stage's own timed work (`seconds`; the DuckDB reference: its scan and group-by)."""
    if "error" in s:
        return None
    if "seconds" in s:
        return s["seconds"]
    if "scan_seconds" in s:
        return s["scan_seconds"] + s.get("groupby_seconds", 0.0)
    return None


def seconds_per_event(results: dict) -> dict[str, dict[str, float]]:
    """{stage: {dataset: seconds per event}} over the generated datasets measured."""
    out: dict[str, dict[str, float]] = {}
    for ds in SIZES:
        r = results.get(ds)
        n = events(r) if r else None
        if not n:
            continue
        for stage, s in r.items():
            if "entity_share" in s:  # trained on a sample of the entities: per_entity_16k compares those
                continue
            sec = stage_seconds(s)
            if sec is not None:
                out.setdefault(stage, {})[ds] = sec / n
    return out


def growth(per_event: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """{stage: {"1m->10m": ratio, "10m->100m": ratio}}: seconds per event at the larger size over the
    smaller's (1.0: linear in the events; under LINEAR_GROWTH counts as linear), where both ran."""
    out: dict[str, dict[str, float]] = {}
    for stage, by in per_event.items():
        for small, big in zip(SIZES, SIZES[1:]):
            if small in by and big in by and by[small] > 0:
                out.setdefault(stage, {})[f"{small}->{big}"] = round(by[big] / by[small], 3)
    return out


def _peaks(r: dict | None) -> dict[str, float]:
    """Per stage, its maximum RSS; not the generator's (the benchmark's data, not habitus; its own peak is
    `peak_rss_gb_generate`, bounded by its block of customers)."""
    return {k: s["peak_rss_gb"] for k, s in (r or {}).items() if "peak_rss_gb" in s and k != "generate"}


def per_entity_16k(results: dict) -> dict:
    """The 16k fine-tuning's seconds per trained entity: every entity at 1M and 10M events
    (finetune_16k), a sample at 100M without --full (finetune_16k_sample), and its growth 10M -> 100M."""
    out: dict = {}
    for ds in SIZES:
        for stage in ("finetune_16k", "finetune_16k_sample"):
            s = results.get(ds, {}).get(stage, {})
            if s.get("entities") and stage_seconds(s):
                out[ds] = {"stage": stage, "entities": s["entities"], "seconds_per_entity": s["seconds"] / s["entities"]}
                break
    if "10m" in out and "100m" in out:
        out["growth_10m_100m"] = round(out["100m"]["seconds_per_entity"] / out["10m"]["seconds_per_entity"], 3)
    return out


def peak_gb(r: dict | None) -> float | None:
    """A dataset's peak: the largest per-stage maximum RSS."""
    return max(_peaks(r).values(), default=None)


def peak_stage(r: dict | None) -> str | None:
    peaks = _peaks(r)
    return max(peaks, key=peaks.get) if peaks else None


def cache_ratios(results: dict) -> dict[str, float]:
    """{dataset: cache bytes / extracted source bytes} where the cache stage measured both."""
    return {ds: r["cache"]["cache_to_source_ratio"] for ds, r in results.items()
            if "cache_to_source_ratio" in r.get("cache", {})}


def disk(results: dict) -> dict[str, dict[str, int]]:
    """{dataset: {stage: bytes the stage left in the dataset's folder}, "total": the folder at the end}."""
    out: dict[str, dict[str, int]] = {}
    for ds, r in results.items():
        kept = {k: s["disk_kept_bytes"] for k, s in r.items() if "disk_kept_bytes" in s}
        if kept:
            ends = [s["disk_folder_bytes"] for s in r.values() if "disk_folder_bytes" in s]
            out[ds] = {**kept, "total": ends[-1] if ends else sum(kept.values())}
    return out


def scale_keys(results: dict) -> dict:
    """The scale keys (growth per event, cache ratio, peaks) from the results of the datasets measured."""
    per_event = seconds_per_event(results)
    ratios = cache_ratios(results)
    peaks = {ds: peak_gb(results.get(ds)) for ds in SIZES}
    out = {"peak_rss_gb_100m": peaks["100m"],
           "peak_ratio_10m_1m": round(peaks["10m"] / peaks["1m"], 3) if peaks["10m"] and peaks["1m"] else None,
           "peak_ratio_100m_10m": round(peaks["100m"] / peaks["10m"], 3) if peaks["100m"] and peaks["10m"] else None,
           "peak_stage": {ds: peak_stage(results.get(ds)) for ds in SIZES if ds in results},
           "peak_rss_gb_generate": {ds: results[ds]["generate"]["peak_rss_gb"] for ds in SIZES
                                    if "peak_rss_gb" in results.get(ds, {}).get("generate", {})},
           "cache_to_source_ratio": max(ratios.values()) if ratios else None,
           "cache_to_source_ratio_by_dataset": ratios,
           "seconds_per_event": per_event,
           "seconds_per_event_growth": growth(per_event),
           "finetune_16k_per_entity": per_entity_16k(results),
           "disk_bytes": disk(results)}
    return out


def over_linear(growths: dict[str, dict[str, float]], limit: float = LINEAR_GROWTH) -> list[str]:
    """'stage size->size ratio' for every growth above `limit` (what the table's notes name)."""
    return [f"{stage} {step} {g:.2f}x" for stage, by in growths.items() for step, g in by.items() if g > limit]
