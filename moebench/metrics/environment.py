"""What this machine can run: versions, devices, native precision paths, NVML and Slurm.

``moebench env`` prints it before a sweep, so nobody finds out after an hour on the cluster that
fp8 ran emulated or that NVML was missing. Every fact comes from the same code the trainer uses
(:func:`moebench.kernels.quantized.precision_impl`, the NVML loader, :func:`versions`).

:func:`run_environment` is what every run record keeps of it: the facts that decide whether two
cluster runs are comparable (communication and torch settings, versions, topology, power and clocks).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from typing import Any

from moebench.metrics.host import cpu_model, versions
from moebench.metrics.nvml import NULL_SETTINGS, gpu_settings, links_phrase, list_gpus, load_nvml
from moebench.precision_modes import BF16_MODES

# Environment variables a record keeps, by prefix: NCCL's algorithm, protocol and transport choices,
# torch's (TORCH_NCCL_*, TORCH_DISTRIBUTED_*, ...) and CUDA's (visible devices, launch blocking,
# device order) change speed without changing the config. No other variable is kept: others can
# hold credentials.
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_")
TOPOLOGY_TIMEOUT_S = 20


def env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``NCCL_*``, ``TORCH_*`` and ``CUDA_*`` variables of this process, sorted by name."""
    environ = dict(os.environ) if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith(ENV_PREFIXES)}


def gpu_topology(smi: str | None = None) -> str | None:
    """``nvidia-smi topo -m``: the GPU/NIC connection matrix (NVLink, PCIe switch, NUMA affinity);
    None where there is no nvidia-smi or it fails (no driver)."""
    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=TOPOLOGY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.rstrip() if out.returncode == 0 and out.stdout.strip() else None


def run_environment(nvml: Any = None, gpus: bool = True) -> dict[str, Any]:
    """The record fields of this process's environment: ``env_vars``, ``versions``, ``gpu_topology``,
    ``driver_version``, ``cuda_driver_version`` and ``gpu_settings`` (:mod:`moebench.record`).
    ``gpus=False`` leaves the node's GPU facts (an ``nvidia-smi`` run, NVML queries) None: a run asks
    on rank 0, whose record is the one kept, rather than every rank of a node querying the same GPUs."""
    if not gpus:
        return {"env_vars": env_vars(), "versions": versions(), "gpu_topology": None, **NULL_SETTINGS}
    return {"env_vars": env_vars(), "versions": versions(), "gpu_topology": gpu_topology(), **gpu_settings(nvml)}


def devices() -> list[dict[str, Any]]:
    """The CPU and each visible CUDA device, with how each precision's expert GEMMs would run there."""
    # torch only to list the devices: run_environment (every run record, its tests) needs none
    import torch

    from moebench.kernels.quantized import precision_impl

    out = [{"device": "cpu", "name": cpu_model(), "threads": torch.get_num_threads(),
            "precision_impl": {p: precision_impl(p, "cpu") for p in BF16_MODES}}]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        out.append({"device": f"cuda:{i}", "name": props.name, "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "precision_impl": {p: precision_impl(p, f"cuda:{i}") for p in BF16_MODES}})
    return out


def environment(nvml: Any = None) -> dict[str, Any]:
    """Versions, devices, whether NVML, Triton and Slurm are usable here, and what a run record
    would keep of this environment (:func:`run_environment`)."""
    lib = load_nvml(nvml)
    return {
        **run_environment(nvml),
        "devices": devices(),
        "nvml": {"available": lib is not None, "gpus": list_gpus(nvml) if lib is not None else []},
        "triton": importlib.util.find_spec("triton") is not None,
        "slurm": {"sbatch": shutil.which("sbatch"), "job_id": os.environ.get("SLURM_JOB_ID")},
    }


def environment_lines(env: dict[str, Any]) -> list[str]:
    """A short human-readable view of :func:`environment`."""
    v = env["versions"]
    lines = [f"moebench {v['moebench']}  python {v['python']}  torch {v['torch']}  cuda {v['cuda'] or '-'}  "
             f"nccl {v['nccl'] or '-'}  triton {v['triton'] or '-'}"]
    for d in env["devices"]:
        extra = f"  sm {d['capability']}  {d['memory_gib']} GiB" if "capability" in d else f"  {d['threads']} threads"
        impls = ", ".join(f"{p} {impl}" for p, impl in d["precision_impl"].items())
        lines.append(f"{d['device']:<8} {d['name']}{extra}  [{impls}]")
    nvml = env["nvml"]
    lines.append(f"nvml     available, {len(nvml['gpus'])} GPU(s)" if nvml["available"] else "nvml     not available")
    lines.append(f"triton   {'importable' if env['triton'] else 'not installed'}")
    slurm = env["slurm"]
    lines.append(f"slurm    {'sbatch at ' + slurm['sbatch'] if slurm['sbatch'] else 'no sbatch on PATH'}"
                 + (f", inside job {slurm['job_id']}" if slurm["job_id"] else ""))
    return lines + _comparability_lines(env)


def _links_down(states: list[bool | None] | None) -> str:
    """`` (link 5 down)``, naming the links NVML says are down; empty when none is."""
    down = [i for i, up in enumerate(states or []) if up is False]
    return f" ({links_phrase(down, 'down')})" if down else ""


def _comparability_lines(env: dict[str, Any]) -> list[str]:
    """What a run record keeps of this environment: driver, GPU settings, variables, topology."""
    if env.get("driver_version"):
        lines = [f"driver   {env['driver_version']} (CUDA {env.get('cuda_driver_version') or '-'})"]
    else:
        lines = ["driver   none seen by NVML"]
    for gpu in env.get("gpu_settings") or []:
        def show(value: Any, unit: str) -> str:
            return "-" if value is None else f"{value:g} {unit}"

        lines.append(f"gpu{gpu['index']:<5} power limit {show(gpu['power_limit_w'], 'W')} "
                     f"(enforced {show(gpu['enforced_power_limit_w'], 'W')}), application clocks "
                     f"SM {show(gpu['application_sm_clock_mhz'], 'MHz')} / memory "
                     f"{show(gpu['application_mem_clock_mhz'], 'MHz')}, "
                     f"NVLinks active {'-' if gpu['nvlinks_active'] is None else gpu['nvlinks_active']}"
                     + _links_down(gpu.get("nvlink_up")))
    variables = env.get("env_vars") or {}
    lines.append("env      " + (" ".join(f"{k}={v}" for k, v in variables.items())
                                or f"no {'/'.join(p + '*' for p in ENV_PREFIXES)} variables"))
    topology = env.get("gpu_topology")
    lines.append("topology" + ("" if topology else " no nvidia-smi topo -m"))
    lines += [f"  {line}" for line in (topology or "").splitlines()]
    return lines
