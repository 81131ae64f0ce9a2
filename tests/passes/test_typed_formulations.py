"""Typed formulations: every fusion pass says which formulation a pattern is by its `form`, never by its name.

Each fusion pass declares the frozen dataclass of its formulations (`FusionPass.form_type`); every pattern it builds
carries one, and no two patterns of a pass share one (a form identifies its formulation, so `wider` may look one
up). Then every pattern is renamed: for a match of each formulation on its own trace (its search at its example
shapes, normalised as the backend does, matched op for op), the pass's token count, check, replacement, semantic-check draws and wider formulations
are those it gives the match under the original name.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dsv41.config import Dsv41Config
from dsv41.passes import build_passes
from dsv41.passes.fusion import Draws, FusionPass
from dsv41.passes.manager import NormalizePass
from dsv41.passes.matcher import MatchResult, leaves

from .harness import aten_graph, config

FUSIONS = [p.name for p in build_passes(Dsv41Config()) if isinstance(p, FusionPass)]
OP_OUTPUT = object()  # stands for the op's output where a replacement output is a function of it


def _fusion(name: str) -> FusionPass:
    return next(p for p in build_passes(config()) if p.name == name)


def test_every_fusion_pass_is_listed():
    assert len(FUSIONS) == 10, FUSIONS


@pytest.mark.parametrize("name", FUSIONS)
def test_each_pattern_has_a_form_of_its_pass_and_no_two_share_one(name):
    fusion = _fusion(name)
    assert dataclasses.is_dataclass(fusion.form_type) and fusion.form_type.__dataclass_params__.frozen
    patterns = fusion.patterns()
    wrong = [p.name for p in patterns if type(p.form) is not fusion.form_type]
    assert not wrong, f"not a {fusion.form_type.__name__}: {wrong}"
    forms = [p.form for p in patterns]
    assert len(set(forms)) == len(forms), [p.name for p in patterns if forms.count(p.form) > 1]


def _renamed(fusion: FusionPass) -> FusionPass:
    """A pass of the same config whose patterns are renamed `renamed_<index>` (the traces are not redone: only the
    pass's own methods read its pattern list)."""
    patterns = fusion.pattern_set()
    other = copy.copy(fusion)
    other._patterns = copy.copy(patterns)
    other._patterns.patterns = [dataclasses.replace(p, name=f"renamed_{i}") for i, p in enumerate(patterns.patterns)]
    return other


def _own_trace(pattern):
    """The pattern's search traced at its example inputs; where it has a guard (the split q and kv norms, whose q
    and kv must be GEMMs of one activation), its first two inputs computed so."""
    def search(*args):
        return pattern.search(*args, **pattern.free_defaults)

    inputs = list(pattern.inputs())
    if pattern.guard is None:
        return aten_graph(search, *inputs)
    q, kv, *rest = inputs
    x = torch.empty(q.shape[0], 16, dtype=q.dtype)
    wq, wkv = torch.empty(q.shape[1], 16, dtype=q.dtype), torch.empty(kv.shape[1], 16, dtype=kv.dtype)
    return aten_graph(lambda x, wq, wkv, *rest: search(x @ wq.t(), x @ wkv.t(), *rest), x, wq, wkv, *rest)


def _outcome(fusion: FusionPass, m: MatchResult) -> dict:
    """What the pass makes of the match: its token count, check, replacement (op, arguments, outputs: a function of
    the op's output called on OP_OUTPUT) and semantic-check draws."""
    outcome = {"tokens": fusion.tokens(m), "check": fusion.check(m)}
    rep = fusion.replacement(m)
    outcome["replacement"] = (rep.op, rep.args, tuple(o(OP_OUTPUT) if callable(o) else o for o in rep.outputs))
    draws = Draws({n: list(n.meta["val"].shape) for n in dict.fromkeys(leaves(m.inputs))}, {})
    outcome["draws"] = {n.name: v for n, v in fusion.sample_inputs(m, draws).items()}
    return outcome


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name", FUSIONS)
def test_renamed_patterns_give_the_same_replacements(name):
    fusion = _fusion(name)
    patterns = fusion.pattern_set()
    renamed = _renamed(fusion)
    compared = []
    for index, pattern in enumerate(patterns.patterns):
        assert renamed.wider(index) == fusion.wider(index), pattern.name
        gm = _own_trace(pattern)
        NormalizePass(fusion.config)(gm.graph)  # as the backend runs it before the fusions
        for anchor in patterns.anchors(gm.graph, index):
            m = patterns.match_one(index, anchor, islands=False)
            if isinstance(m, MatchResult):
                break
        else:
            continue
        m_renamed = dataclasses.replace(m, pattern=renamed.pattern_set().patterns[index])
        assert m_renamed.pattern.form == m.pattern.form and m_renamed.pattern.name != m.pattern.name
        want, got = _outcome(fusion, m), _outcome(renamed, m_renamed)
        differ = [k for k in want if not _same(want[k], got[k])]
        assert not differ, f"{pattern.name}: renamed, its {differ} differ: {want} vs {got}"
        compared.append(pattern.name)
    missing = [p.name for p in patterns.patterns if p.name not in compared]
    assert not missing, f"formulations that do not match their own trace: {missing}"
