"""Autotuning where it means something: on a GPU.

Under ``TRITON_INTERPRET=1`` the autotuner would "benchmark" every config on the CPU, so the bare
kernel runs there with fixed blocks instead. ``LMSCOPE_AUTOTUNE=0`` keeps only each kernel's first
candidate on a GPU too (the first of its config list after pruning, which for the attention kernel is
sorted by tile, not the order its ``_TILES`` table lists): one compile per shape instead of one per
candidate, for test runs that check correctness and must fit a short GPU session.
"""

from __future__ import annotations

import triton

from .dispatch import autotuning, interpreting


def autotune_on_gpu(fn, *, configs: list, key: list[str], interpreter_blocks: dict[str, int],
                    prune=None) -> tuple[object, dict[str, int]]:
    """(the kernel to launch, its extra launch arguments): autotuned over ``configs`` (keyed by ``key``,
    pruned by ``prune``) when compiled; the bare kernel with ``interpreter_blocks`` under the interpreter."""
    if interpreting():
        return fn, dict(interpreter_blocks)

    def candidates(configs, named_args, **kwargs):
        kept = prune(configs, named_args, **kwargs) if prune is not None else list(configs)
        return kept if autotuning() else kept[:1]

    # cache_results: the timings go to Triton's cache directory, so a new process (the next benchmark,
    # a restarted worker) does not tune the same shapes again
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": candidates},
                           cache_results=True, do_bench=bench_when_tuning)(fn), {}


def bench_when_tuning(kernel_call, quantiles) -> list[float]:
    """Triton's own timing while autotuning; with ``LMSCOPE_AUTOTUNE=0``, none. Triton decides whether to
    tune from the unpruned config list, so it would still time the one candidate left, about 0.1 s of a
    short GPU session per new shape, to choose nothing."""
    if not autotuning():
        return [0.0] * len(quantiles)
    from triton.runtime import driver

    return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles)
