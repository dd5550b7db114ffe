"""The arithmetic a run trains in (``--amp auto``): chosen by measuring the run's own model on the machine that
trains, fp32 where bf16 cannot be faster, a given ``--amp`` or ``--channels-last`` kept, and a resumed run's choice
kept.

The decisions run on stand-ins: a CPU whose bf16 support the test sets, and step times the test sets, so that no test
depends on this CPU's instructions or speed. One test runs the real measurement, for its contract alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.data import write_marks
from support.models import tiny_overrides

import capserve.train.amp as amp
from capserve.cli import main
from capserve.configs import ModelConfig, get_config
from capserve.files import CACHE_VARIABLE
from capserve.runtime.precision import Bf16Support
from capserve.train.amp import BF16_MIN_SPEEDUP, CHANNELS_LAST_MIN_SPEEDUP, AmpCandidate, choose, fastest_amp
from capserve.train.config import TrainConfig, read_resume_config
from capserve.train.distributed import Dist
from capserve.train.plan import RESUMED, plan_run

FP32, BF16, BF16_CL = AmpCandidate("off", False), AmpCandidate("bf16", False), AmpCandidate("bf16", True)
CPU = torch.device("cpu")


class StepTimes:
    """Seconds per training step of each candidate, as the test sets them; records what was measured."""

    def __init__(self, fp32: float, bf16: float, bf16_channels_last: float):
        self.seconds = {"fp32": fp32, "bf16": bf16, "bf16 + channels-last": bf16_channels_last}
        self.calls: list[list[AmpCandidate]] = []

    def __call__(self, config, batch_size, device, candidates):  # step_seconds' contract
        assert isinstance(config, ModelConfig) and isinstance(batch_size, int) and batch_size > 0
        assert isinstance(device, torch.device) and candidates
        assert all(isinstance(c, AmpCandidate) for c in candidates) and len(set(candidates)) == len(candidates)
        self.calls.append(list(candidates))
        by_label = {**self.seconds, "fp32 + channels-last": self.seconds["fp32"]}
        return {c: by_label[c.label()] for c in candidates}


def cpu_with_bf16(monkeypatch, native: bool) -> None:
    reason = "x86_64 CPU with amx_bf16" if native else "x86_64 CPU without bf16 instructions"
    monkeypatch.setattr(amp, "native_bf16", lambda: Bf16Support(native, reason))


@pytest.mark.parametrize(
    ("times", "chosen"),
    [
        ((1.0, 0.70, 0.65), BF16_CL),  # bf16 1.43x, channels-last 1.08x more: both
        ((1.0, 0.70, 0.70 / CHANNELS_LAST_MIN_SPEEDUP), BF16_CL),  # channels-last exactly at its bound
        ((1.0, 0.70, 0.70), BF16),  # channels-last no faster: plain bf16
        ((1.0, 1 / BF16_MIN_SPEEDUP, 1.0), BF16),  # bf16 exactly at its bound
        ((1.0, 0.95, 0.95), FP32),  # bf16 5 % faster: noise, fp32
        ((1.0, 1.8, 1.9), FP32),  # emulated bf16: slower
        ((1.0, 1.0, 0.8), BF16_CL),  # plain bf16 no faster, channels-last bf16 1.25x
    ],
)
def test_the_choice_is_the_fastest_beyond_its_margins(times, chosen):
    fp32, bf16, cl = times
    assert choose({FP32: fp32, BF16: bf16, BF16_CL: cl}) == chosen


def test_a_cpu_with_native_bf16_measures_and_trains_at_the_fastest(monkeypatch):
    cpu_with_bf16(monkeypatch, native=True)
    times = StepTimes(0.30, 0.21, 0.19)
    chosen, why = fastest_amp("auto", None, get_config("cifar10-simple"), 32, CPU, measure=times)
    assert chosen == BF16_CL and times.calls == [[FP32, BF16, BF16_CL]]
    assert why.startswith("measured a training step at batch 32 (x86_64 CPU with amx_bf16): fp32 300 ms")


def test_without_native_bf16_nothing_is_measured_and_the_run_trains_in_fp32(monkeypatch):
    cpu_with_bf16(monkeypatch, native=False)
    times = StepTimes(0.30, 0.01, 0.01)  # were it measured, bf16 would win: it must not be
    chosen, why = fastest_amp("auto", None, get_config("cifar10-simple"), 32, CPU, measure=times)
    assert chosen == FP32 and times.calls == [] and why == "no bf16 measured: x86_64 CPU without bf16 instructions"


def test_a_gpu_without_bf16_trains_in_fp32_and_measures_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    times = StepTimes(0.30, 0.01, 0.01)
    chosen, why = fastest_amp("auto", None, get_config("cifar10-simple"), 32, torch.device("cuda"), measure=times)
    assert chosen == FP32 and times.calls == [] and why == "no bf16 measured: Tesla T4 has no bf16 arithmetic"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    chosen, why = fastest_amp("auto", None, get_config("cifar10-simple"), 32, torch.device("cuda"), measure=times)
    assert chosen == BF16 and why.startswith("measured a training step at batch 32 (Tesla T4 computes in bf16)")


def test_a_given_amp_or_memory_format_wins(monkeypatch):
    cpu_with_bf16(monkeypatch, native=True)
    times = StepTimes(0.30, 0.20, 0.10)
    config = get_config("cifar10-simple")
    assert fastest_amp("off", None, config, 32, CPU, measure=times) == (FP32, "given")
    assert fastest_amp("bf16", True, config, 32, CPU, measure=times) == (BF16_CL, "given")
    assert times.calls == []
    chosen, _ = fastest_amp("auto", False, config, 32, CPU, measure=times)  # the format given: only bf16 measured
    assert chosen == BF16 and times.calls == [[FP32, BF16]]


def test_a_machine_measures_once_and_every_later_run_makes_the_same_choice(monkeypatch, tmp_path, caplog):
    """The step times are kept per machine, model shape and batch: a second run there reads them instead of measuring
    (so that a seeded run repeats its choice, whatever the load at its start), and says so; another batch measures
    anew; a damaged cache is measured over; a cache that cannot be written costs a warning, not the run."""
    cpu_with_bf16(monkeypatch, native=True)
    config = get_config("cifar10-simple")
    first = StepTimes(0.30, 0.21, 0.19)
    chosen, why = fastest_amp("auto", None, config, 32, CPU, measure=first)
    assert chosen == BF16_CL and len(first.calls) == 1 and "earlier run" not in why
    again = StepTimes(0.30, 0.60, 0.60)  # a loaded machine would now measure fp32 fastest
    chosen, why = fastest_amp("auto", None, config, 32, CPU, measure=again)
    assert chosen == BF16_CL and again.calls == [] and "fp32 300 ms, bf16 210 ms, bf16 + channels-last 190 ms" in why
    assert why.endswith(f"; measured by an earlier run on this machine ({amp.cache_path()})")
    assert fastest_amp("auto", None, config, 16, CPU, measure=again)[0] == FP32 and len(again.calls) == 1
    amp.cache_path().write_text("{not json")
    assert fastest_amp("auto", None, config, 32, CPU, measure=again)[0] == FP32 and len(again.calls) == 2
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_VARIABLE, str(blocked / "cache"))  # below a file: cannot be made
    with caplog.at_level("WARNING", logger="capserve"):
        assert fastest_amp("auto", None, config, 32, CPU, measure=first)[0] == BF16_CL
    assert "measured again next time" in caplog.text


# ------------------------------------------------------------------------------------------ in a run


@pytest.fixture(scope="module")
def marks(tmp_path_factory):
    """Marks anywhere on noise, 10 a label."""
    return write_marks(tmp_path_factory.mktemp("marks") / "marks", 10, np.random.default_rng(0), placed=True)


def own_config(data, out, **kw) -> TrainConfig:
    base = dict(model="cifar10-conv", overrides=tiny_overrides("cifar10-conv"), epochs=1, device="cpu", test=False)
    return TrainConfig(data=str(data), out=str(out), **{**base, **kw})


def test_a_run_records_its_precision_and_why_and_resume_keeps_it(marks, tmp_path, monkeypatch, caplog):
    """The default run on a bf16 CPU trains in what measured fastest, says so in its log and train_config.json,
    and a resumed run keeps it, whatever a new measurement would say."""
    cpu_with_bf16(monkeypatch, native=True)
    monkeypatch.setattr(amp, "step_seconds", StepTimes(0.30, 0.21, 0.19))
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="capserve"):
        assert main(
            [
                "train",
                "--data",
                str(marks),
                "--out",
                str(out),
                "--epochs",
                "2",
                "--max-steps",
                "1",
                "--no-test",
                "--set",
                "backbone_channels=8",
                "--set",
                "primary_types=4",
            ]
        ) in (0, 1)
    recorded = json.loads((out / "train_config.json").read_text())
    assert (recorded["amp"], recorded["channels_last"]) == ("bf16", True)
    assert recorded["reasons"]["amp"].startswith("measured a training step at batch 27")
    assert "precision: bf16 + channels-last (measured a training step" in caplog.text
    monkeypatch.setattr(amp, "step_seconds", StepTimes(0.30, 0.60, 0.60))  # would now choose fp32
    plan = plan_run(read_resume_config(out), out, Dist(), CPU)
    assert (plan.cfg.amp, plan.cfg.channels_last, plan.reasons["amp"]) == ("bf16", True, RESUMED)


def test_the_real_measurement_times_every_candidate_and_leaves_the_run_untouched():
    """``step_seconds`` on this CPU (bf16 emulated or not: only its contract is checked): a positive time for each
    candidate, and the global random stream as it was (the run's model is built from its seed afterwards)."""
    config = get_config("cifar10-simple", **tiny_overrides("cifar10-simple"))
    state = torch.get_rng_state()
    seconds = amp.step_seconds(config, 4, CPU, [FP32, BF16, BF16_CL])
    assert set(seconds) == {FP32, BF16, BF16_CL} and all(s > 0 for s in seconds.values())
    assert torch.equal(torch.get_rng_state(), state)


def test_a_candidate_far_slower_than_the_fastest_is_measured_no_further(monkeypatch):
    """Emulated bf16 can take ten times fp32's step: one warm-up step of it shows it cannot win, and the measurement
    does not spend further rounds on it."""
    import time as clock

    steps: dict[AmpCandidate, int] = {FP32: 0, BF16: 0, BF16_CL: 0}
    pause = {FP32: 0.002, BF16: 0.02, BF16_CL: 0.0015}

    def step(model, x, candidate, device):
        steps[candidate] += 1
        clock.sleep(pause[candidate])

    monkeypatch.setattr(amp, "_step", step)
    config = get_config("cifar10-simple", **tiny_overrides("cifar10-simple"))
    seconds = amp.step_seconds(config, 2, CPU, [FP32, BF16, BF16_CL])
    full = amp.ROUNDS * (1 + amp.STEPS)
    assert steps == {FP32: full, BF16: 1, BF16_CL: full}
    assert seconds[BF16] >= 0.02 and choose(seconds) == BF16_CL
