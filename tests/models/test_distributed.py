"""Two CPU processes under torchrun (gloo) train the same model as one process: each rank takes
its share of the cache's entity chunks (habitus.models.train.distributed.shard), DDP averages the gradients, and
the weights after training match the single process's, which sees both ranks' chunks in one batch
at every step. Only rank 0 writes.

This file is also the script torchrun runs: `python -m torch.distributed.run --nproc_per_node 2
tests/models/test_distributed.py --cache C --out O`.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 16  # entities per chunk: 64 entities make 4 chunks, 2 steps of 2 chunks
CUTOFF_DAY = 40


def _events(sources):
    rng = np.random.default_rng(0)
    customer, ts, product, price = [], [], [], []
    for i in range(64):  # every customer buys in the first days, so every chunk is full at the cut-off
        days = np.sort(np.r_[rng.uniform(0, 3), rng.uniform(0, 60, rng.integers(3, 12))])
        customer += [f"c{i:03d}"] * len(days)
        ts += [sources.at(float(d)) for d in days]
        product += [f"p{j}" for j in rng.integers(0, 6, len(days))]
        price += rng.gamma(2.0, 5.0, len(days)).round(2).tolist()
    return customer, ts, product, price


def train(cache_path: str, dist, epochs: int = 2, extra_chunk: bool = False, sequence: int = 0) -> dict[str, torch.Tensor]:
    """A minimal foundation loop over the library's features and targets. Distributed: each rank
    trains on shard(plan) with DDP. Single (dist.world == 1): the chunks of both ranks' step j
    together, one batch, which is what DDP's gradient average amounts to. `sequence`: the trunk
    also reads the last events through the sequence encoder."""
    from habitus.models.cache import Cache
    from habitus.models.train.distributed import mean_over_ranks, shard, uneven, unwrap, wrap
    from habitus.models.data.features import DAY, FeatureSpec, chunk_at, featurize
    from habitus.models.nn.network import Model, NetConfig
    from habitus.models.data.targets import foundation_target
    from habitus.models.train.foundation import foundation_loss
    from habitus.models.train.loop import chunk_plan

    cache = Cache(cache_path)
    spec = FeatureSpec.from_cache(cache, buckets=8, sequence=sequence)
    cutoff = int(cache.time_range[0]) // DAY * DAY + CUTOFF_DAY * DAY
    table = cache.entity_table()
    plan = chunk_plan(cache, CHUNK)
    assert len(plan) == 4, plan

    def data(chunks):
        parts = [chunk_at(cache.shard(s), lo, hi, cutoff) for s, lo, hi in chunks]
        return (torch.from_numpy(np.concatenate([featurize(c, spec, table) for c in parts])),
                torch.from_numpy(np.concatenate([foundation_target(c, 14, spec)
                                                 for c in parts])))

    torch.manual_seed(0)
    x_all, y_all = data(plan)
    model = Model(NetConfig(spec.width, 16, 1, dropout=0.0, seq_len=sequence, seq_vocab=spec.token_vocab,
                            seq_numeric=len(spec.numeric), seq_dim=8), y_all.shape[1])
    if sequence:  # (its output layer starts at zero: give it weight, so its gradients average too)
        torch.nn.init.normal_(model.trunk.sequence.out.weight, std=0.1)
    model.trunk.fit_input_scale(x_all, 1.0)
    net = wrap(model, dist)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    steps = [[c] for c in shard(plan, dist)] if dist.enabled else [plan[j:j + 2] for j in range(0, len(plan), 2)]
    if extra_chunk and dist.is_writer:  # rank 0 gets one chunk more than rank 1: uneven inputs
        steps.append([plan[0]])
    losses = []
    with uneven(net):
        for _ in range(epochs):
            for chunks in steps:
                x, y = data(chunks)
                loss = foundation_loss(net(x), y, len(spec.categorical))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    last = mean_over_ranks(losses[-1] if losses else float("nan"), dist)
    state = {k: v.detach().clone() for k, v in unwrap(net).state_dict().items()}
    state["last_loss"] = torch.tensor([last])
    return state


def main() -> None:
    from safetensors.torch import save_file

    from habitus.models.train.distributed import close, from_env

    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sequence", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist = from_env("cpu")
    even = train(args.cache, dist, sequence=args.sequence)
    uneven_run = train(args.cache, dist, epochs=1, extra_chunk=True, sequence=args.sequence)
    if dist.is_writer:  # rank 0 alone writes (the test checks that nothing else appears)
        save_file(even, os.path.join(args.out, "even.safetensors"))
        save_file(uneven_run, os.path.join(args.out, "uneven.safetensors"))
        Path(args.out, "world").write_text(f"{dist.world} {dist.rank}")
    close(dist)


@pytest.mark.slow
@pytest.mark.parametrize("sequence", [0, 4], ids=["aggregate trunk", "with the sequence encoder"])
def test_two_gloo_processes_train_like_one(sources, tmp_path, sequence):
    from safetensors.torch import load_file

    from habitus.models.train.distributed import Dist

    customer, ts, product, price = _events(sources)
    cache = sources.build(sources.events(sources.write_events("purchases", customer, ts, product, price)))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          __file__, "--cache", str(cache.path), "--out", str(out), "--sequence", str(sequence)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "world").read_text() == "2 0"
    assert sorted(p.name for p in out.iterdir()) == ["even.safetensors", "uneven.safetensors", "world"]

    torch.set_num_threads(1)
    single = train(str(cache.path), Dist(), sequence=sequence)
    ddp = load_file(str(out / "even.safetensors"))
    assert set(ddp) == set(single)
    start = train(str(cache.path), Dist(), epochs=0, sequence=sequence)
    moved = max(float((single[k] - start[k]).abs().max()) for k in single if k != "last_loss")
    assert moved > 1e-2  # training changed the weights, so agreeing below means something
    for k in single:
        assert torch.allclose(ddp[k], single[k], atol=1e-5, rtol=1e-4), (k, float((ddp[k] - single[k]).abs().max()))
    # uneven shares (3 chunks against 2) finish on both ranks instead of hanging, and still learn
    assert torch.isfinite(load_file(str(out / "uneven.safetensors"))["last_loss"]).all()


if __name__ == "__main__":
    main()
