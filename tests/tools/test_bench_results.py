"""The benchmarks' bookkeeping, on hand-made inputs (the timing itself needs the H200): stream overlap from a
chrome trace, and merging the results of processes that ran different parts of one benchmark on different GPUs."""

import json

import pytest

from dsv41.models import TINY, DSV41Model
from dsv41.tools.bench_decode import fixed_cost, merge, module_groups, op_group, stream_overlap


def _kernel(stream, ts, dur):
    return {"cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_stream_overlap_counts_side_time_under_main_kernels(tmp_path):
    events = [_kernel(7, 0, 10), _kernel(7, 10, 10), _kernel(7, 30, 10),  # main: [0,20) and [30,40)
              _kernel(20, 5, 10),  # side, fully inside main: 10
              _kernel(20, 18, 10),  # side [18,28): 2 with main
              _kernel(21, 40, 5),  # side after main: 0
              {"cat": "cpu_op", "ts": 0, "dur": 100}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = stream_overlap(str(path))
    assert got == {"kernels_per_stream": {"7": 3, "20": 2, "21": 1}, "main_stream": "7",
                   "side_kernel_us_overlapping_main": 12.0}


def _result(batches, bandwidth, **over):
    base = {"gpu": "H200", "torch": "2.11", "layers": [2, 3], "context": 4096, "config": "flash",
            "inductor_mode": "default", "copy_bandwidth_GBps": bandwidth,
            "start": "cold", "agreement_bound": 0.02,
            "rows": [{"batch": b, "variant": "dsv41", "status": "ok", "step_us": 10.0 * b, "per_layer_us": 2.0 * b,
                      "floor_us": 1.0, "per_layer_floor_us": 0.2, "check": {"ok": True, "rel_l2": 1e-3}} for b in batches],
            "floors": {str(b): {"floor_us": 1.0} for b in batches},
            "breakdown": {str(b): [] for b in batches}, "stream_overlap": {str(b): {} for b in batches if b < 8}}
    return {**base, **over}


def test_merge_concatenates_disjoint_batches_and_keeps_each_bandwidth():
    got = merge([_result([8, 64], 4100.0), _result([1, 32], 4200.0)])
    assert [r["batch"] for r in got["rows"]] == [1, 8, 32, 64]
    assert sorted(got["floors"], key=int) == ["1", "8", "32", "64"]
    assert [p["GBps"] for p in got["copy_bandwidth_GBps_by_part"]] == [4100.0, 4200.0]
    assert got["copy_bandwidth_GBps"] == 4100.0
    assert got["stream_overlap"] == {"1": {}}


def test_merge_refuses_overlapping_or_different_runs():
    with pytest.raises(ValueError, match="disjoint"):
        merge([_result([1, 8], 4100.0), _result([8], 4100.0)])
    with pytest.raises(ValueError, match=r"differ in \['context'\]"):
        merge([_result([1], 4100.0), _result([8], 4100.0, context=1024)])


def test_table_and_plot_skip_rows_that_were_not_timed(tmp_path, capsys):
    """A variant that disagreed and one that failed keep their rows (with the reason); only timed rows are plotted;
    a run with no timed row writes its JSON and no plot, instead of crashing on a log scale of nothing."""
    from dsv41.tools.bench_decode import print_table, write_result

    result = _result([1, 8], 4100.0)
    result["rows"] += [{"batch": 1, "variant": "inductor", "floor_us": 1.0, "per_layer_floor_us": 0.2, "step_us": 12.0,
                        "per_layer_us": 2.5, "status": "disagrees: logits differ from eager by rel L2 0.9 > 0.05",
                        "check": {"rel_l2": 0.9}},
                       {"batch": 8, "variant": "dsv41-nostreams", "floor_us": 1.0, "per_layer_floor_us": 0.2,
                        "status": "failed: OutOfMemoryError: CUDA out of memory"}]
    write_result(result, str(tmp_path), "run")
    print_table(result)
    out = capsys.readouterr().out
    assert "disagrees: logits differ" in out and "failed: OutOfMemoryError" in out
    assert "dsv41/floor 10.00 (step), 10.00 (per layer); dsv41/inductor 0.83 (step), 0.80 (per layer)" in out
    assert json.loads((tmp_path / "run.json").read_text())["rows"][-1]["status"].startswith("failed")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "run.png").stat().st_size > 0
    nothing = _result([1], 4100.0)
    nothing["rows"] = result["rows"][-1:]
    write_result(nothing, str(tmp_path), "none")
    assert (tmp_path / "none.json").exists() and not (tmp_path / "none.png").exists()


def test_kernel_results_merge_by_op():
    from dsv41.tools.bench_kernels import merge as merge_kernels

    def part(op, gbps):
        return {"gpu": "H200", "torch": "2.11", "copy_gbps": gbps, "rows": [{"op": op, "tokens": 1, "us": 1.0}]}

    got = merge_kernels([part("mhc_post_pre", 4200.0), part("mhc_coeffs", 4100.0)])
    assert [r["op"] for r in got["rows"]] == ["mhc_post_pre", "mhc_coeffs"]
    assert got["copy_gbps_by_op"] == {"mhc_post_pre": 4200.0, "mhc_coeffs": 4100.0} and got["copy_gbps"] == 4100.0
    with pytest.raises(ValueError, match="disjoint ops"):
        merge_kernels([part("mhc_coeffs", 1.0), part("mhc_coeffs", 1.0)])


def test_gemms_are_named_by_their_weight_operand():
    """At a batch equal to the indexer's head count (Flash: 32) the head's input x [T, dim] has the shape of the
    indexer's weights_proj [heads, dim]: only the weight operand [K, N] names a GEMM."""
    cfg = TINY
    t = cfg.index_n_heads
    weights = module_groups(DSV41Model(cfg, [2], max_batch=1, max_context=cfg.window_size))
    assert weights[(cfg.dim, cfg.vocab_size)] == "head"
    assert weights[(cfg.dim, cfg.index_n_heads)] == "attn.indexer.weights_proj"
    host = dict(weights=weights, on_device=False)
    assert op_group("aten::mm", [[t, cfg.dim], [cfg.dim, cfg.vocab_size]], **host) == "gemm head"
    assert op_group("aten::addmm", [[t], [t, cfg.dim], [cfg.dim, cfg.index_n_heads]], **host) == \
        "gemm attn.indexer.weights_proj"
    assert op_group("aten::bmm", [[t, 64, 512], [t, 512, 640]], **host) == f"gemm [({t}, 64, 512), ({t}, 512, 640)]"
    assert op_group("aten::_grouped_mm", [], **host) == "gemm routed experts"
    assert op_group("dsv41::mhc_coeffs", [], **host) == "dsv41::mhc_coeffs"


def test_each_kernel_is_counted_once():
    """A Triton launch appears twice in a profile, as the launcher's host record and as the kernel, with the same
    device time: only the kernel counts. Other kernels count in the op that launched them."""
    assert op_group("triton_poi_fused_add_0", [], {}, on_device=True) == "inductor glue kernels"
    assert op_group("triton_poi_fused_add_0", [], {}, on_device=False) is None
    assert op_group("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", [], {}, on_device=True) is None
    assert op_group("## Call CompiledFxGraph fabc ##", [], {}, on_device=False) is None

def test_fixed_cost_leaves_out_the_weight_streaming_kernels():
    """The time outside the weight-streaming kernels: every group but the linears' GEMMs (by the weights they read,
    the head's included) and the expert / wo_a ops, per layer; an activation GEMM (attention's bmm) is fixed cost."""
    weights = {(4096, 1024): "attn.wq_a", (4096, 129280): "head"}
    totals = {"gemm attn.wq_a": 10.0, "gemm head": 300.0, "dsv41::moe_experts": 40.0, "dsv41::wo_a": 20.0,
              "gemm routed experts": 5.0, "gemm [(1, 64, 512), (1, 512, 640)]": 3.0, "dsv41::mhc_coeffs": 12.0,
              "inductor glue kernels": 25.0}
    assert fixed_cost(totals, weights, n_layers=4) == {"weight_streaming_us": 375.0, "other_us": 40.0,
                                                        "other_us_per_layer": 10.0}


def test_decode_variant_names():
    from dsv41.tools.bench_decode import variant_config

    assert variant_config("dsv41") == {}
    assert variant_config("dsv41-nostreams") == {"streams": False}
    assert variant_config("dsv41-streams=mhc_coeffs+indexer") == {
        "stream_branches": frozenset({"mhc_coeffs", "indexer"})}
    with pytest.raises(ValueError, match="unknown variant 'dsv41-fast'"):
        variant_config("dsv41-fast")


def test_decode_rejects_an_unknown_branch_kind_before_any_work():
    from dsv41.tools.bench_decode import main

    with pytest.raises(SystemExit) as e:
        main(["--variants", "dsv41-streams=router", "--replays", "50"])
    assert e.value.code == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only answer")
def test_kernel_profiler_launches_need_cuda(capsys):
    """`dsv41 bench kernels --profiler-launches` (for benchmarks/ncu_kernels.sh) parses, and without a GPU says so."""
    from dsv41.tools.bench_kernels import main

    assert main(["--profiler-launches", "--op", "mhc_coeffs", "--tokens", "1"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_gpu_turn_measures_alone_and_lets_compiles_share(tmp_path):
    """Shared turns (compiles) overlap; an exclusive turn (a measurement) waits for every shared holder, and a shared
    turn asked for while a measurement waits queues behind it (writer preference), so a measurement is never starved
    and never shares the GPU. Each turn opens the lock file itself, as another process would (flock is per open file)."""
    import threading

    from dsv41.tools.bench_decode import gpu_turn

    lock = str(tmp_path / "gpu.lock")
    order, entered, release = [], {}, {}

    def turn(name, shared):
        entered[name], release[name] = threading.Event(), threading.Event()

        def run():
            with gpu_turn(lock, shared=shared):
                order.append(name)
                entered[name].set()
                release[name].wait(10)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    threads = [turn("compile_a", True), turn("compile_b", True)]
    assert entered["compile_a"].wait(5) and entered["compile_b"].wait(5)  # two compiles at once
    threads.append(turn("measure", False))
    assert not entered["measure"].wait(0.3)  # waits for both compiles
    threads.append(turn("compile_c", True))
    assert not entered["compile_c"].wait(0.3)  # queues behind the waiting measurement
    release["compile_a"].set()
    assert not entered["measure"].wait(0.3)  # compile_b still holds its turn
    release["compile_b"].set()
    assert entered["measure"].wait(5)
    assert not entered["compile_c"].wait(0.3)  # no compile while a measurement runs
    release["measure"].set()
    assert entered["compile_c"].wait(5)
    release["compile_c"].set()
    for thread in threads:
        thread.join(5)
    assert sorted(order[:2]) == ["compile_a", "compile_b"] and order[2:] == ["measure", "compile_c"]


def test_gpu_turn_without_a_lock_file_is_free():
    from dsv41.tools.bench_decode import gpu_turn

    with gpu_turn(None), gpu_turn(None, shared=True):
        pass
