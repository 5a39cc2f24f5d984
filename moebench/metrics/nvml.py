"""NVML device metrics: a background sampler for peak device memory, energy, SM clock and
clock-throttle reasons; and the settings a run is compared by (:func:`gpu_settings`: driver, power
limits, application clocks, NVLinks).

The NVML library is injectable (``nvml=``): tests drive the sampler with a fake module that
has the same functions as ``pynvml`` (nvidia-ml-py). Devices are matched by UUID because
NVML numbers GPUs by PCI order and ignores ``CUDA_VISIBLE_DEVICES``.

NVML memory is what the device reports as used (v2 memory info: CUDA context, NCCL buffers
and the caching allocator's reserve included), so it complements the torch allocator
peaks. A poller can miss peaks shorter than its interval, which is why the interval is
reported with the numbers.

Each rank samples its own GPU; :func:`device_totals` combines per-GPU summaries, so a run's
record (every rank's GPUs, gathered after training) and each node's entry read the same way.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Clock event ("throttle") reason bits, as in nvml.h. GPU idle, application-clock and display
# settings are not performance limits, so only the rest flag a run as throttled.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
THROTTLING_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80 | 0x200 | 0x400
NVML_CLOCK_SM = 1
NVML_MEMORY_V2 = 0x02000028

NULL_FIELDS: dict[str, Any] = {
    "nvml_peak_mem_used_bytes": None,
    "nvml_energy_j": None,
    "nvml_sm_clock_mhz_median": None,
    "nvml_throttle_reasons": None,
    "throttled": None,
    "nvml_interval_s": None,
    "nvml_samples": None,
    "nvml_overhead_fraction": None,
    "nvml_devices": None,
}
# the fields that describe GPUs (the rest describe the sampler): what device_totals combines
DEVICE_FIELDS = ("nvml_peak_mem_used_bytes", "nvml_energy_j", "nvml_sm_clock_mhz_median",
                 "nvml_throttle_reasons", "throttled", "nvml_devices")


def load_nvml(nvml: Any = None) -> Any | None:
    """An initialised NVML module (``pynvml`` unless one is given), or None without a driver."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: a machine without NVIDIA GPUs
        return None
    return nvml


def normalize_uuid(uuid: Any) -> str:
    """NVML says ``GPU-8c7f...``, torch says ``8c7f...``: compare them without prefix and case."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    for prefix in ("GPU-", "MIG-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text.lower()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def list_gpus(nvml: Any = None) -> list[dict[str, Any]]:
    """Every GPU NVML sees: name, UUID, driver version and memory size ([] without NVML)."""
    lib = load_nvml(nvml)
    if lib is None:
        return []
    try:
        driver = _text(lib.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(lib.nvmlDeviceGetCount()):
            h = lib.nvmlDeviceGetHandleByIndex(i)
            gpus.append({
                "name": _text(lib.nvmlDeviceGetName(h)),
                "uuid": _text(lib.nvmlDeviceGetUUID(h)),
                "driver": driver,
                "memory_total_bytes": int(lib.nvmlDeviceGetMemoryInfo(h).total),
            })
        return gpus
    finally:
        lib.nvmlShutdown()


# The GPU settings that decide whether two runs on "the same" GPU are comparable, as record fields
# (:func:`gpu_settings`); all None without NVML.
NULL_SETTINGS: dict[str, Any] = {"driver_version": None, "cuda_driver_version": None, "gpu_settings": None}
NVML_CLOCK_MEM = 2
NVML_NVLINK_MAX_LINKS = 18  # NVLink 4 (H100/H200); pynvml's own constant is used where it has one


def _or_none(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except Exception:  # NVML_ERROR_NOT_SUPPORTED / NO_PERMISSION on this GPU or driver: the fact is unknown
        return None


def _cuda_version(raw: int | None) -> str | None:
    """NVML's ``12040`` as ``12.4``: the newest CUDA the driver supports."""
    return None if raw is None else f"{raw // 1000}.{raw % 1000 // 10}"


def nvlink_states(lib: Any, handle: Any) -> list[bool | None] | None:
    """Each NVLink of the GPU, by link number: True up (NVML's state enabled), False down, None where the
    GPU does not answer for that link (it has fewer); None where it answers for none (no NVLink, PCIe only).
    One link down on one GPU cost a 64-GPU job a quarter of its throughput (OLMo-core 3's campaign notes):
    NCCL routes around it with fewer channels."""
    enabled = getattr(lib, "NVML_FEATURE_ENABLED", 1)
    states = [_or_none(lambda link=link: lib.nvmlDeviceGetNvLinkState(handle, link))
              for link in range(getattr(lib, "NVML_NVLINK_MAX_LINKS", NVML_NVLINK_MAX_LINKS))]
    if all(s is None for s in states):
        return None
    while states[-1] is None:  # the links past the GPU's last: not links it has
        states.pop()
    return [None if s is None else int(s) == enabled for s in states]


def links_phrase(links: list[int], state: str) -> str:
    """``link 5 down``, ``links 5, 9 up``: NVLinks by number, as the environment lines and ``check`` name them."""
    return f"link{'s' if len(links) > 1 else ''} {', '.join(map(str, links))} {state}"


def _nvlinks(states: list[bool | None] | None) -> dict[str, Any]:
    """``nvlinks_active`` (links up) and ``nvlink_up`` (each link's state) of a GPU's :func:`nvlink_states`."""
    return {"nvlinks_active": None if states is None else sum(s is True for s in states), "nvlink_up": states}


def gpu_settings(nvml: Any = None) -> dict[str, Any]:
    """``driver_version``, ``cuda_driver_version`` (the newest CUDA the driver supports) and
    ``gpu_settings``: every GPU NVML sees with its power limit (the configured one and the enforced
    one, W), application clocks (the clocks the GPU runs at under load unless boosted or throttled,
    MHz), active NVLinks and each link's state (:func:`nvlink_states`). A fact a GPU does not report is None;
    all None without NVML."""
    lib = load_nvml(nvml)
    if lib is None:
        return dict(NULL_SETTINGS)
    clock_sm, clock_mem = getattr(lib, "NVML_CLOCK_SM", NVML_CLOCK_SM), getattr(lib, "NVML_CLOCK_MEM", NVML_CLOCK_MEM)
    try:
        gpus = []
        for i in range(lib.nvmlDeviceGetCount()):
            h = lib.nvmlDeviceGetHandleByIndex(i)
            limit_mw = _or_none(lambda h=h: lib.nvmlDeviceGetPowerManagementLimit(h))
            enforced_mw = _or_none(lambda h=h: lib.nvmlDeviceGetEnforcedPowerLimit(h))
            gpus.append({
                "index": i,
                "uuid": _text(lib.nvmlDeviceGetUUID(h)),
                "name": _text(lib.nvmlDeviceGetName(h)),
                "power_limit_w": None if limit_mw is None else limit_mw / 1000,
                "enforced_power_limit_w": None if enforced_mw is None else enforced_mw / 1000,
                "application_sm_clock_mhz": _or_none(lambda h=h: int(lib.nvmlDeviceGetApplicationsClock(h, clock_sm))),
                "application_mem_clock_mhz": _or_none(
                    lambda h=h: int(lib.nvmlDeviceGetApplicationsClock(h, clock_mem))),
                **_nvlinks(nvlink_states(lib, h)),
            })
        return {
            "driver_version": _or_none(lambda: _text(lib.nvmlSystemGetDriverVersion())),
            "cuda_driver_version": _cuda_version(_or_none(lambda: int(lib.nvmlSystemGetCudaDriverVersion()))),
            "gpu_settings": gpus,
        }
    finally:
        lib.nvmlShutdown()


def torch_device_uuids(indices: list[int] | None = None) -> list[str]:
    """UUIDs of the CUDA devices this process uses (torch numbering, CUDA_VISIBLE_DEVICES applied)."""
    import torch

    if not torch.cuda.is_available():
        return []
    indices = list(range(torch.cuda.device_count())) if indices is None else indices
    return [str(torch.cuda.get_device_properties(i).uuid) for i in indices]


@dataclass
class _Device:
    uuid: str
    name: str
    handle: Any
    mem_used: list[int] = field(default_factory=list)
    sm_clock: list[int] = field(default_factory=list)
    reasons: int = 0
    energy_start_mj: int | None = None
    energy_end_mj: int | None = None


class NvmlSampler:
    """Polls the given devices every ``interval_s`` on a daemon thread.

    Use ``start()`` before the run, ``window_start()`` / ``window_end()`` around the timed
    steps (energy, clocks and throttle reasons cover that window; memory covers the whole
    run) and ``stop()`` for the record fields. ``sample_once()`` is the whole polling logic,
    so tests can drive it without a thread.
    """

    def __init__(self, uuids: list[str], interval_s: float = 0.1, nvml: Any = None) -> None:
        self.interval_s = interval_s
        self.nvml = load_nvml(nvml)
        self.devices: list[_Device] = []
        self.samples = 0
        self.busy_s = 0.0  # time spent inside sample_once: the sampler's cost
        self._in_window = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._started = self._stopped = 0.0
        if self.nvml is None:
            return
        # resolved once here, not on every poll; newer NVML renamed throttle reasons to clock event reasons
        self._mem_version = getattr(self.nvml, "nvmlMemory_v2", NVML_MEMORY_V2)
        self._clock_sm = getattr(self.nvml, "NVML_CLOCK_SM", NVML_CLOCK_SM)
        self._get_reasons = (getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                             or getattr(self.nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        by_uuid = {}
        for i in range(self.nvml.nvmlDeviceGetCount()):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            by_uuid[normalize_uuid(self.nvml.nvmlDeviceGetUUID(h))] = h
        for uuid in uuids:
            handle = by_uuid.get(normalize_uuid(uuid))
            if handle is None:
                raise ValueError(f"NVML sees no device with UUID {uuid}; it sees {', '.join(by_uuid) or 'none'}")
            self.devices.append(_Device(uuid, _text(self.nvml.nvmlDeviceGetName(handle)), handle))

    @classmethod
    def for_torch_device(cls, device: Any, interval_s: float = 0.1, nvml: Any = None) -> NvmlSampler:
        """A sampler for one torch device; on a CPU device a no-op whose fields are all None.

        Typical use in a trainer::

            sampler = NvmlSampler.for_torch_device(device).start()
            ...warm-up...; sampler.window_start(); ...timed steps...; sampler.window_end()
            record.update(sampler.stop())
        """
        if getattr(device, "type", str(device)) != "cuda":
            return cls([], interval_s, nvml=_Disabled())
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        return cls(torch_device_uuids([index]), interval_s, nvml=nvml)

    @property
    def available(self) -> bool:
        return self.nvml is not None and bool(self.devices)

    # ------------------------------------------------------------------ polling
    def sample_once(self) -> None:
        t0 = time.perf_counter()
        lib = self.nvml
        with self._lock:
            for d in self.devices:
                mem = lib.nvmlDeviceGetMemoryInfo(d.handle, version=self._mem_version)
                d.mem_used.append(int(mem.used))
                if self._in_window:
                    d.sm_clock.append(int(lib.nvmlDeviceGetClockInfo(d.handle, self._clock_sm)))
                    d.reasons |= int(self._get_reasons(d.handle))
            self.samples += 1
            self.busy_s += time.perf_counter() - t0

    def _energy(self) -> list[int | None]:
        out: list[int | None] = []
        for d in self.devices:
            try:
                out.append(int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(d.handle)))
            except Exception:  # NVML_ERROR_NOT_SUPPORTED before Volta: energy stays unknown
                out.append(None)
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NvmlSampler:
        self._started = time.perf_counter()
        if not self.available:
            return self
        self.sample_once()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def window_start(self) -> None:
        if not self.available:
            return
        for d, e in zip(self.devices, self._energy(), strict=True):
            d.energy_start_mj = e
        self._in_window = True
        self.sample_once()

    def window_end(self) -> None:
        if not self.available:
            return
        self.sample_once()
        self._in_window = False
        for d, e in zip(self.devices, self._energy(), strict=True):
            d.energy_end_mj = e

    def stop(self) -> dict[str, Any]:
        """Stop polling and return the record fields (all None without NVML or devices)."""
        self._stopped = time.perf_counter()
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s + 1)
        if not self.available:
            return dict(NULL_FIELDS)
        self.sample_once()
        result = self.summary()
        self.nvml.nvmlShutdown()
        return result

    def summary(self) -> dict[str, Any]:
        devices = []
        for d in self.devices:
            energy = None
            if d.energy_start_mj is not None and d.energy_end_mj is not None:
                energy = (d.energy_end_mj - d.energy_start_mj) / 1000.0
            devices.append({
                "uuid": d.uuid, "name": d.name,
                "peak_mem_used_bytes": max(d.mem_used) if d.mem_used else None,
                "energy_j": energy,
                "sm_clock_mhz_median": statistics.median(d.sm_clock) if d.sm_clock else None,
                "sm_clock_mhz_min": min(d.sm_clock) if d.sm_clock else None,
                "throttle_reasons": reason_names(d.reasons),
                "throttled": bool(d.reasons & THROTTLING_MASK),
            })
        elapsed = (self._stopped or time.perf_counter()) - self._started
        return {
            **device_totals(devices),
            "nvml_interval_s": self.interval_s,
            "nvml_samples": self.samples,
            # share of wall time spent polling; an upper bound on the cost to training, since
            # NVML calls are ctypes calls that release the GIL
            "nvml_overhead_fraction": self.busy_s / elapsed if elapsed > 0 else None,
        }


def device_totals(devices: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's NVML figures over per-GPU summaries (one sampler's, one node's or a whole
    run's): peak memory the max, energy the sum (None unless every GPU has a reading), SM clock
    the median of the GPUs' medians, throttle reasons the union; all None for no GPU."""
    if not devices:
        return {key: NULL_FIELDS[key] for key in DEVICE_FIELDS}
    peaks = [d["peak_mem_used_bytes"] for d in devices if d["peak_mem_used_bytes"] is not None]
    energies = [d["energy_j"] for d in devices]
    clocks = [d["sm_clock_mhz_median"] for d in devices if d["sm_clock_mhz_median"] is not None]
    return {
        "nvml_peak_mem_used_bytes": max(peaks) if peaks else None,
        "nvml_energy_j": None if any(e is None for e in energies) else sum(energies),
        "nvml_sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
        "nvml_throttle_reasons": sorted({r for d in devices for r in d["throttle_reasons"]}),
        "throttled": any(d["throttled"] for d in devices),
        "nvml_devices": devices,
    }


class _Disabled:
    """Stands in for NVML where there is nothing to sample (CPU runs)."""

    def nvmlInit(self) -> None:
        raise RuntimeError("NVML sampling disabled for a CPU device")


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]
