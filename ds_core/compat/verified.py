"""The DeepSpeed bodies each change inside DeepSpeed was read against, by fingerprint (ds_core.compat.fingerprint),
per tested release of the support matrix (stacks/): what a change's Bodies gate (ds_core.compat.gates) decides by.

{"module:qualname" of the body a change replaces or mends: {fingerprint: the release it was read in}}.
- VERIFIED: bodies the change is right for: it applies.
- FIXED: bodies of a release that has the fix a change makes for an older one: it is not needed there.
Any other fingerprint in the installed DeepSpeed refuses the change (its own path runs, one line says so). Each fix's
entries are held to the behaviour they stand for by the probes of ds_core.compat.deepspeed_behaviour
(tests/test_changes_gating.py: the fault is there exactly where the change applies).
To add a release: read each body below in it against the change's code and docstring, then record what
`python -m ds_core.compat.fingerprint DEEPSPEED_SOURCE_ROOT` prints, under VERIFIED or FIXED.
"""
from __future__ import annotations

LATEST = "DeepSpeed 0.19.8"
FORK = "Habana's fork 0.16.1 (release 1.21.0)"

VERIFIED: dict[str, dict[str, str]] = {
    # flat_grad_norm_bf16: the per-parameter fp32 views of fp32_groups_gradients (the same body in both)
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer.get_grads_for_norm": {"ecdd83e4ea428792": f"{LATEST}, {FORK}"},
    # flat_grad_norm_zero: float64 norm per view, float64 sum of squares, float32 before the all-reduce, -1 mask
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_grad_norm_direct": {
        "28d2038dcb0f8868": LATEST, "474ded403870d603": FORK},
    # device_clip: coefficient max_norm / (norm + eps), applied where < 1 (0.16's also takes use_graph)
    "deepspeed.runtime.utils:clip_tensors_by_global_norm": {"b881968ce91f6149": LATEST, "3db9fbd4baae280a": FORK},
    # one_op_grad_hook: copy to fp32, then add, then mark (0.19 adds the AutoEP folding branch, left to DeepSpeed)
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer._update_hp_grad": {
        "2f9a1dc221be62dc": LATEST, "f11b80d41f9a398f": FORK},
    # nonfinite_group_norm: torch.norm of the stacked group norms (0.19's combines them keeping inf: FIXED)
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.scaled_global_norm": {"07b69f1f4b24ec19": FORK},
    # cpu_gradient_buckets: buckets by legacy type string of the accelerator's device (0.19's by dtype: FIXED)
    "deepspeed.runtime.zero.stage_1_and_2:split_half_float_double": {"cad711431c15a3e3": FORK},
    # zero3_gather_waits: one async all-gather per parameter, the last handle waited for (0.19's each: FIXED)
    "deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced": {"2917618e63112cc4": FORK},
    # mpi_exports_as_given: every value in double quotes (0.19 quotes what a shell would split)
    "deepspeed.launcher.multinode_runner:MultiNodeRunner.add_export": {"c0b68fbf6253861b": FORK},
    # pdsh_remote_quoted: [source VENV;] exports, `cd CWD;`, interpreter ... --node_rank=%n ..., script, user args
    # (0.19 adds venv_script and enable_each_rank_log, the fork elastic training's flags: all between cd and script)
    "deepspeed.launcher.multinode_runner:PDSHRunner.get_cmd": {"bec8e37f1d1eaefa": LATEST, "bb429882ad5f7f5a": FORK},
    # pdsh_remote_quoted: an argument with a space wrapped in double quotes, `"` escaped (the same body in both)
    "deepspeed.launcher.multinode_runner:PDSHRunner.parse_user_args": {"966b79ccc91a3b8e": f"{LATEST}, {FORK}"},
    # universal_load_links: each parameter's hp_fragment pointed at the state buffer just filled (ends on exp_avg_sq)
    "deepspeed.utils.tensor_fragment:map_to_flat_opt_states": {"4642a228d966abf2": FORK},
}

FIXED: dict[str, dict[str, str]] = {
    # nonfinite_group_norm: combine_grad_norm_groups keeps a non-finite group's norm
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.scaled_global_norm": {"643f81499427c821": LATEST},
    # cpu_gradient_buckets: buckets by dtype (strided tensors), on any device
    "deepspeed.runtime.zero.stage_1_and_2:split_half_float_double": {"f67623f88879da8b": LATEST},
    # zero3_gather_waits: every launched handle waited for
    "deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced": {"994c129077a8c540": LATEST},
    # mpi_exports_as_given: quotes only a value matching [^\w@%+=:,./-]
    "deepspeed.launcher.multinode_runner:MultiNodeRunner.add_export": {"8180a78bd0ac3850": LATEST},
    # universal_load_links: the state fragments pointed at the buffers, hp_fragment left where it was
    "deepspeed.utils.tensor_fragment:map_to_flat_opt_states": {"9fc7eadb241afc9f": LATEST},
}
