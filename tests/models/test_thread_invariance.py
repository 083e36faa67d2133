"""Scores do not depend on the number of torch threads: inference in N processes of 1 thread must write
the file one process of several threads writes, bit for bit (models/serve/parts.py). A one-output head scored
as a matrix-vector product was not: the CPU BLAS splits that product's sum by thread count (AVX-512
machines: 1-ulp differences in 23 of 126,129 churn scores)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import hashlib, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from habitus.models.nn.network import Model, NetConfig
torch.manual_seed(0)
model = Model(NetConfig(40, 256, 2, 0.0), int(sys.argv[2])).eval()
x = torch.randn(5837, 40, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = model(x)
print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def _digest(threads: int, outputs: int) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), str(outputs)], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    return done.stdout.strip()


def test_one_output_scores_do_not_depend_on_threads():
    assert _digest(1, 1) == _digest(2, 1)


def test_label_scores_do_not_depend_on_threads():
    assert _digest(1, 50) == _digest(2, 50)
