"""What a benchmark ran on: the header of every result file."""

from __future__ import annotations

import os
import platform
from typing import Any


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import torch

    import specdraft

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "specdraft": specdraft.__version__,
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable in a terminal)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 0.1 or v == 0 else f"{v:.3g}"
    return str(v)
