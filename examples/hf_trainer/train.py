"""A tiny Hugging Face Trainer job (GPT-2 built from a config, synthetic tokens, CPU) for fault drills.

    torchrun --nproc-per-node 2 train.py OUT [--steps 12] [--save-steps 4] [--gradient-accumulation-steps 1] [--limit N]
        [--final FILE] [--jit-checkpoint] [--gpu]

It resumes from ``OUT`` when a checkpoint is there (``resume_from_checkpoint=True``), trains with a
constant learning rate (so a resumed run ends where an uninterrupted one does) and dropout on, and
writes the final model and optimizer state to ``--final`` for comparison. ``--gpu``: on the GPU, NCCL, with
transformers' full determinism (a run repeats bit for bit). It never imports
ft_plugins: run it under ``ft-plugins run`` (or add ``import ft_plugins.torch``) for fault tolerance.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

if os.environ.get("FT_EXAMPLE_IMPORT") == "1":
    import ft_plugins.torch  # noqa: F401  (the explicit import; ft-plugins run needs none)

# Multi-process CPU runs: transformers loads the optimizer with map_location="cpu:N", which torch cannot
# restore to; map it to the CPU (CPU only: on GPU/NPU the location is a real device).
torch.serialization.register_package(5, lambda obj: None,
                                     lambda obj, location: obj if location.startswith("cpu:") else None)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--final", default="")
    parser.add_argument("--jit-checkpoint", action="store_true", help="transformers 5's SIGTERM save")
    parser.add_argument("--gpu", action="store_true", help="on the GPU (NCCL), deterministic")
    options = parser.parse_args()
    set_seed(7)
    args = TrainingArguments(output_dir=options.out, max_steps=options.steps, save_steps=options.save_steps,
                             save_total_limit=options.limit, per_device_train_batch_size=2,
                             gradient_accumulation_steps=options.gradient_accumulation_steps, learning_rate=1e-3,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=not options.gpu,
                             ddp_backend="nccl" if options.gpu else "gloo", full_determinism=options.gpu, seed=7,
                             disable_tqdm=True, dataloader_num_workers=0,
                             **({"enable_jit_checkpoint": True} if options.jit_checkpoint else {}))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    resume = os.path.isdir(options.out) and get_last_checkpoint(options.out) is not None
    trainer.train(resume_from_checkpoint=True if resume else None)
    if options.final and trainer.args.process_index == 0:
        torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                    "step": trainer.state.global_step}, options.final)


if __name__ == "__main__":
    main()
