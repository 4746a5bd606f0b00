"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a missing page or a lost
anchor fails it, the README's links included: it is the site's home page), its reference pages are written from
the code, and what the README states once (the versions, the two commands, the version) agrees with the code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import PYTHON, REPO

import ft_plugins
from ft_plugins.config import (EVENTS_JOB_VAR, EVENTS_VAR, GRACE_FOLLOWS_VAR, GRACE_MAX_VAR, GRACE_VAR, INJECT_VAR,
                               LOG_VAR, PREFIX, STRICT_VAR)
from ft_plugins.features import FEATURES
from ft_plugins.vendors import versions

# what the site is built from: mkdocs.yml, docs/ and the repository files its hook shows as pages
SITE_SOURCES = ("mkdocs.yml", "docs", "README.md", "CHANGELOG.md", "ARCHITECTURE.md", "patches/README.md")
VARIABLE = re.compile(rf"\b{PREFIX}[A-Z][A-Z_]*[A-Z]\b")


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the site whose mkdocs.yml is in ``root``, into ``site``."""
    return subprocess.run([PYTHON, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d",
                           str(site)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build(REPO, out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_site_builds_strict_with_every_page_of_the_issue(site: Path) -> None:
    pages = ["getting-started", "frameworks/megatron", "frameworks/hf", "frameworks/mindspore", "launcher",
             "checkpoints", "patch", "verified", "benchmarks", "configuration", "reference/cli",
             "reference/versions", "changelog", "architecture", "patch-recipes",
             *(f"features/{name}" for name in ("taskd", "mstx", "resume", "ttp", "recover", "elastic",
                                                        "replicas"))]
    assert [page for page in pages if not (site / page / "index.html").is_file()] == []
    assert "ft-plugins run" in (site / "index.html").read_text()  # the README is the home page


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The negative control: the same sources with one link to a page that does not exist."""
    for source in SITE_SOURCES:
        target = tmp_path / "repo" / source
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (REPO / source).is_dir() else shutil.copy)(REPO / source, target)
    page = tmp_path / "repo" / "docs" / "benchmarks.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    result = build(tmp_path / "repo", tmp_path / "site")
    assert result.returncode != 0 and "missing.md" in result.stdout + result.stderr


def test_the_references_are_written_from_the_code(site: Path) -> None:
    """Every declared option is in the configuration reference, every command in the CLI reference, and the
    versions page holds the table of ft_plugins.vendors.versions."""
    configuration = (site / "configuration" / "index.html").read_text()
    declared = [f"{PREFIX}{name.upper()}_{option.name.upper()}" for name, feature in FEATURES.items()
                for option in feature.options]
    assert [variable for variable in declared if variable not in configuration] == []
    cli = (site / "reference" / "cli" / "index.html").read_text()
    from ft_plugins.cli import COMMANDS

    assert [command for command in COMMANDS if f"ft-plugins {command}" not in cli] == []
    assert "--inject-fault" in cli and "ft-plugins ckpt latest" in cli
    page = (site / "reference" / "versions" / "index.html").read_text()
    assert all(framework.describe() in page for framework in versions.SUPPORTED)


def test_every_variable_the_documents_name_exists() -> None:
    """A variable named in the README or on a page is one ft_plugins reads: a renamed option cannot linger."""
    known = {f"{PREFIX}{name.upper()}_{option.name.upper()}" for name, feature in FEATURES.items()
             for option in feature.options} | {STRICT_VAR, LOG_VAR, INJECT_VAR, EVENTS_VAR, EVENTS_JOB_VAR, GRACE_VAR,
                                                GRACE_FOLLOWS_VAR, GRACE_MAX_VAR}
    texts = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    named = {(path.relative_to(REPO).as_posix(), variable) for path in texts
             for variable in VARIABLE.findall(path.read_text())}
    assert sorted((path, variable) for path, variable in named if variable not in known) == []
    assert len(named) > 10


def test_the_readme_is_a_front_page_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    assert "pip install ft-plugins" in readme and "bash scripts/demo.sh" in readme
    assert "bash scripts/test.sh" in readme and "exec bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    assert "scripts/setup.sh" in (REPO / "scripts" / "demo.sh").read_text()


def test_the_cli_reference_in_the_repository_is_the_parsers_help() -> None:
    """docs/reference/cli.md reads on any forge, not only on the built site: it must say what the code does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference_hook", REPO / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = REPO / "docs" / hook.CLI_PAGE
    assert page.read_text() == hook.cli_markdown(), f"{page} is out of date: run python docs/hooks/reference.py"


def test_the_readme_states_the_supported_versions_of_the_code() -> None:
    assert versions.table() in (REPO / "README.md").read_text()


def test_the_changelog_begins_with_the_packages_version() -> None:
    first = next(line for line in (REPO / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first.split()[1] == ft_plugins.__version__
