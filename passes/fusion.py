"""The base of every fusion pass: find anchors, match the fusion's patterns, check, replace, count, explain.

A fusion subclass gives its `name` (a key of `report.matches`), `patterns()` (the formulations it accepts,
built from the backend config, each with its `form`: an instance of the pass's `form_type`, a frozen dataclass
whose fields are the axes in which the formulations differ) and `replacement(match)` (the `dsv41::` op, its
arguments, and which op output replaces which pattern output, decided by the matched pattern's form, never by its
name); `tokens(match)` when the token count is not the first input's leading dim.
A match is declined above the token limit, or when the op's own validation rejects the matched values (its
fake implementation runs on them): the error, which names the argument, is the reason.

Semantic check: a match whose graph computes part of the pattern with other ops (islands, see
`dsv41.passes.matcher`) is replaced only if the matched region and the op's reference agree on fresh random
inputs of the matched dtypes (`sample_inputs`: normal floats in the input's dtype, booleans at 1/2, integers in the
range the fusion declares), to the fusion's `tolerance` (exact unless the pass states one). The check, the sizes it
ran at and the value domain it covered are recorded with the replacement (`verified`).

Its memory is bounded by the region's activations, never by its weights: the inputs are drawn on their own device
(a device generator, nothing drawn on the host and copied), one draw alive at a time, and

- at reduced sizes first, where the fusion declares a size its regions and op compute with whatever its value
  (`reductions`: the experts' count E, since each row reads only its own expert's weights): the inputs that carry it
  are drawn with that size cut to the declared one (all E experts' w13 [E, 2I, D] and w2 [E, D, I] drawn as 4
  experts), the integer ranges read from the drawn shapes (expert ids in [0, 4)). A weight reached through a view
  chain (`Derived`) is cut along the dim of the stored value that carries the size, found by evaluating the chain on
  meta tensors; where no such dim exists (a size baked into a view of the chain) the size is not reduced;
- at the graph's full sizes where no size is reduced, or where the region or the op fails or disagrees at the
  reduced sizes (the region writes the size into a view or a count of a value it computes), only when the draws
  fit `draw_budget`: max(the bytes the region itself computes, i.e. its non-view nodes' values at the graph's
  sizes, DRAW_FLOOR_BYTES). Beyond it the match is declined with a recorded reason that gives both numbers.

The floor (256 MiB) lets a dense weight of a few tens of MiB be drawn whole beside a one-token activation (the
Flash wo_a weight, 64 MiB, whose group view bakes its rank); it is not a function of the model's size. Reduced sizes
check the same math on the experts drawn: a wrong expert index, a transposed weight or another scalar (a SwiGLU
limit) still disagree there (`tests/passes/test_semantic_check.py`).
What they cannot see is a region that treats experts beyond the drawn ones differently from those (a bound baked
into the region, `ids.clamp(max=5)`): the reduction is the claim that the region is generic in that size, as the
pattern is.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dsv41.passes.matcher import (Derived, MatchFailure, MatchResult, PatternSet, evaluate, fake_value, leaves,
                                  quiet_fake_tensor)
from dsv41.passes.normalize import view_root
from dsv41.passes.pattern_library import entry_key
from dsv41.passes.printing import module_path

log = logging.getLogger("dsv41")

# Every anchor that a pass does not fuse leaves one record, its deepest failure over the patterns: a decline
# (`declined`) when it matched the whole structure and failed on a scalar, an extra user, the semantic check, the
# op's check or the token limit, or failed on a dtype after four ops; else a near miss (`attempts`) when it matched
# at least _NEAR pattern ops before the first differing op, or reached an input of the graph (kind "graph input"; and
# "graph break" where Dynamo has recorded breaks, which may have split the site there: `_SPLIT`); else another
# computation (`unrelated`: it differs within the pattern's first ops, e.g. the top-k of another fusion).
_REPORTED_KINDS = ("scalar", "extra user", "check", "token limit", "symbolic shape", "semantic")
_NEAR = 2
_SPLIT = "graph break"  # the kind of a site that reaches a graph input where Dynamo has recorded graph breaks
_SEMANTIC_DRAWS = 2
_SEMANTIC_SEED = 0x5EED
# the semantic check draws a region's inputs at full size only within max(the bytes the region computes, this)
DRAW_FLOOR_BYTES = 256 * 2**20
# dtypes torch.randn draws directly; another float dtype (float8) is drawn in fp32 and cast
_RANDN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Traced patterns per (fusion pass class, config constants), shared by every backend of the process: a pass's
# patterns depend on nothing else (their structural traces come from the library on disk, `pattern_library`).
_PATTERN_SETS: dict = {}
# An op-for-op match that fails on these is a different computation (another eps, dtype, ...): not retried with islands.
_FINAL_KINDS = ("scalar", "dtype", "extra user", "token limit", "symbolic shape")


def forget_pattern_sets() -> None:
    """Drop the process's traced patterns: the next fusion pass reads them from the library again, as a process's
    first compile does (for measuring one)."""
    _PATTERN_SETS.clear()


@dataclass(frozen=True)
class Reduction:
    """A size that a fusion's matched regions and its op compute with whatever its value (the experts' count E: each
    row reads its own expert's weights only), which the semantic check draws at `size` where the graph's is larger:
    `dims` maps the pattern inputs that carry it to the dim that does (w13 -> 0, offsets -> 0)."""

    dims: dict
    size: int


@dataclass
class Draws:
    """What one semantic check draws: each graph input node's shape (`shapes`; the graph's, or reduced), the sizes
    reduced (`reduced`: name -> (the graph's, drawn)), and one seeded generator per device."""

    shapes: dict
    reduced: dict
    generators: dict = field(default_factory=dict)

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator of `device` (the draws are made where the values are used)."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(_SEMANTIC_SEED)
        return self.generators[device]

    def nbytes(self) -> int:
        return sum(math.prod(shape) * n.meta["val"].dtype.itemsize for n, shape in self.shapes.items())

    def describe(self) -> str:
        drawn = _mib(self.nbytes())
        if not self.reduced:
            return f"at the graph's sizes ({drawn} drawn)"
        sizes = ", ".join(f"{name} = {small} of {full}" for name, (full, small) in self.reduced.items())
        inputs = ", ".join(f"%{n.name} {list(shape)}" for n, shape in self.shapes.items()
                           if list(shape) != list(n.meta["val"].shape))
        return f"at reduced sizes {sizes} ({inputs}; {drawn} drawn)"


@dataclass
class Replacement:
    """op(*args) replaces the match; `outputs[i]` says what takes the place of the pattern's i-th output: the index
    of an op output (None for a single-output op), or a function of the op's output (a node, or a tensor in the
    semantic check) that returns a Derived value computed from it (rows the op returns sorted, put back in the
    pattern's order). A Derived object that appears both there and in `args` is computed once."""

    op: torch._ops.OpOverload
    args: tuple
    outputs: tuple


@dataclass
class PassResult:
    """A pass's outcome. For a fusion, every anchor (a node with a distinctive op of its patterns) present when the
    pass starts is either inside a replaced region or has exactly one record in `declined`, `attempts` or
    `unrelated` (see `_REPORTED_KINDS`); `narrowed` holds, per site fused by a narrower formulation, the name of
    that formulation and why the wider one was not accepted there (a fused site, not a decline)."""

    name: str
    matches: int = 0
    declined: list[MatchFailure] = field(default_factory=list)
    attempts: list[MatchFailure] = field(default_factory=list)
    unrelated: list[MatchFailure] = field(default_factory=list)
    narrowed: list[tuple[str, MatchFailure]] = field(default_factory=list)
    replaced: list[dict] = field(default_factory=list)  # per match: erased and created node names, provenance
    note: str | None = None  # e.g. "no candidate: ..." when the graph holds none of the fusion's distinctive ops
    seconds: float = 0.0  # the pass's wall time (set by the pass manager)


class GraphPass:
    """A named graph transformation with a match counter."""

    name: str = ""

    def __init__(self, config):
        self.config = config

    def __call__(self, graph: fx.Graph) -> PassResult:
        raise NotImplementedError


class FusionPass(GraphPass):
    def __init__(self, config):
        import dsv41.lowerings  # noqa: F401  (registers the dsv41:: ops the replacements call)

        super().__init__(config)
        self._patterns: PatternSet | None = None

    # the frozen dataclass of the pass's formulations: each of its patterns' `form` is one (see the module)
    form_type: type

    def patterns(self) -> list:
        raise NotImplementedError

    def tokens(self, m: MatchResult):
        """The match's token count (the first input's leading dim unless a fusion says otherwise)."""
        return m.inputs[0].meta["val"].shape[0]

    def check(self, m: MatchResult) -> str | None:
        """A fusion's own condition on the match beyond the token limit (None: accepted); dtypes and shapes are
        checked by the op's own validation on the matched values."""
        return None

    # value ranges of integer inputs for the semantic check: input name -> callable(input metadata by name, at the
    # drawn sizes; free scalars) -> (low, high)
    int_ranges: dict = {}
    # (atol, rtol) of the semantic check per op output dtype; exact where not given
    tolerance: dict = {}
    # sizes the semantic check draws reduced: name -> Reduction (see the module)
    reductions: dict = {}

    def free_topk_order(self, form) -> bool:
        """Whether the formulation `form` (an instance of `form_type`) leaves the order of its top-k free: its
        sorted top-k then stands for a site's unsorted one (`topk(..., sorted=False)`, whose order torch leaves
        unspecified, so the sorted order is one of its results), and the semantic check runs the site's region with
        that top-k sorted (`unsorted_topks_fixed`). False by default: a fusion whose formulations differ in the
        top-k's order (the indexer's sorted and unsorted ones, which its op computes differently) keeps them apart."""
        return False

    def sample_inputs(self, m: MatchResult, draws: Draws) -> dict:
        """Fresh random values for the semantic check: graph input node -> tensor at its shape in `draws`, drawn on
        its device (the domain: see the module). An input the op takes reshaped (a Derived value) is drawn at its
        graph node's shape; its range is read from the op's shape (at the drawn sizes)."""
        names = m.pattern.input_names()
        metas = {name: _drawn_meta(v, draws) for name, v in zip(names, m.inputs) if isinstance(v, (fx.Node, Derived))}
        values: dict = {}
        for name, v in zip(names, m.inputs):
            if isinstance(v, Derived):
                v = leaves(v)[0]
            if not isinstance(v, fx.Node) or v in values:
                continue
            val, shape = v.meta["val"], tuple(draws.shapes[v])
            g = draws.generator(val.device)
            if val.dtype.is_floating_point:
                drawn = val.dtype if val.dtype in _RANDN_DTYPES else torch.float32
                x = torch.randn(shape, generator=g, device=val.device, dtype=drawn).to(val.dtype)
            elif val.dtype is torch.bool:
                x = torch.randint(0, 2, shape, generator=g, device=val.device, dtype=torch.bool)
            else:
                low, high = self.int_ranges[name](metas, m.free) if name in self.int_ranges else (0, 4)
                x = torch.randint(low, high, shape, generator=g, device=val.device, dtype=val.dtype)
            values[v] = x
        return values

    def draw_budget(self, m: MatchResult) -> int:
        """The most bytes the semantic check draws at the graph's full sizes (see the module)."""
        return max(_computed_bytes(m), DRAW_FLOOR_BYTES)

    def reduced_draws(self, m: MatchResult) -> Draws | None:
        """The draws at the sizes of `reductions` (each carried by every matched input that has it, all cut alike),
        or None when no size is smaller there."""
        named = dict(zip(m.pattern.input_names(), m.inputs))
        shapes = {n: list(n.meta["val"].shape) for n in dict.fromkeys(leaves(m.inputs))}
        reduced = {}
        for name, r in self.reductions.items():
            carriers = [(named[i], dim) for i, dim in r.dims.items() if isinstance(named.get(i), (fx.Node, Derived))]
            fulls = {v.meta["val"].shape[dim] for v, dim in carriers}
            if len(fulls) != 1 or (full := fulls.pop()) <= r.size:
                continue
            cut = [_stored_dim(v, dim, r.size) for v, dim in carriers]
            if None in cut or any(shapes[leaf][d] not in (full, r.size) for leaf, d in cut):
                continue  # a size baked into a view chain: drawn whole, within the budget
            for leaf, d in cut:
                shapes[leaf][d] = r.size
            reduced[name] = (full, r.size)
        return Draws(shapes, reduced) if reduced else None

    def explain(self, failure: MatchFailure, graph: fx.Graph) -> MatchFailure:
        """A fusion may restate a structural failure in its own terms (e.g. an iteration count)."""
        return failure

    def replacement(self, m: MatchResult) -> Replacement:
        raise NotImplementedError

    def token_check(self, t) -> str | None:
        """The reason (kind "token limit", or "symbolic shape" for a symbolic count) a token count is not fused, or None."""
        if not isinstance(t, int):
            return f"the token count {t} is symbolic; the decode fusions need static shapes: torch.compile(..., dynamic=False)"
        if t > self.config.max_tokens:
            return f"T={t} > max_tokens={self.config.max_tokens}"
        return None

    def semantic_check(self, m: MatchResult, rep: "Replacement") -> tuple[str | None, str]:
        """(None or the reason the region and the op disagree, the domain checked), on real tensors (the pass may
        run inside a fake-tensor compile)."""
        with unset_fake_temporarily():
            return self._semantic_check(m, rep)

    def _semantic_check(self, m: MatchResult, rep: "Replacement") -> tuple[str | None, str]:
        where = "; ".join(f"%{t.name} computes the pattern's {p} another way ({why.reason})" for p, t, why in m.islands)
        try:
            region = _region_module(m, unsorted_topks_fixed(m) if self.free_topk_order(m.pattern.form) else ())
        except KeyError as e:
            return f"{where}: the region reads %{e.args[0]} that the match does not bind", ""
        full = Draws({n: list(n.meta["val"].shape) for n in dict.fromkeys(leaves(m.inputs))}, {})
        reduced, failure = self.reduced_draws(m), None
        for draws in (reduced, full):
            if draws is None:
                continue
            if draws is full and full.nbytes() > (budget := self.draw_budget(m)):
                over = (f"at the graph's sizes the semantic check would draw {_mib(full.nbytes())}, over its budget "
                        f"of {_mib(budget)} (the larger of the region's activations, {_mib(_computed_bytes(m))}, and "
                        f"the floor, {_mib(DRAW_FLOOR_BYTES)})")
                return f"{where}: {failure}; {over}" if failure else f"{where}: {over}, and no size is reduced", ""
            failure = self._disagreement(m, rep, region, draws)
            if failure is None:
                tol = {str(k).removeprefix("torch."): v for k, v in self.tolerance.items()}
                ranges = {k: "(declared range)" for k in self.int_ranges} or "their default range [0, 4)"
                domain = (f"{_SEMANTIC_DRAWS} random draws (normal floats in each input's dtype, booleans at 1/2, "
                          f"integers in {ranges}), {'within ' + str(tol) if tol else 'bit-exact'}")
                return None, f"{where}; checked on {domain}, {draws.describe()}"
            if draws is reduced:
                failure = f"{failure} ({draws.describe()})"
        return f"{where}: {failure}", ""

    def _disagreement(self, m: MatchResult, rep: "Replacement", region: fx.GraphModule, draws: Draws) -> str | None:
        """None when the region and the op's reference agree on `_SEMANTIC_DRAWS` draws of `draws`, else why not."""
        for _ in range(_SEMANTIC_DRAWS):
            failure = self._disagreement_once(m, rep, region, draws)  # its draw is freed before the next
            if failure is not None:
                return failure
        return None

    def _disagreement_once(self, m: MatchResult, rep: "Replacement", region: fx.GraphModule, draws: Draws):
        values = self.sample_inputs(m, draws)
        try:
            got = region(*[values[v] for v in region.inputs])
            args = list(evaluate(rep.args, values.__getitem__))
            impl = next((i for i, a in enumerate(rep.op._schema.arguments) if a.name == "impl"), None)
            if impl is not None and impl < len(args):
                args[impl] = "reference"
            want = rep.op(*args)
        except Exception as e:
            return f"running the region or the op on random inputs failed: {type(e).__name__}: {e}"
        for i, (out, spec) in enumerate(zip(got, rep.outputs)):
            ref = _op_output(spec, want, values.__getitem__)
            if isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor) and ref.shape != out.shape \
                    and ref.numel() == out.numel():
                ref = ref.reshape(out.shape)  # as the replacement views the op's output to the graph's shape
            diff = _difference(out, ref, self.tolerance.get(ref.dtype, (0.0, 0.0)))
            if diff:
                return f"output {i} differs from dsv41::{self.name}'s reference on random inputs ({diff})"
        return None

    def pattern_set(self) -> PatternSet:
        """The pass's traced patterns (shared by the passes of the process with the same model constants; their
        structural traces read from the traced-pattern library on disk, `dsv41.passes.pattern_library`)."""
        if self._patterns is None:
            key = (type(self), tuple(sorted(self.config.constants().items())))
            if key not in _PATTERN_SETS:
                _PATTERN_SETS[key] = PatternSet(self.patterns(), entry_key(self))
            self._patterns = _PATTERN_SETS[key]
        return self._patterns

    def anchors(self, graph: fx.Graph) -> list[fx.Node]:
        """The graph's nodes with a distinctive op of any of the pass's patterns, in graph order."""
        patterns = self.pattern_set()
        found = {n for i in range(len(patterns.patterns)) for n in patterns.anchors(graph, i)}
        return [n for n in graph.nodes if n in found]

    def __call__(self, graph: fx.Graph) -> PassResult:
        self.pattern_set()
        result = PassResult(self.name)
        self._patterns.forget_graph()
        candidates = self.anchors(graph)
        erased: set[fx.Node] = set()
        failures: dict[fx.Node, MatchFailure] = {}  # per anchor: the deepest op-for-op failure
        island_failures: dict[fx.Node, MatchFailure] = {}  # per anchor: a semantic disagreement
        # Formulations in order over the whole graph: a wider pattern claims its nodes before a narrower one
        # (e.g. combine + shared add before the combine alone); first op for op, then with parts computed another
        # way (islands), which the semantic check must accept.
        for islands in (False, True):
            for index in range(len(self._patterns.patterns)):
                for anchor in self._patterns.anchors(graph, index):
                    if anchor in erased:
                        continue
                    strict = failures.get(anchor)
                    if islands and strict is not None and strict.kind in _FINAL_KINDS:
                        continue  # a different computation (another eps, dtype, ...): no islands
                    m = self._patterns.match_one(index, anchor, islands)
                    if isinstance(m, MatchResult):
                        wide, why = (None, None) if islands else self._wider_accepted(index, anchor, m)
                        narrow = m.pattern.name
                        m = wide or (self._closest_accepted(index, anchor, m) if islands else self._accept(m, anchor))
                        if why is not None and not isinstance(m, MatchFailure):  # fused without the wider part
                            result.narrowed.append((narrow, _at_site(why, anchor)))
                    if isinstance(m, MatchFailure):
                        if islands:  # only a semantic disagreement is worth reporting here
                            if m.kind == "semantic" and island_failures.get(anchor) is None:
                                island_failures[anchor] = m
                        elif strict is None or _rank(m) > _rank(strict):
                            failures[anchor] = m
                        continue
                    m, rep, value, verified = m
                    result.replaced.append(self._replace(graph, m, rep, value))
                    self._patterns.forget_graph()
                    result.replaced[-1]["verified"] = verified
                    erased.update(m.nodes)
                    result.matches += 1
        names = {n.name: n for n in graph.nodes}
        failures.update(island_failures)
        breaks, ends_here = dynamo_graph_breaks(graph)
        fused = {names[name] for r in result.replaced for name in r["created"] if name in names}
        for anchor in candidates:  # each anchor left: one record
            if anchor in erased:
                continue
            f = failures[anchor]
            if f.kind == "graph input" and breaks and not _feeds(anchor, fused):
                # (a candidate that feeds a site this pass fused reached the input through that site)
                f = failures[anchor] = dataclasses.replace(f, kind=_SPLIT, reason=f"{f.reason}; Dynamo has recorded "
                                                           "graph breaks, so the site may be split by one (notes)")
            f = _at_site(self.explain(f, graph) if f.blocking in names else f, anchor)
            if f.kind in _REPORTED_KINDS or f.kind == "dtype" and f.progress >= 4:
                result.declined.append(f)
            elif f.progress >= _NEAR or f.kind in ("graph input", _SPLIT):  # a site that reaches the graph's edge
                result.attempts.append(f)
            else:
                result.unrelated.append(f)
        if not result.matches and not result.declined and not result.attempts:
            ops = sorted({_op(t) for i in range(len(self._patterns.patterns)) for t in self._patterns.anchor_ops(i)})
            result.note = (f"no candidate: the graph has no {' or '.join(ops)}" if not candidates else
                           f"no candidate: the graph's {len(candidates)} {' or '.join(ops)} "
                           f"{'is' if len(candidates) == 1 else 'are'} another computation (unrelated)")
        split = self._split_by_graph_break(graph, result, failures, erased, breaks, ends_here)
        if split:
            result.note = f"{result.note}; {split}" if result.note else split
        return result

    def wider(self, index: int) -> tuple[int, ...]:
        """The patterns (indices) whose region extends that of pattern `index` past its outputs (RoPE + FP8 after
        RoPE alone): where `index` matches op for op, each is first tried there with parts computed another way."""
        return ()

    def _wider_accepted(self, index: int, anchor: fx.Node, narrow: MatchResult):
        """(the accepted match of the first pattern in `wider(index)` whose region at `anchor` holds every node of
        the op-for-op match `narrow` and more, or None; the failure of the last one tried that got past the narrow
        region or matched there over another region, or None): a wider formulation whose extra part the graph writes
        with other ops (the FP8 scale by exp2) would otherwise lose to the narrower one, which the op-for-op phase
        tries first."""
        why = None
        for j in self.wider(index):
            m = self._patterns.match_one(j, anchor, True)
            if isinstance(m, MatchFailure):
                why = m if m.progress > len(narrow.nodes) else why
                continue
            if not set(narrow.nodes) < set(m.nodes):  # matched elsewhere: it does not extend this region
                why = MatchFailure(m.pattern.name, anchor.name, len(m.nodes), len(m.nodes), "check",
                                   f"its match at this anchor covers {len(m.nodes)} nodes, not the "
                                   f"{len(narrow.nodes)} of {narrow.pattern.name}'s match and more")
                continue
            accepted = self._accept(m, anchor)
            if not isinstance(accepted, MatchFailure):
                return accepted, None
            why = accepted
        return None, why

    def _closest_accepted(self, index: int, anchor: fx.Node, m: MatchResult):
        """`_accept` of the formulation closest to the graph among `m` (pattern `index` at `anchor`, with parts
        computed another way) and the later patterns that match there too: the one whose region holds m's and has
        the fewest graph nodes computed another way (`MatchResult.another_way`), the first in order among equals;
        m when that one is not accepted. Without it, list order picks: another formulation of the same math may
        pass the semantic check on its draws by treating what the graph writes as a part computed another way (a
        sorted top-k where the pattern's is unsorted; a score scale, exactly a power of two, as an extra op of an
        unscaled formulation), and such a check cannot tell a scale that rounds from one that does not."""
        closest = m
        for j in range(index + 1, len(self._patterns.patterns)):
            if anchor.target not in self._patterns.anchor_ops(j):
                continue
            other = self._patterns.match_one(j, anchor, True)
            if (isinstance(other, MatchResult) and set(closest.nodes) <= set(other.nodes)
                    and len(other.another_way) < len(closest.another_way)):
                closest = other
        accepted = self._accept(closest, anchor)
        return self._accept(m, anchor) if isinstance(accepted, MatchFailure) and closest is not m else accepted

    def _split_by_graph_break(self, graph: fx.Graph, result: PassResult, failures: dict, erased: set,
                              breaks: list[str], ends_here: bool) -> str | None:
        """When Dynamo has recorded graph breaks (`breaks`, by name: `dynamo_graph_breaks`): the sites of this
        fusion whose region ends at this graph's boundary, and the breaks; None when there is none of either. A fused
        op whose result is a graph output counts only in the graph compiled as the break was recorded (`ends_here`:
        the graph that ends there); a candidate that reaches a graph input (its record's kind `_SPLIT`), in any graph
        after a break."""
        if not breaks:
            return None
        outputs = set(leaves(next(n for n in reversed(graph.nodes) if n.op == "output").args))
        names = {n.name: n for n in graph.nodes}
        sites = [f"%{name} ({r['pattern']}) is an output of this graph" for r in result.replaced for name in r["created"]
                 if ends_here and names.get(name) in outputs]
        sites += [f"the candidate at %{anchor.name} reaches an input of this graph ({f.reason})"
                  for anchor, f in failures.items() if anchor not in erased and f.kind == _SPLIT]
        if not sites:
            return None
        return f"split by a graph break? {'; '.join(sites)}; Dynamo's latest graph breaks: {'; '.join(breaks)}"

    def _accept(self, m: MatchResult, anchor: fx.Node):
        """(match, replacement, fake output, what the semantic check verified) or the MatchFailure that declines it;
        when the semantic check rejects the match, its alternatives (other bindings of island inputs, other operand
        orders) in order. A match found only in another operand order after the walk failed declines with that
        failure (`MatchResult.instead`): its own decline would name a pairing the graph does not have."""
        accepted = self._accept_one(m, anchor)
        if isinstance(accepted, MatchFailure) and accepted.kind == "semantic" and m.alternatives is not None:
            for alternative in m.alternatives():
                found = self._accept_one(alternative, anchor)
                if not isinstance(found, MatchFailure):
                    return found
        return m.instead if isinstance(accepted, MatchFailure) and m.instead is not None else accepted

    def _accept_one(self, m: MatchResult, anchor: fx.Node):
        tokens = self.tokens(m)
        kind = "token limit" if isinstance(tokens, int) else "symbolic shape"
        reason, verified, rep, value = self.token_check(tokens), None, None, None
        if reason is None:
            kind, reason = "check", self.check(m)
        if reason is None:
            kind, rep = "check", self._replacement(m)
            if isinstance(rep, str):
                reason = rep
            else:
                try:  # the op's own validation (dtypes, shapes) on the matched values
                    value = _fake_output(rep)
                except TypeError as e:
                    reason = f"dtype: {e}"
                except (ValueError, RuntimeError) as e:
                    reason = f"the op rejects the matched inputs: {e}"
            if reason is not None:
                log.debug("dsv41: %s declines %%%s: %s", self.name, anchor.name, reason)
        if reason is None and m.islands:
            kind = "semantic"
            reason, verified = self.semantic_check(m, rep)
        if reason is not None:  # the first island, where there is one, is the first differing op
            island = m.islands[0][2] if m.islands else None
            blocking = island.blocking if island is not None else None
            return MatchFailure(m.pattern.name, anchor.name, len(m.nodes), len(m.nodes), kind, reason,
                                blocking and blocking.name, island and island.expected, island and island.found,
                                beside=island.beside.name if island is not None and island.beside is not None else None)
        return m, rep, value, verified

    def _replacement(self, m: MatchResult) -> "Replacement | str":
        """The fusion's replacement for m, or, where building it raises (a bug of the pass on a match it did not
        foresee), the reason that declines the site: one site's failure must not cost the graph its other fusions.
        In debug mode it raises, so the tests see it."""
        try:
            return self.replacement(m)
        except Exception as e:
            if self.config.debug:
                raise
            log.warning("dsv41: %s could not build its replacement at %%%s: %s: %s", self.name, m.outputs[0].name,
                        type(e).__name__, e)
            return f"the replacement could not be built: {type(e).__name__}: {e}"

    def _replace(self, graph: fx.Graph, m: MatchResult, rep: Replacement, value) -> dict:
        from torch._inductor.pattern_matcher import stable_topological_sort

        position = {n: i for i, n in enumerate(graph.nodes)}
        last_input = max(leaves(rep.args), key=position.__getitem__)
        anchor = m.outputs[0]
        derived, region, emitted = [], set(m.nodes), {}

        def emit(d: Derived) -> fx.Node:
            if id(d) in emitted:  # one Derived object read twice (an argument and an output's function)
                return emitted[id(d)]
            args, kwargs = built(d.args), dict(d.kwargs)
            first = next((a for a in args if isinstance(a, fx.Node)), None)
            for u in first.users if first is not None else ():
                if u.target == d.op and u.args == args and u.kwargs == kwargs and u not in region \
                        and position.get(u, len(position)) <= position[last_input]:
                    return u  # the graph computes it already, outside the region (`order // k`): that node
            node = graph.call_function(d.op, args, kwargs)
            node.meta["val"] = fake_value(d)
            derived.append(node)
            emitted[id(d)] = node
            return node

        def built(a):
            """a with every Derived value inside it (also in a list: the indices of an index op) emitted."""
            if isinstance(a, Derived):
                return emit(a)
            return type(a)(built(b) for b in a) if isinstance(a, (tuple, list)) else a

        with graph.inserting_after(last_input):
            args = built(rep.args)
            fused = graph.call_function(rep.op, args)
        fused.meta["val"] = value
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in anchor.meta:
                fused.meta[key] = anchor.meta[key]
        created = [*derived, fused]
        for pat_out, idx in zip(m.outputs, rep.outputs):
            new = fused
            if callable(idx):
                emitted_before = len(derived)
                with graph.inserting_after(fused):
                    new = emit(idx(fused))
                created.extend(derived[emitted_before:])
            elif idx is not None:
                with graph.inserting_after(fused):
                    new = graph.call_function(operator.getitem, (fused, idx))
                new.meta["val"] = fused.meta["val"][idx]
                for key in ("stack_trace", "nn_module_stack"):
                    if key in pat_out.meta:
                        new.meta[key] = pat_out.meta[key]
                created.append(new)
            if list(new.meta["val"].shape) != list(pat_out.meta["val"].shape):  # a graph view of another shape
                # (an output that is not contiguous, a slice of the op's, is reshaped: its dims may not merge in place)
                view = torch.ops.aten.view.default if new.meta["val"].is_contiguous() else torch.ops.aten.reshape.default
                with graph.inserting_after(new):
                    new = graph.call_function(view, (new, list(pat_out.meta["val"].shape)))
                new.meta["val"] = pat_out.meta["val"]
                created.append(new)
            pat_out.replace_all_uses_with(new)
        erased = [n for n in m.nodes if n not in m.kept]
        for n in reversed(erased):
            graph.erase_node(n)
        stable_topological_sort(graph)  # users of an output that preceded the last input move after the op
        return {
            "pattern": m.pattern.name,
            "erased": [n.name for n in erased],
            "created": [n.name for n in created],
            "stack_trace": anchor.meta.get("stack_trace"),
            "module": module_path(anchor.meta.get("nn_module_stack")),
        }


# Dynamo's graph-break counts at the last look, the breaks then new, and the graph in which they were first seen
_BREAKS_SEEN: dict = {"counts": {}, "latest": [], "graph": None}


def dynamo_graph_breaks(graph: fx.Graph) -> tuple[list[str], bool]:
    """The graph breaks Dynamo recorded most recently in this process (`torch._dynamo.utils.counters["graph_break"]`:
    those whose count rose since the last look), each by its name (`break_name`), and whether they were first seen
    while compiling `graph` (Dynamo compiles the graph that ends at a break right after recording it)."""
    from torch._dynamo.utils import counters

    counts = dict(counters["graph_break"])
    new = [r for r, c in counts.items() if c > _BREAKS_SEEN["counts"].get(r, 0)]
    _BREAKS_SEEN["counts"] = counts
    if new:
        _BREAKS_SEEN.update(latest=list(dict.fromkeys(break_name(str(r)) for r in new)), graph=id(graph))
    elif not counts:
        _BREAKS_SEEN.update(latest=[], graph=None)
    return _BREAKS_SEEN["latest"], _BREAKS_SEEN["graph"] == id(graph)


def break_name(reason: str) -> str:
    """A Dynamo graph break by the first line of its reason and, where Dynamo gives one, its developer debug
    context (the operator: "Dynamic shape operator (aten.bincount.default)")."""
    lines = [line.strip() for line in reason.strip().splitlines()]
    context = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Developer debug context:")), "")
    return f"{lines[0]} ({context})" if context and context not in lines[0] else lines[0]


def _feeds(node: fx.Node, targets: set, limit: int = 2000) -> bool:
    """Some node of targets is downstream of node (within `limit` nodes, breadth first)."""
    seen, queue = {node}, [node]
    while queue and len(seen) < limit:
        for u in queue.pop(0).users:
            if u in targets:
                return True
            if u not in seen:
                seen.add(u)
                queue.append(u)
    return False


def _fake_output(rep: Replacement):
    """The op's output on the fake values of its arguments (runs the op's validation; a rejection is a decline, so
    fake-tensor dispatch does not log it)."""
    with quiet_fake_tensor():
        return fake_value(Derived(rep.op, rep.args))


def _op_output(spec, value, leaf):
    """What a `Replacement.outputs` entry takes from the op's output `value` (graph nodes read by `leaf`)."""
    if callable(spec):
        return evaluate(spec(value), leaf)
    return value if spec is None else value[spec]


_TOPK_SORTED = 4  # the `sorted` argument of aten.topk.default (x, k, dim, largest, sorted)


def unsorted_topks_fixed(m: MatchResult) -> frozenset:
    """The region's unsorted top-ks that stand for the pattern's sorted ones: islands where the graph's
    `topk(x, k, dim, largest, sorted=False)` is the pattern's `topk(..., sorted=True)` but for that flag (same dim
    and largest; k is compared by the exact phase). torch leaves an unsorted top-k's order unspecified (it differs
    between devices and sizes), and the sorted order is one of its results, so the region run with these top-ks
    sorted computes one result the program may compute; an op that returns the sorted order returns it too."""
    fixed = set()
    for _, t, why in m.islands:
        p = why.pattern_node  # the pattern's node compared with t, where the island opened at t itself
        if not (why.node is t and isinstance(p, fx.Node) and p.target is torch.ops.aten.topk.default
                and isinstance(t, fx.Node)
                and t.target is torch.ops.aten.topk.default and not t.kwargs and not p.kwargs
                and len(p.args) == len(t.args) == _TOPK_SORTED + 1):
            continue
        if p.args[_TOPK_SORTED] is True and t.args[_TOPK_SORTED] is False and p.args[2:4] == t.args[2:4]:
            fixed.add(t)
    return frozenset(fixed)


def _region_module(m: MatchResult, sort_topks: frozenset = frozenset()) -> fx.GraphModule:
    """The matched region as a module of the graph values it reads (`.inputs`), returning the pattern outputs; the
    unsorted top-ks in `sort_topks` run sorted (`unsorted_topks_fixed`)."""
    g = fx.Graph()
    env: dict = {}
    inputs = list(dict.fromkeys(leaves(m.inputs)))
    for v in inputs:
        env[v] = g.placeholder(v.name)
    # a matched view of the root of an input reads that input (`_views_of_one_root`: view(view(r), s) is view(r, s))
    viewed = {view_root(v): env[v] for v in inputs if isinstance(v, fx.Node)}
    for n in m.nodes:
        def arg(a, n=n):
            if a in env:
                return env[a]
            if n.target is torch.ops.aten.view.default and a is n.args[0] and a in viewed:
                return viewed[a]
            raise KeyError(a.name)
        env[n] = g.node_copy(n, arg)
        if n in sort_topks:
            env[n].args = (*env[n].args[:_TOPK_SORTED], True)
    g.output(tuple(env[o] for o in m.outputs))
    module = fx.GraphModule(torch.nn.Module(), g)
    module.inputs = inputs
    return module


def _computed_bytes(m: MatchResult) -> int:
    """The bytes of the values the matched region computes at the graph's sizes (its activations): every region
    node's value but those an op returns as a view of its input (a transposed weight is no activation)."""
    total = 0
    for n in m.nodes:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            continue
        total += sum(v.numel() * v.dtype.itemsize for v in _tensors_of(n.meta.get("val")))
    return total


def _tensors_of(val) -> list[torch.Tensor]:
    """The tensors in a node's value (one, or those of a tuple)."""
    if isinstance(val, torch.Tensor):
        return [val]
    return [v for v in val if isinstance(v, torch.Tensor)] if isinstance(val, (tuple, list)) else []


def _like(val: torch.Tensor, shape) -> torch.Tensor:
    """A meta tensor of `shape` whose dims are laid out in val's order (a weight stored transposed stays so)."""
    order = sorted(range(val.dim()), key=lambda d: val.stride(d))  # innermost first
    strides, step = [0] * val.dim(), 1
    for d in order:
        strides[d], step = step, step * max(shape[d], 1)
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=val.dtype, device="meta")


def _drawn_meta(v, draws: Draws) -> torch.Tensor:
    """The meta value of matched input v (a graph node or a Derived value of one) at the drawn sizes."""
    return evaluate(v, lambda n: _like(n.meta["val"], draws.shapes[n]))


def _stored_dim(v, dim: int, size: int):
    """(graph node, its dim) that carries matched input v's dim `dim`: v itself, or the one node a Derived view chain
    reads, at the dim whose cut to `size` cuts v's `dim` to `size` and nothing else (evaluated on meta tensors);
    None where no dim does (a view that bakes the size)."""
    if isinstance(v, fx.Node):
        return v, dim
    stored = set(leaves(v))
    if len(stored) != 1:
        return None
    node = stored.pop()
    val, want = node.meta["val"], list(v.meta["val"].shape)
    full, want[dim] = want[dim], size
    for d, n in enumerate(val.shape):
        if n != full:
            continue
        shape = list(val.shape)
        shape[d] = size
        try:
            if list(evaluate(v, lambda _: _like(val, shape)).shape) == want:
                return node, d
        except (RuntimeError, ValueError):  # torch: "shape '[...]' is invalid for input of size ..."
            continue
    return None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def _difference(got, want, tol) -> str | None:
    """None when got equals want (NaN never does) to (atol, rtol); else what differs."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return f"{type(got).__name__} vs {type(want).__name__}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    if not got.dtype.is_floating_point:
        bad = (got != want).sum().item()
        return f"{bad} of {got.numel()} elements differ" if bad else None
    g, w = got.float(), want.float()
    atol, rtol = tol
    ok = (g - w).abs() <= atol + rtol * w.abs()
    ok |= (g == w)  # equal infinities
    ok &= ~(g.isnan() | w.isnan())
    bad = (~ok).sum().item()
    return f"{bad} of {got.numel()} elements differ, max |diff| {(g - w).abs().nan_to_num(nan=float('inf')).max().item():.3g}" if bad else None


def _op(target) -> str:
    return target.name() if hasattr(target, "name") else str(target)


def _rank(f: MatchFailure) -> tuple:
    return (f.kind in _REPORTED_KINDS, f.progress / max(f.total, 1))


def _at_site(f: MatchFailure, anchor: fx.Node) -> MatchFailure:
    """f with its anchor's module path (where the graph records one)."""
    return dataclasses.replace(f, module=module_path(anchor.meta.get("nn_module_stack")))

