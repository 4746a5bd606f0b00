"""The modules the Hugging Face integration patches, named once: every hook names its target through these."""

TRAINER = "transformers.trainer"
ACCELERATOR = "accelerate.accelerator"
