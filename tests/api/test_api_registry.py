"""/v1/models (admins register HF directories under the model roots) and /v1/datasets (uploads)."""

from __future__ import annotations

import hashlib
import io
import json
import struct

from sqlalchemy import select

from lmscope.db.models import Dataset

from .conftest import is_problem

SHAPES = {"transformer.wte.weight": [10, 4], "transformer.h.0.attn.c_attn.weight": [4, 12], "lm_head.bias": [10]}


def write_hf_dir(path, shapes=SHAPES):
    """A minimal Hugging Face GPT-2 directory: config.json + a hand-written .safetensors file."""
    path.mkdir(parents=True)
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
    body = is_problem(api.client.post("/v1/datasets?name=f&format=csv", headers=h, data=b"a", content_type="text/plain"),
                      422, "validation-error")
    assert "jsonl" in body["detail"]
    is_problem(api.client.post("/v1/datasets?name=blank", headers=h, data=b"\n\n \n", content_type="text/plain"),
               422, "invalid-dataset")
    assert stored_files(api) == []


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
