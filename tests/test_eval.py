"""Speculative decoding equals the target's greedy decoding; offline tau equals the trainer's."""

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from dflash_cache.drafter.checkpoint import save_drafter
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.export import export_checkpoint
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import DFlashCacheError
from dflash_cache.eval import (
    OfflineOptions,
    SpeculativeOptions,
    evaluate_offline,
    evaluate_speculative,
    speculative,
)
from dflash_cache.eval.decode import greedy_generate, speculative_generate
from dflash_cache.eval.drafters import check_fits, read_drafter
from dflash_cache.eval.prompts import load_prompts
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import load_target
from dflash_cache.train.checkpoint import COMPLETE
from dflash_cache.train.train import train
from dflash_cache_cli.main import main
from tests.test_train_helpers import make_cache, metrics, tiny_config

LAYERS = [1, 4]
BLOCK = 6


def random_drafter(directory, target_dir, seed=0):
    """An untrained drafter for the tiny targets: its drafts are almost never accepted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=len(tokenizer),
        block_size=BLOCK,
        target_layer_ids=LAYERS,
        mask_token_id=tokenizer.mask_token_id,
        num_target_layers=6,
    )
    torch.manual_seed(seed)
    save_drafter(DFlashDrafter(config), directory)
    return directory


@pytest.fixture(scope="module")
def fp32_target(qwen3_target_dir):
    return load_target(qwen3_target_dir, "cpu", torch.float32)


def test_greedy_loop_matches_hf_generate(target_dir, conversations):
    target = load_target(target_dir, "cpu", torch.float32)
    stops = speculative.stop_ids(target)
    for prompt in load_prompts([conversations], target.tokenizer, 2):
        ours = greedy_generate(target.model, prompt, 8, stops).tokens
        theirs = target.model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=sorted(stops), pad_token_id=0
        )[0, len(prompt) :]
        assert ours == theirs.tolist()


def test_random_drafter_decodes_exactly_with_tau_near_one(target_dir, conversations, tmp_path):
    drafter = random_drafter(tmp_path / "drafter", target_dir)
    report = evaluate_speculative(
        SpeculativeOptions(drafter=drafter, target=target_dir, data=[conversations], max_new_tokens=8, num_prompts=1)
    )
    assert report.prompts == 1 and report.new_tokens > 2
    assert 1.0 <= report.tau < 1.3 and len(report.acceptance) == BLOCK - 1
    assert report.tokens_per_forward == pytest.approx(report.new_tokens / report.target_forwards)
    assert report.tau == pytest.approx(1 + sum(report.acceptance))


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("wrong_slot", [None, 3, 1])
def test_drafts_are_accepted_up_to_the_first_miss(fp32_target, conversations, wrong_slot, kv_cache):
    """An oracle drafter proposes the greedy continuation (one slot spoiled): whole blocks, or
    exactly the drafts before the spoiled slot, are accepted, and the output stays the greedy one.
    The drafter sees every earlier position's features, as a fresh forward computes them, whether
    each cycle recomputes the sequence or verifies on the KV cache cut back after it."""
    stops = speculative.stop_ids(fp32_target)
    prompt = load_prompts([conversations], fp32_target.tokenizer, 1)[0]
    greedy = greedy_generate(fp32_target.model, prompt, 20, stops).tokens
    runner = TargetRunner(fp32_target, LAYERS)
    seen = []

    def oracle(tokens, context):
        assert context.shape == (len(tokens) - 1, len(LAYERS) * 64) and tokens[: len(prompt)].tolist() == prompt
        done = len(tokens) - len(prompt)  # new tokens so far, the newest one included
        assert tokens[len(prompt) :].tolist() == greedy[:done]
        truth = torch.tensor((greedy[done:] + [0] * BLOCK)[: BLOCK - 1])
        if wrong_slot is not None:
            truth[wrong_slot - 1] = (truth[wrong_slot - 1] + 1) % fp32_target.vocab_size
        seen.append((tokens[:-1].clone(), context))
        return truth

    generation = speculative_generate(runner, oracle, BLOCK, prompt, 20, stops, kv_cache)
    assert generation.tokens == greedy
    expected = BLOCK - 1 if wrong_slot is None else wrong_slot - 1
    assert generation.accepted[:-1] == [expected] * (len(generation.accepted) - 1)
    assert generation.target_forwards == 1 + len(generation.accepted)
    tokens, context = seen[-1]
    fresh = runner.run(tokens[None], torch.tensor([len(tokens)])).hidden[0]
    torch.testing.assert_close(context.float(), fresh.float(), atol=1e-5, rtol=2**-7)


def test_eval_verifies_on_the_kv_cache_where_it_can_be_cut_back_and_warns_of_nothing(
    target_dir, conversations, tmp_path
):
    """Dense attention: KV-cached verification and a speed-up printed; hybrid linear attention: the
    whole sequence recomputed and no speed-up claimed. Neither run raises a warning (a deprecated
    transformers argument would)."""
    drafter = random_drafter(tmp_path / "drafter", target_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = evaluate_speculative(
            SpeculativeOptions(
                drafter=drafter, target=target_dir, data=[conversations], max_new_tokens=8, num_prompts=2
            )
        )
    hybrid = "linear_attention" in (load_target(target_dir, "cpu").config.layer_types or [])
    assert report.kv_cached is not hybrid
    timing = report.lines()[4]
    assert ("speed-up" in timing and "KV-cached greedy" in timing) is not hybrid
    assert ("no speed-up measured" in timing) is hybrid


def test_a_prompt_only_record_is_the_prompt_its_answered_form_gives(fp32_target, conversations, tmp_path):
    """Each conversation cut before its first assistant turn gives the prompt the whole one gives
    (its rendering up to the generation prompt); --limit counts records."""
    records = [json.loads(line) for line in conversations.read_text().splitlines()]
    cut = [
        {"messages": r["messages"][: next(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")]}
        for r in records
    ]
    prompt_only = tmp_path / "prompts.jsonl"
    prompt_only.write_text("".join(json.dumps(r) + "\n" for r in cut))
    tokenizer = fp32_target.tokenizer
    assert load_prompts([prompt_only], tokenizer, 5) == load_prompts([conversations], tokenizer, 5)
    assert len(load_prompts([prompt_only], tokenizer)) == len(records)
    drafter = random_drafter(tmp_path / "drafter", fp32_target.path)
    result = CliRunner().invoke(
        main,
        [
            "eval",
            "--drafter",
            str(drafter),
            "--target",
            str(fp32_target.path),
            "--data",
            str(prompt_only),
            "--limit",
            "2",
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "2 prompts, " in result.output and "eval: 2/2 prompts" in result.stderr


def test_a_wrong_output_fails_loudly(qwen3_target_dir, conversations, tmp_path, monkeypatch):
    drafter = random_drafter(tmp_path / "drafter", qwen3_target_dir)
    real = speculative.speculative_generate

    def off_by_one(*args, **kwargs):
        generation = real(*args, **kwargs)
        generation.tokens[3] += 1
        return generation

    monkeypatch.setattr(speculative, "speculative_generate", off_by_one)
    with pytest.raises(
        DFlashCacheError, match="prompt 0: speculative decoding differs from greedy decoding at new token 3"
    ):
        evaluate_speculative(
            SpeculativeOptions(
                drafter=drafter, target=qwen3_target_dir, data=[conversations], max_new_tokens=8, num_prompts=1
            )
        )


def test_drafter_folders_checkpoint_run_and_export(qwen3_target_dir, tmp_path):
    checkpoint = random_drafter(tmp_path / "run" / "checkpoints" / "step-7", qwen3_target_dir)
    (checkpoint / COMPLETE).write_text("{}")
    export_checkpoint(checkpoint, tmp_path / "export", dtype="float32")
    config, state, source = read_drafter(checkpoint)
    for folder in (tmp_path / "run", tmp_path / "export"):
        other_config, other_state, _ = read_drafter(folder)
        assert other_config.target_layer_ids == config.target_layer_ids and other_config.block_size == BLOCK
        assert all(torch.equal(state[k], other_state[k]) for k in state)
    assert read_drafter(tmp_path / "run")[2] == checkpoint == source
    with pytest.raises(DFlashCacheError, match="holds no drafter"):
        read_drafter(tmp_path)
    with pytest.raises(DFlashCacheError, match="hidden size 64 vs the target's 32"):
        check_fits(config, hidden_size=32, vocab_size=config.vocab_size, num_layers=6)
    with pytest.raises(DFlashCacheError, match="target layers \\[1, 4\\] vs the cache's \\[1, 3\\]"):
        check_fits(config, 64, config.vocab_size, 6, layer_ids=[1, 3])


def test_offline_tau_equals_the_trainers_held_out_tau(tmp_path):
    cache = make_cache(tmp_path / "cache")
    train(tiny_config(tmp_path, cache, steps=1, eval_fraction=0.3, eval_every=1), echo=lambda line: None)
    logged = [r for r in metrics(tmp_path / "run") if "eval_tau" in r][-1]
    report = evaluate_offline(
        OfflineOptions(drafter=tmp_path / "run", caches=[cache], eval_fraction=0.3, token_budget=128, max_anchors=8)
    )
    assert report.tau == pytest.approx(logged["eval_tau"], rel=1e-12)
    assert report.loss == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert report.blocks > 0 and len(report.accuracy) == 3
    assert "held-out split of" in report.split and "--eval-fraction 0.3" in report.split
    by_default = evaluate_offline(OfflineOptions(drafter=tmp_path / "run", caches=[cache]))  # the run's own options
    assert (by_default.samples, by_default.tau, by_default.loss) == (report.samples, report.tau, report.loss)
    everything = evaluate_offline(OfflineOptions(drafter=tmp_path / "run", caches=[cache], eval_fraction=0.0))
    assert everything.samples == 16 and everything.blocks > report.blocks
    assert everything.split == "every sample of the cache"


@pytest.mark.parametrize("loss", ["dpace", "topk"])
def test_offline_loss_is_the_runs_own_loss(tmp_path, loss):
    """A run trained with another --loss is evaluated with it, as its held-out evaluation was; a topk
    drafter's loss needs a cache with top-K labels."""
    cache = make_cache(tmp_path / "cache", topk=3)
    train(tiny_config(tmp_path, cache, steps=1, eval_fraction=0.3, eval_every=1, loss=loss), echo=lambda line: None)
    logged = [r for r in metrics(tmp_path / "run") if "eval_loss" in r][-1]
    report = evaluate_offline(OfflineOptions(drafter=tmp_path / "run", caches=[cache]))
    assert report.loss == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert report.tau == pytest.approx(logged["eval_tau"], rel=1e-12)
    if loss == "topk":
        plain = make_cache(tmp_path / "plain")
        with pytest.raises(DFlashCacheError, match="trained with --loss topk.*extracted with --topk K"):
            evaluate_offline(OfflineOptions(drafter=tmp_path / "run", caches=[plain]))


def test_cli(qwen3_target_dir, conversations, tmp_path):
    drafter = random_drafter(tmp_path / "drafter", qwen3_target_dir)
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "eval",
            "--drafter",
            str(drafter),
            "--target",
            str(qwen3_target_dir),
            "--data",
            str(conversations),
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "6",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "every output equal to the target's greedy output" in result.output and "tau" in result.output
    result = runner.invoke(main, ["eval", "--drafter", str(drafter)])
    assert result.exit_code == 2 and "either --target" in result.output
    result = runner.invoke(
        main, ["eval", "--drafter", str(tmp_path), "--target", str(qwen3_target_dir), "--data", str(conversations)]
    )
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "holds no drafter" in result.output


@pytest.mark.parametrize(
    "options, message, exit_code",
    [
        (["--num-prompts", "-1"], "Invalid value for '--num-prompts' / '--limit': -1 is not in the range x>=0", 2),
        (["--device", "gpu0"], "--device 'gpu0' is not a device (cpu, cuda or cuda:N)", 1),
        (["--device", "cuda:7"], "--device cuda:7: there is no such GPU (this machine shows", 1),
    ],
)
def test_eval_target_options_out_of_range(qwen3_target_dir, conversations, tmp_path, options, message, exit_code):
    """Each was accepted (a negative --num-prompts as 'every one') or ended in a bare AssertionError
    ('Torch not compiled with CUDA enabled') after the target was loaded."""
    if "cuda:7" in options and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    drafter = random_drafter(tmp_path / "drafter", qwen3_target_dir)
    result = CliRunner().invoke(
        main,
        [
            "eval",
            "--drafter",
            str(drafter),
            "--target",
            str(qwen3_target_dir),
            "--data",
            str(conversations),
            "--max-new-tokens",
            "2",
            *options,
        ],
    )
    assert result.exit_code == exit_code and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr


@pytest.mark.parametrize("fraction", ["1", "2", "-0.5"])
def test_eval_cache_refuses_an_eval_fraction_out_of_range(tmp_path, fraction):
    """`eval --cache --eval-fraction 2` scored every sample and called it a held-out split."""
    cache = make_cache(tmp_path / "cache")
    result = CliRunner().invoke(
        main, ["eval", "--drafter", str(tmp_path / "never-read"), "--cache", str(cache), "--eval-fraction", fraction]
    )
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"Invalid value for '--eval-fraction': {float(fraction)} is not in the range 0<=x<1" in result.stderr
