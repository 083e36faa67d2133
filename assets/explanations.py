"""explanations/<name>: why each entity scores as it does, daily like predictions/<name>, for the
scenarios with `explain:` in their config. Each entity's top reasons with signed contributions to the
score predictions/<name> serves (the network's or, where the head chosen on validation blends LightGBM
trees in, that blend's), to `explanations/<name>/<day>.parquet` (schema: the README's "Explanations"
section; method: models/explain/, docs/explanations.md) and, with `explain: {write_back: true}` and a
sink, to the warehouse table <sink.table>_<name>_explanations. The materialization carries the
completeness gap, the head explained and the global importance (mean |attribution| by source and
column) as a table and a bar chart."""

import time
from datetime import datetime

import dagster as dg

from habitus.assets.plots import importance_chart
from habitus.assets.predictions import scoring_asset, scoring_inputs, write_days
from habitus.assets.serving import CHECKPOINT_NOTE, serves_baseline, serving_checkpoint, serving_note
from habitus.resources.store.workspace import locked


def explanations_key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["explanations", name])


def importance_markdown(importance: list[tuple[str, str, float]], rows: int = 15) -> str:
    lines = ["| source | column | mean abs. attribution |", "|---|---|---|"]
    lines += [f"| {s} | {c} | {v:.4g} |" for s, c, v in importance[:rows]]
    return "\n".join(lines)


def build_explanations_asset(project, name: str, scenario, partitions_def) -> dg.AssetsDefinition:
    settings = scenario.explain
    sink = project.predictions.sink if settings.write_back else None

    chosen = ("every entity" if settings.select == "all" else
              f"the {settings.share:.0%} highest-scored entities" if settings.select == "top" else
              f"a random {settings.share:.0%} of the entities")

    @scoring_asset(explanations_key(name), name, partitions_def, sink, {"parquet"},
                   f"The top {settings.top} reasons of {chosen} for their {scenario.task} score(s) of scenario "
                   f"{name!r}, the score predictions serve (Integrated Gradients of the network and, where the head "
                   f"chosen on validation blends trees in, their exact contributions; grouped by source, column "
                   f"and value)")
    @locked(f"explanations/{name}")
    def _explanations(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from habitus.models.explain import Summary, column_sources, explain_cutoff, input_groups, vocab_reader
        from habitus.models.serve.predict import load_model
        from habitus.models.heads.stacked_head import load_head
        from habitus.models.tasks import task as task_of

        started = time.time()
        if serves_baseline(context.resources.workspace, name) is not None:  # no network serves: nothing to explain
            why = (f"explanations/{name}: nothing written: predictions use the "
                   f"{serving_note(context.resources.workspace, name)}, and explanations explain a network")
            context.log.warning(why)
            return dg.MaterializeResult(metadata={"rows": dg.MetadataValue.int(0), "skipped": why})
        workspace, executor, device, cache, state, config, passed = scoring_inputs(context, name, "explaining")
        model, spec, task = load_model(state, config)  # fp32: gradients (predictions may score in int8)
        # the head chosen on validation, as predictions scores with it: where it blends trees in, the served
        # score is explained (models/explain/served.py); None or the network alone: the network's
        head = load_head(serving_checkpoint(workspace, name)[0], config)
        explained = "network" if head is None or head.weight == 0 else f"{head.chosen} (trees weighted {head.weight:.2f})"
        label_names = config.get("label_values") or None
        labels = None
        if settings.labels:
            if not (task_of(task).writes_every_label and label_names):
                raise dg.Failure(f"scenarios.{name}.explain.labels: only a multilabel or multiclass scenario has "
                                 f"labels to name")
            known = [str(v) for v in label_names or []]
            missing = [v for v in settings.labels if v not in known]
            if missing:
                raise dg.Failure(f"scenarios.{name}.explain.labels: {missing} are not labels of the scenario; its "
                                 f"labels are {known[:20]}{' ...' if len(known) > 20 else ''}")
            labels = [known.index(v) for v in settings.labels]
        groups = input_groups(spec, vocab_reader(cache), model.trunk, column_sources(project))
        summary = Summary.of(groups)
        fingerprint = config["weights_sha256"][:16]
        folder = workspace.path / "explanations" / name

        def batches_of(day: str, as_of: datetime):
            return explain_cutoff(model, cache, spec, task, int(as_of.timestamp()), groups, top=settings.top,
                                  labels=labels, per_entity=settings.per_entity, label_names=label_names,
                                  steps=settings.steps, select=settings.select, share=settings.share, device=device,
                                  summary=summary, head=head)

        rows, written_back, files = write_days(context, "explanations", name, folder, batches_of, cache,
                                               project.entity, fingerprint, sink,
                                               f"{sink.table}_{name}_explanations" if sink else None, unit="reasons")
        seconds = time.time() - started
        importance = summary.importance()
        chart = importance_chart(importance, folder / "importance.png",
                                 f"{name}: mean |attribution| by source.column")
        return dg.MaterializeResult(metadata={
            "global_importance": dg.MetadataValue.md(chart),
            "importance_table": dg.MetadataValue.md(importance_markdown(importance)),
            "rows": dg.MetadataValue.int(rows),
            "entities": dg.MetadataValue.int(summary.entities),
            "scored_entities": dg.MetadataValue.int(summary.eligible),
            "selection": f"{settings.select} {settings.share:.0%}" if settings.select != "all" else "all",
            "mean_steps": dg.MetadataValue.float(round(summary.steps_mean, 2)),
            "over_tolerance": dg.MetadataValue.int(summary.over_tolerance),
            "explained_scores": dg.MetadataValue.int(summary.pairs),
            "days": dg.MetadataValue.int(len(files)),
            "steps": dg.MetadataValue.int(settings.steps),
            "completeness_gap_mean": dg.MetadataValue.float(summary.gap_mean),
            "completeness_gap_max": dg.MetadataValue.float(summary.gap_max),
            "completeness_gap_relative": dg.MetadataValue.float(summary.relative_gap),
            "model_fingerprint": fingerprint,
            "explained_head": explained,  # the head predictions serve: the same scores
            "checkpoint": CHECKPOINT_NOTE[passed],
            "entities_per_second": dg.MetadataValue.float(round(summary.entities / max(seconds, 1e-9), 1)),
            "written_to_warehouse": dg.MetadataValue.int(written_back),
            "seconds": dg.MetadataValue.float(round(seconds, 3)),
            "path": dg.MetadataValue.path(str(files[-1])),
        })

    return _explanations
