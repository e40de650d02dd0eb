"""Benchmarks that print ratios against a baseline measured in the same run; each runs as `python -m bench.<name>`
from the repository root (h5_loader, bert_step, image_pipeline, bt_e2e, zero_memory, startup). Shared pieces live in
bench.common. bench may import anything in the project; nothing imports bench (tests/test_layering.py)."""
