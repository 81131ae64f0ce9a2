"""The base of every fusion pass: find anchors, match the fusion's patterns, check, replace, count, explain.

A fusion subclass gives its `name` (a key of `report.matches`), `patterns()` (the formulations it accepts,
built from the backend config) and `replacement(match)` (the `dsv41::` op, its arguments, and which op output
replaces which pattern output); `tokens(match)` when the token count is not the first input's leading dim.
A match is declined above the token limit, or when the op's own validation rejects the matched values (its
fake implementation runs on them): the error, which names the argument, is the reason.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from dsv41.passes.matcher import MatchFailure, MatchResult, PatternSet
from dsv41.passes.printing import module_path

# A failed candidate is a decline worth reporting when it got past the first few ops, matched the whole structure
# and failed on a scalar or an extra user, or failed a check.
_REPORTED_KINDS = ("scalar", "extra user", "check", "token limit")


@dataclass
class Replacement:
    """op(*args) replaces the match; `outputs[i]` is the index of the op output (None for a single-output op)
    that takes the place of the pattern's i-th output."""

    op: torch._ops.OpOverload
    args: tuple
    outputs: tuple


@dataclass
class PassResult:
    name: str
    matches: int = 0
    declined: list[MatchFailure] = field(default_factory=list)
    attempts: list[MatchFailure] = field(default_factory=list)
    replaced: list[dict] = field(default_factory=list)  # per match: erased and created node names, provenance


def source_hash(*objs, extra=None) -> str:
    """sha256 over the source files of `objs` and a JSON dump of `extra` (the config a pass depends on)."""
    h = hashlib.sha256()
    for o in objs:
        h.update(inspect.getsource(inspect.getmodule(o)).encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


class GraphPass:
    """A named graph transformation with a match counter and a cache-safe uuid."""

    name: str = ""

    def __init__(self, config):
        self.config = config

    def config_key(self) -> dict:
        """The part of the backend config this pass depends on (hashed into uuid)."""
        return {}

    def uuid(self) -> str:
        return source_hash(type(self), GraphPass, extra={"pass": self.name, **self.config_key()})

    def __call__(self, graph: fx.Graph) -> PassResult:
        raise NotImplementedError


class FusionPass(GraphPass):
    def __init__(self, config):
        super().__init__(config)
        self._patterns: PatternSet | None = None

    def patterns(self) -> list:
        raise NotImplementedError

    def tokens(self, m: MatchResult):
        """The match's token count (the first input's leading dim unless a fusion says otherwise)."""
        return m.inputs[0].meta["val"].shape[0]

    def check(self, m: MatchResult) -> str | None:
        """The token limit; dtypes and shapes are checked by the op's own validation on the matched values."""
        return self.token_check(self.tokens(m))

    def explain(self, failure: MatchFailure, graph: fx.Graph) -> MatchFailure:
        """A fusion may restate a structural failure in its own terms (e.g. an iteration count)."""
        return failure

    def replacement(self, m: MatchResult) -> Replacement:
        raise NotImplementedError

    def config_key(self) -> dict:
        return {"max_tokens": self.config.max_tokens, "kernel": self.config.kernel, "constants": self.config.constants()}

    def uuid(self) -> str:
        import dsv41.passes.matcher as matcher

        return source_hash(type(self), FusionPass, matcher, extra={"pass": self.name, **self.config_key()})

    def token_check(self, t) -> str | None:
        if not isinstance(t, int):
            return f"token limit: the token count {t} is symbolic; decode fusions need a static batch"
        if t > self.config.max_tokens:
            return f"token limit: T={t} > max_tokens={self.config.max_tokens}"
        return None

    def __call__(self, graph: fx.Graph) -> PassResult:
        if self._patterns is None:
            self._patterns = PatternSet(self.patterns())
        result = PassResult(self.name)
        erased: set[fx.Node] = set()
        failures: dict[fx.Node, MatchFailure] = {}
        # Formulations in order over the whole graph: a wider pattern claims its nodes before a narrower one
        # (e.g. combine + shared add before the combine alone).
        for index in range(len(self._patterns.patterns)):
            for anchor in self._patterns.anchors(graph, index):
                if anchor in erased:
                    continue
                m = self._patterns.match_one(index, anchor)
                if isinstance(m, MatchResult):
                    reason = self.check(m)
                    rep = None
                    if reason is None:
                        rep = self.replacement(m)
                        try:  # the op's own validation (dtypes, shapes) on the matched values
                            value = _fake_output(rep)
                        except TypeError as e:
                            reason = f"dtype: {e}"
                        except (ValueError, RuntimeError) as e:
                            reason = f"the op rejects the matched inputs: {e}"
                    if reason is not None:
                        kind = "token limit" if reason.startswith("token limit") else "check"
                        m = MatchFailure(m.pattern.name, anchor.name, len(m.nodes), len(m.nodes), kind, reason)
                if isinstance(m, MatchFailure):
                    best = failures.get(anchor)
                    if best is None or _rank(m) > _rank(best):
                        failures[anchor] = m
                    continue
                result.replaced.append(self._replace(graph, m, rep, value))
                erased.update(m.nodes)
                result.matches += 1
        names = {n.name: n for n in graph.nodes}
        for anchor, f in failures.items():
            if anchor in erased:
                continue
            f = self.explain(f, graph) if f.blocking in names else f
            if f.progress >= 2:
                result.attempts.append(f)
            if f.kind in _REPORTED_KINDS or f.progress >= max(4, f.total // 3):
                result.declined.append(f)
        return result

    def _replace(self, graph: fx.Graph, m: MatchResult, rep: Replacement, value) -> dict:
        from torch._inductor.pattern_matcher import stable_topological_sort

        position = {n: i for i, n in enumerate(graph.nodes)}
        arg_nodes: list[fx.Node] = []
        fx.node.map_arg(rep.args, arg_nodes.append)
        last_input = max(arg_nodes, key=position.__getitem__)
        anchor = m.outputs[0]
        with graph.inserting_after(last_input):
            fused = graph.call_function(rep.op, rep.args)
        fused.meta["val"] = value
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in anchor.meta:
                fused.meta[key] = anchor.meta[key]
        created = [fused]
        for pat_out, idx in zip(m.outputs, rep.outputs):
            new = fused
            if idx is not None:
                with graph.inserting_after(fused):
                    new = graph.call_function(operator.getitem, (fused, idx))
                new.meta["val"] = fused.meta["val"][idx]
                for key in ("stack_trace", "nn_module_stack"):
                    if key in pat_out.meta:
                        new.meta[key] = pat_out.meta[key]
                created.append(new)
            pat_out.replace_all_uses_with(new)
        for n in reversed(m.nodes):
            graph.erase_node(n)
        stable_topological_sort(graph)  # users of an output that preceded the last input move after the op
        return {
            "pattern": m.pattern.name,
            "erased": [n.name for n in m.nodes],
            "created": [n.name for n in created],
            "stack_trace": anchor.meta.get("stack_trace"),
            "module": module_path(anchor.meta.get("nn_module_stack")),
        }


def _fake_output(rep: Replacement):
    """The op's output on the fake values of its arguments (runs the op's validation)."""
    arg_nodes: list[fx.Node] = []
    fx.node.map_arg(rep.args, arg_nodes.append)
    with detect_fake_mode([n.meta["val"] for n in arg_nodes]):
        return rep.op(*fx.node.map_arg(rep.args, lambda n: n.meta["val"]))


def _rank(f: MatchFailure) -> tuple:
    return (f.kind in _REPORTED_KINDS, f.progress / max(f.total, 1))


def _module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L['self']", "") or None

