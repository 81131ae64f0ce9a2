"""What the foreign decode blocks' tests share: the block compiled once through the real backend, in a given mode
(`inductor`, the default, or `fx`), and run beside eager on fresh inputs; its one fusion report; that every fused op
runs in the compiled step; the outputs' agreement."""

from __future__ import annotations

from collections import Counter

import torch

from dsv41.passes.registry import FUSION_NAMES

from ..harness import compile_fx


def compile_and_run(block, inputs, seeds, mode="fx"):
    """(backend, [(compiled outputs, eager outputs) on inputs(seed, block) for each seed]) of the block compiled in
    `mode`; asserts that the compiled step runs each fused op as often as the report counts its sites
    (`assert_fused_ops_run`). Dynamo reset after."""
    fn, backend = compile_fx(block, mode=mode)
    with torch.no_grad():
        runs = [(fn(*x), block(*x)) for x in (inputs(seed, block) for seed in seeds)]
        assert_fused_ops_run(backend, fn, inputs(seeds[0], block))
    torch._dynamo.reset()
    return backend, runs


def dsv41_calls(fn, args) -> Counter:
    """The `dsv41::` ops that one call fn(*args) runs, by name, as torch.profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return Counter(e.name.removeprefix("dsv41::") for e in prof.events() if e.name.startswith("dsv41::"))


def assert_fused_ops_run(backend, fn, args):
    """One compiled step runs `dsv41::<fusion>` exactly as many times as the backend's reports count sites of it:
    a fusion on record that no code path runs (a graph that fell back, an op Inductor dropped) fails here."""
    fused = Counter()
    for report in backend.reports:
        fused.update({k: v for k, v in report.matches.items() if v})
    assert dsv41_calls(fn, args) == fused, backend.reports[-1].fallback


def fused_sites(backend):
    """(the nonzero match counts per fusion, the report) of the backend's one graph, which must not have fallen back.
    The backend runs in debug mode, where the pass manager checks that every anchor of every fusion was replaced or
    has exactly one record (`check_records`; a breach is an error, so the graph would have fallen back)."""
    report = backend.reports[-1]
    assert backend.config.debug and len(backend.reports) == 1 and report.fallback is None
    return {k: v for k, v in report.matches.items() if v}, report


def fused_formulations(report):
    """Per fusion that replaced a site: the names of the formulations that fused, in order."""
    return {p.name: [r["pattern"] for r in p.replaced] for p in report.passes if p.replaced and p.name in FUSION_NAMES}


def assert_outputs_agree(runs):
    """Per run (h, x_new, selection): the selection (indices or mask) equal; h and x_new bf16 within one bf16 ulp of
    an fp32 reordering (atol=rtol=1.6e-2) on at least 99% of elements, since the FP8 round trip may move a bucket;
    no NaN."""
    for (gh, gx, gi), (wh, wx, wi) in runs:
        assert torch.equal(gi, wi)
        for g_, w_ in ((gh, wh), (gx, wx)):
            close = torch.isclose(g_.float(), w_.float(), atol=1.6e-2, rtol=1.6e-2)
            assert not g_.isnan().any() and close.float().mean() >= 0.99, (~close).sum()


def assert_one_request_fuses(block, inputs, sites, mode, agree=None):
    """The block at one request (B = 1, so every batch and length dim is 1: `inputs(seed, block, b=1)`) compiled in
    `mode` fuses exactly `sites`, as at B > 1, and its outputs agree with eager on two fresh inputs (`agree(runs,
    block, inputs)`; default `assert_outputs_agree`)."""
    one_request = lambda seed, module: inputs(seed, module, b=1)  # noqa: E731
    backend, runs = compile_and_run(block, one_request, (1, 2), mode)
    fused, report = fused_sites(backend)
    assert fused == sites, (report.declined, report.near_misses)
    if agree is None:
        assert_outputs_agree(runs)
    else:
        agree(runs, block, one_request, (1, 2))


def assert_no_further_from_eager_than_inductor(runs, block, inputs, seeds):
    """For a block whose outputs sit near a discrete decision (an FP8 bucket, a routed expert) that the fp32
    summation order of Inductor's code for its unfused parts can flip, so that plain Inductor itself is far from
    eager: the selection equal to eager's, no NaN, and h and x_new no further from eager (relative L2) than 1.5x
    plain Inductor's (compiled with the backend's Inductor settings) on the same inputs, or 2e-2."""
    from dsv41.backend import INDUCTOR_PATCHES

    with torch._inductor.config.patch(INDUCTOR_PATCHES), torch.no_grad():
        plain = torch.compile(block, backend="inductor", fullgraph=True)
        baseline = [plain(*inputs(seed, block)) for seed in seeds]
    torch._dynamo.reset()
    for ((gh, gx, gi), (wh, wx, wi)), (ph, px, _) in zip(runs, baseline):
        assert torch.equal(gi, wi)
        for got, want, ind in ((gh, wh, ph), (gx, wx, px)):
            assert not got.isnan().any()
            rel = lambda a: float((a.float() - want.float()).norm() / want.float().norm())  # noqa: E731
            assert rel(got) <= 1.5 * max(rel(ind), 2e-2), (rel(got), rel(ind))
