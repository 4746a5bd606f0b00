"""Whose failure is it: a collective failing because a peer was lost (``recover`` waits for its replacement),
or this rank's own error (nothing to replace: its peers are told at once and the dump follows). The frames
are compiled under the file names the real raisers have, so the traceback is what the loop meets."""

from __future__ import annotations

import os

import pytest

from ft_plugins.torch.megatron.loop import attempt

SITE = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")
C10D = os.path.join(SITE, "torch", "distributed", "distributed_c10d.py")
BUFFER = os.path.join(SITE, "megatron", "core", "distributed", "param_and_grad_buffer.py")
RERUN = os.path.join(SITE, "megatron", "core", "rerun_state_machine.py")
TRAINING = os.path.join(SITE, "megatron", "training", "training.py")
GLOO_RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4312: Connection reset by peer"


def _raiser(filename: str, name: str, body: str, namespace: dict) -> None:
    exec(compile(f"def {name}():\n    {body}\n", filename, "exec"), namespace)


def _failure(chain: list[tuple[str, str]], raised: str) -> BaseException:
    """The exception ``raised`` thrown by the last of ``chain`` (file, function) frames, each called by the one before."""
    namespace: dict = {"torch_distributed": __import__("torch.distributed").distributed}
    for index, (filename, name) in enumerate(chain):
        body = raised if index == len(chain) - 1 else f"{chain[index + 1][1]}()"
        _raiser(filename, name, body, namespace)
    try:
        namespace[chain[0][1]]()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


def _own(exc: BaseException) -> bool:
    """What the training loop's ``attempt`` makes of ``exc``: this rank's own error, or a lost peer."""
    def step() -> None:
        raise exc

    return attempt(step, (), {}, lambda: None)[2]


@pytest.mark.parametrize(("chain", "raised"), [
    ([(TRAINING, "train_step"), (C10D, "all_reduce")], f"raise RuntimeError({GLOO_RESET!r})"),
    ([(TRAINING, "train_step"), (C10D, "barrier")], "raise RuntimeError('anything')"),  # raised inside c10d
    ([(TRAINING, "train_step"), (BUFFER, "finish_grad_sync")], f"raise RuntimeError({GLOO_RESET!r})"),  # a wait
    ([(TRAINING, "train_step")], "raise torch_distributed.DistBackendError('NCCL communicator was aborted')"),
    ([(TRAINING, "train_step")], "raise torch_distributed.DistStoreError('wait timeout')"),
])
def test_a_collective_failing_is_a_lost_peer(chain: list, raised: str) -> None:
    assert not _own(_failure(chain, raised))


@pytest.mark.parametrize(("chain", "raised"), [
    # megatron's NaN/Inf gradient check (on by default): raised by its rerun state machine, called from the buffer
    ([(TRAINING, "train_step"), (BUFFER, "check_grads"), (RERUN, "validate_result")],
     "raise RuntimeError('Rank 1: found NaN in local grad norm for bucket #0 in backward pass')"),
    ([(TRAINING, "train_step"), (BUFFER, "start_grad_sync")],
     "raise AssertionError('grad_reduce_handle must be None')"),
    ([(TRAINING, "train_step")], "raise ValueError('a bad batch')"),
])
def test_a_ranks_own_error_is_its_own_even_under_megatrons_distributed_package(chain: list, raised: str) -> None:
    assert _own(_failure(chain, raised))


def test_attempt_tells_the_peers_only_for_a_lost_peer() -> None:
    told: list[str] = []

    def nan_check() -> None:
        raise _failure([(TRAINING, "train_step"), (BUFFER, "check_grads"), (RERUN, "validate_result")],
                       "raise RuntimeError('Rank 1: found NaN in local grad norm')")

    result, reason, own = attempt(nan_check, (), {}, lambda: told.append("lost"))
    assert (result, own, told) == (None, True, []) and reason == "RuntimeError: Rank 1: found NaN in local grad norm"

    def reset() -> None:
        raise _failure([(TRAINING, "train_step"), (C10D, "all_reduce")], f"raise RuntimeError({GLOO_RESET!r})")

    assert attempt(reset, (), {}, lambda: told.append("lost"))[2] is False and told == ["lost"]
