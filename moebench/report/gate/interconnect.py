"""The interconnect's state on the two sides of a comparison: NVLinks up per GPU (the record's
``gpu_settings``: ``nvlinks_active``, ``nvlink_up``) and NCCL's settings (its ``NCCL_*`` variables,
``env_vars``). A change in either moves a multi-GPU run's speed without any change of code or config:
one GPU with a link down cost a 64-GPU job a quarter of its throughput (NCCL fell to 4 channels, no
NVLS; OLMo-core 3's campaign notes). NCCL's channel count itself is not readable from outside NCCL, so
what a record holds of it is the variables that bound it (``NCCL_MIN_NCHANNELS``, ``NCCL_MAX_NCHANNELS``,
``NCCL_NVLS_ENABLE``, ...) where they are set."""

from __future__ import annotations

from typing import Any

import pandas as pd

from moebench.metrics.nvml import links_phrase

NCCL_PREFIX = "env_vars.NCCL_"


def _states(cell: Any) -> dict[int, tuple[int, tuple[bool | None, ...] | None]]:
    """``{GPU index: (links up, each link's state or None)}`` of one record's ``gpu_settings``; GPUs that
    answered for no link (no NVLink) and records without NVML left out."""
    out: dict[int, tuple[int, tuple[bool | None, ...] | None]] = {}
    for gpu in cell if isinstance(cell, list) else []:  # a hand-edited or damaged field: what is readable
        if not isinstance(gpu, dict) or not all(isinstance(gpu.get(k), int) and not isinstance(gpu.get(k), bool)
                                                for k in ("nvlinks_active", "index")):
            continue
        links = gpu.get("nvlink_up")
        out[gpu["index"]] = (gpu["nvlinks_active"], tuple(links) if isinstance(links, list) else None)
    return out


def _side(t: pd.DataFrame) -> dict[int, set[tuple[int, tuple[bool | None, ...] | None]]]:
    """Every NVLink state a side's records saw, by GPU index."""
    seen: dict[int, set[tuple[int, tuple[bool | None, ...] | None]]] = {}
    for cell in t["gpu_settings"] if "gpu_settings" in t.columns else []:
        for index, state in _states(cell).items():
            seen.setdefault(index, set()).add(state)
    return seen


def _counts(states: set[tuple[int, Any]]) -> str:
    return "/".join(str(n) for n in sorted({n for n, _ in states}))


def _links(states: set[tuple[int, tuple[bool | None, ...] | None]], up: bool) -> set[int]:
    """The links every state of ``states`` has ``up`` (True) or down (False)."""
    known = [links for _, links in states if links is not None]
    return set.intersection(*({i for i, s in enumerate(links) if s is up} for links in known)) if known else set()


def nvlink_changes(base: pd.DataFrame, cur: pd.DataFrame) -> list[str]:
    """``NVLink links up 18 -> 17 on GPU 3 (link 5 down)``, one per GPU whose links up differ between the
    sides (several counts on one side: ``17/18``)."""
    was, now = _side(base), _side(cur)
    out = []
    for index in sorted(set(was) & set(now)):
        if {n for n, _ in was[index]} == {n for n, _ in now[index]}:
            continue
        down = sorted(_links(was[index], True) & _links(now[index], False))
        back = sorted(_links(was[index], False) & _links(now[index], True))
        which = [links_phrase(ls, word) for ls, word in ((down, "down"), (back, "up")) if ls]
        out.append(f"NVLink links up {_counts(was[index])} -> {_counts(now[index])} on GPU {index}"
                   + (f" ({'; '.join(which)})" if which else ""))
    return out


def _values(t: pd.DataFrame, col: str) -> str:
    values = t[col] if col in t.columns else pd.Series([None] * len(t), dtype=object)
    return "/".join(sorted({"unset" if v is None or v != v else str(v) for v in values}))


def nccl_changes(base: pd.DataFrame, cur: pd.DataFrame) -> list[str]:
    """``NCCL_MAX_NCHANNELS unset -> 4``, one per NCCL variable set differently on the two sides."""
    if base.empty or cur.empty:
        return []
    cols = sorted({c for t in (base, cur) for c in t.columns if c.startswith(NCCL_PREFIX)})
    pairs = [(c.removeprefix("env_vars."), _values(base, c), _values(cur, c)) for c in cols]
    return [f"{name} {was} -> {now}" for name, was, now in pairs if was != now]


def interconnect_warnings(base: pd.DataFrame, cur: pd.DataFrame, names: tuple[str, str] = ("BASELINE", "CURRENT")
                          ) -> list[str]:
    """One warning naming every NVLink and NCCL difference between the sides, as the environment's."""
    changes = nvlink_changes(base, cur) + nccl_changes(base, cur)
    if not changes:
        return []
    a, b = names
    return [f"environment changed between {a} and {b}: {'; '.join(changes)}: NCCL routes and sizes its channels "
            "by the links up and these variables, so part of any speed difference is the interconnect's, not "
            "the code's"]
