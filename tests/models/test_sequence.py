"""The foundation's sequence encoder: the last events as tokens (models/data/features.last_events), the
encoder (models/nn/sequence.py) inside the trunk, the masked-event objective, and a foundation model
trained with them that scores, embeds and runs in int8 and bf16 like the aggregate trunk."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from habitus.models.data.features import DAY, FeatureSpec, chunk_at, featurize, last_events
from habitus.models.nn.network import Model, NetConfig
from habitus.models.nn.quantize import for_inference
from habitus.models.nn.sequence import MaskedEvents
from habitus.models.train.config import FinetuneConfig, FoundationConfig
from habitus.models.train.finetune import finetune
from habitus.models.train.foundation import train_foundation
from habitus.models.data.targets import TargetSpec
from habitus.models.tasks.spec import TaskSpec

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 8
FOUNDATION = FoundationConfig(horizon_days=14, cutoff_every_days=7, hidden=16, layers=1, epochs=2, batch_size=16,
                              learning_rate=5e-3, buckets=32, chunk_entities=48, min_history_days=28,
                              sequence_events=LENGTH, sequence_dim=16)


@pytest.fixture(scope="module")
def cache(module_sources):
    return module_sources.churning_purchases(120, 100, seed=3, shard_events=1500)


def _spec(cache, length=LENGTH):
    return FeatureSpec.from_cache(cache, 32, sequence=length)


def test_tokens_are_the_last_events_before_the_cutoff_most_recent_first(cache):
    spec = _spec(cache)
    shard = cache.shard(0)
    cutoff = int(cache.time_range[0]) // DAY * DAY + 60 * DAY
    chunk = chunk_at(shard, 0, len(shard.entities), cutoff)
    tokens = last_events(chunk, spec)
    assert tokens.shape == (chunk.n, LENGTH, spec.event_width)
    k = len(spec.categorical)
    product = list(spec.categorical)[0]
    for row in range(chunk.n):
        pos = chunk.lo + int(np.flatnonzero(shard.entities[chunk.lo:chunk.hi] == chunk.entities[row])[0])
        lo, hi = shard.starts[pos], shard.starts[pos + 1]
        history = np.flatnonzero(shard.ts[lo:hi] <= cutoff)[::-1] + lo  # the entity's rows, newest first
        n = min(len(history), LENGTH)
        assert n >= 1
        assert (tokens[row, :n, k + len(spec.numeric)] == 1).all() and (tokens[row, n:] == 0).all()
        # (the vocabularies here are smaller than the buckets: a value's bucket is its id)
        np.testing.assert_array_equal(tokens[row, :n, 0], shard.columns[product][history[:n]] + 1)
        age = (cutoff - shard.ts[history]) / DAY
        np.testing.assert_allclose(tokens[row, :n, k + len(spec.numeric) + 1], np.log1p(age[:n]), rtol=1e-5)
        gaps = np.r_[age[1:] - age[:-1], 0.0]  # to the event before; the first event has none
        np.testing.assert_allclose(tokens[row, :n, k + len(spec.numeric) + 2], np.log1p(gaps[:n]), rtol=1e-5,
                                   atol=1e-6)


def test_no_token_reads_past_the_cutoff(cache):
    """Events after the cut-off change nothing: the tokens at a cut-off are those of the data cut there."""
    spec = _spec(cache)
    shard = cache.shard(0)
    cutoff = int(cache.time_range[0]) // DAY * DAY + 50 * DAY
    x = featurize(chunk_at(shard, 0, len(shard.entities), cutoff), spec, cache.entity_table())
    assert x.shape[1] == spec.input_width == spec.width + LENGTH * spec.event_width
    later = featurize(chunk_at(shard, 0, len(shard.entities), cutoff + 20 * DAY), spec, cache.entity_table())
    assert not np.array_equal(x[:, spec.width:], later[:len(x), spec.width:])  # (the later cut-off does see more)
    # every event after the cut-off moved further into the future, its values changed: the same inputs
    ts = np.where(shard.ts > cutoff, shard.ts + 30 * DAY, shard.ts)
    columns = {c: np.where(shard.ts > cutoff, v[::-1], v) for c, v in shard.columns.items()}
    moved = SimpleNamespace(entities=shard.entities, starts=shard.starts, ts=ts, columns=columns)
    again = featurize(chunk_at(moved, 0, len(shard.entities), cutoff), spec, cache.entity_table())
    np.testing.assert_array_equal(x, again)


def _trunk(cache, length=LENGTH):
    spec = _spec(cache, length)
    net = NetConfig(spec.width, 16, 1, 0.0, seq_len=length, seq_vocab=spec.token_vocab, seq_numeric=len(spec.numeric),
                    seq_dim=16)
    torch.manual_seed(0)
    model = Model(net, 3)
    torch.nn.init.normal_(model.trunk.sequence.out.weight, std=0.1)  # (it starts at zero: make it count)
    shard = cache.shard(0)
    early = int(cache.time_range[0]) // DAY * DAY + 20 * DAY  # (early: many entities have fewer events than LENGTH)
    x = featurize(chunk_at(shard, 0, len(shard.entities), early), spec, cache.entity_table())
    model.trunk.fit_input_scale(torch.from_numpy(x), 1.0)
    return spec, model.eval(), torch.from_numpy(x)


def test_padding_does_not_reach_the_representation(cache):
    spec, model, x = _trunk(cache)
    h = model.trunk(x)
    assert h.shape == (len(x), 16) and torch.isfinite(h).all()
    seq = x[:, spec.width:].reshape(len(x), LENGTH, spec.event_width)
    padded = seq[..., len(spec.categorical) + len(spec.numeric)] == 0
    assert padded.any(), "the test needs entities with fewer events than the sequence"
    noisy = seq.clone()
    noisy[..., 1:len(spec.categorical) + len(spec.numeric)][padded] = 123.0  # numbers of padding: anything
    other = torch.cat([x[:, :spec.width], noisy.reshape(len(x), -1)], 1)
    torch.testing.assert_close(model.trunk(other), h)
    # and the events themselves do count
    changed = seq.clone()
    changed[..., 0][~padded] = 1.0
    assert not torch.allclose(model.trunk(torch.cat([x[:, :spec.width], changed.reshape(len(x), -1)], 1)), h)


def test_an_empty_sequence_is_finite(cache):
    spec, model, x = _trunk(cache)
    empty = torch.cat([x[:2, :spec.width], torch.zeros(2, LENGTH * spec.event_width)], 1)
    assert torch.isfinite(model.trunk(empty)).all()


def test_masking_hides_the_masked_values_and_scores_them(cache):
    spec, model, x = _trunk(cache)
    torch.manual_seed(1)
    h0, _ = model.trunk.masked(x, 0.0)
    torch.testing.assert_close(h0, model.trunk(x))  # nothing masked: forward()
    events = MaskedEvents(spec.token_vocab, len(spec.numeric), 16)
    torch.manual_seed(1)
    h, states = model.trunk.masked(x, 0.5)
    t, masked, ids, numbers = states
    assert 0.3 < float(masked.float().sum() / (ids[..., 0] > 0).sum()) < 0.7
    assert not (masked & (ids[..., 0] == 0)).any()  # padding is never masked
    loss = events.loss(*states)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert model.trunk.sequence.embed[0].weight.grad.abs().sum() > 0
    # the masked events' own values are not in the input: changing them changes nothing
    torch.manual_seed(1)
    seq = x[:, spec.width:].reshape(len(x), LENGTH, spec.event_width).clone()
    seq[..., 0] = torch.where(masked, 1.0, seq[..., 0])
    h2, _ = model.trunk.masked(torch.cat([x[:, :spec.width], seq.reshape(len(x), -1)], 1), 0.5)
    torch.testing.assert_close(h2, h)


@pytest.fixture(scope="module")
def trained(cache):
    last = int(cache.time_range[1]) // DAY * DAY - 28 * DAY
    return train_foundation(cache, FOUNDATION, last, device="cpu", log=lambda _: None), last


def test_the_foundation_trains_its_encoder_and_records_it(cache, trained):
    result, _ = trained
    assert all(np.isfinite(result.curves["train_loss"]))
    spec = FeatureSpec.from_dict(result.info["feature_spec"])
    net = NetConfig.from_dict(result.info["net"])
    assert spec.sequence == net.seq_len == LENGTH and net.seq_vocab == spec.token_vocab
    assert result.model.trunk.sequence.out.weight.abs().sum() > 0  # it learned to add something
    assert not any(k.startswith("events.") for k in result.model.state_dict())  # the pretraining heads are not kept


def test_a_scenario_fine_tunes_and_scores_on_the_sequence_trunk_in_every_precision(cache, trained):
    result, last = trained
    churn = TaskSpec("binary", TargetSpec("no_event", 14, active_days=30))
    cutoffs = [last - 21 * DAY, last - 14 * DAY]
    tuned = finetune(cache, result.model.state_dict(), result.info, churn, cutoffs, last,
                     FinetuneConfig(epochs=1, batch_size=32, chunk_entities=48), device="cpu", log=lambda _: None)
    spec = FeatureSpec.from_dict(result.info["feature_spec"])
    shard = cache.shard(0)
    x = torch.from_numpy(featurize(chunk_at(shard, 0, len(shard.entities), last), spec, cache.entity_table()))
    with torch.no_grad():
        p = tuned.model.eval()(x)
        for precision, tol in (("int8", 0.1), ("bf16", 0.05)):
            q = for_inference(tuned.model, precision)(x)
            assert q.shape == p.shape and torch.isfinite(q).all()
            assert float((torch.sigmoid(q.float()) - torch.sigmoid(p)).abs().max()) < tol, precision
