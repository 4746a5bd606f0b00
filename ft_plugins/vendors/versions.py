"""The versions ft_plugins supports, in one place: the features' own checks and messages, ``ft-plugins doctor``
and the documentation (README's table, the site's) read them here, so they cannot disagree."""

from __future__ import annotations

from collections import namedtuple

MEGATRON_CORE = "0.8"  # megatron.training with train_step / save_checkpoint / load_checkpoint as hooked
TORCH = "2.1"
TORCH_RECOVER = "2.3"  # torch.distributed.elastic.multiprocessing.subprocess_handler: recover's replacement workers
TORCH_NPU_MSTX = "2.1"  # torch_npu.npu.mstx, the mstx ranges
MINDSPORE = "2.7.0"  # TTP and link failover through MS_ENABLE_TFT
MINDFORMERS = "1.6"  # the first that asks for a MindSpore in the range above (~=2.7.0rc1)
TRANSFORMERS = "4.40"
TRANSFORMERS_RNG_SAFE_LOAD = "4.48"  # the Trainer loads its RNG files with safe globals (torch 2.6's weights_only)
TORCH_WEIGHTS_ONLY = "2.6"  # torch.load defaults to weights_only=True
ACCELERATE = "0.30"
MINDIO_TFT_API = "6.0"  # MindCluster release whose mindio_ttp has the tft_* API (dying-gasp checkpoints)
MINDIO_LINK_FAILOVER = "7.1.RC1"  # mindio_ttp needed for MindSpore's link failover (TSP)

OLDER, INSIDE, NEWER, UNKNOWN = "older", "inside", "newer", "unknown"


# collections' namedtuple: this module is imported by every training process (see ft_plugins.config.Option)
class Framework(namedtuple("Framework", ("distribution", "oldest", "newest", "tested", "needed_for"))):
    """One framework's supported range. ``oldest``: the oldest release the hooks are written for (older ones
    turn the features off, saying so); ``newest``: the newest release line tested (``"0.19"`` covers every
    0.19.x; None where no release can be tested here); ``tested``: the releases the test suite runs."""

    __slots__ = ()
    distribution: str
    oldest: str
    newest: str | None
    tested: tuple[str, ...]
    needed_for: str

    def standing(self, found: str) -> str:
        """Where ``found`` stands against the range: OLDER, INSIDE, NEWER, or UNKNOWN when it does not parse."""
        from packaging.version import InvalidVersion, Version  # here: training processes import this module

        try:
            version = Version(found)
        except InvalidVersion:
            return UNKNOWN
        if version < Version(self.oldest):
            return OLDER
        newest = None if self.newest is None else Version(self.newest).release
        if newest is not None and version.release[:len(newest)] > newest:
            return NEWER
        return INSIDE

    def describe(self) -> str:
        """The range in words, e.g. ``4.40 to 4.57.x``; ``2.1 or newer (not tested here)`` without a newest."""
        if self.newest is None:
            return f"{self.oldest} or newer (not tested here)"
        return f"{self.oldest} to {self.newest}.x"


SUPPORTED = (
    Framework("torch", TORCH, "2.13", ("2.13.0",), "PyTorch jobs"),
    Framework("megatron-core", MEGATRON_CORE, "0.19", ("0.8.0", "0.12.1", "0.17.1", "0.19.2"),
              "Megatron / MindSpeed-LLM hooks (megatron.training)"),
    Framework("transformers", TRANSFORMERS, "5", ("4.40.2", "4.57.1", "5.24.0"), "Hugging Face Trainer hooks"),
    Framework("accelerate", ACCELERATE, "1", ("1.15.0",), "Accelerate hooks"),
    Framework("mindspore", MINDSPORE, "2.10", ("2.7.2", "2.9.0", "2.10.0"), "MindSpore jobs (TTP, link failover)"),
    Framework("mindformers", MINDFORMERS, "1.9", ("1.6.0", "1.8.0", "1.9.0"), "MindFormers callbacks and resume guard"),
    Framework("torch_npu", TORCH_NPU_MSTX, None, (), "mstx ranges on Ascend (torch_npu.npu.mstx)"),
    Framework("mindio_ttp", MINDIO_LINK_FAILOVER, None, (),
              f"link failover (dying-gasp checkpoints need MindCluster {MINDIO_TFT_API}'s tft_* API)"),
)
BY_NAME = {framework.distribution: framework for framework in SUPPORTED}


def supported(*distributions: str) -> str:
    """The named frameworks' ranges in one phrase, for the messages that say a layout is not supported."""
    return ", ".join(f"{name} {BY_NAME[name].describe()}" for name in distributions)


def table() -> str:
    """The supported-versions table in Markdown, as the README and the documentation site show it."""
    rows = [f"| `{framework.distribution}` | {framework.describe()} | "
            f"{', '.join(framework.tested) or 'not here (stand-ins of its documented API)'} | {framework.needed_for} |"
            for framework in SUPPORTED]
    header = ["| framework | supported | tested by the suite | needed for |", "| --- | --- | --- | --- |"]
    return "\n".join([*header, *rows])
