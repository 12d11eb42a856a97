"""MoE Parallel Folding (Liu et al. 2025, Megatron-Core): the rank arithmetic of the expert layers.

Attention and the dense layers lay the ranks of one pipeline stage out as dp x cp x tp (tp innermost,
spec/plan.py MESH_DIMS). The MoE layers regroup the SAME tp*cp*dp ranks as edp x ep x etp, etp innermost,
over the same order (Megatron-Core's RankGenerator for experts, "tp-ep-dp-pp" with tp read as etp):

    stage rank s = (dp_rank * cp + cp_rank) * tp + tp_rank        (attention's order, 0 .. tp*cp*dp - 1)
    etp_rank = s % etp
    ep_rank  = (s // etp) % ep
    edp_rank = s // (etp * ep)                                      (0 .. edp - 1, edp = tp*cp*dp / (ep*etp))

    etp   ranks that split each expert's matrices (w1/w3 by column, w2 by row, like attention's tp)
    ep    ranks that split the experts: expert e lives on ep rank e // (experts / ep)
    edp   ranks that hold the same expert slice; their expert gradients are summed, never averaged

So ep may span tp ranks (tp2 ep4 on 4 ranks: the ep group is the two tp ranks of both dp replicas), and
etp = tp with ep over dp reproduces "experts split like the MLP". Example, tp2 dp2, ep2 etp1 (edp 2):

    stage rank      0    1    2    3
    attention      tp0  tp1  tp0  tp1      dp0  dp0  dp1  dp1
    experts        ep0  ep1  ep0  ep1      edp0 edp0 edp1 edp1

Pure arithmetic, no torch: the runtime (runtime/expert_parallel.py), the cost model and the planner read
the same groups from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fivefold.errors import require
from fivefold.spec.checks import divisors

if TYPE_CHECKING:
    from fivefold.spec.model import ModelSpec

EXPERT_DIMS = ("pp", "edp", "ep", "etp")  # outermost first, etp innermost


def row_major_coords(rank: int, dims: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    """The coordinates of `rank` on a row-major mesh (last dim innermost): the plan's and the experts' view."""
    out = {}
    for dim, size in reversed(list(zip(dims, sizes))):
        rank, out[dim] = divmod(rank, size)
    return {dim: out[dim] for dim in dims}


def check_folding(model: ModelSpec, tp: int, cp: int, dp: int, ep: int, etp: int) -> None:
    """The folding rule, one line per refusal naming --ep / --etp and what would be valid."""
    stage = tp * cp * dp
    if not model.is_moe:
        require(ep == 1, "plan.ep", ep, "--ep: expert parallelism needs an MoE model (model.experts > 0); use 1")
        require(etp == 1, "plan.etp", etp, "--etp: expert tensor parallelism needs an MoE model "
                                            "(model.experts > 0); use 1")
        return
    require(model.experts % ep == 0, "plan.ep", ep, f"--ep must divide model.experts={model.experts}; valid: "
            f"{', '.join(str(d) for d in divisors(model.experts) if stage % (d * etp) == 0)}")
    require(model.expert_ffn_hidden % etp == 0, "plan.etp", etp, f"--etp must divide the expert MLP width "
            f"{model.expert_ffn_hidden}; valid: {', '.join(map(str, _valid_etp(model, stage, ep)))}")
    require(stage % (ep * etp) == 0, "plan.ep", ep,
            f"--ep x --etp = {ep * etp} must divide tp*cp*dp={stage} (MoE parallel folding regroups a "
            f"stage's ranks as etp x ep x edp); valid --ep with --etp {etp}: "
            f"{', '.join(str(d) for d in divisors(model.experts) if stage % (d * etp) == 0) or 'none'}")


def _valid_etp(model: ModelSpec, stage: int, ep: int) -> list[int]:
    return [d for d in divisors(model.expert_ffn_hidden) if stage % (d * ep) == 0]


class ExpertRanks:
    """The expert view of a plan's ranks (mixin over spec.plan.MeshRanks fields pp, dp, cp, tp, ep, etp)."""

    __slots__ = ()
    if TYPE_CHECKING:
        pp: int
        dp: int
        cp: int
        tp: int
        ep: int
        etp: int

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: ranks of a stage holding the same expert slice."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int, int]:
        """(pp, edp, ep, etp): a row-major mesh of this shape numbers the ranks as the plan's does."""
        return (self.pp, self.edp, self.ep, self.etp)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """{'pp': .., 'edp': .., 'ep': .., 'etp': ..} of a global rank."""
        return row_major_coords(rank, EXPERT_DIMS, self.expert_mesh_shape)

    def expert_rank_of(self, pp: int = 0, edp: int = 0, ep: int = 0, etp: int = 0) -> int:
        return ((pp * self.edp + edp) * self.ep + ep) * self.etp + etp

    def expert_group_ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks sharing every expert coordinate with `rank` except `dim` ('ep', 'etp', 'edp')."""
        coords = self.expert_coords(rank)
        size = dict(zip(EXPERT_DIMS, self.expert_mesh_shape))[dim]
        return [self.expert_rank_of(**{**coords, dim: i}) for i in range(size)]

    def experts_of_rank(self, rank: int, experts: int) -> range:
        """The experts `rank` holds (a slice of each, 1/etp of its columns, when etp > 1)."""
        local = experts // self.ep
        first = self.expert_coords(rank)["ep"] * local
        return range(first, first + local)
