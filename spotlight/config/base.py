"""What every config section shares: a frozen pydantic model that refuses unknown keys, the error that
names a problem, and the short hash that keys caches. No project imports: everything else builds on it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config problem, named precisely (the key path and why)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)



def fingerprint(data: Any) -> str:
    """A short, stable hash of JSON-able data."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

