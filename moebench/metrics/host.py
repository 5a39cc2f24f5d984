"""Run metadata: code version, library versions and the machine a sweep ran on.

Written once per sweep into the results store's meta.json, so results stay comparable
when machines or commits change.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import moebench
from moebench.metrics.nvml import list_gpus

REPO_ROOT = Path(moebench.__file__).resolve().parents[1]


def git_info(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"commit", "dirty"}`` of the checkout moebench runs from (nulls outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """moebench, torch, CUDA, NCCL, triton and Python versions (None where absent)."""
    import torch

    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            raw = torch.cuda.nccl.version()
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except Exception:  # NCCL missing from this build: the version is simply unknown
            nccl = None
    return {
        "moebench": moebench.__version__,
        "torch": str(torch.__version__),  # a plain str: torch's TorchVersion is not a JSON/safe-pickle type
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "triton": _dist_version("triton"),
        "python": platform.python_version(),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info(nvml: Any = None) -> dict[str, Any]:
    """Hostname, CPU model and count, GPUs (via NVML), node count and Slurm job id."""
    env = os.environ
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": list_gpus(nvml),
        "nodes": int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1"))),
        "slurm_job_id": env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID"),
        "platform": platform.platform(),
        "executable": sys.executable,
    }


def run_metadata(nvml: Any = None) -> dict[str, Any]:
    return {"git": git_info(), "versions": versions(), "host": host_info(nvml)}
