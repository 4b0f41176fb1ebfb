"""Machine description written next to every benchmark result."""
from __future__ import annotations

import os
import platform

import torch


def machine_info() -> dict:
    from verispec.bench.runner import cpu_model
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
