"""The subspace codecs: the fitted basis, the extraction that stores coordinates, and the export
that folds the basis back so that the reference `dflash` model reads full states."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache import DFlashCacheError, open_cache
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.checkpoint import save_drafter
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.export import export_checkpoint
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.store.codecs import compress, decode, decompress, encode, encoded_size
from dflash_cache.store.subspace import BASIS_FILE, fit_basis, gram, load_basis, token_shares
from dflash_cache.store.verify import verify_cache
from tests.support.drafter import random_batch, save_target_head
from tests.support.extract import LAYERS, run_extract
from tests.support.reference import reference_model_class

BLOCK = 4

WIDTH, RANK = 2 * 64, 64


def orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))[0]


def test_the_basis_spans_the_top_singular_vectors():
    """States of rank 40 plus faint noise: the energy rule keeps one group of 64 coordinates, whose
    span holds the 40 directions, and the basis is that of an SVD of the states themselves."""
    g = torch.Generator().manual_seed(0)
    directions = orthonormal(WIDTH, 40, 1)
    x = (torch.randn(500, 40, generator=g) * torch.linspace(30, 1, 40)) @ directions.T
    x += 1e-3 * torch.randn(500, WIDTH, generator=g)
    basis, kept = fit_basis(gram(x.split(128), "cpu")[0], None, 0.999)
    assert basis.shape == (WIDTH, 64) and kept > 0.999
    torch.testing.assert_close(basis.T @ basis, torch.eye(64), atol=1e-5, rtol=0)
    outside = directions - basis @ (basis.T @ directions)
    assert outside.norm() / directions.norm() < 1e-3
    top = torch.linalg.svd(x.double(), full_matrices=False).Vh[:40].T.float()  # an independent fit
    torch.testing.assert_close(basis[:, :40] @ basis[:, :40].T, top @ top.T, atol=1e-3, rtol=0)
    assert fit_basis(gram([x], "cpu")[0], 128, 0.5)[0].shape == (WIDTH, 128)  # a given rank wins


def test_token_shares_by_hand():
    """Token (3, 4, 0) keeps 9/25 on the first axis and all on two; token (0, 0, 2) nothing until the
    third: the means are 0.18, 0.5 and 1."""
    x = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0]], dtype=torch.float64)
    shares = token_shares([x], torch.eye(3, dtype=torch.float64))
    torch.testing.assert_close(shares, torch.tensor([0.18, 0.5, 1.0], dtype=torch.float64))


@pytest.fixture(scope="module")
def exported(qwen3_target_dir, tmp_path_factory):
    """A drafter trained on subspace coordinates (here: random weights and a random basis), saved,
    exported in fp32 and loaded with the reference."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen3_target_dir)
    root = tmp_path_factory.mktemp("export")
    save_target_head(model, root / "head.safetensors")
    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=len(tokenizer),
        block_size=BLOCK,
        target_layer_ids=[1, 4],
        mask_token_id=tokenizer.mask_token_id,
        num_target_layers=6,
        subspace_rank=RANK,
    )
    torch.manual_seed(0)
    ours = DFlashDrafter(config, TargetHead.load(root / "head.safetensors"), tile=16)
    basis = orthonormal(WIDTH, RANK, 2)
    ours.subspace_basis.copy_(basis)
    save_drafter(ours, root / "checkpoint")
    export_checkpoint(root / "checkpoint", root / "export", dtype="float32")
    reference = reference_model_class().from_pretrained(root / "export", dtype=torch.float32)
    return ours.eval(), reference.eval(), basis


@torch.no_grad()
def test_the_export_reads_full_states_as_the_drafter_reads_coordinates(exported):
    """Full states x with a part outside the subspace: the reference on x equals our drafter on the
    coordinates x U (to fp32 rounding), and on the coordinates the cache stores, bf16 values
    through subspace-bf16-zstd, to the bf16 rounding of a coordinate (2^-8 relative)."""
    ours, reference, basis = exported
    batch = random_batch([30, 6, 21], seed=4, hidden=64)
    full = batch.hidden.float()
    assert (full - full @ basis @ basis.T).norm() > 0.5 * full.norm()  # much of x lies outside
    n = full.shape[0]
    enc = encode(batch.hidden, "subspace-bf16-zstd", 2, basis)
    size = encoded_size("subspace-bf16-zstd", n, RANK)
    planes = decompress(compress(enc.planes.numpy(), "subspace-bf16-zstd"), "subspace-bf16-zstd", size)
    stored = decode(torch.from_numpy(planes.copy()), None, "subspace-bf16-zstd", n, RANK)
    anchors = sample_anchors(batch, BLOCK, 4, torch.Generator().manual_seed(4))
    exact = ours.block_states(DraftInputs.build(replace(batch, hidden=full @ basis), anchors))
    from_cache = ours.block_states(DraftInputs.build(replace(batch, hidden=stored.float()), anchors))
    positions, starts = batch.position_ids(), batch.cu_seqlens.long()[batch.sequence_ids()]
    for j, a in enumerate(anchors.tolist()):
        p = int(positions[a])
        block = torch.full((BLOCK,), ours.config.mask_token_id)
        block[0] = batch.input_ids[a]
        expected = reference(
            position_ids=torch.arange(p + BLOCK)[None],
            noise_embedding=ours.head.embed_tokens[block][None],
            target_hidden=full[int(starts[a]) : a][None],
        )[0]
        torch.testing.assert_close(exact[j], expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(from_cache[j], expected, atol=2e-2, rtol=2e-2)
        # our drafter handed full states (a live target at evaluation) projects them itself
    live = ours.block_states(DraftInputs.build(replace(batch, hidden=full), anchors))
    torch.testing.assert_close(live, exact, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("codec", ["subspace-fp8-zstd", "subspace-fp4"])
def test_extract_stores_coordinates_on_the_sample_basis(qwen3_target_dir, conversations, tmp_path, codec):
    """A bf16-zstd extraction is the sample; the subspace cache of the same data holds, per token,
    its states' coordinates on the basis fitted to it, within the inner codec's rounding."""
    run_extract(qwen3_target_dir, conversations, tmp_path / "full")
    with pytest.raises(DFlashCacheError, match="--subspace-sample"):
        run_extract(qwen3_target_dir, conversations, tmp_path / "refused", codec=codec)
    run_extract(
        qwen3_target_dir,
        conversations,
        tmp_path / "sub",
        codec=codec,
        subspace_sample=tmp_path / "full",
        subspace_rank=RANK,
    )
    full, sub = open_cache(tmp_path / "full"), open_cache(tmp_path / "sub")
    assert sub.spec["subspace"]["rank"] == RANK and sub.width == RANK
    assert BASIS_FILE in sub.manifest["target_files"]
    basis = load_basis(tmp_path / "sub" / "target" / BASIS_FILE, len(LAYERS) * 64, RANK)
    tolerance = 0.05 if codec == "subspace-fp8-zstd" else 0.2
    for sid in sorted(full):
        want = full[sid].hidden.float() @ basis
        got = sub[sid].hidden.float()
        assert got.shape == want.shape
        assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < tolerance
    assert verify_cache(sub).rows == len(full)
    # a rerun resumes with the basis the cache holds (the same spec), even without the sample
    run_extract(qwen3_target_dir, conversations, tmp_path / "sub", codec=codec)
