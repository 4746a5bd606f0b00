"""Job YAML for MindCluster, edited where MindCluster reads it and nowhere else.

Port 9601 named ``taskd-port`` on every training container (AscendJob: the ``ascend`` container of
each replica spec; Volcano Job: every container of every task); the ``fault-scheduling`` /
``pod-rescheduling`` / ``fault-retry-times`` labels and the ``recover-strategy`` /
``wait-reschedule-timeout`` annotations on the job's metadata; ``TTP_PORT``, ``POD_IP`` and port 8000
``ttp-port`` when a strategy dumps or recovers; with ``elastic-training``, ``MINDIO_WAIT_MINDX_TIME`` and
``FT_PLUGINS_ELASTIC_WAIT`` (the survivors' wait for a replacement: the wait-reschedule-timeout); with ``--save``/``--termination-grace`` every pod's
``terminationGracePeriodSeconds``. ruamel.yaml only *locates* (a load + dump rewrites
booleans, flow lists, spacing and line ends); each edit is written into the original text, so
everything else stays byte for byte, CRLF, a missing final newline and other documents included,
and a second run changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("retry", "recover", "recover-in-place", "dump", "exit", "elastic-training")
TTP_STRATEGIES = ("dump", "recover")
FAULT_SCHEDULING = ("grace", "force")
TASKD_PORT, TASKD_PORT_NAME = 9601, "taskd-port"
TTP_PORT, TTP_PORT_NAME = 8000, "ttp-port"
RESCHEDULE_TIMEOUT = (30, 270)
MINDIO_WAIT = (1, 3600)  # MINDIO_WAIT_MINDX_TIME, seconds (MindIO's controller.cpp); >= 60 advised for elastic-training
ELASTIC = "elastic-training"
GRACE_KEY = "terminationGracePeriodSeconds"


class JobFileRefused(ValueError):
    """The file holds no training job, or one written so that an edit cannot be placed safely (exit 3)."""


class JobFileInvalid(ValueError):
    """The file is not YAML (exit 2: the input cannot be read as a job file at all)."""


@dataclass(frozen=True)
class Options:
    """What to ensure; ``None`` leaves a label or annotation as the file has it."""

    recover_strategy: tuple[str, ...] = ()
    fault_scheduling: str | None = None
    pod_rescheduling: bool = True
    fault_retry_times: int | None = None
    wait_reschedule_timeout: int | None = None
    mindio_wait: int | None = None  # MINDIO_WAIT_MINDX_TIME of every training container, with elastic-training
    # terminationGracePeriodSeconds of every pod: (seconds, override) — an estimate raises a shorter one only
    termination_grace: tuple[int, bool] | None = None


def parse_strategies(raw: str) -> tuple[str, ...]:
    """``recover,dump`` -> ("recover", "dump"); ValueError naming the unknown ones and the accepted."""
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise ValueError(f"--recover-strategy {raw!r}: unknown {', '.join(map(repr, unknown)) or '(empty)'}; "
                         f"accepted: a comma list of {', '.join(STRATEGIES)}")
    return names


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _quoted(value: object) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Edits:
    """Insertions after original lines and in-line value replacements, applied at the end."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.inserts: list[tuple[int, int, list[str]]] = []
        self.replaced: dict[int, str] = {}

    def insert_after(self, index: int, new_lines: list[str]) -> None:
        self.inserts.append((index, len(self.inserts), new_lines))

    def block_end(self, start: int, col: int, mapping: bool) -> int:
        """Last line of the block whose first line is ``start`` and whose entries sit at column ``col``."""
        last = start
        for index in range(start + 1, len(self.lines)):
            text = self.lines[index].strip()
            if not text:
                continue
            indent = _indent(self.lines[index])
            if text in ("---", "...") or text.startswith("--- "):
                break
            if indent > col or (mapping and indent == col and (text == "-" or text.startswith("- "))):
                last = index
                continue
            break
        return last

    def apply(self) -> list[str]:
        lines = [self.replaced.get(index, line) for index, line in enumerate(self.lines)]
        for index, _, new_lines in sorted(self.inserts, reverse=True):
            lines[index + 1:index + 1] = new_lines
        return lines


class _Job:
    """One training-job document: its parsed tree (for positions) and the shared edits."""

    def __init__(self, doc: Any, edits: _Edits) -> None:
        self.doc = doc
        self.edits = edits
        self.pending: dict[tuple[int, str], tuple[Any, list[list[str]], str]] = {}

    def _refuse_flow(self, node: Any, what: str) -> None:
        if node.fa.flow_style() and len(node):
            raise JobFileRefused(f"line {node.lc.line + 1}: {what} is written in flow style ([...] / {{...}}); "
                                 "write it as a block and run again")

    def add_keys(self, mapping: Any, rel_lines: list[str], what: str) -> None:
        """New keys at the end of a block mapping, indented like its keys."""
        self._refuse_flow(mapping, what)
        last = list(mapping)[-1]
        line, col = mapping.lc.key(last)
        end = self.edits.block_end(line, col, mapping=True)
        self.edits.insert_after(end, [" " * col + rel for rel in rel_lines])

    def append_item(self, parent: Any, key: str, item: list[str], what: str) -> None:
        """Queue one item for the block sequence ``parent[key]``; :meth:`flush` writes each list once."""
        self.pending.setdefault((id(parent), key), (parent, [], what))[1].append(item)

    def flush(self) -> None:
        for (_, key), (parent, items, what) in self.pending.items():
            rel = [("- " if n == 0 else "  ") + line for item in items for n, line in enumerate(item)]
            seq = self.existing_or_new(parent, key, rel, what, list)
            if seq is None:
                continue
            self._refuse_flow(seq, f"{what}: {key}")
            line, col = seq.lc.item(len(seq) - 1)
            dash = self.edits.lines[line].rfind("-", 0, col)
            end = self.edits.block_end(line, dash, mapping=False)
            self.edits.insert_after(end, [(" " * dash + "-" + " " * (col - dash - 1) + line[2:]) if line.startswith("- ")
                                          else " " * col + line[2:] for line in rel])
        self.pending.clear()

    def existing_or_new(self, parent: Any, key: str, rel_lines: list[str], what: str, kind: type) -> Any:
        """The non-empty block collection ``parent[key]``; or None once ``rel_lines`` became its content
        (the key added, or an empty value filled)."""
        if key not in parent:
            self.add_keys(parent, [f"{key}:"] + [f"  {line}" for line in rel_lines], what)
            return None
        if self.fill_empty(parent, key, rel_lines):
            return None
        if not isinstance(parent[key], kind):
            raise JobFileRefused(f"line {parent.lc.key(key)[0] + 1}: {what}: {key} is not a {kind.__name__}")
        return parent[key]

    def fill_empty(self, parent: Any, key: str, rel_lines: list[str]) -> bool:
        """Give an empty ``key:`` / ``key: []`` / ``key: {}`` block content; False when it is not empty."""
        value = parent.get(key)
        if value is not None and (isinstance(value, str) or not hasattr(value, "__len__") or len(value)):
            return False
        key_line, key_col = parent.lc.key(key)
        if value is not None:  # `[]` or `{}` (a block collection is never empty): drop it, keep a comment
            line, col = parent.lc.value(key)
            text = self.edits.lines[line]
            end = text.index("]" if text[col] == "[" else "}", col) + 1
            self.edits.replaced[line] = (text[:col].rstrip() + " " + text[end:].strip()).rstrip()
        self.edits.insert_after(key_line, [" " * (key_col + 2) + rel for rel in rel_lines])
        return True

    def set_value(self, mapping: Any, key: str, value: str, quoted: bool = True) -> None:
        """Replace a one-line scalar value in place (a string, else as given), keeping any trailing comment."""
        line, col = mapping.lc.value(key)
        text = self.edits.lines[line]
        rest = text[col:]
        if rest[:1] in ("'", '"'):
            close = rest.find(rest[0], 1)
            end = col + close + 1 if close > 0 else len(text)
        else:
            comment = re.search(r"\s#", rest)
            end = col + (comment.start() if comment else len(rest.rstrip()))
        self.edits.replaced[line] = text[:col] + (_quoted(value) if quoted else value) + text[end:]

    def ensure_entries(self, owner: Any, key: str, wanted: dict[str, tuple[str, bool]], what: str) -> None:
        """``owner[key]`` (labels / annotations) holds each wanted ``name: (value, override)``; an
        existing different value is replaced only when ``override`` (the user asked for it)."""
        entries = [f"{name}: {_quoted(value)}" for name, (value, _) in wanted.items()]
        current = self.existing_or_new(owner, key, entries, what, dict)
        if current is None:
            return
        missing = []
        for name, (value, override) in wanted.items():
            if name not in current:
                missing.append(f"{name}: {_quoted(value)}")
            elif str(current[name]) != value and override:
                self.set_value(current, name, value)
        if missing:
            self.add_keys(current, missing, f"{what}.{key}")

    def ensure_port(self, container: Any, port: int, name: str, where: str) -> None:
        ports = _entries(container, "ports", where)
        if any(str(item.get("containerPort")) == str(port) for item in ports):
            return
        self.append_item(container, "ports", [f"containerPort: {port}", f"name: {name}"], where)

    def ensure_env(self, container: Any, name: str, rel_lines: list[str], where: str) -> None:
        env = _entries(container, "env", where)
        if any(item.get("name") == name for item in env):
            return
        self.append_item(container, "env", [f"name: {name}", *rel_lines], where)


def _entries(container: Any, key: str, where: str) -> list[Any]:
    """A container's ``ports`` / ``env`` list (empty when absent); JobFileRefused when it or an entry is malformed."""
    entries = container.get(key)
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise JobFileRefused(f"{where}: {key} is a {type(entries).__name__}, not a list of entries")
    for index, entry in enumerate(entries):
        if not hasattr(entry, "get"):
            shown = "empty" if entry is None else f"a {type(entry).__name__}"
            raise JobFileRefused(f"{where}: {key}[{index}] is {shown}, not a mapping; fix the entry and run again")
    return entries


def _mapping(node: Any, path: str, job: str) -> Any:
    """``node`` when it is a non-empty mapping; else JobFileRefused naming ``path`` inside ``job``."""
    if not (hasattr(node, "get") and hasattr(node, "lc") and len(node)):
        shown = "missing" if node is None else f"a {type(node).__name__}" if not hasattr(node, "get") else "empty"
        raise JobFileRefused(f"{job}: {path} is {shown}, not a mapping; a training job needs it")
    return node


def _sequence(node: Any, path: str, job: str) -> list[Any]:
    """``node`` when it is a non-empty list; else JobFileRefused naming ``path`` inside ``job``."""
    if not isinstance(node, list) or not node:
        shown = "missing" if node is None else "empty" if isinstance(node, list) else f"a {type(node).__name__}"
        raise JobFileRefused(f"{job}: {path} is {shown}, not a list of entries; a training job needs it")
    return node


def _pod_spec(template_owner: Any, path: str, job: str) -> Any:
    template = _mapping(_mapping(template_owner, path, job).get("template"), f"{path}.template", job)
    return _mapping(template.get("spec"), f"{path}.template.spec", job)


def _pod_containers(template_owner: Any, path: str, job: str) -> list[Any]:
    pod = _pod_spec(template_owner, path, job)
    containers = _sequence(pod.get("containers"), f"{path}.template.spec.containers", job)
    for index, container in enumerate(containers):
        _mapping(container, f"{path}.template.spec.containers[{index}]", job)
    return containers


def _containers(doc: Any, job: str) -> list[tuple[str, Any]]:
    """(where, container) of every training container; JobFileRefused when the job has none to edit."""
    spec = _mapping(doc.get("spec"), "spec", job)
    found = []
    if doc.get("kind") == "AscendJob":
        for replica, replica_spec in _mapping(spec.get("replicaSpecs"), "spec.replicaSpecs", job).items():
            containers = _pod_containers(replica_spec, f"spec.replicaSpecs.{replica}", job)
            ascend = [c for c in containers if c.get("name") == "ascend"]
            if not ascend:
                raise JobFileRefused(f"{job}: replica {replica} has no container named 'ascend' (MindCluster "
                                     "requires that name)")
            found += [(f"replica {replica}, container ascend", c) for c in ascend]
    else:
        for index, task in enumerate(_sequence(spec.get("tasks"), "spec.tasks", job)):
            containers = _pod_containers(task, f"spec.tasks[{index}]", job)
            found += [(f"task {task.get('name')}, container {c.get('name')}", c) for c in containers]
    return found


def _pod_specs(doc: Any, job: str) -> list[Any]:
    """The pod spec of every replica (AscendJob) or task (Volcano Job)."""
    spec = _mapping(doc.get("spec"), "spec", job)
    if doc.get("kind") == "AscendJob":
        replicas = _mapping(spec.get("replicaSpecs"), "spec.replicaSpecs", job)
        return [_pod_spec(owner, f"spec.replicaSpecs.{name}", job) for name, owner in replicas.items()]
    return [_pod_spec(task, f"spec.tasks[{index}]", job)
            for index, task in enumerate(_sequence(spec.get("tasks"), "spec.tasks", job))]


def is_training_job(doc: Any) -> bool:
    if not hasattr(doc, "get"):
        return False
    kind, api = doc.get("kind"), str(doc.get("apiVersion", ""))
    return kind == "AscendJob" or (kind == "Job" and api.startswith("batch.volcano.sh/"))


def edit(text: str, options: Options) -> tuple[str, list[str]]:
    """``text`` with the edits made, and notes for the user; JobFileRefused when no training job is in it."""
    from ruamel.yaml import YAML  # the k8s extra; imported only here
    from ruamel.yaml.error import YAMLError

    newline = "\r\n" if "\r\n" in text else "\n"
    lines = text.split(newline)
    final_newline = lines[-1] == ""
    if final_newline:
        lines.pop()
    edits = _Edits(lines)
    try:
        docs = list(YAML(typ="rt").load_all(text))
    except YAMLError as exc:
        raise JobFileInvalid(f"not valid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise JobFileInvalid("not a job file: nested too deeply to read") from None
    jobs = [doc for doc in docs if is_training_job(doc)]
    if not jobs:
        kinds = ", ".join(str(doc.get("kind")) for doc in docs if hasattr(doc, "get")) or "nothing"
        raise JobFileRefused(f"no AscendJob or Volcano Job (batch.volcano.sh) in the file (found: {kinds})")
    notes = []
    for doc in jobs:
        name = doc.get("metadata", {}).get("name") if hasattr(doc.get("metadata"), "get") else None
        where = f"{doc.get('kind')} {name!r}" if name is not None else f"the {doc.get('kind')} at line {doc.lc.line + 1}"
        try:
            _edit_job(_Job(doc, edits), options, where)
        except JobFileRefused:
            raise
        except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:  # a shape not foreseen above
            raise JobFileRefused(f"{where}: written in a shape this command cannot edit safely ({type(exc).__name__}: "
                                 f"{exc}); add the settings by hand (see 'ft-plugins k8s --help')") from None
    if ELASTIC in options.recover_strategy and options.mindio_wait is None:
        notes.append("elastic-training also needs MINDIO_WAIT_MINDX_TIME in each training container's env "
                     "(not added: choose the wait for your cluster, --mindio-wait-mindx-time SECONDS)")
    elif ELASTIC in options.recover_strategy and options.mindio_wait < 60 and "recover" not in options.recover_strategy:
        notes.append(f"MINDIO_WAIT_MINDX_TIME {options.mindio_wait}: MindCluster advises at least 60 s for "
                     "elastic-training without process-level recovery (recover)")
    result = newline.join(edits.apply() + ([""] if final_newline else []))
    try:  # never print a file that no longer reads as YAML: a shape the placing above did not foresee
        list(YAML(typ="rt").load_all(result))
    except YAMLError:
        raise JobFileRefused("the edited file would not be valid YAML (a block this command cannot place entries "
                             "in); add the settings by hand") from None
    return result, notes


def _edit_job(job: _Job, options: Options, where: str) -> None:
    """Queue the edits of one training job (nothing is written before every job was examined)."""
    doc = job.doc
    metadata = _mapping(doc.get("metadata"), "metadata", where)
    labels: dict[str, tuple[str, bool]] = {
        "fault-scheduling": (options.fault_scheduling or "grace", options.fault_scheduling is not None)}
    if options.pod_rescheduling:
        labels["pod-rescheduling"] = ("on", True)
    if options.fault_retry_times is not None:
        labels["fault-retry-times"] = (str(options.fault_retry_times), True)
    job.ensure_entries(metadata, "labels", labels, "metadata")
    annotations: dict[str, tuple[str, bool]] = {}
    if options.recover_strategy:
        annotations["recover-strategy"] = (",".join(options.recover_strategy), True)
    if options.wait_reschedule_timeout is not None:
        annotations["wait-reschedule-timeout"] = (str(options.wait_reschedule_timeout), True)
    if annotations:
        job.ensure_entries(metadata, "annotations", annotations, "metadata")
    ttp = any(strategy in TTP_STRATEGIES for strategy in options.recover_strategy)
    for place, container in _containers(doc, where):
        job.ensure_port(container, TASKD_PORT, TASKD_PORT_NAME, place)
        if ttp:
            job.ensure_port(container, TTP_PORT, TTP_PORT_NAME, place)
            job.ensure_env(container, "TTP_PORT", [f"value: {_quoted(TTP_PORT)}"], place)
            job.ensure_env(container, "POD_IP", ["valueFrom:", "  fieldRef:", "    fieldPath: status.podIP"], place)
        if ELASTIC in options.recover_strategy and options.mindio_wait is not None:
            job.ensure_env(container, "MINDIO_WAIT_MINDX_TIME", [f"value: {_quoted(options.mindio_wait)}"], place)
        if ELASTIC in options.recover_strategy and options.wait_reschedule_timeout is not None:  # ft_plugins' own
            job.ensure_env(container, "FT_PLUGINS_ELASTIC_WAIT", [f"value: {_quoted(options.wait_reschedule_timeout)}"],
                           place)
    job.flush()
    if options.termination_grace is not None:
        seconds, override = options.termination_grace
        for pod in _pod_specs(doc, where):
            current = pod.get(GRACE_KEY)
            if current is None:
                job.add_keys(pod, [f"{GRACE_KEY}: {seconds}"], "pod spec")
            elif override or not str(current).isdigit() or int(current) < seconds:
                job.set_value(pod, GRACE_KEY, str(seconds), quoted=False)


def validate_timeout(seconds: int) -> int:
    return _within(seconds, RESCHEDULE_TIMEOUT, "--wait-reschedule-timeout", "MindCluster")


def validate_mindio_wait(seconds: int) -> int:
    return _within(seconds, MINDIO_WAIT, "--mindio-wait-mindx-time", "MindIO")


def _within(seconds: int, bounds: tuple[int, int], flag: str, who: str) -> int:
    low, high = bounds
    if not low <= seconds <= high:
        raise ValueError(f"{flag} {seconds}: {who} accepts {low} to {high} seconds")
    return seconds

