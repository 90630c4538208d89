"""The host the benchmarks ran on: cores, CPU, memory, versions, load, huge-page mode."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

from bench.settings import GIB
from fsdpcheck.children.launch import usable_cores  # torch-free


def meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    total = meminfo("MemTotal")
    return {
        "cores": usable_cores(),
        "cpu": cpu_model(),
        "memory_gib": round(total / GIB, 1) if total else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "fsdpcheck": version("fsdpcheck"),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (the bracketed word), or "unknown"."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"
