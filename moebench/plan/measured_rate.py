"""A matmul efficiency measured on the device instead of assumed: the dense bf16 fwd+bwd rate
``scripts/gpu_check.sh`` writes to its ``gpu_check.json`` (section ``dense``), over the datasheet
peak of the device it ran on (:mod:`moebench.devices`). ``moebench plan --matmul-efficiency-from``
plans with it on that device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moebench.devices import DEVICES, device_key
from moebench.errors import ConfigError


@dataclass(frozen=True)
class MeasuredRate:
    efficiency: float  # the measured rate over the datasheet dense bf16 peak, in (0, 1]
    gpu: str  # the device table's key (``moebench plan --gpu``)
    source: str  # what the plan's assumptions say about the figure


def read_gpu_check(path: str | Path) -> MeasuredRate:
    """The dense rate of a ``gpu_check.json``; a clear error naming the file and field otherwise."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable gpu_check.json ({exc})") from None
    if not isinstance(results, dict):
        raise ConfigError(f"{path}: not a gpu_check.json (a JSON object expected)")
    name = results.get("device")
    key = device_key(name) if isinstance(name, str) else None
    if key is None:
        raise ConfigError(f"{path}: field 'device' ({name!r}) is not a GPU in moebench's device table "
                          f"({', '.join(DEVICES)})")
    if results.get("dtype") != "bfloat16":
        raise ConfigError(f"{path}: field 'dtype' is {results.get('dtype')!r}; the planner's peak is the bf16 one")
    dense = (results.get("sections") or {}).get("dense") or {}
    tflops = (dense.get("fwd_bwd") or {}).get("tflops")
    if not isinstance(tflops, int | float) or not tflops > 0:
        why = dense.get("error") or dense.get("skipped") or f"tflops is {tflops!r}"
        raise ConfigError(f"{path}: field 'sections.dense.fwd_bwd.tflops' has no measured rate ({why})")
    device = DEVICES[key]
    share = tflops * 1e12 / device.bf16_flops
    if share > 1:
        raise ConfigError(f"{path}: field 'sections.dense.fwd_bwd.tflops' ({tflops:.0f}) exceeds the "
                          f"{device.name} dense peak ({device.bf16_flops / 1e12:.0f} TFLOP/s): the peak or "
                          "the FLOP count is wrong")
    when = results.get("started_at", "an unknown time")
    return MeasuredRate(share, key, f"measured: dense bf16 fwd+bwd {tflops:.0f} of "
                                       f"{device.bf16_flops / 1e12:.0f} TFLOP/s by scripts/gpu_check.sh on "
                                       f"{name} at {when}, {path}")
