"""Which group (value, scalar, attribute) every input of the network belongs to, and its name."""

from dataclasses import dataclass

import numpy as np

from habitus.models.data.features import ENTITY_BUCKETS, WINDOWS, FeatureSpec, bucket_count, tail_start, visit_width

SEQUENCE_REASON = "the order, timing and values of the last events"


def with_tokens(base, x, width: int):
    """Where an explanation's path starts: the baseline's `width` aggregate columns with the rows' own
    sequence tokens (torch or numpy rows; `base` as wide as `x`). Token ids are not a quantity a path
    can move along, so the tokens are in place from the start, and what they add to the baseline,
    f(start) - f(baseline), is the `sequence` group's contribution: the attributions still sum to
    f(x) - f(baseline)."""
    if x.shape[1] == width:
        return base
    start = base.clone() if hasattr(base, "clone") else base.copy()
    start[:, width:] = x[:, width:]
    return start


@dataclass
class Groups:
    """The network's inputs in groups. Per group: kind, source, column, value (the text of the value,
    or None for an attribute, whose value is the entity's own) and `value_id` (the histogram bucket of
    a value group, else -1). `of_input[i]` is the group of input i; `baseline` the "no history" input."""

    kind: list[str]
    source: list[str]
    column: list[str]
    value: list
    value_id: np.ndarray
    of_input: np.ndarray
    baseline: np.ndarray
    bucket_group: dict  # (column, bucket) -> group of a value group

    def __len__(self) -> int:
        return len(self.kind)

    def columns(self) -> list[tuple[str, str]]:
        """(source, column) of every group: what the global importance is summed by."""
        return list(zip(self.source, self.column))


def scalar_names(spec: FeatureSpec) -> list[tuple[str, str, str]]:
    """(kind, column, description) of the leading scalar inputs, in the order features.py writes them."""
    hl = [f"{h:g}" for h in spec.half_lives]
    out = [("frequency", "frequency", "events"), ("recency", "recency", "days since the last event"),
           ("recency", "recency", "days since the first event")]
    out += [("frequency", "frequency", f"events in the last {w} days") for w in WINDOWS]
    out += [("frequency", "frequency", f"events, decayed over {h} days") for h in hl]
    for c in spec.numeric:
        out += [("money", c, f"sum of {c}, decayed over {h} days") for h in hl]
        out.append(("money", c, f"mean {c} per event"))
    if spec.visits:
        out += [("frequency", "frequency", "visits (days with events)")]
        out += [("frequency", "frequency", f"visits in the last {w} days") for w in WINDOWS]
        out += [("frequency", "frequency", f"visits, decayed over {h} days") for h in hl]
        out += [("frequency", "frequency", "mean days between visits"),
                ("recency", "recency", "days since the last visit against the usual gap"),
                ("frequency", "frequency", "visited on two days or more"),
                ("frequency", "frequency", "events per visit")]
    assert len(out) == spec.scalar_width, (len(out), spec.scalar_width)
    return out


# inputs whose "no history" value is the largest seen in training, not zero: the days since the first
# and the last event, the mean days between visits (features.py; log1p of days)
def _age_inputs(spec: FeatureSpec) -> list[int]:
    ages = [1, 2]
    if spec.visits:
        ages.append(spec.scalar_width - visit_width(spec.half_lives) + 1 + len(WINDOWS) + len(spec.half_lives))
    return ages


def _bucket_names(vocab: list, vocab_size: int, buckets: int, tail: np.ndarray | None = None) -> list[str]:
    """A name per histogram bucket: the value of a bucket of its own, and for a shared bucket of
    related values (`tail`: models/data/related.py) its most frequent member ("like ...")."""
    n = bucket_count(vocab_size, buckets)
    exact = n if vocab_size + 1 <= buckets else tail_start(buckets)
    name = lambda i: str(vocab[i - 1]) if i - 1 < len(vocab) else f"(id {i})"  # noqa: E731
    names = ["(unknown)"] + [name(i) for i in range(1, exact)]
    for b in range(exact, n):
        members = np.flatnonzero(tail == b - exact) if tail is not None else ()
        like = f" like {name(exact + int(members[0]))}" if len(members) else ""  # ids by frequency: the first
        names.append(f"(rarer values{like}, shared bucket {b - exact + 1} of {n - exact})")
    return names


def input_groups(spec: FeatureSpec, vocab, trunk, sources: dict[str, str] | None = None) -> Groups:
    """The groups of a feature spec's inputs. `vocab(column)` -> the column's values in id order
    (`entity.<column>` for entity attributes: Cache.vocab's names); `sources` maps a column to the
    source it comes from (events and attribute columns, entity attributes), default "events" /
    "entity"; `trunk` gives the "no history" baseline (its input means and, when it has them, the
    piecewise-linear bins' top edges)."""
    sources = sources or {}
    events = sources.get("__events__", "events")
    kind, source, column, value, value_id, of_input, bucket_group = [], [], [], [], [], [], {}

    def add(k, s, c, v, vid=-1, width=1):
        kind.append(k), source.append(s), column.append(c), value.append(v), value_id.append(vid)
        of_input.extend([len(kind) - 1] * width)

    for k, c, d in scalar_names(spec):
        add(k, events, c, d)
    for c, size in spec.categorical.items():
        for b, name in enumerate(_bucket_names(vocab(c), size, spec.buckets, spec.tail(c))):
            bucket_group[(c, b)] = len(kind)
            add("value", sources.get(c, events), c, name, b, spec.channels)
    for c, size in spec.entity_categorical.items():
        add("attribute", sources.get(c, "entity"), c, None, width=bucket_count(size, ENTITY_BUCKETS))
    for c in list(spec.entity_numeric) + list(spec.entity_timestamp):
        add("attribute", sources.get(c, "entity"), c, None, width=2)
    if spec.sequence:  # the sequence encoder's tokens: one reason, what the last events add (with_tokens)
        add("sequence", events, "recent events", SEQUENCE_REASON, width=spec.input_width - spec.width)
    of_input = np.asarray(of_input, np.int64)
    assert len(of_input) == spec.input_width, (len(of_input), spec.input_width)

    mean = np.zeros(spec.input_width, np.float32)
    std = np.ones(spec.input_width, np.float32)
    mean[:spec.width] = trunk.in_mean.detach().float().cpu().numpy()
    std[:spec.width] = trunk.in_std.detach().float().cpu().numpy()
    base = np.zeros(spec.input_width, np.float32)  # (the tokens of no event at all: padding)
    attr = np.isin(of_input, [g for g, k in enumerate(kind) if k == "attribute"])
    base[attr] = mean[attr]  # the population's average attributes
    top = mean + 3 * std
    if getattr(trunk.cfg, "ple_bins", 0) and trunk.cfg.ple_columns:
        edges = trunk.ple_edges.detach().float().cpu().numpy()[:trunk.cfg.ple_columns, -1]
        top[:len(edges)] = edges * std[:len(edges)] + mean[:len(edges)]
    for i in _age_inputs(spec):
        base[i] = max(top[i], 0.0)
    return Groups(kind, source, column, value, np.asarray(value_id, np.int64), of_input, base, bucket_group)


def column_sources(project) -> dict[str, str]:
    """column -> source name of a project config (the sources' `columns` lists), plus "__events__",
    the name the entity's scalars go under (the events source, or "events" when there are several)."""
    out = {}
    for s in project.sources:
        for c in s.columns:
            out.setdefault(c, s.name)
    ev = project.events_sources
    out["__events__"] = ev[0].name if len(ev) == 1 else "events"
    return out


def vocab_reader(cache):
    """column -> its values in id order (`entity.<column>` for entity attributes), read once each."""
    seen = {}

    def vocab(column: str) -> list:
        if column not in seen:
            seen[column] = cache.vocab(column).column("value").to_pylist()
        return seen[column]

    return vocab
