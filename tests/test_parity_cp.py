"""Context parallel computes the same training run: per-step loss and global gradient norm of 5 fp32 steps
on CPU/gloo match the single-process run within 1e-5 relative, with and without --document-mask, for cp
composed with dp, tp (+sp), pp (1f1b and zbv), ZeRO 1, 2 and 3 (FSDP over dp x cp) and Ulysses; and a run checkpointed at step 3
resumes under another cp degree (cp2 -> cp1, cp1 -> cp2) within 1e-5 of the uninterrupted run.

One launch per world size runs all its layouts one after another (as test_parity_plans.py does): starting
torch in a process costs more than the 5 steps. The data are short packed documents (sentences of the
built-in corpus, ~40 bytes each), so nearly every 32-token row crosses a document boundary and the
document mask matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.checkpoint import step_dir
from fivefold.data import ByteTokenizer, builtin_corpus, tokenize_documents, write_tokens
from fivefold.runtime import RunConfig, launch
from fivefold.spec import PRESETS, Plan, TrainSpec, parse_cluster

STEPS, SAVED_AT, RTOL = 5, 3, 1e-5

# name -> plan fields of a 4-process layout; each runs with and without --document-mask.
LAYOUTS: dict[str, dict] = {
    "cp2xdp2": dict(dp=2, cp=2, micro_batch=2),
    "cp4": dict(cp=4, micro_batch=4, recompute="full"),
    "cp2xtp2-sp-zero1": dict(cp=2, tp=2, sequence_parallel=True, zero=1, micro_batch=4),
    "cp2xpp2-1f1b": dict(cp=2, pp=2, schedule="1f1b", micro_batch=2),
    "cp2xpp2-zbv-zero2": dict(cp=2, pp=2, schedule="zbv", virtual_stages=2, zero=2, micro_batch=2),
    "cp2xdp2-zero3": dict(dp=2, cp=2, zero=3, micro_batch=1, recompute="selective"),
    "cp2-ulysses-xdp2": dict(dp=2, cp=2, cp_method="ulysses", micro_batch=2),
}
# Resumed runs (with --document-mask): name -> (source run, plan fields), from its checkpoint at step 3.
RESUMES = {
    "cp2xdp2 -> cp1 dp4": ("cp2xdp2+doc", dict(dp=4, micro_batch=2)),
    "cp1 -> cp2 dp2": ("reference+doc", dict(dp=2, cp=2, micro_batch=1)),
}


def make_plan(world: int, document_mask: bool, **fields) -> Plan:
    return Plan(model=PRESETS["tiny"], cluster=parse_cluster(f"1x{world}xcpu"),
                train=TrainSpec(seq_len=32, global_batch=8, dtype="fp32", document_mask=document_mask), **fields)


def sentence_documents(folder: Path) -> str:
    """A token file of the built-in corpus's sentences, each closed by the end-of-document byte."""
    sentences = [s.strip() + "." for s in builtin_corpus()[:200_000].split(".") if s.strip()]
    return str(write_tokens(tokenize_documents(sentences, ByteTokenizer()), folder / "sentences.bin",
                            {"tokenizer": "byte", "vocab_size": 256, "end_of_document": 0}))


def config(folder: Path, data: str, name: str, plan: Plan, **fields) -> RunConfig:
    return RunConfig(plan.to_toml(), steps=STEPS, seed=0, device="cpu", show_progress=False, data=data,
                     metrics_file=str(folder / f"{name}.jsonl"), **fields)


def records(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two launches: the single-process references (the masked one saving at step 3), then every 4-process
    layout (cp2xdp2 with the mask saving at step 3), and last in that launch the two resumed runs."""
    folder = tmp_path_factory.mktemp("parity_cp")
    data = sentence_documents(folder)
    saving = dict(checkpoint_every=SAVED_AT, checkpoint_async=False)
    references = [config(folder, data, "reference", make_plan(1, False)),
                  config(folder, data, "reference+doc", make_plan(1, True),
                         checkpoint_dir=str(folder / "reference+doc"), **saving)]
    layouts = []
    for doc in (False, True):
        for name, fields in LAYOUTS.items():
            name += "+doc" if doc else ""
            extra = dict(checkpoint_dir=str(folder / name), **saving) if name == "cp2xdp2+doc" else {}
            layouts.append(config(folder, data, name, make_plan(4, doc, **fields), **extra))
    for name, (source, fields) in RESUMES.items():
        layouts.append(config(folder, data, name, make_plan(4, True, **fields),
                              resume_from=str(step_dir(folder / source, SAVED_AT))))
    launch(references, 1)
    launch(layouts, 4)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("document_mask", [False, True], ids=["causal", "document-mask"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_single_process(runs, name, document_mask):
    suffix = "+doc" if document_mask else ""
    reference, got = records(runs, f"reference{suffix}"), records(runs, name + suffix)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for ref, rec in zip(reference, got):
        assert rec["loss"] == pytest.approx(ref["loss"], rel=RTOL), (name, rec["step"])
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL), (name, rec["step"])


@pytest.mark.slow
def test_document_mask_changes_the_run(runs):
    """Masked and unmasked references differ, so the parity above checks the mask, not just causality."""
    plain, masked = records(runs, "reference"), records(runs, "reference+doc")
    assert abs(plain[0]["loss"] - masked[0]["loss"]) > 1e-3
    assert all(abs(a["grad_norm"] - b["grad_norm"]) > 1e-4 for a, b in zip(plain, masked))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_across_a_cp_change(runs, name):
    """Continue the step-3 checkpoint under another cp degree: steps 4-5 (drawn from the saved loader
    position) match the uninterrupted run."""
    reference, resumed = records(runs, "reference+doc"), records(runs, name)
    assert [r["step"] for r in resumed] == list(range(SAVED_AT + 1, STEPS + 1))
    for ref, rec in zip(reference[SAVED_AT:], resumed):
        assert rec["loss"] == pytest.approx(ref["loss"], rel=RTOL), (name, rec["step"])
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL), (name, rec["step"])
