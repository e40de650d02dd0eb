"""What the toolkit changes or reads inside the libraries it builds on, each applied by feature, in one room.

- changes.py: the list of every replacement or read of a DeepSpeed internal (the flat-buffer norm, the device clip, the
  one-op gradient hook, the Muon import, the partition layout NVLAMB / LANS read, the comm timing), what each replaces,
  the DeepSpeed versions it was checked against and its test; each is on only where the installed DeepSpeed has what
  it replaces, else DeepSpeed's own path runs and one line says so.
- flat_norm.py, grad_hook.py, lazy_compile.py, zero_layout.py: those changes.
- deepspeed_behaviour.py: behaviour that differs between DeepSpeed releases, read from the installed one (the optimizer
  wrapper a configuration gets, whether the comms logger's timer is cumulative, what a non-finite gradient norm does).
- hf.py: the differences between the transformers releases of the support matrix (stacks/), decided by feature.
The support matrix and why it has two stacks: docs/gaudi.md.
"""
