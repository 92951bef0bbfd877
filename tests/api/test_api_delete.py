"""DELETE /v1/jobs/{id}: an ended job goes with its series, artifacts and files; what is still needed stays."""

from __future__ import annotations

from sqlalchemy import func, select

from lmscope.db.models import Artifact, Job, Series

from tests.api.conftest import add_checkpoint, add_results, is_problem, small_sweep


def rows_of(api, table, job_ids: list[int]) -> int:
    with api.sessions() as session:
        return session.scalar(select(func.count()).select_from(table).where(table.job_id.in_(job_ids)))


def test_an_ended_job_goes_with_its_results_and_files_and_its_id_is_never_given_again(api):
    ann, bob = api.user("ann"), api.user("bob")
    kept = api.submit(ann).get_json()["id"]
    api.set_job(kept, status="succeeded")
    add_results(api, kept, {"a.png": b"keep"})
    r = api.client.post("/v1/jobs", json={"kind": "probe", "params": {"model": "m"}},
                        headers={**ann, "Idempotency-Key": "probe-1"})
    job = r.get_json()["id"]
    api.set_job(job, status="failed")
    files = {"norms.png": b"\x89PNG" + bytes(100), "checkpoints/step0/model.safetensors": bytes(5000)}
    add_results(api, job, files)

    stored = api.client.get("/v1/me", headers=ann).get_json()["job_file_bytes"]
    assert stored == len(b"keep") + sum(map(len, files.values()))
    is_problem(api.client.delete(f"/v1/jobs/{job}", headers=bob), 404, "not-found")  # not bob's to see
    r = api.client.delete(f"/v1/jobs/{job}", headers=ann)
    assert r.status_code == 200, r.get_json()
    assert r.get_json() == {"id": job, "deleted": [job], "freed_bytes": sum(map(len, files.values()))}
    assert not api.settings.job_dir(job).exists()
    assert rows_of(api, Series, [job]) == 0 and rows_of(api, Artifact, [job]) == 0
    assert rows_of(api, Series, [kept]) == 3 and (api.settings.job_dir(kept) / "a.png").read_bytes() == b"keep"
    assert api.client.get("/v1/me", headers=ann).get_json()["job_file_bytes"] == len(b"keep")

    for method, path in (("get", ""), ("get", "/results"), ("get", "/artifacts"), ("get", "/artifacts/norms.png"),
                         ("get", "/events"), ("post", "/cancel"), ("delete", "")):
        body = is_problem(getattr(api.client, method)(f"/v1/jobs/{job}{path}", headers=ann), 410, "job-deleted")
        assert body["detail"].startswith(f"job {job} (probe) was deleted on ") and body["deleted_at"]
    is_problem(api.client.get(f"/v1/jobs/{job}", headers=bob), 404, "not-found")  # still nothing to bob
    is_problem(api.client.get(f"/v1/compare?jobs={kept},{job}", headers=ann), 410, "job-deleted")
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=ann).get_json()["items"]] == [kept]
    assert 'lmscope_jobs{kind="probe",status="failed"} 0' in api.client.get("/metrics").get_data(as_text=True)

    # The newest job was deleted: SQLite would give its id to the next row if the row went.
    r = api.client.post("/v1/jobs", json={"kind": "probe", "params": {"model": "m"}},
                        headers={**ann, "Idempotency-Key": "probe-1"})
    assert r.status_code == 202  # the key went with the job: a new job, not a replay of the deleted one
    assert r.get_json()["id"] > job


def test_an_admin_deletes_anyones_job(api):
    ann, root = api.user("ann"), api.user("root", admin=True)
    job = api.submit(ann).get_json()["id"]
    api.set_job(job, status="cancelled")
    assert api.client.delete(f"/v1/jobs/{job}", headers=root).get_json()["deleted"] == [job]
    is_problem(api.client.get(f"/v1/jobs/{job}", headers=ann), 410, "job-deleted")


def test_a_job_still_needed_is_kept_saying_what_to_do(api):
    ann = api.user("ann")
    job = api.submit(ann).get_json()["id"]
    add_results(api, job, {"partial.npz": b"x" * 10})
    for status in ("queued", "running"):
        api.set_job(job, status=status)
        body = is_problem(api.client.delete(f"/v1/jobs/{job}", headers=ann), 409, "job-active")
        assert f"job {job} is {status}" in body["detail"] and f"lmscope cancel {job}" in body["detail"]
    assert (api.settings.job_dir(job) / "partial.npz").exists() and rows_of(api, Series, [job]) == 3

    sweep = api.submit(ann, kind="sweep", params=small_sweep(2)).get_json()["id"]
    points = [j.id for j in api.jobs(parent_id=sweep)]
    assert len(points) == 2
    api.set_job(sweep, status="failed")
    api.set_job(points[0], status="succeeded")
    body = is_problem(api.client.delete(f"/v1/jobs/{sweep}", headers=ann), 409, "job-active")
    assert f"grid points {points[1]} of sweep {sweep} have not ended" in body["detail"]
    body = is_problem(api.client.delete(f"/v1/jobs/{points[0]}", headers=ann), 409, "job-in-sweep")
    assert f"grid point of sweep {sweep}" in body["detail"] and f"lmscope delete {sweep}" in body["detail"]

    run = api.submit(ann, kind="train", params={"dataset": "d", "run_name": "blip"}).get_json()["id"]
    api.set_job(run, status="succeeded")
    for step in (0, 5):
        add_checkpoint(api, f"blip@step{step}", run)
    body = is_problem(api.client.delete(f"/v1/jobs/{run}", headers=ann), 409, "job-has-models")
    assert "blip@step0, blip@step5" in body["detail"] and "`lmscope models delete --run blip`" in body["detail"]
    assert body["models"] == ["blip@step0", "blip@step5"]
    assert api.client.get(f"/v1/jobs/{run}", headers=ann).status_code == 200
    for name in ("blip@step0", "blip@step5"):
        assert api.client.delete(f"/v1/models/{name}", headers=ann).status_code == 204
    assert api.client.delete(f"/v1/jobs/{run}", headers=ann).status_code == 200
    body = is_problem(api.submit(ann, kind="entropy", params={"train_job": run, "dataset": "d"}), 422,
                      "unknown-reference")
    assert f"train job {run} was deleted" in body["detail"]


def test_a_sweep_goes_with_its_grid_points(api):
    ann = api.user("ann")
    sweep = api.submit(ann, kind="sweep", params=small_sweep(3)).get_json()["id"]
    points = [j.id for j in api.jobs(parent_id=sweep)]
    sizes = {}
    for i, job_id in enumerate([sweep, *points]):
        api.set_job(job_id, status="cancelled" if i == 2 else "succeeded")
        add_results(api, job_id, {"training.png": bytes(10 + i)})
        sizes[job_id] = 10 + i
    r = api.client.delete(f"/v1/jobs/{sweep}", headers=ann)
    assert r.status_code == 200, r.get_json()
    assert r.get_json() == {"id": sweep, "deleted": [sweep, *points], "freed_bytes": sum(sizes.values())}
    assert rows_of(api, Series, [sweep, *points]) == 0 and rows_of(api, Artifact, [sweep, *points]) == 0
    for job_id in points:
        is_problem(api.client.get(f"/v1/jobs/{job_id}", headers=ann), 410, "job-deleted")
        assert not api.settings.job_dir(job_id).exists()
    assert api.client.get(f"/v1/jobs?parent={sweep}", headers=ann).get_json()["items"] == []


def test_of_deletes_at_once_one_deletes_and_the_others_answer_410(api):
    """Four DELETEs of one job in four threads (each its own request and database session): the job is deleted
    once, its files counted once, and every other answer says it was deleted."""
    import threading

    ann = api.user("ann")
    job = api.submit(ann).get_json()["id"]
    api.set_job(job, status="succeeded")
    add_results(api, job, {"plot.png": bytes(700)})
    start, answers = threading.Barrier(4), []

    def delete_once():
        client = api.client.application.test_client()
        start.wait()
        r = client.delete(f"/v1/jobs/{job}", headers=ann)
        answers.append((r.status_code, r.get_json()))

    threads = [threading.Thread(target=delete_once) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = sorted(code for code, _ in answers)
    assert codes == [200, 410, 410, 410], answers
    assert next(body for code, body in answers if code == 200) == {"id": job, "deleted": [job], "freed_bytes": 700}
    assert all(body["type"].endswith("job-deleted") for code, body in answers if code == 410)
    assert rows_of(api, Series, [job]) == 0 and not api.settings.job_dir(job).exists()


def test_files_a_delete_could_not_remove_go_when_the_api_next_starts(api, make_api, monkeypatch):
    import shutil

    ann = api.user("ann")
    gone, other = (api.submit(ann).get_json()["id"] for _ in range(2))
    for job_id in (gone, other):
        api.set_job(job_id, status="succeeded")
        add_results(api, job_id, {"a.npz": b"abc"})

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", refuse)
        r = api.client.delete(f"/v1/jobs/{gone}", headers=ann)
    assert r.status_code == 200  # deleted: only the files wait
    assert (api.settings.job_dir(gone) / "a.npz").exists()
    is_problem(api.client.get(f"/v1/jobs/{gone}", headers=ann), 410, "job-deleted")
    make_api()  # the next start
    assert not api.settings.job_dir(gone).exists()
    assert (api.settings.job_dir(other) / "a.npz").read_bytes() == b"abc"
    with api.sessions() as session:
        assert session.get(Job, other).deleted_at is None
