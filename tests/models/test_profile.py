"""habitus.models.nn.profile: the columns the `embeddings` asset writes, fitted with the foundation."""

import numpy as np
import pytest

from habitus.models.nn.profile import MAX_COMPONENTS, Profile, profile_shape


@pytest.mark.parametrize("entities, expected", [
    (50, (4, False)),        # a handful: the fewest components, no scalars
    (772, (7, False)),       # MovieLens-100k's population: 7 columns, about 100 entities each
    (3_100, (31, False)),    # 31 columns of budget: too few for 24 scalars + 8 components
    (3_200, (8, True)),      # 32: the scalars and 8 components
    (28_610, (32, True)),    # Ta-Feng: the most components, and the scalars
    (18_000_000, (32, True)),
])
def test_the_width_follows_the_population(entities, expected):
    assert profile_shape(entities, 256, 24) == expected
    k, scalars = profile_shape(entities, 256, 24)
    assert k <= MAX_COMPONENTS and (k + 24 * scalars <= max(entities // 100, 4))


def test_a_narrow_trunk_caps_the_components():
    assert profile_shape(1_000_000, 16, 24) == (16, True)


def _trunk_output(rows=2000, hidden=24, seed=0):
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(rows, 5)) * np.array([5.0, 3.0, 2.0, 1.0, 0.5])
    return latent @ rng.normal(size=(5, hidden)) + 0.01 * rng.normal(size=(rows, hidden)) + 3.0


def test_fitted_components_are_centred_uncorrelated_and_of_unit_variance():
    h = _trunk_output()
    profile = Profile.fit(h, entities=1_000, scalar_width=24)  # 10 columns: trunk only
    assert profile.components.shape == (10, 24) and not profile.scalars
    scores = profile.apply(h, np.zeros((len(h), 24)))
    assert scores.shape == (len(h), 10)
    np.testing.assert_allclose(scores.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(np.cov(scores[:, :5].T), np.eye(5), atol=1e-3)
    # the leading components hold the variance: the latent 5 dimensions come back almost exactly
    reconstructed = scores[:, :5] @ np.linalg.pinv(profile.components[:5].T) + profile.mean
    assert np.abs(reconstructed - h).max() < 0.1


def test_the_same_rows_in_another_order_give_the_same_columns_with_the_same_signs():
    h = _trunk_output()
    first = Profile.fit(h, 1_000, 24)
    again = Profile.fit(h[np.random.default_rng(1).permutation(len(h))], 1_000, 24)
    np.testing.assert_allclose(again.components[:5], first.components[:5], atol=1e-3)
    for row in first.components:
        assert row[np.abs(row).argmax()] > 0


def test_scalars_follow_the_components_where_the_population_carries_them():
    h = _trunk_output()
    profile = Profile.fit(h, entities=50_000, scalar_width=3)
    scalars = np.arange(len(h) * 3, dtype=np.float64).reshape(-1, 3)
    out = profile.apply(h, scalars)
    assert profile.scalars and out.shape == (len(h), len(profile.components) + 3)
    np.testing.assert_array_equal(out[:, -3:], scalars)
    assert profile.width(24, 3) == out.shape[1] and profile.trunk_width(24) == len(profile.components)


def test_a_profile_survives_the_checkpoint_config_and_an_old_config_reads_the_whole_trunk():
    h = _trunk_output()
    profile = Profile.fit(h, 1_000, 24)
    import json
    back = Profile.of({"profile": json.loads(json.dumps(profile.to_dict()))})
    np.testing.assert_array_equal(back.components, profile.components)
    np.testing.assert_array_equal(back.apply(h, h[:, :0]), profile.apply(h, h[:, :0]))
    assert back.entities == 1_000 and back.scalars is False
    whole = Profile.of({})  # a checkpoint saved before the projection: the trunk and the scalars, as then
    assert whole.components is None and whole.scalars and whole.width(256, 24) == 280
    np.testing.assert_array_equal(whole.apply(h, h[:, :2]), np.concatenate([h, h[:, :2]], axis=1))


def test_directions_without_variance_are_left_out():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(500, 5)) @ rng.normal(size=(5, 24))  # rank 5, like a narrow layer-normalized trunk
    profile = Profile.fit(h, entities=100_000, scalar_width=3)
    assert profile.components.shape == (5, 24)
    np.testing.assert_allclose(profile.apply(h, h[:, :0])[:, :5].std(0, ddof=1), 1, atol=1e-6)
