"""What a search refuses before it starts: the checks of the model, the training and the choices the user
fixed that need no search, each naming the flag that decides. They run in microseconds whatever the cluster's
size, so an impossible request never waits for a search, and the message is not the generic "no split is valid".
"""

from __future__ import annotations

from fivefold.errors import SpecError, require
from fivefold.spec import ClusterSpec, ModelSpec, TrainSpec, divisors


def check_before_search(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, choices: object) -> None:
    """Raise SpecError for a request no split can serve; `choices` is the planner's Choices (None = free)."""
    if train.seq_len > model.max_seq_len:
        raise SpecError("--seq-len", train.seq_len, f"longer than the model allows (model.max_seq_len="
                        f"{model.max_seq_len}; context parallel does not lift that limit); use --seq-len "
                        f"{model.max_seq_len} or less, or a model with a larger max_seq_len")
    fixed = {name: getattr(choices, name, None) for name in ("dp", "tp", "pp", "cp", "ep")}
    world = cluster.world_size
    for name, degree in fixed.items():
        if degree is not None and name != "ep":
            require(world % degree == 0, f"--{name}", degree, f"must divide the cluster's {world} devices")
    tp, cp, dp, ep = fixed["tp"], fixed["cp"], fixed["dp"], fixed["ep"]
    if tp is not None:
        require(model.heads % tp == 0 and model.kv_heads % tp == 0, "--tp", tp,
                f"must divide heads={model.heads} and kv_heads={model.kv_heads}; valid: "
                f"{', '.join(str(d) for d in divisors(model.kv_heads) if model.heads % d == 0)}")
    if cp is not None and cp > 1:
        require(train.seq_len % (2 * cp) == 0, "--cp", cp, f"2*cp must divide --seq-len={train.seq_len} (context "
                                                           "parallel cuts the sequence into 2*cp chunks)")
        if getattr(choices, "cp_method", None) == "ulysses":
            per_tp = model.kv_heads // tp if tp else model.kv_heads
            require(per_tp % cp == 0, "--cp-method", "ulysses",
                    f"Ulysses splits each tp rank's {per_tp} key/value heads (kv_heads={model.kv_heads}"
                    f"{f' / tp={tp}' if tp else ''}) over cp={cp}, which does not divide them; use --cp-method "
                    "allgather or a cp that divides them")
    if dp is not None:
        require(train.global_batch % dp == 0, "--dp", dp, f"must divide --global-batch={train.global_batch}")
    if ep is not None and ep > 1:
        require(model.is_moe, "--ep", ep, f"expert parallel needs an MoE model; {model.name} is dense (experts = 0): "
                                          "use --ep 1 or leave it out")
        require(model.experts % ep == 0, "--ep", ep, f"must divide the model's {model.experts} experts; valid: "
                                                     f"{', '.join(map(str, divisors(model.experts)))}")
        require(world % ep == 0, "--ep", ep, f"must divide the cluster's {world} devices")
    etp = getattr(choices, "etp", None)
    if etp is not None and etp > 1:
        require(model.is_moe, "--etp", etp, f"expert tensor parallel needs an MoE model; {model.name} is dense: "
                                            "use --etp 1 or leave it out")
        require(model.expert_ffn_hidden % etp == 0, "--etp", etp, f"must divide the expert MLP width "
                f"{model.expert_ffn_hidden}; valid: {', '.join(map(str, divisors(model.expert_ffn_hidden)))}")
        require(world % (etp * (ep or 1)) == 0, "--etp", etp, f"--ep x --etp must divide the cluster's {world} "
                                                               "devices")
