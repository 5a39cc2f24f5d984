"""A store's claims.json: the verdicts ``moebench claim`` recorded on it, one per claim name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moebench.errors import StoreError
from moebench.results import reader
from moebench.results.durable import write_json_atomic
from moebench.results.store import STORE_SCHEMA_VERSION

# ``moebench claim``'s verdicts on this store, one per claim name (the report shows them in its Claims section)
CLAIMS_FILE = "claims.json"


def write_claims(path: Path, verdicts: list[dict[str, Any]]) -> None:
    """Record claim verdicts in a store's claims.json (atomically), replacing earlier ones of the same claim."""
    kept = [v for v in read_claims(path) if v.get("name") not in {x.get("name") for x in verdicts}]
    write_json_atomic(path / CLAIMS_FILE, {"schema_version": STORE_SCHEMA_VERSION, "claims": [*kept, *verdicts]})


def read_claims(path: Path) -> list[dict[str, Any]]:
    """The claim verdicts recorded in a store (none when it has no claims.json); a StoreError naming the file
    when it cannot be read."""
    try:
        data = reader.read_json(path / CLAIMS_FILE)
    except FileNotFoundError:
        return []
    claims = data.get("claims") if isinstance(data, dict) else None
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise StoreError(f"{path / CLAIMS_FILE}: expected {{\"claims\": [verdict objects]}}")
    return claims

