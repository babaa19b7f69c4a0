"""Shared benchmark plumbing: machine description, peak memory, result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from cachecraft.config import ENV_PREFIX, Config

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """Samples RSS in a background thread while the block runs; ``peak_mb`` after."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20

    @property
    def growth_mb(self) -> float:
        """How far RSS rose above where it was when the block began."""
        return (self.peak - self.start) / 2**20


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def with_settings(command: str, config: Config) -> str:
    """``command`` preceded by the environment variables that give ``config``'s
    non-default settings, so that the line alone reproduces a result."""
    text = lambda value: str(value).lower() if isinstance(value, bool) else str(value)  # noqa: E731
    env = [f"{ENV_PREFIX}{name.upper()}={shlex.quote(text(value))}"
           for name, value in config.settings_changed().items()]
    return " ".join([*env, command])


def write_result(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write a result JSON atomically, adding date and machine."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine(), **payload}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path
