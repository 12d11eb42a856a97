"""`fivefold generate` on one process: greedy tokens equal transformers' generate; continuous batching with
staggered arrivals, chunked prefill and preemption gives every request the tokens it gets alone (greedy and
seeded sampling); bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from fivefold.cli import main
from fivefold.serve import batch as batch_module
from fivefold.serve.batch import decode_groups
from fivefold.serve.engine import Engine, Request
from fivefold.serve.executor import LocalExecutor
from fivefold.serve.sampling import SamplingParams
from fivefold.serve.source import open_source
from fivefold.spec.serve import BatchLimits, ServeLayout
from serve_models import hf_greedy, prompts, read_outputs, save_model, write_prompts

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("serve") / "llama")


def run_engine(folder, prompt_ids, limits: BatchLimits, arrivals=None, sampling=None, max_tokens=10):
    """Every prompt through one engine; prompt i joins at engine step arrivals[i]. Returns (tokens, engine)."""
    source = open_source(str(folder), None)
    layout = ServeLayout(dtype="fp32", kv_dtype="fp32", limits=limits)
    engine = Engine(LocalExecutor(source, layout), layout, source.eos_ids, source.spec.max_seq_len)
    arrivals = arrivals or [0] * len(prompt_ids)
    requests = [Request(str(i), ids, max_tokens, sampling(i) if sampling else SamplingParams())
                for i, ids in enumerate(prompt_ids)]
    step = 0
    while step <= max(arrivals) or engine.busy:
        for request, arrival in zip(requests, arrivals):
            if arrival == step:
                engine.add(request)
        engine.step()
        step += 1
    return [r.output_ids for r in requests], engine


def test_generate_greedy_matches_transformers(llama, tmp_path, capsys):
    model, folder = llama
    prompt_ids = prompts(6, seed=1)
    write_prompts(tmp_path / "in.jsonl", prompt_ids)
    assert main(["generate", "--from-hf", str(folder), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--max-tokens", "12"]) == 0
    outputs = read_outputs(tmp_path / "out.jsonl")
    assert [o["index"] for o in outputs] == list(range(6))
    for ids, out in zip(prompt_ids, outputs):
        assert out["completion_ids"] == hf_greedy(model, ids, 12)
        assert out["finish_reason"] in ("length", "stop") and out["prompt_tokens"] == len(ids)
        assert out["timings"]["ttft_s"] > 0 and out["timings"]["total_s"] >= out["timings"]["ttft_s"]
    assert "wrote 6 completions" in capsys.readouterr().out


def test_staggered_arrivals_chunked_prefill_and_preemption_keep_each_requests_tokens(llama):
    _, folder = llama
    prompt_ids = prompts(8, seed=2, shortest=2, longest=40)
    roomy = BatchLimits(max_batch=64, max_tokens_per_step=4096, kv_blocks=256, block_size=4)
    alone = [run_engine(folder, [ids], roomy)[0][0] for ids in prompt_ids]
    # At most 3 running, 16 tokens a step (chunked prefill of the long prompts), arrivals over 12 steps.
    tight = BatchLimits(max_batch=3, max_tokens_per_step=16, kv_blocks=256, block_size=4)
    batched, engine = run_engine(folder, prompt_ids, tight, arrivals=[0, 0, 1, 3, 4, 4, 9, 12])
    assert batched == alone and engine.preemptions == 0
    # 14 blocks of 4 tokens: requests run out of blocks and are preempted (recomputed), with the same tokens.
    starved = BatchLimits(max_batch=8, max_tokens_per_step=64, kv_blocks=14, block_size=4)
    preempted, engine = run_engine(folder, prompt_ids, starved, arrivals=[0, 0, 1, 1, 2, 2, 3, 3])
    assert engine.preemptions >= 3
    assert preempted == alone
    assert engine.kv_blocks_in_use == 0


def test_seeded_sampling_is_the_same_alone_batched_and_preempted(llama):
    _, folder = llama
    prompt_ids = prompts(5, seed=3)
    roomy = BatchLimits(max_batch=64, max_tokens_per_step=4096, kv_blocks=256, block_size=4)

    def sampling(index):
        return SamplingParams(temperature=1.0, top_p=0.9, seed=7, key=index)

    alone = [run_engine(folder, [ids], roomy, sampling=lambda _, i=i: sampling(i))[0][0]
             for i, ids in enumerate(prompt_ids)]
    starved = BatchLimits(max_batch=8, max_tokens_per_step=32, kv_blocks=12, block_size=4)
    together, engine = run_engine(folder, prompt_ids, starved, sampling=sampling)
    assert engine.preemptions >= 1 and together == alone
    greedy = [run_engine(folder, [ids], roomy)[0][0] for ids in prompt_ids]
    assert together != greedy  # the sampling did sample
    other_seed = run_engine(folder, prompt_ids, roomy,
                            sampling=lambda i: SamplingParams(temperature=1.0, top_p=0.9, seed=8, key=i))[0]
    assert other_seed != together


def test_decode_groups_split_where_the_context_falls_to_the_ratio():
    contexts = [100, 30, 95, 8, 71, 70, 40, 69, 12, 9, 10, 11]
    # longest first: 100 95 71 | 70 69 | 40 30 | 12 11 10 9 8; 70 <= 0.7 x 100 starts a group, 40 <= 0.7 x 70 and
    # 12 <= 0.7 x 40 too; 8 <= 0.7 x 12 would, but only 1 request (< smallest) would be left for it
    assert decode_groups(list(range(12)), contexts, ratio=0.7, smallest=2) == [[0, 2, 4], [5, 7], [6, 1],
                                                                               [8, 11, 10, 9, 3]]
    # with 4 at least: 70 joins the first group (it has 3), 11 starts the third (12 was the second's 4th)
    assert decode_groups(list(range(12)), contexts, ratio=0.7, smallest=4) == [[0, 2, 4, 5], [7, 6, 1, 8],
                                                                               [11, 10, 9, 3]]
    assert decode_groups([3, 5], contexts, ratio=0.0) == [[5, 3]]  # ratio 0: one call for all decodes
    assert decode_groups([], contexts) == []


def test_decodes_split_over_several_attention_calls_keep_each_requests_tokens(llama, monkeypatch):
    _, folder = llama
    prompt_ids = prompts(12, seed=4, shortest=2, longest=100)
    roomy = BatchLimits(max_batch=64, max_tokens_per_step=4096, kv_blocks=256, block_size=4)
    alone = [run_engine(folder, [ids], roomy)[0][0] for ids in prompt_ids]
    splits = []

    def recording(decodes, context_lens):
        groups = decode_groups(decodes, context_lens)
        splits.append(len(groups))
        return groups

    monkeypatch.setattr(batch_module, "decode_groups", recording)
    together, _ = run_engine(folder, prompt_ids, roomy)
    assert max(splits) >= 2 and together == alone


@pytest.mark.parametrize("flags, line, expected", [
    (["--max-tokens", "0"], '{"prompt_ids": [1, 2]}', "error: --max-tokens=0: must be at least 1"),
    ([], '{"prompt_ids": [1, 2]', "not a JSON object"),
    ([], '{"prompt_ids": [1, 200]}', "in.jsonl:1:prompt_ids=[200]: token ids must be in [0, 96)"),
    ([], '{"prompt": "hello"}', "this model folder has no tokenizer; give prompt_ids"),
    (["--max-tokens", "100"], json.dumps({"prompt_ids": [1] * 40}), "exceeds the model's context of 128 tokens"),
    (["--tp", "3"], '{"prompt_ids": [1, 2]}', "error: --tp=3: must divide the model's 4 attention heads"),
    (["--ep", "2"], '{"prompt_ids": [1, 2]}', "error: --ep=2: expert parallel needs an MoE model"),
    (["--top-p", "0"], '{"prompt_ids": [1, 2]}', "error: --top-p=0.0: must be in (0, 1]"),
    (["--kv-blocks", "1"], '{"prompt_ids": [1, 2, 3]}', "exceeds the KV cache's 16 tokens"),
])
def test_bad_generate_input_is_one_line_and_exit_2(llama, tmp_path, capsys, flags, line, expected):
    _, folder = llama
    (tmp_path / "in.jsonl").write_text(line + "\n")
    code = main(["generate", "--from-hf", str(folder), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_text_prompts_use_the_folders_tokenizer(llama, tmp_path):
    import shutil

    from serve_models import save_tokenizer, words

    model, folder = llama
    shutil.copytree(folder, tmp_path / "with-tokenizer")
    save_tokenizer(tmp_path / "with-tokenizer")
    (tmp_path / "in.jsonl").write_text('{"prompt": "w5 w6 w7"}\n{"prompt_ids": [8, 9]}\n')
    assert main(["generate", "--from-hf", str(tmp_path / "with-tokenizer"), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--max-tokens", "6"]) == 0
    first, second = read_outputs(tmp_path / "out.jsonl")
    assert first["completion_ids"] == hf_greedy(model, [5, 6, 7], 6) and first["text"] == words(first["completion_ids"])
    assert second["completion_ids"] == hf_greedy(model, [8, 9], 6) and second["text"] == words(second["completion_ids"])


@pytest.mark.parametrize("file, text, expected", [
    ("tokenizer.json", "[1, 2]", "tokenizer.json='(unreadable)': not a readable tokenizer.json"),
    ("tokenizer_config.json", "{not json", "tokenizer_config.json='(unparsable)': not valid JSON"),
    ("tokenizer_config.json", '{"chat_template": 5}', "tokenizer_config.json:chat_template=5: must be a string"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "default"}]}', "chat_template[]:template=None: required"),
    ("tokenizer_config.json", '{"eos_token": 7}', "tokenizer_config.json:eos_token=7: must be a string"),
])
def test_a_broken_tokenizer_file_is_one_line_naming_the_file_and_key(llama, tmp_path, capsys, file, text, expected):
    import shutil

    from serve_models import save_tokenizer

    _, folder = llama
    shutil.copytree(folder, tmp_path / "broken")
    save_tokenizer(tmp_path / "broken")
    (tmp_path / "broken" / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "broken" / file).write_text(text)
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    code = main(["generate", "--from-hf", str(tmp_path / "broken"), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--port", "70000"], "error: --port=70000: must be in 0..65535"),
    (["--max-queue", "0"], "error: --max-queue=0: must be at least 1"),
    (["--pp", "3"], "error: --pp=3: must be at most the model's 2 layers"),
    (["--kv-dtype", "fp8"], "error: --kv-dtype='fp8': the runtime keeps the KV cache in one of fp32, bf16, fp16"),
])
def test_bad_serve_flags_are_one_line_and_exit_2_before_anything_starts(llama, capsys, flags, expected):
    _, folder = llama
    assert main(["serve", "--from-hf", str(folder), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_a_fivefold_checkpoint_generates_what_its_hf_folder_does(llama, tmp_path):
    model, folder = llama
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    write_prompts(tmp_path / "in.jsonl", prompts(3, seed=4))
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--max-tokens", "6"]) == 0
    outputs = read_outputs(tmp_path / "out.jsonl")
    assert [o["completion_ids"] for o in outputs] == [
        hf_greedy(model, ids, 6) for ids in prompts(3, seed=4)]
    assert all("text" not in o for o in outputs)  # a checkpoint carries no tokenizer



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generates_the_tokens_of_the_cpu(llama, tmp_path):
    _, folder = llama
    write_prompts(tmp_path / "in.jsonl", prompts(5, seed=6, shortest=3, longest=40))
    for device in ("cpu", "cuda"):
        assert main(["generate", "--from-hf", str(folder), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / f"{device}.jsonl"), "--max-tokens", "10", "--device", device, "--dtype",
                     "fp32"]) == 0
    cpu, cuda = read_outputs(tmp_path / "cpu.jsonl"), read_outputs(tmp_path / "cuda.jsonl")
    assert [o["completion_ids"] for o in cuda] == [o["completion_ids"] for o in cpu]
