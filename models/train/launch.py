"""What torchrun runs in every process when training takes several: `python -m habitus.models.train.launch JOB_DIR`.

The asset writes JOB_DIR/job.json (habitus.models.train.recipe.foundation_job / scenario_job: the cache
version, the configs, the cut-offs, the device, the precision, where to save resumable state) and starts
torchrun (habitus.resources.training.executor.TrainingExecutor.train). Every rank joins the process group
(habitus.models.train.distributed.from_env) and trains its share of the entity chunks through
`run_training`, the entry a single process runs too; rank 0 alone writes the result, JOB_DIR/result: a
checkpoint (habitus.models.nn.checkpoint.save_checkpoint, written under a temporary name and renamed)
holding the weights, the loss curves and the training info. `read_result` turns it back into the
TrainResult that training in the asset's own process returns, so the asset goes on exactly as after
that (its checkpoint, metadata and checks).

A rank that fails writes its traceback to JOB_DIR/error-<rank>.txt, which the asset's failure
quotes (`rank_errors`). A job with "resume" saves its step state there (rank 0, every N steps): a
torchrun restarted (`--max-restarts`, or the asset run again) continues from it with the same number
of processes.
"""
import json
import os
import sys
import traceback
from pathlib import Path

from habitus.models.data.features import FeatureSpec
from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.nn.network import Model, NetConfig
from habitus.models.tasks.scoring import build_model
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.distributed import close, from_env, weights_gap
from habitus.models.train.loop import TrainResult
from habitus.models.train.recipe import run_training, writes

JOB = "job.json"
RESULT = "result"


def child_env(extra: dict | None = None) -> dict:
    """The environment of a process this one starts to run `models/` (torchrun's ranks, the scoring
    processes of models/serve/parts.py): this one's, with the repository and every folder on sys.path
    outside the interpreter's own on PYTHONPATH, so the child imports what this process can (a
    scenario's target function, say); `extra` on top. Site folders stay out: the child's interpreter
    adds its own, and one put ahead of them (a virtual environment layered over another's packages)
    would load the other installation's import hooks first."""
    root = str(Path(__file__).resolve().parents[2])  # the repository, not models/
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path
             if not str(Path(p or ".").resolve()).startswith((sys.prefix, sys.base_prefix))
             and Path(p or ".").name not in ("site-packages", "dist-packages")]  # (the child's site finds its own)
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([root, *paths, *filter(None, [env.get("PYTHONPATH")])]))
    return env


def write_job(job_dir, job: dict) -> None:
    Path(job_dir, JOB).write_text(json.dumps(job, indent=2))


def run(job_dir) -> None:
    """One rank of the launch: join, train, check that the ranks agree, rank 0 writes the result."""
    job_dir = Path(job_dir)
    rank = os.environ.get("RANK", "0")
    try:
        job = json.loads((job_dir / JOB).read_text())
        dist = from_env(job["device"])
        result, spec = run_training(job, dist, _say)
        gap = weights_gap(result.model, dist)  # lockstep keeps the ranks' weights equal: 0.0
        result.info["weights_gap"] = gap
        if writes(job, dist):
            if gap > 0:
                _say(f"warning: the ranks' weights differ by up to {gap:.3g} after training; rank 0's are kept")
            save_checkpoint(job_dir / RESULT, result.model, {
                "kind": job["kind"], "net": result.model.trunk.cfg.to_dict(), "feature_spec": spec,
                "curves": result.curves, "info": result.info,
                "task": job["scenario"]["task"] if job["kind"] == "scenario" else None})
        close(dist)
    except BaseException:
        (job_dir / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def read_result(job_dir, device: str = "cpu") -> TrainResult:
    """Rank 0's result as the TrainResult of a training in this process (the model on `device`)."""
    state, cfg = load_checkpoint(Path(job_dir) / RESULT)
    net = NetConfig.from_dict(cfg["net"])
    if cfg["kind"] == "foundation":
        model = Model(net, cfg["info"]["targets_width"])
    else:
        model = build_model(net, TaskSpec.from_dict(cfg["task"]), FeatureSpec.from_dict(cfg["feature_spec"]))
    model.load_state_dict(state)
    model.to(device).eval()
    return TrainResult(model, cfg["curves"], cfg["info"])


def rank_errors(job_dir) -> str:
    """The tracebacks the failed ranks left, rank by rank."""
    return "\n".join(f"rank {p.stem.removeprefix('error-')}:\n{p.read_text().rstrip()}"
                     for p in sorted(Path(job_dir).glob("error-*.txt")))


def _say(line: str) -> None:
    # one write per line: the ranks share torchrun's stdout, and two writes could interleave
    sys.stdout.buffer.write((line + "\n").encode())
    sys.stdout.flush()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m torch.distributed.run --nproc_per_node N -m habitus.models.train.launch JOB_DIR")
    run(sys.argv[1])
    # done, the result written, every rank past the barrier: leave without the interpreter's teardown,
    # where a gloo thread still joinable at C++ static destruction aborts the rank ("terminate called
    # without an active exception", SIGABRT) and torchrun reports a run that succeeded as failed
    # (CI, twice, with the barrier in place)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
