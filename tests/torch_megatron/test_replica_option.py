"""``ttp``'s ``replicas`` option: megatron's distributed optimizer replicated from the import alone.

One real 4-rank ``pretrain()`` (DP=4, ``--use-distributed-optimizer``, ``FT_PLUGINS=ttp``, replicas left at
``auto``) must build megatron's instance groups [0, 1] / [2, 3] and replica groups [0, 2] / [1, 3]; the
negative control is the same run with ``--no-ft-plugins-import`` (one instance of 4). The other cases run
megatron's real ``parse_args`` + ``validate_args`` in one process (fixtures/replica_cases.py).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from support import PYTHON, fake_env, run_megatron

HERE = Path(__file__).resolve().parent
GROUPS_ENTRY = HERE / "fixtures" / "replica_groups.py"
CASES_ENTRY = HERE / "fixtures" / "replica_cases.py"
DISTRIBUTED = ("--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "8",
               "--train-iters", "2", "--save-interval", "2")


def _pretrain(workdir: Path, *args: str, **env: str) -> str:
    result = run_megatron(workdir, 4, fake_env(workdir / "calls.jsonl", **env), *DISTRIBUTED,
                          "--save", str(workdir / "ckpt"), *args, entry=GROUPS_ENTRY)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def _groups(workdir: Path) -> dict[int, tuple[list[int], list[int]]]:
    """Per rank: megatron's intra-instance group and its inter-instance (replica) group."""
    found = {rank: json.loads((workdir / f"replica_groups_rank{rank}.json").read_text()) for rank in range(4)}
    return {rank: (groups["instance"], groups["across"]) for rank, groups in found.items()}


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    workdir = tmp_path_factory.mktemp("replicated")
    return workdir / "ckpt", _pretrain(workdir, FT_PLUGINS="ttp", FT_PLUGINS_TTP_ENGINE="builtin")


def test_ttp_alone_replicates_the_distributed_optimizer_in_two_instances(replicated: tuple[Path, str]) -> None:
    save, output = replicated
    assert _groups(save.parent) == {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}
    assert re.search(r"^\s*num_distributed_optimizer_instances \.+ 2$", output, re.MULTILINE)
    assert len(re.findall(r"iteration\s+\d+/\s*2 \|", output)) == 2
    assert (save / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()


def test_one_log_line_gives_replicas_and_bytes_per_parameter(replicated: tuple[Path, str]) -> None:
    _, output = replicated
    lines = re.findall(r"^.*ttp: distributed optimizer with .*$", output, re.MULTILINE)
    assert lines == ["[ft_plugins.ttp rank 0] INFO ttp: distributed optimizer with 2 replicas over data-parallel "
                     "size 4 (instances of 2 ranks): optimizer state 12.00 bytes per parameter with mixed "
                     "precision, against 8.00 unreplicated"]


def test_builtin_engine_serves_the_distributed_optimizer(replicated: tuple[Path, str]) -> None:
    _, output = replicated
    assert "engine is off for this run" not in output


def test_without_the_import_megatron_keeps_one_instance(tmp_path: Path) -> None:
    output = _pretrain(tmp_path, "--no-ft-plugins-import", FT_PLUGINS="ttp", FT_PLUGINS_TTP_ENGINE="builtin")
    assert _groups(tmp_path) == {rank: ([0, 1, 2, 3], []) for rank in range(4)}
    assert "ttp: distributed optimizer with" not in output


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    """Megatron's own argument handling under ft_plugins, one process for every case."""
    wanted = {
        "flag_wins": {"world": 4, "replicas": "2", "strict": True,
                      "argv": ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4"]},
        "flag_one_wins": {"world": 4, "replicas": "2", "strict": False,
                          "argv": ["--use-distributed-optimizer", "--num-distributed-optimizer-instances=1"]},
        "bad_strict": {"world": 4, "replicas": "3", "strict": True, "argv": ["--use-distributed-optimizer"]},
        "bad_lenient": {"world": 4, "replicas": "3", "strict": False, "argv": ["--use-distributed-optimizer"]},
        "auto_odd": {"world": 3, "replicas": "auto", "strict": True, "argv": ["--use-distributed-optimizer"]},
        "four": {"world": 8, "replicas": "4", "strict": True, "argv": ["--use-distributed-optimizer"]},
        "plain_optimizer": {"world": 4, "replicas": "2", "strict": True, "argv": []},
    }
    result = subprocess.run([PYTHON, str(CASES_ENTRY), json.dumps(list(wanted.values()))], capture_output=True,
                            text=True, timeout=300, env=fake_env(Path("/dev/null")))
    found = [json.loads(line[5:]) for line in result.stdout.splitlines() if line.startswith("CASE ")]
    assert result.returncode == 0 and len(found) == len(wanted), (result.stdout + result.stderr)[-4000:]
    return dict(zip(wanted, found))


def test_a_flag_the_user_passed_wins(cases: dict[str, dict]) -> None:
    assert cases["flag_wins"]["instances"] == 4 and cases["flag_wins"]["error"] is None
    assert cases["flag_wins"]["log"] == ["INFO ttp: --num-distributed-optimizer-instances 4 given on the command "
                                         "line: it wins over FT_PLUGINS_TTP_REPLICAS"]
    assert cases["flag_one_wins"]["instances"] == 1


def test_replicas_data_parallel_cannot_take_fail_before_training_when_strict(cases: dict[str, dict]) -> None:
    case = cases["bad_strict"]
    assert case["error"] == ("ReplicaLayoutError: ttp: FT_PLUGINS_TTP_REPLICAS=3: data-parallel size 4 cannot be "
                             "split into 3 optimizer replicas; use a divisor of 4 (1, 2, 4) or 'auto' (or leave "
                             "replicas to megatron with --num-distributed-optimizer-instances)")
    assert case["log"] == []


def test_replicas_data_parallel_cannot_take_warn_and_run_unreplicated_otherwise(cases: dict[str, dict]) -> None:
    case = cases["bad_lenient"]
    assert case["instances"] == 1 and case["error"] is None
    warning, summary = case["log"]
    assert warning.startswith("WARNING ttp: data-parallel size 4 cannot be split into 3 optimizer replicas")
    assert "every optimizer shard has a single holder" in warning
    assert summary.startswith("INFO ttp: distributed optimizer with 1 replica over data-parallel size 4 ")
    assert summary.endswith("8.00 bytes per parameter with mixed precision, against 8.00 unreplicated")
    assert case["refusal"] == "", "the dump serves the distributed optimizer (test_replicated_dump.py)"


def test_auto_with_odd_data_parallel_warns_of_single_holders(cases: dict[str, dict]) -> None:
    case = cases["auto_odd"]
    assert case["instances"] == 1 and case["error"] is None
    assert case["log"][0].startswith("WARNING ttp: optimizer state is not replicated: every optimizer shard has "
                                     "a single holder") and "(data-parallel size 3 is not divisible by 2)" in case["log"][0]


def test_explicit_count_and_plain_optimizer(cases: dict[str, dict]) -> None:
    assert cases["four"]["instances"] == 4
    assert cases["four"]["log"] == ["INFO ttp: distributed optimizer with 4 replicas over data-parallel size 8 "
                                    "(instances of 2 ranks): optimizer state 12.00 bytes per parameter with mixed "
                                    "precision, against 6.00 unreplicated"]
    assert cases["plain_optimizer"] == {"instances": 1, "error": None, "log": [], "refusal": ""}
