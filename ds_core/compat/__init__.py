"""What the toolkit changes or reads inside the libraries it builds on, each applied by feature, in one room.

- changes.py: the list of every change inside DeepSpeed (and the two outside it its op loads go through), each with
  its stage, its one gate and its apply function, applied by one call per stage (apply_stage), switchable
  (--ds_changes, DS_TOOLKIT_CHANGES) and recorded (states(): on / off / not needed with the reason, in every run's
  summary); fork_cpu_only marks the fixes of Habana's fork on DeepSpeed's CPU accelerator that no Gaudi user meets.
- gates.py: the two kinds of gate (Bodies: the fingerprints of the DeepSpeed bodies a change replaces; Has: what it
  wraps or reads is there) and the State each change ends in (applied, not needed, refused, switched off).
  fingerprint.py computes a body's fingerprint; verified.py holds those of the bodies each change was read against,
  per tested release (VERIFIED: it applies; FIXED: the release has the fix). marks.py: the one marker of a
  replacement (__wrapped__) and the one way an attribute is replaced.
- deepspeed_behaviour.py: behaviour that differs between DeepSpeed releases, read from the installed one by probes
  (the optimizer wrapper a configuration gets, whether the comms logger's timer is cumulative, the faults of the fork
  that some changes fix, which hold verified.py's entries to the behaviour they stand for).
- The changes: flat_norm.py, group_norm.py, grad_hook.py, lazy_compile.py, zero_buckets.py, zero3_gather.py,
  universal_load.py, op_baton.py, comm_timing.py, mpi_exports.py, pdsh_quoting.py, and the two reads (reads.py,
  zero_layout.py); cached_cpu_info's code is the cache it installs, ds_core.device.cpu_info.
- hf.py: the differences between the transformers releases of the support matrix (stacks/), decided by feature;
  torch_releases.py: the same for its PyTorch releases.
The support matrix and why it has several stacks: docs/gaudi.md.
"""
