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


def report(project, prediction_day: str | None = None) -> str:
    """The table a person reads first: each scenario's hold-out metric next to its baselines."""
    from habitus.assets.check_measures import baseline_margin
    from habitus.resources.workspace import Workspace

    ws = Workspace(root=project.workspace)
    lines = [f"{'scenario':<18} {'task':<15} {'metric':<12} {'model':>8} {'best baseline':>14}  {'(which)':<18} "
             f"{'beats':<6} {'entities':>9}"]
    for name in project.scenarios:
        cfg_file = ws.scenario(name) / "config.json"
        if not cfg_file.exists():
            lines.append(f"{name:<18} (not trained yet)")
            continue
        cfg = json.loads(cfg_file.read_text())
        margin = baseline_margin(cfg)
        lines.append(f"{name:<18} {cfg['task']['task']:<15} {margin['metric']:<12} {margin['model']:>8.4f} "
                     f"{margin['baseline']:>14.4f}  {margin['best_baseline'] or '-':<18} "
                     f"{'yes' if cfg['beats_baselines'] else 'no':<6} {cfg['metrics']['entities']:>9,}")
    lines.append(f"\nhold-out: test cut-off {_first_protocol(ws, project)}; features before it, targets after it")
    for name in project.prediction_scenarios:
        folder = ws.predictions(name)
        files = sorted(folder.glob("*.parquet")) if folder.exists() else []
        chosen = [f for f in files if prediction_day and f.stem == prediction_day] or files[-1:]
        if chosen:
            import pyarrow.parquet as pq

            lines.append(f"predictions/{name}: {chosen[0]} ({pq.read_metadata(chosen[0]).num_rows:,} rows)")
    emb = sorted(ws.embeddings.glob("*.parquet")) if ws.embeddings.exists() else []
    if emb:
        import pyarrow.parquet as pq

        lines.append(f"embeddings: {emb[-1]} ({pq.read_metadata(emb[-1]).num_rows:,} rows)")
    return "\n".join(lines)


def _first_protocol(ws, project) -> str:
    for name in project.scenarios:
        f = ws.scenario(name) / "config.json"
        if f.exists():
            return json.loads(f.read_text())["protocol"]["test_cutoff"]
    return "-"
