"""Distributed init and DeepSpeed engine construction for HPU (hccl), CUDA (nccl) and CPU (gloo).

The accelerator is whatever DeepSpeed's `get_accelerator()` finds (DS_ACCELERATOR forces one). Rank discovery works
under the deepspeed launcher, torchrun-style variables, and mpirun (mpi4py discovery, done by deepspeed itself), and a
plain `python -m ...` becomes a world of one.
"""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from ds_core.compat import changes
from ds_core.device import hpu
from ds_core.errors import ConfigError
from ds_core.rank.parent_watch import watch_parent
from ds_core.rank.rendezvous import free_port, rank_variables
from ds_core.rank.venv import torch_extensions_env

# Per-launcher names of "how many ranks share this node". DeepSpeed's launcher also sets CROSS_SIZE (= nodes).
_LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                    "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: int
    accelerator: str  # "cpu" | "cuda" | "hpu"
    device: torch.device
    backend: str


def _in_mpi() -> bool:
    return any(v in os.environ for v in _MPI_RANK_VARS)


SHM_DIR = Path("/dev/shm")


def cpu_shm_buffer_name(rank: int) -> str:
    """Name of the shared-memory workspace DeepSpeed's CPU allreduce op (ShareMemCommBuilder, shm.cpp) creates for a
    rank: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_cpu_shm_buffer(rank: int) -> bool:
    """Unlink this rank's DeepSpeed CPU allreduce workspace from /dev/shm; True if it was there.

    DeepSpeed 0.19 creates one ~66 MB workspace per rank when all ranks share a host (LOCAL_SIZE == world size, a
    world of one under the deepspeed launcher included) and never unlinks it (shm.cpp has a shared_close that nothing
    calls), so every CPU run, finished or killed, leaves its workspaces in /dev/shm, which is RAM: a few hundred runs
    filled 20 GB of a 24 GB machine here.
    Once every rank has passed shm_initialize (which maps each peer's workspace before returning) the names are no
    longer needed: after a barrier each rank unlinks its own, the mappings stay valid until the processes exit, and
    the kernel frees the memory when the last one does, whichever way it ends."""
    torch.distributed.barrier()  # every rank has mapped every peer's workspace
    try:
        (SHM_DIR / cpu_shm_buffer_name(rank)).unlink()
    except FileNotFoundError:  # op not built / ranks on several hosts (no shm path), or a different layout
        return False
    return True


def shutdown_distributed() -> None:
    """Destroy the process groups at the end of a run that went well; a no-op when none is initialised.

    Every entry point calls this before it returns (NCCL asks for it: torch warns at exit without it). It is not
    called on the error path, where a dead peer could make a collective-style shutdown wait. For gloo it does NOT
    stop the group's threads while anything still holds the group (DeepSpeed's engine does, until the process
    ends): ProcessGroupGloo.shutdown() is a no-op, its work and transport threads live until the C++ object dies.
    That is why a rank ends through ds_core.rank.process_end.run_main, not through interpreter finalisation.

    A barrier comes first: the ranks of a run that went well leave together, after rank 0's last writes, so a
    launcher can take a rank still running well after a peer ended for one waiting on a peer that is gone
    (launch.local_ranks.PEER_EXIT_S)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def stale_build_locks(max_age_s: float = 600) -> list[tuple[Path, float]]:
    """JIT build locks of torch extensions (DeepSpeed's ops: fused_adam, deepspeed_shm_comm, ...) older than max_age_s.

    torch.utils.cpp_extension serialises a build with a `lock` file in the op's build directory and removes it when
    the build ends; a build killed on the way (SIGKILL, OOM, a timed-out job) leaves it, and every later process that
    needs the op waits for it forever, silently, after DeepSpeed's "Loading extension module" line. A build takes
    about a minute here, so a lock much older than that is almost certainly stale."""
    import time

    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now, found = time.time(), []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # a build just finished
            continue
        if age > max_age_s:
            found.append((lock, age))
    return found


def init_distributed(timeout_s: int = 1800) -> DistInfo:
    """Initialise torch.distributed through deepspeed on the accelerator deepspeed finds; idempotent."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    watch_parent()  # a rank started by a launcher ends when the launcher dies (ds_core.rank.parent_watch)
    if "RANK" not in os.environ and not _in_mpi():
        # A single process started by hand: a world of one, on a free local port.
        os.environ.update(rank_variables(0, 1, master_port=int(os.environ.get("MASTER_PORT") or free_port())))
    # this venv's own JIT op cache, whichever launcher started the rank (DeepSpeed's pdsh runner, mpirun and srun do
    # not pass the starter's TORCH_EXTENSIONS_DIR to other nodes); a value set by the user wins
    os.environ.update(torch_extensions_env(os.environ))
    accel = get_accelerator()
    # the changes inside DeepSpeed of this stage (ds_core.compat.changes): the op build lock that names its holder,
    # py-cpuinfo's answer cached for DeepSpeed's op loads
    local_zero = os.environ.get("LOCAL_RANK", "0") == "0"
    changes.apply_stage("process_start", device_type=accel.device_name(),
                        say=(lambda line: print(line, flush=True)) if local_zero else None)
    if local_zero:
        for lock, age in stale_build_locks():
            print(f"[ds_core] warning: {lock} is {age / 60:.0f} min old: a torch extension build that held it was "
                  f"probably killed, and this run will wait for it forever when it needs that op. If no build is "
                  f"running on this machine, remove the file.", flush=True)
    # The timeout given to init_process_group covers the world group only; DeepSpeed's ZeRO groups come from
    # torch.distributed.new_group(), which reads torch's module-level defaults (30 min). Set those too, so a dead or
    # hung rank fails every collective after timeout_s.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), auto_mpi_discovery=True,
                               timeout=timedelta(seconds=timeout_s), verbose=False)
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    name = accel.device_name()
    if name != "cpu":
        accel.set_device(local_rank)
        device = torch.device(accel.device_name(local_rank))
    else:
        release_cpu_shm_buffer(rank)
        device = torch.device("cpu")
    local_world = next((int(os.environ[v]) for v in _LOCAL_SIZE_VARS if os.environ.get(v, "").isdigit()), 0)
    if not local_world:
        # No launcher told us: count ranks that share this host name.
        names: list = [None] * world
        torch.distributed.all_gather_object(names, socket.gethostname())
        local_world = names.count(socket.gethostname())
    cross_size = os.environ.get("CROSS_SIZE", "")
    nodes = int(cross_size) if cross_size.isdigit() else max(1, world // local_world)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world, nodes=nodes,
                    accelerator=name, device=device, backend=accel.communication_backend_name())


def set_seed(seed: int, rank: int = 0) -> None:
    """Seed python, numpy, torch and the accelerator with seed + rank.

    ds_core.run.setup.start_run calls set_seed(seed) before the model is built, so every rank builds the same initial
    weights. ds_core.run.components.Checkpointing.start then calls set_seed(seed, rank) for a fresh run, so dropout and
    other model randomness differ per data-parallel rank, as NVIDIA's and Habana's BERT recipes do (seed + rank): with
    one seed everywhere the ranks draw identical dropout masks. Data order never comes from these streams (the data
    modules use their own generators built from the global seed), and a resume restores each rank's own streams from its
    checkpoint."""
    seed = seed + rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    from deepspeed.accelerator import get_accelerator

    get_accelerator().manual_seed_all(seed)


def without_throughput_timer(ds_config: dict) -> dict:
    """The DeepSpeed config with DeepSpeed's throughput timer off unless the JSON sets "timers" itself. That timer
    (on by default, synchronized) synchronizes the device at every micro batch's forward and at every engine.step()
    when deepspeed.initialize got no dataloader, as here: on a GPU, two host waits per micro batch (measured on an
    H200: BERT-Large at accumulation 8 spent 68 % of its step with the GPU idle). The toolkit times its own window
    (ds_core.outputs.metrics), so the timer's figures are not used."""
    if "timers" in ds_config:
        return ds_config
    return dict(ds_config, timers={"throughput": {"enabled": False}})


def build_engine(model: torch.nn.Module, ds_config: dict, *, optimizer=None, lr_scheduler=None,
                 model_parameters=None):
    """deepspeed.initialize with a resolved config (see ds_core.config.load_ds_config); returns the engine.

    An optimizer passed here and an "optimizer" section in the DeepSpeed JSON would be the same setting in two
    places, so that combination is refused.
    """
    import deepspeed

    if optimizer is not None and "optimizer" in ds_config:
        raise ConfigError("an optimizer was built in code and the DeepSpeed config also has an \"optimizer\" section: "
                          "remove one (use a DeepSpeed JSON without \"optimizer\" for models that build their own)")
    if lr_scheduler is not None and "scheduler" in ds_config:
        raise ConfigError("an LR scheduler was built in code and the DeepSpeed config also has a \"scheduler\" "
                          "section: remove one")
    if optimizer is None and "optimizer" not in ds_config:
        raise ConfigError("no optimizer: pass one in code or add an \"optimizer\" section to the DeepSpeed config")
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    model_parameters, moved = odd_sizes_last(model, model_parameters)
    from deepspeed.accelerator import get_accelerator

    from ds_core.device.ops_check import prepare_optimizer_ops

    # the optimizer's compiled op loaded (or built) here, on every rank: where it cannot be, torch's AdamW with the
    # reason in one line, never a build error inside deepspeed.initialize
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    ds_config = prepare_optimizer_ops(ds_config, get_accelerator().device_name(), rank,
                                      say=lambda line: print(line, flush=True))
    ds_config = without_throughput_timer(ds_config)
    # the changes inside DeepSpeed (ds_core.compat.changes) of the stages around deepspeed.initialize, each where the
    # switch leaves it on and the installed DeepSpeed has (and needs) what it replaces; rank 0 says which is off
    say = (lambda line: print(line, flush=True)) if rank == 0 else None
    device_type = get_accelerator().device_name()
    changes.apply_stage("before_initialize", device_type=device_type, say=say)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters, optimizer=optimizer,
                                           lr_scheduler=lr_scheduler, config=ds_config)
    engine.flat_layout = flat_layout(moved)  # recorded in checkpoints' fingerprints (ds_core.checkpoint)
    changes.apply_stage("after_initialize", engine=engine, device_type=device_type, say=say)
    if say is not None:
        say(changes.start_line())  # every change's state, as the run's summary records it
    return engine


# Where DeepSpeed flattens a parameter group into one buffer (ZeRO-1/2's and its bf16 optimizer's bit16 groups),
# each parameter becomes a view at the running sum of the sizes before it. One parameter whose size is not a
# multiple of 8 elements (BridgeTower's 1-element logit_scale, first in its group) puts every later weight off
# 16-byte alignment, and cuBLAS then runs those GEMMs with its align1 kernels: measured on an H200, two such kernels
# took 366 ms of BridgeTower-Large's 771 ms step. DeepSpeed has no per-parameter alignment setting, so the order is
# ours: within each group, parameters of such sizes go last (stable otherwise), and every other view stays aligned.
ALIGN_ELEMENTS = 8


def odd_sizes_last(model: torch.nn.Module, model_parameters) -> tuple[list, list[str]]:
    """model_parameters (tensors, or param-group dicts) with, in each group, the parameters whose numel is not a
    multiple of ALIGN_ELEMENTS moved to the group's end; also the names of those that moved."""
    names = {id(p): n for n, p in model.named_parameters()}
    moved: list[str] = []

    def reorder(params: list) -> list:
        params = list(params)
        odd = [i for i, p in enumerate(params) if p.numel() % ALIGN_ELEMENTS]
        if odd and odd != list(range(len(params) - len(odd), len(params))):  # not already at the end
            moved.extend(names.get(id(params[i]), f"#{i}") for i in odd)
            params = [p for p in params if p.numel() % ALIGN_ELEMENTS == 0] + [params[i] for i in odd]
        return params

    model_parameters = list(model_parameters)
    if model_parameters and isinstance(model_parameters[0], dict):
        return [dict(g, params=reorder(g["params"])) for g in model_parameters], moved
    return reorder(model_parameters), moved


def flat_layout(moved: list[str]) -> str:
    """The fingerprint's name of the parameter order in the flat buffers: a checkpoint's optimizer state is stored
    in that order, so one written in another order must not load (its values would land on other parameters)."""
    return "model order" if not moved else "odd sizes last: " + ", ".join(moved)


def compile_backend() -> str:
    """The torch.compile backend of the accelerator DeepSpeed runs on ("inductor" on CUDA and CPU, "hpu_backend" on
    Gaudi, where inductor is not supported: Habana's PyTorch Support Matrix): the one every compile here takes.
    DeepSpeed's accelerators name it (get_compile_backend, in DeepSpeed 0.16.1 and Habana's fork as in 0.19);
    one without the method gets torch's default."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    return accel.get_compile_backend() if hasattr(accel, "get_compile_backend") else "inductor"


def compile_wanted(setting: str, accelerator: str = "cpu", auto_on: tuple[str, ...] = (), lazy: bool = False) -> bool:
    """TrainConfig.compile resolved. auto compiles
    - on Gaudi, every model: eager + torch.compile(backend="hpu_backend") is Habana's default and recommended
      execution (PyTorch Support Matrix; Habana's DeepSpeed BERT-1.5B script runs with --enable_torch_compile). That
      default follows Habana's guidance; the toolkit has not measured it (docs/compile.md);
    - on the accelerators a model names in `auto_on`: those where its compiled step was measured faster than the
      eager one (BERT: CUDA, an H200 at 1.51x, docs/compile.md);
    and stays eager elsewhere (on a CPU the compile costs minutes for a step of seconds).
    In Gaudi's lazy mode (`lazy`: PT_HPU_LAZY_MODE=1) nothing compiles: auto stays with lazy mode's graphs and on is
    refused (ConfigError), since Habana lists no torch.compile backend for lazy mode."""
    if setting == "off":
        return False
    why = hpu.compile_refusal(accelerator, lazy)
    if why:
        if setting == "on":
            raise ConfigError(f"--compile on: {why}. Run with PT_HPU_LAZY_MODE=0 (Habana's default execution), or "
                              "with --compile off / auto in lazy mode")
        return False
    return setting == "on" or (setting == "auto" and (accelerator == "hpu" or accelerator in auto_on))


def compile_model(engine, setting: str, *, dynamic: bool | None, auto_on: tuple[str, ...] = ()) -> bool:
    """torch.compile the engine's module when `setting` (TrainConfig.compile) says so; True if it did.

    DeepSpeed's engine.compile is the library's way: it calls module.compile(backend=the accelerator's backend,
    compile_backend()), so the engine's own forward hooks stay in the compiled call, and a DeepSpeed JSON with
    "compile": {"deepcompile": true} turns it into DeepCompile. dynamic: False for models whose batches all have one
    shape (one graph, no symbolic sizes), None for models whose shapes vary (torch recompiles once with the varying
    sizes symbolic)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    lazy = accelerator == "hpu" and hpu.lazy_mode()
    if not compile_wanted(setting, accelerator, auto_on, lazy):
        if lazy and setting == "auto" and engine.global_rank == 0:
            print("[ds_core] --compile auto: eager model in lazy mode (PT_HPU_LAZY_MODE=1, graphs cut by mark_step); "
                  "torch.compile runs on Gaudi in eager mode only", flush=True)
        return False
    if engine.zero_optimization_partition_weights() and engine.global_rank == 0:
        # measured on DeepSpeed 0.19: its ZeRO-3 gather / release hooks are torch.compiler.disable'd, so dynamo
        # breaks the graph at every submodule (the run trains, with many small graphs and recompiles)
        print("[ds_core] warning: --compile with ZeRO-3 compiles each submodule separately (DeepSpeed's parameter "
              "hooks break the graph); DeepCompile (\"compile\": {\"deepcompile\": true} in the DeepSpeed JSON) is "
              "DeepSpeed's path for ZeRO-3", flush=True)
    engine.compile(compile_kwargs={"dynamic": dynamic})
    if engine.global_rank == 0:
        why = (" (--compile auto on Gaudi: Habana's recommended execution, eager + torch.compile; not measured by "
               "this toolkit)" if setting == "auto" and accelerator == "hpu" and accelerator not in auto_on else "")
        print(f"[ds_core] torch.compile ({compile_backend()}): the model's forward through engine.compile "
              f"(dynamic={dynamic}){why}; the first steps include the compile", flush=True)
    return True
