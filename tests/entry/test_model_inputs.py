"""Bad decode inputs at the model's entry: trace-time checks of types, dtypes, shapes and the batch; host checks
of token and position values where they are free; the in-graph guard (clamp + per-row flag) under torch.compile.

Model: TINY layers [0, 2, 3] (window-only, ratio-2 kv/index source and its consumer), max_batch 4, max_context 32;
compiled in fx mode once per module (~10 s on 2 cores). The in-graph guard in inductor mode is tested on the
whole TINY model in a subprocess (test_guard_survives_inductor.py).
"""

from __future__ import annotations

import copy
import logging
import re
from unittest import mock

import pytest
import torch

from dsv41.backend import make_backend
from dsv41.cuda_graphs import DecodeGraphRunner
from dsv41.models import TINY, DSV41Model
from dsv41.models.model import INPUT_ERRORS

LAYERS, MAX_BATCH, MAX_CONTEXT = [0, 2, 3], 4, 32
TOKENS, POSITIONS = torch.tensor([5, 7, 11]), torch.tensor([3, 9, 20])


def caches(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if not n.startswith("inv_freq")}


@pytest.fixture(scope="module")
def model():
    return DSV41Model(TINY, LAYERS, max_batch=MAX_BATCH, max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def compiled(model):
    """(model, its fx-mode compile, the backend); the model is warmed by 3 eager steps first."""
    target = copy.deepcopy(model)
    with torch.no_grad():
        for k in range(3):
            target(TOKENS + k, POSITIONS - 3 + k)
    torch._dynamo.reset()
    backend = make_backend(mode="fx")
    step = torch.compile(target, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        step(TOKENS, POSITIONS)
    yield target, step, backend
    torch._dynamo.reset()


CASES = [  # (tokens, positions, error, message)
    (torch.arange(5), torch.arange(5), ValueError, r"the batch B = 5 \(the length of tokens and positions\) must be in \[1, max_batch = 4\]"),
    (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), ValueError, r"the batch B = 0 .* must be in \[1, max_batch = 4\]"),
    (torch.tensor([1, 2]), torch.tensor([1, 2, 3]), ValueError, r"tokens and positions must have the same length B, got 2 and 3"),
    (torch.tensor([1.0, 2.0]), torch.tensor([1, 2]), TypeError, r"tokens must be torch.int64 or torch.int32, got torch.float32"),
    (torch.tensor([1, 2]), torch.tensor([True, False]), TypeError, r"positions must be torch.int64 or torch.int32, got torch.bool"),
    (torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), ValueError, r"tokens must be 1-D \[B\] \(one token per request\), got shape \[1, 2\]"),
    ([1, 2], torch.tensor([1, 2]), TypeError, r"tokens must be a torch.Tensor, got list"),
    (torch.tensor([1, 2], device="meta"), torch.tensor([1, 2], device="meta"), ValueError, r"tokens is on meta, the model on cpu"),
]
VALUE_CASES = [
    (torch.tensor([1, 2, 3]), torch.tensor([1, MAX_CONTEXT, 3]), r"positions\[1\] = 32 is outside \[0, max_context = 32\)"),
    (torch.tensor([1, 2, 3]), torch.tensor([1, 2, -1]), r"positions\[2\] = -1 is outside \[0, max_context = 32\)"),
    (torch.tensor([TINY.vocab_size, 2]), torch.tensor([1, 2]), r"tokens\[0\] = 512 is outside \[0, vocab_size = 512\)"),
    (torch.tensor([1, -4], dtype=torch.int32), torch.tensor([1, 2]), r"tokens\[1\] = -4 is outside \[0, vocab_size = 512\)"),
]


@pytest.mark.parametrize("tokens, positions, error, message", CASES)
@torch.no_grad()
def test_eager_rejects_bad_shapes_and_types(model, tokens, positions, error, message):
    with pytest.raises(error, match="DSV41Model: " + message):
        model(tokens, positions)


@pytest.mark.parametrize("tokens, positions, message", VALUE_CASES)
@torch.no_grad()
def test_eager_rejects_out_of_range_values(model, tokens, positions, message):
    before = caches(model)
    with pytest.raises(ValueError, match="DSV41Model: " + message):
        model(tokens, positions)
    assert all(torch.equal(b, caches(model)[n]) for n, b in before.items()), "a rejected step wrote a cache"


@pytest.mark.parametrize("tokens, positions, error, message", CASES[:3])
@torch.no_grad()
def test_compiled_shape_errors_carry_the_message(compiled, tokens, positions, error, message):
    """Dynamo turns a raise in a fullgraph trace into Unsupported ("Observed exception") with the message (or,
    for an empty batch, which it does not trace, the error comes as is); without fullgraph it runs the frame
    eagerly and the error comes as is."""
    target, step, _ = compiled
    with pytest.raises((torch._dynamo.exc.Unsupported, error)) as info:
        step(tokens, positions)
    if info.type is not error:
        assert re.search(f"raised exception {error.__name__}\\('DSV41Model: {message}", str(info.value)), info.value
    with pytest.raises(error, match=message):
        torch.compile(target, backend="eager")(tokens, positions)


@torch.no_grad()
def test_int32_inputs_fuse_fully_and_quietly(model, caplog):
    """int32 tokens and positions: the positions are widened to int64 at the entry, so the indexer's n_c is int64
    and no fusion declines (a declined dtype check used to log fake-tensor tracebacks)."""
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    backend = make_backend(mode="fx")
    step = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    with caplog.at_level(logging.DEBUG, logger="torch._subclasses.fake_tensor"):
        got = step(TOKENS.int(), POSITIONS.int())
    torch._dynamo.reset()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    report = backend.reports[-1]
    assert report.fallback is None and report.matches["indexer_topk"] == 1 and not any(report.declined.values())
    assert torch.equal(got, eager(TOKENS, POSITIONS))


@pytest.mark.parametrize("bad_row, tokens, positions, flag", [
    (1, TOKENS, torch.tensor([3, MAX_CONTEXT + 100, 20]), "positions"),
    (2, TOKENS, torch.tensor([3, 9, -7]), "positions"),
    (0, torch.tensor([TINY.vocab_size + 3, 7, 11]), POSITIONS, "tokens"),
])
@torch.no_grad()
def test_compiled_step_clamps_and_flags_out_of_range_values(compiled, bad_row, tokens, positions, flag):
    """No error and no host sync inside the step: the bad row is clamped and flagged; every other request's
    logits and cache rows are those of the same step with a valid value in the bad row, and the row outside
    the batch is untouched."""
    target, step, backend = compiled
    start = caches(target)
    target.input_errors.zero_()
    got = step(tokens, positions)
    n_graphs = len(backend.reports)
    after_bad, flags = caches(target), target.pop_input_errors()
    for name, buf in target.named_buffers():
        if name in start:
            buf.copy_(start[name])
    good_tokens, good_positions = tokens.clone(), positions.clone()
    good_tokens[bad_row], good_positions[bad_row] = TOKENS[bad_row], POSITIONS[bad_row]
    want = step(good_tokens, good_positions)
    after_good = caches(target)
    assert len(backend.reports) == n_graphs, "the bad and the good step ran different graphs"
    assert flags == {bad_row: [flag]} and not target.input_errors.any()
    others = [r for r in range(len(tokens)) if r != bad_row]
    assert torch.equal(got[others], want[others])
    for name, buf in after_bad.items():
        assert torch.equal(buf[others], after_good[name][others]), f"{name}: another request's row changed"
        assert torch.equal(buf[len(tokens):], start[name][len(tokens):]), f"{name}: a row outside the batch changed"


@torch.no_grad()
def test_value_checks_setting(model):
    guarded = copy.deepcopy(model)
    guarded.value_checks = "never"  # only the in-graph guard: the step runs and flags the row
    guarded(torch.tensor([1, 2]), torch.tensor([1, 99]))
    assert guarded.pop_input_errors() == {1: ["positions"]}
    with pytest.raises(ValueError, match="value_checks must be one of"):
        DSV41Model(TINY, [0], value_checks="sometimes")
    assert INPUT_ERRORS == {"tokens": 1, "positions": 2}


def test_constructor_rejects_bad_sizes_and_devices():
    with pytest.raises(ValueError, match=r"max_batch must be an int >= 1, got 0"):
        DSV41Model(TINY, [0], max_batch=0)
    with pytest.raises(ValueError, match=r"max_context=31 must be an even int >= window_size"):
        DSV41Model(TINY, [0], max_context=31)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda': CUDA is not available on this machine"):
            DSV41Model(TINY, [0], device="cuda")


@pytest.mark.parametrize("tokens, positions, error, message", [
    (torch.tensor([1, 2]), torch.tensor([3, MAX_CONTEXT]), ValueError, r"positions\[1\] = 32 is outside \[0, max_context = 32\)"),
    (torch.tensor([-1, 2]), torch.tensor([3, 4]), ValueError, r"tokens\[0\] = -1 is outside \[0, vocab_size = 512\)"),
    (torch.tensor([1.0]), torch.tensor([1]), TypeError, r"tokens must be a torch.int64 or torch.int32 tensor, got torch.float32"),
    (torch.tensor([1, 2]), torch.tensor([1]), ValueError, r"must be equal non-empty 1-D shapes \[B\]"),
    (torch.arange(5), torch.arange(5), ValueError, r"batch 5 exceeds the largest captured batch size 4"),
])
def test_graph_runner_checks_host_inputs_before_copying(model, tokens, positions, error, message):
    """DecodeGraphRunner needs CUDA to capture; its input checks run before any CUDA call, so they are tested
    here with CUDA reported present (nothing is captured)."""
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.graph_pool_handle", return_value=None):
        runner = DecodeGraphRunner(torch.compile(model), [1, 4], device="cpu")
    assert (runner.vocab_size, runner.max_context) == (TINY.vocab_size, MAX_CONTEXT)
    with pytest.raises(error, match=message):
        runner(tokens, positions)
    with pytest.raises(RuntimeError, match="bucket 4 is not captured"):  # valid inputs get past the checks
        runner(torch.tensor([1, 2]), torch.tensor([3, 4]))
