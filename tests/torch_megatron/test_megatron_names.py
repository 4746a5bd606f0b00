"""Every megatron name ft_plugins reaches exists where each supported release keeps it: megatron-core 0.8 (the
oldest supported, MindSpeed-LLM's base; its wheel holds ``megatron.core`` only), 0.17.1 (the suite's) and 0.19
(the newest, installed beside it). The names are read from the package's source, so a new call site is checked
without being listed here; a name that moved between releases (``unwrap_model`` lived in
``megatron.training.utils`` up to 0.13 and only in ``megatron.core.utils`` since 0.19) turns this red unless
the glue looks it up in each place (``state.moved``). A name reached with ``getattr(..., None)`` or through
``optional_megatron`` is optional by construction: the glue does without it where a release lacks it."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

import ft_plugins

from support import NEWER_MEGATRON, OLDEST_MEGATRON, PYTHON

GLUE = Path(ft_plugins.__file__).resolve().parent / "torch" / "megatron"
CHECK = """
import importlib, json, sys
if sys.argv[2]:  # megatron is a namespace package: only the release under test may answer for it
    import megatron
    megatron.__path__ = [part for part in megatron.__path__ if part.startswith(sys.argv[2])]
missing, unverifiable = [], []
for places, attribute, optional in json.loads(sys.argv[1]):
    found, absent = [], []
    for place in places:
        try:
            found.append(importlib.import_module(place))
        except ModuleNotFoundError as error:
            (absent if error.name.startswith("megatron") else missing).append(f"{place}: {error}")
        except Exception as error:
            missing.append(f"{place}: {type(error).__name__}: {error}")
    def holds(owner, dotted=attribute):
        for part in dotted.split("."):
            owner = getattr(owner, part, holds)
        return owner is not holds
    name = f"{' or '.join(places)}: {attribute}"
    if any(holds(module) for module in found) or (optional and not found):
        continue
    if absent and all(".training" in reason.split(":")[0] for reason in absent):
        unverifiable.append(name)
    else:
        missing.append(name)
print(json.dumps({"missing": missing, "unverifiable": unverifiable}))
"""


class Reached(NamedTuple):
    """A megatron name the glue reaches: ``attribute`` of the first of ``places`` holding it; ``optional``: the
    glue does without the module where a release lacks it."""

    places: tuple[str, ...]
    attribute: str
    optional: bool = False


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _called(node: ast.AST, *functions: str) -> str | None:
    """The name of ``node``'s function when it is a call of one of ``functions``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        return node.func.id
    return None


def _reached_in(tree: ast.Module, constants: dict[str, str], updates: tuple[str, ...]) -> set[Reached]:
    # aliases by name across the file (rerun = optional_megatron("core.rerun_state_machine")): a module handed to a
    # helper keeps its name there (dump.py's ``_shards(checkpointing, ...)``)
    aliases: dict[str, tuple[str, bool]] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and (function := _called(node.value, "megatron", "optional_megatron"))):
            aliases[node.targets[0].id] = (f"megatron.{_string(node.value.args[0])}", function == "optional_megatron")
    reached: set[Reached] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _called(node.value, "megatron"):
            reached.add(Reached((f"megatron.{_string(node.value.args[0])}",), node.attr))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module, optional = aliases[node.value.id]
            reached.add(Reached((module,), node.attr, optional))
        elif _called(node, "moved"):
            attribute, *places = [_string(argument) for argument in node.args]
            reached.add(Reached(tuple(f"megatron.{place}" for place in places), attribute))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
            reached |= {Reached((node.module,), alias.name) for alias in node.names}
        elif _called(node, "Patch") and not any(keyword.arg == "required" and _false(keyword.value)
                                                for keyword in node.keywords):
            target, attribute = node.args[:2]
            module = _string(target) or constants.get(getattr(target, "id", ""))
            if module and module.startswith("megatron."):
                names = updates if isinstance(attribute, ast.Name) else (_string(attribute),)
                reached |= {Reached((module,), name) for name in names if name}
    return reached


def names_reached() -> set[Reached]:
    """Every megatron name the torch glue calls, imports or patches."""
    trees = [ast.parse(path.read_text()) for path in sorted(GLUE.glob("*.py"))]
    constants = {target.id: value for tree in trees for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name) and (value := _string(node.value))}
    updates = ast.literal_eval(next(node.value for tree in trees for node in tree.body if isinstance(node, ast.Assign)
                                    and [getattr(t, "id", None) for t in node.targets] == ["UPDATES"]))
    return {name for tree in trees for name in _reached_in(tree, constants, updates)}


def test_the_source_scan_finds_the_names_it_must() -> None:
    """A scan that found nothing would pass every release: it finds each kind of reference."""
    names = names_reached()
    assert {Reached(("megatron.core.utils", "megatron.training.utils"), "unwrap_model"),
            Reached(("megatron.training.training",), "train_step"),
            Reached(("megatron.training.checkpointing",), "save_checkpoint"),
            Reached(("megatron.core.parallel_state",), "get_expert_model_parallel_rank"),  # through an alias
            Reached(("megatron.core.rerun_state_machine",), "get_rerun_state_machine", True),
            Reached(("megatron.core.optimizer.optimizer",), "MixedPrecisionOptimizer.step_with_ready_grads")} <= names
    assert len(names) > 30


def _check(path: Path, only: bool) -> dict[str, list[str]]:
    reached = sorted([list(name.places), name.attribute, name.optional] for name in names_reached())
    result = subprocess.run([PYTHON, "-c", CHECK, json.dumps(reached), str(path) if only else ""],
                            capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(path) if path.name else ""})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("release, path", [("megatron-core 0.17.1", Path()), ("megatron-core 0.19", NEWER_MEGATRON)])
def test_every_name_exists_in_the_release(release: str, path: Path) -> None:
    if path.name and not path.is_dir():
        pytest.fail(f"{release} is not installed beside the venv: run scripts/setup.sh")
    assert _check(path, only=False) == {"missing": [], "unverifiable": []}, release


def test_every_megatron_core_name_exists_in_the_oldest_release() -> None:
    """megatron-core 0.8.0's wheel holds ``megatron.core`` only (``megatron.training`` came with Megatron-LM's
    source then): every ``megatron.core`` name is checked against it, the rest is named as not checkable."""
    if not OLDEST_MEGATRON.is_dir():
        pytest.fail("megatron-core 0.8.0 is not installed beside the venv: run scripts/setup.sh")
    found = _check(OLDEST_MEGATRON, only=True)
    assert found["missing"] == []
    assert found["unverifiable"] and all(".training" in name for name in found["unverifiable"]), found
    print("megatron-core 0.8.0: not in its wheel, so not checked:", ", ".join(found["unverifiable"]))
