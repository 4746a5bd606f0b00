"""``ft-plugins k8s`` on malformed job files: every one is edited (each training container gets port 9601)
or refused in one line (JobFileRefused: exit 3; JobFileInvalid: exit 2), never a traceback, never a
silent success that added nothing. Fuzzed like the checkpoint probes: derandomized, a fixed number of examples."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from support import PYTHON

from ft_plugins.launch import k8s

FUZZ = settings(derandomize=True, max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
KEYS = ("metadata", "name", "spec", "replicaSpecs", "Worker", "template", "containers", "ports", "env", "labels",
        "annotations", "tasks", "containerPort", "value", "kind")
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 9601), st.sampled_from(["", "ascend", "x y", "9601"]))
TREES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                     max_leaves=10)


def _container(name: str) -> dict[str, Any]:
    return {"name": name, "image": "train:1", "ports": [{"containerPort": 2222}]}


def _pod(*names: str) -> dict[str, Any]:
    return {"template": {"spec": {"containers": [_container(name) for name in names]}}}


VALID = {
    "AscendJob": {"apiVersion": "mindxdl.gitee.com/v1", "kind": "AscendJob", "metadata": {"name": "job", "labels": {}},
                  "spec": {"replicaSpecs": {"Master": _pod("ascend"), "Worker": _pod("ascend", "sidecar")}}},
    "Job": {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": "job"},
            "spec": {"tasks": [{"name": "t", **_pod("main")}]}},
}


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix] if prefix else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if prefix or key not in ("kind", "apiVersion"):
            found += _paths(child, (*prefix, key))
    return found


def _replace(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[path[0]] = _replace(copy[path[0]], path[1:], value)
    return copy


@st.composite
def jobs(draw: Any) -> str:
    """A valid AscendJob or Volcano Job with one part (1 or 2 in a few) replaced by something random."""
    doc = VALID[draw(st.sampled_from(sorted(VALID)))]
    for _ in range(draw(st.integers(1, 2))):
        doc = _replace(doc, draw(st.sampled_from(_paths(doc))), draw(TREES))
    out = io.StringIO()
    YAML().dump(doc, out)
    return out.getvalue()


def _containers(doc: Any) -> list[Any]:
    spec = doc["spec"]
    if doc["kind"] == "AscendJob":
        return [c for replica in spec["replicaSpecs"].values() for c in replica["template"]["spec"]["containers"]
                if c.get("name") == "ascend"]
    return [c for task in spec["tasks"] for c in task["template"]["spec"]["containers"]]


@FUZZ
@given(text=jobs())
def test_every_malformed_job_is_edited_whole_or_refused_in_one_line(text: str) -> None:
    try:
        edited, _ = k8s.edit(text, k8s.Options(recover_strategy=("dump",)))
    except (k8s.JobFileRefused, k8s.JobFileInvalid) as refusal:
        assert "\n" not in str(refusal) and str(refusal)
        return
    doc = YAML().load(edited)
    containers = _containers(doc)
    assert containers and all(any(port.get("containerPort") == 9601 for port in c["ports"]) for c in containers)
    assert doc["metadata"]["labels"]["fault-scheduling"]
    assert k8s.edit(edited, k8s.Options(recover_strategy=("dump",)))[0] == edited  # a second run changes nothing


VOLCANO_WITHOUT_CONTAINERS = """\
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata:
  name: job
spec:
  tasks:
    - name: t
      template:
        spec:
          containers: []
"""


@pytest.mark.parametrize("text, exit_code, says", [
    ("apiVersion: batch.volcano.sh/v1alpha1\nkind: Job\nspec:\n  tasks: []\n", 3, "metadata is missing"),
    ("kind: AscendJob\nmetadata:\n  name: j\nspec: null\n", 3, "'j': spec is missing"),
    (VOLCANO_WITHOUT_CONTAINERS, 3, "containers is empty"),
    ("kind: AscendJob\nmetadata: [\n", 2, "not valid YAML"),
    (b"kind: AscendJob\n\xff\xfe\n", 2, "not UTF-8 text"),
])
def test_the_command_refuses_in_one_line_with_its_exit_code(tmp_path: Path, text: str | bytes, exit_code: int,
                                                             says: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout) == (exit_code, "")
    assert len(result.stderr.splitlines()) == 1 and says in result.stderr, result.stderr


def test_an_unreadable_file_is_exit_2(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(tmp_path / "absent.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("ft-plugins k8s: cannot read")
