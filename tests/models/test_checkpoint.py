"""habitus.models.nn.checkpoint: weights-only folders that round-trip exactly and refuse tampering."""

import json
import struct

import pytest
import torch

from habitus.models.nn.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from habitus.models.nn.network import Model, NetConfig


def _model(seed=0, history_channels=0) -> Model:
    torch.manual_seed(seed)
    model = Model(NetConfig(in_dim=7, hidden=8, layers=2, dropout=0.0), outputs=3, history_channels=history_channels)
    model.trunk.fit_input_scale(torch.randn(32, 7) * 3 + 1, std_floor=1e-3)  # buffers must round-trip too
    return model.eval()


def test_round_trip_restores_weights_buffers_and_config(tmp_path):
    model = _model(history_channels=3)
    digest = save_checkpoint(tmp_path / "ckpt", model, {"kind": "test", "net": model.trunk.cfg.to_dict()})
    state, config = load_checkpoint(tmp_path / "ckpt")
    assert config["kind"] == "test" and config["weights_sha256"] == digest
    assert set(state) == set(model.state_dict())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)

    clone = Model(NetConfig.from_dict(config["net"]), outputs=3, history_channels=3).eval()
    clone.load_state_dict(state)
    x, h = torch.randn(5, 7), torch.randn(5, 3, 3)
    torch.testing.assert_close(clone(x, h), model(x, h), rtol=0, atol=0)


def test_folder_holds_only_safetensors_and_json(tmp_path):
    save_checkpoint(tmp_path / "ckpt", _model(), {"kind": "test"})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    raw = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    assert raw[:1] != b"\x80"  # not a pickle stream
    assert not raw.startswith(b"PK")  # not a torch.save zip archive
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])  # safetensors: a JSON header, then raw tensor bytes
    assert "trunk.in_mean" in header and header["trunk.in_mean"]["dtype"] == "F32"
    json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert not list(tmp_path.glob(".*"))  # no temporary folder left behind


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path):
    save_checkpoint(tmp_path / "ckpt", _model(seed=0), {"kind": "old"})
    second = _model(seed=1)
    save_checkpoint(tmp_path / "ckpt", second, {"kind": "new"})
    state, config = load_checkpoint(tmp_path / "ckpt")
    assert config["kind"] == "new"
    torch.testing.assert_close(state["head.linear.weight"], second.state_dict()["head.linear.weight"])


def test_tampered_weights_are_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", _model(), {"kind": "test"})
    path = tmp_path / "ckpt" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_incomplete_folder_is_refused(tmp_path, missing):
    save_checkpoint(tmp_path / "ckpt", _model(), {"kind": "test"})
    (tmp_path / "ckpt" / missing).unlink()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "does-not-exist")


class _Payload:
    """Unpickling this runs code: it creates the file named in `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _forge(folder, weights: bytes):
    """A checkpoint folder whose config.json records the SHA-256 of `weights` (an attacker controls both)."""
    import hashlib

    folder.mkdir()
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(json.dumps({"kind": "foundation",
                                                    "weights_sha256": hashlib.sha256(weights).hexdigest()}))


def test_pickle_bearing_checkpoint_is_refused_without_running_it(tmp_path):
    import pickle

    marker = tmp_path / "pwned"
    _forge(tmp_path / "pickle", pickle.dumps({"trunk.w": _Payload(marker)}))
    with pytest.raises(CheckpointError, match="not a safetensors file.*never read as pickle"):
        load_checkpoint(tmp_path / "pickle")
    assert not marker.exists()

    archive = tmp_path / "archive.pt"  # torch.save's zip format, with the payload inside
    torch.save({"trunk.w": torch.zeros(2), "x": _Payload(marker)}, archive)
    _forge(tmp_path / "torchsave", archive.read_bytes())
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_checkpoint(tmp_path / "torchsave")
    assert not marker.exists()


def test_config_that_is_not_json_is_refused(tmp_path):
    save_checkpoint(tmp_path / "ckpt", _model(), {"kind": "test"})
    (tmp_path / "ckpt" / "config.json").write_text("!!python/object:os.system ['touch x']")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path / "ckpt")


def test_no_code_loads_pickle():
    """Every torch.load passes weights_only=True; nothing imports pickle or lets numpy unpickle."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for package in ("models", "assets", "resources", "pipelines", "bench"):
        for file in sorted((root / package).rglob("*.py")):
            text = file.read_text()
            for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
                if "weights_only=True" not in m.group(1):
                    offenders.append(f"{file.name}: {m.group(0)}")
            for bad in (r"^\s*import (c?pickle|dill|joblib|shelve)\b", r"^\s*from (c?pickle|dill|joblib|shelve) import",
                        r"allow_pickle\s*=\s*True", r"\byaml\.load\((?![^)]*Loader=_UniqueKeyLoader)",
                        r"yaml\.unsafe_load", r"(?<![.\w])eval\(", r"(?<![.\w])exec\("):
                offenders += [f"{file.name}: {m.group(0).strip()}" for m in re.finditer(bad, text, re.M)]
    assert offenders == []
