"""What the toolkit changes or reads inside the libraries it builds on, each applied by feature, in one room.

- changes.py: the list of every change inside DeepSpeed (and the two outside it its op loads go through), each with
  its stage and apply function, applied by one call per stage (apply_stage), switchable (--ds_changes,
  DS_TOOLKIT_CHANGES) and recorded (states(): on / off / not needed with the reason, in every run's summary).
- checks.py: what each change needs from the installed DeepSpeed; deepspeed_behaviour.py: behaviour that differs
  between DeepSpeed releases, read from the installed one by probes (the optimizer wrapper a configuration gets,
  whether the comms logger's timer is cumulative, the faults of older releases that some changes fix).
- fingerprint.py, verified.py: the fingerprints of the DeepSpeed bodies a change replaces, per tested release: a
  change is on only over a body it was verified against. marks.py: the one marker of a replacement (__wrapped__).
- The changes: flat_norm.py, grad_hook.py, lazy_compile.py, zero_buckets.py, zero3_gather.py, universal_load.py,
  op_baton.py, cpu_info.py, comm_timing.py, mpi_exports.py, and the two reads (reads.py, zero_layout.py).
- hf.py: the differences between the transformers releases of the support matrix (stacks/), decided by feature;
  torch_releases.py: the same for its PyTorch releases.
The support matrix and why it has several stacks: docs/gaudi.md.
"""
