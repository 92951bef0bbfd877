"""/v1/models and /v1/datasets: what jobs may name.

Models are registered by admins from Hugging Face directories under LMSCOPE_MODEL_DIRS (the path is
resolved first, so `..` and symlinks cannot escape a root). Datasets are uploaded by anyone: the
bytes are decoded and split into documents *before* anything is stored, so a bad file leaves no trace.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated

from flask import Blueprint, request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from lmscope.api.auth import current_caller, require_admin
from lmscope.api.errors import Problem, validation_problem
from lmscope.api.inputs import (decode_page_token, encode_page_token, json_body, query_int, query_params,
                                refuse_bad_strings, single_values, takes_upload)
from lmscope.api.render import iso
from lmscope.api.state import state
from lmscope.api.submit import active_job_params
from lmscope.catalog import (DATASET_FORMATS, NAME_MAX_LENGTH, NAME_PATTERN, CatalogError, inspect_model_dir,
                             parse_documents, sha256_bytes)
from lmscope.db.models import ACTIVE_STATES, Dataset, Job, Model, User
from lmscope.wording import byte_size

log = logging.getLogger("lmscope.api")
bp = Blueprint("registry", __name__, url_prefix="/v1")



def _not_a_checkpoint_name(name: str) -> str:
    if re.search(r"@step\d+$", name):  # a running train job would fail when it reaches that step
        raise ValueError(f"{name!r} is a training run's checkpoint name (<run>@step<N>, registered by `train` "
                         "jobs); choose a name without the @step<N> ending")
    return name


class RegisterModelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, AfterValidator(_not_a_checkpoint_name)] = Field(max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN, description="the name jobs use, e.g. gpt2-small")
    path: str = Field(min_length=1, description="a Hugging Face directory under one of LMSCOPE_MODEL_DIRS")


class UploadForm(BaseModel):
    model_config = ConfigDict(extra="forbid")  # `fromat=lines` must not store the file as text

    name: str = Field(max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN)
    format: str = Field("text", description="text | lines | jsonl")
    description: str | None = Field(None, max_length=2000)


def model_json(m: Model) -> dict:
    return {"name": m.name, "source": m.source, "path": m.path, "architecture": m.architecture,
            "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "hidden": m.hidden_size,
            "vocab_size": m.vocab_size, "context": (m.info or {}).get("max_positions"), "params": m.num_parameters,
            "dtype": m.dtype, "step": m.step,
            "job_id": m.job_id, "created_at": iso(m.created_at)}


def dataset_json(d: Dataset, uploaded_by: str | None = None) -> dict:
    return {"name": d.name, "source": d.source, "format": d.format, "documents": d.num_documents,
            "bytes": d.num_bytes, "sha256": d.sha256, "description": d.description, "uploaded_by": uploaded_by,
            "created_at": iso(d.created_at)}


def name_taken(what: str, name: str) -> Problem:
    return Problem(409, "name-taken", f"{what.capitalize()} name taken",
                   f"a {what} named {name!r} exists; choose another name")


# ---------------------------------------------------------------- models

MODEL_SOURCES = ("builtin", "directory", "checkpoint")
DEFAULT_MODEL_PAGE, MAX_MODEL_PAGE = 1000, 1000


@bp.get("/models")
@query_params("run", "source", "limit", "page_token")
def list_models():
    """Registered models by name: built-in tiny configs, local HF directories, training checkpoints; `run`
    keeps one training run's checkpoints, `source` one kind of model. Pages of `limit` (1000)."""
    limit = query_int("limit", DEFAULT_MODEL_PAGE, 1, MAX_MODEL_PAGE)
    q = select(Model).order_by(Model.name).limit(limit + 1)
    if (source := request.args.get("source")) is not None:
        if source not in MODEL_SOURCES:
            raise Problem(422, "validation-error", "Invalid source filter",
                          f"source {source!r} is none of {', '.join(MODEL_SOURCES)}",
                          errors=[{"loc": ["query", "source"], "msg": "unknown source", "type": "enum"}])
        q = q.where(Model.source == source)
    run = request.args.get("run")
    if run is not None:  # checkpoints `<run>@step<N>` (the step is checked below: `a@step1x` is no checkpoint)
        q = q.where(Model.source == "checkpoint", Model.name.startswith(f"{run}@step", autoescape=True))
    if token := request.args.get("page_token"):
        q = q.where(Model.name > decode_page_token(
            token, "after", lambda v: type(v) is str and len(v) <= NAME_MAX_LENGTH and re.fullmatch(NAME_PATTERN, v),
            "/v1/models"))
    with state().sessions() as session:
        rows = session.scalars(q).all()
    page, more = rows[:limit], len(rows) > limit
    items = [model_json(m) for m in page if run is None or m.name == f"{run}@step{m.step}"]
    return {"items": items, "next_page_token": encode_page_token(after=page[-1].name) if more else None}


@bp.post("/models")
def register_model():
    """Register a Hugging Face directory under LMSCOPE_MODEL_DIRS as a model (admins only)."""
    caller = require_admin()
    st = state()
    raw = json_body('{"name": "gpt2", "path": "/models/gpt2"}')
    try:
        body = RegisterModelBody.model_validate(raw)
    except ValidationError as e:
        raise validation_problem(e, model=RegisterModelBody) from None
    try:
        facts = inspect_model_dir(Path(body.path), st.settings.model_dirs)
    except CatalogError as e:
        raise Problem(422, "invalid-model", "Model directory refused", str(e),
                      errors=[{"loc": ["path"], "msg": str(e), "type": "invalid_model"}]) from None
    row = Model(name=body.name, source="directory", path=facts.path,
                architecture=facts.architecture, num_layers=facts.num_layers, num_heads=facts.num_heads,
                num_kv_heads=facts.num_kv_heads, hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                num_parameters=facts.num_parameters, dtype=facts.dtype, info=facts.info, created_by=caller.id)
    try:
        with st.sessions() as session, session.begin():
            session.add(row)
    except IntegrityError:
        raise name_taken("model", body.name) from None
    return model_json(row), 201, {"Location": "/v1/models"}


@bp.delete("/models/<name>")
def delete_model(name: str):
    """Remove a model from the registry and free its name (its files stay where they are).

    A checkpoint by the owner of the run that wrote it, or by an admin; a registered directory by an
    admin; built-in models stay. Refused while its training run is active or a queued or running job
    reads the model (`model_refs()`: model, models, a tokenizer) or its run's checkpoints (`job_refs()`)."""
    caller = current_caller()
    with state().sessions() as session, session.begin():
        row = removable(session, Model, "model", name)
        run = session.get(Job, row.job_id) if row.job_id is not None else None
        owner = run.user_id if run is not None else row.created_by
        if not caller.is_admin and (row.source != "checkpoint" or owner != caller.id):
            whose = "a checkpoint of another user's run" if row.source == "checkpoint" else "registered by an admin"
            raise Problem(403, "forbidden", "Not yours to remove",
                          f"model {name!r} is {whose}; its owner or an admin can remove it")
        if run is not None and run.status in ACTIVE_STATES:
            raise Problem(409, "model-in-use", "Its training run is active",
                          f"job {run.id} is {run.status} and writes {name!r}; cancel it (`lmscope cancel {run.id}`) "
                          "or wait for it to end")
        refuse_while_read(session, caller, "model", name,
                          lambda p: name in p.model_refs() or row.job_id in p.job_refs())
        session.delete(row)
    return "", 204


def removable(session, table, what: str, name: str):
    """The registry row `name` of `table` (Model or Dataset), which is not built in; 404 / 409 otherwise.

    Locked until the caller's transaction ends (PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` serialises
    writers anyway): a submit naming it holds it shared (`check_refs`) until the job row is committed,
    so the in-use check that follows sees that job, or the submit sees the row gone."""
    row = session.scalar(select(table).where(table.name == name).with_for_update())
    if row is None:
        raise Problem(404, "not-found", f"No such {what}",
                      f"there is no {what} {name!r}; list {what}s with GET /v1/{what}s or `lmscope {what}s`")
    if row.source == "builtin":
        raise Problem(409, f"builtin-{what}", f"Built-in {what}s stay",
                      f"{name!r} is built in (every worker registers it again at start); it cannot be removed")
    return row


def refuse_while_read(session, caller, what: str, name: str, reads) -> None:
    """409 when queued or running jobs' validated params satisfy ``reads(params)`` (name the model among
    their `model_refs()`, read a train job's checkpoints among their `job_refs()`, …): the caller's own
    jobs by id (an admin's: all), other users' only counted (jobs are private)."""
    own, others = [], 0
    for job_id, user_id, parsed in active_job_params(session):
        if reads(parsed):
            if caller.can_see(user_id):
                own.append(job_id)
            else:
                others += 1
    if own or others:
        which = ", ".join(filter(None, [f"job(s) {', '.join(map(str, own))}" if own else "",
                                        f"{others} job(s) of other users" if others else ""]))
        raise Problem(409, f"{what}-in-use", f"Jobs use this {what}",
                      f"{which} read {name!r} and are queued or running; remove it once they have ended")


# ---------------------------------------------------------------- datasets

@bp.get("/datasets")
def list_datasets():
    """Registered text datasets (uploads and built-in corpora)."""
    with state().sessions() as session:
        rows = session.execute(select(Dataset, User.name).outerjoin(User, User.id == Dataset.created_by)
                               .order_by(Dataset.name)).all()
        return {"items": [dataset_json(d, by if d.source == "upload" else None) for d, by in rows]}


def _read_upload() -> tuple[dict, bytes]:
    """(form fields, file bytes) from multipart (`file` + `name`, `format`) or a raw body (`?name=&format=`)."""
    if request.mimetype == "multipart/form-data":
        if request.args:
            raise Problem(422, "validation-error", "Query parameters with a multipart upload",
                          "a multipart upload sends name, format and description as form fields; "
                          f"leave out the query parameters ({', '.join(request.args)})",
                          errors=[{"loc": ["query", k], "msg": "send it as a form field", "type": "extra_forbidden"}
                                  for k in request.args])
        upload = request.files.get("file")
        if upload is None:
            # also what a malformed multipart body reads as: werkzeug finds no fields in it
            others = sorted(request.files)  # a misspelt field name (`fil=@wiki.txt`) holds the file
            got = f"; the file came as {', '.join(repr(k) for k in others)}" if others else ""
            raise Problem(422, "validation-error", "No file", f"send the dataset as the multipart field 'file'{got}",
                          errors=[{"loc": ["file"], "msg": "missing", "type": "missing"}])
        single_values(request.form, "form")
        single_values(request.files, "form")
        fields = request.form.to_dict()
        refuse_bad_strings(fields)
        return fields, upload.read()
    return request.args.to_dict(), request.get_data(cache=False)


@bp.post("/datasets")
@query_params("name", "format", "description")
@takes_upload
def upload_dataset():
    """Upload a text dataset: multipart `file` + `name` + `format` (text|lines|jsonl), or a raw body with ?name=&format=."""
    st, caller = state(), current_caller()
    limit = st.settings.max_upload_bytes
    fields, data = _read_upload()  # a body far past the limit is refused by Flask's MAX_CONTENT_LENGTH (413)
    if len(data) > limit:
        raise Problem(413, "payload-too-large", "Upload too large",
                      f"the file is {len(data)} bytes, the limit is {limit} (LMSCOPE_MAX_UPLOAD_BYTES); "
                      "split the corpus or ask an admin to raise the limit")
    try:
        form = UploadForm.model_validate(fields)
    except ValidationError as e:
        raise validation_problem(e, model=UploadForm) from None
    if form.format not in DATASET_FORMATS:
        raise Problem(422, "validation-error", "Unknown format",
                      f"format {form.format!r} is unknown; use one of: "
                      + "; ".join(f"{k} ({v})" for k, v in DATASET_FORMATS.items()),
                      errors=[{"loc": ["format"], "msg": "unknown format", "type": "enum"}])
    try:
        documents = parse_documents(data, form.format)
    except CatalogError as e:
        raise Problem(422, "invalid-dataset", "Dataset refused", str(e),
                      errors=[{"loc": ["file"], "msg": str(e), "type": "invalid_dataset"}]) from None
    if not documents:
        raise Problem(422, "invalid-dataset", "Dataset refused",
                      f"the file has no documents in format {form.format!r} ({DATASET_FORMATS[form.format]})")

    with st.sessions() as session:
        if session.scalar(select(Dataset.id).where(Dataset.name == form.name)) is not None:
            raise name_taken("dataset", form.name)
        check_upload_quota(session, caller, st.settings, len(data))
    digest = sha256_bytes(data)
    path = st.settings.data_dir / "datasets" / f"{digest}.{'jsonl' if form.format == 'jsonl' else 'txt'}"
    store_file(path, data)
    row = Dataset(name=form.name, source="upload", path=str(path), format=form.format, num_documents=len(documents),
                  num_bytes=len(data), sha256=digest, description=form.description, created_by=caller.id)
    try:
        with st.sessions() as session, session.begin():
            # again, with the user's row locked (PostgreSQL; SQLite serialises writers): two uploads of
            # one user at once cannot both pass a check made before either was inserted
            session.execute(select(User.id).where(User.id == caller.id).with_for_update())
            check_upload_quota(session, caller, st.settings, len(data))
            session.add(row)
    # refused: the file may be another name's too (the same bytes, uploaded meanwhile): removed only if unused
    except Problem:
        remove_unused_upload(st.sessions, path)
        raise
    except IntegrityError:
        remove_unused_upload(st.sessions, path)
        raise name_taken("dataset", form.name) from None
    store_file(path, data)  # a delete of another name with these bytes may have removed the file meanwhile
    return dataset_json(row, caller.name), 201, {"Location": "/v1/datasets"}


@bp.delete("/datasets/<name>")
def delete_dataset(name: str):
    """Remove a dataset from the registry and free its name. An upload's file goes too, unless another
    name is backed by the same bytes (uploads are stored by content); a file registered in place stays.

    An upload by its uploader or an admin, a file registered in place by an admin; the built-in stays.
    Refused while a queued or running job reads it."""
    caller = current_caller()
    with state().sessions() as session, session.begin():
        row = removable(session, Dataset, "dataset", name)
        if not caller.is_admin and (row.source != "upload" or row.created_by != caller.id):
            whose = "another user's upload" if row.source == "upload" else "a file an admin registered"
            raise Problem(403, "forbidden", "Not yours to remove",
                          f"dataset {name!r} is {whose}; its uploader or an admin can remove it")
        refuse_while_read(session, caller, "dataset", name, lambda p: name in p.dataset_refs())
        session.delete(row)
    if row.source == "upload":  # else deleted uploads would fill the disk with files no name leads to
        remove_unused_upload(state().sessions, Path(row.path))
    return "", 204


def remove_unused_upload(sessions, path: Path) -> None:
    """Delete an upload's file if no dataset row uses it, safe against an upload of the same bytes at the
    same moment: the file is first moved aside, and only then are the rows read (again). An upload that committed
    before that read keeps the file (it is moved back); one that commits after it finds the file gone when
    it stores its bytes again after its commit (``upload_dataset``), and writes it anew."""
    def used() -> bool:
        with sessions() as session:
            return session.scalar(select(Dataset.id).where(Dataset.path == str(path)).limit(1)) is not None

    if used():  # another name's file, which a job may be reading: never moved, not even for a moment
        return
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}{ASIDE_SUFFIX}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    except OSError as e:  # the name is freed either way; a file left behind only takes space
        log.warning("could not remove the file of a deleted upload, %s: %s", path, e)
        return
    try:
        if used():
            os.replace(aside, path)
        else:
            aside.unlink()
    except Exception as e:  # the delete has succeeded: say so to the caller, log what is left to tidy
        log.warning("could not finish removing the file of a deleted upload, %s (left as %s): %s", path, aside, e)


ASIDE_SUFFIX = ".deleting"


def tidy_deleted_uploads(sessions, folder: Path, older_than_s: float = 600.0) -> None:
    """Finish, at start-up, what ``remove_unused_upload`` logged it could not (a failed unlink, or a failed move
    back): a file moved aside returns to its name when a dataset row names it and the name is free, else it is
    deleted. Files moved aside in the last ``older_than_s`` seconds are left to the removal under way."""
    now = time.time()
    for aside in folder.glob(f"*{ASIDE_SUFFIX}"):
        try:
            if now - aside.stat().st_ctime < older_than_s:  # a rename sets ctime: when it was moved aside
                continue
            original = aside.with_name(aside.name.rsplit(".", 2)[0])  # <name>.<uuid hex>.deleting
            with sessions() as session:
                named = session.scalar(select(Dataset.id).where(Dataset.path == str(original)).limit(1)) is not None
            if named and not original.exists():
                os.replace(aside, original)
                log.warning("restored %s, a registered dataset's file left aside by a failed delete", original)
            else:
                aside.unlink()
        except (OSError, SQLAlchemyError) as e:  # tidying must not stop the API from starting
            log.warning("could not tidy %s: %s", aside, e)


def check_upload_quota(session, caller, settings, size: int) -> None:
    """A user's uploads together stay within LMSCOPE_MAX_UPLOADED_BYTES_PER_USER (the disk is shared)."""
    limit = settings.max_uploaded_bytes_per_user
    stored = uploaded_bytes(session, caller.id)
    if stored + size > limit:
        raise Problem(409, "upload-quota", "Upload quota reached",
                      f"your uploads take {byte_size(stored)} and this one {byte_size(size)}: together more than the "
                      f"{byte_size(limit)} a user may store (LMSCOPE_MAX_UPLOADED_BYTES_PER_USER; each name counts, "
                      "even for the same bytes). `lmscope datasets` shows who uploaded what: delete one of yours you no "
                      "longer need (`lmscope datasets delete NAME`), or ask the server's admin to raise the limit",
                      stored=stored, size=size, limit=limit)


def uploaded_bytes(session, user_id: int) -> int:
    """The bytes a user's uploads count against their quota (each name, as uploaded)."""
    total = session.scalar(select(func.sum(Dataset.num_bytes))
                           .where(Dataset.source == "upload", Dataset.created_by == user_id))
    return int(total or 0)  # SUM is NULL over no rows, and a Decimal on PostgreSQL


def store_file(path: Path, data: bytes) -> bool:
    """Write atomically (temp file + rename); content-addressed, so an existing file is already right."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True
