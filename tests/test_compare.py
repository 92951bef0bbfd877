"""lmscope.compare: how curves of different jobs are matched and aligned (worked examples)."""

from __future__ import annotations

from lmscope.compare import compare


def _job(job_id, **params):
    return {"id": job_id, "kind": "entropy", "name": None, "status": "succeeded", "params": params, "summary": {}}


def _series(name, labels, x, y):
    return {"name": name, "labels": labels, "x": x, "y": y}


def test_curves_of_two_runs_match_without_their_run_labels():
    """Two single-model entropy jobs label their layer means with their own model and step."""
    c = compare([_job(1, model="a"), _job(2, model="b")],
                [[_series("entropy.layer_mean", {"model": "a", "step": None}, [0, 1], [3.0, 2.0])],
                 [_series("entropy.layer_mean", {"model": "b", "step": None}, [0, 1], [3.5, 2.5])]])
    [curve] = c.curves
    assert curve.labels == {} and curve.aligned([1, 2]) == [(0, [3.0, 3.5]), (1, [2.0, 2.5])]


def test_a_job_with_several_checkpoints_keeps_its_curves_apart():
    steps = [_series("entropy.layer_mean", {"model": f"r@step{s}", "step": s}, [0], [float(s)]) for s in (100, 200)]
    c = compare([_job(1), _job(2)], [steps, [_series("entropy.layer_mean", {"model": "m"}, [0], [7.0])]])
    by_labels = {tuple(sorted(curve.labels.items())): curve.by_job for curve in c.curves}
    assert by_labels[(("step", 100),)] == {1: ([0], [100.0])}  # the step is enough to tell them apart
    assert by_labels[(("step", 200),)] == {1: ([0], [200.0])}
    assert by_labels[()] == {2: ([0], [7.0])}


def test_two_runs_over_checkpoints_match_step_by_step():
    """Two train runs' checkpoints (a@step100, b@step100, ...): matched by step, not by the model's name."""
    def run(prefix, base):
        return [_series("entropy.layer_mean", {"model": f"{prefix}@step{s}", "step": s}, [0], [base + s])
                for s in (100, 200)]

    c = compare([_job(1), _job(2)], [run("a", 0.0), run("b", 1.0)])
    by_step = {curve.labels["step"]: curve.by_job for curve in c.curves}
    assert set(by_step) == {100, 200} and all(curve.labels == {"step": curve.labels["step"]} for curve in c.curves)
    assert by_step[200] == {1: ([0], [200.0]), 2: ([0], [201.0])}


def test_the_same_name_and_labels_twice_in_one_job_keeps_both():
    twice = [_series("loss", {}, [0], [1.0]), _series("loss", {}, [0], [2.0])]
    c = compare([_job(1), _job(2)], [twice, [_series("loss", {}, [0], [5.0])]])
    assert sorted(tuple(curve.by_job[1][1]) for curve in c.curves if 1 in curve.by_job) == [(1.0,), (2.0,)]


def test_numeric_x_is_aligned_by_value_in_ascending_order():
    c = compare([_job(1), _job(2)], [[_series("s", {}, [0, 2], [1.0, 3.0])],
                                     [_series("s", {}, [0.0, 1, 2.0], [4.0, 5.0, 6.0])]])
    assert c.curves[0].aligned([1, 2]) == [(0, [1.0, 4.0]), (1, [None, 5.0]), (2, [3.0, 6.0])]
    words = compare([_job(1), _job(2)], [[_series("s", {}, ["b", "a"], [1, 2])],
                                         [_series("s", {}, ["a"], [3])]])
    assert words.curves[0].aligned([1, 2]) == [("b", [1, None]), ("a", [2, 3])]  # order of appearance
