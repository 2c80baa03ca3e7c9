"""Where and when a benchmark ran: CPU/GPU, core count, load, library versions, date."""

from __future__ import annotations

import datetime
import os
import platform


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """A JSON-able description of this machine, taken now (call it before the run, so the
    load average shows work by other processes rather than by the benchmark)."""
    info = {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    if hasattr(os, "getloadavg"):
        info["loadavg_1m_at_start"] = round(os.getloadavg()[0], 2)
    try:
        import torch
    except ImportError:  # `bench serve` and `bench report` do not need torch
        return info
    info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count()}
    return info


def machine_summary(info: dict) -> str:
    """One line for tables and reports, e.g. 'NVIDIA H200 / AMD EPYC (16 cores), 2026-11-29'."""
    device = f"{info['gpu']} / " if info.get("gpu") else ""
    date = str(info.get("date", ""))[:10]
    return f"{device}{info.get('cpu', '?')} ({info.get('cores', '?')} cores), {date}"
