"""The science: one module per job kind, each a function of (params, context) -> JobOutput.

Analyses know nothing of Flask, Celery or SQL: the worker hands them a `JobContext`.
"""
