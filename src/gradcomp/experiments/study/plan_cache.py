"""What a measurement of `gradcomp plan` is valid for (this machine, the versions, gradcomp's source) and the cache
of measurements keyed by it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CACHE_FORMAT = 7  # bump when a measure_* function (plan_measure.py, plan_local.py) changes what it measures


def machine_identity(device: str) -> dict[str, Any]:
    """What a cached measurement is only valid for: this processor (or GPU), the versions, the thread count."""
    import gradcomp
    from gradcomp.experiments.run.report import cpu_model

    return {
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "gradcomp": gradcomp.__version__,
        "gradcomp_source": _source_digest(),
        "threads": torch.get_num_threads(),
    }


_SOURCE_DIGEST: str | None = None


def _source_digest() -> str:
    """A digest of gradcomp's Python source: an edited compressor is a new version for the cache."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        here = Path(__file__).resolve().parent
        root = here.parents[1]  # the gradcomp package
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            if path.parent == here and (path.name == "plan.py" or path.name.startswith("plan_")):
                continue  # the planner's own code: its measuring loop is versioned by CACHE_FORMAT instead
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()[:16]
    return _SOURCE_DIGEST


class Cache:
    """JSON files under ``~/.cache/gradcomp/plan`` (or ``GRADCOMP_CACHE_DIR``/plan), one per measurement."""

    def __init__(self, directory: str | None = None, enabled: bool = True):
        base = directory or os.environ.get("GRADCOMP_CACHE_DIR") or os.path.join(Path.home(), ".cache", "gradcomp")
        self.directory = Path(base) / "plan"
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def _path(self, key: dict[str, Any]) -> Path:
        name = hashlib.sha256(json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True).encode()).hexdigest()
        return self.directory / f"{name[:32]}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored value (a hit), or None (a miss: the caller measures and ``put``s it)."""
        path = self._path(key)
        if self.enabled and path.is_file():
            try:
                stored = json.loads(path.read_text())
                if stored.get("key") == key:
                    self.hits += 1
                    return stored["value"]
            except (OSError, json.JSONDecodeError, AttributeError):
                pass  # unreadable: measured again and overwritten
        self.misses += 1
        return None

    def put(self, key: dict[str, Any], value: dict[str, Any]) -> None:
        if not self.enabled:
            return
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "value": value}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: the plan still works, uncached

    def get_or_measure(self, key: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        value = self.get(key)
        if value is None:
            value = measure()
            self.put(key, value)
        return value

