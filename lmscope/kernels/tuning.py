"""Autotuning where it means something: on a GPU.

Under ``TRITON_INTERPRET=1`` the autotuner would "benchmark" every config on the CPU, so the bare
kernel runs there with fixed blocks instead.
"""

from __future__ import annotations

import triton

from .dispatch import interpreting


def autotune_on_gpu(fn, *, configs: list, key: list[str], interpreter_blocks: dict[str, int],
                    prune=None) -> tuple[object, dict[str, int]]:
    """(the kernel to launch, its extra launch arguments): autotuned over ``configs`` (keyed by ``key``,
    pruned by ``prune``) when compiled; the bare kernel with ``interpreter_blocks`` under the interpreter."""
    if interpreting():
        return fn, dict(interpreter_blocks)
    prune_by = {"early_config_prune": prune} if prune is not None else None
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune_by)(fn), {}
