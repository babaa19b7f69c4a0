"""Shared benchmark plumbing: machine description, peak memory, result files."""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

import cachecraft
from cachecraft.config import ENV_PREFIX, Config
from cachecraft.dataset import load_items
from cachecraft.intervals import paired, verdict

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
    from cachecraft.pipeline.cost import cpu_name

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# The paths whose changes alter results (results and docs do not).
_CODE_PATHS = ("cachecraft", "cli", "integrations", "pyproject.toml")


def _source_root(source_dir: Path | None) -> Path:
    """``source_dir``, else the directory that holds the ``cachecraft`` package."""
    return Path(source_dir) if source_dir is not None else Path(cachecraft.__file__).resolve().parent.parent


def code_identity(source_dir: Path | None = None) -> dict[str, Any]:
    """Which code made a result: the package version and, from a git checkout, the
    commit and whether the code (not results or docs) differed from it; ``commit`` is
    None outside a checkout (an installed wheel)."""
    root = _source_root(source_dir)
    info: dict[str, Any] = {"version": cachecraft.__version__, "commit": None, "modified": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():  # e.g. installed into a venv inside some checkout
        return info
    commit = git("rev-parse", "HEAD")
    if commit:
        changes = git("status", "--porcelain", "--", *_CODE_PATHS)
        info.update(commit=commit, modified=bool(changes) if changes is not None else None)
    return info


_CODE_AT_START = code_identity()  # on first import: before a benchmark's run starts


def with_settings(command: str, config: Config) -> str:
    """``command`` preceded by the environment variables that give ``config``'s
    non-default settings, so that the line alone reproduces a result."""
    text = lambda value: str(value).lower() if isinstance(value, bool) else str(value)  # noqa: E731
    env = [f"{ENV_PREFIX}{name.upper()}={shlex.quote(text(value))}"
           for name, value in config.settings_changed().items()]
    return " ".join([*env, command])


def same_code(before: dict[str, Any], after: dict[str, Any], source_dir: Path | None = None) -> bool:
    """Whether two :func:`code_identity` readings name the same code: equal, or two
    commits of this checkout whose code (not results or docs) does not differ, neither
    with uncommitted code changes."""
    if before == after:
        return True
    if before.get("modified") or after.get("modified") or not before.get("commit") or not after.get("commit"):
        return False
    try:
        done = subprocess.run(["git", "-C", str(_source_root(source_dir)), "diff", "--quiet", before["commit"],
                               after["commit"], "--", *_CODE_PATHS], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def running_code() -> dict[str, Any]:
    """The :func:`code_identity` of the code this process runs: taken when the benchmarks
    were first imported, before the run, so that a commit made while a long run goes on
    is not named as the code that made its result. Where the code changed since (not
    only results or docs), ``changed_since_start`` says to what."""
    now = code_identity()
    if same_code(_CODE_AT_START, now):
        return _CODE_AT_START
    return {**_CODE_AT_START, "changed_since_start": now}


def write_result(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write a result JSON atomically, adding date, machine and the code that made it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine(), "code": running_code(), **payload}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def hit_shares(lookups: dict[str, int]) -> dict[str, Any]:
    """Chunk lookups counted by the tier that served them (``miss``: none) as shares: the
    overall hit rate and each tier's."""
    total = sum(lookups.values()) or 1
    return {"hit_rate": 1 - lookups.get("miss", 0) / total,
            "hit_rate_by_tier": {t: n / total for t, n in sorted(lookups.items()) if t != "miss"}}


def fresh_cache_dir(path: Path, models_dir: Path) -> Path:
    """An empty cache directory whose ``models`` folder links to ``models_dir``, so a node or
    server started there finds the converted model instead of converting it again."""
    path = Path(path)
    path.mkdir(parents=True)
    (path / "models").symlink_to(Path(models_dir).resolve(), target_is_directory=True)
    return path


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend (files only, no display), or
    :class:`MissingExtra` when the ``bench`` extra is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("matplotlib is not installed: pip install 'cachecraft[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def items_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a one-measurement script over dataset items: OUT, ``--model``,
    ``--dataset``, and ``--skip``/``--limit`` (the calibration items, 36 on, by default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--skip", type=int, default=36)
    parser.add_argument("--limit", type=int, default=8)
    return parser


def script_items(args: argparse.Namespace) -> tuple[Config, list]:
    """The config (``args.model``) and the items an :func:`items_parser` script runs on."""
    return Config.load(overrides={"model": args.model}), load_items(args.dataset, args.skip + args.limit)[args.skip:]


# The answer-level figures a one-measurement script pairs, and whether lower is better
ANSWER_FIGURES = (("answer_kl", True), ("token_agreement", False), ("kl", True))


def paired_figures(ours: Callable[[str], list[float]], theirs: Callable[[str], list[float]]) -> dict[str, Any]:
    """Answer KL, token agreement and first-token KL of one run paired item by item with
    another's (``ours(key)`` and ``theirs(key)``: the per-item values), each with its verdict."""
    out: dict[str, Any] = {}
    for key, lower in ANSWER_FIGURES:
        difference = paired(ours(key), theirs(key))
        out[key] = {**difference.to_dict(), "verdict": verdict(difference, lower_is_better=lower)}
    return out


def script_run() -> dict[str, Any]:
    """The running script's command line, start time and code, for its result file."""
    return {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "code": running_code()}


def write_script_result(args: argparse.Namespace, benchmark: str, **fields: Any) -> None:
    """Write an :func:`items_parser` script's OUT: its name, model, dataset, the machine,
    then ``fields``. Scripts call it after every item, so a stopped run keeps what it measured."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": benchmark, "model": args.model, "dataset": str(args.dataset),
                                    "machine": machine(), **fields}, indent=2))


def answer_means(values: Callable[[str], list[float]]) -> dict[str, float]:
    """A run's means over items (``values(key)``: its per-item values) of answer KL, token
    agreement, first-token KL and the recomputed share."""
    return {"answer_kl": statistics.fmean(values("answer_kl")),
            "token_agreement": statistics.fmean(values("token_agreement")),
            "first_token_kl": statistics.fmean(values("kl")),
            "recompute": statistics.fmean(values("recompute_fraction"))}


def summarise_runs(rows: list[dict], label_key: str, labels: Sequence[Any], baseline: Any,
                   name: Callable[[Any], str] = str, extra: Sequence[str] = ()) -> dict[str, Any]:
    """What a :func:`runs_against_full` script reports so far: per label (``name(label)``
    in the summary), the means of :func:`answer_means` and of the ``extra`` row fields; and
    each other label paired item by item with ``baseline``, with the number of items on
    which its answer KL was lower."""

    def of(label: Any, key: str) -> list[float]:
        return [r[key] for r in rows if r[label_key] == label]

    summary = {name(label): {**answer_means(lambda key: of(label, key)),
                             **{key: statistics.fmean(of(label, key)) for key in extra}} for label in labels}
    comparisons = [{label_key: label, "against": baseline,
                    "lower_on": sum(a < b for a, b in zip(of(label, "answer_kl"), of(baseline, "answer_kl"))),
                    **paired_figures(lambda key: of(label, key), lambda key: of(baseline, key))}
                   for label in labels if label != baseline]
    return {"items": len(of(baseline, "answer_kl")), "summary": summary, "paired": comparisons, "per_item": rows}


FULL_RUN = "full"  # what runs_against_full passes its set-up before full's reference answer


def runs_against_full(pipe: Any, items: Sequence[Any], method: Any, labels: Sequence[Any], label_key: str,
                      use: Callable[[Any], None], fields: Sequence[str]) -> Iterator[list[dict]]:
    """One request of ``method`` per label on each item, every answer compared with full's,
    through the one request path; yields each item's rows (``item``, ``label_key``: the
    label, then ``fields`` of the row). ``use(label)`` sets a run up before it, with
    ``use(None)`` around making the item's caches and after its runs, and
    ``use(FULL_RUN)`` before full's reference answer."""
    # here, not at the top: the result renderers import this module and need no model code
    from cachecraft.evaluation import _answer_row, item_chunks
    from cachecraft.methods import Full

    for item in items:
        chunks = item_chunks(item)
        use(None)  # the caches are made as warm makes them
        pipe.warm(chunks)
        use(FULL_RUN)
        _, reference = _answer_row(pipe, item, chunks, Full(), None, 32, None, None)
        rows = []
        for label in labels:
            use(label)
            gc.collect()
            row, _ = _answer_row(pipe, item, chunks, method, reference, 32, None, None)
            rows.append({"item": item.index, label_key: label, **{k: row[k] for k in fields}})
        use(None)
        pipe.forget(chunks)
        yield rows


def record_item(args: argparse.Namespace, benchmark: str, run: dict[str, Any], rows: list[dict],
                item_rows: list[dict], label: Callable[[dict], str], summary: Callable[[], dict[str, Any]]) -> None:
    """Add one item's rows (from :func:`runs_against_full`) to ``rows``, print its answer KL
    per run (named by ``label(row)``) and write OUT with ``summary()`` of the rows so far."""
    rows += item_rows
    print(f"item {item_rows[0]['item']}: answer KL " + ", ".join(
        f"{label(r)} {r['answer_kl']:.4f}" for r in item_rows), flush=True)
    write_script_result(args, benchmark, run=run, **summary())
