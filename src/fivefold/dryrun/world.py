"""The stand-ins a dry run needs: a fake process group of the plan's world size, fake tensors, and the
few places where torch's own code reads a tensor's value (which a fake tensor does not have).

- `fake_world(world_size, rank)`: torch.distributed on the "fake" backend
  (torch.testing._internal.distributed.fake_pg): every collective returns at once and moves no data, so
  one process plays any rank of any world size, and DeviceMesh, DTensor and FSDP2 build as they would.
- `static_pipeline(schedule, metas)`: torch.distributed.pipelining agrees with its neighbours on how to
  learn the shapes crossing stages (a vote sent over p2p, then `.item()`) and may then exchange them as
  pickled objects; with a fake group nothing arrives. The dry run gives every stage its input and output
  shapes (the "static" mode the API offers) and skips the vote.
- `value_free(fn)`: runs `fn` and stops at the first read of a tensor's value (`.item()`): the runtime's
  global gradient-norm clip allocates everything before it reads the norm, so its memory is accounted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A fake default process group in which this process is `rank` of `world_size`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (it builds a fake one)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding decisions by mesh equality, and a mesh of the next fake world equals the
    last one's but names other process groups: clear those caches between worlds."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


def value_free(fn: Callable[[], Any]) -> Any:
    """fn(), or None where it reads a value from a fake tensor (see the module docstring)."""
    try:
        return fn()
    except DataDependentOutputException:
        return None


def static_pipeline(schedule: Any, metas: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]
                    ) -> None:
    """Give each stage of `schedule` its (inputs, outputs) example tensors and skip the p2p shape vote."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        inputs, outputs = metas[stage.stage_index]
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs),
                                      input_grads=None, output_grads=None)

    def warmup(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


@contextlib.contextmanager
def swappable_fake_parameters(mode: Any) -> Iterator[None]:
    """nn.Module.to_empty swaps each fake parameter for a new one (torch.utils.swap_tensors), which refuses
    tensors with weak references, and FakeTensorMode's converter memo keeps one to every parameter made
    under it. FSDP2 and TP parameters are DTensors (their local tensors are swapped, not them); a plain model
    (no dp, no tp) hits it. The memo is only a cache of real-to-fake conversions, none of which the dry
    run needs, so it is emptied before each swap."""
    original = torch.utils.swap_tensors
    converter = mode.fake_tensor_converter.meta_converter

    def swap(first: torch.Tensor, second: torch.Tensor) -> None:
        converter.tensor_memo.clear()
        converter.storage_memo.clear()
        original(first, second)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def meshes_outside_fake() -> Iterator[None]:
    """DeviceMesh computes its (real) rank tables when the runtime cuts a sub-mesh (mesh["tp"]) or FSDP2
    joins dp and tp meshes; under FakeTensorMode those tables would meet fake tensors. They are computed
    with the fake mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    originals = [(DeviceMesh, "__init__", DeviceMesh.__init__), (DeviceMesh, "__getitem__", DeviceMesh.__getitem__),
                 (DeviceMesh, "mesh", DeviceMesh.__dict__["mesh"]),
                 (_MeshLayout, "remap_to_tensor", _MeshLayout.remap_to_tensor)]

    def outside(method: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return method(*args, **kwargs)
        return call

    for owner, name, method in originals:
        if isinstance(method, property):
            assert method.fget is not None
            setattr(owner, name, property(outside(method.fget)))
        else:
            setattr(owner, name, outside(method))
    try:
        yield
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)
