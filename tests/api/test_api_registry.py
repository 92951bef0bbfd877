"""/v1/models (admins register HF directories under the model roots) and /v1/datasets (uploads)."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from lmscope.catalog import CatalogError, parse_documents
from lmscope.db.models import Dataset, Model, User

from .conftest import is_problem

SHAPES = {"transformer.wte.weight": [10, 4], "transformer.h.0.attn.c_attn.weight": [4, 12], "lm_head.bias": [10]}


def write_hf_dir(path, shapes=SHAPES):
    """A minimal Hugging Face GPT-2 directory: config.json, a hand-written .safetensors file and a
    (stand-in) tokenizer.json."""
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text("{}")
    (path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_head": 2, "n_embd": 4,
        "vocab_size": 10, "torch_dtype": "float32"}))
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * eval("*".join(map(str, shape)))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)
    return path


def test_admin_registers_a_model_directory(api, tmp_path):
    admin = api.user("root", admin=True)
    model_dir = write_hf_dir(tmp_path / "models" / "gpt2-mini")
    r = api.client.post("/v1/models", headers=admin, json={"name": "gpt2-mini", "path": str(model_dir)})
    assert r.status_code == 201, r.get_json()
    listed = {m["name"]: m for m in api.client.get("/v1/models", headers=api.user("ann")).get_json()["items"]}
    m = listed["gpt2-mini"]
    assert (m["source"], m["architecture"], m["layers"], m["heads"], m["hidden"]) == ("directory", "gpt2", 1, 2, 4)
    assert m["params"] == 10 * 4 + 4 * 12 + 10
    # The API upserted the built-in tiny models at start-up (lmscope.db.builtins, as workers do).
    from lmscope.catalog import BUILTIN_MODELS

    assert {n for n, x in listed.items() if x["source"] == "builtin"} >= set(BUILTIN_MODELS)
    assert all(listed[n]["params"] > 0 for n in BUILTIN_MODELS)  # counted at start-up, not only once loaded
    # the context length, which bounds an entropy job's seq_len
    assert listed["tiny-gpt2"]["context"] == BUILTIN_MODELS["tiny-gpt2"]["n_positions"]
    assert listed["tiny-llama"]["context"] == BUILTIN_MODELS["tiny-llama"]["max_position_embeddings"]
    # Now jobs may name it.
    assert api.submit(api.user("ann"), params={"model": "gpt2-mini"}).status_code == 202
    is_problem(api.client.post("/v1/models", headers=admin, json={"name": "gpt2-mini", "path": str(model_dir)}),
               409, "name-taken")
    # a training run's checkpoint name: the run would fail with name-taken when it got to that step
    for name in ("run7@step250", "my-run@step0"):
        body = is_problem(api.client.post("/v1/models", headers=admin, json={"name": name, "path": str(model_dir)}),
                          422, "validation-error")
        assert body["errors"][0]["loc"] == ["name"] and "@step<N>" in body["detail"]


def test_model_registration_is_admin_only(api, tmp_path):
    model_dir = write_hf_dir(tmp_path / "models" / "x")
    body = is_problem(api.client.post("/v1/models", headers=api.user("ann"), json={"name": "x", "path": str(model_dir)}),
                      403, "forbidden")
    assert "admin" in body["detail"]


def test_model_paths_must_stay_under_the_roots(api, tmp_path):
    admin = api.user("root", admin=True)
    outside = write_hf_dir(tmp_path / "elsewhere" / "m")
    (tmp_path / "models" / "link").symlink_to(outside, target_is_directory=True)
    for path in (outside, tmp_path / "models" / ".." / "elsewhere" / "m", tmp_path / "models" / "link"):
        body = is_problem(api.client.post("/v1/models", headers=admin, json={"name": "sneaky", "path": str(path)}),
                          422, "invalid-model")
        assert "outside the configured model roots" in body["detail"] and "LMSCOPE_MODEL_DIRS" in body["detail"]
    (tmp_path / "models" / "empty").mkdir()
    body = is_problem(api.client.post("/v1/models", headers=admin,
                                      json={"name": "e", "path": str(tmp_path / "models" / "empty")}), 422, "invalid-model")
    assert "config.json" in body["detail"]
    body = is_problem(api.client.post("/v1/models", headers=admin, json={"name": "bad name!", "path": "x"}),
                      422, "validation-error")
    assert body["errors"][0]["loc"] == ["name"]
    assert "letters, digits and . _ @ : + / -" in body["detail"] and "pattern" not in body["detail"]  # words, no regex
    assert "sneaky" not in [m["name"] for m in api.client.get("/v1/models", headers=admin).get_json()["items"]]


def test_a_relative_model_path_is_looked_up_under_the_roots(api, tmp_path, monkeypatch):
    """The server's working directory means nothing to a user: a relative path names a directory under a
    model root (it was resolved against the server's working directory, and refused as outside the roots)."""
    admin = api.user("root", admin=True)
    model_dir = write_hf_dir(tmp_path / "models" / "team" / "tiny")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the server's working directory: no models there
    r = api.client.post("/v1/models", headers=admin, json={"name": "tiny", "path": "team/tiny"})
    assert r.status_code == 201, r.get_json()
    assert r.get_json()["path"] == str(model_dir.resolve())
    missing = is_problem(api.client.post("/v1/models", headers=admin, json={"name": "x", "path": "tiny"}),
                         422, "invalid-model")
    assert "no model root holds it" in missing["detail"] and str(tmp_path / "models" / "tiny") in missing["detail"]
    write_hf_dir(tmp_path / "elsewhere" / "m")
    # a path that leaves the roots is refused alike whether it exists or not: no oracle for files outside
    answers = [is_problem(api.client.post("/v1/models", headers=admin, json={"name": "x", "path": path}),
                          422, "invalid-model")["detail"].split(" is outside")[1]
               for path in ("../elsewhere/m", "../elsewhere/nothing", "team/../../elsewhere/m")]
    assert len(set(answers)) == 1 and "configured model roots" in answers[0]


def test_unusable_model_directories_are_422_naming_what_is_wrong(api, tmp_path):
    """Each of these was a 500 (an unreadable path, a config that is not an object, a truncated weights
    file) or was stored, and GET /v1/models then served `"hidden": Infinity`, which is not JSON."""
    admin = api.user("root", admin=True)

    def refused(path, *says):
        body = is_problem(api.client.post("/v1/models", headers=admin, json={"name": "bad", "path": str(path)}),
                          422, "invalid-model")
        assert all(s in body["detail"] for s in says), body["detail"]
        assert body["errors"][0]["loc"] == ["path"]

    refused("~nosuchuser-lmscope/x", "not a usable path")
    config = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 4, "vocab_size": 10}
    cases = [
        ("[]", "must hold a JSON object"),
        (json.dumps({**config, "model_type": ["gpt2"]}), "model_type ['gpt2'] is not supported"),
        (json.dumps({**config, "architectures": "GPT2LMHeadModel"}), "architectures must be a list"),
        (json.dumps({**config, "n_layer": "many"}), 'n_layer must be a positive integer', '"many"'),
        (json.dumps({**config, "n_head": -3}), "n_head must be a positive integer"),
        (json.dumps({**config, "n_positions": "x"}), "n_positions must be a positive integer"),
        (json.dumps({**config, "n_embd": True}), "n_embd must be a positive integer"),
        (json.dumps({**config, "vocab_size": 2**40}), "vocab_size must be a positive integer"),
        (json.dumps(config)[:-1] + ', "n_embd": 1e400}', "1e400 is too large"),
        (json.dumps(config)[:-1] + ', "n_embd": NaN}', "NaN is not a JSON number"),
        (json.dumps({**config, "torch_dtype": {"a": 1}}), "torch_dtype must name a dtype"),
        (json.dumps({**config, "num_key_value_heads": "2"}), "num_key_value_heads must be a positive integer"),
    ]
    for i, (text, *says) in enumerate(cases):
        model_dir = write_hf_dir(tmp_path / "models" / f"c{i}")
        (model_dir / "config.json").write_text(text)
        refused(model_dir, *says)
    for i, weights in enumerate((b"abc", struct.pack("<Q", 2**60) + b"{}", struct.pack("<Q", 2) + b"[]",
                                 struct.pack("<Q", 26) + b'{"w": {"shape": "large"}}')):
        model_dir = write_hf_dir(tmp_path / "models" / f"w{i}")
        (model_dir / "model.safetensors").write_bytes(weights)
        refused(model_dir, "model.safetensors is not a safetensors file")
    # no tokenizer: it was registered, and every job on it failed at load ("has no tokenizer vocabulary")
    model_dir = write_hf_dir(tmp_path / "models" / "no-tokenizer")
    (model_dir / "tokenizer.json").unlink()
    refused(model_dir, "has no tokenizer", "save_pretrained")
    (model_dir / "tokenizer_config.json").write_text("{}")  # settings, no vocabulary: every load failed
    refused(model_dir, "has no tokenizer vocabulary", "tokenizer_config.json alone")
    (model_dir / "lmscope.json").write_text('{"tokenizer": "bytes"}')  # lmscope's byte tokenizer, named
    # ... whose 259 ids do not fit 10 token embeddings: every job failed with an IndexError
    refused(model_dir, "byte tokenizer produces token ids up to 258", "10 token embeddings", "resize_token_embeddings")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 259}))
    r = api.client.post("/v1/models", headers=admin, json={"name": "bytes-model", "path": str(model_dir)})
    assert r.status_code == 201, r.get_json()
    # a tokenizer.json whose vocabulary or added tokens reach past the embeddings
    for i, tokenizer in enumerate(({"model": {"vocab": {"a": 0, "b": 10}}},
                                   {"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 12, "content": "<x>"}]})):
        model_dir = write_hf_dir(tmp_path / "models" / f"big-tokenizer{i}")
        (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
        refused(model_dir, "tokenizer.json produces token ids up to", "10 token embeddings")
    # a NUL in the path is refused with the body's other strings that cannot be stored
    body = is_problem(api.client.post("/v1/models", headers=admin, json={"name": "bad", "path": "/tmp/a\x00b"}),
                      422, "validation-error")
    assert body["errors"][0]["loc"] == ["path"]
    listed = api.client.get("/v1/models", headers=admin)
    assert "bad" not in [m["name"] for m in json.loads(listed.get_data(as_text=True),
                                                       parse_constant=lambda c: pytest.fail(c))["items"]]


TEXT = "First paragraph, two\nlines.\n\nSecond paragraph.\n\n\n = Heading = \n\nThird one.\n"


def stored_files(api):
    folder = api.settings.data_dir / "datasets"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_upload_a_dataset_multipart_and_raw(api):
    h = api.user("ann")
    r = api.client.post("/v1/datasets", headers=h, content_type="multipart/form-data",
                        data={"name": "paras", "format": "text", "file": (io.BytesIO(TEXT.encode()), "a.txt")})
    assert r.status_code == 201, r.get_json()
    d = r.get_json()
    digest = hashlib.sha256(TEXT.encode()).hexdigest()
    # Paragraphs split at blank lines; the WikiText-style heading is not a document.
    assert (d["documents"], d["bytes"], d["sha256"], d["format"]) == (3, len(TEXT.encode()), digest, "text")
    assert (api.settings.data_dir / "datasets" / f"{digest}.txt").read_bytes() == TEXT.encode()
    # Raw body, one document per line.
    r = api.client.post("/v1/datasets?name=lines&format=lines", headers=h, data=TEXT.encode(), content_type="text/plain")
    assert r.status_code == 201 and r.get_json()["documents"] == 4
    assert stored_files(api) == [f"{digest}.txt"]  # same bytes, stored once
    listed = api.client.get("/v1/datasets", headers=h).get_json()["items"]
    assert [x["name"] for x in listed if x["source"] == "upload"] == ["d", "lines", "paras"]
    assert api.submit(h, kind="norms", params={"model": "m", "dataset": "paras"}).status_code == 202
    is_problem(api.client.post("/v1/datasets?name=paras", headers=h, data=b"x", content_type="text/plain"), 409, "name-taken")


def test_too_large_uploads_are_413_and_store_nothing(api):
    h = api.user("ann")
    big = b"word " * 1000  # 5000 bytes > max_upload_bytes = 4096
    body = is_problem(api.client.post("/v1/datasets", headers=h, content_type="multipart/form-data",
                                      data={"name": "big", "file": (io.BytesIO(big), "big.txt")}), 413, "payload-too-large")
    assert "5000" in body["detail"] and "4096" in body["detail"]
    # Far beyond the limit: refused from Content-Length before the body is read.
    is_problem(api.client.post("/v1/datasets?name=huge", headers=h, data=b"x" * 200_000, content_type="text/plain"),
               413, "payload-too-large")
    with api.sessions() as session:
        assert session.scalars(select(Dataset.name).where(Dataset.source == "upload", Dataset.name != "d")).all() == []
    assert stored_files(api) == []


def test_bad_files_are_422_saying_where(api):
    h = api.user("ann")
    latin1 = "caf\xe9\nna\xefve\n".encode("latin-1")
    body = is_problem(api.client.post("/v1/datasets?name=l1", headers=h, data=latin1, content_type="text/plain"),
                      422, "invalid-dataset")
    assert "byte 3" in body["detail"] and "line 1" in body["detail"] and "UTF-8" in body["detail"]
    jsonl = b'{"text": "ok"}\n{"body": "no text field"}\n'
    body = is_problem(api.client.post("/v1/datasets?name=j&format=jsonl", headers=h, data=jsonl, content_type="text/plain"),
                      422, "invalid-dataset")
    assert "line 2" in body["detail"] and "'text'" in body["detail"]
    # each line is strict JSON (these were a 500, or stored and then failed every job in the tokenizer)
    for i, (data, says) in enumerate(((b'{"text": "ok"}\n{"text": ' + b"[" * 1000 + b"\n", "line 2 is not JSON"),
                                      (b'{"text": "ok", "text": "again"}', "appears twice"),
                                      (b'{"text": "ok", "score": NaN}', "NaN"),
                                      (b'{"text": "hello \\ud800 world"}', "lone surrogate"))):
        body = is_problem(api.client.post(f"/v1/datasets?name=bad{i}&format=jsonl", headers=h, data=data,
                                          content_type="text/plain"), 422, "invalid-dataset")
        assert says in body["detail"], body["detail"]
    with pytest.raises(CatalogError, match="line 1 is not JSON .a number has too many digits"):  # past the upload limit here
        parse_documents(b'{"text": "ok", "n": ' + b"1" * 5000 + b"}", "jsonl")
    body = is_problem(api.client.post("/v1/datasets?name=f&format=csv", headers=h, data=b"a", content_type="text/plain"),
                      422, "validation-error")
    assert "jsonl" in body["detail"]
    is_problem(api.client.post("/v1/datasets?name=blank", headers=h, data=b"\n\n \n", content_type="text/plain"),
               422, "invalid-dataset")
    assert stored_files(api) == []
    # U+2028 is a character inside a JSON string, not a line break
    r = api.client.post("/v1/datasets?name=ls&format=jsonl", headers=h, content_type="text/plain",
                        data='{"text": "one\u2028line"}\n{"text": "two"}\n'.encode())
    assert r.status_code == 201 and r.get_json()["documents"] == 2, r.get_json()


def test_a_missing_builtin_corpus_is_logged_not_silent(settings_factory, sqlite_url, tmp_path, caplog):
    """A wrong corpora mount used to surface only as "dataset 'wikitext-2' is not registered" at submit."""
    from lmscope.db.builtins import WIKITEXT2, ensure_builtins
    from lmscope.db.engine import make_engine, make_sessionmaker

    sessions = make_sessionmaker(make_engine(sqlite_url))
    missing = tmp_path / "corpora" / "wiki.test.raw"
    with caplog.at_level("WARNING", logger="lmscope.builtins"):
        ensure_builtins(settings_factory(database_url=sqlite_url, wikitext2_path=missing), sessions)
    assert f"LMSCOPE_WIKITEXT2_PATH={missing} is not a file" in caplog.text and "CORPORA_DIR" in caplog.text
    with sessions() as session:
        assert session.scalar(select(Dataset).where(Dataset.name == WIKITEXT2)) is None
    empty = tmp_path / "empty.raw"
    empty.write_text(" = Only a heading = \n")
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmscope.builtins"):  # a warning, not a service that cannot start
        ensure_builtins(settings_factory(database_url=sqlite_url, wikitext2_path=empty), sessions)
    assert "is not registered" in caplog.text and "no documents" in caplog.text
    # A file that cannot be read (as root, chmod does not stop reads; /proc/self/mem is a regular file
    # whose first page is unmapped): a warning, not a traceback that stops `lmscope up` starting.
    unreadable = Path("/proc/self/mem")
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmscope.builtins"):
        ensure_builtins(settings_factory(database_url=sqlite_url, wikitext2_path=unreadable), sessions)
    assert "is not registered" in caplog.text and "mem cannot be read" in caplog.text


def test_upload_fields_are_checked_like_every_other_input(api):
    """`fromat=lines` was ignored (the file stored as text); a repeated name kept one value silently."""
    h = api.user("ann")

    def multipart(**fields):
        data = {"file": (io.BytesIO(TEXT.encode()), "a.txt"), **fields}
        return api.client.post("/v1/datasets", headers=h, content_type="multipart/form-data", data=data)

    body = is_problem(api.client.post("/v1/datasets?name=d2&fromat=lines", headers=h, data=TEXT.encode(),
                                      content_type="text/plain"), 422, "validation-error")
    assert "did you mean 'format'?" in body["detail"] and body["errors"][0]["loc"] == ["query", "fromat"]
    body = is_problem(multipart(name="d2", fromat="lines"), 422, "validation-error")
    assert body["errors"][0]["loc"] == ["fromat"] and "did you mean 'format'?" in body["detail"]
    body = is_problem(multipart(name=["a", "b"]), 422, "validation-error")
    assert body["errors"][0]["loc"] == ["form", "name"]
    is_problem(api.client.post("/v1/datasets?name=a&name=b", headers=h, data=TEXT.encode(), content_type="text/plain"),
               422, "validation-error")
    body = is_problem(api.client.post("/v1/datasets?format=lines", headers=h, content_type="multipart/form-data",
                                      data={"name": "d2", "file": (io.BytesIO(TEXT.encode()), "a.txt")}),
                      422, "validation-error")
    assert "form fields" in body["detail"]
    body = is_problem(multipart(name="d2", description="a\x00b"), 422, "validation-error")
    assert body["errors"][0]["loc"] == ["description"]
    # a multipart body werkzeug cannot read has no `file` field: the 422 says how to send one
    broken = api.client.post("/v1/datasets", headers=h, data=b"--xx\r\nbroken",
                             content_type="multipart/form-data; boundary=xx")
    assert "multipart field 'file'" in is_problem(broken, 422, "validation-error")["detail"]
    misspelt = api.client.post("/v1/datasets", headers=h, content_type="multipart/form-data",
                               data={"name": "d2", "fil": (io.BytesIO(TEXT.encode()), "a.txt")})
    assert is_problem(misspelt, 422, "validation-error")["detail"] == (
        "send the dataset as the multipart field 'file'; the file came as 'fil'")
    assert stored_files(api) == []
    assert multipart(name="d2", format="lines", description="tab\tand\nnewline").status_code == 201


def test_a_server_without_model_roots_says_where_to_set_them(make_api, tmp_path):
    """The roots are the server's setting: setting LMSCOPE_MODEL_DIRS in the CLI's shell changes nothing."""
    api = make_api(model_dirs=[])
    model_dir = write_hf_dir(tmp_path / "models" / "x")
    body = is_problem(api.client.post("/v1/models", headers=api.user("root", admin=True),
                                      json={"name": "x", "path": str(model_dir)}), 422, "invalid-model")
    assert "no model roots are configured on the server" in body["detail"]
    assert "LMSCOPE_MODEL_DIRS" in body["detail"] and "lmscope up" in body["detail"]


def test_removing_a_failed_runs_checkpoints_frees_its_run_name(api, tmp_path):
    """A failed run's checkpoints held its run_name for ever. Its owner removes them (not another user, and
    not while a job still names one); then the name can be used again. Built-ins stay; a registered
    directory is an admin's to remove."""
    from lmscope.db.models import Model

    ann, bob, root = api.user("ann"), api.user("bob"), api.user("root", admin=True)
    run = api.submit(ann, kind="train", params={"dataset": "d", "run_name": "blip"}).get_json()["id"]
    with api.sessions.begin() as session:
        for step in (0, 5):
            session.add(Model(name=f"blip@step{step}", source="checkpoint", architecture="gpt2", num_layers=2,
                              num_heads=2, job_id=run, step=step))
    body = is_problem(api.client.delete("/v1/models/blip@step0", headers=ann), 409, "model-in-use")
    assert f"job {run} is queued" in body["detail"] and f"lmscope cancel {run}" in body["detail"]
    api.set_job(run, status="failed")
    reader = api.submit(bob, kind="probe", params={"model": "blip@step5"}).get_json()["id"]
    body = is_problem(api.client.delete("/v1/models/blip@step5", headers=ann), 409, "model-in-use")
    assert body["detail"].startswith("1 job(s) of other users read 'blip@step5'")  # bob's job: not named to ann
    body = is_problem(api.client.delete("/v1/models/blip@step5", headers=root), 409, "model-in-use")
    assert body["detail"].startswith(f"job(s) {reader} read")  # an admin sees every job
    api.set_job(reader, status="succeeded")
    api.set_job(run, status="succeeded")  # an entropy job reads a finished run's checkpoints
    r = api.submit(ann, kind="entropy", params={"train_job": run, "dataset": "d"})
    assert r.status_code == 202, r.get_json()
    curves = r.get_json()["id"]
    body = is_problem(api.client.delete("/v1/models/blip@step0", headers=ann), 409, "model-in-use")
    assert f"job(s) {curves}" in body["detail"]  # it reads the run's checkpoints as it goes
    api.set_job(curves, status="succeeded")
    is_problem(api.client.delete("/v1/models/blip@step5", headers=bob), 403, "forbidden")
    refused = is_problem(api.submit(ann, kind="train", params={"dataset": "d", "run_name": "blip"}), 409, "name-taken")
    assert "blip@step" in refused["detail"] and "`lmscope models delete --run blip`" in refused["detail"]
    for name in ("blip@step0", "blip@step5"):
        assert api.client.delete(f"/v1/models/{name}", headers=ann).status_code == 204
    names = {m["name"] for m in api.client.get("/v1/models", headers=ann).get_json()["items"]}
    assert not {"blip@step0", "blip@step5"} & names
    # the run's curves cannot be measured any more: said at submit, not by a job failing later
    body = is_problem(api.submit(ann, kind="entropy", params={"train_job": run, "dataset": "d"}), 422,
                      "unknown-reference")
    assert f"train job {run} has no checkpoints in the registry" in body["detail"]
    assert api.submit(ann, kind="train", params={"dataset": "d", "run_name": "blip"}).status_code == 202
    is_problem(api.client.delete("/v1/models/blip@step0", headers=ann), 404, "not-found")
    is_problem(api.client.delete("/v1/models/tiny-gpt2", headers=root), 409, "builtin-model")

    model_dir = write_hf_dir(tmp_path / "models" / "gpt2-mini")
    assert api.client.post("/v1/models", headers=root, json={"name": "gpt2-mini", "path": str(model_dir)}).status_code == 201
    is_problem(api.client.delete("/v1/models/gpt2-mini", headers=ann), 403, "forbidden")
    assert api.client.delete("/v1/models/gpt2-mini", headers=root).status_code == 204
    assert model_dir.is_dir()  # the files stay


def _in_thread(call):
    """Run call() in a thread; (the thread, a list that gets its result)."""
    import threading

    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def test_a_submit_and_a_delete_of_the_model_it_reads_never_both_succeed(api):
    """Racing, whichever transaction reaches the model first wins and the other sees it: a delete waits
    for a submit that named the model, then refuses (its job is queued); a submit waits for a delete
    that took the model, then refuses (it is gone). Never a queued job on a removed model. (PostgreSQL:
    the row locks; SQLite: every writing transaction is serialised.)"""
    from lmscope.api.auth import Caller
    from lmscope.api.registry import removable
    from lmscope.api.submit import check_refs
    from lmscope.db.models import Job, Model, User
    from lmscope.params import validate_params

    ann = api.user("ann")
    run = api.submit(ann, kind="train", params={"dataset": "d", "run_name": "race"}).get_json()["id"]
    api.set_job(run, status="failed")
    with api.sessions.begin() as session:
        for step in (0, 5):
            session.add(Model(name=f"race@step{step}", source="checkpoint", architecture="gpt2", num_layers=2,
                              num_heads=2, job_id=run, step=step))

    # the submit first: its transaction has checked the model and added its job, not yet committed
    with api.sessions.begin() as session:
        user = session.scalar(select(User).where(User.name == "ann"))
        params = validate_params("probe", {"model": "race@step0"})
        check_refs(session, Caller.of(user), [params])
        session.add(Job(user_id=user.id, kind="probe", params=params.stored(), status="queued"))
        session.flush()
        reader = session.scalar(select(Job.id).where(Job.kind == "probe"))
        deleting, deleted = _in_thread(lambda: api.client.delete("/v1/models/race@step0", headers=ann))
        deleting.join(1.0)
        assert deleting.is_alive(), "the delete must wait for the submit that named the model"
    deleting.join(30)
    body = is_problem(deleted[0], 409, "model-in-use")
    assert f"job(s) {reader}" in body["detail"]

    # the delete first: its transaction holds the model; a submit naming it waits, then finds it gone
    with api.sessions.begin() as session:
        row = removable(session, Model, "model", "race@step5")
        submitting, submitted = _in_thread(lambda: api.submit(ann, kind="probe", params={"model": "race@step5"}))
        submitting.join(1.0)
        assert submitting.is_alive(), "the submit must wait for the delete that took the model"
        session.delete(row)
    submitting.join(30)
    body = is_problem(submitted[0], 422, "unknown-reference")
    assert "model 'race@step5' is not registered" in body["detail"]
    assert [j.params for j in api.jobs(kind="probe")] == [params.stored()]  # the first race's job only


def test_removing_a_dataset_frees_its_name_and_its_file_once_no_name_uses_it(api):
    """The uploader (or an admin) removes an upload, not while a job reads it; its file goes with the
    last name that uses those bytes; a file registered in place and the built-in stay."""
    ann, bob, root = api.user("ann"), api.user("bob"), api.user("root", admin=True)
    r = api.client.post("/v1/datasets?name=essays&format=text", headers=ann, data=b"one two three\n\nfour five six\n")
    assert r.status_code == 201, r.get_json()
    with api.sessions() as session:
        path = Path(session.scalar(select(Dataset.path).where(Dataset.name == "essays")))
    reader = api.submit(ann, kind="norms", params={"model": "tiny-gpt2", "dataset": "essays"})
    assert reader.status_code == 202, reader.get_json()
    body = is_problem(api.client.delete("/v1/datasets/essays", headers=ann), 409, "dataset-in-use")
    assert f"job(s) {reader.get_json()['id']}" in body["detail"]
    api.set_job(reader.get_json()["id"], status="succeeded")
    is_problem(api.client.delete("/v1/datasets/essays", headers=bob), 403, "forbidden")
    assert api.client.post("/v1/datasets?name=copy&format=text", headers=bob,
                           data=b"one two three\n\nfour five six\n").status_code == 201  # the same bytes
    assert api.client.delete("/v1/datasets/essays", headers=ann).status_code == 204
    assert "essays" not in {d["name"] for d in api.client.get("/v1/datasets", headers=ann).get_json()["items"]}
    assert path.is_file()  # content-addressed: the file backs `copy` too
    assert api.client.delete("/v1/datasets/copy", headers=bob).status_code == 204
    assert not path.exists() and stored_files(api) == []  # no name leads to it any more
    is_problem(api.client.delete("/v1/datasets/essays", headers=root), 404, "not-found")
    from lmscope.db.builtins import register_dataset_file

    in_place = api.settings.data_dir.parent / "corpus.txt"  # `lmscope datasets add corpus FILE`
    in_place.write_text("one two three\n\nfour five six\n")
    register_dataset_file(api.sessions, "corpus", in_place, "text")
    assert api.client.delete("/v1/datasets/corpus", headers=root).status_code == 204
    assert in_place.is_file()  # registered where it lies: not lmscope's to remove
    assert api.client.post("/v1/datasets?name=essays&format=text", headers=bob,
                           data=b"seven eight\n").status_code == 201  # the name is free again
    builtin = {d["name"] for d in api.client.get("/v1/datasets", headers=ann).get_json()["items"]
               if d["source"] == "builtin"}
    assert builtin == {"wikitext-2"}
    for name in builtin:
        is_problem(api.client.delete(f"/v1/datasets/{name}", headers=root), 409, "builtin-dataset")


def test_json_bodies_are_held_to_a_megabyte_and_uploads_to_their_own_limit(make_api):
    """A JSON body (a job, a registration) past JSON_BODY_BYTES is refused before it is parsed (a 60 MB list
    of tags once cost the server 3 GB), whatever the upload limit; an upload that large is taken."""
    from lmscope.api.inputs import JSON_BODY_BYTES

    api = make_api(max_upload_bytes=4 * JSON_BODY_BYTES)
    api.add_model("m")
    h = api.user("ann")
    tags = ["t"] * (JSON_BODY_BYTES // 4)  # '"t", ' per tag: past the limit
    body = json.dumps({"kind": "probe", "params": {"model": "m"}, "tags": tags})
    assert JSON_BODY_BYTES < len(body) < 4 * JSON_BODY_BYTES
    refused = is_problem(api.client.post("/v1/jobs", headers=h, data=body, content_type="application/json"),
                         413, "payload-too-large")
    assert str(JSON_BODY_BYTES) in refused["detail"] and "few kilobytes" in refused["detail"]
    assert api.jobs() == []
    is_problem(api.client.post("/v1/models", headers=api.user("root", admin=True),
                               data=json.dumps({"name": "x", "path": "/" * (JSON_BODY_BYTES + 1)}),
                               content_type="application/json"), 413, "payload-too-large")
    text = ("a sentence of the dataset that goes on for a while.\n" * (2 * JSON_BODY_BYTES // 52)).encode()
    assert len(text) > JSON_BODY_BYTES
    r = api.client.post("/v1/datasets?name=big&format=lines", headers=h, data=text, content_type="text/plain")
    assert r.status_code == 201, r.get_json()
    # sent chunked (no Content-Length): werkzeug cuts the body at the limit; it is refused as too large, not
    # parsed as cut-off JSON
    from werkzeug.test import EnvironBuilder, run_wsgi_app
    from werkzeug.wrappers import Response

    environ = EnvironBuilder(path="/v1/jobs", method="POST", headers={**h, "Transfer-Encoding": "chunked"},
                             content_type="application/json", data=body.encode()).get_environ()
    del environ["CONTENT_LENGTH"]  # as a server hands over a chunked body, read to its end
    environ["wsgi.input_terminated"] = True
    chunked = Response(*run_wsgi_app(api.app, environ, buffered=True))
    assert str(JSON_BODY_BYTES) in is_problem(chunked, 413, "payload-too-large")["detail"]
    assert api.jobs() == []
    # exactly at the limit, chunked as with a Content-Length, is taken (JSON padded with spaces)
    small = json.dumps({"kind": "probe", "params": {"model": "m"}}).encode()
    environ = EnvironBuilder(path="/v1/jobs", method="POST", headers={**h, "Transfer-Encoding": "chunked"},
                             content_type="application/json",
                             data=small + b" " * (JSON_BODY_BYTES - len(small))).get_environ()
    del environ["CONTENT_LENGTH"]
    environ["wsgi.input_terminated"] = True
    assert Response(*run_wsgi_app(api.app, environ, buffered=True)).status_code == 202
    api.set_job(api.jobs()[0].id, status="cancelled")
    # a body within the limit is the ordinary submission
    assert api.submit(h, kind="probe", params={"model": "m"}, tags=["t"] * 32).status_code == 202


@pytest.mark.parametrize("upload_commits", ["before the read", "after the read"])
def test_a_delete_and_an_upload_of_the_same_bytes_at_once_never_leave_a_dataset_without_its_file(api, upload_commits):
    """Deleting the last name of some bytes moves the file aside, then reads the rows: an upload of the same
    bytes that committed before that read keeps the file (moved back); one that commits after it has found
    the file gone and written it anew. Either way the new name has its file and nothing is left aside."""
    from lmscope.api.registry import remove_unused_upload

    ann = api.user("ann")
    data = b"one two three\n\nfour five six\n"
    assert api.client.post("/v1/datasets?name=old&format=text", headers=ann, data=data).status_code == 201
    with api.sessions() as session, session.begin():  # the delete's own commit
        row = session.scalar(select(Dataset).where(Dataset.name == "old"))
        path = Path(row.path)
        session.delete(row)

    def upload():
        assert api.client.post("/v1/datasets?name=new&format=text", headers=ann, data=data).status_code == 201

    reads = []

    def sessions():  # what remove_unused_upload reads the rows through, with the upload at the forced moment
        session = api.sessions()
        reads.append(path.exists())
        if len(reads) == 1:  # its first read, before it moves the file: no other name uses it yet
            return session
        if upload_commits == "before the read":
            upload()
        else:  # once the read is over (its session closed: SQLite would hold the upload's write back)
            close = session.close

            def close_then_upload():
                close()
                upload()
            session.close = close_then_upload
        return session

    remove_unused_upload(sessions, path)
    assert reads == [True, False]  # the upload came while the file was moved aside
    with api.sessions() as session:
        assert session.scalar(select(Dataset.path).where(Dataset.name == "new")) == str(path)
    assert path.read_bytes() == data
    assert stored_files(api) == [path.name]  # nothing left aside
    assert api.client.delete("/v1/datasets/new", headers=ann).status_code == 204
    assert stored_files(api) == []


def test_files_a_failed_delete_left_aside_are_tidied_when_the_api_starts(api, make_api, monkeypatch):
    """A delete whose unlink (or move back) failed leaves `<file>.<uuid>.deleting`: at start-up the API moves
    it back where a dataset still names the file (nothing is lost), deletes it where none does, and leaves a
    file moved aside moments ago to the removal under way."""
    import os

    ann = api.user("ann")
    kept, gone = b"kept bytes one two\n", b"gone bytes three four\n"
    for name, data in (("kept", kept), ("gone", gone)):
        assert api.client.post(f"/v1/datasets?name={name}&format=text", headers=ann, data=data).status_code == 201
    with api.sessions() as session:
        kept_path, gone_path = (Path(session.scalar(select(Dataset.path).where(Dataset.name == n)))
                                for n in ("kept", "gone"))
    real_unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(OSError("disk error")))
    assert api.client.delete("/v1/datasets/gone", headers=ann).status_code == 204  # the delete itself succeeds
    monkeypatch.setattr(Path, "unlink", real_unlink)
    gone_aside = next(gone_path.parent.glob(gone_path.name + ".*.deleting"))
    kept_aside = kept_path.with_name(kept_path.name + ".0123abcd.deleting")  # a move back that failed
    os.replace(kept_path, kept_aside)
    from lmscope.api import registry

    registry.tidy_deleted_uploads(api.sessions, gone_path.parent)  # moved aside moments ago: left alone
    assert gone_aside.exists() and kept_aside.exists() and not kept_path.exists()

    monkeypatch.setattr(registry.time, "time", lambda real=time.time: real() + 601)  # ten minutes later
    make_api()  # another API process starting on the same data directory
    assert kept_path.read_bytes() == kept and not kept_aside.exists()
    assert not gone_aside.exists() and not gone_path.exists()
    with api.sessions() as session:
        assert session.scalar(select(Dataset.path).where(Dataset.name == "kept")) == str(kept_path)
    assert stored_files(api) == [kept_path.name]


def test_one_users_uploads_together_stay_within_their_quota(make_api):
    """Uploads count against their uploader (the disk is shared): past the quota 409 upload-quota, saying
    how much is stored and how to free it; another user has their own; deleting one frees its share."""
    api = make_api(max_upload_bytes=4096, max_uploaded_bytes_per_user=5000)
    ann, bob = api.user("ann"), api.user("bob")

    def upload(h, name, size):
        return api.client.post(f"/v1/datasets?name={name}&format=text", headers=h, data=b"w " * (size // 2))

    assert upload(ann, "a", 3000).status_code == 201
    body = is_problem(upload(ann, "b", 2002), 409, "upload-quota")
    assert "your uploads take 2.9 KiB and this one 2.0 KiB: together more than the 4.9 KiB" in body["detail"]
    assert (body["stored"], body["size"], body["limit"]) == (3000, 2002, 5000)
    assert "lmscope datasets delete" in body["detail"] and len(stored_files(api)) == 1  # the refused one left nothing
    listed = {d["name"]: d["uploaded_by"] for d in api.client.get("/v1/datasets", headers=bob).get_json()["items"]}
    assert listed["a"] == "ann" and listed["wikitext-2"] is None  # who uploaded what, for everyone to see
    assert api.client.get("/v1/me", headers=ann).get_json()["uploaded_bytes"] == 3000
    assert upload(ann, "b", 2000).status_code == 201  # exactly at the quota
    assert upload(bob, "c", 4000).status_code == 201  # bob's own
    assert api.client.delete("/v1/datasets/a", headers=ann).status_code == 204
    assert upload(ann, "d", 3000).status_code == 201


def test_models_are_listed_by_name_in_pages_and_by_run(api):
    """A team's registry grows by a run's checkpoints at a time: the list pages by name (every model once,
    none skipped), `run` keeps one run's checkpoints (not a longer run name, not `R@stepX`), `source` one kind."""
    h = api.user("ann")
    with api.sessions.begin() as session:
        for name, step in (("r@step0", 0), ("r@step20", 20), ("r@step100", 100), ("r2@step5", 5), ("r@stepx", None)):
            session.add(Model(name=name, source="checkpoint", path="/nonexistent", step=step))
    with api.sessions() as session:
        every = list(session.scalars(select(Model.name).order_by(Model.name)))  # the database's own collation
    seen, token, pages = [], None, 0
    while True:
        page = api.client.get("/v1/models?limit=2" + (f"&page_token={token}" if token else ""), headers=h).get_json()
        assert len(page["items"]) <= 2
        seen += [m["name"] for m in page["items"]]
        pages += 1
        token = page["next_page_token"]
        if not token:
            break
    assert seen == every and pages == -(-len(every) // 2)
    run = api.client.get("/v1/models?run=r", headers=h).get_json()
    assert sorted(m["name"] for m in run["items"]) == ["r@step0", "r@step100", "r@step20"]
    assert run["next_page_token"] is None
    built = api.client.get("/v1/models?source=builtin", headers=h).get_json()["items"]
    assert {m["source"] for m in built} == {"builtin"} and {"tiny-gpt2", "tiny-llama"} <= {m["name"] for m in built}
    is_problem(api.client.get("/v1/models?source=hub", headers=h), 422, "validation-error")
    is_problem(api.client.get("/v1/models?page_token=nonsense", headers=h), 422, "validation-error")


def _racing_store(monkeypatch, api, *rows):
    """registry.store_file that, the first time, commits `rows` right after writing the file: what another
    request does between an upload's first checks and its insert."""
    import lmscope.api.registry as registry

    real, raced = registry.store_file, []

    def store_file(path, data):
        created = real(path, data)
        if not raced:
            raced.append(path)
            with api.sessions.begin() as session:
                for row in rows:
                    session.add(Dataset(**{"source": "upload", "format": "text", "num_documents": 1, "sha256": "0" * 64,
                                           "num_bytes": 1, **row, "path": str(path) if row.get("path") == "SAME" else
                                           row.get("path", "/elsewhere")}))
        return created
    monkeypatch.setattr(registry, "store_file", store_file)
    return raced


def test_an_upload_that_loses_its_name_keeps_a_file_another_name_uploaded_meanwhile(api, monkeypatch):
    """Upload x writes its file; meanwhile x is taken (other bytes) and y is uploaded with the same bytes;
    x's insert fails: the file it wrote is y's now, and stays."""
    ann = api.user("ann")
    raced = _racing_store(monkeypatch, api, {"name": "x"}, {"name": "y", "path": "SAME"})
    is_problem(api.client.post("/v1/datasets?name=x&format=text", headers=ann, data=b"one two three"), 409, "name-taken")
    assert raced and raced[0].read_bytes() == b"one two three"  # y's file


def test_two_uploads_of_one_user_at_once_cannot_both_pass_the_quota(make_api, monkeypatch):
    """The quota is checked again in the insert's transaction, with the user's row locked: an upload of the
    same user that committed after this one's first check counts, and this one leaves no file behind."""
    api = make_api(max_upload_bytes=4096, max_uploaded_bytes_per_user=5000)
    ann = api.user("ann")
    with api.sessions() as session:
        ann_id = session.scalar(select(User.id).where(User.name == "ann"))
    raced = _racing_store(monkeypatch, api, {"name": "first", "num_bytes": 3000, "created_by": ann_id})
    body = is_problem(api.client.post("/v1/datasets?name=second&format=text", headers=ann, data=b"w " * 1500),
                      409, "upload-quota")
    assert (body["stored"], body["size"]) == (3000, 3000)
    assert raced and not raced[0].exists() and stored_files(api) == []


def test_a_page_token_holds_a_model_name(api):
    """A token naming no possible model (a NUL: PostgreSQL refused the query with a 500) is a 422."""
    import base64

    h = api.user("ann")
    for after in ("a\u0000", "x" * 201, " a", 5):
        token = base64.urlsafe_b64encode(json.dumps({"after": after}).encode()).decode().rstrip("=")
        body = is_problem(api.client.get(f"/v1/models?page_token={token}", headers=h), 422, "validation-error")
        assert body["errors"][0]["loc"] == ["query", "page_token"]


def test_the_cli_makes_a_relative_path_that_exists_here_absolute(api, live, tmp_path, monkeypatch):
    """`lmscope models register tiny tiny` in the model's parent directory (the embedded service, a shared
    disk) registers that directory, not ROOT/tiny."""
    from click.testing import CliRunner

    from lmscope.cli import main

    api.user("root", admin=True)
    model_dir = write_hf_dir(tmp_path / "models" / "team" / "tiny")
    monkeypatch.chdir(tmp_path / "models" / "team")
    r = CliRunner(env={"LMSCOPE_URL": live.url, "LMSCOPE_TOKEN": api.tokens["root"]}).invoke(
        main, ["models", "register", "tiny", "tiny"])
    assert r.exit_code == 0, r.output
    [m] = [m for m in api.client.get("/v1/models", headers=api.user("root")).get_json()["items"] if m["name"] == "tiny"]
    assert m["path"] == str(model_dir.resolve())
    # a path the CLI cannot expand is the server's to refuse, with its own message (not a traceback here)
    bad = CliRunner(env={"LMSCOPE_URL": live.url, "LMSCOPE_TOKEN": api.tokens["root"]}).invoke(
        main, ["models", "register", "x", "~nosuchuser-lmscope/x"])
    assert bad.exit_code == 1 and "not a usable path" in bad.output and "Traceback" not in bad.output
