"""The trunk's piecewise-linear inputs: hand-computed encodings, fitted bin edges, old configs."""

import numpy as np
import pytest
import torch

from habitus.models.nn.network import Model, NetConfig, Trunk

pytestmark = pytest.mark.usefixtures("one_thread")


def test_piecewise_encoding_by_hand():
    trunk = Trunk(NetConfig(in_dim=3, hidden=4, ple_columns=2, ple_bins=2))
    trunk.ple_edges.copy_(torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 4.0]]))  # column 1: an empty first bin
    z = torch.tensor([[1.5, 1.0, 9.0], [-1.0, 5.0, 9.0], [0.5, 0.0, 9.0]])
    e = trunk.piecewise(z)
    # column 0: below, inside and above the bins; column 1: the empty bin is a step at 0
    assert e.tolist() == [[1.0, 0.5, 1.0, 0.25], [0.0, 0.0, 1.0, 1.0], [0.5, 0.0, 0.0, 0.0]]


def test_bin_edges_are_quantiles_of_the_standardized_inputs():
    x = torch.arange(101, dtype=torch.float32).reshape(-1, 1).repeat(1, 3)
    trunk = Trunk(NetConfig(in_dim=3, hidden=4, ple_columns=2, ple_bins=4))
    trunk.fit_input_scale(x, std_floor=1.0)
    z = ((x - trunk.in_mean) / trunk.in_std)[:, 0].numpy()
    want = np.quantile(z, [0, 0.25, 0.5, 0.75, 1.0])
    assert trunk.ple_edges.shape == (2, 5)
    np.testing.assert_allclose(trunk.ple_edges[0].numpy(), want, rtol=1e-5)
    # every training value lands somewhere in the bins: the encoding sums to its bin position
    e = trunk.piecewise((x - trunk.in_mean) / trunk.in_std).reshape(101, 2, 4)
    np.testing.assert_allclose(e[:, 0].sum(-1).numpy(), np.arange(101) / 25, rtol=1e-4)


def test_configs_saved_before_piecewise_inputs_still_build_and_load():
    old = {"in_dim": 5, "hidden": 8, "layers": 1, "dropout": 0.1}  # a checkpoint's "net" from before
    model = Model(NetConfig.from_dict(old), outputs=1)
    assert not hasattr(model.trunk, "ple")
    state = model.state_dict()
    again = Model(NetConfig.from_dict(old), outputs=1)
    again.load_state_dict(state)
    x = torch.randn(4, 5)
    model.eval(), again.eval()
    assert torch.equal(model(x), again(x))


def test_piecewise_inputs_round_trip_through_the_state_dict():
    cfg = NetConfig(in_dim=4, hidden=8, layers=1, ple_columns=2, ple_bins=3)
    model = Model(cfg, outputs=2)
    model.trunk.fit_input_scale(torch.randn(50, 4), std_floor=1.0)
    again = Model(NetConfig.from_dict(cfg.to_dict()), outputs=2)
    again.load_state_dict(model.state_dict())
    assert torch.equal(again.trunk.ple_edges, model.trunk.ple_edges)
    x = torch.randn(6, 4)
    model.eval(), again.eval()
    assert torch.equal(model(x), again(x))
