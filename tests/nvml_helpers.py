"""A fake NVML library for tests: the pynvml functions moebench calls, over scripted per-device readings."""

from __future__ import annotations

from types import SimpleNamespace


class FakeNvml:
    """The pynvml functions the sampler uses, over scripted per-device readings."""

    NVML_CLOCK_SM = 1
    nvmlMemory_v2 = 0x02000028

    def __init__(self, uuids, mem=None, clocks=None, reasons=None, energy_step_mj=1000):
        self.uuids = uuids
        self.mem = mem or {u: [1 << 30] for u in uuids}
        self.clocks = clocks or {u: [1980] for u in uuids}
        self.reasons = reasons or {u: 0 for u in uuids}
        self.energy = dict.fromkeys(uuids, 0)
        self.energy_step_mj = energy_step_mj
        self.calls = {u: 0 for u in uuids}
        self.inited = self.shutdowns = 0
        self.mem_versions = set()
        self.nvlinks: dict[str, int] = {}  # active links per device (none listed: the GPU has no NVLink)
        self.nvlink_count: dict[str, int] = {}  # links a device has (18 unless listed)
        self.nvlinks_down: dict[str, set[int]] = {}  # links down whatever their number
        self.app_clocks_supported = True

    def nvmlInit(self):
        self.inited += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "570.1"

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.uuids[i]

    def nvmlDeviceGetUUID(self, h):
        return h

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        self.mem_versions.add(version)
        seq = self.mem[h]
        i = min(self.calls[h], len(seq) - 1)
        self.calls[h] += 1
        return SimpleNamespace(used=seq[i], total=141 << 30)

    def nvmlDeviceGetClockInfo(self, h, clock):
        assert clock == self.NVML_CLOCK_SM
        seq = self.clocks[h]
        return seq[min(self.calls[h], len(seq)) - 1]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self.reasons[h]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.energy[h] += self.energy_step_mj
        return self.energy[h]

    # the settings a record keeps (gpu_settings): power limits, application clocks, NVLinks
    def nvmlSystemGetCudaDriverVersion(self):
        return 12080

    def nvmlDeviceGetPowerManagementLimit(self, h):
        return 700_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 650_000

    def nvmlDeviceGetApplicationsClock(self, h, clock):
        if not self.app_clocks_supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return {1: 1755, 2: 2619}[clock]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h not in self.nvlinks or link >= self.nvlink_count.get(h, 18):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # no NVLink, or a link number past the GPU's last
        return 0 if link in self.nvlinks_down.get(h, ()) else 1 if link < self.nvlinks[h] else 0
