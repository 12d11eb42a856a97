"""--vocab-parallel against one process: the largest relative difference of loss and global grad norm over 5 fp32
steps on CPU for every schedule and with dp, tp (with and without sequence parallel), cp, zero 3, an uneven
vocabulary split, learned positions and MoE; and the wall time of each launch (docs/training.md's table).

    .venv/bin/python bench/vocab_parallel_parity.py runs/vocab-parity
"""
import dataclasses, json, sys, time
from pathlib import Path
from fivefold.runtime import RunConfig, launch
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

V258 = dataclasses.replace(PRESETS["tiny"], vocab=258, name="tiny-v258")
MODELS = {"tiny": PRESETS["tiny"], "tiny-gpt": PRESETS["tiny-gpt"], "tiny-moe": PRESETS["tiny-moe"], "v258": V258}
VP = dict(vocab_parallel=True, micro_batch=2)
PLANS = {
    2: {"pp2-zbv": ("tiny", dict(pp=2, schedule="zbv", virtual_stages=2, **VP)),
        "pp2-1f1b": ("tiny", dict(pp=2, schedule="1f1b", **VP)),
        "pp2-interleaved": ("tiny", dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, **VP)),
        "pp2-gpipe": ("tiny", dict(pp=2, schedule="gpipe", **VP)),
        "pp2-zb-h1": ("tiny", dict(pp=2, schedule="zb-h1", **VP)),
        "gpt-pp2-interleaved": ("tiny-gpt", dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, **VP)),
        "moe-pp2-1f1b": ("tiny-moe", dict(pp=2, schedule="1f1b", **VP))},
    4: {"dp2xpp2-1f1b-zero1": ("tiny", dict(dp=2, pp=2, schedule="1f1b", zero=1, **VP)),
        "tp2xpp2-interleaved-sp": ("tiny", dict(tp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                                sequence_parallel=True, **VP)),
        "tp2xpp2-zbv-nosp": ("tiny", dict(tp=2, pp=2, schedule="zbv", virtual_stages=2, sequence_parallel=False, **VP)),
        "cp2xpp2-zbv": ("tiny", dict(cp=2, pp=2, schedule="zbv", virtual_stages=2, **VP)),
        "dp2xpp2-interleaved-zero3": ("tiny", dict(dp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2, zero=3, **VP)),
        "v258-pp4-1f1b": ("v258", dict(pp=4, schedule="1f1b", **VP))},
}

def plan(world, model, **f):
    return Plan(model=MODELS[model], cluster=parse_cluster(f"1x{world}xcpu"),
                train=TrainSpec(seq_len=32, global_batch=8, dtype="fp32"), **f)

def cfg(folder, name, p):
    return RunConfig(p.to_toml(), steps=5, seed=0, device="cpu", show_progress=False, metrics_file=str(folder / f"{name}.jsonl"))

def read(folder, name):
    return [json.loads(l) for l in (folder / f"{name}.jsonl").read_text().splitlines()]

if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/vocab-parity")
    folder.mkdir(parents=True, exist_ok=True)
    t = time.time()
    launch([cfg(folder, f"ref-{m}", plan(1, m)) for m in MODELS], 1)
    print(f"refs: {time.time() - t:.1f} s", flush=True)
    for world, plans in PLANS.items():
        t = time.time()
        launch([cfg(folder, n, plan(world, m, **f)) for n, (m, f) in plans.items()], world)
        print(f"world {world}: {len(plans)} configs {time.time() - t:.1f} s", flush=True)
        for name, (model, _) in plans.items():
            ref, rec = read(folder, f"ref-{model}"), read(folder, name)
            dl = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rec, ref))
            dg = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(rec, ref))
            print(f"{name}: steps {len(rec)} max rel diff loss {dl:.1e} grad_norm {dg:.1e}", flush=True)
