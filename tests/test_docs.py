"""What the documents say against what the program does: the README's table of settings
(every setting, each with its real default), and every command line in the README,
RESULTS.md and the report (each option one its command takes)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from cachecraft.config import Config, parse_bytes

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# a row may name several settings (`a` / `b`), their defaults in the same order; a cell may
# hold an escaped bar (`\|`)
ROW = re.compile(r"^\| (?P<names>`[a-z_]+`(?: / `[a-z_]+`)*) \| (?P<default>(?:[^|\\]|\\.)*) \|")
# defaults the table writes in words, not as the value itself
IN_WORDS = {"cache_dir", "system_prompt", "question_template", "catalog_url", "redis_url", "server", "api_key",
            "early_stop_layers", "redis_budget_bytes"}
BUDGETS = {"gpu_budget_bytes", "cpu_budget_bytes", "disk_budget_bytes"}  # sizes written as "2 GiB"


def _table() -> dict[str, str]:
    """Setting name -> the default the README's table gives it."""
    start = README.read_text().index("| key | default | meaning |")
    rows: dict[str, str] = {}
    for line in README.read_text()[start:].splitlines()[2:]:
        match = ROW.match(line)
        if match is None:
            break
        names = [n.strip("`") for n in match["names"].split(" / ")]
        defaults = [d.strip().replace("\\|", "|") for d in match["default"].split(" / ")]
        for i, name in enumerate(names):
            rows[name] = defaults[min(i, len(defaults) - 1)]
    return rows


def _written(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_readme_names_every_setting_with_its_default():
    table, config = _table(), Config.load(overrides={}, environ={})
    names = {f.name for f in dataclasses.fields(Config) if not f.name.startswith("_")}
    assert names - set(table) == set(), "settings missing from the README's table"
    for name, default in table.items():
        assert name in names, f"the README names {name}, which is no setting"
        if name in IN_WORDS:
            continue
        if name in BUDGETS:
            assert parse_bytes(default.replace(" ", "")) == getattr(config, name), (name, default)
            continue
        assert default.strip("`") == _written(getattr(config, name)), (name, default)


# a command line, in a code block or in backticks: `cachecraft` and its words up to the end
# of the line, the closing backtick or the next command joined by && ; |
COMMAND = re.compile(r"(?m)(?:^|`)cachecraft ([^`\n]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _options(command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


def test_every_documented_command_line_takes_the_options_it_shows():
    import typer.main

    from cli.app import app
    root = typer.main.get_command(app)
    everywhere = _options(root) | {"--help"}
    checked, wrong = 0, []
    for name in ("README.md", "RESULTS.md", "benchmarks/report/report.md"):
        for match in COMMAND.finditer((ROOT / name).read_text()):
            line = re.split(r"&&|;|\|(?!\|)", match.group(1))[0]
            command, words = root, line.split()
            while words and words[0] in getattr(command, "commands", {}):
                command = command.commands[words.pop(0)]
            if command is root:
                continue
            known = _options(command) | everywhere
            for flag in FLAG.findall(line):
                checked += 1
                if flag not in known:
                    wrong.append(f"{name}: {command.name} {flag} ({line[:60]})")
    assert checked > 100 and wrong == [], wrong
