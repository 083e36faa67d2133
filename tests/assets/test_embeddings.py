"""The `embeddings` asset's description of its columns matches what habitus.models.serve.predict.embed writes."""

import numpy as np

from habitus.assets.embeddings import embedding_columns, scalar_column_names
from habitus.models.data.features import FeatureSpec
from habitus.models.nn.network import NetConfig, Trunk
from habitus.models.nn.profile import Profile
from habitus.models.serve.predict import embedding_width


def _spec(numeric, visits=True, half_lives=(14.0, 60.0)) -> FeatureSpec:
    return FeatureSpec({"product_id": 50}, list(numeric), {"region": 4}, {"age": (40.0, 12.0)}, ["signup"],
                       half_lives=half_lives, visits=visits)


def test_every_scalar_column_is_named_once():
    for spec in (_spec(["price", "quantity"]), _spec([]), _spec(["price"], visits=False),
                 _spec(["price"], half_lives=(3.0, 14.0, 60.0, 180.0))):
        names = scalar_column_names(spec)
        assert len(names) == spec.scalar_width and len(set(names)) == len(names)
    names = scalar_column_names(_spec(["price"]))
    assert names[:3] == ["events", "days_since_last_event", "days_since_first_event"]
    assert names[8:11] == ["price_sum_decayed_14d", "price_sum_decayed_60d", "price_mean_per_event"]
    assert names[11] == "visits" and names[-1] == "events_per_visit"


def test_columns_metadata_covers_the_whole_width():
    spec = _spec(["price"])
    columns = embedding_columns(spec, 256)
    assert list(columns)[0] == "0-255" and "trunk" in columns["0-255"]
    assert list(columns)[1:] == [str(i) for i in range(256, 256 + spec.scalar_width)]
    assert columns["256"].startswith("events, standardized")


def positions(columns: dict[str, str]) -> list[int]:
    """Every position the `columns` metadata names: "0-255" is a range, "256" one position."""
    out = []
    for key in columns:
        lo, _, hi = key.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def test_columns_metadata_names_every_position_of_the_written_width_once():
    rng = np.random.default_rng(0)
    for spec in (_spec(["price", "quantity"]), _spec([], visits=False)):
        for hidden in (16, 256):
            trunk = Trunk(NetConfig(spec.width, hidden, 1, 0.0))
            width = embedding_width(trunk, spec)
            assert positions(embedding_columns(spec, hidden)) == list(range(width))
            assert width == hidden + spec.scalar_width
            for entities in (500, 100_000):  # a profile: its components, then the scalars where kept
                profile = Profile.fit(rng.normal(size=(300, hidden)), entities, spec.scalar_width)
                columns = embedding_columns(spec, hidden, profile)
                assert positions(columns) == list(range(embedding_width(trunk, spec, profile)))
                assert "principal components" in next(iter(columns.values()))
                assert (len(columns) > 1) == profile.scalars
