"""Which pipeline ranks do identical work (same layers, ends of the model, chunks and device): step.py costs
each such group once. Cached: the planner asks for the same shape with many micro-batch sizes, ZeRO levels
and recompute policies."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from fivefold.cost.cache import IdentityCache
from fivefold.cost.comm import GroupLink, Topology
from fivefold.cost.layout import Layout, RankEnv


_SHAPES: IdentityCache[PipelineShape] = IdentityCache(8192)


class ShapeGroup(NamedTuple):
    """Pipeline ranks with the same layers, ends of the model, chunks and device: costed once."""

    layers: int
    first: bool  # holds the first stage (embedding)
    last: bool  # holds the last stage (LM head)
    chunks: int  # stage models on each rank
    env: RankEnv
    ranks: list[int]  # shared with the cache: never mutate


class PipelineShape(NamedTuple):
    first_ranks: list[int]  # the first device of each pp rank
    hop_links: list[GroupLink]  # the distinct links between consecutive stages on different ranks
    groups: list[ShapeGroup]


def pipeline_shape(layout: Layout, topology: Topology, envs: list[RankEnv], owners: Sequence[int],
                    block: int) -> PipelineShape:
    """The pipeline's shape (PipelineShape), cached: the planner asks for the same
    pipeline shape with many micro-batch sizes, ZeRO levels and recompute policies."""
    p = layout.pp
    # envs are built for one topology (layout.rank_envs), so they stand for it in the key.
    key = (layout.schedule, p, layout.virtual_stages, block, layout.placement, layout.layers_per_stage)
    cached = _SHAPES.get(envs, key)
    if isinstance(cached, PipelineShape):
        return cached
    first_ranks = [layout.placement[r * block] if layout.placement else r * block for r in range(p)]
    layers_of, chunks_of = [0] * p, [0] * p
    for owner, layers in zip(owners, layout.layers_per_stage):
        layers_of[owner] += layers
        chunks_of[owner] += 1
    links = {}
    for index in range(len(owners) - 1):
        a, b = owners[index], owners[index + 1]
        if a != b:
            da, db = first_ranks[a], first_ranks[b]
            link_key = (topology.node_of[da] == topology.node_of[db], topology.group_of[da], topology.group_of[db])
            if link_key not in links:
                links[link_key] = topology.pair_link(da, db)
    groups: dict[tuple, ShapeGroup] = {}
    for r in range(p):
        group_key = (layers_of[r], r == owners[0], r == owners[-1], chunks_of[r], id(envs[r]))
        if group_key not in groups:
            groups[group_key] = ShapeGroup(layers_of[r], r == owners[0], r == owners[-1], chunks_of[r], envs[r], [])
        groups[group_key].ranks.append(r)
    return _SHAPES.put(envs, key, PipelineShape(first_ranks, list(links.values()), list(groups.values())))
