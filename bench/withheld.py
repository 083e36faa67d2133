"""A few-label target that events do not determine: an entity attribute withheld from the inputs.

bench/panel.py builds its caches without the attribute (Ta-Feng's `age_group`, the demo's `segment`,
MovieLens's `gender`), reads it from the source table, and trains a binary scenario whose target is
`target` below (a target function, habitus.models.data.target_functions): 1 where the entity's value
is in the positive set, 0 elsewhere (also where it is missing). Constant over cut-offs: what varies is
how much history the models have read.
"""

import dataclasses

import pyarrow.parquet as pq

# dataset -> (the entity table's file name, the withheld column, its positive values, what 1 means)
ATTRIBUTES = {
    "tafeng": ("customers", "age_group", {"<25", "25-29", "30-34"}, "age under 35"),
    "demo": ("customers", "segment", {"premium"}, "premium segment"),
    "movielens": ("users", "gender", {"F"}, "gender F"),
}
FUNCTION = "withheld:target"
VALUES: dict[str, float] = {}  # entity id (text) -> 0/1, set by `load`


def without(spec, dataset: str):
    """The cache spec with the dataset's withheld column left out of its entity tables."""
    column = ATTRIBUTES[dataset][1]
    return dataclasses.replace(spec, entity_attributes=[
        dataclasses.replace(t, columns={c: k for c, k in t.columns.items() if c != column})
        for t in spec.entity_attributes])


def load(path: str, entity: str, column: str, positive: set) -> float:
    """Reads the attribute of every entity from `path` into VALUES; returns the positive share."""
    table = pq.read_table(path, columns=[entity, column]).to_pydict()
    VALUES.clear()
    VALUES.update({str(e): float(v in positive) for e, v in zip(table[entity], table[column])})
    return sum(VALUES.values()) / max(len(VALUES), 1)


def target(history, future, entities) -> list[float]:
    """The withheld attribute's 0/1 of each entity scored at the cut-off."""
    return [VALUES.get(str(e), 0.0) for e in entities.column("entity_id").to_pylist()]
