"""MkDocs hook: the parts of the site that restate the code are written from it at build time, so they cannot
drift from it.

- ``<!-- generated: options -->``: every ``FT_PLUGINS*`` variable, and each feature's ``Option`` declarations;
- ``<!-- generated: versions -->``: the supported versions (``ft_plugins.vendors.versions``);
- ``reference/cli.md``, kept in the repository so that it reads anywhere: the help of every ``ft-plugins``
  command, from its argparse parser; ``python docs/hooks/reference.py`` rewrites it, and the suite fails while it
  differs from the code;
- ``index.md``, ``changelog.md``, ``architecture.md``, ``patch-recipes.md``: the repository's README, CHANGELOG,
  ARCHITECTURE and ``patches/README.md``, their links rewritten for the site, so each text is kept in one place.
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any, Iterator

from ft_plugins import faults
from ft_plugins.cli import build_parser
from ft_plugins.config import (EVENTS_JOB_VAR, EVENTS_VAR, GRACE_MAX, GRACE_MAX_VAR, INJECT_VAR, LOG_LEVELS, LOG_VAR,
                               PREFIX, SELECT_VAR, STRICT_VAR)
from ft_plugins.features import FEATURES
from ft_plugins.vendors import versions

ROOT = Path(__file__).resolve().parents[2]
CLI_PAGE = "reference/cli.md"
HELP_WIDTH = 100  # the terminal's width would make the page depend on where it is built
# site page -> repository file it shows; a link to one of these files is rewritten to its page
MIRRORED = {"index.md": "README.md", "changelog.md": "CHANGELOG.md", "architecture.md": "ARCHITECTURE.md",
            "patch-recipes.md": "patches/README.md"}
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _value(default: Any) -> str:
    if isinstance(default, bool):
        return "`on`" if default else "`off`"
    return f"`{default}`" if default not in ("", None) else "unset"


def options_markdown() -> str:
    """The variables table and one table per feature, each row from a declaration in the code."""
    names = ", ".join(f"`{name}`" for name in FEATURES)
    fire = (f"fire drill: `rank=R,step=N,kind={'|'.join(faults.KINDS)}[,at={'|'.join(faults.POINTS)}][,attempt=A]`, "
            "several separated by `;`")
    general = [
        (SELECT_VAR, f"`auto` (every feature whose runtime is present), `all`, `none`, or a comma list of {names}",
         "`auto`"),
        (STRICT_VAR, "`1`: a requested feature that cannot start stops the job before training", "`0`"),
        (LOG_VAR, ", ".join(f"`{level}`" for level in LOG_LEVELS), "`info`"),
        (INJECT_VAR, fire, "unset"),
        (EVENTS_VAR, "the folder every process writes the job's events to, for `ft-plugins report`; `off`: none",
         "`<--save>/ft_events`, else `<--output_dir>/ft_events`, else (MindSpore) beside the checkpoints, else none"),
        (EVENTS_JOB_VAR, "the job's name in its events: the same in every launch of a job relaunched by hand or by a "
         "cluster manager, so that the report reads them as one job",
         "torchrun's `--rdzv-id`, else the launcher's pid"),
        (GRACE_MAX_VAR, "the most seconds the grace before SIGKILL that `ft-plugins run` and `ft-plugins k8s` estimate "
         "from the job's writes may reach ([the grace](launcher.md#the-grace-covers-the-dump)); `--grace` is not cut",
         f"`{GRACE_MAX:g}`"),
    ]
    lines = ["## Variables", "", "| variable | values | default |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {_cell(values)} | {default} |" for name, values, default in general]
    for name, feature in FEATURES.items():
        lines += ["", f"## {name}", "", f"{feature.summary[:1].upper()}{feature.summary[1:]}."]
        if feature.requires:
            lines[-1] += f" Works on top of {', '.join(f'`{required}`' for required in feature.requires)}."
        lines += ["", "| variable | option | values | default |", "| --- | --- | --- | --- |"]
        for option in feature.options:
            values = " / ".join(f"`{choice}`" for choice in option.choices) if option.choices else option.help
            help_text = f"{option.help}: {values}" if option.choices else values
            lines.append(f"| `{PREFIX}{name.upper()}_{option.name.upper()}` | `{option.name}` | {_cell(help_text)} | "
                         f"{_value(option.default)} |")
    return "\n".join(lines)


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and, depth first, every subcommand's."""
    yield parser
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def cli_markdown() -> str:
    """One section per command: its usage, arguments and help, exactly as ``--help`` prints them."""
    sections = ["# CLI reference", "",
                "Every `ft-plugins` command as `--help` prints it, written from the argument parsers in "
                "`ft_plugins/cli/` by `python docs/hooks/reference.py`. Exit codes: 0 success, 1 failure, "
                "2 usage error, "
                "3 nothing suitable found or refused."]
    for parser in _parsers(build_parser()):
        parser.formatter_class = functools.partial(parser.formatter_class, width=HELP_WIDTH)
        sections += ["", f"## `{parser.prog}`", "", "```text", parser.format_help().rstrip(), "```"]
    return "\n".join(sections) + "\n"


def mirrored_markdown(page: str) -> str:
    """A repository file as a site page: links to the site's pages (``docs/...``) and to the other mirrored files
    become links within the site."""
    source = ROOT / MIRRORED[page]
    pages = {str((ROOT / path).resolve()): name for name, path in MIRRORED.items()}

    def relink(match: re.Match[str]) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        if "://" in target:
            return match.group(0)
        resolved = (source.parent / target).resolve()
        if str(resolved) in pages:
            return f"]({pages[str(resolved)]}{anchor})"
        docs = ROOT / "docs"
        if resolved.is_relative_to(docs):
            return f"]({resolved.relative_to(docs).as_posix()}{anchor})"
        return match.group(0)  # left as it is: mkdocs --strict names it if it is broken

    return LINK.sub(relink, source.read_text())


GENERATED = {"options": options_markdown, "versions": versions.table}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for page in MIRRORED:
        files.append(File.generated(config, page, content=mirrored_markdown(page)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return re.sub(r"<!-- generated: (\w+) -->", lambda match: GENERATED[match.group(1)](), markdown)


if __name__ == "__main__":
    (ROOT / "docs" / CLI_PAGE).write_text(cli_markdown())
