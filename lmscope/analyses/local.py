"""A JobContext that runs an analysis in this process, without the service.

For notebooks, scripts and the analyses' own tests::

    ctx = LocalContext("out/", models={"m": LoadedModel("m", model, tok)}, datasets={"d": docs})
    output = norms.run(NormsParams(model="m", dataset="d"), ctx)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from lmscope.analyses.base import JobCancelled, LoadedModel


class LocalContext:
    def __init__(
        self,
        artifact_dir: str | Path,
        *,
        models: dict[str, LoadedModel] | None = None,
        datasets: dict[str, list[str]] | None = None,
        checkpoints: dict[int, list[tuple[int, str]]] | None = None,
        device: str = "cpu",
        on_progress: Callable[[int, int, str | None], None] | None = None,
        cancel_after: int | None = None,
        job_id: int = 0,
        attempt: int = 1,
        shares_process: bool = False,
    ):
        self.job_id = job_id
        self.attempt = attempt
        self.shares_process = shares_process  # other jobs run in this process at the same time (JobContext)
        self.artifact_dir = Path(artifact_dir)
        self.artifact_dir.mkdir(parents=True, exist_ok=True)
        self.device = device
        self.models = dict(models or {})
        self.datasets = dict(datasets or {})
        self.checkpoints = dict(checkpoints or {})
        self.registered: dict[str, tuple[Path, int | None]] = {}
        self.environment: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.progress_log: list[tuple[int, int, str | None]] = []
        self._on_progress = on_progress
        self._cancel_after = cancel_after  # cancel once this many progress reports were made (tests)

    def progress(self, done: int, total: int, stage: str | None = None) -> None:
        self.progress_log.append((done, total, stage))
        if self._on_progress:
            self._on_progress(done, total, stage)
        self.check_cancelled()

    def check_cancelled(self) -> None:
        if self._cancel_after is not None and len(self.progress_log) >= self._cancel_after:
            raise JobCancelled()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def _source(self, name: str) -> tuple[str, str | None]:
        """(source, path) of a model not given as an object: a registered checkpoint or a built-in."""
        from lmscope.catalog import BUILTIN_MODELS

        if name in self.registered:
            return "checkpoint", str(self.registered[name][0])
        if name in BUILTIN_MODELS:
            return "builtin", None
        raise KeyError(f"unknown model {name!r}")

    def load_model(self, name: str, *, dtype: str = "float32") -> LoadedModel:
        if name in self.models:
            loaded = self.models[name]
            if not loaded.info:  # LoadedModel(name, model, tokenizer) as the docs show: the facts jobs report
                from lmscope.modeling.loading import model_info

                loaded.info = model_info(loaded.model)
            return loaded
        from lmscope.modeling.loading import load_model

        return load_model(name, *self._source(name), dtype=dtype, device=self.device)

    def load_tokenizer(self, name: str):
        if name in self.models:
            return self.models[name].tokenizer
        from lmscope.modeling.loading import load_tokenizer

        return load_tokenizer(*self._source(name))

    def load_documents(self, dataset: str) -> list[str]:
        return self.datasets[dataset]

    def register_model(self, name: str, path: Path, *, step: int | None = None) -> None:
        self.registered[name] = (Path(path), step)

    def checkpoints_of(self, train_job_id: int) -> list[tuple[int, str]]:
        return sorted(self.checkpoints.get(train_job_id, []))

    def record(self, key: str, value: Any) -> None:
        self.environment[key] = value
