"""Tiny Megatron GPT pretraining on CPU (gloo) with ft_plugins switched on by one import.

    torchrun --nproc-per-node 2 examples/megatron_gpt/pretrain_gpt.py --train-iters 4 --save CKPT

The only ft_plugins line is ``import ft_plugins.torch`` below; everything else is an ordinary
Megatron entry script. Small defaults are put before the command-line arguments, so any
Megatron flag given on the command line wins. Extra flags of this script:
``--no-ft-plugins-import`` (run without the import), ``--ft-report-dir DIR`` (each rank writes
what every feature did to ``DIR/rank_<r>.json``) and ``--ft-sample-log DIR`` (which samples each step read).
"""

from __future__ import annotations

import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpu_shim  # noqa: E402  (megatron assumes CUDA; this maps it to the CPU)

cpu_shim.install()

if "--no-ft-plugins-import" not in sys.argv:
    import ft_plugins.torch  # noqa: E402,F401  <- the whole integration

import torch  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402

DEFAULTS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--lr-decay-style", "constant", "--train-iters", "4",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
    "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--clip-grad", "0.0",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--seed", "1234",
    "--ckpt-format", "torch", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
]


VALIDATION = 1_000_000  # the first validation sample's index: its samples are none of training's


class RandomTokens(torch.utils.data.Dataset):
    """Deterministic token sequences: sample i is the same on every run and every rank."""

    def __init__(self, size: int, seq_length: int, vocab: int, first: int = 0) -> None:
        self.size, self.seq_length, self.vocab, self.first = size, seq_length, vocab, first

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index += self.first
        generator = torch.Generator().manual_seed(index)
        return {"tokens": torch.randint(0, self.vocab, (self.seq_length + 1,), generator=generator), "index": index}


def datasets_provider(num_samples, vp_stage=None):  # one iterator per model chunk with virtual pipeline stages
    args = get_args()
    validation = RandomTokens(num_samples[1], args.seq_length, args.vocab_size, VALIDATION) if num_samples[1] else None
    return RandomTokens(max(num_samples[0], 1), args.seq_length, args.vocab_size), validation, None


datasets_provider.is_distributed = True


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts),  # MoE with --num-experts
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,  # the model chunk, with virtual pipeline stages
    )


def loss_func(loss_mask, output_tensor):
    loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    if model.training:  # a training step's samples, not an evaluation's
        log_samples(batch["index"])
    tokens = batch["tokens"] if getattr(torch.cuda, "_cpu_shim", False) else batch["tokens"].cuda()  # a real GPU
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    loss_mask = torch.ones_like(labels, dtype=torch.float)
    output = model(inputs, position_ids, None, labels=labels)
    return output, lambda out: loss_func(loss_mask, out)


def log_samples(indices) -> None:
    """With ``--ft-sample-log DIR``: which samples this rank read in which step, at which world size (one line per
    micro-batch in ``DIR/pid_<pid>.txt``), to check that every step reads exactly its global batch."""
    args = get_args()
    if not args.ft_sample_log:
        return
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.makedirs(args.ft_sample_log, exist_ok=True)
    with open(os.path.join(args.ft_sample_log, f"pid_{os.getpid()}.txt"), "a", encoding="utf-8") as handle:
        handle.write(f"{args.curr_iteration + 1} {world} {rank} {' '.join(map(str, indices.tolist()))}\n")


def extra_args(parser):
    group = parser.add_argument_group("ft_plugins example")
    group.add_argument("--no-ft-plugins-import", action="store_true")
    group.add_argument("--ft-report-dir", default=None)
    group.add_argument("--ft-sample-log", default=None)
    return parser


def write_report() -> None:
    args = get_args()
    if not args.ft_report_dir or "ft_plugins.torch" not in sys.modules:
        return
    runtime = sys.modules["ft_plugins.torch"].runtime()
    report = runtime.report() if runtime is not None else {}
    os.makedirs(args.ft_report_dir, exist_ok=True)
    path = os.path.join(args.ft_report_dir, f"rank_{torch.distributed.get_rank()}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


def single_process_defaults() -> None:
    """Allow ``python pretrain_gpt.py`` without torchrun: one rank on a free loopback port."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


if __name__ == "__main__":
    single_process_defaults()
    defaults = DEFAULTS
    # a default the command line's choice excludes: Megatron takes the run's length in iterations or in samples,
    # and megatron-core 0.19 takes a batch-size schedule or a global batch size, not both
    for given, default in (("--train-samples", "--train-iters"), ("--step-batch-size-schedule", "--global-batch-size")):
        if given in sys.argv:
            at = defaults.index(default)
            defaults = defaults[:at] + defaults[at + 2:]
    sys.argv[1:1] = defaults
    if "cfg_container" in inspect.signature(pretrain).parameters:  # megatron-core >= 0.19: config container
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        config = pretrain_cfg_container_from_args(parse_and_validate_args(extra_args_provider=extra_args))
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    else:
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 extra_args_provider=extra_args)
    write_report()
