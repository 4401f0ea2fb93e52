"""The launchers' front door, as a user meets it, in real launcher processes: a flag is taken
only as written, `--help` gives each default once, and what parsing cannot see (a path that is
not there, no GPU, a file where the run folder goes) is one line on stderr and exit status 2,
before anything is printed or written and before torch, Ray or transformers load."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from geo3k_grpo.main import parse as parse_grpo
from geo3k_sft.main import parse as parse_sft
from rl_runtime import ConfigError, count_gpus

ROOT = Path(__file__).resolve().parent.parent
APPS = ("geo3k_grpo", "geo3k_sft")
HEAVY = ("torch", "ray", "transformers")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEO3K_", "MILES_", "SLIME_"))}
    return env | extra


def _launch(app: str, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``apps/<app> argv`` as a user runs it, its output captured."""
    return subprocess.run(
        [sys.executable, f"apps/{app}", *argv],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )


# A launcher's __main__ run several times in one process (runpy), then the heavy packages it
# loaded: each case must end at its check, before the run imports them.
IMPORTS = """
import json, runpy, sys
app, cases = sys.argv[1], json.loads(sys.argv[2])
codes = []
for argv in cases:
    sys.argv = [app, *argv]
    try:
        runpy.run_path(app, run_name="__main__")
        codes.append(None)
    except SystemExit as stop:
        codes.append(stop.code)
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray", "transformers"})
print(json.dumps({"codes": codes, "loaded": loaded}))
"""


@pytest.mark.parametrize("app", APPS)
def test_parsing_and_refusing_load_neither_torch_ray_nor_transformers(tmp_path, app):
    """`--help`, a misspelt flag and each check before the run, in the launcher's process."""
    (tmp_path / "a-file").write_text("")
    tiny = ["--preset", "tiny", "--output-dir", str(tmp_path / "run")]
    cases = [
        ["--help"],
        ["--num-roll", "3"],
        [*tiny, "--dataset", str(tmp_path / "no-such-data")],
        [*tiny, "--model-name", str(tmp_path / "no-such-model")],
        [*tiny, "--num-gpus", "1024"],
        ["--preset", "tiny", "--output-dir", str(tmp_path / "a-file")],
    ]
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS, f"apps/{app}", json.dumps(cases)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 2, 2, 2, 2, 2], out.stderr
    assert result["loaded"] == [], result
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("app", "argv", "closest"),
    [
        ("geo3k_grpo", ["--num-roll", "3"], "--num-roll: did you mean --num-rollout?"),
        ("geo3k_grpo", ["--no-colo"], "--no-colo: did you mean --no-colocate"),
        ("geo3k_sft", ["--sft-num-step", "3"], "--sft-num-step: did you mean --sft-num-steps"),
        ("geo3k_sft", ["--trainer.l", "1e-5"], "unrecognized arguments: --trainer.l 1e-5"),
    ],
)
def test_a_shortened_or_misspelt_flag_is_refused_naming_the_closest(app, argv, closest):
    """argparse's abbreviations took `--num-roll 3` as `--num-rollout 3` and started a run."""
    out = _launch(app, *argv)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"{app}: error: unrecognized arguments: ") and closest in line, line


FREE_TEXT = ("model_name", "dataset", "output_dir")  # any text reads; checked before the run


@pytest.mark.parametrize(("app", "parse"), [("geo3k_grpo", parse_grpo), ("geo3k_sft", parse_sft)])
def test_every_variable_with_a_bad_value_names_itself_and_what_it_takes(app, parse):
    """`GEO3K_NUM_GPUS=banana` answered `cannot read 'banana' as int: invalid literal for
    int() with base 10: 'banana'`; an unknown `GEO3K_PRESET` was called `--preset`."""
    aliases = importlib.import_module(f"{app}.config").ENV_ALIASES
    for key, names in aliases.items():
        for name in names:
            if key in FREE_TEXT:
                parse([], env={name: "banana"})
                continue
            with pytest.raises(ConfigError) as err:
                parse([], env={name: "banana"})
            message = str(err.value)
            assert message.startswith(f"environment {name}=banana: "), message
            assert re.search(r"takes (a whole number|1 or 0)|expected one of|known:", message)
            assert "invalid literal" not in message and "cannot read" not in message


def test_a_bad_variable_is_one_line_and_exit_2_before_anything_is_printed():
    out = _launch("geo3k_grpo", "--preset", "tiny", GEO3K_NUM_GPUS="banana")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.strip() == (
        "geo3k_grpo: error: environment GEO3K_NUM_GPUS=banana: GPUs to use (0: CPU run); "
        "takes a whole number >= 0"
    )


def test_an_abbreviation_is_no_flag_in_process():
    with pytest.raises(ConfigError, match=r"--num-roll: did you mean --num-rollout\?"):
        parse_grpo(["--preset", "tiny", "--num-roll", "3"], env={})
    with pytest.raises(ConfigError, match=r"--lr-sched: did you mean --lr-schedule\?"):
        parse_sft(["--preset", "tiny", "--lr-sched", "cosine"], env={})


@pytest.mark.parametrize("app", APPS)
def test_help_gives_each_default_once(app):
    """Help texts that say what unset means ("(default: half of --num-gpus)") were followed by
    argparse's "(default: None)" too."""
    out = subprocess.run(
        [sys.executable, f"apps/{app}", "--help"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=--)", out.stdout)[1:]]
    settings = [e for e in entries if not e.startswith("--print-config")]
    assert len(settings) > 50
    for entry in settings:
        assert entry.count("default:") == 1, entry
    rollout = next(e for e in settings if e.startswith("--cluster.rollout-num-gpus"))
    assert "(default: half of --num-gpus)" in rollout and "None" not in rollout


REFUSALS = {
    "dataset not there": (
        ["--dataset", "{tmp}/no-such-data"],
        {},
        "--dataset / GEO3K_DATASET_NAME: {tmp}/no-such-data: no such file or directory",
    ),
    "dataset folder without data": (
        ["--dataset", "{tmp}/empty"],
        {},
        "--dataset / GEO3K_DATASET_NAME: no file for split 'train' in {tmp}/empty",
    ),
    "model not there": (
        ["--model-name", "{tmp}/no-such-model"],
        {},
        "--model-name: {tmp}/no-such-model: no such file or directory",
    ),
    "load not there": (
        ["--load", "{tmp}/no-such-run"],
        {},
        "--load: {tmp}/no-such-run: no such file or directory",
    ),
    "hub model, offline": (
        ["--model-name", "glimpse-tests/no-such-model"],
        {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "{tmp}/hf-cache"},
        "--model-name: model 'glimpse-tests/no-such-model': HF_HUB_OFFLINE is set",
    ),
    "no GPU for the layout": (["--num-gpus", "1024"], {}, "needs 1024 GPU(s), but "),
    "output folder is a file": (
        ["--output-dir", "{tmp}/a-file"],
        {},
        "--output-dir / GEO3K_OUTPUT_DIR: {tmp}/a-file: a file, not a folder",
    ),
}


@pytest.mark.parametrize("app", APPS)
def test_what_parsing_cannot_see_is_refused_before_anything_is_printed_or_written(tmp_path, app):
    """Each used to come after the 110-line configuration dump (and megatron-core's warnings),
    a bad dataset after `config.json` and the warm-up's folder were written, and a file as
    --output-dir was a FileExistsError traceback, exit 1. Started together: each is quick."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("kept")
    procs = {}
    for name, (argv, env, _) in REFUSALS.items():
        run = tmp_path / "runs" / re.sub(r"\W+", "-", name)
        argv = [a.format(tmp=tmp_path) for a in argv]
        env = {k: v.format(tmp=tmp_path) for k, v in env.items()}
        procs[name] = subprocess.Popen(
            [sys.executable, f"apps/{app}", "--preset", "tiny", "--output-dir", str(run), *argv],
            cwd=ROOT,
            env=_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{app}: error: "), (name, err)
        assert REFUSALS[name][2].format(tmp=tmp_path) in lines[0], (name, lines[0])
        assert out == "" and f"{app} configuration" not in err, name  # no dump
    assert not (tmp_path / "runs").exists()  # no run folder, no config.json, no warm-up
    assert (tmp_path / "a-file").read_text() == "kept"


@pytest.mark.parametrize("app", APPS)
def test_resume_with_nothing_to_resume_is_refused_before_the_config_dump(tmp_path, app):
    """A `--resume` of a folder with metrics but no checkpoint took 8.7 s and printed the
    150-line configuration before its refusal."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    argv = ["--preset", "tiny", "--output-dir", str(tmp_path), "--resume"]
    out = _launch(app, *argv)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"{app}: error: --resume: no complete checkpoint in "), line
    assert "2 rows (up to step 2)" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # nothing written


@pytest.mark.skipif(count_gpus() > 0, reason="this machine has a GPU to read")
@pytest.mark.parametrize("parse", [parse_grpo, parse_sft])
def test_print_config_estimates_for_the_gpu_named(capsys, parse):
    """Without a GPU the layout is estimated for `--gpu-memory-gib`; without either, the
    field says which flag to pass."""
    argv = ["--backend", "fsdp", "--num-gpus", "1", "--model-name", "Qwen3-VL-2B-Instruct"]
    with pytest.raises(SystemExit):
        parse([*argv, "--print-config"], env={})
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["description"] == (
        "not estimated: no GPU is visible to read its memory from: give it with "
        "--gpu-memory-gib N (an H200: 140.4)"
    )
    with pytest.raises(SystemExit):
        parse([*argv, "--print-config", "--gpu-memory-gib", "140.4"], env={})
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["gpu_gib"] == 140.4 and layout["fits"] and layout["total_gib"] > 10
    unknown = ["--model-name", "someone/Some-VL-Model", "--gpu-memory-gib", "140.4"]
    with pytest.raises(SystemExit):
        parse([*argv, *unknown, "--print-config"], env={})
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert "someone/Some-VL-Model is not known without downloading it" in layout["description"]
    assert "--model-name" in layout["description"]


@pytest.mark.gpu
def test_gpus_are_counted_as_torch_counts_them():
    """`count_gpus` asks the CUDA driver without torch; it must agree with torch, and honour
    CUDA_VISIBLE_DEVICES."""
    import torch

    assert count_gpus() == torch.cuda.device_count() > 0
    out = subprocess.run(
        [sys.executable, "-c", "from rl_runtime import count_gpus; print(count_gpus())"],
        env=_env(CUDA_VISIBLE_DEVICES="0"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "1"


def test_sft_help_promises_no_plot_it_does_not_write():
    """`geo3k_sft --output-dir` promised a plot; only GRPO draws `reward.png`."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        parse_sft(["--help"], env={})
    entry = " ".join(text.getvalue().split("--output-dir OUTPUT_DIR", 1)[1].split()[:14])
    assert "plot" not in entry.replace("GRPO: reward.png", ""), entry
