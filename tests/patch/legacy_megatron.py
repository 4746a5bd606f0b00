"""Writes a repository shaped like Megatron-LM at commit 285068c (the vendor's GPT-3 example).

``megatron/training.py`` holds ``pretrain``, ``setup_model_and_optimizer``, ``train_step`` and the
``train`` loop; ``megatron/checkpointing.py`` reads the tracker with ``read_metadata`` and writes
``iter_{:07d}/mp_rank_00/model_optim_rng.pt``; ``megatron/optimizer/`` and
``megatron/core/parallel_state.py`` complete the layout. Small enough to run on CPU with gloo:
``python pretrain_tiny.py --train-iters 4 --save DIR --save-interval 2 [--load DIR]``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

FILES = {
    "megatron/__init__.py": '''
        from .global_vars import get_args
        from .global_vars import print_rank_0
    ''',
    "megatron/global_vars.py": '''
        """Megatron global variables."""
        import argparse

        import torch

        _GLOBAL_ARGS = None


        def get_args():
            return _GLOBAL_ARGS


        def set_args(args):
            global _GLOBAL_ARGS
            _GLOBAL_ARGS = args


        def print_rank_0(message):
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print(message, flush=True)
    ''',
    "megatron/initialize.py": '''
        """Megatron initialization."""
        import argparse
        import os

        import torch

        from megatron.global_vars import set_args


        def initialize_megatron(extra_args_provider=None, args_defaults={}):
            parser = argparse.ArgumentParser()
            parser.add_argument("--train-iters", type=int, default=4)
            parser.add_argument("--save", default=None)
            parser.add_argument("--save-interval", type=int, default=None)
            parser.add_argument("--load", default=None)
            args = parser.parse_args()
            args.iteration = 0
            set_args(args)
            torch.distributed.init_process_group(
                backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    ''',
    "megatron/core/__init__.py": '''
        from megatron.core import parallel_state
        mpu = parallel_state
    ''',
    "megatron/core/parallel_state.py": '''
        """Model and data parallel groups."""
        import torch


        def get_data_parallel_rank():
            return torch.distributed.get_rank()


        def get_tensor_model_parallel_rank():
            return 0
    ''',
    "megatron/optimizer/__init__.py": '''
        from .optimizer import FP32Optimizer


        def get_megatron_optimizer(model):
            return FP32Optimizer(model)
    ''',
    "megatron/optimizer/optimizer.py": '''
        """Megatron optimizer."""
        import torch


        class FP32Optimizer:
            def __init__(self, model):
                self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

            def zero_grad(self):
                self.optimizer.zero_grad()

            def step(self, args, timers):
                self.optimizer.step()
                return True, None, None

            def state_dict(self):
                return self.optimizer.state_dict()

            def load_state_dict(self, state_dict):
                self.optimizer.load_state_dict(state_dict)
    ''',
    "megatron/checkpointing.py": '''
        """Input/output checkpointing."""

        import os

        import torch

        from megatron import get_args, print_rank_0
        from megatron.core import mpu


        def get_checkpoint_name(checkpoints_path, iteration, release=False):
            directory = 'release' if release else 'iter_{:07d}'.format(iteration)
            return os.path.join(checkpoints_path, directory,
                                f'mp_rank_{mpu.get_tensor_model_parallel_rank():02d}',
                                'model_optim_rng.pt')


        def get_checkpoint_tracker_filename(checkpoints_path):
            return os.path.join(checkpoints_path, 'latest_checkpointed_iteration.txt')


        def read_metadata(tracker_filename):
            with open(tracker_filename, 'r') as f:
                metastring = f.read().strip()
                try:
                    iteration = int(metastring)
                    release = False
                except ValueError:
                    release = metastring == 'release'
                    if not release:
                        print_rank_0('ERROR: Invalid metadata file {}. Exiting'.format(tracker_filename))
                        raise SystemExit(1)
            return iteration if not release else 0, release


        def save_checkpoint(iteration, model, optimizer, opt_param_scheduler):
            args = get_args()
            checkpoint_name = get_checkpoint_name(args.save, iteration)
            if mpu.get_data_parallel_rank() == 0:
                os.makedirs(os.path.dirname(checkpoint_name), exist_ok=True)
                torch.save({'iteration': iteration, 'model': model.state_dict(),
                            'optimizer': optimizer.state_dict()}, checkpoint_name)
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                with open(get_checkpoint_tracker_filename(args.save), 'w') as f:
                    f.write(str(iteration))
            torch.distributed.barrier()


        def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', strict=True):
            args = get_args()
            load_dir = getattr(args, load_arg)
            tracker_filename = get_checkpoint_tracker_filename(load_dir)
            if not os.path.isfile(tracker_filename):
                print_rank_0('WARNING: could not find the metadata file {}'.format(tracker_filename))
                return 0
            iteration, release = read_metadata(tracker_filename)
            state_dict = torch.load(get_checkpoint_name(load_dir, iteration, release), weights_only=False)
            model.load_state_dict(state_dict['model'], strict=strict)
            optimizer.load_state_dict(state_dict['optimizer'])
            print_rank_0(f'  successfully loaded checkpoint from {load_dir} at iteration {iteration}')
            return iteration
    ''',
    "megatron/training.py": '''
        # coding=utf-8
        # Copyright (c) 2020, NVIDIA CORPORATION.  All rights reserved.

        """Pretrain utilities."""

        from datetime import datetime
        import math
        import sys
        import time
        # The earliest we can measure the start time.
        _TRAIN_START_TIME = time.time()
        import torch

        from megatron import get_args
        from megatron import print_rank_0
        from megatron.checkpointing import load_checkpoint
        from megatron.checkpointing import save_checkpoint
        from megatron.core import mpu
        from megatron.initialize import initialize_megatron
        from megatron.optimizer import get_megatron_optimizer


        def print_datetime(string):
            """Note that this call will sync across all ranks."""
            torch.distributed.barrier()
            time_str = datetime.now().strftime('%Y-%m-%d %H:%M:%S')
            print_rank_0('[' + string + '] datetime: {} '.format(time_str))


        def pretrain(train_valid_test_dataset_provider,
                     model_provider,
                     model_type,
                     forward_step_func,
                     process_non_loss_data_func=None,
                     extra_args_provider=None,
                     args_defaults={}):
            """Main training program."""

            # Initalize and get arguments, timers, and Tensorboard writer.
            initialize_megatron(extra_args_provider=extra_args_provider,
                                args_defaults=args_defaults)

            args = get_args()
            print_datetime('after megatron is initialized')

            # Model, optimizer, and learning rate.
            model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
                model_provider, model_type)
            print_datetime('after model, optimizer, and learning rate '
                           'scheduler are built')

            train_data_iterator = train_valid_test_dataset_provider()
            iteration = train(forward_step_func,
                              model, optimizer, opt_param_scheduler,
                              train_data_iterator, None,
                              process_non_loss_data_func)
            print_datetime('after training is done')
            return iteration


        def setup_model_and_optimizer(model_provider_func, model_type):
            """Setup model and optimizer."""
            args = get_args()
            model = model_provider_func()
            optimizer = get_megatron_optimizer(model)
            opt_param_scheduler = None

            if args.load is not None:
                args.iteration = load_checkpoint(model, optimizer, opt_param_scheduler)
            else:
                args.iteration = 0
            return model, optimizer, opt_param_scheduler


        def train_step(forward_step_func, data_iterator,
                       model, optimizer, opt_param_scheduler):
            """Single training step."""
            args = get_args()
            optimizer.zero_grad()
            loss = forward_step_func(data_iterator, model)
            loss.backward()
            for param in model.parameters():
                torch.distributed.all_reduce(param.grad)
            update_successful, grad_norm, num_zeros_in_grad = optimizer.step(args, None)
            return {'lm loss': loss.item()}, not update_successful, grad_norm, None, num_zeros_in_grad


        def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler):
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler)


        def train(forward_step_func, model, optimizer, opt_param_scheduler,
                  train_data_iterator, valid_data_iterator,
                  process_non_loss_data_func):
            """Train the model function."""
            args = get_args()

            # Iterations.
            iteration = args.iteration

            while iteration < args.train_iters:
                args.curr_iteration = iteration
                loss_dict, skipped_iter, grad_norm, params_norm, num_zeros_in_grad = \\
                    train_step(forward_step_func,
                               train_data_iterator,
                               model,
                               optimizer,
                               opt_param_scheduler)
                iteration += 1
                print_rank_0(f' iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {loss_dict["lm loss"]:.6E}')

                # Checkpointing
                if args.save and args.save_interval and \\
                   iteration % args.save_interval == 0:
                    save_checkpoint_and_time(iteration, model, optimizer,
                                             opt_param_scheduler)

            return iteration
    ''',
    "pretrain_tiny.py": '''
        """Pretrain a tiny linear model with the legacy Megatron layout (CPU, gloo)."""
        import os
        import time

        import torch

        from megatron.training import pretrain

        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")


        def model_provider():
            torch.manual_seed(0)
            return torch.nn.Linear(8, 1)


        def batches():
            generator = torch.Generator().manual_seed(1)
            while True:
                yield torch.randn(4, 8, generator=generator)


        def forward_step(data_iterator, model):
            return model(next(data_iterator)).pow(2).mean()


        if __name__ == "__main__":
            pretrain(batches, model_provider, None, forward_step)
            # Drained before the interpreter ends, as ``import ft_plugins.torch`` drains Megatron's pretrain()
            # (ft_plugins/torch/clean_exit.py): left to the exit, a gloo worker thread still letting go of the last
            # collective sometimes aborts a finished job (PyTorch issue 190489). A source patch of the legacy
            # layout has no place for it.
            torch.distributed.barrier()
            time.sleep(0.1)
            torch.distributed.destroy_process_group()
    ''',
}


def write(root: Path) -> Path:
    """Write the legacy-layout repository under ``root``; returns ``root``."""
    for relpath, text in FILES.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return root
