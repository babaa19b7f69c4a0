"""Shared pieces of the ``cachecraft`` command: consoles, config loading, error handling."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape

# The methods as --help lists them; the same words as cachecraft.methods.methods_help()
# (a test keeps them equal), written out so that --help needs no torch import.
METHODS_HELP = ("full: prefill everything; prefix: exact prefix reuse of earlier requests (vLLM-style); reuse: "
                "chunk-caches concatenated, only the question computed; cacheblend: reuse plus CacheBlend's "
                "deviation check at a fixed ratio; cachecraft: the policy: per-chunk variant and recompute from "
                "attention statistics; qguided (experimental): the tokens the question looks at most, at a fixed "
                "ratio; inter (experimental): the tokens with the highest stored inter-attention; firstk "
                "(experimental): the first tokens of every chunk (EPIC-like); spread (experimental): tokens "
                "spread evenly over every chunk; the others move by the drift those show")


from cachecraft.config import Config, ConfigError

FEW_ITEMS = 10  # below this many items, paired intervals are called rough (a bootstrap over 2 is their range)
CONTEXT = {"help_option_names": ["-h", "--help"]}


def _flags_without_types() -> None:
    """Typer's rich help prints a type after every option, ``<bool>`` after a flag too
    (``--json <bool>``), which reads as if the flag took a value; flags show none."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_without_types", False):
        return  # an older typer shows no types in its help: nothing to hide

    def display_type_rich(self, ctx):
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich.flags_without_types = True
    TyperOption.display_type_rich = display_type_rich


_flags_without_types()
# Messages are not hard-wrapped: a line naming a long path stays one line for scripts that
# read it (the terminal still wraps it on screen); tables keep the console's width.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


class UserError(Exception):
    """An error the user can fix; shown as one line."""


def progress_bar():
    """A transient progress bar on stderr (stdout stays clean for answers and JSON); plain
    lines where stderr is not a terminal, so a log shows the work move."""
    from cachecraft.progress import bar

    return bar(err_console)


def working(text: str):
    """A spinner on stderr saying ``text`` while a long step runs (its ``update`` changes
    the text); plain lines where stderr is not a terminal."""
    from cachecraft.progress import spinner

    return spinner(err_console, text)


def _user_errors() -> tuple[type[BaseException], ...]:
    from cachecraft.bench.common import MissingExtra
    from cachecraft.dataset import DatasetError
    from cachecraft.engine import PromptError
    from cachecraft.methods import UnknownMethod
    from cachecraft.model.adapter import UnsupportedArchitecture
    from cachecraft.model.loader import ModelLoadError
    from cachecraft.catalog import CatalogError
    from cachecraft.prompt import PromptInputError
    from cachecraft.retrieval.documents import DocumentError
    from cachecraft.retrieval.embed import EmbedderError
    from cachecraft.retrieval.snapshot import CorpusError
    from cachecraft.store import StoreError
    return (UserError, ConfigError, DatasetError, PromptError, UnknownMethod, UnsupportedArchitecture,
            ModelLoadError, PromptInputError, StoreError, CatalogError, DocumentError, CorpusError,
            EmbedderError, MissingExtra, FileNotFoundError, PermissionError)


def friendly(func: Callable) -> Callable:
    """Turn known user errors into one line on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except _user_errors() as exc:
            err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # read at import, so the processes a command starts (bench cluster's nodes) load models
    # without transformers' bars too
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # a damaged PDF is reported as ingest's own one line; pypdf's warnings about it add nothing
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


@contextlib.contextmanager
def shared_tier_failures_reported_here():
    """Silence the shared tier's own warning that it failed, for a command whose result
    (an eviction's report) says so itself, as its one error line."""
    logger = logging.getLogger("cachecraft.store.shared")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_config(ctx: typer.Context, **overrides: Any) -> Config:
    """The effective config for this invocation."""
    obj = ctx.obj or {}
    merged = {**obj.get("overrides", {}), **overrides}
    config = Config.load(obj.get("config_path"), overrides=merged)
    _usable_cache_dir(config.cache_dir)
    return config


def _usable_cache_dir(path: Path) -> None:
    """Refuse a cache directory that is a file, or lies under one, before any command reads
    it (as an empty cache) or writes it."""
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                where = "is a file" if place == path else f"lies under {place}, a file"
                raise UserError(f"the cache directory {path} {where}, not a directory; set cache_dir elsewhere")
            return


def invocation(ctx: typer.Context, command: str) -> str:
    """The command line that ran ``cachecraft COMMAND`` (e.g. ``bench quality``), for a
    result file: its arguments, preceded by the settings (config file, environment, global
    options) that differ from the defaults or were given."""
    from cachecraft.bench.common import with_settings

    args = sys.argv[1:]
    name = command.split()[-1]
    rest = args[args.index(name) + 1:] if name in args else []
    return with_settings(" ".join([f"cachecraft {command}", *map(shlex.quote, rest)]), load_config(ctx))


def nonempty_path(value: str | Path) -> Path:
    """A path given on the command line; an empty one is refused: converted as it is, it
    would name the current directory, so `forget "$UNSET"` would forget every file
    ingested from here."""
    if not str(value).strip():
        raise typer.BadParameter("an empty path names nothing (an unset shell variable?)")
    return Path(value)


def ensure_dir(path: Path) -> Path:
    """Create ``path`` (and parents) or fail with a user error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the cache directory {path}: {exc.strerror}") from None
    return path


def load_model_quietly(config: Config, name: str | None = None):
    """Load the configured (or named) model behind a spinner."""
    from cachecraft.model.loader import load_model
    with working(f"loading model {name or config.model} ..."):
        return load_model(name, config)


def summarize_commands(*apps: typer.Typer) -> None:
    """Prepare every command's ``--help`` from its docstring: without a ``short_help``, the
    first sentence on one line, for the command lists (which otherwise keep the docstring's
    line breaks); without a ``help``, the docstring :func:`reflow`-ed."""
    import inspect

    for typer_app in apps:
        for info in typer_app.registered_commands:
            doc = inspect.getdoc(info.callback) if info.callback else None
            if not doc:
                continue
            if info.short_help is None:
                paragraph = " ".join(doc.split("\n\n")[0].split())
                # the first sentence: up to the first ". " that does not end an abbreviation
                shielded = paragraph.replace("e.g. ", "e.g.\0").replace("i.e. ", "i.e.\0")
                sentence = shielded.split(". ")[0].rstrip(".").replace("\0", " ")
                info.short_help = sentence + "."
            if info.help is None:
                info.help = reflow(doc)


def reflow(doc: str) -> str:
    """A docstring as ``--help`` should show it: every paragraph after the first on one line
    (rich wraps it to the terminal; typer keeps the docstring's own breaks there, which
    break lines twice in an 80-column terminal), except example paragraphs (starting with
    ``Example``) and indented blocks, whose lines are kept as written."""
    paragraphs = doc.split("\n\n")
    kept = [p if p.lstrip().startswith("Example") or any(line.startswith(" ") for line in p.splitlines())
            else " ".join(p.split()) for p in paragraphs]
    return "\n\n".join(kept)
