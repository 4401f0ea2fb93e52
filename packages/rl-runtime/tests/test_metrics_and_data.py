"""metrics.jsonl, the plot, the resumable sampler, the preflight messages."""

import json

import pytest

from rl_runtime.data import PromptPrefetch, PromptSampler
from rl_runtime.metrics import RunLogger, read_metrics
from rl_runtime.preflight import PreflightError, check_backend, check_gpus, check_output_dir


def test_metrics_rows_plot_and_resume_truncation(tmp_path):
    logger = RunLogger(tmp_path)
    for step in range(1, 6):
        row = {"step": step, "reward_mean": step / 10, "response_length_mean": 3.0}
        if step % 2 == 0:
            row["eval_accuracy"] = step / 5
        logger.log(row)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    png = logger.plot()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A torn last line (crash mid-write) is ignored; resuming from step 3 drops rows 4 and 5.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')
    resumed = RunLogger(tmp_path, resume_step=3)
    assert [r["step"] for r in resumed.rows()] == [1, 2, 3]
    resumed.log({"step": 4, "reward_mean": float("nan")})
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 4, "reward_mean": None}


class Source:
    """Rows 0..n-1; the rows in `bad` are unusable."""

    def __init__(self, n, bad=()):
        self.n, self.bad, self.skipped, self.malformed_lines = n, set(bad), 0, 0

    def __len__(self):
        return self.n

    def get(self, i):
        if i in self.bad:
            self.skipped += 1
            return None
        return i


def test_sampler_is_deterministic_resumable_and_skips_bad_rows():
    a = PromptSampler(Source(10, bad={3}), seed=7)
    first = [a.next_batch(4) for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_batch(4) for _ in range(3)]  # crosses into the next epochs
    b = PromptSampler(Source(10, bad={3}), seed=7)
    b.load_state_dict(state)
    assert [b.next_batch(4) for _ in range(3)] == rest
    seen = [x for batch in first + rest for x in batch]
    assert 3 not in seen and a.state.skipped >= 1
    assert sorted(seen[:9]) == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # one epoch covers every good row


def test_prefetched_prompts_equal_the_plain_sampler_and_resume_from_before_the_prefetch():
    plain = PromptSampler(Source(10, bad={3}), seed=7)
    expected = [plain.next_batch(4) for _ in range(4)]
    ahead = PromptPrefetch(PromptSampler(Source(10, bad={3}), seed=7), 4)
    got, saved = [], None
    for step in range(4):
        got.append(ahead.take())
        ahead.start()  # the next batch builds while this step "trains"
        ahead.start()  # a second start while one is in flight changes nothing
        if step == 1:
            saved = ahead.state_dict()  # a checkpoint of step 2, the step-3 batch in flight
    ahead.close()
    assert got == expected
    resumed = PromptPrefetch(PromptSampler(Source(10, bad={3}), seed=7), 4)
    resumed.sampler.load_state_dict(saved)
    assert [resumed.take(), resumed.take()] == expected[2:]


def test_a_failed_prefetch_raises_where_the_batch_is_taken():
    ahead = PromptPrefetch(PromptSampler(Source(3, bad={0, 1, 2})), 1)
    ahead.start()
    with pytest.raises(RuntimeError, match="every row"):
        ahead.take()
    ahead.close()


def test_sampler_all_bad_raises():
    with pytest.raises(RuntimeError, match="every row"):
        PromptSampler(Source(3, bad={0, 1, 2})).next_batch(1)


def test_output_dir_must_be_a_folder_or_become_one(tmp_path):
    check_output_dir(tmp_path / "new" / "run")  # made later, with its parents
    (tmp_path / "file").write_text("")
    with pytest.raises(PreflightError, match=r"^--output-dir: .*/file: a file, not a folder$"):
        check_output_dir(tmp_path / "file")
    with pytest.raises(PreflightError, match=r"/file/run: .*/file is a file, not a folder$"):
        check_output_dir(tmp_path / "file" / "run")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing made


def test_preflight_messages():
    check_gpus(0)
    with pytest.raises(PreflightError, match=r"no GPU.*--preset tiny"):
        check_gpus(8, available=0)
    with pytest.raises(PreflightError, match="only 2 GPU"):
        check_gpus(8, available=2)

    class Kernels:  # a trainer config with a GPU-only setting
        def machine_refusal(self, *, use_gpu: bool) -> str | None:
            return None if use_gpu else "--kernels x runs on CUDA only"

    def present() -> type:  # a package whose actor imports
        return object

    def missing() -> type:  # one that lacks its actor (rl-runtime imports no trainer itself)
        raise AttributeError("module 'trainers_x' has no attribute 'NoSuchActor'")

    check_backend("fsdp", Kernels(), present, use_gpu=True)
    with pytest.raises(PreflightError, match=r"--kernels x runs on CUDA only"):
        check_backend("fsdp", Kernels(), present, use_gpu=False)
    with pytest.raises(PreflightError, match=r"NoSuchActor.*--backend fsdp"):
        check_backend("megatron", Kernels(), missing, use_gpu=True)


def test_the_reward_plot_has_a_title_and_a_y_label(tmp_path, monkeypatch):
    """reward.png had neither."""
    from matplotlib.figure import Figure

    from rl_runtime.metrics import plot_metrics

    drawn: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))
    )
    rows = [{"step": 1, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.5, "eval_accuracy": 0.4}]
    assert plot_metrics(rows, tmp_path / "reward.png") == tmp_path / "reward.png"
    (ax,) = drawn[0].axes
    assert "reward" in ax.get_title() and "reward" in ax.get_ylabel()
