"""Shared DeepSpeed core: config, engine, the training loop, checkpoints, metrics, scaling reports, ZeRO tuning."""
