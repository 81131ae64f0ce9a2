"""`dsv41 demo`: compile the tiny DeepSeek-V4.1 model with the dsv41 backend and show what it did.

Prints the fusion counts per compiled graph, the decline reasons, the agreement with eager over three decode
steps, and on a GPU the step times of eager, Inductor and dsv41 (each replayed in a CUDA graph).
On a CPU the backend runs in `fx` mode (no Inductor compile), so the demo finishes in well under a minute.
The graph-diff recording goes to a temporary directory, removed at the end unless `--keep-recording`.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
import time

import torch


def _steps(model, tokens, start, n=3):
    out = []
    for i in range(n):
        out.append(model(tokens, start + i))
    return out


MAX_CONTEXT = 256


def _device(parser: argparse.ArgumentParser, text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"argument --device: {text!r} is not a device (cpu or cuda)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: {text!r}: the demo runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {text!r}: CUDA is not available on this machine (use --device cpu)")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=4, help="requests per decode step, 1..max_tokens (64 unless DSV41_MAX_TOKENS)")
    parser.add_argument("--mode", choices=("fx", "inductor"), default=None,
                        help="backend code generation (default: inductor on a GPU, fx on a CPU)")
    parser.add_argument("--keep-recording", action="store_true",
                        help="keep the graph-diff recording (for `dsv41 graphdiff show DIR`) instead of removing it")
    args = parser.parse_args(argv)
    device = _device(parser, args.device)
    from dsv41.backend import make_backend

    mode = args.mode or ("inductor" if device.type == "cuda" else "fx")
    try:
        backend = make_backend(mode=mode)
    except (TypeError, ValueError) as e:  # a bad DSV41_* variable
        parser.error(str(e))
    max_batch = backend.config.max_tokens  # a larger batch is past the decode fusions' token limit
    if not 1 <= args.batch <= max_batch:
        parser.error(f"argument --batch: must be in [1, {max_batch}] (the decode fusions apply up to max_tokens = "
                     f"{max_batch} tokens), got {args.batch}")
    record_dir = tempfile.mkdtemp(prefix="dsv41_demo_graphdiff_")
    try:
        return _run(args, device, mode, backend, record_dir)
    finally:
        if not args.keep_recording:
            shutil.rmtree(record_dir, ignore_errors=True)


def _run(args, device, mode, backend, record_dir) -> int:
    from dsv41.models import TINY, DSV41Model

    torch.manual_seed(0)
    print(f"dsv41 demo: tiny DeepSeek-V4.1 ({TINY.n_layers} layers, D={TINY.dim}) on {device}, batch {args.batch}, mode {mode}")
    eager = DSV41Model(TINY, max_batch=args.batch, max_context=MAX_CONTEXT, device=device)
    fused = copy.deepcopy(eager)
    compiled = torch.compile(fused, backend=backend, fullgraph=True)
    tokens = torch.randint(0, TINY.vocab_size, (args.batch,), device=device)
    start = (torch.arange(args.batch, device=device) * 7) % 200 + 20  # 20..219: the 3 steps stay below MAX_CONTEXT
    from dsv41.tools.graphdiff import main as graphdiff_main, record

    with torch.no_grad():
        t0 = time.perf_counter()
        with record(record_dir):
            got = _steps(compiled, tokens, start)
        compile_s = time.perf_counter() - t0
        want = _steps(eager, tokens, start)
    report = backend.reports[-1]
    print(f"\ncompiled in {compile_s:.1f} s; fusions replaced (graph {report.graph_id}):")
    for name, n in report.matches.items():
        print(f"  {name:14s} {n:3d}")
    if report.fallback:
        print(f"  fell back to plain Inductor: {report.fallback}")
    for name, reasons in report.declined.items():
        for r in reasons[:3]:
            print(f"  declined {name}: {r}")
    if args.keep_recording:
        print(f"\ngraph-diff summary (recorded in {record_dir}; `dsv41 graphdiff show {record_dir} --format html` for the report):")
    else:
        print("\ngraph-diff summary (from a temporary recording, removed at exit; --keep-recording keeps it):")
    graphdiff_main(["show", record_dir, "--color", "never"])
    from dsv41.models import agreement

    worst = max((a - b).abs().max().item() for a, b in zip(got, want))
    rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))
    top1 = min((a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(got, want))
    print(f"\nagreement with eager over 3 decode steps: max |logit diff| {worst:.3g}, relative L2 {rel:.3g}, "
          f"top-1 agreement {top1:.2f}")
    check = agreement.check(fused, compiled, tokens)
    print(f"agreement check (conditioned state, bound rel L2 {check.bound}): rel L2 {check.rel_l2:.3g}, "
          f"{check.kernel_calls} fused-op calls checked against their references: {'ok' if check.ok else check.reason}")
    ok = check.ok
    if device.type == "cuda":
        from dsv41.cuda_graphs import time_step

        inductor = torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True)
        print("\nstep time (CUDA graph replay, median):")
        for name, model in (("eager", eager), ("inductor", inductor), ("dsv41", compiled)):
            print(f"  {name:9s} {time_step(model, tokens, start + 3):8.1f} us")
    return 0 if ok else 1
