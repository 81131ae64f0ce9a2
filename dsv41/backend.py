"""The dsv41 torch.compile backend, read top to bottom:

1. Dynamo hands over a Torch-IR graph. If its sizes are symbolic (`dynamic=True`, or Dynamo's automatic dynamic
   shapes after a second batch size) and fusions declined for it, the backend also returns a
   `SizeSpecializedGraph`, which runs steps 2-4 again, statically, for sizes that recur
   (`dsv41.size_specialization`), since the decode fusions need static shapes.
2. AOTAutograd turns it into a functionalised ATen inference graph with Inductor's decompositions (buffer
   mutations such as cache writes stay in the graph as trailing `copy_`s).
3. The dsv41 pass manager rewrites that graph (normalise, fuse, schedule streams, defunctionalise) and records a
   `CompileReport` in `backend.reports`; on a warm start the pass cache hands back the rewrite and the report.
4. Code generation: `inductor` compiles the rewritten graph with Inductor (the `dsv41::` ops stay opaque extern
   calls); `fx` runs the rewritten graph as is. A graph with a side-stream schedule is cut into stream segments,
   each compiled that way, and run by `dsv41.stream_executor.StreamExecutor`.

A graph the pipeline cannot handle is compiled by plain Inductor instead, with the reason logged and stored in
`report.fallback`: never a wrong result. Dynamo's own control-flow signals (`torch._dynamo.exc.RestartAnalysis`,
e.g. TensorifyScalarRestartAnalysis under `dynamic=True`, and `SkipFrame`) are not failures: they pass through
untouched, and Dynamo retraces and calls the backend again.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table

from dsv41.config import Dsv41Config
from dsv41.passes.decompose import PRECISION_BARRIER
from dsv41.passes.manager import CompileReport, PassManager
from dsv41.size_specialization import SizeSpecializedGraph, size_locations
from dsv41.stream_executor import StreamExecutor, has_schedule

log = logging.getLogger("dsv41")

# Inductor settings for the leftover graph. emulate_precision_casts keeps the bf16 rounding points of the
# model (spec 2.9): fake quantisation and top-k are discontinuous, so a skipped rounding changes results.
INDUCTOR_PATCHES = {"emulate_precision_casts": True}

# Raised inside a backend to make Dynamo restart or skip the frame, not errors of the backend.
DYNAMO_SIGNALS = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)


class Dsv41Backend:
    """A torch.compile backend: `torch.compile(model, backend=Dsv41Backend(config))`.

    `Dsv41Backend(from_env=True)` (the registered `dsv41_backend`) reads its config, the defaults with the DSV41_*
    environment applied, when it is first used, so a bad variable raises there (naming it) and not at import."""

    def __init__(self, config: Dsv41Config | None = None, *, from_env: bool = False):
        _check_config("Dsv41Backend", config)
        self._config, self._from_env = config, from_env
        self._pass_manager: PassManager | None = None
        self.reports: list[CompileReport] = []
        self._with_options: dict[Dsv41Config, Dsv41Backend] = {}

    def with_options(self, options: dict) -> "Dsv41Backend":
        """The backend of this config with `options` (settings by name, `torch.compile(..., options=...)`) applied;
        one per resulting config, recording into this backend's `reports`. A bad option raises as a bad setting."""
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise TypeError(f"Dsv41Backend: options must be a dict of settings by name, got {options!r}")
        config = self.config.replace(**options)
        if config not in self._with_options:
            backend = Dsv41Backend(config)
            backend.reports = self.reports
            self._with_options[config] = backend
        return self._with_options[config]

    @property
    def config(self) -> Dsv41Config:
        if self._config is None:
            self._config = Dsv41Config().with_env() if self._from_env else Dsv41Config()
        return self._config

    @property
    def pass_manager(self) -> PassManager:
        if self._pass_manager is None:
            self._pass_manager = PassManager(self.config)
            if self.config.dump_dir:  # graph-diff snapshots of every pass (`dsv41 graphdiff show DIR`)
                from dsv41.tools.graphdiff import Recorder

                self._pass_manager.recorder = Recorder(self.config.dump_dir)
        return self._pass_manager

    def __call__(self, gm: fx.GraphModule, example_inputs, options: dict | None = None):
        if options:  # torch.compile(..., backend="dsv41", options={...})
            return self.with_options(options)(gm, example_inputs)
        import dsv41.lowerings  # noqa: F401  (registers the dsv41:: ops)

        self.pass_manager  # a bad setting raises here, before any report or fallback
        report = CompileReport(graph_id=len(self.reports))
        symbolic = self._compile_reported(gm, example_inputs, report)
        if not _declined_for_symbols(report):
            return symbolic
        locations = size_locations(gm) if self.config.specialize_sizes else None
        if locations is None:
            log.warning("dsv41: graph %d has a symbolic token count, so the decode fusions declined; compile with "
                        "torch.compile(..., dynamic=False) (one graph per batch size)", report.graph_id)
            return symbolic
        log.info("dsv41: graph %d has symbolic sizes, so the decode fusions declined there; sizes that recur are "
                 "compiled statically (at most specialize_sizes = %d)", report.graph_id, self.config.specialize_sizes)
        return SizeSpecializedGraph(gm, symbolic, locations, self.config.specialize_sizes, self._compile_sizes,
                                    self._sizes_overflow)

    def _compile_reported(self, gm: fx.GraphModule, example_inputs, report: CompileReport):
        """`_compile` with `report` appended to `reports`; plain Inductor, on record, where the pipeline fails."""
        self.reports.append(report)
        try:
            return self._compile(gm, example_inputs, report)
        except DYNAMO_SIGNALS:
            self.reports.remove(report)  # Dynamo retraces and calls again: that attempt gets the report
            raise
        except Exception as e:  # a graph we cannot handle: plain Inductor, with the reason on record
            report.fallback = f"{type(e).__name__}: {e}"
            log.warning("dsv41: graph %d falls back to plain Inductor: %s", report.graph_id, report.fallback)
            from torch._inductor.compile_fx import compile_fx

            with torch._inductor.config.patch(INDUCTOR_PATCHES):
                return compile_fx(gm, example_inputs)

    def _compile_sizes(self, gm: fx.GraphModule, inputs: list, sizes: dict[str, int]):
        """gm compiled statically for one call's real inputs (`SizeSpecializedGraph`), or None. This runs outside
        Dynamo, so a Dynamo signal cannot restart anything: those sizes keep the symbolic compile, on record."""
        try:
            return self._compile_reported(gm, inputs, CompileReport(graph_id=len(self.reports), sizes=sizes))
        except DYNAMO_SIGNALS as e:
            self._symbolic_for(sizes, f"{type(e).__name__} while compiling for these sizes")
            return None

    def _sizes_overflow(self, sizes: dict[str, int]) -> None:
        self._symbolic_for(sizes, f"more sets of sizes than specialize_sizes = {self.config.specialize_sizes} "
                                  "(raise it, or compile with dynamic=False)")

    def _symbolic_for(self, sizes: dict[str, int], why: str) -> None:
        report = CompileReport(graph_id=len(self.reports), sizes=sizes, fallback=f"runs the symbolic compile: {why}")
        self.reports.append(report)
        log.warning("dsv41: graph %d for sizes %s %s", report.graph_id, sizes, report.fallback)

    def _compile(self, gm: fx.GraphModule, example_inputs, report: CompileReport):
        seconds = report.seconds

        def inference_compiler(aten_gm: fx.GraphModule, inputs):
            t0 = time.perf_counter()
            self.pass_manager.run_cached(aten_gm, report)
            aten_gm.recompile()
            t1 = time.perf_counter()
            seconds["passes"] = t1 - t0
            try:
                if has_schedule(aten_gm.graph):
                    return StreamExecutor(aten_gm, self._compile_graph)
                return self._compile_graph(aten_gm, inputs)
            finally:
                seconds["codegen"] = time.perf_counter() - t1

        def no_training(aten_gm, inputs):
            raise NotImplementedError("dsv41 compiles inference (decode) graphs only; run under torch.no_grad()")

        # v1 wrappers of mutating custom ops: the form defunctionalisation rewrites (compile anchors, pitfall 10); the
        # Inductor settings during the trace too: under emulate_precision_casts AOT's trace marks the ops whose
        # bf16 results Inductor must round as eager does (without the marks a fused chain keeps fp32 values)
        t_start = time.perf_counter()
        try:
            with torch._inductor.config.patch({**INDUCTOR_PATCHES, "enable_auto_functionalized_v2": False}):
                return aot_module_simplified(gm, example_inputs, fw_compiler=no_training,
                                             inference_compiler=inference_compiler,
                                             decompositions=select_decomp_table(), keep_inference_input_mutations=True)
        finally:
            seconds["aot"] = time.perf_counter() - t_start - seconds.get("passes", 0.0) - seconds.get("codegen", 0.0)

    def _compile_graph(self, gm: fx.GraphModule, inputs):
        """A boxed callable for `gm`: Inductor's compiled code, or the GraphModule itself in fx mode and for a
        graph of nothing but dsv41 ops (a stream segment holding one fused op has nothing for Inductor)."""
        if self.config.mode == "fx" or _only_dsv41_ops(gm.graph):
            return make_boxed_func(gm.forward)
        from torch._inductor.compile_fx import compile_fx_inner

        patches = dict(INDUCTOR_PATCHES)
        if torch._inductor.config.post_grad_custom_post_pass is None:  # (a user's own pass stays; see RoundingPoints)
            patches["post_grad_custom_post_pass"] = RoundingPoints(gm.graph)
        with torch._inductor.config.patch(patches):
            return compile_fx_inner(gm, inputs)


class RoundingPoints(CustomGraphPass):
    """A post-grad pass that changes nothing, whose `uuid` (part of the key of Inductor's FX graph cache) names the
    graph's low-precision barriers (`dsv41.passes.decompose.PRECISION_BARRIER`). The key hashes the graph's code
    but not its node annotations, so without it a graph compiled before its nodes were marked would be served for
    the same code with the marks, and round elsewhere than eager."""

    def __init__(self, graph: fx.Graph):
        barriers = " ".join(n.name for n in graph.nodes if n.meta.get(PRECISION_BARRIER))
        self.key = hashlib.sha256(barriers.encode()).hexdigest()

    def __call__(self, graph: fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return self.key


def _declined_for_symbols(report: CompileReport) -> bool:
    return any(": symbolic shape: " in r for reasons in report.declined.values() for r in reasons)


def _only_dsv41_ops(graph: fx.Graph) -> bool:
    import operator

    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    return bool(calls) and all(getattr(n.target, "namespace", None) == "dsv41" for n in calls)


def _check_config(where: str, config) -> None:
    if config is not None and not isinstance(config, Dsv41Config):
        raise TypeError(f"{where}: config must be a Dsv41Config or None, got {type(config).__name__}")


def make_backend(config: Dsv41Config | None = None, **overrides) -> Dsv41Backend:
    """A backend from `config` (defaults if None) with keyword overrides, then the DSV41_* environment applied."""
    _check_config("make_backend", config)
    config = (config or Dsv41Config()).replace(**overrides).with_env()
    return Dsv41Backend(config)


dsv41_backend = Dsv41Backend(from_env=True)
