"""The worker: glue between the job rows (SQL), the queue and the analyses.

- ``runner``: run one delivery of a job id (claim, heartbeat, context, results, retries' rules)
- ``attempt``: one attempt's hold on its row (ownership condition, heartbeat thread)
- ``context``: the ``JobContext`` an analysis sees (progress, cancel, models, documents)
- ``reaper``: re-enqueue jobs whose worker or message was lost; recover after a restart
- ``celery_app``: the Celery app (``celery -A lmscope.worker.celery_app worker``)
- ``embedded``: the in-process worker and ``serve()`` for ``lmscope up``
- ``startup``: per-process database sessions, the test hook for extra kinds
- ``environment``: what every finished job records about where it ran

Only the Celery child process (or the embedded worker thread) touches CUDA; nothing here imports
torch at module level.
"""
