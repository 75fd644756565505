"""The search space: config keys as ``--set`` names them, checked by the keys' own rules, one line per mistake."""

from __future__ import annotations

import pytest

pytest.importorskip("optuna")

import torchrig  # noqa: E402
from torchrig.recipes.run import build_config  # noqa: E402
from torchrig.tune import TuneError, load_space  # noqa: E402


@pytest.fixture(scope="module")
def cfg():
    return build_config()  # the digits job


def test_kinds_become_optuna_distributions(cfg, tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("optim.lr: {log_uniform: [1e-5, 1e-1]}\n"       # 1e-5 without a dot: YAML text, read as a number
                    "optim:\n  weight_decay: {uniform: [0.0, 0.01], step: 0.005}\n"   # nested keys read as dotted
                    "data.batch_size: {choice: [32, 64]}\n"
                    "model.options.width: {int: [16, 64], step: 16}\n"
                    "optim.betas: {choice: [[0.9, 0.999], [0.8, 0.99]]}\n")
    space = load_space(path, cfg)
    assert space.keys == ["optim.lr", "optim.weight_decay", "data.batch_size", "model.options.width", "optim.betas"]
    d = space.distributions()
    assert (d["optim.lr"].low, d["optim.lr"].high, d["optim.lr"].log) == (1e-5, 0.1, True)
    assert d["optim.weight_decay"].step == 0.005 and d["model.options.width"].step == 16
    assert space.params[3].grid() == [16, 32, 48, 64] and space.params[1].grid() == [0.0, 0.005, 0.01]
    applied = space.apply(cfg, {"optim.lr": 0.01, "data.batch_size": 64, "model.options.width": 32,
                                "optim.betas": d["optim.betas"].choices[1]})
    assert (applied.optim.lr, applied.data.batch_size, applied.model.options) == (0.01, 64, {"width": 32})
    assert tuple(applied.optim.betas) == (0.8, 0.99)  # a list choice travels as JSON text and comes back
    assert cfg.optim.lr == 3e-3  # the base config is left as it was


@pytest.mark.parametrize("space, message", [
    ({"optim.lrr": {"log_uniform": [1e-5, 1e-1]}}, "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ({"optimizer.lr": {"uniform": [0.1, 0.2]}}, "unknown config section 'optimizer'"),
    ({"optim.momentum": {"uniform": [0.5, 1.0]}}, "config key 'optim.momentum': expected a number in [0, 1), got 1.0"),
    ({"data.batch_size": {"int": [0, 64]}}, "config key 'data.batch_size': expected an integer >= 1, got 0"),
    ({"precision": {"choice": ["fp32", "fp64"]}}, "config key 'precision': expected one of fp32, bf16, fp16, got 'fp64'"),
    ({"optim.lr": {"log_uniform": [0.0, 0.1]}}, "key 'optim.lr': log_uniform needs low > 0"),
    ({"optim.lr": {"uniform": [0.1, 0.01]}}, "key 'optim.lr': uniform [0.1, 0.01] needs low < high"),
    ({"optim.lr": {"loguniform": [1e-5, 0.1]}}, "unknown kind 'loguniform'; did you mean 'log_uniform'?"),
    ({"optim.lr": [1e-5, 0.1]}, "key 'optim.lr': expected one of uniform, log_uniform, int, log_int, choice"),
    ({"data.batch_size": {"int": [16, 64.5]}}, "key 'data.batch_size': expected an integer, got 64.5"),
    ({"run_dir": {"choice": ["a", "b"]}}, "key 'run_dir' is set by torchrig tune for each trial"),
    ({"loss": {"choice": ["cross_entropy", "pkg.payload:loss"]}}, "key 'loss': the choice 'pkg.payload:loss' names "
                                                                  "code of yours (MODULE:NAME)"),
    ({"metrics": {"choice": [["accuracy"], ["pkg.payload:Metric"]]}}, "key 'metrics': the choice "
                                                                      "['pkg.payload:Metric'] names code of yours"),
    ({"model.options.widht": {"int": [16, 64]}}, "'model.options.widht': model 'digits_cnn' does not accept options"),
])
def test_a_bad_space_is_one_line_naming_the_key(cfg, tmp_path, space, message):
    with pytest.raises(TuneError) as info:
        torchrig.tune(cfg, space, 2, study_dir=tmp_path / "study")
    text = str(info.value)
    assert message in text and "\n" not in text
    assert not (tmp_path / "study" / "study.json").exists()  # nothing was started


def test_the_grid_sampler_needs_a_finite_space(cfg, tmp_path):
    with pytest.raises(TuneError, match=r"the grid sampler needs a finite set of values.*use \{choice"):
        torchrig.tune(cfg, {"optim.lr": {"log_uniform": [1e-5, 0.1]}}, 2, sampler="grid", study_dir=tmp_path / "s")


def test_a_space_file_that_is_not_yaml_is_named(cfg, tmp_path):
    bad = tmp_path / "space.yaml"
    bad.write_text("optim.lr: {log_uniform: [1e-5\n")
    with pytest.raises(TuneError, match=r"search space file '.*space.yaml' is not valid YAML at line"):
        load_space(bad, cfg)


@pytest.mark.parametrize("spec, points", [
    ({"data.batch_size": {"int": [1, 2_000_000]}}, "2000000"),
    ({"optim.weight_decay": {"uniform": [0.0, 1.0], "step": 1e-6}, "data.batch_size": {"choice": [32, 64]}}, "2000002"),
], ids=["int", "steps"])
def test_a_grid_is_counted_before_it_is_built(cfg, tmp_path, spec, points):
    """A grid over the 10,000-point limit is refused from its count alone: no list as long as the range."""
    import tracemalloc

    space = load_space(spec, cfg)
    tracemalloc.start()
    try:
        with pytest.raises(TuneError) as info:
            space.grid()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == (f"search space: the grid has {points} points (more than 10000); narrow it or use "
                               f"--sampler tpe / random")
    assert peak < 1 << 20  # bytes; listing the range first took over 50 MiB
    with pytest.raises(TuneError, match=f"the grid has {points} points"):
        torchrig.tune(cfg, spec, 2, sampler="grid", study_dir=tmp_path / "s")
    assert not (tmp_path / "s" / "study.json").exists()
