"""Training: InfoNCE loss, LoRA/QLoRA adapters or full parameters, data, sharded steps, the trainer."""
