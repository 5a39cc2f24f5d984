"""Device table for the planner: peak dense FLOP/s, HBM and link bandwidths, each with its source.

All numbers are per GPU, from vendor datasheets for the SXM parts in 8-GPU HGX/DGX nodes.
Vendors quote Tensor Core FLOP/s "with sparsity"; the planner uses the dense figure
(half of it). NVLink is quoted as total bidirectional bandwidth; the planner uses one
direction (half), because a rank's send time is bounded by its outgoing link. Network
bandwidth is the NIC line rate per GPU (one NIC per GPU), in bytes/s. Capacities are the
datasheet's decimal GB; the CUDA allocator sees somewhat less (context, NCCL buffers).
Compute capabilities (SM versions) are from NVIDIA's CUDA GPU Compute Capability table
(developer.nvidia.com/cuda-gpus): they decide which quantized expert GEMMs moebench runs
natively (:mod:`moebench.plan.precision`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moebench.errors import ConfigError


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense bf16 Tensor Core FLOP/s
    fp8_flops: float  # dense fp8 Tensor Core FLOP/s (the planner uses it for block-scaled MXFP8 too)
    compute_capability: tuple[int, int]  # CUDA SM version: 9.0 Hopper, 10.x Blackwell
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # NVLink, bytes/s per GPU, one direction
    inter_node_bw: float  # NIC line rate per GPU, bytes/s, one direction
    gpus_per_node: int
    source: str


DEVICES: dict[str, Device] = {
    "h100": Device(
        name="NVIDIA H100 SXM5 80GB", bf16_flops=989.4e12, fp8_flops=1978.9e12, compute_capability=(9, 0),
        hbm_bytes=80e9, hbm_bw=3.35e12, intra_node_bw=450e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 / FP8 3,958 TFLOPS with sparsity, "
                "80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; DGX H100: one ConnectX-7 400 Gb/s NIC per GPU; "
                "compute capability 9.0"),
    ),
    "h200": Device(
        name="NVIDIA H200 SXM 141GB", bf16_flops=989.4e12, fp8_flops=1978.9e12, compute_capability=(9, 0),
        hbm_bytes=141e9, hbm_bw=4.8e12, intra_node_bw=450e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 / FP8 3,958 TFLOPS with sparsity, "
                "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; HGX H200: ConnectX-7 400 Gb/s per GPU; "
                "compute capability 9.0"),
    ),
    "b200": Device(
        name="NVIDIA B200 SXM 180GB", bf16_flops=2.25e15, fp8_flops=4.5e15, compute_capability=(10, 0),
        hbm_bytes=180e9, hbm_bw=8e12, intra_node_bw=900e9, inter_node_bw=50e9, gpus_per_node=8,
        source=("NVIDIA HGX B200 datasheet (8 GPUs): FP16/BF16 36 / FP8 72 PFLOPS with sparsity, 1.44 TB HBM3e "
                "at 64 TB/s, NVLink 5 1.8 TB/s per GPU; DGX B200: ConnectX-7 400 Gb/s per GPU; "
                "compute capability 10.0"),
    ),
    "b300": Device(
        name="NVIDIA B300 SXM 288GB", bf16_flops=2.25e15, fp8_flops=4.5e15, compute_capability=(10, 3),
        hbm_bytes=288e9, hbm_bw=8e12, intra_node_bw=900e9, inter_node_bw=100e9, gpus_per_node=8,
        source=("NVIDIA HGX B300 datasheet (8 GPUs): FP16/BF16 36 / FP8 72 PFLOPS with sparsity, 2.3 TB HBM3e "
                "(288 GB per GPU) at 8 TB/s per GPU, NVLink 5 1.8 TB/s per GPU; ConnectX-8 800 Gb/s per GPU; "
                "compute capability 10.3"),
    ),
}


def get_device(name: str) -> Device:
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]
