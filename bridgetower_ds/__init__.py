"""BridgeTower contrastive fine-tuning with host and device image pipelines."""
