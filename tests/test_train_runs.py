"""End-to-end trainer runs on a real corpus (code search over this machine's standard library),
each in fresh processes: one device, 8 CPU devices in two meshes, two processes under
jax.distributed, and a run killed with SIGKILL then resumed. All share one reference: the
one-process, one-device loss trajectory. A persistent compilation cache shared by the
processes keeps the repeated compilations cheap."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import rel_err, suite_xla_flags

import jaxembed
from jaxembed.train.corpus import build_stdlib_corpus

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("train_worker.py")
STEPS = 5
MODULES = ["json", "textwrap", "string", "shlex", "argparse", "fractions", "statistics", "heapq", "bisect", "glob"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("train_runs")
    counts = build_stdlib_corpus(path / "data", modules=MODULES, heldout_fraction=0.2, seed=0, negatives=2)
    assert counts["train_rows"] >= 8 * STEPS, counts
    return path


def write_config(workdir: Path, name: str, **sections) -> Path:
    raw = {
        "model": {"init": str(ROOT / "configs/models/tiny-train-mamba2.yaml"), "tokenizer": "stdlib-bpe:512",
                  "dtype": "float32"},
        "data": {"train": str(workdir / "data/train.jsonl"), "negatives_per_query": 2, "max_tokens": 64},
        "lora": {"rank": 8, "alpha": 16},
        "quantization": "nf4",
        "train": {"batch_size": 8, "grad_cache_size": 4, "learning_rate": 2e-3, "warmup_steps": 2, "seed": 0,
                  "max_steps": STEPS},
        "checkpoint": {"directory": str(workdir / name / "checkpoints"), "every": 2, "keep": 2},
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def env(workdir: Path, devices: int | None = None) -> dict:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(workdir / "jax-cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "PYTHONPATH": str(ROOT)}
    out["XLA_FLAGS"] = suite_xla_flags(devices)
    return out


def worker(workdir, config, *meshes, devices=None, extra=()):
    cmd = [sys.executable, str(WORKER), str(config), "--steps", str(STEPS), *[a for m in meshes for a in ("--mesh", m)],
           *extra]
    return subprocess.Popen(cmd, env=env(workdir, devices), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def result(proc) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(workdir):
    """The loss trajectory of one process on one device."""
    config = write_config(workdir, "reference")
    losses = result(worker(workdir, config, "single", extra=("--export", str(workdir / "reference" / "export"))))[
        "single"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    return config, np.array(losses)


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b) / np.abs(b)))


def test_sharding_invariance_on_8_devices(workdir, reference):
    """A data x fsdp = 4 x 2 mesh over 8 CPU devices: NF4 base, LoRA adapters and AdamW state split
    over fsdp, the batch over both axes, GradCache sub-batches spread over all devices."""
    config, ref = reference
    losses = result(worker(workdir, config, "4x2", devices=8))
    for mesh, got in losses.items():
        assert rel(got, ref) < 1e-5, (mesh, got, ref.tolist())


def test_two_processes_agree_with_one(workdir, reference):
    """Two processes on localhost under jax.distributed (one CPU device each, mesh data=2)."""
    config, ref = reference
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    export = workdir / "two_processes" / "export"
    procs = [worker(workdir, config, "2x1", extra=("--coordinator", f"localhost:{port}", "--num-processes", "2",
                                                   "--process-id", str(i), "--export", str(export))) for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = json.loads(outputs[0][0].strip().splitlines()[-1])["2x1"]
    assert rel(got, ref) < 1e-5, (got, ref.tolist())
    # process 0 exports alone (it waited at orbax's barrier for process 1, which had returned: a deadlock)
    texts = ["Return the sum of a list.", "def total(xs): return sum(xs)"]
    two, one = (jaxembed.load(d).encode(texts) for d in (export, workdir / "reference" / "export"))
    assert rel_err(two, one) < 1e-5, rel_err(two, one)


def test_processes_given_different_runs_are_refused(workdir, reference):
    """Two processes whose configs differ (here the learning rate; the checkpoint paths differ too, which is
    allowed when they name one shared directory) both stop with an error naming the section, before the first
    step: each would have trained its own replica at its own rate (exit 0 and a mixed checkpoint). Two whose
    checkpoint directories are not the same directory stop too (orbax's first save hung)."""
    config, _ = reference
    pairs = {"train;": (config, write_config(workdir, "other_rate", train={"learning_rate": 3e-3})),
             "cannot see what process 0 writes": (config, write_config(workdir, "own_directory"))}
    procs = {}
    for message, configs in pairs.items():
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        procs[message] = [worker(workdir, c, "2x1", extra=("--coordinator", f"localhost:{port}", "--num-processes",
                                                           "2", "--process-id", str(i)))
                          for i, c in enumerate(configs)]
    for message, pair in procs.items():
        for p in pair:
            _, err = p.communicate(timeout=600)
            assert p.returncode != 0
            assert f"process(es) [1] {'differ from process 0 in ' if message == 'train;' else ''}{message}" in err, \
                err[-2000:]
    assert not list((workdir / "reference" / "checkpoints").glob(".jaxembed-shared-*"))  # the marker is removed


def test_sigkill_and_resume_reproduce_the_trajectory(workdir, reference):
    """`jaxembed train` killed with SIGKILL right after step 3 (checkpoints every 2 steps, so it restarts
    from step 2 and redoes step 3), then run again: the logged losses are the uninterrupted ones, bit for bit."""
    _, ref = reference
    config = write_config(workdir, "resume", tensorboard=str(workdir / "resume/tensorboard"))
    cmd = [sys.executable, "-m", "jaxembed.cli", "train", str(config), "--quiet"]
    killed = subprocess.run(cmd, env={**env(workdir), "JAXEMBED_TRAIN_KILL_AFTER_STEP": "3"}, cwd=workdir,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    log = workdir / "resume/metrics.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()[1:]] == [1, 2, 3]
    resumed = subprocess.run(cmd, env=env(workdir), cwd=workdir, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in steps] == ref.tolist()
    # TensorBoard shows the same trajectory: the resumed run's purge hides the killed run's step 3
    losses = tensorboard_scalars(workdir / "resume/tensorboard")["train/loss"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert np.allclose([losses[s] for s in sorted(losses)], ref, rtol=1e-6, atol=0)  # stored as float32


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the event files as TensorBoard reads them: files in name (time) order, and a
    SessionLog START at step s drops the earlier events at steps >= s."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[pos: pos + 8])
            event = Event.FromString(data[pos + 12: pos + 12 + length])
            pos += 16 + length
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars
