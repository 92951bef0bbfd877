"""Job submission: everything `POST /v1/jobs` checks before a row exists, and the insert itself.

Order matters: an `Idempotency-Key` replay is answered first (a retry of an accepted request must
not be refused because the quota filled up since), then the body, the kind's params, the sweep's
size and points, the names they refer to, the windows against the models' context, the layers
against the models' depth, the model names a train job will take, the quota; the parent and its
children go in one transaction.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Iterator

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from lmscope.api.auth import Caller
from lmscope.api.errors import Problem, describe_errors, fields_problem, pydantic_errors
from lmscope.catalog import OWN_ATTENTION_MODULES, SOFT_CAPPED_ATTENTION
from lmscope.config import Settings
from lmscope.db.models import ACTIVE_STATES, Dataset, Job, Model, User, utcnow
from lmscope.params import KINDS, JobParams, UnknownKind, parent_kinds, validate_params, whole_floats_as_ints
from lmscope.wording import STUDY_INTERFACE_MODEL, article, did_you_mean

# A job's name and tags are one line each in every listing: no tab, line break (also NEL, U+2028/9),
# C1 control (U+009B starts a terminal escape) or direction control that makes it display as
# something else (U+202E turns "gpj.exe" around).
_NOT_ONE_LINE = re.compile(r"[\t\n\r\x80-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _one_line(text: str | None) -> str | None:
    if text is not None and (bad := _NOT_ONE_LINE.search(text)):
        raise ValueError(f"holds U+{ord(bad.group()):04X} at character {bad.start()}: names and tags are one line "
                         "of plain text (no tab, line break or direction control)")
    return text


Tag = Annotated[str, StringConstraints(min_length=1, max_length=64, strip_whitespace=True), AfterValidator(_one_line)]


class SubmitBody(BaseModel):
    """The body of `POST /v1/jobs`; `params` is checked by the kind's own model."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(description="the job kind (GET /v1/kinds lists them)")
    params: dict[str, Any] = Field(default_factory=dict, description="the kind's parameters")
    name: Annotated[str | None, AfterValidator(_one_line)] = Field(None, max_length=200, description="a label for people")
    tags: list[Tag] = Field(default_factory=list, max_length=32, description="free-form labels to filter by")


def submittable_kinds() -> list[str]:
    return sorted(k for k, spec in KINDS.items() if spec.submittable)


def request_hash(body: Any) -> str:
    """sha256 of the body's canonical JSON: key order, whitespace and 5.0 versus 5 do not matter."""
    canonical = json.dumps(whole_floats_as_ints(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: a lone surrogate ("\ud800") must not crash the hash (json_body refuses it anyway)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def find_replay(session: Session, caller: Caller, key: str, body_hash: str) -> Job | None:
    """The job an earlier request with this Idempotency-Key made, or None; 422 if its body differed."""
    job = session.scalar(select(Job).where(Job.user_id == caller.id, Job.idempotency_key == key))
    if job is not None and job.request_hash != body_hash:
        raise Problem(422, "idempotency-key-reused", "Idempotency-Key reused with a different body",
                      f"job {job.id} was submitted with Idempotency-Key {key!r} and a different body; "
                      "use a new key for a different request", job_id=job.id)
    return job


def parse_body(raw: Any) -> SubmitBody:
    if not isinstance(raw, dict):
        raise Problem(422, "validation-error", "Invalid request",
                      'the body must be a JSON object like {"kind": "probe", "params": {"model": "tiny-gpt2"}}',
                      errors=[{"loc": [], "msg": "expected a JSON object", "type": "dict_type"}])
    try:
        return SubmitBody.model_validate(raw)
    except ValidationError as e:
        errors = pydantic_errors(e, model=SubmitBody)
        params = raw.get("params", {})
        if isinstance(raw.get("kind"), str) and isinstance(params, dict) \
                and not any(err["loc"][:1] in (["kind"], ["params"]) for err in errors):
            try:  # the params' mistakes too (a misspelt "tag" beside a misspelt parameter): one round trip
                check_params(raw["kind"], params)
            except Problem as p:  # invalid parameters, or a kind that does not exist / is not submittable
                errors += p.errors or []
        raise fields_problem("Invalid request", errors) from None


def check_params(kind: str, params: dict[str, Any]):
    try:
        return validate_params(kind, params)
    except UnknownKind:
        kinds = submittable_kinds()
        if kind in KINDS:  # a child kind: made only by its parent
            parents = parent_kinds()
            raise Problem(422, "unknown-kind", "Not a submittable kind",
                          f"kind {kind!r} is a grid point made by a {' / '.join(parents)} job, not submitted on "
                          f"its own; submit kind {parents[0]!r} with a grid of one point instead "
                          "(docs/analyses/sweep.md)",
                          errors=[{"loc": ["kind"], "msg": f"{kind!r} is made by {', '.join(parents)}",
                                   "type": "child_kind"}], kinds=kinds) from None
        # The list once, in the field's message: a client shows the detail and then the fields (and the
        # message alone travels with other body mistakes, in a fields problem).
        raise Problem(422, "unknown-kind", "Unknown job kind",
                      f"kind {kind!r} does not exist{did_you_mean(kind, kinds) or ';'} GET /v1/kinds or "
                      "`lmscope kinds` describes each kind",
                      errors=[{"loc": ["kind"], "msg": f"unknown kind; the kinds are {', '.join(kinds)}",
                               "type": "unknown_kind"}], kinds=kinds) from None
    except ValidationError as e:
        errors = pydantic_errors(e, ("params",), KINDS[kind].params)
        for error in errors:
            # A field another kind has: a sweep's parameter file sent as norms ("target" is not a misspelt
            # "dataset"), or a near miss of this kind's own ("seed" in a sweep, which has "seeds").
            if error["type"] == "extra_forbidden" and len(error["loc"]) == 2:
                name = str(error["loc"][1])
                owners = " / ".join(repr(k) for k in submittable_kinds()
                                    if k != kind and name in KINDS[k].params.model_fields)
                if owners:
                    close = did_you_mean(name, KINDS[kind].params.model_fields, cutoff=0.8)
                    error["msg"] = (f"unknown field{close} ({name!r} is a field of {owners})" if close else
                                    f"not a field of {kind!r} but of {owners}: parameters meant for another kind?")
        raise fields_problem(f"Invalid parameters for kind {kind!r}", errors) from None


def _field_holding(parsed: list, value) -> list:
    """The params field a referenced name came from, for the error's `loc` (e.g. ["params", "model"]):
    a field the request set before one left at its default (`tokenizer=gpt2`, not train's default
    `architecture` "gpt2")."""
    for p in parsed:
        values = p.model_dump()
        for field in sorted(values, key=lambda f: f not in p.model_fields_set):
            v = values[field]
            if v == value or (isinstance(v, list) and value in v):
                return ["params", field]
    return ["params"]


def _training_run_hint(session: Session, caller: Caller, name: str) -> str:
    """For a `train` run's name: its checkpoints are the models, `run@step<N>`; say which exist."""
    rows = session.execute(select(Model.name, Model.step, Model.job_id)
                           .where(Model.source == "checkpoint", Model.name.startswith(f"{name}@step", autoescape=True))
                           .order_by(Model.step)).all()
    rows = [r for r in rows if r.name == f"{name}@step{r.step}"]
    if not rows:
        return ""
    shown = [r.name for r in rows] if len(rows) <= 4 else [rows[0].name, "…", rows[-1].name]
    job = rows[-1].job_id
    if job is not None and not caller.can_see(session.get(Job, job).user_id):
        job = None
    return (f"; {name!r} is a training run, whose checkpoints are the models: {', '.join(shown)} "
            f"({len(rows)}); name one of them"
            + (f", or give train_job={job} to an entropy or pruning job for all of them" if job is not None else ""))


def _path_hint(what: str, name: str) -> str:
    """A file or directory path where a registered name belongs: how to make it one."""
    # names may hold "/" and "." (org/model, corpus.v2): only what reads as a path on a disk
    if not (name.startswith(("/", "./", "../", "~")) or "\\" in name):
        return ""
    if what == "dataset":
        return ("; jobs take a registered name, not a path: upload the file first (`lmscope datasets upload NAME "
                "FILE`, Client.upload_dataset(name, path) or POST /v1/datasets) and give NAME")
    return ("; jobs take a registered name, not a path: register the directory first (`lmscope models register NAME DIR`, "
            "Client.register_model(name, path) or POST /v1/models) and give NAME")


def check_refs(session: Session, caller: Caller, parsed: list) -> None:
    """Every model, dataset and train job the params name must exist (and the job be visible and finished).

    The rows found are held shared until the submit commits (PostgreSQL ``FOR SHARE``): a concurrent
    delete (`registry.removable` locks the row first) then waits, and its in-use check sees the new job."""
    models = sorted({m for p in parsed for m in p.model_refs()})
    datasets = sorted({d for p in parsed for d in p.dataset_refs()})
    jobs = sorted({j for p in parsed for j in p.job_refs()})
    errors = []  # (loc, message)
    for what, table, names in (("model", Model, models), ("dataset", Dataset, datasets)):
        if not names:
            continue
        known = set(session.scalars(select(table.name).where(table.name.in_(names))
                                    .order_by(table.name).with_for_update(read=True)))
        missing = [n for n in names if n not in known]
        everything = list(session.scalars(select(table.name))) if missing else []
        for n in missing:
            run = _training_run_hint(session, caller, n) if table is Model else ""
            near = did_you_mean(n, everything)
            errors.append((_field_holding(parsed, n), f"{what} {n!r} is not registered"
                           + (run or near + f" (list {what}s: GET /v1/{what}s or `lmscope {what}s`)")
                           + (_path_hint(what, n) if not run and not near else "")))
    for job_id in jobs:
        ref = session.get(Job, job_id)
        if ref is None or not caller.can_see(ref.user_id):
            errors.append((_field_holding(parsed, job_id),
                           f"job {job_id} does not exist (list your train jobs: GET /v1/jobs?kind=train or "
                           "`lmscope jobs --kind train`)"))
        elif ref.deleted_at is not None:
            errors.append((_field_holding(parsed, job_id), f"train job {job_id} was deleted, with its checkpoints"))
        elif ref.kind != "train":
            errors.append((_field_holding(parsed, job_id), f"job {job_id} is {article(ref.kind)} {ref.kind!r} job, not a 'train' job"))
        elif ref.status not in ACTIVE_STATES and not session.scalars(
                select(Model.id).where(Model.job_id == job_id, Model.source == "checkpoint")
                .order_by(Model.id).with_for_update(read=True)).all():  # the job reads every one of them
            errors.append((_field_holding(parsed, job_id),
                           f"train job {job_id} has no checkpoints in the registry (it ended before writing one, "
                           "or they were removed with `lmscope models delete`)"))
    if errors:
        raise Problem(422, "unknown-reference", "Unknown model, dataset or job", "; ".join(m for _, m in errors),
                      errors=[{"loc": loc, "msg": m, "type": "unknown_reference"} for loc, m in errors])
    for job_id in jobs:
        _refuse_unfinished_train_job(session, session.get(Job, job_id))


def _refuse_unfinished_train_job(session: Session, train: Job) -> None:
    """A run still training has written some checkpoints (step 0 at once): measured now, its curve would
    stop there without saying so. Say which checkpoints exist, to name them or to wait."""
    if train.status not in ACTIVE_STATES:
        return
    names = list(session.scalars(select(Model.name).where(Model.job_id == train.id, Model.source == "checkpoint")
                                 .order_by(Model.step)))
    where = (f" (step {train.progress_done} of {train.progress_total})"
             if train.status == "running" and train.progress_total else "")
    so_far = (f", or name the checkpoints written so far: models={json.dumps(names)}" if len(names) > 1
              else f", or name the one written so far: model={names[0]}" if names else "")
    raise Problem(409, "train-job-unfinished", "Train job not finished",
                  f"train job {train.id} is still {train.status}{where}: its checkpoints would stop where it "
                  f"stands; submit this job once it has finished (`lmscope wait {train.id}`){so_far}")


def check_context(session: Session, parsed: list) -> None:
    """Windows longer than a model's context are refused now, not after a queue wait and a model load.

    Models registered before their context length was recorded are checked by the worker instead.
    """
    errors = {}  # message -> loc; a sweep's parent and children ask the same question
    asking = [p for p in parsed if p.positions_read() is not None]
    names = sorted({name for p in asking for name in p.model_refs()})
    context = {name: (info or {}).get("max_positions") for name, info in  # one query for a whole sweep
               session.execute(select(Model.name, Model.info).where(Model.name.in_(names)))} if names else {}
    for p in asking:
        field, n = p.positions_read()
        limits = [(f"model {name!r}", context[name]) for name in p.model_refs() if name in context]
        for job_id in p.job_refs():
            ref = session.get(Job, job_id)
            if ref is not None and ref.kind == "train":
                limits.append((f"train job {job_id}'s checkpoints", (ref.params or {}).get("context")))
        for what, limit in limits:
            if isinstance(limit, int) and n > limit:
                errors[f"{field}={n} is longer than the {limit} positions {what} can read; "
                       f"set {field} to at most {limit}"] = ["params", field]
    if errors:
        raise Problem(422, "sequence-too-long", "Sequence longer than the model's context", "; ".join(errors),
                      errors=[{"loc": loc, "msg": m, "type": "sequence_too_long"} for m, loc in errors.items()])


def check_layers(session: Session, parsed: list) -> None:
    """Layer indices a model does not have are refused now, not by the worker after a queue wait.

    Models whose number of layers is not recorded are checked by the worker instead.
    """
    asking = [p.layers_read() for p in parsed if p.layers_read() is not None]
    names = sorted({model for _, model, _ in asking})
    counts = {name: n for name, n in  # one query for a whole sweep
              session.execute(select(Model.name, Model.num_layers).where(Model.name.in_(names)))} if names else {}
    errors = {}  # message -> loc; a sweep's parent and children ask the same question
    for field, model, layers in asking:
        n = counts.get(model)
        bad = sorted({layer for layer in layers if isinstance(n, int) and not 0 <= layer < n})
        if bad:
            errors[f"model {model!r} has {n} layers (0 to {n - 1}); there is no layer "
                   f"{', '.join(map(str, bad))}"] = ["params", field]
    if errors:
        raise Problem(422, "validation-error", "No such layer", "; ".join(errors),
                      errors=[{"loc": loc, "msg": m, "type": "layer_out_of_range"} for m, loc in errors.items()])


def check_attention_read(session: Session, parsed: list) -> None:
    """A job that reads q and k or attention weights from lmscope's attention functions (the entropy job's
    dimension-wise part, the operator job) is refused now on a model that computes its attention in its own
    modules, not after a queue wait and a model load (the worker checks again; a `train_job`'s checkpoints
    are GPT-2 or LLaMA, always readable)."""
    for p in parsed:
        read = p.attention_read()
        if read is None or not read.models:
            continue
        own = session.execute(select(Model.name, Model.architecture).where(
            Model.name.in_(read.models), Model.architecture.in_(sorted(OWN_ATTENTION_MODULES)))).all()
        if own:
            msg = "; ".join(f"model {name!r} ({arch}) computes its attention in its own modules, so lmscope never "
                            f"sees its {read.reads}" for name, arch in sorted(own))
            advice = f"{read.advice}, or {STUDY_INTERFACE_MODEL}" if read.advice else STUDY_INTERFACE_MODEL
            raise Problem(422, "validation-error", read.title, f"{msg}; {advice}",
                          errors=[{"loc": ["params", read.field], "msg": msg, "type": "unsupported_attention"}])


def check_model_sizes(session: Session, parsed: list) -> None:
    """A job too large for a model's recorded shape (the operator job's mean pattern) is refused now, not after
    a queue wait and a model load; models whose layers and heads are not recorded are checked by the worker."""
    for p in parsed:
        names = p.model_refs()
        if not names:
            continue
        for name, layers, heads, info in session.execute(select(Model.name, Model.num_layers, Model.num_heads,
                                                                Model.info).where(Model.name.in_(names))):
            if not (isinstance(layers, int) and isinstance(heads, int)):
                continue
            refusal = p.model_size_refusal(layers, heads, (info or {}).get("max_positions"))
            if refusal is not None:
                field, why = refusal
                msg = f"model {name!r}: {why}"
                raise Problem(422, "validation-error", "The job is too large for this model", msg,
                              errors=[{"loc": ["params", field], "msg": msg, "type": "too_large_for_model"}])


def check_softmax_attention(session: Session, parsed: list) -> None:
    """The attention study on an architecture it cannot read is refused now, not by every child after a
    queue wait and a model load (the worker checks again: a config may differ from its type's)."""
    names = sorted({name for p in parsed if (name := p.softmax_attention_read()) is not None})
    if not names:
        return
    errors = {}
    for name, arch, info in session.execute(select(Model.name, Model.architecture, Model.info)
                                            .where(Model.name.in_(names))):
        if arch in OWN_ATTENTION_MODULES:
            why = "computes its attention in its own modules, so lmscope never sees its q, k, v"
        elif (info or {}).get("attention_softcap", arch in SOFT_CAPPED_ATTENTION):  # unrecorded: by its type
            why = "soft-caps its attention scores, so its attention is not the softmax Performer and Linformer approximate"
        else:
            continue
        errors[f"model {name!r} ({arch}) {why}; study a model whose attention goes through transformers' "
               "AttentionInterface without soft-capping (docs/models-and-datasets.md lists them); the "
               "entropy job runs this one"] = ["params", "model"]
    if errors:
        raise Problem(422, "validation-error", "The attention study cannot read this model", "; ".join(errors),
                      errors=[{"loc": loc, "msg": m, "type": "unsupported_attention"} for m, loc in errors.items()])


def check_same_shapes(session: Session, parsed: list) -> None:
    """Models a job compares head by head must have the same layers × heads (as far as recorded)."""
    for p in parsed:
        asked = p.models_compared()
        if asked is None:
            continue
        field, names = asked
        shapes = {row.name: (row.num_layers, row.num_heads) for row in session.execute(
            select(Model.name, Model.num_layers, Model.num_heads).where(Model.name.in_(names)))}
        known = [(name, shapes[name]) for name in names if None not in shapes.get(name, (None, None))]
        other = next((item for item in known if item[1] != known[0][1]), None)
        if other is not None:
            (first, (l0, h0)), (name, (l1, h1)) = known[0], other
            msg = (f"model {name!r} has {l1} layers × {h1} heads but {first!r} has {l0} × {h0}; one job follows "
                   "the same heads across its models (e.g. checkpoints of one run): submit one job per architecture")
            raise Problem(422, "validation-error", "Models differ in shape", msg,
                          errors=[{"loc": ["params", field], "msg": msg, "type": "models_differ"}])


def check_model_names(session: Session, caller: Caller, parsed: list) -> None:
    """The models a job will register (a train run's `<run_name>@step<N>`) must not clash with any model
    or with an active job that registers the same names: refused now, not at its first checkpoint. Another
    user's active job is not named (jobs are private: its id would say it exists and what it trains)."""
    prefixes = sorted({pre for p in parsed for pre in p.model_prefixes()})
    for prefix in prefixes:
        _lock_name_until_commit(session, prefix)
        taken = session.execute(select(Model.name, Model.job_id).where(Model.name.startswith(prefix, autoescape=True))
                                .order_by(Model.id).limit(1)).first()
        if taken is not None:
            run_job = session.get(Job, taken.job_id) if taken.job_id is not None else None
            whose = ("" if taken.job_id is None else f" (a checkpoint of job {taken.job_id})"
                     if run_job is None or caller.can_see(run_job.user_id) else " (a checkpoint of another user's run)")
            what = f"model {taken.name!r} exists{whose}"
        elif (active := _active_job_registering(session, prefix)) is not None:
            whose = f"job {active}" if caller.can_see(session.get(Job, active).user_id) else "another user's job"
            what = f"{whose} (still active) will register models named {prefix}<N>"
        else:
            continue
        run_name = prefix.removesuffix("@step")
        # a finished run's checkpoints can be removed (by its owner or an admin) to use the name again
        free = (f", or (its owner or an admin) remove that run's checkpoints: `lmscope models delete --run {run_name}`"
                if taken is not None and (run_job is None or run_job.status not in ACTIVE_STATES) else "")
        raise Problem(409, "name-taken", "Model names taken",
                      f"{what}; pick another run_name than {run_name!r} (models: GET /v1/models or `lmscope models`)"
                      + free,
                      errors=[{"loc": _field_holding(parsed, run_name), "msg": f"models {prefix}<N> are taken",
                               "type": "name_taken"}], prefix=prefix)


def _lock_name_until_commit(session: Session, prefix: str) -> None:
    """Serialise submits that claim the same model names, so that two racing submits of one new
    run_name cannot both pass the check before either row exists.

    PostgreSQL: a transaction-scoped advisory lock on the name (held until this submit commits, when
    its job row is visible to the next). SQLite needs none: ``BEGIN IMMEDIATE`` already serialises
    every writing transaction. Prefixes are locked in sorted order, so two submits cannot deadlock.
    """
    if session.get_bind().dialect.name != "postgresql":
        return
    key = int.from_bytes(hashlib.blake2b(prefix.encode(), digest_size=8, person=b"lmscope-name").digest(),
                         "big", signed=True)
    session.execute(select(func.pg_advisory_xact_lock(key)))


def active_job_params(session: Session, kinds: list[str] | None = None) -> Iterator[tuple[int, int, JobParams]]:
    """(id, user id, validated params) of every queued or running job (of `kinds`). Rows whose params an
    older schema stored, or whose kind this API no longer knows, are skipped: they cannot be asked.

    Few jobs are active at a time, so their params are re-read here rather than indexed.
    """
    query = select(Job.id, Job.user_id, Job.kind, Job.params).where(Job.status.in_(ACTIVE_STATES))
    if kinds is not None:
        query = query.where(Job.kind.in_(kinds))
    for job_id, user_id, kind, params in session.execute(query).all():
        try:
            yield job_id, user_id, validate_params(kind, params, internal=True)
        except (UnknownKind, ValidationError):
            continue


def _active_job_registering(session: Session, prefix: str) -> int | None:
    """The id of a queued/running job whose params register models under `prefix`, else None."""
    kinds = [k for k, spec in KINDS.items() if spec.params.model_prefixes is not JobParams.model_prefixes]
    return next((job_id for job_id, _, parsed in active_job_params(session, kinds)
                 if prefix in parsed.model_prefixes()), None)


def active_jobs(session: Session, user_id: int) -> int:
    """Queued+running top-level jobs: a sweep counts once, however many points it has."""
    return session.scalar(select(func.count()).select_from(Job).where(
        Job.user_id == user_id, Job.status.in_(ACTIVE_STATES), Job.parent_id.is_(None))) or 0


def check_quota(session: Session, caller: Caller, settings: Settings) -> None:
    # Lock the user's row so that two concurrent submissions cannot both take the last slot
    # (PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises writers).
    session.execute(select(User.id).where(User.id == caller.id).with_for_update())
    active, limit = active_jobs(session, caller.id), caller.active_jobs_limit(settings)
    if active >= limit:
        raise Problem(429, "quota-exceeded", "Too many active jobs",
                      f"you have {active} queued or running job{'' if active == 1 else 's'}, your limit is "
                      f"{limit}; wait for some to finish or cancel some (`lmscope cancel ID`, "
                      "POST /v1/jobs/{id}/cancel)",
                      headers={"Retry-After": "30"}, active=active, limit=limit)


def create_job(session: Session, caller: Caller, settings: Settings, body: SubmitBody, *,
               idempotency_key: str | None, body_hash: str | None) -> tuple[Job, list[int]]:
    """Validate and insert; returns the job and the ids to publish (its children for a sweep)."""
    params = check_params(body.kind, body.params)
    spec = KINDS[body.kind]
    children = spec.expand(params) if spec.expand else None
    child_params = []
    if children is not None:
        if not children:
            raise Problem(422, "validation-error", "Empty sweep", "the grid has no points; give at least one value per axis",
                          errors=[{"loc": ["params", "grid"], "msg": "no grid points", "type": "empty_sweep"}])
        limit = caller.sweep_points_limit(settings)
        if len(children) > limit:
            where = ("LMSCOPE_MAX_SWEEP_POINTS" if caller.max_sweep_points is None
                     else f"set for user {caller.name!r} by an admin")
            raise Problem(422, "sweep-too-large", "Sweep too large",
                          f"the grid has {len(children)} points, your limit is {limit} ({where}); "
                          "use fewer values per axis or split the sweep",
                          errors=[{"loc": ["params", "grid"], "msg": f"{len(children)} points > {limit}",
                                   "type": "sweep_too_large"}], points=len(children), limit=limit)
        for i, child in enumerate(children):
            try:
                child_params.append(validate_params(child.kind, child.params, internal=True))
            except ValidationError as e:
                # A grid value the child kind refuses: the user's fault, say which point.
                raise Problem(422, "validation-error", "Invalid sweep point",
                              f"grid point {i} ({child.name}) is invalid for {child.kind!r}: "
                              + describe_errors(pydantic_errors(e, model=KINDS[child.kind].params))) from None
    check_refs(session, caller, [params, *child_params])
    check_context(session, [params, *child_params])
    check_layers(session, [params, *child_params])
    check_softmax_attention(session, [params])
    check_attention_read(session, [params])
    check_model_sizes(session, [params])
    check_same_shapes(session, [params])
    check_model_names(session, caller, [params, *child_params])
    check_quota(session, caller, settings)

    now = utcnow()
    job = Job(user_id=caller.id, kind=body.kind, name=body.name, tags=list(body.tags),
              params=params.stored(), status="queued", max_attempts=settings.max_attempts,
              created_at=now, idempotency_key=idempotency_key, request_hash=body_hash)
    if children is not None:
        # The parent does no work itself: it is "running" while its children run.
        job.status, job.waiting_children, job.started_at = "running", True, now
    session.add(job)
    session.flush()
    if children is None:
        return job, [job.id]
    rows = [Job(user_id=caller.id, kind=c.kind, name=c.name, tags=list(dict.fromkeys([*body.tags, *c.tags])),
                params=p.stored(), status="queued", parent_id=job.id,
                max_attempts=settings.max_attempts, created_at=now)
            for c, p in zip(children, child_params)]
    session.add_all(rows)
    session.flush()
    return job, [r.id for r in rows]
