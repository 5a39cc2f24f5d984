"""A machine profile: the calibration factors fitted on one machine's measured runs
(:mod:`moebench.plan.calibrate`), the device they were fitted on, saved as a small JSON file.

::

    {"schema_version": 1, "kind": "moebench machine profile",
     "device": {...the Device fields...}, "cores": 2,
     "factors": {"matmul.fp32": 1.8, "all_to_all": 0.31, "attention.per_layer": 0.0021, ...},
     "fitted_on": {"stores": [...], "points": 10, "in_sample_median_abs_error": 0.06}}

``factors`` maps a term of :data:`moebench.plan.calibrate.TERMS` to its fitted value; a term
the store could not fit is absent and keeps its roofline value. ``cores`` (CPU profiles only)
is how many cores the ranks of one node share.

A CPU has no datasheet: its peak is the store's calibration matmul (the one its MFU was
measured against), and its memory and link bandwidths are priced at
:data:`CPU_TRANSFER_UNIT` (1 GB/s), a unit rather than an estimate, so a fitted transfer factor
reads as seconds per GB. CPU plans exist only through a profile.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moebench.devices import DEVICES, Device
from moebench.errors import ConfigError

PROFILE_SCHEMA_VERSION = 1
PROFILE_KIND = "moebench machine profile"
CPU_TRANSFER_UNIT = 1e9  # bytes/s: the price of a CPU's memory and link traffic (see the module docstring)


def cpu_device(peak_flops: float, model: str) -> Device:
    """A CPU as the planner sees it: the measured calibration matmul as its peak, unit bandwidths,
    no capacity limit (a store does not record the machine's memory)."""
    return Device(
        name=f"CPU {model}", bf16_flops=peak_flops, fp8_flops=None, compute_capability=(0, 0),
        hbm_bytes=math.inf, hbm_bw=CPU_TRANSFER_UNIT, intra_node_bw=CPU_TRANSFER_UNIT,
        inter_node_bw=CPU_TRANSFER_UNIT, gpus_per_node=1 << 30, cpu=True,
        source=(f"CPU: peak = the store's calibration matmul (bf16 where the CPU has it, else fp32; "
                f"{peak_flops / 1e9:.1f} GFLOP/s per rank); "
                "memory and link traffic priced at 1 GB/s (a unit: the profile's factors give the real rate)"),
    )


def time_sharing(device: Device, cores: int | None, world_size: int) -> float:
    """How many ranks share one core's time: 1 on GPUs and on CPUs with a core per rank (moebench's
    launcher gives each local rank ``cores // ranks`` threads, at least one)."""
    return max(1.0, world_size / cores) if device.cpu and cores else 1.0


@dataclass(frozen=True)
class Profile:
    device: Device
    factors: dict[str, float]
    cores: int | None = None  # CPU: cores the ranks of one node share
    fitted_on: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # where it was loaded from (not saved)

    def time_sharing(self, world_size: int) -> float:
        return time_sharing(self.device, self.cores, world_size)

    def to_dict(self) -> dict[str, Any]:
        device = asdict(self.device)
        device["hbm_bytes"] = None if math.isinf(self.device.hbm_bytes) else self.device.hbm_bytes
        return {"schema_version": PROFILE_SCHEMA_VERSION, "kind": PROFILE_KIND, "device": device,
                "cores": self.cores, "factors": dict(sorted(self.factors.items())), "fitted_on": self.fitted_on}

    def save(self, path: str | Path) -> None:
        try:
            Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot write the profile ({exc.strerror})") from None


def load_profile(path: str | Path, ranges: dict[str, tuple[float, float]]) -> Profile:
    """Read and check a profile file; anything wrong is a ConfigError naming the file and field.

    ``ranges`` maps each calibration term to the values a factor of it may take
    (:func:`moebench.plan.calibrate.term_ranges`); every factor must be a finite number inside
    its term's range, and a profile must carry at least one factor.
    """
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such profile file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read the profile ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ConfigError(f"{where}: field 'kind' must be {PROFILE_KIND!r} (a file written by "
                          "moebench plan --calibrate)")
    if data.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise ConfigError(f"{where}: field 'schema_version' is {data.get('schema_version')!r}; this moebench reads "
                          f"{PROFILE_SCHEMA_VERSION} (fit it again with moebench plan --calibrate)")
    factors = data.get("factors")
    if not isinstance(factors, dict):
        raise ConfigError(f"{where}: field 'factors' must be an object of term: value")
    if not factors:
        raise ConfigError(f"{where}: field 'factors' is empty: a profile without fitted factors calibrates "
                          "nothing (fit one with moebench plan --calibrate STORE, or plan without --profile)")
    for name, value in factors.items():
        if name not in ranges:
            raise ConfigError(f"{where}: field 'factors.{name}' is not a calibration term; known: "
                              f"{', '.join(sorted(ranges))}")
        low, high = ranges[name]
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not low <= value <= high):
            raise ConfigError(f"{where}: field 'factors.{name}' must be a finite number in [{low:g}, {high:g}], "
                              f"got {value!r}")
    fitted_on = data.get("fitted_on") or {}
    if not isinstance(fitted_on, dict):
        raise ConfigError(f"{where}: field 'fitted_on' must be an object (what the profile was fitted on)")
    cores = data.get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ConfigError(f"{where}: field 'cores' must be an integer >= 1 or null, got {cores!r}")
    return Profile(device=_device(where, data.get("device")), factors={k: float(v) for k, v in factors.items()},
                   cores=cores, fitted_on=fitted_on, path=where)


def _device(where: str, raw: Any) -> Device:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: field 'device' must be an object with the device's fields")
    if not raw.get("cpu"):
        known = next((d for d in DEVICES.values() if d.name == raw.get("name")), None)
        if known is None:
            raise ConfigError(f"{where}: field 'device.name' {raw.get('name')!r} is not a GPU in the device table")
        return known  # the table is the one home of a GPU's figures
    peak = raw.get("bf16_flops")
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not math.isfinite(peak) or peak <= 0:
        raise ConfigError(f"{where}: field 'device.bf16_flops' must be the CPU's calibrated FLOP/s (> 0), got {peak!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.startswith("CPU "):
        raise ConfigError(f"{where}: field 'device.name' must name the CPU ('CPU <model>'), got {name!r}")
    return cpu_device(float(peak), name.removeprefix("CPU "))
