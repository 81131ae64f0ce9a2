"""`dsv41 bench foreign` on the CPU: one foreign block end to end at the TINY config's sizes (plain calls timed, no
CUDA graphs), a block whose sizes are module constants built at the sizes asked for, every adapter's block built and run at
Flash sizes on the meta device (shapes only, no memory), and the usage errors."""

import gc
import importlib.util
import json
import weakref

import pytest
import torch

from dsv41.tools import bench_foreign as bf


def test_one_block_end_to_end_on_the_cpu(tmp_path, capsys, monkeypatch):
    """HF's grouped_mm experts: both variants compiled cold, timed, checked against eager; dsv41 fuses the sites its
    test module declares, each op runs once in the profiled step, its bf16 combine is the recorded decline, and
    nothing falls back. The table is printed last, the plot written where matplotlib is installed. The block's
    parameters are freed when the bench is done with it (at Flash sizes the next block needs their ~27 GB)."""
    parameters, build_block = [], bf.build_block

    def build_and_watch(*args, **kwargs):
        block = build_block(*args, **kwargs)
        parameters.extend(weakref.ref(p) for p in block.parameters())
        return block

    monkeypatch.setattr(bf, "build_block", build_and_watch)
    rc = bf.main(["--sizes", "tiny", "--device", "cpu", "--blocks", "hf_experts_grouped", "--replays", "3",
                  "--out", str(tmp_path), "--tag", "run"])
    assert rc == 0
    gc.collect()
    assert parameters and not [p for p in parameters if p() is not None]
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["device"] == "cpu" and "plain calls" in result["timing"] and "no CUDA graphs" in result["timing"]
    assert result["sizes"] == "tiny" and result["batch"] == 1 and result["context"] == bf.CONTEXT["tiny"]
    assert result["block_sizes"]["dim"] == 128 and result["block_sizes"]["experts"] == 16
    assert "fresh_cache" in result["compile"] and result["agreement"]["min_share"] == 0.99
    (row,) = result["blocks"]
    assert row["block"] == "hf_experts_grouped" and row["status"] == "ok" and row["default_device"] is None
    assert row["model_bytes"] > 0
    inductor, dsv41 = row["variants"]
    assert [inductor["variant"], dsv41["variant"]] == ["inductor", "dsv41"]
    for v in (inductor, dsv41):
        assert v["status"] == "ok" and v["compile_s"] > 0 and v["step_us"] > 0 and v["peak_bytes"] is None
        assert v["agreement"]["ok"] and [o["nan"] for o in v["agreement"]["outputs"]] == [False]
    assert row["expected"] and dsv41["fused"] == row["expected"], (dsv41["fused"], row["expected"])
    assert set(dsv41["formulations"]) == set(row["expected"])
    assert dsv41["fallback"] == [] and dsv41["graphs"] == 1
    assert dsv41["dsv41_op_calls"] == sum(dsv41["fused"].values()) and inductor["dsv41_op_calls"] == 0
    assert "kernel_us" not in dsv41  # device kernels are profiled on a GPU only
    (decline,) = dsv41["records"]["declined"]["moe_finalize"]
    assert "accumulates in bf16" in decline, decline
    assert row["ratios"]["step_us"] == round(dsv41["step_us"] / inductor["step_us"], 3)
    assert row["ratios"]["compile_s"] == round(dsv41["compile_s"] / inductor["compile_s"], 3)
    table = capsys.readouterr().out.split("\nforeign blocks at tiny sizes")[-1]
    (line,) = [ln for ln in table.splitlines() if ln.strip().startswith("hf_experts_grouped")]
    assert "3/3 " in line and "inductor ok, dsv41 ok" in line, line
    # the plot where matplotlib is installed (the GPU machine), none where it is not (this CPU image)
    assert (tmp_path / "run.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_a_block_whose_sizes_are_module_constants_is_built_at_the_sizes_asked_for(tmp_path):
    """libfn_style keeps its sizes as module constants: the bench sets them to the TINY config's, then every site
    fuses in the default mode and the fused ops run."""
    assert bf.main(["--sizes", "tiny", "--device", "cpu", "--blocks", "libfn", "--replays", "2",
                    "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "foreign.json").read_text())["blocks"]
    libfn = bf.foreign_loader(bf.DEFAULT_FOREIGN_DIR)("libfn_style")
    sizes = bf.BlockSizes.of_config("tiny", bf.CONTEXT["tiny"])
    assert (libfn.D, libfn.N_EXPERTS, libfn.N_CAP) == (sizes.dim, sizes.experts, sizes.context)
    dsv41 = row["variants"][1]
    assert row["model_bytes"] > 0 and dsv41["status"] == "ok", dsv41["status"]
    assert dsv41["fused"] == row["expected"] == libfn.SITES and not dsv41["fallback"]
    assert dsv41["dsv41_op_calls"] == sum(libfn.SITES.values())


def test_every_block_runs_at_flash_sizes_on_meta():
    """Each adapter's block at the Flash sizes (about 27 GB of routed experts, on the meta device) takes the inputs
    the adapter builds: its eager step runs, under the meta default device where it creates device-less tensors,
    and its first output is [.., 5120]."""
    load, meta = bf.foreign_loader(bf.DEFAULT_FOREIGN_DIR), torch.device("meta")
    sizes = bf.BlockSizes.of_config("flash", bf.CONTEXT["flash"])
    for spec in bf.BLOCKS:
        module = load(spec.module)
        block = bf.build_block(spec, module, sizes, meta)
        inputs = [t.to(meta) for t in spec.inputs(module, block, sizes, bf.BATCH, torch.Generator().manual_seed(1))]
        assert bf.model_bytes(block, inputs) > 27e9, spec.name
        out, _ = bf.run_eager(block, inputs, meta)
        first = torch.utils._pytree.tree_leaves(out)[0]
        assert first.device == meta and first.shape[-1] == sizes.dim and first.numel() == sizes.dim, spec.name
        assert spec.expected(load), spec.name


def test_a_missing_foreign_dir_is_an_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert bf.main(["--sizes", "tiny", "--device", "cpu", "--foreign-dir", str(missing)]) == 2
    assert f"--foreign-dir {missing}: no such directory" in capsys.readouterr().err
    assert bf.main(["--sizes", "tiny", "--device", "cpu", "--foreign-dir", str(tmp_path)]) == 2
    assert "not a Python package" in capsys.readouterr().err


def test_bad_arguments_are_refused_before_any_work(capsys):
    from dsv41.tools.bench import main as bench

    with pytest.raises(SystemExit) as e:
        bench(["foreign", "--blocks", "hf,nope", "--device", "cpu"])
    assert e.value.code == 2 and "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bf.main(["--replays", "0", "--device", "cpu"])
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cuda_without_a_gpu_says_so(capsys):
    assert bf.main(["--device", "cuda"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_dsv41_no_further_from_eager_than_inductor_passes():
    """dsv41 short of the 99% share passes where each floating output's relative L2 to eager is within 1.5x plain
    Inductor's (or 2e-2) and each integer output equals eager's at least as often; a NaN, a larger distance or a
    less often equal selection keeps it a disagreement; a dsv41 row that agreed is left as it is."""
    def variant(name, status, *outputs):
        return {"variant": name, "status": status, "agreement": {"ok": False, "outputs": list(outputs)}}

    def out(rel_l2=None, share=0.5, nan=False):
        entry = {"nan": nan, "share_close": share}
        if rel_l2 is not None:
            entry["rel_l2"] = rel_l2
        return entry

    inductor = variant("inductor", "disagrees with eager", out(0.10), out(share=0.9))
    cases = [((out(0.14), out(share=0.95)), "ok"), ((out(0.16), out(share=0.95)), "disagrees with eager"),
             ((out(0.01), out(share=0.8)), "disagrees with eager"),
             ((out(0.01, nan=True), out(share=1.0)), "disagrees with eager")]
    for outputs, status in cases:
        dsv41 = variant("dsv41", "disagrees with eager", *outputs)
        bf.judge_against_inductor([inductor, dsv41])
        assert dsv41["status"] == status, outputs
        assert (dsv41["agreement"].get("rule") is not None) == (status == "ok")
    small = variant("inductor", "ok", out(0.001), out(share=1.0))
    dsv41 = variant("dsv41", "disagrees with eager", out(0.019), out(share=1.0))
    bf.judge_against_inductor([small, dsv41])
    assert dsv41["status"] == "ok"  # within the 2e-2 floor
