"""What a person reads after a run: each scenario's hold-out metric next to its baselines, where the
outputs are, and the failed checks."""

import json


def failure_line(f: dict) -> str:
    return f"{f['asset']} {f['check']} ({f['severity']}): {f['reason']}".strip()


def failed_checks_table(failures: list[dict]) -> str:
    """The failed checks, one a line: asset, check, severity (blocking or not) and the reason."""
    if not failures:
        return ""
    width = max(len(f"{f['asset']} {f['check']}") for f in failures)
    lines = ["failed checks:"]
    for f in failures:
        sev = f["severity"].upper() + (", blocking" if f["blocking"] else "")
        lines.append(f"  {f['asset'] + ' ' + f['check']:<{width}}  {sev:<16} {f['reason']}")
    return "\n".join(lines)


def holdout_rows(project) -> list[dict]:
    """Each scenario's hold-out metric next to its closest baseline, from its newest checkpoint: scenario,
    task, metric, model, best_baseline, baseline, lower_is_better, beats_baselines, entities (None for a
    scenario not trained yet)."""
    from habitus.assets.check_measures import baseline_margin
    from habitus.resources.store.workspace import Workspace

    ws, rows = Workspace(root=project.workspace), []
    for name in project.scenarios:
        cfg_file = ws.scenario(name) / "config.json"
        row = dict.fromkeys(("task", "metric", "model", "best_baseline", "baseline", "lower_is_better",
                             "beats_baselines", "entities"))
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())
            row.update(baseline_margin(cfg), task=cfg["task"]["task"], beats_baselines=bool(cfg["beats_baselines"]),
                       entities=cfg["metrics"]["entities"])
        rows.append({"scenario": name, **row})
    return rows


def report(project, prediction_day: str | None = None) -> str:
    """The table a person reads first: each scenario's hold-out metric next to its baselines."""
    from habitus.resources.store.workspace import Workspace

    ws = Workspace(root=project.workspace)
    lines = [f"{'scenario':<18} {'task':<15} {'metric':<12} {'model':>8} {'best baseline':>14}  {'(which)':<18} "
             f"{'beats':<6} {'entities':>9}"]
    for r in holdout_rows(project):
        if r["task"] is None:
            lines.append(f"{r['scenario']:<18} (not trained yet)")
            continue
        lines.append(f"{r['scenario']:<18} {r['task']:<15} {r['metric']:<12} {r['model']:>8.4f} "
                     f"{r['baseline']:>14.4f}  {r['best_baseline'] or '-':<18} "
                     f"{'yes' if r['beats_baselines'] else 'no':<6} {r['entities']:>9,}")
    lines.append(f"\nhold-out: test cut-off {_first_protocol(ws, project)}; features before it, targets after it")
    for name in project.prediction_scenarios:
        folder = ws.predictions(name)
        files = sorted(folder.glob("*.parquet")) if folder.exists() else []
        chosen = [f for f in files if prediction_day and f.stem == prediction_day] or files[-1:]
        if chosen:
            import pyarrow.parquet as pq

            lines.append(f"predictions/{name}: {chosen[0]} ({pq.read_metadata(chosen[0]).num_rows:,} rows"
                         f"{scored_by(ws, name, chosen[0])})")
    emb = sorted(ws.embeddings.glob("*.parquet")) if ws.embeddings.exists() else []
    if emb:
        import pyarrow.parquet as pq

        lines.append(f"embeddings: {emb[-1]} ({pq.read_metadata(emb[-1]).num_rows:,} rows)")
    return "\n".join(lines)


def scored_by(ws, name: str, path) -> str:
    """", scored by version <fp>" (", by its baseline <which>, version <fp>") of a predictions file."""
    import pyarrow.parquet as pq

    from habitus.assets.serving import BASELINE, serves_baseline, versions

    first = next(pq.ParquetFile(path).iter_batches(batch_size=1, columns=["model_fingerprint"]), None)
    if first is None or not len(first):
        return ""
    fp, store = first.column(0)[0].as_py(), versions(ws, name)
    kept = store.info(fp) if fp in store.fingerprints() else {}
    serving = serves_baseline(ws, name) or {}  # (a scoring machine holds the serving copy, not the versions)
    which = (kept.get("best_baseline") if kept.get("kind") == BASELINE
             else serving.get("baseline") if serving.get("weights_sha256", "")[:16] == fp else None)
    return f", scored by its baseline {which}, version {fp}" if which else f", scored by version {fp}"


def _first_protocol(ws, project) -> str:
    for name in project.scenarios:
        f = ws.scenario(name) / "config.json"
        if f.exists():
            return json.loads(f.read_text())["protocol"]["test_cutoff"]
    return "-"
