"""Plan: the contract between planner, simulator, runtime, checkpoints and reports.

A frozen, versioned record of how one model trains on one cluster. Ranks are laid out on a mesh of
dims MESH_DIMS = (pp, dp, cp, tp), tp innermost, so by default a tp group is consecutive devices of one
node. `placement[rank]` is the cluster device index that rank runs on.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fivefold.errors import SpecError, require
from fivefold.spec.checks import MAX_COUNT, check_table, divisors, is_int
from fivefold.spec.cluster import ClusterSpec, cluster_from_dict
from fivefold.spec.folding import ExpertRanks, check_folding, row_major_coords
from fivefold.spec.model import ModelSpec, model_from_dict
from fivefold.spec.train import TrainSpec, train_from_dict
from fivefold.spec.units import read_toml_file

PLAN_VERSION = 1
MESH_DIMS = ("pp", "dp", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")  # zero-bubble schedules: the backward runs as an input (I) and a weight (W) pass
RECOMPUTE = ("none", "selective", "full")
ZERO_LEVELS = (0, 1, 2, 3)
CP_METHODS = ("allgather", "ulysses")  # Llama 3's K/V all-gather, DeepSpeed Ulysses' all-to-all over heads


def stage_owner(schedule: str, pp: int, stage: int) -> int:
    """The pp rank that holds virtual stage `stage`: V-shaped for zbv (rank r holds r and 2*pp-1-r), looped
    otherwise (stage s on rank s % pp). The one definition: Plan, the cost model and the planner use it."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@functools.lru_cache(maxsize=1024)
def stage_owners(schedule: str, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The pp rank of every virtual stage (the planner asks for the same few shapes ~10^5 times)."""
    return tuple(stage_owner(schedule, pp, stage) for stage in range(pp * virtual_stages))


def reduced_by_ddp(dp: int, cp: int, tp: int, pp: int, zero: int, ep: int, etp: int = 1) -> bool:
    """Whether fivefold's runtime on CPU reduces this layout's gradients with DistributedDataParallel
    (bucketed, overlapped with backward) instead of FSDP2 / replicate per module: ZeRO-0 over dp x cp without
    tp or pp, with experts either replicated (ep = etp = 1) or each rank's own slice (ep x etp = dp*cp, no
    expert replicas). runtime/parallelize.py runs it and cost/host.py costs it, both from this rule."""
    replicas = dp * cp
    return replicas > 1 and zero == 0 and tp == pp == 1 and ep * etp in (1, replicas)


def reductions_overlap_on_cpu(dp: int, cp: int, tp: int, pp: int, zero: int, ep: int, micro_batches: int,
                              etp: int = 1) -> bool:
    """Whether fivefold's runtime on CPU reduces this layout's gradients while the backward still computes:
    under DistributedDataParallel (reduced_by_ddp), or through FSDP2 with its asynchronous reduce-scatter
    (runtime/parallelize.py AsyncReduceScatter) when no pipeline defers the reduction and it is the step's
    only one: ZeRO-1, or ZeRO-2/3 with one micro-batch (later micro-batches' reductions add into the
    gradient at once, so they block). cost/step.py costs the reduction overlapped exactly then."""
    if reduced_by_ddp(dp, cp, tp, pp, zero, ep, etp):
        return True
    return dp * cp > 1 and zero >= 1 and pp == 1 and (zero == 1 or micro_batches == 1)


def mesh_rank(dp_size: int, cp_size: int, tp_size: int, pp: int, dp: int, cp: int, tp: int) -> int:
    """The global rank at mesh coordinate (pp, dp, cp, tp) of a mesh with those dp, cp and tp sizes."""
    return ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp


class MeshRanks:
    """The rank arithmetic of the (pp, dp, cp, tp) mesh, tp innermost, and which pipeline rank holds which
    virtual stage: the one copy, shared by Plan and the planner's Layout (cost/layout.py)."""

    __slots__ = ()
    if TYPE_CHECKING:
        pp: int
        dp: int
        cp: int
        tp: int
        schedule: str
        virtual_stages: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a rank: {'pp': .., 'dp': .., 'cp': .., 'tp': ..}."""
        return row_major_coords(rank, MESH_DIMS, tuple(getattr(self, dim) for dim in MESH_DIMS))

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return mesh_rank(self.dp, self.cp, self.tp, pp, dp, cp, tp)

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks that share every mesh coordinate with `rank` except `dim` (its tp group, dp group, ...)."""
        coords = self.coords(rank)
        return [self.rank_of(**{**coords, dim: i}) for i in range(getattr(self, dim))]

    def pipeline_ranks(self, pp_rank: int) -> range:
        """The global ranks of pipeline rank `pp_rank` (pp is the outermost mesh dim: one contiguous block)."""
        first = self.rank_of(pp=pp_rank)
        return range(first, first + self.dp * self.cp * self.tp)

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """The global ranks of data-parallel replica `dp_rank`, every pp, cp and tp coordinate."""
        return [self.rank_of(pp=p, dp=dp_rank, cp=c, tp=t) for p in range(self.pp) for c in range(self.cp)
                for t in range(self.tp)]

    def stage_owner(self, stage: int) -> int:
        """The pp rank that holds virtual stage `stage` (module function stage_owner)."""
        return stage_owner(self.schedule, self.pp, stage)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.stage_owner(s) == pp_rank]


def default_layers_per_stage(layers: int, stages: int) -> tuple[int, ...]:
    """Even split; leftover layers go to the middle stages, since the first and last stages also carry
    the embedding and the LM head."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle_out = sorted(range(stages), key=lambda s: (s in (0, stages - 1) and stages > 2, abs(s - (stages - 1) / 2)))
    for stage in middle_out[:extra]:
        counts[stage] += 1
    return tuple(counts)


def check_stage_layers(layers_per_stage: tuple[int, ...]) -> None:
    """A stage may hold no transformer layer only when it still holds something: the first stage the
    embedding, the last one the head (the Zero Bubble and vocabulary-parallel papers' layouts)."""
    counts = list(layers_per_stage)
    require(all(n >= 0 for n in counts), "plan.layers_per_stage", counts, "layer counts cannot be negative")
    empty_middle = [s for s, n in enumerate(counts) if n == 0 and 0 < s < len(counts) - 1]
    require(not empty_middle, "plan.layers_per_stage", counts,
            f"stage {empty_middle[0] if empty_middle else 0} would hold nothing: only the first stage (embedding "
            "alone) or the last (head alone) may have 0 layers")


@dataclass(frozen=True)
class Plan(MeshRanks, ExpertRanks):
    model: ModelSpec  # what is trained
    cluster: ClusterSpec  # where it is trained
    train: TrainSpec  # sequence length, global batch, dtype, optimizer
    dp: int = 1  # data-parallel degree (replicas, or shards under ZeRO/FSDP)
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree (ranks per pipeline)
    cp: int = 1  # context-parallel degree (sequence split inside attention)
    cp_method: str = "allgather"  # allgather (K/V all-gathered) | ulysses (all-to-all sequence <-> heads)
    ep: int = 1  # expert-parallel degree, folded over tp x cp x dp (MoE only; spec/folding.py)
    etp: int = 1  # expert tensor-parallel degree: each expert's matrices split over etp ranks (MoE only)
    zero: int = 0  # 0 = replicated, 1 = optimizer, 2 = +gradients, 3 = +parameters (FSDP)
    micro_batch: int = 1  # sequences per micro-batch on one replica
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zb-h1 | zbv
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved: >= 2, zbv: 2)
    layers_per_stage: tuple[int, ...] = ()  # one entry per virtual stage, in model order; () = even
    recompute: str = "none"  # activation recompute: none | selective | full
    sequence_parallel: bool = False  # shard norms/dropout activations over tp (needs tp > 1)
    vocab_parallel: bool = False  # embedding, output layer and loss split over the pp ranks (needs pp > 1)
    placement: tuple[int, ...] = ()  # rank -> cluster device index; () = identity
    replica_micro_batches: tuple[int, ...] = ()  # micro-batches per dp replica when uneven; () = even
    version: int = PLAN_VERSION  # format version of this record

    def __post_init__(self) -> None:
        self.check_degrees()  # before anything computes with them
        if not self.layers_per_stage and self.model.layers >= self.num_stages > 0:
            object.__setattr__(self, "layers_per_stage",
                               default_layers_per_stage(self.model.layers, self.num_stages))
        if not self.placement and self.world_size == self.cluster.world_size:
            object.__setattr__(self, "placement", tuple(range(self.world_size)))
        object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "replica_micro_batches", tuple(self.replica_micro_batches))
        self.validate()

    # --- derived quantities -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per replica per step (the largest one when replicas are uneven)."""
        if self.replica_micro_batches:
            return max(self.replica_micro_batches)
        return self.train.global_batch // (self.dp * self.micro_batch)

    def micro_batches_of_replica(self, dp_rank: int) -> int:
        if self.replica_micro_batches:
            return self.replica_micro_batches[dp_rank]
        return self.num_micro_batches

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in MESH_DIMS)

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("-ulysses" if self.cp_method == "ulysses" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        text = " ".join(parts) + f" mb{self.micro_batch}x{self.num_micro_batches}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else "")
        text += f" zero{self.zero} rc={self.recompute}"
        return text + (" sp" if self.sequence_parallel else "") + (" vocab-parallel" if self.vocab_parallel else "")

    # --- validation ---------------------------------------------------------------------------
    def check_degrees(self) -> None:
        """Integers (not booleans or floats) in range, so the derived quantities can be computed."""
        for dim in ("dp", "tp", "pp", "cp", "ep", "etp", "micro_batch", "virtual_stages", "zero", "version"):
            value = getattr(self, dim)
            require(is_int(value), f"plan.{dim}", value, f"must be an integer, not a {type(value).__name__}")
            if dim not in ("zero", "version"):
                require(value >= 1, f"plan.{dim}", value, "must be an integer >= 1")
                require(value <= MAX_COUNT, f"plan.{dim}", value, f"must be at most {MAX_COUNT:,}")
        for flag in ("sequence_parallel", "vocab_parallel"):
            require(isinstance(getattr(self, flag), bool), f"plan.{flag}", getattr(self, flag), "must be true or false")
        for name in ("layers_per_stage", "placement", "replica_micro_batches"):
            values = getattr(self, name)
            require(isinstance(values, (list, tuple)), f"plan.{name}", values, "must be a list of integers")
            if not all(is_int(value) for value in values):
                raise SpecError(f"plan.{name}", list(values)[:16], "must be a list of integers")
        require(len(self.placement) <= MAX_COUNT, "plan.placement", len(self.placement), "is far too long")

    def validate(self) -> None:
        m, t = self.model, self.train
        self.check_degrees()
        require(self.version == PLAN_VERSION, "plan.version", self.version,
                f"this fivefold reads plan version {PLAN_VERSION}")
        world = self.cluster.world_size
        if self.world_size != world:
            inner = self.tp * self.pp * self.cp
            hint = f"; e.g. dp={world // inner}" if world % inner == 0 else ""
            raise SpecError("plan.dp*tp*pp*cp", self.world_size, f"degrees must multiply to the cluster's {world} "
                            f"devices (dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}){hint}")
        require(m.heads % self.tp == 0, "plan.tp", self.tp, f"must divide model.heads={m.heads}; "
                f"valid: {', '.join(map(str, divisors(m.heads)))}")
        require(m.kv_heads % self.tp == 0, "plan.tp", self.tp, f"must divide model.kv_heads={m.kv_heads}; "
                f"valid: {', '.join(map(str, divisors(m.kv_heads)))}")
        ffn = m.expert_ffn_hidden if m.is_moe else m.ffn_hidden
        require(ffn % self.tp == 0, "plan.tp", self.tp, f"must divide the MLP width {ffn}")
        require(self.cp_method in CP_METHODS, "plan.cp_method", self.cp_method, f"use one of {', '.join(CP_METHODS)}")
        if self.cp > 1:
            # 2*cp chunks, rank r holding chunks r and 2*cp-1-r, balance the causal attention work.
            require(t.seq_len % (2 * self.cp) == 0, "train.seq_len", t.seq_len,
                    f"must be divisible by 2*cp={2 * self.cp} (context parallel cuts the sequence into 2*cp chunks)")
        if self.cp > 1 and self.cp_method == "ulysses":
            for field, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)):
                per_tp = heads // self.tp if heads % self.tp == 0 else heads
                require(per_tp % self.cp == 0, "plan.cp", self.cp,
                        f"ulysses splits attention heads over cp: model.{field}={heads} / tp={self.tp} = {per_tp} "
                        f"per tp rank is not divisible by cp={self.cp}; use --cp-method allgather")
        if t.seq_len > m.max_seq_len:
            table = "the learned position table" if m.position == "learned" else "what the model is built for"
            # Also under cp: each rank embeds or rotates the global positions of its chunks, up to seq_len - 1.
            beyond = f"; context parallel (cp={self.cp}) does not lift that limit" if self.cp > 1 else ""
            raise SpecError("train.seq_len", t.seq_len, f"longer than {table} (model.max_seq_len={m.max_seq_len})"
                            f"{beyond}; use --seq-len {m.max_seq_len} or less, or a model with a larger max_seq_len")
        check_folding(m, self.tp, self.cp, self.dp, self.ep, self.etp)
        require(self.zero in ZERO_LEVELS, "plan.zero", self.zero, "use 0, 1, 2 or 3 (3 = FSDP)")
        require(self.recompute in RECOMPUTE, "plan.recompute", self.recompute, f"use one of {', '.join(RECOMPUTE)}")
        require(self.schedule in SCHEDULES, "plan.schedule", self.schedule, f"use one of {', '.join(SCHEDULES)}")
        if self.schedule == "interleaved-1f1b":
            require(self.virtual_stages >= 2, "plan.virtual_stages", self.virtual_stages,
                    "interleaved-1f1b needs 2 or more virtual stages per rank")
        elif self.schedule == "zbv":
            require(self.virtual_stages == 2, "plan.virtual_stages", self.virtual_stages,
                    "zbv places exactly 2 stages on each rank (a V shape)")
        else:
            require(self.virtual_stages == 1, "plan.virtual_stages", self.virtual_stages,
                    f"{self.schedule} uses 1; virtual stages need interleaved-1f1b or zbv")
        if self.sequence_parallel:
            require(self.tp > 1, "plan.sequence_parallel", True, "needs tp > 1")
        if self.vocab_parallel:
            require(self.pp > 1, "plan.vocab_parallel", True, "splits the vocabulary over the pp ranks: needs pp > 1")
        if not self.layers_per_stage:
            require(m.layers >= self.num_stages, "plan.pp", self.pp,
                    f"pp x virtual_stages = {self.num_stages} stages but the model has {m.layers} layers; give "
                    "--layers-per-stage with 0 for a stage holding only the embedding (first) or the head (last)")
        require(len(self.layers_per_stage) == self.num_stages, "plan.layers_per_stage", list(self.layers_per_stage),
                f"needs one entry per stage ({self.num_stages} = pp x virtual_stages)")
        check_stage_layers(self.layers_per_stage)
        require(sum(self.layers_per_stage) == m.layers, "plan.layers_per_stage", list(self.layers_per_stage),
                f"sums to {sum(self.layers_per_stage)} but model.layers={m.layers}")
        if self.replica_micro_batches:
            require(len(self.replica_micro_batches) == self.dp, "plan.replica_micro_batches",
                    list(self.replica_micro_batches), f"needs one entry per dp replica ({self.dp})")
            require(all(n >= 1 for n in self.replica_micro_batches), "plan.replica_micro_batches",
                    list(self.replica_micro_batches), "every replica needs at least one micro-batch")
            total = sum(self.replica_micro_batches) * self.micro_batch
            require(total == t.global_batch, "plan.replica_micro_batches", list(self.replica_micro_batches),
                    f"sum x micro_batch = {total} but train.global_batch={t.global_batch}")
        else:
            per_step = self.dp * self.micro_batch
            require(t.global_batch % per_step == 0, "plan.micro_batch", self.micro_batch,
                    f"dp x micro_batch = {per_step} must divide train.global_batch={t.global_batch}")
        if self.schedule == "interleaved-1f1b" and self.pp > 1:
            require(self.num_micro_batches % self.pp == 0, "plan.micro_batch", self.micro_batch,
                    f"interleaved-1f1b needs micro-batches per replica ({self.num_micro_batches}) "
                    f"divisible by pp={self.pp}")
        require(sorted(self.placement) == list(range(world)), "plan.placement", list(self.placement)[:16],
                f"must list each of the {world} cluster devices exactly once")

    # --- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        plan = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("model", "cluster", "train", "version")}
        plan = {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}
        if not plan["replica_micro_batches"]:
            del plan["replica_micro_batches"]
        if plan["placement"] == list(range(self.world_size)):
            del plan["placement"]  # identity, the default
        if not plan["vocab_parallel"]:
            del plan["vocab_parallel"]  # the default; plan files written before the field stay identical
        plan["num_micro_batches"] = self.num_micro_batches  # informative; checked on load
        return {"version": self.version, "plan": plan, "model": self.model.to_dict(),
                "train": self.train.to_dict(), "cluster": self.cluster.to_dict()}

    def to_toml(self) -> str:
        import tomli_w

        return "# fivefold plan: " + self.describe() + "\n" + tomli_w.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    def replace(self, **changes: object) -> Plan:
        """A copy with some fields changed; derived defaults are recomputed unless given."""
        if any(k in changes for k in ("pp", "virtual_stages", "schedule")) and "layers_per_stage" not in changes:
            changes["layers_per_stage"] = ()
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # Plan.__post_init__ checks them


def plan_from_dict(data: dict) -> Plan:
    check_table(data, "plan", "a plan file is a TOML document with [plan], [model], [train] and [cluster] tables")
    for key in ("plan", "model", "train", "cluster"):
        require(isinstance(data.get(key), dict), key, data.get(key), f"the plan file needs a [{key}] table")
    fields = dict(data["plan"])
    expected_micro_batches = fields.pop("num_micro_batches", None)
    known = {f.name for f in dataclasses.fields(Plan)} - {"model", "cluster", "train", "version"}
    for key in fields:
        require(key in known, f"plan.{key}", fields[key], f"unknown field; known: {', '.join(sorted(known))}")
    for key in ("layers_per_stage", "placement", "replica_micro_batches"):
        if key in fields:
            require(isinstance(fields[key], list), f"plan.{key}", fields[key], "must be a list of integers")
            fields[key] = tuple(fields[key])
    plan = Plan(model=model_from_dict(data["model"]), cluster=cluster_from_dict(data["cluster"]),
                train=train_from_dict(data["train"]), version=data.get("version", PLAN_VERSION), **fields)
    if expected_micro_batches is not None:
        require(expected_micro_batches == plan.num_micro_batches, "plan.num_micro_batches", expected_micro_batches,
                f"global_batch / (dp x micro_batch) gives {plan.num_micro_batches}")
    return plan


def load_plan(path: str | Path) -> Plan:
    return plan_from_dict(read_toml_file(path, "--plan"))
