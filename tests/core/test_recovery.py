"""In-place recovery's protocol decisions (ft_plugins.recovery): what every rank decides alike from the survivors' standings."""

from __future__ import annotations

from ft_plugins.faults import Fault, parse_faults, planned
from ft_plugins.recovery import LOG, SAVE, STEP, Standing, plan, replacement, supervised

DP4 = [[0, 1, 2, 3]]
TP2_DP2 = [[0, 2], [1, 3]]


def _at(*completed: int, lost: int) -> dict[int, Standing]:
    ranks = [rank for rank in range(len(completed) + 1) if rank != lost]
    return {rank: Standing(done, 3, 4 * done, 1.5 * done) for rank, done in zip(ranks, completed)}


def test_the_newest_step_wins_and_its_lowest_holder_sends_to_every_rank_lacking_it() -> None:
    decided = plan(_at(3, 4, 4, lost=0), DP4)  # rank 1 one step behind, rank 0 replaced
    assert (decided.step, decided.sources, decided.receivers, decided.refusal) == (4, {0: 2}, {0: (0, 1)}, "")


def test_every_data_parallel_group_needs_a_surviving_holder_of_the_step() -> None:
    assert plan(_at(3, 3, 3, lost=1), TP2_DP2).sources == {0: 0, 1: 3}
    refused = plan({0: Standing(3, 3, 0, 0.0), 2: Standing(3, 3, 0, 0.0), 3: Standing(2, 3, 0, 0.0)}, TP2_DP2)
    assert refused.refusal == "no surviving holder of step 3 for ranks [1, 3]"


def test_every_rank_resumes_at_the_one_point_of_the_loop_where_the_survivors_stand() -> None:
    at_step = {0: Standing(3, 3, 0, 0.0), 2: Standing(3, 3, 0, 0.0)}  # in step 4, 3 completed
    assert plan(at_step, [[0, 1, 2]]).resume == STEP
    after_update = {0: Standing(3, 2, 0, 0.0), 2: Standing(2, 2, 0, 0.0)}  # in step 3 after / before its update
    assert (plan(after_update, [[0, 1, 2]]).resume, plan(after_update, [[0, 1, 2]]).receivers) == (LOG, {0: (1, 2)})
    saving = {0: Standing(3, 3, 0, 0.0, True), 2: Standing(3, 3, 0, 0.0, True)}
    assert plan(saving, [[0, 1, 2]]).resume == SAVE


def test_survivors_no_single_point_serves_are_refused() -> None:
    mixed = {0: Standing(3, 3, 0, 0.0, True), 2: Standing(3, 3, 0, 0.0)}  # one in the save of 3, one in step 4
    assert plan(mixed, [[0, 1, 2]]).refusal.startswith("the survivors stand where no single point of the loop serves")
    apart = {0: Standing(3, 3, 0, 0.0), 2: Standing(3, 2, 0, 0.0)}  # one in step 4, one still in step 3's end
    assert "rank 2: 3 completed at iteration 2" in plan(apart, [[0, 1, 2]]).refusal
    late_save = {0: Standing(3, 3, 0, 0.0, True), 2: Standing(2, 2, 0, 0.0, True)}
    assert plan(late_save, [[0, 1, 2]]).refusal


def test_a_torn_state_counts_as_holding_nothing() -> None:
    assert plan({0: Standing(-1, 3, 0, 0.0)}, [[0, 1]]).refusal == "no survivor holds a completed step"
    assert plan({0: Standing(-1, 3, 0, 0.0), 2: Standing(3, 3, 12, 0.0)}, [[0, 1, 2]]).receivers == {0: (0, 1)}


def test_a_standing_survives_the_store_round_trip() -> None:
    standing = Standing(4, 3, 16, 2.5e9)
    assert Standing.decode(standing.encode()) == standing


def test_the_launchers_variable_says_supervised_and_which_life_a_replacement_is() -> None:
    assert not supervised({}) and replacement({}) is None
    assert supervised({"FT_PLUGINS_RECOVERY": "0,0"}) and replacement({"FT_PLUGINS_RECOVERY": "0,0"}) is None
    assert replacement({"FT_PLUGINS_RECOVERY": "2,1"}) == (2, 1)
    assert replacement({"FT_PLUGINS_RECOVERY": "x"}) is None


def test_a_fault_fires_in_its_life_only_so_a_replacement_does_not_fire_it_again() -> None:
    env = {"FT_PLUGINS_INJECT_FAULT": "rank=1,step=2,kind=kill;rank=1,step=0,kind=hang,at=join,life=1"}
    assert planned(1, env) == (Fault(1, 2, "kill"),)
    assert planned(1, {**env, "FT_PLUGINS_RECOVERY": "1,1"}) == (Fault(1, 0, "hang", "join", 0, 1),)
    assert str(parse_faults("rank=1,step=0,kind=hang,at=join,life=1")[0]) == "rank=1,step=0,kind=hang,at=join,attempt=0,life=1"


SCRIPT = """
import gc, json, os, sys
os.environ.update(json.loads(sys.argv[1]))
from ft_plugins.launch import roles
from ft_plugins.recovery import resume_collection
roles.boot()
seen = [gc.isenabled()]
cycle = []
cycle.append(cycle)  # made before the join: frozen with the rest
resume_collection(keep_disabled=sys.argv[2] == "manual")
print(json.dumps(seen + [gc.isenabled(), gc.get_freeze_count() > 0]))
"""


def _collector(env: dict[str, str], manual: bool = False) -> list[bool]:
    """The collector in a worker booted by ``ft-plugins run``'s bootstrap: on at boot, on after the join,
    what was made before the join frozen."""
    import json
    import subprocess
    import sys

    base = {"TORCHELASTIC_RUN_ID": "job"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps({**base, **env}), "manual" if manual else ""],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def test_a_replacement_collects_nothing_until_it_joined_then_freezes_what_it_made() -> None:
    assert _collector({"FT_PLUGINS_RECOVERY": "1,1"}) == [False, True, True]
    assert _collector({"FT_PLUGINS_RECOVERY": "1,1"}, manual=True) == [False, False, True]  # --manual-gc: kept off


def test_workers_started_with_the_job_collect_as_usual() -> None:
    assert _collector({"FT_PLUGINS_RECOVERY": "0,0"}) == [True, True, False]
    assert _collector({}) == [True, True, False]
