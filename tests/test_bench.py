"""`jaxembed bench`: the named specs are valid on both platforms, a tiny sweep runs end to end in
fresh processes (CSV with three timed repeats per point, figure, tables), points over the memory
limit are recorded and the longer ones skipped, and bad specs fail with errors that name the problem."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxembed.bench import sweep as sweeps
from jaxembed.cli import main
from jaxembed.errors import SpecError
from jaxembed.testing import TINY_CONFIGS

TINY_MODELS = {
    "mamba2": TINY_CONFIGS["mamba2"],
    "transformer": dict(architecture="transformer", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                        d_ff=48, sliding_window=100),
}


def write_spec(tmp_path: Path, series: list[dict], lengths=None) -> Path:
    for name, cfg in TINY_MODELS.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    spec = {"name": "tiny", "title": "tiny sweep", "repeats": 3,
            "platforms": {"cpu": {"dtype": "float32", "lengths": lengths or {1: [48, 160], 2: [96]},
                                  "series": series}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("name", ["chunk-size", "vertical-chunk-size", "model-comparison"])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_named_sweeps_are_valid(name, platform):
    sweep = sweeps.load_sweep(name, platform)
    sweeps.check_points(sweep)  # configs load, V is a multiple of Q for every batch
    assert sweep.repeats == 3
    if name == "model-comparison":
        assert set(sweep.lengths) == {1, 32}
        archs = [sweeps.series_config(s).architecture for s in sweep.series]
        assert archs == ["mamba2", "rwkv7", "xlstm", "transformer", "transformer"]
        windows = [sweeps.series_config(s).sliding_window for s in sweep.series[3:]]
        assert windows == [4096, None]  # v0.1: sliding window; v0.3: full attention
        if platform == "gpu":
            assert all(sweeps.series_config(s).d_model == 4096 for s in sweep.series)
            assert max(max(v) for v in sweep.lengths.values()) == 128 * 1024


def test_tiny_sweep_end_to_end(tmp_path):
    spec = write_spec(tmp_path, [
        {"label": "mamba2 V=32", "config": "mamba2.yaml", "vertical_chunk_size": {1: 32, 2: 64}},
        {"label": "transformer", "config": "transformer.yaml"},
    ], lengths={1: [48], 2: [96]})  # every point is a fresh process (~5 s): two per series are enough
    out = tmp_path / "out"
    assert main(["bench", str(spec), "--platform", "cpu", "--output", str(out), "--threads", "1", "--quiet"]) == 0
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [(r["series"], r["batch"], r["length"]) for r in rows] == [
        (s, b, n) for b, n in (("1", "48"), ("2", "96")) for s in ("mamba2 V=32", "transformer")]
    for r in rows:
        assert r["status"] == "ok", r
        times = [float(t) for t in r["times_s"].split()]
        assert len(times) == 3
        assert float(r["min_s"]) == pytest.approx(min(times), abs=1e-5)
        assert float(r["max_s"]) == pytest.approx(max(times), abs=1e-5)
        assert float(r["mean_s"]) == pytest.approx(statistics.fmean(times), abs=1e-5)
        assert float(r["memory_mib"]) == float(r["peak_rss_mib"]) > 100  # a fresh process's own peak
        assert float(r["run_peak_rss_mib"]) <= float(r["peak_rss_mib"])
        expected_v = {"1": "32", "2": "64"}[r["batch"]] if r["series"].startswith("mamba2") else ""
        assert r["vertical_chunk_size"] == expected_v
    readme = (out / "README.md").read_text()
    assert "batch 2, runtime" in readme and "Machine:" in readme and "tiny.png" in readme
    # a rerun into the folder is refused before any point runs (a rerun cut short, or a narrowed one, left a new
    # results.csv beside the earlier README and figure)
    assert main(["bench", str(spec), "--platform", "cpu", "--output", str(out), "--batch", "1", "--quiet"]) == 2
    assert len(list(csv.DictReader((out / "results.csv").read_text().splitlines()))) == 4
    from matplotlib.image import imread

    image = imread(out / "tiny.png")
    assert image.shape[1] > 1000 and np.std(image) > 0.05  # two batch columns, drawn


def test_points_over_the_memory_limit_are_recorded_and_longer_ones_skipped(tmp_path):
    spec = write_spec(tmp_path, [{"label": "transformer", "config": "transformer.yaml"}], lengths={1: [48, 96, 160]})
    out = tmp_path / "out"
    assert main(["bench", str(spec), "--platform", "cpu", "--output", str(out), "--memory-limit-mib", "60",
                 "--quiet"]) == 1  # nothing was measured
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [r["status"] for r in rows] == ["out of memory", "skipped", "skipped"]
    assert "RSS > 60 MiB" in rows[0]["error"] and rows[1]["error"] == "after out of memory at 48"
    assert rows[0]["memory_mib"] == "" and float(rows[0]["peak_rss_mib"]) > 60  # no measured memory, the RSS seen
    assert "OOM" in (out / "README.md").read_text()


def test_bad_specs_name_the_problem(tmp_path, capsys):
    def error(*args, platform="cpu"):
        assert main(["bench", *args, "--platform", platform, "--output", str(tmp_path / "o")]) == 2
        return capsys.readouterr().err

    msg = error("nope")
    assert "no sweep named 'nope'" in msg and "model-comparison" in msg
    msg = error(str(write_spec(tmp_path, [{"label": "m", "config": "mamba2.yaml", "vertical_chunk_size": 40}])))
    assert "series 'm', batch 1" in msg and "not a multiple of the chunk size Q=16" in msg
    assert "absent.yaml does not exist" in error(str(write_spec(tmp_path, [{"label": "m", "config": "absent.yaml"}])))
    spec = str(write_spec(tmp_path, [{"label": "m", "config": "mamba2.yaml", "vertical_chunk_size": {1: 32}}]))
    assert "no entry for batch 2" in error(spec)
    assert "no settings for platform 'gpu'" in error(spec, platform="gpu")
    assert "--series 'x' is not one of the spec's series ['m']" in error(spec, "--series", "x")
    # options that could not measure anything: named before any point runs
    good = str(write_spec(tmp_path, [{"label": "m", "config": "mamba2.yaml"}]))
    for option, value, why in (("--repeats", "0", "--repeats must be at least 1, got 0"),
                               ("--threads", "-1", "--threads must be at least 1, got -1"),
                               ("--timeout", "0", "--timeout must be positive, got 0"),
                               ("--memory-limit-mib", "0", "--memory-limit-mib must be positive"),
                               ("--lengths", "0,-5", "every length must be a positive number of tokens")):
        assert why in error(good, option, value), option
    assert "--platform gpu: jax sees no GPU here" in error("chunk-size", platform="gpu")  # the spec has gpu points
    for key, value, why in (("repeats", 0, "repeats must be a positive int, got 0"),
                            ("dtype", "float16x", "dtype must be float32 or bfloat16, got 'float16x'"),
                            ("lengths", {1: [0]}, "every length must be a positive number of tokens")):
        spec = write_spec(tmp_path, [{"label": "m", "config": "mamba2.yaml"}])
        raw = yaml.safe_load(spec.read_text())
        (raw if key == "repeats" else raw["platforms"]["cpu"])[key] = value
        spec.write_text(yaml.safe_dump(raw))
        assert why in error(str(spec)), key
    assert not (tmp_path / "o").exists()  # nothing ran


def test_series_labels_with_commas_can_be_chosen():
    """The bundled model-comparison spec names "Mamba2 (Codestral, scaled)": --series splits on commas, so a
    label that holds one could not be chosen."""
    from jaxembed.bench import split_labels

    labels = [s.label for s in sweeps.load_sweep("model-comparison", "cpu").series]
    wanted = ["Mamba2 (Codestral, scaled)", "Mistral v0.1 (window 4096, scaled)"]
    assert set(wanted) <= set(labels)
    assert split_labels(",".join(wanted), labels) == wanted
    assert split_labels(f" {wanted[1]} ", labels) == wanted[1:]
    with pytest.raises(SpecError, match=r"--series 'Mamba2 \(Codestral' is not one of"):
        split_labels("Mamba2 (Codestral", labels)


def test_gpu_rows_report_the_device_allocator_peak():
    """On a GPU the memory column is the allocator's peak_bytes_in_use, and the machine line names
    the device (the GPU worker itself needs a GPU; its result is shaped here as the worker reports it)."""
    result = {"status": "ok", "device": "NVIDIA H100 80GB HBM3", "env": {"threads": None}, "times_s": [1.0, 1.2, 1.1],
              "mean_s": 1.1, "min_s": 1.0, "max_s": 1.2, "peak_device_mib": 15000.5, "peak_rss_mib": 4000.0}
    row = sweeps._row_from_result(result, batch=1, length=4096, platform="gpu")
    assert row["memory_mib"] == 15000.5 and row["memory_kind"] == "device peak_bytes_in_use"
    assert row["tokens_per_s"] == pytest.approx(4096 / 1.1, rel=1e-4)
    assert sweeps.machine_line([row], "gpu").startswith("NVIDIA H100 80GB HBM3; jax ")


def test_gpu_points_are_limited_by_the_device_not_a_fixed_host_cap(monkeypatch):
    """A CPU point's RSS is its measure (capped at 16 GiB); a GPU point's host RSS only guards the
    machine (90% of what is available, no fixed cap): the device allocator decides out of memory."""
    from jaxembed.bench import measure

    monkeypatch.setattr(measure, "available_memory_mib", lambda: 120_000.0)
    assert measure.default_memory_limit_mib("cpu") == 16384.0
    assert measure.default_memory_limit_mib("gpu") == pytest.approx(108_000.0)


def test_device_params_have_the_family_shapes_and_keep_decays_float32():
    """The benchmark weights are drawn on the device: the family's shapes less the LM head, the asked
    dtype, decay parameters float32, one drawn layer repeated over the stack."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxembed import models
    from jaxembed.bench.worker import device_params
    from jaxembed.config import config_from_dict

    cfg = dataclasses.replace(config_from_dict(TINY_MODELS["mamba2"]), n_layers=3, tie_embeddings=False)
    params = device_params(cfg, "bfloat16", seed=0, device=jax.devices()[0])
    shapes = models.family(cfg).param_shapes(cfg)
    assert shapes.pop("lm_head")  # untied, but an embedder never reads it: not on the device
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    assert {jax.tree_util.keystr(k): v.shape for k, v in flat} == {
        jax.tree_util.keystr(k): tuple(v) for k, v in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda x: isinstance(x, tuple))[0]}
    layers = params["layers"]
    assert layers["xbcdt_proj"].dtype == jnp.bfloat16 and params["embedding"].dtype == jnp.bfloat16
    assert all(layers[k].dtype == jnp.float32 for k in ("A_log", "dt_bias", "D"))
    assert float(jnp.std(layers["xbcdt_proj"][0].astype(jnp.float32))) > 0
    assert bool(jnp.all(layers["xbcdt_proj"][0] == layers["xbcdt_proj"][2]))
