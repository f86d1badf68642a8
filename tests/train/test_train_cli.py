import pytest

from tests.support.cli import cli, one_line_error
from tests.support.train import drafter_json, losses, make_cache


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return make_cache(root / "cache"), drafter_json(root / "drafter.json")


def options(cache, drafter, out, *extra):
    return [
        "train",
        "--cache",
        cache,
        "--out",
        out,
        "--drafter",
        drafter,
        "--steps",
        2,
        "--token-budget",
        128,
        "--max-anchors",
        8,
        "--eval-fraction",
        0,
        "--workers",
        2,
        *extra,
    ]


def test_train_then_refuse_to_overwrite_then_resume(tmp_path, setup):
    cache, drafter = setup
    out = tmp_path / "run"
    code, text = cli(*options(cache, drafter, out))
    assert code == 0, text
    assert "Batches per epoch:" in text and "step 2/2 | loss" in text and f"done: {out}" in text
    assert (
        "optimizer: muon (lr 0.001, weight decay 0.1; AdamW on the norms), 0 warmup steps, then a cosine to lr 0.0001"
        in text
    )
    before = (out / "metrics.jsonl").read_text()

    one_line_error(*cli(*options(cache, drafter, out)), "already holds a training run", "--resume")
    one_line_error(*cli(*options(cache, drafter, out, "--lr", 2e-3, "--resume")), "different config", "lr")
    assert (out / "metrics.jsonl").read_text() == before  # nothing overwritten

    code, text = cli(*options(cache, drafter, out, "--resume"))  # a finished run: nothing to do, and what next
    assert code == 0 and f"{out} is finished: step-2 is its last step (2)" in text, text
    assert "another --out with more --steps" in text and "step 1/" not in text
    assert (out / "metrics.jsonl").read_text() == before


def test_a_run_with_no_checkpoint_is_named_as_such(tmp_path, setup):
    """Stopped before its first checkpoint (here: its checkpoints removed), a run cannot be resumed:
    the rerun says so and what to do, instead of sending the user to --resume."""
    import shutil

    cache, drafter = setup
    out = tmp_path / "run"
    assert cli(*options(cache, drafter, out))[0] == 0
    shutil.rmtree(out / "checkpoints")
    one_line_error(*cli(*options(cache, drafter, out)), "no checkpoint", "nothing to resume", "delete it")
    one_line_error(*cli(*options(cache, drafter, out, "--resume")), "no complete checkpoint")


def test_bad_caches(tmp_path, setup):
    cache, drafter = setup
    one_line_error(*cli(*options(tmp_path / "nope", drafter, tmp_path / "a")), "no such cache directory")
    incomplete = make_cache(tmp_path / "incomplete")
    (incomplete / "manifest.json").unlink()
    one_line_error(*cli(*options(incomplete, drafter, tmp_path / "b")), "incomplete")
    other = make_cache(tmp_path / "other", codec="fp8-zstd")
    one_line_error(
        *cli(*options(cache, drafter, tmp_path / "c", "--cache", other)),
        "different specs",
        "codec: bf16-zstd -> fp8-zstd",
    )
    headless = make_cache(tmp_path / "headless")
    (headless / "target" / "head.safetensors").unlink()
    one_line_error(*cli(*options(headless, drafter, tmp_path / "d")), "head.safetensors is missing")
    assert not any((tmp_path / name).exists() for name in "abcd")  # no run folder made for bad input


def test_a_cache_given_twice_is_refused(tmp_path, setup):
    """`--cache C --cache C` (or `./C`, or a copy of C) trained on every sample twice."""
    import shutil

    cache, drafter = setup
    shutil.copytree(cache, tmp_path / "copy")
    for second, out in ((cache, "a"), (f"{cache}/.", "b"), (tmp_path / "copy", "c")):
        one_line_error(
            *cli(*options(cache, drafter, tmp_path / out, "--cache", second)),
            "sample 0 is in both",
            "(same data source); give each cache once",
        )
    assert not any((tmp_path / name).exists() for name in "abc")


def test_drafter_config_that_does_not_fit_the_cache(tmp_path, setup):
    cache, _ = setup
    layers = drafter_json(tmp_path / "layers.json", target_layer_ids=[1, 4])
    one_line_error(*cli(*options(cache, layers, tmp_path / "a")), "reads target layers [1, 4]", "holds [1, 3]")
    hidden = drafter_json(tmp_path / "hidden.json", hidden_size=64)
    one_line_error(*cli(*options(cache, hidden, tmp_path / "b")), "target hidden size 64", "has 32")


def test_resume_without_a_run_or_a_checkpoint(tmp_path, setup):
    cache, drafter = setup
    one_line_error(*cli(*options(cache, drafter, tmp_path / "fresh", "--resume")), "holds no run")
    out = tmp_path / "run"
    code, _ = cli(*options(cache, drafter, out, "--save-every", 1000, "--steps", 1))
    assert code == 0
    for checkpoint in (out / "checkpoints").iterdir():
        (checkpoint / "complete.json").unlink()  # as if killed while writing it
    one_line_error(*cli(*options(cache, drafter, out, "--steps", 1, "--resume")), "no complete checkpoint")


def test_out_that_is_not_empty(tmp_path, setup):
    cache, drafter = setup
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    one_line_error(*cli(*options(cache, drafter, tmp_path / "busy")), "not an empty folder")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--token-budget", 0], "--token-budget must be at least 1"),
        (["--gpus", ""], "--gpus is empty"),
        (["--epochs", 2], "give --epochs or --steps, not both"),
        (["--eval-fraction", 1.5], "--eval-fraction must be in [0, 1)"),
        (["--grad-accum", 50], "fewer than one step needs"),
        (["--dpace-alpha", 0], "--dpace-alpha must be in (0, 1]"),
        (
            ["--loss", "topk", "--labels", "tokens"],
            "--loss topk distils the target's own distribution; it needs --labels target",
        ),
    ],
)
def test_options_out_of_range(tmp_path, setup, extra, needle):
    cache, drafter = setup
    one_line_error(*cli(*options(cache, drafter, tmp_path / "run", *extra)), needle)


def test_each_loss_trains_and_a_run_resumes_only_with_its_own(tmp_path, setup):
    """--loss reaches the objective (the first step's loss differs by loss, on the same batch and weights),
    dpace when left out, and is part of the run's identity; topk reads the top-K labels of a cache
    extracted with them."""
    _, drafter = setup
    topk_cache = make_cache(tmp_path / "cache", topk=4)
    first = {}
    for loss in ("dflash", "dpace", "topk", None):
        out = tmp_path / f"run-{loss}"
        code, text = cli(*options(topk_cache, drafter, out, *(["--loss", loss] if loss else []), "--steps", 1))
        assert code == 0, text
        first[loss] = losses(out)[0]
    assert len({first[loss] for loss in ("dflash", "dpace", "topk")}) == 3, first
    assert first[None] == first["dpace"], first
    one_line_error(
        *cli(*options(topk_cache, drafter, tmp_path / "run-dflash", "--steps", 1, "--resume")),
        "different config",
        "loss",
    )


def test_topk_loss_needs_top_k_labels(tmp_path, setup):
    cache, drafter = setup
    out = tmp_path / "run"
    one_line_error(*cli(*options(cache, drafter, out, "--loss", "topk")), "lacks", "extract it with --topk K")
    assert not out.exists()
    one_line_error(
        *cli(
            "train",
            "--live-target",
            tmp_path / "model",
            "--data",
            tmp_path / "data.jsonl",
            "--out",
            out,
            "--loss",
            "topk",
        ),
        "--live-target computes none",
    )
    assert not out.exists()


def test_a_cache_with_no_token_to_train_on_is_refused(tmp_path):
    """Before: such a cache trained to 'loss 0.0000 | tau 0.000' with exit 0."""
    import json

    from dflash_cache.store.manifest import manifest_checksum

    cache = make_cache(tmp_path / "cache")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest.pop("checksum")
    manifest["extract"] = {"masked_tokens": {"content": 0, "reasoning": 0, "tool_call": 0, "markup": 0}}
    manifest["checksum"] = manifest_checksum(manifest)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "run"
    one_line_error(*cli(*options(cache, drafter_json(tmp_path / "drafter.json"), out)), "holds no token to train on")
    assert not out.exists()
