"""Machine description written next to every benchmark result."""
from __future__ import annotations

import os
import platform

import torch


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
