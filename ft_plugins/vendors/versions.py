"""The minimum versions ft_plugins relies on, in one place: the features' own checks and messages and
``ft-plugins doctor`` read them here, so they cannot disagree."""

from __future__ import annotations

MEGATRON_CORE = "0.8"  # megatron.training with train_step / save_checkpoint / load_checkpoint as hooked
TORCH = "2.1"
TORCH_NPU_MSTX = "2.1"  # torch_npu.npu.mstx, the mstx ranges
MINDSPORE = "2.7.0"  # TTP and link failover through MS_ENABLE_TFT
MINDFORMERS = "1.3"
MINDIO_TFT_API = "6.0"  # MindCluster release whose mindio_ttp has the tft_* API (dying-gasp checkpoints)
MINDIO_LINK_FAILOVER = "7.1.RC1"  # mindio_ttp needed for MindSpore's link failover (TSP)

# (distribution, minimum or None, what needs it): what doctor checks
FRAMEWORKS = (
    ("mindspore", MINDSPORE, "MindSpore jobs (TTP, link failover)"),
    ("torch", TORCH, "PyTorch jobs"),
    ("torch_npu", TORCH_NPU_MSTX, "mstx ranges on Ascend (torch_npu.npu.mstx)"),
    ("megatron-core", MEGATRON_CORE, "Megatron / MindSpeed-LLM hooks"),
    ("mindformers", MINDFORMERS, "MindFormers callbacks"),
    ("mindio_ttp", MINDIO_LINK_FAILOVER, f"link failover (dying-gasp checkpoints need MindCluster {MINDIO_TFT_API}'s "
                                         "tft_* API)"),
)
