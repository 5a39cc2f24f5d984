"""The device table: peak dense FLOP/s, compute capability, HBM and link bandwidths, each with its
source; and what the native quantized GEMMs need. One home for these facts: MFU
(:mod:`moebench.metrics.flops`), the planner and the precision probe
(:mod:`moebench.kernels.quantized`) all read them here. Torch-free.

All numbers are per GPU, from vendor datasheets for the SXM parts in 8-GPU HGX/DGX nodes
(GB200/GB300: the NVL72 rack's figures divided by its 72 GPUs, one NVLink domain).
Vendors quote Tensor Core FLOP/s "with sparsity"; the planner uses the dense figure
(half of it). NVLink is quoted as total bidirectional bandwidth; the planner uses one
direction (half), because a rank's send time is bounded by its outgoing link. Network
bandwidth is the NIC line rate per GPU (one NIC per GPU), in bytes/s. Capacities are the
datasheet's decimal GB; the CUDA allocator sees somewhat less (context, NCCL buffers).
Compute capabilities (SM versions) are from NVIDIA's CUDA GPU Compute Capability table
(developer.nvidia.com/cuda-gpus): they decide which quantized expert GEMMs a plan counts as native
(:data:`NATIVE_CAPABILITY`, the hardware) and whether torch's grouped kernels serve the device
(:data:`TORCH_GROUPED_CAPABILITIES`, torch's allow-list).
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.errors import ConfigError


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense bf16 Tensor Core FLOP/s
    fp8_flops: float | None  # dense fp8 Tensor Core FLOP/s (also for block-scaled MXFP8); None: no fp8 units
    compute_capability: tuple[int, int]  # CUDA SM version: 9.0 Hopper, 10.x Blackwell
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # NVLink, bytes/s per GPU, one direction
    inter_node_bw: float  # NIC line rate per GPU, bytes/s, one direction
    gpus_per_node: int  # GPUs in one NVLink domain: an HGX/DGX node of 8, an NVL72 rack of 72
    source: str
    # what ``torch.cuda.get_device_name`` contains for this part (upper case, all of them)
    names: tuple[str, ...] = ()
    # a CPU built from a store's calibration (moebench.plan.profile.cpu_device), never in the table
    cpu: bool = False


# Lowest compute capability whose tensor cores run each quantized format (fp8 rowwise: Hopper's fp8
# units; MXFP8 block scales: Blackwell's): the hardware. A plan counts a format as native from here
# up, assuming a torch build whose kernels serve the device.
NATIVE_CAPABILITY: dict[str, tuple[int, int]] = {"fp8": (9, 0), "mxfp8": (10, 0)}
# The pinned torch's allow-list for the native grouped GEMM (torch._scaled_grouped_mm), a set and not a
# minimum: torch 2.13 refuses every device but SM 9.x and 10.x at the op (its message: "compute
# capability = [9.0, 10.0]"), and its own platform flags (torch.testing._internal.common_cuda:
# PLATFORM_SUPPORTS_FP8_GROUPED_GEMM, PLATFORM_SUPPORTS_MXFP8_GROUPED_GEMM) claim MXFP8 on exactly 10.0,
# in builds with MSLK (FBGEMM GenAI). Neither names 10.3 (B300, GB300): a plan there says that the
# pinned torch may run it emulated. A run asks its own torch (the probe, moebench.kernels.quantized);
# this set only names the likely reason when the probe fails.
TORCH_VERSION_PINNED = "2.13"
TORCH_GROUPED_CAPABILITIES: dict[str, frozenset[tuple[int, int]]] = {
    "fp8": frozenset({(9, 0), (10, 0)}),
    "mxfp8": frozenset({(10, 0)}),
}
# K alignment the native kernels need, checked on the expert dims (both GEMMs' K and M are D, H, 2H):
# 16-byte fp8 rows; MXFP8 scale rows of whole 4-block (128-element) tiles.
NATIVE_ALIGN: dict[str, int] = {"fp8": 16, "mxfp8": 128}

# Most specific first: a torch device name is matched against ``names`` in this order.
DEVICES: dict[str, Device] = {
    "h100-pcie": Device(
        name="NVIDIA H100 PCIe 80GB", bf16_flops=756e12, fp8_flops=1513e12, compute_capability=(9, 0),
        hbm_bytes=80e9, hbm_bw=2.0e12, intra_node_bw=64e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H100 Tensor Core GPU datasheet (PCIe): BF16 1,513 / FP8 3,026 TFLOPS with sparsity, "
                "80 GB HBM2e at 2.0 TB/s, PCIe Gen5 128 GB/s (the NVLink bridge joins pairs only); "
                "one 400 Gb/s NIC per GPU assumed; compute capability 9.0"),
        names=("H100", "PCIE"),
    ),
    "h100-nvl": Device(
        name="NVIDIA H100 NVL 94GB", bf16_flops=835.5e12, fp8_flops=1670.5e12, compute_capability=(9, 0),
        hbm_bytes=94e9, hbm_bw=3.9e12, intra_node_bw=64e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H100 Tensor Core GPU datasheet (H100 NVL): BF16 1,671 / FP8 3,341 TFLOPS with sparsity, "
                "94 GB HBM3 at 3.9 TB/s, PCIe Gen5 128 GB/s (the NVLink bridge, 600 GB/s, joins pairs only); "
                "one 400 Gb/s NIC per GPU assumed; compute capability 9.0"),
        names=("H100", "NVL"),
    ),
    "h200-nvl": Device(
        name="NVIDIA H200 NVL 141GB", bf16_flops=835.5e12, fp8_flops=1670.5e12, compute_capability=(9, 0),
        hbm_bytes=141e9, hbm_bw=4.8e12, intra_node_bw=64e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H200 Tensor Core GPU datasheet (H200 NVL): BF16 1,671 / FP8 3,341 TFLOPS with sparsity, "
                "141 GB HBM3e at 4.8 TB/s, PCIe Gen5 128 GB/s (the NVLink bridge, 900 GB/s, joins 2 or 4 GPUs "
                "only); one 400 Gb/s NIC per GPU assumed; compute capability 9.0"),
        names=("H200", "NVL"),
    ),
    "h100": Device(
        name="NVIDIA H100 SXM5 80GB", bf16_flops=989.4e12, fp8_flops=1978.9e12, compute_capability=(9, 0),
        hbm_bytes=80e9, hbm_bw=3.35e12, intra_node_bw=450e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 / FP8 3,958 TFLOPS with sparsity, "
                "80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; DGX H100: one ConnectX-7 400 Gb/s NIC per GPU; "
                "compute capability 9.0"),
        names=("H100",),
    ),
    "h200": Device(
        name="NVIDIA H200 SXM 141GB", bf16_flops=989.4e12, fp8_flops=1978.9e12, compute_capability=(9, 0),
        hbm_bytes=141e9, hbm_bw=4.8e12, intra_node_bw=450e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 / FP8 3,958 TFLOPS with sparsity, "
                "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; HGX H200: ConnectX-7 400 Gb/s per GPU; "
                "compute capability 9.0"),
        names=("H200",),
    ),
    # before b200 / b300: torch names a GB200 "NVIDIA GB200", which contains "B200"
    "gb200": Device(
        name="NVIDIA GB200 NVL72 186GB", bf16_flops=2.5e15, fp8_flops=5e15, compute_capability=(10, 0),
        hbm_bytes=186e9, hbm_bw=8e12, intra_node_bw=900e9, inter_node_bw=50e9, gpus_per_node=72,
        source=("NVIDIA GB200 NVL72 datasheet (72 GPUs, per GPU = rack / 72): FP16/BF16 360 / FP8 720 PFLOPS "
                "with sparsity, 13.4 TB HBM3e (186 GB per GPU) at 576 TB/s (8 TB/s per GPU), NVLink 5 130 TB/s "
                "(1.8 TB/s per GPU), all 72 GPUs in one NVLink domain; DGX GB200: ConnectX-7 400 Gb/s per GPU; "
                "compute capability 10.0. Assumed: one NIC per GPU for traffic between racks"),
        names=("GB200",),
    ),
    "gb300": Device(
        name="NVIDIA GB300 NVL72 288GB", bf16_flops=2.5e15, fp8_flops=5e15, compute_capability=(10, 3),
        hbm_bytes=288e9, hbm_bw=8e12, intra_node_bw=900e9, inter_node_bw=100e9, gpus_per_node=72,
        source=("NVIDIA GB300 NVL72 datasheet (72 GPUs, per GPU = rack / 72): FP16/BF16 360 / FP8 720 PFLOPS "
                "with sparsity (the higher FP4 figure is not used), 288 GB HBM3e per GPU at 8 TB/s, NVLink 5 "
                "130 TB/s (1.8 TB/s per GPU), all 72 GPUs in one NVLink domain; ConnectX-8 800 Gb/s per GPU; "
                "compute capability 10.3. Assumed: one NIC per GPU for traffic between racks. The rack's BF16 "
                "figure gives 2.5 PFLOPS dense per GPU; HGX B300 quotes 2.25"),
        names=("GB300",),
    ),
    "b200": Device(
        name="NVIDIA B200 SXM 180GB", bf16_flops=2.25e15, fp8_flops=4.5e15, compute_capability=(10, 0),
        hbm_bytes=180e9, hbm_bw=8e12, intra_node_bw=900e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 36 / FP8 72 PFLOPS with sparsity, 1.44 TB HBM3e "
                "at 64 TB/s, NVLink 5 1.8 TB/s per GPU; DGX B200: ConnectX-7 400 Gb/s per GPU; "
                "compute capability 10.0"),
        names=("B200",),
    ),
    "b300": Device(
        name="NVIDIA B300 SXM 288GB", bf16_flops=2.25e15, fp8_flops=4.5e15, compute_capability=(10, 3),
        hbm_bytes=288e9, hbm_bw=8e12, intra_node_bw=900e9, inter_node_bw=100e9, gpus_per_node=8,
        source=("NVIDIA HGX B300 datasheet (8 GPUs): FP16/BF16 36 / FP8 72 PFLOPS with sparsity, 2.3 TB HBM3e "
                "(288 GB per GPU) at 8 TB/s per GPU, NVLink 5 1.8 TB/s per GPU; ConnectX-8 800 Gb/s per GPU; "
                "compute capability 10.3"),
        names=("B300",),
    ),
    "a100": Device(
        name="NVIDIA A100 SXM4 80GB", bf16_flops=312e12, fp8_flops=None, compute_capability=(8, 0),
        hbm_bytes=80e9, hbm_bw=2.039e12, intra_node_bw=300e9, inter_node_bw=25e9, gpus_per_node=8,
        source=("NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense (624 with sparsity), "
                "no FP8, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s; DGX A100: ConnectX-6 200 Gb/s per GPU; "
                "compute capability 8.0"),
        names=("A100",),
    ),
    "l40s": Device(
        name="NVIDIA L40S 48GB", bf16_flops=362e12, fp8_flops=733e12, compute_capability=(8, 9),
        hbm_bytes=48e9, hbm_bw=864e9, intra_node_bw=32e9, inter_node_bw=25e9, gpus_per_node=8,
        source=("NVIDIA L40S datasheet: BF16 362 / FP8 733 TFLOPS dense (733 / 1,466 with sparsity), "
                "48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16 64 GB/s, no NVLink; one 200 Gb/s NIC per GPU assumed; "
                "compute capability 8.9"),
        names=("L40S",),
    ),
}


def capability_text(capabilities: frozenset[tuple[int, int]] | tuple[int, int]) -> str:
    """``9.0`` for one compute capability, ``9.0, 10.0`` for a set (ascending)."""
    caps = sorted(capabilities) if isinstance(capabilities, frozenset) else [capabilities]
    return ", ".join(f"{major}.{minor}" for major, minor in caps)


def torch_serves(fmt: str, capability: tuple[int, int]) -> bool:
    """Whether the pinned torch's native grouped ``fmt`` GEMM is allowed on ``capability``
    (:data:`TORCH_GROUPED_CAPABILITIES`)."""
    return capability in TORCH_GROUPED_CAPABILITIES[fmt]


def device_key(device_name: str) -> str | None:
    """The table's key for a device as torch names it (``NVIDIA H100 80GB HBM3`` -> ``h100``), or None."""
    upper = device_name.upper()
    return next((key for key, d in DEVICES.items() if all(n in upper for n in d.names)), None)


def get_device(name: str) -> Device:
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]


@dataclass(frozen=True)
class LocalRanks:
    """How many ranks this machine runs as local processes: one per GPU, or one per CPU on a CPU
    run (more share cores and measure the sharing). Counted by :func:`moebench.launch.leader.local_ranks`."""

    cpus: int
    gpus: int

    def limit(self, device: str) -> tuple[int, str]:
        """(most ranks, what they run on) for ``train.device`` = ``device``, resolved as the trainer does
        (``auto``: the GPUs when there are any)."""
        on_gpu = device == "cuda" or (device == "auto" and self.gpus > 0)
        return (self.gpus, "GPUs") if on_gpu else (self.cpus, "CPUs")
