"""Fit the policy's alpha: the smallest recompute that keeps answers as good as full prefill.

Each candidate alpha runs as method ``cachecraft@alpha`` next to ``full`` on the same
requests; the chosen alpha is the one with the lowest mean recompute fraction whose
mean answer agreement (token F1 against full's answer) reaches the target. If none
does, the best agreement wins and the result says so. ``write_config_value`` stores
the choice in a flat TOML config file, keeping the keys already there.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from cachecraft.config import DEFAULT_QUESTION_TEMPLATE, ConfigError


class CalibrationError(ValueError):
    """Calibration input that cannot work (bad alphas or target); the message says which."""


@dataclass(frozen=True)
class AlphaRow:
    """How one candidate alpha did, averaged over the requests."""

    alpha: float
    recompute: float
    agreement: float
    kl: float
    ttft_s: float


@dataclass(frozen=True)
class CalibrationResult:
    """Every candidate's row, the chosen alpha and whether it reached the target."""

    rows: tuple[AlphaRow, ...]
    chosen: AlphaRow
    target: float
    reached: bool
    full_ttft_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "reached": self.reached, "policy_alpha": self.chosen.alpha,
                "full_ttft_s_median": self.full_ttft_s, "rows": [vars(r) for r in self.rows]}


def parse_alphas(text: str) -> list[float]:
    """``"0.1,0.05,0.1"`` -> ``[0.05, 0.1]`` (sorted, unique, each within [0, 1])."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise CalibrationError(f"alphas: {part!r} is not a number") from None
        values.append(value)
    return check_alphas(values)


def check_alphas(alphas: Sequence[float]) -> list[float]:
    """Sorted unique candidates; each must be within [0, 1] (a recompute fraction scale)."""
    if not alphas:
        raise CalibrationError("alphas: give at least one candidate, e.g. 0.05,0.1,0.2")
    bad = [a for a in alphas if not (math.isfinite(a) and 0.0 <= a <= 1.0)]
    if bad:
        raise CalibrationError(f"alphas must be within [0, 1], got {bad[0]:g}")
    return sorted(set(float(a) for a in alphas))


def check_target(target: float) -> float:
    """The agreement target must be within (0, 1]."""
    if not (math.isfinite(target) and 0.0 < target <= 1.0):
        raise CalibrationError(f"target must be within (0, 1], got {target:g}")
    return target


def choose_alpha(rows: Sequence[AlphaRow], target: float) -> tuple[AlphaRow, bool]:
    """The row with the lowest recompute (then lowest alpha) whose agreement reaches
    ``target``, and True; else the best agreement (then lowest recompute), and False."""
    assert rows, "no candidate to choose from"
    reaching = [r for r in rows if r.agreement >= target]
    if reaching:
        return min(reaching, key=lambda r: (r.recompute, r.alpha)), True
    return min(rows, key=lambda r: (-r.agreement, r.recompute, r.alpha)), False


def calibrate(lm, items: Sequence, alphas: Sequence[float], target: float = 0.95, *,
              system_prompt: str, question_template: str = DEFAULT_QUESTION_TEMPLATE,
              kv_dtype: torch.dtype = torch.float16, max_new_tokens: int = 32, store=None,
              on_item: Callable[[int, int], None] | None = None, warm_context: str = "",
              warm_context_tokens: int = 1024, stats_layer_step: int = 1) -> CalibrationResult:
    """Run ``full`` and ``cachecraft@alpha`` for every candidate on ``items`` and choose alpha;
    the chunk-caches are made after the system prefix and ``warm_context`` (as ``warm`` does)."""
    from cachecraft.bench.quality import run_quality
    from cachecraft.methods import MethodSpec

    alphas, target = check_alphas(alphas), check_target(target)
    specs = [MethodSpec("full")] + [MethodSpec("cachecraft", a) for a in alphas]
    result = run_quality(lm, items, specs, system_prompt=system_prompt, question_template=question_template,
                         kv_dtype=kv_dtype, max_new_tokens=max_new_tokens, on_item=on_item, store=store,
                         warm_context=warm_context, warm_context_tokens=warm_context_tokens,
                         stats_layer_step=stats_layer_step)
    methods = result["methods"]
    rows = tuple(AlphaRow(spec.ratio, m["recompute_fraction_mean"], m["agreement_f1_mean"], m["kl_mean"],
                          m["ttft_s_median"])
                 for spec in specs[1:] for m in [methods[spec.label]])
    chosen, reached = choose_alpha(rows, target)
    return CalibrationResult(rows, chosen, target, reached, methods["full"]["ttft_s_median"])


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, (str, Path)):
        return _toml_string(str(value))
    raise ConfigError(f"cannot write {key} = {value!r} to a flat config file (only str, int, float, bool)")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def write_config_value(path: str | Path, key: str, value: Any) -> Path:
    """Set ``key = value`` in the TOML config at ``path`` (created if missing), keeping
    its other keys; a ``[cachecraft]`` table stays a table. Written atomically."""
    path = Path(path).expanduser()
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    table = data.get("cachecraft") if isinstance(data.get("cachecraft"), dict) else None
    (table if table is not None else data)[key] = value
    top = {k: v for k, v in data.items() if table is None or k != "cachecraft"}
    lines = [f"{_toml_key(k)} = {_toml_value(k, v)}" for k, v in top.items()]
    if table is not None:
        lines += ["[cachecraft]"] + [f"{_toml_key(k)} = {_toml_value(k, v)}" for k, v in table.items()]
    text = "\n".join(lines) + "\n"
    try:
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".toml", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigError(f"cannot write config file {path}: {exc.strerror or exc}") from None
    return path
