"""MindFormers' own launch path on CPU: ``fixtures/run_mindformer.py`` (run_mindformer.py's train path) on a task
YAML of a tiny LLaMA (1 layer, hidden 32, vocab 128, seq 16), a MindRecord of synthetic tokens, a save every 2
steps; on one process, or data parallel over msrun's workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ENTRY = Path(__file__).resolve().parent / "fixtures" / "run_mindformer.py"
LOSS_LINE = re.compile(r"Epoch:\[\s*(\d+)/\s*\d+\], step:\[\s*(\d+)/\s*\d+\], loss:\[([0-9.]+)/")
DATA_PARALLEL = ("\nparallel: {parallel_mode: 0, gradients_mean: True, enable_parallel_optimizer: False, "
                 "full_batch: False}")

YAML = """
seed: 0
output_dir: './output'
load_checkpoint: '{load_checkpoint}'
resume_training: {resume}
run_mode: 'train'
use_parallel: {use_parallel}{parallel}
trainer: {{type: CausalLanguageModelingTrainer, model_name: 'llama'}}
runner_config: {{epochs: {epochs}, batch_size: 2, sink_mode: False, sink_size: 1, gradient_accumulation_steps: 1}}
optimizer: {{type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, learning_rate: 1.e-3}}
lr_schedule: {{type: ConstantWarmUpLR, learning_rate: 1.e-3, warmup_steps: 0, total_steps: -1}}  # runs of any length agree
train_dataset: &train_dataset
  data_loader: {{type: MindDataset, dataset_dir: '{data}', shuffle: False}}
  input_columns: ["input_ids"]
  num_parallel_workers: 1
  python_multiprocessing: False
  drop_remainder: True
  batch_size: 2
  repeat: 1
  numa_enable: False
  prefetch_size: 1
train_dataset_task: {{type: CausalLanguageModelDataset, dataset_config: *train_dataset}}
parallel_config: {{data_parallel: {data_parallel}, model_parallel: 1, pipeline_stage: 1, micro_batch_num: 1, vocab_emb_dp: True}}
micro_batch_interleave_num: 1
callbacks:
  - type: MFLossMonitor{fault_tolerance}
  - type: CheckpointMonitor
    prefix: tiny
    save_checkpoint_steps: 2
    keep_checkpoint_max: 20
    integrated_save: False
    async_save: False
context: {{mode: 1, device_target: CPU, max_call_depth: 10000, save_graphs: False}}
model:
  model_config:
    type: LlamaConfig
    batch_size: 2
    seq_length: 16
    hidden_size: 32
    num_layers: 1
    num_heads: 2
    vocab_size: 128
    multiple_of: 16
    rms_norm_eps: 1.0e-5
    bos_token_id: 1
    eos_token_id: 2
    pad_token_id: 0
    ignore_token_id: -100
    compute_dtype: float32
    layernorm_compute_type: float32
    softmax_compute_type: float32
    rotary_dtype: float32
    param_init_type: float32
    use_past: False
    use_flash_attention: False
    fused_rms_norm: False
    use_rope_slice: True
    checkpoint_name_or_path: ''
  arch: {{type: LlamaForCausalLM}}
runner_wrapper: {{type: MFTrainOneStepCell, scale_sense: 1.0, use_clip_grad: True}}
"""


def task_yaml(data: Path, epochs: int, resume: bool = False, fault_tolerance: str = "", data_parallel: int = 1) -> str:
    """The task: ``epochs`` over ``data``, resumed from ./output/checkpoint (MindFormers' own resume) or not,
    ``fault_tolerance`` appended to the callbacks, data parallel over ``data_parallel`` workers."""
    return YAML.format(load_checkpoint="./output/checkpoint" if resume else "", resume=resume, epochs=epochs, data=data,
                       fault_tolerance=fault_tolerance, use_parallel=data_parallel > 1,
                       parallel=DATA_PARALLEL if data_parallel > 1 else "", data_parallel=data_parallel)


def losses(output: str, steps_per_epoch: int) -> dict[int, str]:
    """Loss printed by MFLossMonitor at each global step (as printed: compared exactly)."""
    return {(int(e) - 1) * steps_per_epoch + int(s): loss for e, s, loss in LOSS_LINE.findall(output)}


def tokens(directory: Path, samples: int) -> Path:
    """A MindRecord of ``samples`` rows of synthetic tokens for the task (seq 16, vocab 128), in ``directory``."""
    path = directory / "tokens.mindrecord"
    subprocess.run([sys.executable, str(ENTRY), "--data", str(path), str(samples), "16", "128"], cwd=directory,
                   check=True, capture_output=True, timeout=300)
    return path
