"""``ft-plugins k8s`` on job files written here: exact bytes out, a second run changes nothing,
CRLF, a missing final newline and other documents kept, non-jobs refused with exit 3."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support import PYTHON

from ft_plugins.launch import k8s

ASCEND_JOB = """\
apiVersion: mindxdl.gitee.com/v1
kind: AscendJob
metadata:
  name: default-test-pytorch
  labels:
    framework: pytorch
    ring-controller.atlas: ascend-910b
  annotations: {}
spec:
  schedulerName: volcano   # work when enableGangScheduling is true
  runPolicy:
    schedulingPolicy:
      minAvailable: 2
  successPolicy: AllWorkers
  replicaSpecs:
    Master:
      replicas: 1
      restartPolicy: Never
      template:
        metadata:
          labels:
            ring-controller.atlas: ascend-910b
        spec:
          containers:
          - name: ascend # do not modify
            image: pytorch-test:latest
            command: ["/bin/bash", "-c", "cd /job/code/scripts; chmod +x train_start.sh; bash train_start.sh"]
            ports:                          # default value containerPort: 2222 name: ascendjob-port if not set
              - containerPort: 2222         # determined by user
                name: ascendjob-port        # do not modify
            env:
              - name: XDL_IP
                valueFrom:
                  fieldRef:
                    fieldPath: status.hostIP
            resources:
              limits:
                huawei.com/Ascend910: 8
    Worker:
      replicas: 1
      template:
        spec:
          containers:
          - name: ascend
            image: pytorch-test:worker
          - name: sidecar
            image: busybox
"""

def inserted(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each block inserted after the one line equal to its key: what k8s must add."""
    lines = text.splitlines(keepends=True)
    for anchor, block in blocks.items():
        assert [line.rstrip("\n") for line in lines].count(anchor) == 1, anchor
        lines.insert([line.rstrip("\n") for line in lines].index(anchor) + 1, block)
    return "".join(lines)


TASKD_AND_TTP_PORTS = """\
- containerPort: 9601
  name: taskd-port
- containerPort: 8000
  name: ttp-port
"""
TTP_ENV = """\
- name: TTP_PORT
  value: "8000"
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
"""


def indented(block: str, spaces: int) -> str:
    return "".join(" " * spaces + line for line in block.splitlines(keepends=True))


# after --recover-strategy recover,dump: labels, annotations (the empty {} opened), port 9601 and the
# TTP settings on the `ascend` container of each replica (new blocks where the Worker has none)
ASCEND_JOB_EDITED = inserted(ASCEND_JOB.replace("  annotations: {}\n", "  annotations:\n"), {
    "    ring-controller.atlas: ascend-910b": '    fault-scheduling: "grace"\n    pod-rescheduling: "on"\n',
    "  annotations:": '    recover-strategy: "recover,dump"\n',
    "                name: ascendjob-port        # do not modify": indented(TASKD_AND_TTP_PORTS, 14),
    "                    fieldPath: status.hostIP": indented(TTP_ENV, 14),
    "            image: pytorch-test:worker": "            ports:\n" + indented(TASKD_AND_TTP_PORTS, 14)
                                            + "            env:\n" + indented(TTP_ENV, 14),
})


VOLCANO_JOB = """\
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata:
  name: mindx-dls-test
  namespace: vcjob
  labels:
    ring-controller.atlas: ascend-910
    fault-scheduling: "force"   # keep: the user's choice
spec:
  minAvailable: 2
  schedulerName: volcano
  maxRetry: 3
  queue: default
  tasks:
  - name: "default-test"
    replicas: 2
    template:
      metadata:
        labels:
          app: tf
      spec:
        containers:
        - image: ms:b030
          imagePullPolicy: IfNotPresent
          name: mindspore
          env:
          - name: XDL_IP
            valueFrom:
              fieldRef:
                fieldPath: status.hostIP
          command: ["/bin/bash", "-c", "cd /job/code; bash train_start.sh"]
          resources:
            requests:
              huawei.com/Ascend910: 8
        - image: log:1
          name: log-agent
        nodeSelector:
          host-arch: huawei-arm
        restartPolicy: OnFailure
"""

# after --recover-strategy retry,dump --wait-reschedule-timeout 60: every container of the task;
# the user's fault-scheduling "force" kept (no --fault-scheduling given)
VOLCANO_JOB_EDITED = inserted(VOLCANO_JOB, {
    '    fault-scheduling: "force"   # keep: the user\'s choice':
        '    pod-rescheduling: "on"\n  annotations:\n    recover-strategy: "retry,dump"\n'
        '    wait-reschedule-timeout: "60"\n',
    "                fieldPath: status.hostIP": indented(TTP_ENV, 10),
    "              huawei.com/Ascend910: 8": "          ports:\n" + indented(TASKD_AND_TTP_PORTS, 12),
    "          name: log-agent": "          ports:\n" + indented(TASKD_AND_TTP_PORTS, 12) + "          env:\n"
                                  + indented(TTP_ENV, 12),
})


CONFIG_MAP = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: rings-config-mindx-dls-test
data:
  hccl.json: |
    {"status": "initializing"}
"""

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  template:
    spec:
      containers:
      - name: ascend
        image: nginx
"""

RECOVER_DUMP = k8s.Options(recover_strategy=("recover", "dump"))
RETRY_DUMP = k8s.Options(recover_strategy=("retry", "dump"), wait_reschedule_timeout=60)


def _twice(text: str, options: k8s.Options) -> str:
    once, _ = k8s.edit(text, options)
    again, _ = k8s.edit(once, options)
    assert again == once, "a second run changed the file"
    return once


def test_ascend_job() -> None:
    assert _twice(ASCEND_JOB, RECOVER_DUMP) == ASCEND_JOB_EDITED


def test_volcano_job() -> None:
    assert _twice(VOLCANO_JOB, RETRY_DUMP) == VOLCANO_JOB_EDITED


def test_crlf_and_missing_final_newline_kept() -> None:
    crlf = ASCEND_JOB.replace("\n", "\r\n").rstrip("\r\n")
    assert _twice(crlf, RECOVER_DUMP) == ASCEND_JOB_EDITED.replace("\n", "\r\n").rstrip("\r\n")


def test_several_documents_only_jobs_edited() -> None:
    text = "---\n" + CONFIG_MAP + "---\n" + ASCEND_JOB + "---\n" + VOLCANO_JOB + "...\n"
    expected = "---\n" + CONFIG_MAP + "---\n" + ASCEND_JOB_EDITED + "---\n" + _twice(VOLCANO_JOB, RECOVER_DUMP) + "...\n"
    assert _twice(text, RECOVER_DUMP) == expected


def test_user_choice_replaced_in_place_only_when_asked() -> None:
    forced, _ = k8s.edit(VOLCANO_JOB, k8s.Options(fault_scheduling="grace", pod_rescheduling=False))
    assert '    fault-scheduling: "grace"   # keep: the user\'s choice\n' in forced
    assert "pod-rescheduling" not in forced and "recover-strategy" not in forced
    assert forced.replace('"grace"   #', '"force"   #').replace(
        "          ports:\n            - containerPort: 9601\n              name: taskd-port\n", "") == VOLCANO_JOB


@pytest.mark.parametrize("text, found", [(DEPLOYMENT, "Deployment"), (CONFIG_MAP, "ConfigMap")])
def test_files_without_a_training_job_are_refused(tmp_path: Path, text: str, found: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and result.stdout == ""
    assert "no AscendJob or Volcano Job" in result.stderr and found in result.stderr


def test_command_prints_exact_bytes_and_validates_strategies(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(ASCEND_JOB.replace("\n", "\r\n").encode())
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(path), "--recover-strategy", "recover,dump"],
                            capture_output=True, timeout=60)
    assert result.returncode == 0 and result.stdout == ASCEND_JOB_EDITED.replace("\n", "\r\n").encode()
    bad = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(path), "--recover-strategy", "recover,restart"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'restart'" in bad.stderr and "elastic-training" in bad.stderr
    timeout = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(path), "--wait-reschedule-timeout", "10"],
                             capture_output=True, text=True, timeout=60)
    assert timeout.returncode == 2 and "30 to 270" in timeout.stderr


def test_ascend_job_without_an_ascend_container_and_flow_ports_are_refused() -> None:
    renamed = ASCEND_JOB.replace("          - name: ascend\n            image: pytorch-test:worker\n",
                                 "          - name: trainer\n            image: pytorch-test:worker\n")
    with pytest.raises(k8s.JobFileRefused, match="replica Worker has no container named 'ascend'"):
        k8s.edit(renamed, RECOVER_DUMP)
    flow = VOLCANO_JOB.replace("          name: log-agent\n", "          name: log-agent\n          ports: [{containerPort: 80}]\n")
    with pytest.raises(k8s.JobFileRefused, match="flow style"):
        k8s.edit(flow, k8s.Options())


def test_elastic_training_note() -> None:
    _, notes = k8s.edit(ASCEND_JOB, k8s.Options(recover_strategy=("elastic-training",)))
    assert len(notes) == 1 and "MINDIO_WAIT_MINDX_TIME" in notes[0]


def test_elastic_training_gets_mindios_wait_and_the_survivors_wait_in_every_training_container() -> None:
    options = k8s.Options(recover_strategy=("recover", "elastic-training"), wait_reschedule_timeout=60, mindio_wait=90)
    edited, notes = k8s.edit(ASCEND_JOB, options)
    assert notes == []
    for name, value in (("MINDIO_WAIT_MINDX_TIME", "90"), ("FT_PLUGINS_ELASTIC_WAIT", "60")):  # Master and Worker
        assert edited.count(f'- name: {name}\n                value: "{value}"\n') == 2, name
    assert '    wait-reschedule-timeout: "60"\n' in edited
    assert k8s.edit(edited, options)[0] == edited  # a second run changes nothing
    _, notes = k8s.edit(ASCEND_JOB, k8s.Options(recover_strategy=("elastic-training",), mindio_wait=30))
    assert len(notes) == 1 and "at least 60 s" in notes[0]


@pytest.mark.parametrize("flag, value, bounds", [("--mindio-wait-mindx-time", "0", "1 to 3600"),
                                                 ("--mindio-wait-mindx-time", "3601", "1 to 3600"),
                                                 ("--wait-reschedule-timeout", "271", "30 to 270")])
def test_waits_outside_the_documented_ranges_are_refused_in_one_line(tmp_path: Path, flag: str, value: str,
                                                                      bounds: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(ASCEND_JOB)
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(path), "--recover-strategy",
                             "elastic-training", flag, value], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and bounds in result.stderr and flag in result.stderr
