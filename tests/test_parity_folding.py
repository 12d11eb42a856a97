"""MoE Parallel Folding computes the same training run: tiny-moe, 5 fp32 steps on CPU/gloo, loss, global
gradient norm, auxiliary loss and expert load within 1e-5 relative of the single-process run when ep spans
tp x cp x dp ranks and etp splits each expert (spec/folding.py, runtime/expert_folding.py), and a checkpoint
resumes across foldings (tp2 ep4 -> ep2, ep2 -> tp2 ep4) within 1e-5. One 4-process launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from fivefold.checkpoint import step_dir
from fivefold.runtime import launch
from test_parity_moe import SAVED_AT, assert_same_run, config, make_plan, records

# name -> plan fields on 4 processes; the name says where ep / etp fold.
FOLDINGS: dict[str, dict] = {
    "tp2-ep4": dict(dp=2, tp=2, ep=4, sequence_parallel=True, micro_batch=2),  # ep spans tp and dp
    "tp2-etp2-ep2": dict(dp=2, tp=2, ep=2, etp=2, sequence_parallel=False, micro_batch=2),  # etp = the tp ranks
    "pp2-tp2-ep2": dict(dp=1, pp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=2),  # ep = the tp ranks
    "ep2-etp2-zero3": dict(dp=4, ep=2, etp=2, zero=3, micro_batch=1),  # etp over dp
    "cp2-ep2": dict(dp=2, cp=2, ep=2, micro_batch=2),  # ep = the cp ranks; auxiliary loss summed over cp
    "etp4-ddp": dict(dp=4, etp=4, micro_batch=2),  # each expert over all 4 ranks; DDP leaves the experts out
}
# name -> (source run, its checkpoint resumed under these fields)
RESUMES = {"tp2 ep4 -> ep2": ("tp2-ep4", dict(dp=4, ep=2, micro_batch=2)),
           "ep2 -> tp2 ep4": ("dp4-ep2", dict(dp=2, tp=2, ep=4, sequence_parallel=True, micro_batch=2))}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("folding")
    runs = [config(folder, name, make_plan(4, **fields), checkpoint_dir=str(folder / name), checkpoint_every=SAVED_AT)
            for name, fields in {**FOLDINGS, "dp4-ep2": dict(dp=4, ep=2, micro_batch=2)}.items()]
    runs += [config(folder, name, make_plan(4, **fields), resume_from=str(step_dir(folder / source, SAVED_AT)))
             for name, (source, fields) in RESUMES.items()]
    launch(runs, 4)
    launch([config(folder, "reference", make_plan(1))], 1)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDINGS))
def test_folding_matches_single_process(folder, name):
    assert_same_run(records(folder, "reference"), records(folder, name), name)
    # Every token copy is computed once per MoE layer (8 sequences x 32 tokens x top-2), not once per tp rank.
    assert {r["expert_copies"] for r in records(folder, name)} == {8 * 32 * 2}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_across_foldings(folder, name):
    resumed = records(folder, name)
    assert [r["step"] for r in resumed] == [SAVED_AT + 1, SAVED_AT + 2]
    assert_same_run(records(folder, "reference")[SAVED_AT:], resumed, name)
    assert_same_run(records(folder, RESUMES[name][0])[SAVED_AT:], resumed, name)
