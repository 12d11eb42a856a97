"""Process group, device and DeviceMesh of one worker, all derived from the Plan.

Ranks sit on a mesh of dims Plan.MESH_DIMS = (pp, dp, cp, tp), tp innermost, exactly as Plan.coords and
Plan.group_ranks number them, so the runtime and the planner agree on who talks to whom.

Placement: rank r runs on the device `placement[r]` names. On one machine that is any of its devices. On
several, torchrun numbers processes node by node, so rank r runs on the node that holds cluster device r
(start the nodes in the cluster's group order) and uses the local GPU its placement names there; moving a
rank to another node would need a mesh laid out over permuted process ranks, whose process groups torch 2.13
orders by process rank rather than by mesh coordinate, so launch.check_runnable refuses such placements.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fivefold.spec import MESH_DIMS, Plan


@dataclass
class Mesh:
    """This worker's place in the plan's mesh."""

    device: torch.device  # where this rank computes
    world: DeviceMesh  # the whole (pp, dp, cp, tp) mesh
    rank: int  # global rank
    coords: dict[str, int]  # this rank's coordinate on each mesh dim
    experts: DeviceMesh | None = None  # the (pp, edp, ep, etp) view of the same ranks (MoE layers, spec/folding.py)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.world.get_group(dim)

    def __getitem__(self, dim: str) -> DeviceMesh:
        return self.world[dim]


def pick_device(kind: str, plan: Plan) -> torch.device:
    """cpu, or the local GPU this rank's placement names; `auto` takes cuda when there is one."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        device_index = plan.placement[int(os.environ.get("RANK", "0"))]
        one_machine = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE")) == os.environ.get("WORLD_SIZE")
        # One machine: the plan's devices are this machine's GPUs in order; several: the index inside the node.
        local_index = device_index if one_machine else plan.cluster.slots()[device_index].local
        device = torch.device("cuda", local_index % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float | None = None) -> None:
    """Join the process group of this launch (env:// from torchrun or the elastic launcher) once; the one
    place a worker's process group starts. With `timeout_s` (--collective-timeout) every collective waits at
    most that long for a peer, on the default group AND on every group created after it (the DeviceMesh's
    dims, the checkpoint group): torch's new_group without a timeout uses the module default
    `default_pg_timeout` (30 min; 10 min for NCCL) rather than the world group's, so that default is set too."""
    if dist.is_initialized():
        return
    options: dict = {}
    if timeout_s is not None:
        import torch.distributed.distributed_c10d as c10d

        timeout = timedelta(seconds=timeout_s)
        c10d.default_pg_timeout = timeout
        if hasattr(c10d, "default_pg_nccl_timeout"):
            c10d.default_pg_nccl_timeout = timeout
        options = {"timeout": timeout, **attempt_store(timeout)}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None, **options)


def attempt_store(timeout: timedelta) -> dict:
    """Under torch's elastic agent, a store whose keys are this restart's own: the agent's TCPStore
    outlives a restart, and the groups created after the default one (DeviceMesh dims, the checkpoint
    group) are keyed by names that repeat in every incarnation, so a restarted worker would read the dead
    incarnation's addresses and fail with "Connection refused" (found on torch 2.13, 2 CPU ranks)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return {}  # a plain env:// launch
    from torch.distributed import PrefixStore, TCPStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                     is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store)
    return {"store": PrefixStore(f"/fivefold/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store),
            "rank": rank, "world_size": world}


def build_mesh(plan: Plan, device: torch.device, outer_groups: int = 1) -> Mesh:
    """The DeviceMesh of `plan` over the processes of this launch. With `outer_groups` > 1 (DiLoCo,
    runtime/diloco.py) the dp dim is cut into ("outer", "dp") = (outer_groups, dp / outer_groups): the same
    ranks in the same order, and every use of the "dp" dim stays inside one outer group."""
    world_size = dist.get_world_size()
    if world_size != plan.world_size:
        raise RuntimeError(f"the plan needs {plan.world_size} processes (dp*tp*pp*cp) but {world_size} were started")
    shape, names = plan.mesh_shape, MESH_DIMS
    if outer_groups > 1:
        at = MESH_DIMS.index("dp")
        shape = (*shape[:at], outer_groups, shape[at] // outer_groups, *shape[at + 1:])
        names = (*MESH_DIMS[:at], "outer", *MESH_DIMS[at:])
    world = init_device_mesh(device.type, shape, mesh_dim_names=names)
    rank = dist.get_rank()
    coords = plan.coords(rank)
    inner = {**coords, "dp": coords["dp"] % (plan.dp // outer_groups)}
    # The mesh must number ranks the way the plan does, or the cost model described another layout.
    assert [world.get_local_rank(dim) for dim in MESH_DIMS] == [inner[d] for d in MESH_DIMS], (coords, world)
    experts = None
    if plan.model.is_moe:
        from fivefold.runtime.expert_parallel import expert_mesh, folds_experts

        experts = expert_mesh(plan, device) if folds_experts(plan) else None
    return Mesh(device=device, world=world, rank=rank, coords=coords, experts=experts)
