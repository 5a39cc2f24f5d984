"""Which model features each expert backend computes, and the backend ``moe.backend=auto`` resolves to."""

from __future__ import annotations

from collections.abc import Collection

from moebench.errors import ConfigError

# The model features an expert backend may or may not compute, by the config field that turns each
# on (quantized experts: precision.mode fp8 or mxfp8). Router bias, group-limited routing, routed
# scaling and the shared expert run in the router and the MoE block, outside every backend today;
# they are listed so that a backend that fuses them in has to say whether it computes them.
MOE_FEATURES: dict[str, str] = {
    "moe.swiglu_limit": "clamped SwiGLU",
    "moe.router_bias": "router bias",
    "moe.expert_groups": "group-limited routing",
    "moe.routed_scaling": "routed scaling",
    "moe.shared_expert_hidden": "shared expert",
    "precision.mode": "quantized experts (fp8, mxfp8)",
}

# What each expert backend computes, on every device (moebench.kernels.expert_backends has the
# backends). Every backend computes every feature today; a backend added without one lists what it
# computes here, and the model then refuses it for a config that uses the rest.
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "loop": frozenset(MOE_FEATURES),
    "grouped_mm": frozenset(MOE_FEATURES),
    "triton": frozenset(MOE_FEATURES),
    "cpu_fused": frozenset(MOE_FEATURES),
}


def check_backend_features(backend: str, features: Collection[str]) -> None:
    """ConfigError, naming what would work, when expert backend ``backend`` (a ``moe.backend``)
    does not compute every one of ``features`` (names of :data:`MOE_FEATURES`); ``auto`` always can."""
    if backend == "auto" or backend not in BACKEND_FEATURES:  # an unknown name is the backend lookup's error
        return
    missing = sorted(set(features) - BACKEND_FEATURES[backend])
    if missing:
        able = ["auto", *(name for name, has in BACKEND_FEATURES.items() if set(features) <= has)]
        what = ", ".join(f"{MOE_FEATURES[f]} ({f})" for f in missing)
        raise ConfigError(f"moe.backend={backend} does not compute {what}: use moe.backend={' or '.join(able)}")


def resolve_backend(backend: str, device_type: str, features: Collection[str] = ()) -> str:
    """``auto`` is ``cpu_fused`` on CPU (at the layer benchmark shape 0.96-1.02 of the dense fp32
    matmul rate, against 0.73-0.83 for ``grouped_mm``) and ``grouped_mm`` on a GPU (device
    offsets, no host sync); on CPU it is ``grouped_mm`` too when the model uses a feature
    ``cpu_fused`` does not compute (:data:`BACKEND_FEATURES`); any other name as set."""
    if backend != "auto":
        return backend
    fused = device_type == "cpu" and set(features) <= BACKEND_FEATURES["cpu_fused"]
    return "cpu_fused" if fused else "grouped_mm"

