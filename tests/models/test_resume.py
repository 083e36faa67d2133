"""habitus.models.train.resume: a training run stopped after a save and started again ends with exactly the weights
of an uninterrupted run; a state from other inputs, or a damaged one, is not used."""

import json

import numpy as np
import pytest
import torch

from habitus.models.evaluate.holdout import protocol
from habitus.models.train.resume import Resumer
from habitus.models.data.targets import TargetSpec
from habitus.models.train.finetune import finetune
from habitus.models.train.foundation import train_foundation
from habitus.models.train.config import FinetuneConfig, FoundationConfig
from habitus.models.tasks.spec import TaskSpec

SPAN_DAYS, HORIZON = 100, 14
FOUNDATION = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=8, layers=1, epochs=2,
                              batch_size=16, learning_rate=5e-3, buckets=16, seed=3, cutoffs_per_chunk=2,
                              chunk_entities=32, min_history_days=28, dropout=0.2)  # dropout: torch RNG matters
FINETUNE = FinetuneConfig(epochs=3, learning_rate=3e-3, batch_size=16, chunk_entities=32, seed=5)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))

pytestmark = pytest.mark.usefixtures("one_thread")


class Killed(Exception):
    """Stands in for SIGKILL right after a save (tests/faults kills real processes)."""


class DiesAfter(Resumer):
    def __init__(self, *args, saves: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.die_after = saves

    def save(self, *args, **kwargs):
        super().save(*args, **kwargs)
        if self.saves == self.die_after:
            raise Killed


@pytest.fixture(scope="module")
def world(module_sources):
    rng = np.random.default_rng(1)
    customer, ts, product, price = [], [], [], []
    for i in range(120):
        k = rng.poisson(0.3 * SPAN_DAYS)
        customer += [f"c{i:03d}"] * k
        ts += [module_sources.at(d) for d in np.sort(rng.uniform(0, SPAN_DAYS * rng.uniform(0.3, 1), k))]
        product += [f"p{j}" for j in rng.integers(0, 6, k)]
        price += rng.gamma(2.0, 5.0, k).round(2).tolist()
    cache = module_sources.build(module_sources.events(module_sources.write_events("ev", customer, ts, product,
                                                                                    price)), shard_events=1500)
    return cache, module_sources.at(SPAN_DAYS - HORIZON)


def _same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def _foundation(world, resume=None):
    cache, test_cutoff = world
    return train_foundation(cache, FOUNDATION, test_cutoff - HORIZON * 86_400, device="cpu", log=lambda _: None,
                            resume=resume)


def test_foundation_resumed_after_each_kill_ends_with_the_same_weights(world, tmp_path):
    clean = _foundation(world)
    # saving on its own changes nothing
    saving = Resumer(tmp_path / "saving", "fp", every_steps=4, log=lambda _: None)
    watched = _foundation(world, saving)
    _same(clean.model.state_dict(), watched.model.state_dict())
    total_saves = saving.saves
    assert total_saves >= 4

    # killed after the 1st, 2nd, ... save and resumed each time
    folder, kills, final = tmp_path / "killed", 0, None
    for _ in range(total_saves + 1):
        try:
            final = _foundation(world, DiesAfter(folder, "fp", every_steps=4, saves=1, log=lambda _: None))
            break
        except Killed:
            kills += 1
    assert final is not None, "the run never finished"
    assert kills == total_saves  # every attempt got one save further
    _same(clean.model.state_dict(), final.model.state_dict())
    assert final.curves == clean.curves
    assert final.info["steps"] == clean.info["steps"]
    assert final.info["events_seen"] == clean.info["events_seen"]


def test_a_resumed_foundation_reads_the_rare_value_groups_it_trained_on(sources, tmp_path, monkeypatch):
    import habitus.models.train.foundation as foundation

    cache = sources.loyal_groups()  # 20 rarer products in two groups bought together: 2 shared tail buckets
    cfg = FoundationConfig(buckets=8, epochs=2, hidden=8, layers=1, ple_bins=0, min_history_days=14, batch_size=16,
                           chunk_entities=32, seed=3)

    def run(resume):
        return train_foundation(cache, cfg, sources.at(70), device="cpu", log=lambda _: None, resume=resume)

    clean = run(None)
    assert clean.info["feature_spec"]["tails"]
    folder = tmp_path / "state"
    with pytest.raises(Killed):
        run(DiesAfter(folder, "fp", every_steps=4, saves=1, log=lambda _: None))
    # the fit on another machine may group otherwise (its float sums differ): here, the groups swapped
    fit = foundation.related_tails
    monkeypatch.setattr(foundation, "related_tails", lambda *a, **k: {c: 1 - t for c, t in fit(*a, **k).items()})
    resumed = run(Resumer(folder, "fp", every_steps=4, log=lambda _: None))
    assert resumed.info["feature_spec"]["tails"] == clean.info["feature_spec"]["tails"]
    _same(clean.model.state_dict(), resumed.model.state_dict())
    # a run that does not resume (another fingerprint) fits its groups afresh
    afresh = run(Resumer(tmp_path / "other", "fp", every_steps=4, log=lambda _: None))
    assert afresh.info["feature_spec"]["tails"] != clean.info["feature_spec"]["tails"]


def test_finetune_resumed_ends_with_the_same_weights_and_best_epoch(world, tmp_path):
    cache, test_cutoff = world
    base = _foundation(world)
    plan = protocol(test_cutoff, HORIZON, 2, cache.time_range[0])

    def run(resume=None):
        return finetune(cache, base.model.state_dict(), base.info, CHURN, list(plan.train_cutoffs), plan.val_cutoff,
                        FINETUNE, device="cpu", log=lambda _: None, resume=resume)

    clean = run()
    logs = []
    with pytest.raises(Killed):
        run(DiesAfter(tmp_path / "ft", "fp", every_steps=3, saves=8, log=logs.append))
    saved = json.loads((tmp_path / "ft" / "latest" / "state.json").read_text())
    assert saved["loop"]["epoch"] >= 1  # past an epoch end: its snapshot (for the soup) must come back too
    resumed = run(Resumer(tmp_path / "ft", "fp", every_steps=3, log=logs.append))
    assert any("resuming from the state saved at step" in m for m in logs)
    _same(clean.model.state_dict(), resumed.model.state_dict())
    assert resumed.curves == clean.curves
    assert {k: resumed.info[k] for k in ("best_epoch", "soup_epochs", "rows_seen")} == \
        {k: clean.info[k] for k in ("best_epoch", "soup_epochs", "rows_seen")}


def test_state_is_safetensors_and_json_only(world, tmp_path):
    with pytest.raises(Killed):
        _foundation(world, DiesAfter(tmp_path, "fp", every_steps=3, saves=1, log=lambda _: None))
    files = sorted(p.name for p in (tmp_path / "latest").iterdir())
    assert files == ["state.json", "state.safetensors"]
    body = json.loads((tmp_path / "latest" / "state.json").read_text())
    assert body["step"] >= 3 and body["fingerprint"] == "fp"
    assert body["loop"]["epoch"] == 0 and body["loop"]["next"] >= 1
    assert not (tmp_path / "latest" / "state.safetensors").read_bytes().startswith((b"\x80", b"PK"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_state_of_other_inputs_or_tampered_is_ignored(world, tmp_path):
    with pytest.raises(Killed):
        _foundation(world, DiesAfter(tmp_path, "fp", every_steps=3, saves=1, log=lambda _: None))
    clean = _foundation(world).model.state_dict()

    logs = []
    other = _foundation(world, Resumer(tmp_path, "another-cache", every_steps=10_000, log=logs.append))
    assert any("other inputs" in m for m in logs)
    _same(clean, other.model.state_dict())

    st = tmp_path / "latest" / "state.safetensors"
    raw = bytearray(st.read_bytes())
    raw[-3] ^= 0x10
    st.write_bytes(bytes(raw))
    logs = []
    tampered = _foundation(world, Resumer(tmp_path, "fp", every_steps=10_000, log=logs.append))
    assert any("SHA-256" in m for m in logs)
    _same(clean, tampered.model.state_dict())


def test_unsupported_values_are_refused_not_pickled(tmp_path):
    r = Resumer(tmp_path, "fp", every_steps=1, log=lambda _: None)
    with pytest.raises(TypeError, match="no pickle"):
        r.save(1, {}, np.random.default_rng(0), {"oops": object()})
    with pytest.raises(ValueError):
        Resumer(tmp_path, "fp", every_steps=0)
