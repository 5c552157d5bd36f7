"""Fine-tuning: InfoNCE loss, LoRA/QLoRA adapters, data, sharded steps, the trainer."""
