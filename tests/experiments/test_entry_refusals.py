"""The entry points' refusals of bad input: one line naming the input, exit status 2, before any work, and
no run directory left behind (``experiments.run``, ``experiments.reproduce``, ``slurm/sim_grid.sbatch``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from tests.builders import REPO, cfg

R = [
    "model=olmoe-1b-7b",
    "cluster.nodes=1",
    "cluster.gpus_per_node=8",
    "trace.num_batches=1",
    "trace.samples_per_batch=16",
    "trace.max_tokens=256",
]
"""A small fast run."""


def _cli(*args: str, module: str = "experiments.run", timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("seed=-1", "seed=-1"),
        ("cluster.nodes=null", "cluster.nodes=null"),
        ("seed=99999999999999999999", "seed="),
    ],
)
def test_a_refused_run_leaves_no_new_run_directory(override, named, tmp_path) -> None:
    line = _one_line(_cli(*R, override, f"hydra.run.dir={tmp_path / 'new' / 'run'}"))
    assert named in line
    assert not (tmp_path / "new").exists()


def test_a_refusal_that_needs_the_inputs_removes_the_new_run_directory(tmp_path, trace_file) -> None:
    # The overlap check of a trace file's workload needs its micro-batches, so it runs once Hydra has made
    # the run directory; the folders it made are removed again, an existing parent is kept.
    proc = _cli(f"trace.path={trace_file}", "model=olmoe-1b-7b", "cluster.nodes=2", "cluster.gpus_per_node=8",
                "cluster.ep_overlap=true", "workload.samples_per_microbatch=8",
                f"hydra.run.dir={tmp_path / 'new' / 'run'}")  # fmt: skip
    assert "cluster.ep_overlap=true needs at least 2 micro-batches" in _one_line(proc)
    assert tmp_path.exists() and not (tmp_path / "new").exists()


def test_a_refusal_keeps_an_existing_run_directory_as_it_was(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.parquet").write_bytes(b"earlier run")
    _one_line(_cli(*R, "seed=-1", f"hydra.run.dir={run_dir}"))
    assert sorted(p.name for p in run_dir.iterdir()) == ["results.parquet"]
    assert (run_dir / "results.parquet").read_bytes() == b"earlier run"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("seed=[", "'seed=['"),
        ("a=b=c", "'a=b=c'"),
        ("seed=1,2", "seed=1,2: a sweep runs only with --multirun"),
    ],
)
def test_an_unparseable_override_is_one_line_exit_2(override, named, tmp_path) -> None:
    line = _one_line(_cli(*R, override, f"hydra.run.dir={tmp_path / 'run'}"))
    assert named in line and not (tmp_path / "run").exists()


def test_reproduce_refuses_an_unparseable_override_in_one_line(tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    assert reproduce(["--results", str(tmp_path / "r"), "--presets", "quick_overhead", "seed=["]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'seed=['" in err and "not a valid override" in err
    assert not (tmp_path / "r").exists()


def test_reproduce_refuses_an_empty_presets_list(tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    for given in ("", ",", " , "):
        assert reproduce(["--results", str(tmp_path / "r"), "--presets", given, "--no-analysis"]) == 2
        err = capsys.readouterr().err
        assert "no preset given" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_reproduce_interrupted_while_checking_its_arguments_is_one_line_exit_130(
    tmp_path, capsys, monkeypatch
) -> None:
    import experiments.config.schema as schema
    from experiments.grid.cli import EXIT_INTERRUPTED
    from experiments.grid.cli import main as reproduce

    def interrupted(*args: object, **kwargs: object) -> list[str]:
        raise KeyboardInterrupt  # Ctrl-C during the schema walk, the first seconds of a run

    monkeypatch.setattr(schema, "override_problems", interrupted)
    assert reproduce(["--results", str(tmp_path / "r"), "--presets", "quick_overhead"]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err
    assert not (tmp_path / "r").exists()


def test_reproduce_refuses_an_experiment_name_override(tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    args = ["--results", str(tmp_path / "r"), "--presets", "quick_overhead", "--no-analysis"]
    assert reproduce([*args, "experiment_name=../../x"]) == 2
    err = capsys.readouterr().err
    assert "experiment_name=../../x: each preset sets its own experiment_name" in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["../../x", "a/b", "", ".hidden", "x y"])
def test_an_experiment_name_that_is_not_a_plain_name_is_refused(name) -> None:
    with pytest.raises(ConfigError, match=r"experiment_name=.*must be a plain name"):
        check_config(cfg(*R, "+experiment=quick_overhead", f"experiment_name='{name}'"))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("logger.project=a/b", "logger.project='a/b': W&B refuses it"),
        ("logger.project=" + "p" * 129, "exceeded 128 characters"),
        ("logger.tags=[" + "t" * 65 + "]", "logger.tags="),
        ("logger.project=''", "logger.project='': give a project name"),
    ],
)
def test_a_logger_setting_wandb_refuses_is_refused_before_any_cell(override, named) -> None:
    with pytest.raises(ConfigError, match="logger") as err:
        check_config(cfg(*R, "logger=wandb", override))
    assert named in str(err.value)


def test_a_key_of_a_group_option_not_chosen_is_one_line_exit_2(tmp_path) -> None:
    line = _one_line(_cli(*R, "logger.project=x", f"hydra.run.dir={tmp_path / 'run'}"))
    assert "logger.project" in line and not (tmp_path / "run").exists()


def test_sim_grid_sbatch_with_an_unknown_preset_is_one_line_exit_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RELIBRA_PYTHON": sys.executable}
    env.pop("SLURM_ARRAY_TASK_ID", None)
    proc = subprocess.run(["bash", str(REPO / "slurm" / "sim_grid.sbatch"), "bogus"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    line = _one_line(proc)
    assert "bogus" in line and "unknown experiment preset" in line


@pytest.fixture
def conf_with_a_malformed_preset(tmp_path, monkeypatch) -> Iterator[Path]:
    """A copy of experiments/conf with one malformed experiment preset, used as the suite's config dir."""
    import shutil

    import experiments.config.presets as grid
    from experiments.config.schema import config_schema

    conf = tmp_path / "conf"
    shutil.copytree(REPO / "experiments" / "conf", conf)
    (conf / "experiment" / "zz_bad.yaml").write_text("experiment_name: zz_bad\n  x: [1,\n")
    monkeypatch.setattr(grid, "CONF_DIR", conf)
    config_schema.cache_clear()
    yield conf / "experiment" / "zz_bad.yaml"
    config_schema.cache_clear()


def test_a_malformed_preset_no_run_uses_breaks_nothing(conf_with_a_malformed_preset, tmp_path) -> None:
    from experiments.config.schema import config_schema, override_problems
    from experiments.grid.cli import _argument_problems
    from experiments.run import preflight

    assert "experiment/zz_bad" in config_schema().broken
    preflight([*R, f"hydra.run.dir={tmp_path / 'run'}"])  # refuses nothing
    check_config(cfg(*R))
    assert _argument_problems(None, ["quick_overhead"], [], ["quick_overhead"], override_problems) == []


def test_a_malformed_preset_a_run_uses_is_one_message_naming_the_file(
    conf_with_a_malformed_preset, tmp_path, capsys
) -> None:
    from experiments.grid.cli import main as reproduce
    from experiments.run import preflight

    bad = str(conf_with_a_malformed_preset)
    with pytest.raises(ConfigError, match="not valid YAML at line 2") as err:
        preflight([*R, "+experiment=zz_bad", f"hydra.run.dir={tmp_path / 'run'}"])
    assert bad in str(err.value)
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        preflight(["-m", *R, "+experiment=zz_bad", "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert bad in str(err.value)
    assert reproduce(["--results", str(tmp_path / "r"), "--presets", "zz_bad", "--no-analysis"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and bad in lines[0] and "--presets zz_bad" in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["5", "abc", "'[8, x]'"])
def test_chunk_layers_that_is_not_a_list_names_the_key_and_the_list_expected(value) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(cfg(*R, f"parallel.chunk_layers={value}"))
    # NOTE: the run spec's type (relibra.parallel.ParallelDims.chunk_layers: tuple[int, ...]) refuses it
    assert "parallel.chunk_layers=" in str(err.value) and "must be a list of integers" in str(err.value)
    assert "not iterable" not in str(err.value)


def test_a_trace_path_that_is_not_a_regular_file_says_so(tmp_path) -> None:
    from relibra.trace.format import TraceFormatError, load_trace

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        with pytest.raises(ConfigError, match=f"trace.path={path}: not a regular file"):
            check_config(cfg(*R, f"trace.path={path}"))
        with pytest.raises(TraceFormatError, match="not a regular file"):
            load_trace(path)  # returns at once: a FIFO without a writer is never opened
    with pytest.raises(ConfigError, match="no such file"):
        check_config(cfg(*R, f"trace.path={tmp_path / 'absent.npz'}"))


def test_an_input_that_cannot_fit_in_memory_is_refused_before_it_is_built(monkeypatch) -> None:
    from relibra.executors import budget

    monkeypatch.setattr(budget, "available_host_bytes", lambda *a: 8 * 2**30)
    huge = cfg(*R[:-2], "trace.samples_per_batch=100000000", "trace.max_tokens=256")
    with pytest.raises(ConfigError) as err:
        check_config(huge)
    text = str(err.value)
    assert "trace.num_batches * trace.samples_per_batch = 1 * 100000000" in text
    assert "need 381.5 GiB, more than the 8.0 GiB this host has available" in text
    check_config(cfg(*R))  # the small run fits
    monkeypatch.setattr(budget, "available_host_bytes", lambda *a: None)
    check_config(huge)  # a host that does not publish MemAvailable: not checked (docs/results_store.md)


def test_a_trace_file_that_cannot_fit_in_memory_is_refused_naming_its_arrays(trace_file, monkeypatch) -> None:
    from relibra.executors import budget
    from relibra.trace.format import TraceFormatError, load_trace

    monkeypatch.setattr(budget, "available_host_bytes", lambda *a: 1000)
    with pytest.raises(TraceFormatError, match=rf"trace file {trace_file}: its arrays need .* GiB.*experts"):
        load_trace(trace_file)
    with pytest.raises(ConfigError, match=rf"trace.path={trace_file}"):
        check_config(
            cfg(f"trace.path={trace_file}", "model=olmoe-1b-7b", "cluster.nodes=2", "cluster.gpus_per_node=8")
        )


def test_ctrl_c_while_a_module_is_still_importing_is_one_line_exit_130() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # sys.argv[0] is "-m" while Python imports the package of `python -m experiments.<module>`
    as_main = "import sys; sys.argv[0] = '-m'; import experiments; raise KeyboardInterrupt"
    proc = subprocess.run([sys.executable, "-c", as_main], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 130 and proc.stderr.strip() == "python -m experiments: interrupted", proc.stderr
    as_library = "import experiments; raise KeyboardInterrupt"  # a library user keeps Python's own hook
    proc = subprocess.run([sys.executable, "-c", as_library], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode != 130 and "Traceback" in proc.stderr


# --- found by a hostile round on the entry points' inputs ---------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trace.path=''"], "trace.path='': empty"),  # an unset shell variable: not the synthetic generator
        (
            ["model.top_k=100"],
            "model.top_k=100: a token picks distinct experts, at most model.num_experts=64",
        ),
    ],
)
def test_a_setting_that_would_run_something_else_is_refused(overrides, named) -> None:
    with pytest.raises(ConfigError, match="bad configuration") as err:
        check_config(cfg(*R, *overrides))
    assert named in str(err.value)


def test_an_empty_run_dir_and_a_dangling_trace_link_are_named(tmp_path) -> None:
    from experiments.run import preflight

    with pytest.raises(ConfigError, match=r"hydra\.run\.dir='': empty"):
        preflight([*R, "hydra.run.dir="])
    (tmp_path / "link.npz").symlink_to(tmp_path / "gone.npz")
    with pytest.raises(ConfigError, match="no such file \\(a symbolic link to nothing"):
        check_config(cfg(*R, f"trace.path={tmp_path / 'link.npz'}"))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--presets", "quick_overhead,quick_overhead"], "--presets names quick_overhead twice"),
        (
            ["--presets", "quick_overhead", "+experiment=quick_overall"],
            "the presets are chosen with --presets",
        ),
        (["--presets", "quick_overhead", "results_dir=/elsewhere"], "choose the results root with --results"),
    ],
)
def test_reproduce_refuses_what_it_would_ignore_or_repeat(args, named, tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    assert reproduce(["--results", str(tmp_path / "r"), "--no-analysis", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err, err
    assert not (tmp_path / "r").exists()


def test_reproduce_argument_errors_are_one_line(tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    for args in (["--workers", "0"], ["--scale", "bogus"]):
        with pytest.raises(SystemExit) as exit_:
            reproduce(["--results", str(tmp_path / "r"), *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and args[0] in err, err


def test_an_option_after_the_overrides_is_one_line(tmp_path) -> None:
    from experiments.run import preflight

    with pytest.raises(ConfigError, match=r"unrecognized arguments seed=0,1: give options \(-m"):
        preflight([*R, "-m", "seed=0,1"])  # Hydra's argparse would print its usage, exit status 2


@pytest.mark.parametrize(
    "mode",
    [
        ["--help"],
        ["--hydra-help"],
        ["--version"],
        ["--cfg", "job"],
        ["-c", "all"],
        ["--info"],
        ["-i", "defaults"],
    ],
)
def test_hydras_help_and_inspection_modes_are_left_to_hydra(mode: list[str]) -> None:
    from experiments.run import preflight

    preflight([*mode, "planner=bogus", "cluster.nodez=2"])  # refuses nothing: Hydra prints, no task runs


def test_a_sweep_outside_multirun_is_refused_and_inside_it_is_not(tmp_path) -> None:
    from experiments.run import preflight

    with pytest.raises(ConfigError, match="seed=0,1: a sweep runs only with --multirun"):
        preflight([*R, "seed=0,1", f"hydra.run.dir={tmp_path / 'run'}"])
    for flag in ("-m", "--multirun"):
        preflight([flag, *R, "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
