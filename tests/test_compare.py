"""lmscope.compare: how curves of different jobs are matched and aligned (worked examples)."""

from __future__ import annotations

import pytest

from lmscope.compare import LEGEND_WIDTH, compare, comparison_figure, plot_comparison, plot_formats


def _job(job_id, kind="entropy", summary=None, **params):
    return {"id": job_id, "kind": kind, "name": None, "status": "succeeded", "params": params, "summary": summary or {}}


def _series(name, labels, x, y):
    return {"name": name, "labels": labels, "x": x, "y": y}


def test_curves_of_two_runs_match_without_their_run_labels():
    """Two single-model entropy jobs label their layer means with their own model and step."""
    c = compare([_job(1, model="a"), _job(2, model="b")],
                [[_series("entropy.layer_mean", {"model": "a", "step": None}, [0, 1], [3.0, 2.0])],
                 [_series("entropy.layer_mean", {"model": "b", "step": None}, [0, 1], [3.5, 2.5])]])
    [curve] = c.curves
    assert curve.labels == {} and curve.aligned([1, 2]) == [(0, [3.0, 3.5]), (1, [2.0, 2.5])]


def test_two_sweeps_match_although_a_seed_failed_in_one():
    """A sweep labels each best_val_error curve with how many seeds it averages at each d′."""
    labels = {"architecture": "mlp_sumformer", "token_dim": 2}
    c = compare([_job(1), _job(2)],
                [[_series("best_val_error", {**labels, "seed_count": [2, 2]}, [1, 2], [0.5, 0.25])],
                 [_series("best_val_error", {**labels, "seed_count": [2, 1]}, [1, 2], [0.4, 0.3])]])
    [curve] = c.curves
    assert curve.labels == labels and curve.aligned([1, 2]) == [(1, [0.5, 0.4]), (2, [0.25, 0.3])]


def test_grid_points_that_differ_in_a_labelled_parameter_share_one_curve():
    """Sweep children label val_error with their own grid point: the latent_dim in which they differ
    says which job a curve is, as the job's model does; the labels they share stay."""
    labels = {"architecture": "mlp_sumformer", "token_dim": 2, "features": None}
    c = compare([_job(6, "sumformer_fit", latent_dim=1, token_dim=2), _job(7, "sumformer_fit", latent_dim=4, token_dim=2)],
                [[_series("val_error", {**labels, "latent_dim": 1}, [5, 10], [0.5, 0.4])],
                 [_series("val_error", {**labels, "latent_dim": 4}, [5, 10], [0.3, 0.2])]])
    [curve] = c.curves
    assert curve.labels == labels and curve.aligned([6, 7]) == [(5, [0.5, 0.3]), (10, [0.4, 0.2])]
    # a job whose own curves differ only in that label keeps them apart
    both = [_series("val_error", {"latent_dim": d}, [1], [float(d)]) for d in (1, 4)]
    c = compare([_job(1, latent_dim=1), _job(2, latent_dim=4)], [both, both[:1]])
    assert [cv.labels for cv in c.curves if 1 in cv.by_job] == [{"latent_dim": 1}, {"latent_dim": 4}]
    # a sweep (no latent_dim parameter: its grid has them) against one of its points: matched by latent_dim
    sweep = [_series("val_error", {"latent_dim": d}, [5], [float(d)]) for d in (1, 4)]
    c = compare([_job(1, "sweep", grid={"latent_dim": [1, 4]}), _job(2, "sumformer_fit", latent_dim=4)],
                [sweep, [_series("val_error", {"latent_dim": 4}, [5], [0.1])]])
    assert [(cv.labels, sorted(cv.by_job)) for cv in c.curves] == [({"latent_dim": 1}, [1]), ({"latent_dim": 4}, [1, 2])]


def test_a_null_parameter_is_not_an_absent_one():
    """loss_filter null (keep every sample) is a value; a job of another kind has no such field."""
    from lmscope.compare import job_labels

    jobs = [_job(1, "norms", loss_filter=1.0), _job(2, "norms", loss_filter=None), _job(3, "probe")]
    c = compare(jobs, [[], [], []])
    assert c.params["loss_filter"] == {1: 1.0, 2: None}  # job 3 is left out, not None
    assert [job_labels(c)[j["id"]] for j in c.jobs] == ["job 1 (loss_filter=1.0)", "job 2 (loss_filter=null)",
                                                 "job 3"]  # it has no loss_filter: nothing to say
    same = [_job(1, "norms", loss_filter=None), _job(2, "norms", loss_filter=None)]
    assert "loss_filter" not in compare(same, [[], []]).params  # the same null twice: no difference


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


def test_one_checkpoint_matches_the_same_step_of_a_run_over_checkpoints():
    """`entropy model=run@step200` against `entropy train_job=run`: the run needs its steps apart, and the
    single checkpoint's curve is its step 200's; a plain model (no step) stays a curve of its own."""
    run = [_series("entropy.layer_mean", {"model": f"r@step{s}", "step": s}, [0], [float(s)]) for s in (100, 200)]
    one = [_series("entropy.layer_mean", {"model": "r@step200", "step": 200}, [0], [2.5])]
    plain = [_series("entropy.layer_mean", {"model": "m", "step": 0}, [0], [7.0])]  # entropy's step for a plain model
    c = compare([_job(1, train_job=1), _job(2, model="r@step200"), _job(3, model="m")], [run, one, plain])
    by_labels = {tuple(sorted(curve.labels.items())): curve.by_job for curve in c.curves}
    assert by_labels == {(("step", 100),): {1: ([0], [100.0])},
                         (("step", 200),): {1: ([0], [200.0]), 2: ([0], [2.5])},
                         (): {3: ([0], [7.0])}}
    # a list of plain models is stepped by index: model b (index 0) is not a run's step 0, nor model m
    listed = [_series("entropy.layer_mean", {"model": name, "step": i}, [0], [float(i)]) for i, name in enumerate("ab")]
    c = compare([_job(4, models=["a", "b"]), _job(3, model="m")], [listed, plain])
    assert [sorted(curve.by_job) for curve in c.curves] == [[4], [4], [3]]


def test_a_job_with_one_curve_twice_does_not_make_others_keep_their_run_labels():
    """Two checkpoints of one run compared (each names its step) against a job whose same-named curves
    only its model tells apart: the checkpoints still share their curve."""
    twice = [_series("s", {"model": "x", "step": 0}, [0], [1.0]), _series("s", {"model": "x", "step": 0}, [0], [2.0])]
    c = compare([_job(1, model="r@step300"), _job(2, model="r@step600"), _job(3, model="x")],
                [[_series("s", {"model": "r@step300", "step": 300}, [0], [3.0])],
                 [_series("s", {"model": "r@step600", "step": 600}, [0], [6.0])], twice])
    assert [sorted(curve.by_job) for curve in c.curves][0] == [1, 2]


def test_what_a_norms_run_counted_does_not_keep_its_inner_loss_apart():
    """Two models' loss_filter keeps different numbers of trajectories: still one inner_loss.mean curve."""
    def run(kept, y):
        about = {"kept": kept, "total": 30, "loss_filter": 4.0, "over": "kept", "trajectories": kept}
        return [_series("inner_loss.mean", about, [0, 1], y)]

    c = compare([_job(1, "norms", model="a@step600"), _job(2, "norms", model="a@step300")],
                [run(16, [5.0, 3.0]), run(13, [6.0, 4.0])])
    [curve] = c.curves
    assert curve.labels == {"loss_filter": 4.0, "over": "kept"}
    assert curve.aligned([1, 2]) == [(0, [5.0, 6.0]), (1, [3.0, 4.0])]
    # what a curve averages is no count: one over every finite trajectory is another curve
    everything = [_series("inner_loss.mean", {"kept": 0, "total": 30, "loss_filter": 4.0,
                                              "over": "all finite: none passed loss_filter", "trajectories": 30},
                          [0, 1], [9.0, 8.0])]
    c = compare([_job(1, "norms", model="a@step600"), _job(3, "norms", model="a@step0")], [run(16, [5.0, 3.0]), everything])
    assert len(c.curves) == 2


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


# ---------------------------------------------------------------- the plot (read back from the figure)

def _norms_job(job_id, model, **summary):
    return _job(job_id, "norms", summary, model=model, dataset="wikitext-2")


def _legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_plot_labels_its_axes_and_names_jobs_by_what_differs():
    """x: what x is (norms: the hidden state), y: the series and its unit; the legend names each job by
    the parameter that differs; a label all curves share (unit) is no legend entry."""
    c = compare([_norms_job(3, "tiny-gpt2"), _norms_job(4, "tiny-llama")],
                [[_series("norm.mean", {"unit": "L2 norm"}, [0, 1, 2, 3], [1.0, 1.5, 2.0, 2.2])],
                 [_series("norm.mean", {"unit": "L2 norm"}, [0, 1, 2, 3], [0.5, 0.9, 1.1, 1.4])]])
    fig = comparison_figure(c)
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("hidden state") and ax.get_ylabel() == "L2 norm of the current token's hidden state [norm.mean]"
    assert _legend(ax) == ["job 3 (model=tiny-gpt2)", "job 4 (model=tiny-llama)"]
    assert ax.get_title() == "norm.mean"
    fig.canvas.draw()  # ticks are placed at drawing time: whole numbers only for layer indices
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks == [0, 1, 2, 3]


def test_labels_that_vary_go_in_the_legend_and_shared_ones_in_the_title():
    def series(base):
        return [_series("rel_error", {"method": "performer", "layer": layer}, [4, 8], [base + layer, base])
                for layer in (0, 1)]

    c = compare([_job(1, model="a", seed=0), _job(2, model="b", seed=0)], [series(1.0), series(2.0)])
    ax = comparison_figure(c).axes[0]
    assert _legend(ax) == ["job 1 (model=a)", "job 2 (model=b)", "layer=0", "layer=1"]
    assert ax.get_title() == "rel_error\nmethod=performer"
    assert ax.get_xlabel().startswith("k ") and ax.get_ylabel() == "relative L2 error of the attention output [rel_error]"


def test_two_jobs_over_eight_layers_give_each_line_its_own_colour_and_look():
    """More label sets than jobs: a colour per layer (the same in both jobs), a look per job; all named."""
    def series(base):
        return [_series("rel_error", {"method": "performer", "layer": layer}, [16, 32, 64], [base + layer, base, 1.0])
                for layer in range(8)]

    c = compare([_job(1, model="a"), _job(2, model="b")], [series(0.0), series(100.0)])
    ax = comparison_figure(c, logx=True).axes[0]
    assert _legend(ax) == ["job 1 (model=a)", "job 2 (model=b)", *(f"layer={layer}" for layer in range(8))]
    lines = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in ax.get_lines()]
    assert len(lines) == 16 and len(set(lines)) == 16
    colours = {line.get_ydata()[0]: line.get_color() for line in ax.get_lines()}  # y[0] = base + layer
    assert all(colours[0.0 + layer] == colours[100.0 + layer] for layer in range(8))  # a layer's colour in both jobs
    assert len(set(colours.values())) == 8 and ax.get_xscale() == "log"
    # the legend's look for each job is the one its lines are drawn with
    job_looks = [(h.get_linestyle(), h.get_marker()) for h in ax.get_legend().legend_handles[:2]]
    assert [(ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()[:2]] == job_looks


def test_a_log_x_axis_says_what_it_could_not_draw():
    c = compare([_job(1, model="a"), _job(2, model="b")],
                [[_series("norm.mean", {}, [0, 1, 2], [1.0, 2.0, 3.0]), _series("entropy.mean", {}, [0], [1.0])],
                 [_series("norm.mean", {}, [0, 1, 2], [1.5, 2.5, 3.5]), _series("entropy.mean", {}, [0], [2.0])]])
    norm, entropy = comparison_figure(c, logx=True).axes[:2]
    assert norm.get_xscale() == "log" and norm.get_xlabel().endswith("(log; 2 point(s) at x ≤ 0 not drawn)")
    assert entropy.get_xscale() == "linear" and entropy.get_xlabel() == "training step (linear: no x > 0 for a log axis)"


def test_past_what_a_legend_can_name_the_title_counts_the_curves():
    jobs = [_job(i, model=f"m{i}") for i in range(1, 14)]  # 13 jobs: more than the twelve looks
    c = compare(jobs, [[_series("s", {"layer": layer}, [0], [1.0]) for layer in range(25)] for _ in jobs])
    ax = comparison_figure(c).axes[0]
    assert ax.get_title() == "s\n25 curves by layer" and not any("layer=" in t for t in _legend(ax))


def test_unknown_series_fractional_x_and_long_differences():
    """An unknown series' x is "x"; fractional x keeps fractional ticks; a long difference is cut."""
    long_a, long_b = "a" * 80, "b" * 80
    c = compare([_job(1, note=long_a), _job(2, note=long_b)],
                [[_series("custom", {}, [0.25, 0.5], [1.0, 2.0])], [_series("custom", {}, [0.25, 0.5], [3.0, 1.0])]])
    fig = comparison_figure(c)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "x" and ax.get_ylabel() == "custom"
    first, second = _legend(ax)
    assert first.startswith("job 1 (note=aaa") and first.endswith("…)")
    assert len(first) == len("job 1 ()") + LEGEND_WIDTH and second.startswith("job 2 (note=bbb")
    fig.canvas.draw()
    assert any(not float(t).is_integer() for t in ax.get_xticks())


def test_plot_comparison_writes_the_format_its_extension_names(tmp_path):
    c = compare([_job(1, model="a"), _job(2, model="b")],
                [[_series("loss.val", {}, [0, 10], [3.0, 2.0])], [_series("loss.val", {}, [0, 10], [3.5, 2.5])]])
    assert {"png", "pdf", "svg"} <= set(plot_formats()) and "txt" not in plot_formats()
    assert plot_comparison(c, tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    assert plot_comparison(c, tmp_path / "bare") == tmp_path / "bare.png"  # no extension: a PNG
    assert (tmp_path / "bare.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match=r"\.txt.*png"):
        plot_comparison(c, tmp_path / "c.txt")
    assert not (tmp_path / "c.txt").exists()


def test_labels_a_curve_has_not_are_left_out_of_its_legend():
    from lmscope.compare import labels_text

    assert labels_text({"architecture": "mlp_sumformer", "features": None, "token_dim": 2},
                       ["architecture", "features", "token_dim"]) == "architecture=mlp_sumformer, token_dim=2"
    assert labels_text({"features": 8, "seed": [0, 1]}, ["features", "seed"]) == "features=8, seed=[0,1]"


def test_a_sweep_over_several_targets_matches_a_sweep_over_one_target_by_target():
    """Sweep B runs two targets, sweep A one: `target` differs between the jobs, yet B needs it to tell its
    own curves apart, so A's fig2_poly curve is B's fig2_poly curve; what each sweep counted (seed_count)
    is no part of the match."""
    labels = {"architecture": "mlp_sumformer", "token_dim": 1, "seq_len": 3}
    a = [_series("best_val_error", {**labels, "target": "fig2_poly", "seed_count": [1, 1]}, [1, 2], [0.77, 0.74])]
    b = [_series("best_val_error", {**labels, "target": t, "seed_count": [1, 1]}, [1, 2], y)
         for t, y in (("fig2_poly", [0.77, 0.74]), ("sin_exp", [0.5, 0.4]))]
    c = compare([_job(1, "sweep", target="fig2_poly"), _job(2, "sweep", target=["fig2_poly", "sin_exp"])], [a, b])
    by_target = {curve.labels["target"]: curve for curve in c.curves}
    assert set(by_target) == {"fig2_poly", "sin_exp"}
    assert all("seed_count" not in curve.labels for curve in c.curves)
    assert by_target["fig2_poly"].aligned([1, 2]) == [(1, [0.77, 0.77]), (2, [0.74, 0.74])]
    assert by_target["sin_exp"].aligned([1, 2]) == [(1, [None, 0.5]), (2, [None, 0.4])]


def test_legend_entries_that_cutting_would_make_alike_stay_apart_and_the_panel_keeps_its_width():
    """Label sets alike in their first LEGEND_WIDTH characters (the grid point's features come last) are cut
    wider rather than read the same; a legend beside the panel widens the figure, not squeeze the panel."""
    def series(base):
        return [_series("best_val_error", {"architecture": arch, "token_dim": d, "target": "fig2_poly", "features": f},
                        [1, 2], [base + f, base])
                for arch in ("performer", "linformer") for d in (1, 2) for f in (4, 8)]

    c = compare([_job(1, model="a"), _job(2, model="b")], [series(0.0), series(1.0)])
    fig = comparison_figure(c)
    ax = fig.axes[0]
    curves = _legend(ax)[2:]
    assert len(curves) == 8 and len(set(curves)) == 8 and all(t.endswith(("features=4", "features=8")) for t in curves)
    assert len(max(curves, key=len)) > LEGEND_WIDTH  # they had to be wider
    fig.draw_without_rendering()
    panel, legend = ax.get_window_extent(), ax.get_legend().get_window_extent()
    assert legend.x0 >= panel.x1 and panel.width / fig.dpi > 3.0  # beside it, and the panel still ~4 inches


def test_clip_apart_cuts_to_the_width_where_that_keeps_texts_apart():
    from lmscope.compare import clip_apart

    assert clip_apart(["abcdef", "abxyzq", "q"], 4) == ["abc…", "abx…", "q"]  # apart at 4 already: cut there
    assert clip_apart(["abcdef", "abcxyz", "q"], 4) == ["abcd…", "abcx…", "q"]  # alike at 4: one wider
    assert clip_apart(["abcdef1", "abcdef2"], 4) == ["abcdef1", "abcdef2"]
    assert clip_apart(["same", "same"], 2) == ["s…", "s…"]  # the same text twice is no conflict


def test_a_job_that_needs_a_parameter_label_does_not_split_the_curve_others_share():
    """Sweep 1 runs d′ = 1 and 4 (it needs latent_dim to tell its curves apart), jobs 2 and 3 one d′ each
    (8 and 16): their curves still share one curve, as without job 1 in the comparison; job 1's are its own."""
    labels = {"architecture": "mlp_sumformer"}
    c = compare([_job(1, latent_dim=[1, 4]), _job(2, latent_dim=8), _job(3, latent_dim=16)],
                [[_series("val_error", {**labels, "latent_dim": d}, [5], [float(d)]) for d in (1, 4)],
                 [_series("val_error", {**labels, "latent_dim": 8}, [5], [8.0])],
                 [_series("val_error", {**labels, "latent_dim": 16}, [5], [16.0])]])
    assert [(cv.labels, sorted(cv.by_job)) for cv in c.curves] == [
        ({**labels, "latent_dim": 1}, [1]), ({**labels, "latent_dim": 4}, [1]), (labels, [2, 3])]


def test_close_values_are_drawn_as_they_are_not_as_an_offset():
    """Two layer means 1e-4 nats apart near 3.877: the y ticks read the values themselves, no '+3.877' offset
    in a corner that would make the spread look like a large one."""
    c = compare([_job(1, model="a"), _job(2, model="b")],
                [[_series("entropy.layer_mean", {}, [0, 1], [3.8770, 3.8771])],
                 [_series("entropy.layer_mean", {}, [0, 1], [3.8772, 3.8773])]])
    fig = comparison_figure(c)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.yaxis.get_major_formatter().get_offset() == ""
    labels = [t.get_text().replace("\u2212", "-") for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(3.876 < float(label) < 3.878 for label in labels)


def test_summary_lists_and_objects_are_compared_up_to_a_size():
    """Mean entropy per layer and the lowest head (a list, an object) are compared like numbers; a list too long
    for a table row (a per-position curve put in a summary) is left out."""
    long = [0.5] * 2000
    jobs = [_job(1, summary={"mean_entropy_per_layer": [3.1, 2.2], "lowest_entropy_head": {"layer": 1, "head": 0},
                             "curve": long, "tokens": 512}),
            _job(2, summary={"mean_entropy_per_layer": [3.0, 2.4], "lowest_entropy_head": {"layer": 1, "head": 0},
                             "curve": long, "tokens": 512})]
    c = compare(jobs, [[], []])
    assert c.summary["mean_entropy_per_layer"] == {1: [3.1, 2.2], 2: [3.0, 2.4]}
    assert c.summary["lowest_entropy_head"] == {1: {"layer": 1, "head": 0}, 2: {"layer": 1, "head": 0}}
    assert c.summary["tokens"] == {1: 512, 2: 512} and "curve" not in c.summary


def _series_names_written_by_the_analyses() -> set[str]:
    """Every series name lmscope/analyses passes to Series(...): literal names, and an f-string's text before
    its first field ("entropy." of f"entropy.{key}")."""
    import ast
    from pathlib import Path

    names = set()
    for path in (Path(__file__).parents[1] / "lmscope" / "analyses").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Series" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant):
                    names.add(first.value)
                elif isinstance(first, ast.JoinedStr) and isinstance(first.values[0], ast.Constant):
                    names.add(first.values[0].value + "x")  # a name that starts so
    return names


def test_every_series_the_analyses_write_says_what_its_x_and_y_are():
    """pruning's and operator's curves were drawn and exported with x = "x" (the head index, a share of heads
    or a training step, nowhere said)."""
    from lmscope.compare import x_meaning, y_meaning

    names = _series_names_written_by_the_analyses()
    assert {"input_dependence", "pruned_loss", "head_importance", "entropy.layer_mean", "norm.x"} <= names
    assert not [n for n in sorted(names) if x_meaning(n) == "x"]
    assert not [n for n in sorted(names) if y_meaning(n) == n]
    assert x_meaning("input_dependence") == "head" and x_meaning("input_dependence.layer.over_training") == \
        "training step"
    assert x_meaning("pruned_loss.random_draw") == x_meaning("pruned_loss") == "share of heads removed (k / all units)"


def test_a_single_model_beside_a_runs_checkpoints_names_every_line_and_each_job_by_what_it_sets():
    """An entropy job on one model beside one on a train job's checkpoints: job 3's line had an empty legend
    entry (it has no step), and the jobs read `model=null, train_job=7` against `model=tiny-gpt2,
    train_job=null`."""
    one = _job(3, model="tiny-gpt2", train_job=None)
    run = _job(8, model=None, train_job=7)
    c = compare([one, run],
                [[_series("entropy.layer_mean", {}, [0, 1], [3.0, 2.9])],
                 [_series("entropy.layer_mean", {"step": s}, [0, 1], [3.1 - s / 1000, 3.0]) for s in (0, 300, 600)]])
    fig = comparison_figure(c)
    legend = _legend(fig.axes[0])
    assert legend[:2] == ["job 3 (model=tiny-gpt2)", "job 8 (train_job=7)"]
    assert sorted(legend[2:]) == sorted(["no step", "step=0", "step=300", "step=600"])
    assert all(text.strip() for text in legend)
