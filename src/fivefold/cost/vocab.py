"""Vocabulary parallelism (Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary Parallelism",
arXiv 2411.05288): the input embedding, the LM head and the cross-entropy split over the pp ranks of each
pipeline, so that no stage carries a 128k-vocabulary head alone.

Every pp rank holds vocab/pp rows of the embedding and of the head (one matrix when they are tied: a rank's
slice of both is the same rows) and, for EVERY micro-batch, computes its slice of the head's GEMM and of the
loss, and its slice of the embedding lookup. What that costs per micro-batch on each rank, over the pp group
of one pipeline (the paper's Algorithm 2, the one with the fewest communication barriers):

| term (VocabParallelComm)  | pass     | collective over the pp group                      | bytes              |
|---------------------------|----------|---------------------------------------------------|--------------------|
| head_input_broadcast      | forward  | broadcast of the last layer's output X            | tokens x h x e     |
| softmax_stats_all_reduce  | forward  | all-reduce of each token's max and sum of exp     | tokens x 2 x 4     |
| head_grad_all_reduce      | backward | all-reduce of the input gradient of X             | tokens x h x e     |
| embedding_all_reduce      | forward  | all-reduce of the partial embedding outputs       | tokens x h x e     |
| embedding_grad_broadcast  | backward | broadcast of the embedding output's gradient      | tokens x h x e     |

tokens = micro_batch x seq_len / cp, h the hidden size (its sequence shard, / tp, under sequence parallel),
e the training dtype's bytes. A broadcast is costed as half a ring all-reduce (NCCL's ring broadcast moves
the message once around the ring; an all-reduce moves it twice). The paper overlaps these collectives with
transformer-layer compute; fivefold's runtime issues them in the passes, so they are counted exposed, on the
rank's forward and input-gradient time (a conservative bound; `estimate` names them as `vocab_comm`).
The compute is the head's and embedding's own terms (cost/layer.py) with the vocabulary cut pp x tp ways.
Memory: the vocabulary rows of both ends / pp on every rank (cost/layout.py stage_params) and the logits
working memory of a vocab/pp slice on every rank instead of the whole vocabulary on the last one (step.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from fivefold.cost.cache import IdentityCache
from fivefold.cost.comm import GroupLink, Topology, all_reduce_time
from fivefold.cost.passwork import ZERO_PASS, PassCost

if TYPE_CHECKING:
    from fivefold.cost.layout import Layout


class VocabParallelComm(NamedTuple):
    """Seconds of each collective of vocabulary parallelism for one micro-batch on one pp rank."""

    head_input_broadcast: float
    softmax_stats_all_reduce: float
    head_grad_all_reduce: float
    embedding_all_reduce: float
    embedding_grad_broadcast: float

    @property
    def forward(self) -> float:
        return self.head_input_broadcast + self.softmax_stats_all_reduce + self.embedding_all_reduce

    @property
    def backward(self) -> float:
        return self.head_grad_all_reduce + self.embedding_grad_broadcast

    @property
    def total(self) -> float:
        return self.forward + self.backward


def broadcast_time(num_bytes: float, link: GroupLink) -> float:
    """A ring broadcast: the message goes once around the ring, half of a ring all-reduce's traffic."""
    return all_reduce_time(num_bytes, link) / 2


def vocab_parallel_comm(layout: Layout, pp_link: GroupLink, element_bytes: int) -> VocabParallelComm:
    """The table in the module docstring, for one micro-batch of `layout` over the pp group `pp_link`."""
    tokens = layout.micro_batch * layout.train.seq_len // layout.cp
    hidden = tokens * layout.model.hidden * element_bytes / (layout.tp if layout.sequence_parallel else 1)
    return VocabParallelComm(
        head_input_broadcast=broadcast_time(hidden, pp_link),
        softmax_stats_all_reduce=all_reduce_time(tokens * 2 * 4, pp_link),
        head_grad_all_reduce=all_reduce_time(hidden, pp_link),
        embedding_all_reduce=all_reduce_time(hidden, pp_link),
        embedding_grad_broadcast=broadcast_time(hidden, pp_link))


def comm_pass(comm: VocabParallelComm) -> PassCost:
    """The collectives as a PassCost: forward ones on the forward, backward ones on the input gradient."""
    return ZERO_PASS._replace(forward=comm.forward, backward_input=comm.backward)


_PP_LINKS: IdentityCache[GroupLink] = IdentityCache(4096)


def pp_group_link(layout: Layout, topology: Topology) -> GroupLink:
    """The slowest pp group's link (the pp ranks sharing dp, cp and tp coordinates), cached per topology:
    groups are looked at for every (dp, cp, tp) coordinate of the first pp rank, at most 64."""
    key = (layout.dp, layout.tp, layout.pp, layout.cp, layout.placement)
    cached = _PP_LINKS.get(topology, key)
    if isinstance(cached, GroupLink):
        return cached
    links = []
    for offset in list(layout.pipeline_ranks(0))[:64]:
        ranks = [offset + stage * layout.dp * layout.cp * layout.tp for stage in range(layout.pp)]
        devices = [layout.placement[r] for r in ranks] if layout.placement else ranks
        links.append(topology.group_link(devices))
    slowest = max(links, key=lambda link: (all_reduce_time(2.0**26, link), link.size))
    return _PP_LINKS.put(topology, key, slowest)


def vocab_share(pp: int, vocab_parallel: bool) -> int:
    """Ways the vocabulary rows of the embedding, head and loss are split beyond tp: pp, or 1."""
    return pp if vocab_parallel and pp > 1 else 1
