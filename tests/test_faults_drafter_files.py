"""Hostile drafter checkpoints and exports: a safetensors header that lies, a config whose sizes the
weights do not have (or that would allocate terabytes), a config of the wrong types. Each is one line
naming the file, before any model is built and before `export --out` is written."""

import json
import re
import struct

import pytest
from click.testing import CliRunner

from dflash_cache.drafter.checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_drafter
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.export import export_checkpoint
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.errors import DFlashCacheError
from dflash_cache.eval.drafters import read_drafter
from dflash_cache_cli.main import main

CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=100,
    block_size=4,
    target_layer_ids=[1, 3],
    mask_token_id=99,
    num_target_layers=6,
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A training checkpoint and its export."""
    root = tmp_path_factory.mktemp("drafter")
    save_drafter(DFlashDrafter(DrafterConfig(**CONFIG)), root / "checkpoint")
    export_checkpoint(root / "checkpoint", root / "export", dtype="float32")
    return root


def copy(sources, kind, tmp_path):
    source, target = sources / kind, tmp_path / kind
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    names = (WEIGHTS_FILE, CONFIG_FILE) if kind == "checkpoint" else ("model.safetensors", "config.json")
    return target, target / names[0], target / names[1]


def rewrite_header(weights, edit) -> None:
    """Replace the safetensors JSON header with `edit(header)`, keeping the tensor bytes."""
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.dumps(edit(json.loads(data[8 : 8 + size]))).encode()
    header += b" " * (-len(header) % 8)
    weights.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + size :])


def past_the_end(h):
    h["norm.weight"]["data_offsets"][1] += 1 << 30
    return h


def overlapping(h):
    h["layers.0.mlp.up_proj.weight"]["data_offsets"] = list(h["layers.0.mlp.gate_proj.weight"]["data_offsets"])
    return h


def shape_swapped(h):  # the same bytes, the shape transposed: the header is valid, the config disagrees
    h["fc.weight"]["shape"] = h["fc.weight"]["shape"][::-1]
    return h


def integer_weights(h):
    h["norm.weight"]["dtype"] = "I32" if h["norm.weight"]["dtype"] == "F32" else "I16"
    return h


def huge_length(weights):
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


HEADERS = {
    "past_the_end": (past_the_end, "unreadable safetensors file"),
    "overlapping": (overlapping, "unreadable safetensors file"),
    "shape_swapped": (shape_swapped, r"fc.weight is \[64, 32\], the config makes it \[32, 64\]"),
    "integer_weights": (integer_weights, "norm.weight is torch.int(32|16), not floating point"),
}


def refused(path, tmp_path, match):
    with pytest.raises(DFlashCacheError, match=match):
        read_drafter(path)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(path), "--out", str(out)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), (
        result.stderr
    )
    assert not out.exists()
    return result.stderr


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
@pytest.mark.parametrize("case", sorted(HEADERS))
def test_a_lying_safetensors_header_is_one_line_naming_the_file(sources, tmp_path, kind, case):
    folder, weights, _ = copy(sources, kind, tmp_path)
    edit, match = HEADERS[case]
    rewrite_header(weights, edit)
    if kind == "export":  # `export` reads checkpoints only; eval reads both
        with pytest.raises(DFlashCacheError, match=match):
            read_drafter(folder)
        return
    assert str(weights) in refused(folder, tmp_path, match)


def test_a_header_length_of_a_terabyte_is_refused_unread(sources, tmp_path):
    folder, weights, _ = copy(sources, "checkpoint", tmp_path)
    huge_length(weights)
    refused(folder, tmp_path, "unreadable safetensors file .*header too large")


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_a_config_with_huge_sizes_is_refused_before_anything_is_allocated(sources, tmp_path, kind):
    """intermediate_size 2^40 makes MLP weights of 2^45 bytes: refused against the weights' shapes
    (an export of such a checkpoint was written, and eval built the model before loading weights)."""
    folder, _, config_file = copy(sources, kind, tmp_path)
    values = json.loads(config_file.read_text())
    values["intermediate_size"] = 1 << 40
    config_file.write_text(json.dumps(values))
    match = r"does not fit .*mlp.down_proj.weight is \[32, 64\], the config makes it \[32, 1099511627776\]"
    if kind == "export":
        with pytest.raises(DFlashCacheError, match=match):
            read_drafter(folder)
        return
    refused(folder, tmp_path, match)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, not 0"),  # was ZeroDivisionError
        ("num_hidden_layers", "1", "num_hidden_layers must be a positive integer, not '1'"),
        ("hidden_size", 32.0, "hidden_size must be a positive integer, not 32.0"),
        (
            "target_layer_ids",
            3,
            "target_layer_ids must be a list, not 3",
        ),  # was TypeError: 'int' object is not iterable
        ("target_layer_ids", ["1", 3], r"target_layer_ids must be layer numbers, not \['1', 3\]"),
    ],
)
def test_a_config_of_the_wrong_types_is_named(sources, tmp_path, field, value, match):
    folder, _, config_file = copy(sources, "checkpoint", tmp_path)
    values = json.loads(config_file.read_text())
    values[field] = value
    config_file.write_text(json.dumps(values))
    refused(folder, tmp_path, "invalid drafter config: " + match)


# Each was exported; then eval ended in a bare IndexError (mask_token_id), tried to allocate 17 GB
# (block_size) or reported accuracy 0.00 (the rest).
BAD_VALUES = [
    ("mask_token_id", 10**9),
    ("mask_token_id", -1),
    ("mask_token_id", 100),
    ("block_size", 1 << 31),
    ("rope_theta", float("nan")),
    ("rms_norm_eps", -1),
    ("rms_norm_eps", float("inf")),
    ("max_position_embeddings", 1 << 40),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_a_config_value_out_of_range_names_the_file_and_field_in_train_export_and_eval(sources, tmp_path, field, value):
    for kind in ("checkpoint", "export"):
        folder, _, config_file = copy(sources, kind, tmp_path)
        values = json.loads(config_file.read_text())
        values[field] = value
        if kind == "export" and field == "mask_token_id":
            values["dflash_config"][field] = value
        if kind == "export" and field == "rope_theta":  # the reference config reads it here first
            values["rope_parameters"][field] = value
        config_file.write_text(json.dumps(values))  # NaN and Infinity as Python's json writes them
        match = f"^{re.escape(str(config_file))}: invalid drafter config: {field} must be"
        with pytest.raises(DFlashCacheError, match=match):  # eval reads both
            read_drafter(folder)
        with pytest.raises(DFlashCacheError, match=match):  # train reads a config file
            load_drafter_config(config_file)
        if kind == "checkpoint":
            assert str(config_file) in refused(folder, tmp_path, f"{field} must be")


def test_a_config_that_is_not_json_names_its_file(sources, tmp_path):
    folder, _, config_file = copy(sources, "checkpoint", tmp_path)
    config_file.write_text("{not json")
    assert str(config_file) in refused(folder, tmp_path, "drafter_config.json: unreadable")
    config_file.write_text("[1, 2]")
    refused(folder, tmp_path, "a drafter config must be a JSON object, not list")


@pytest.mark.parametrize("reader", ["eval", "export"])
def test_a_checkpoint_the_run_deletes_while_it_is_read_is_chosen_again(sources, tmp_path, monkeypatch, reader):
    """`eval --drafter RUN` / `export RUN` while RUN trains with `--keep-last 1`: the run writes step-3
    and deletes step-2, the one just chosen, before it is read (it was `RUN/checkpoints/step-2 holds
    no drafter` / `is not a drafter checkpoint`). The newest is chosen again."""
    import dflash_cache.drafter.export as export_module
    import dflash_cache.eval.drafters as drafters_module
    from dflash_cache.train.checkpoint import COMPLETE
    from dflash_cache.train.retention import prune_checkpoints
    from dflash_cache.train.rundir import RUN_FILE

    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_FILE).write_text("{}")

    def write_checkpoint(step):
        folder = run / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        for f in (sources / "checkpoint").iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        (folder / COMPLETE).write_text("{}")

    write_checkpoint(1)
    write_checkpoint(2)
    module = drafters_module if reader == "eval" else export_module
    original = module.load_drafter_state

    def the_run_moves_on(path):
        if not (run / "checkpoints" / "step-3").exists():
            write_checkpoint(3)
            assert prune_checkpoints(run, keep_last=1) == [
                run / "checkpoints" / "step-1",
                run / "checkpoints" / "step-2",
            ]
        return original(path)

    monkeypatch.setattr(module, "load_drafter_state", the_run_moves_on)
    if reader == "eval":
        assert read_drafter(run)[2] == run / "checkpoints" / "step-3"
        return
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0 and f"exported {run / 'checkpoints' / 'step-3'} ->" in result.stdout, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
