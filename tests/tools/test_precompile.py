"""`dsv41 precompile`: the kernels it lists follow the config (the ones without a build for it are left out), the
indexer's launches follow --max-context, a bad --max-context is a usage error, and a listed thunk really builds."""

import pytest

from dsv41.models.config import get_config
from dsv41.tools import precompile


def _labels(config, max_context=None):
    return [label for label, _ in precompile.kernels_for(get_config(config), max_context)]


def test_flash_lists_every_kernel_and_the_indexer_only_with_a_context():
    without = _labels("flash")
    assert [label.split("(")[0] for label in without] == ["mhc_coeffs", "mhc_post_pre", "mhc_post_pre", "qkv_norm",
                                                           "moe_route", "moe_metadata", "moe_experts", "moe_finalize",
                                                           "moe_finalize"]
    cfg = get_config("flash")
    max_context = 4224
    extra = _labels("flash", max_context)[len(without):]
    assert extra[:3] == [f"indexer_topk scores (candidate-masked={m}, block maxima={b})"
                         for m, b in ((False, False), (False, True), (True, False))]
    n_blocks = -(-max_context // cfg.ratio(cfg.candidate_source_layer) // cfg.candidate_block_size)
    widths = sorted({max_context // cfg.ratio(cfg.kv_source(layer)) for layer in cfg.index_source_layers})
    assert widths == [max_context // 2, max_context]
    assert extra[3:] == [f"indexer_topk select (N={n}, K={min(k, n)})" for n, k in
                         sorted([(n_blocks, cfg.candidate_topk_blocks)] + [(n, cfg.index_topk) for n in widths])] + [
        "indexer_topk candidate filter"]  # the sampled path of the rows wider than 4096 (max_context 4224)
    assert "indexer_topk candidate filter" not in _labels("flash", 4096)  # every row fits one select CTA


def test_tiny_leaves_out_what_has_no_build():
    # the router kernel needs D % 1024 == 0 and the indexer kernel 32 heads of 128: the tiny config has neither
    assert [label.split("(")[0] for label in _labels("tiny", 4224)] == ["mhc_coeffs", "mhc_post_pre", "qkv_norm",
                                                                         "moe_metadata", "moe_experts", "moe_finalize",
                                                                         "moe_finalize"]


def test_bad_max_context_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        precompile.main(["--max-context", "0"])
    assert exit_info.value.code == 2
    assert "argument --max-context: must be >= 1, got 0" in capsys.readouterr().err


def test_a_listed_kernel_builds(monkeypatch, tmp_path):
    pytest.importorskip("cutlass.cute")
    pytest.importorskip("tvm_ffi")
    from dsv41.kernels import moe_experts

    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path))
    moe_experts._compile_moe_experts.cache_clear()
    (label, build), = [(label, build) for label, build in precompile.kernels_for(get_config("tiny"))
                       if label.startswith("moe_experts")]
    gemm1, gemm2 = build()
    assert callable(gemm1) and callable(gemm2), label
    assert any(tmp_path.rglob("*")), "nothing written to the kernel cache"
    moe_experts._compile_moe_experts.cache_clear()


def test_it_writes_the_pattern_library_once(monkeypatch, tmp_path, capsys):
    """The traced-pattern library is written beside the kernels: every fusion pass's entry the first time, none the
    second (they are on disk)."""
    pytest.importorskip("cutlass.cute")
    pytest.importorskip("tvm_ffi")
    from dsv41.passes import registry

    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("DSV41_PATTERN_CACHE_DIR", str(tmp_path / "patterns"))
    fusions = len(registry.FUSION_NAMES)
    assert precompile.main(["--config", "tiny"]) == 0
    assert f"{fusions} of {fusions} fusion passes' patterns traced" in capsys.readouterr().out
    assert len(list((tmp_path / "patterns").glob("*.pkl"))) == fusions
    assert precompile.main(["--config", "tiny"]) == 0
    assert f"0 of {fusions} fusion passes' patterns traced" in capsys.readouterr().out
