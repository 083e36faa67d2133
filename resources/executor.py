"""Where training runs: the device and the number of CPU threads, chosen per deployment."""

import dagster as dg


class TrainingExecutor(dg.ConfigurableResource):
    """`device`: auto (a GPU when one is visible), cpu, cuda or cuda:N. Training runs in the asset's
    process on that device."""

    device: str = "auto"
    threads: int | None = None

    def setup(self) -> str:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"executor device {self.device!r} was asked for but torch sees no CUDA device "
                               f"(torch {torch.__version__}); install a CUDA build of torch or use device: cpu")
        return "cuda" if self.device == "auto" and torch.cuda.is_available() else (
            "cpu" if self.device == "auto" else self.device)
