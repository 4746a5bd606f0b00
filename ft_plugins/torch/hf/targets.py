"""The modules the Hugging Face integration patches, named once: every hook names its target through these."""

TRAINER = "transformers.trainer"
TRAINER_UTILS = "transformers.trainer_utils"
ACCELERATOR = "accelerate.accelerator"
OPTIMIZER = "accelerate.optimizer"
CHECKPOINTING = "accelerate.checkpointing"
# every module above: a patch set made only when transformers or accelerate is imported waits for these
MODULES = (TRAINER_UTILS, TRAINER, ACCELERATOR, OPTIMIZER, CHECKPOINTING)
