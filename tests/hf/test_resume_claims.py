"""What the resume page says about who reaches ``get_last_checkpoint`` how, checked against the installed source:
the transformers modules that import it by name (each such copy is one ``resume`` must rebind), and the example
that does. TRL and LLaMA-Factory are not installed here: their rows were read in their sources."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from support import REPO

NAME = "get_last_checkpoint"


def importers(root: Path, package: str) -> set[str]:
    """The modules under ``root`` that bind ``get_last_checkpoint`` with a ``from ... import``."""
    found = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if NAME not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and any(alias.name == NAME for alias in node.names):
                parts = path.relative_to(root).with_suffix("").parts
                found.add(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return found


def test_transformers_imports_it_by_name_only_in_the_trainer() -> None:
    """The page's transformers row: ``Trainer.train(resume_from_checkpoint=True)`` goes through the copy in
    ``transformers.trainer``, and no other module of the package holds one."""
    spec = importlib.util.find_spec("transformers")
    assert spec is not None and spec.origin is not None
    assert importers(Path(spec.origin).parent, "transformers") == {"transformers.trainer"}
    page = (REPO / "docs" / "features" / "resume.md").read_text()
    assert "`Trainer.train(resume_from_checkpoint=True)` calls the copy `transformers.trainer` imported" in page


def test_the_trainer_example_imports_it_by_name() -> None:
    assert importers(REPO / "examples" / "hf_trainer", "examples.hf_trainer") == {"examples.hf_trainer.train"}
