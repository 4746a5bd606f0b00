"""Source files shaped like targets with no installable copy here (written by the tests)."""

from __future__ import annotations

# mindspeed_llm/training/training.py (MindSpeed-LLM 1.0 / 2.x): its own pretrain() and train()
# over train_step imported from megatron by name.
MINDSPEED_LLM_TRAINING = '''\
# coding=utf-8
# Copyright (c) 2024, HUAWEI CORPORATION.  All rights reserved.

import gc
import sys
import time

import torch

from megatron.training import get_args
from megatron.training import get_timers
from megatron.core import mpu
from megatron.training.checkpointing import save_checkpoint
from megatron.training.initialize import initialize_megatron
from megatron.training.training import (
    train_step, calc_params_l2_norm,
    evaluate_and_print_results,
    save_checkpoint_and_time, print_datetime,
)

# The earliest we can measure the start time.
_TRAIN_START_TIME = time.time()


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
    timers = get_timers()

    if args.enable_high_availability:
        raise AssertionError("High availability feature do not support core_r0.8.0")
    train_args, test_data_iterator_list = build_train_args(args, timers, train_valid_test_dataset_provider,
                                                           model_provider, model_type, forward_step_func)
    iteration, num_floating_point_operations_so_far = train(*train_args)
    return iteration


def train(forward_step_func, model, optimizer, opt_param_scheduler,
          train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config):
    """Train the model function."""
    args = get_args()
    timers = get_timers()
    iteration = args.iteration
    num_floating_point_operations_so_far = 0
    gc.disable()
    while iteration < args.train_iters:
        args.curr_iteration = iteration
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = \\
            train_step(forward_step_func,
                       train_data_iterator,
                       model,
                       optimizer,
                       opt_param_scheduler,
                       config)
        iteration += 1
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint_and_time(iteration, model, optimizer,
                                     opt_param_scheduler,
                                     num_floating_point_operations_so_far)
    return iteration, num_floating_point_operations_so_far
'''

# main.py of the ResNet-50 ImageNet example (pytorch/examples imagenet, the vendor's ResNet-50 guide).
RESNET_MAIN = '''\
import argparse
import os
import random
import shutil
import time
import warnings

import torch
import torch.nn as nn

best_acc1 = 0


def main():
    args = parser.parse_args()
    main_worker(args.gpu, 1, args)


def main_worker(gpu, ngpus_per_node, args):
    global best_acc1
    args.gpu = gpu
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), args.lr)

    # optionally resume from a checkpoint
    if args.resume:
        if os.path.isfile(args.resume):
            print("=> loading checkpoint '{}'".format(args.resume))
            if args.gpu is None:
                checkpoint = torch.load(args.resume)
            else:
                # Map model to be loaded to specified single gpu.
                loc = 'cuda:{}'.format(args.gpu)
                checkpoint = torch.load(args.resume, map_location=loc)
            args.start_epoch = checkpoint['epoch']
            best_acc1 = checkpoint['best_acc1']
            model.load_state_dict(checkpoint['state_dict'])
            optimizer.load_state_dict(checkpoint['optimizer'])
            print("=> loaded checkpoint '{}' (epoch {})"
                  .format(args.resume, checkpoint['epoch']))
        else:
            print("=> no checkpoint found at '{}'".format(args.resume))

    for epoch in range(args.start_epoch, args.epochs):
        save_checkpoint({
            'epoch': epoch + 1,
            'state_dict': model.state_dict(),
            'best_acc1': best_acc1,
            'optimizer': optimizer.state_dict(),
        }, False)


def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, 'model_best.pth.tar')


if __name__ == '__main__':
    main()
'''
