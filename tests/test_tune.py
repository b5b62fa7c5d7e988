"""`scaletrain tune`: the proxy narrowed to model.mup_base_dim, the choice of rate, and the command
end to end (a diverged rate, resuming, refusing another config, the config it writes)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import ROOT, run_cli
from scaletrain.config import ConfigError, load_config
from scaletrain.tune import best_rate, proxy_data

TINY = ROOT / "configs" / "tiny.toml"


def test_the_proxy_is_the_model_narrowed_to_the_base_width_with_heads_as_wide():
    cfg = load_config(TINY, ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=704",
                             "model.mup_base_dim=64", "parallel.tp=2", "log.plan=x.plan.json"])
    proxy = proxy_data(cfg)
    assert {k: proxy["model"][k] for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "mup_base_dim", "n_layers")} \
        == {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 176, "mup_base_dim": 64, "n_layers": 2}
    assert proxy["parallel"] == {} and "plan" not in proxy["log"]  # one process, not the wide run's plan
    assert proxy["train"] == cfg.train.model_dump(exclude_none=True)  # batch, steps, schedule: the run's
    # Depth-wise muP: the proxy is as shallow as mup_base_layers too (and only that, alone).
    deep = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=8", "model.n_layers=8", "model.mup_base_layers=2"]
    proxy = proxy_data(load_config(TINY, [*deep, "model.mup_base_dim=64"]))["model"]
    assert (proxy["dim"], proxy["n_heads"], proxy["n_layers"], proxy["mup_base_layers"]) == (64, 2, 2, 2)
    proxy = proxy_data(load_config(TINY, deep))["model"]
    assert (proxy["dim"], proxy["n_heads"], proxy["n_layers"]) == (256, 8, 2)
    # Local and global blocks: the proxy's attend as the model's first ones.
    local_global = [*deep, "model.sliding_window=16", "model.full_attention_layers=[1, 3, 5, 7]"]
    assert proxy_data(load_config(TINY, local_global))["model"]["full_attention_layers"] == [1]
    for overrides, words in [
            (["model.dim=128"], "set model.mup_base_dim to the width to tune at .*, model.mup_base_layers"),
            ([*deep, "model.sliding_window=16", "model.full_attention_layers=[3, 7]"],
             r"leaves the proxy none of the blocks model.full_attention_layers = \[3, 7\] take out of the window; "
             "use more than 3 base layers"),
            ([*deep, "model.moe_experts=4", "model.moe_dense_layers=2"],
             "leaves the proxy only the model.moe_dense_layers = 2 dense blocks"),
            (["model.dim=128", "model.mup_base_dim=24"], "not a multiple of the head width dim / n_heads = 32"),
            (["model.dim=256", "model.n_heads=8", "model.n_kv_heads=2", "model.mup_base_dim=64"],
             "2 heads, which do not share key/value heads 4 to one"),
            (["model.mup_base_dim=128"],
             "model.mup_base_dim = 128: a proxy of width 128 and 2 blocks, not smaller than the model"),
            (["model.mup_base_dim=64"], "model.mup_base_dim = 64: a proxy of width 64 and 2 blocks, not smaller")]:
        with pytest.raises(ConfigError, match=words):
            proxy_data(load_config(TINY, overrides))


def test_the_best_rate_its_parabola_and_the_grids_edges():
    def rows(losses):
        return [{"lr": 2.0 ** -k, "val_loss": loss, "diverged": loss is None} for k, loss in zip(range(10, 5, -1), losses)]

    # A parabola in log2(lr) with its vertex at 2^-7.6: 2^-8 is the best of the grid.
    quadratic = [4 + 0.1 * (x + 7.6) ** 2 for x in range(-10, -5)]
    chosen = best_rate(rows(quadratic))
    assert chosen["best_lr"] == 2.0 ** -8 and chosen["edge"] is None
    assert math.log2(chosen["fitted_lr"]) == pytest.approx(-7.6)
    assert best_rate(rows([5.0, 4.9, 4.8, 4.7, None])) == {"best_lr": 2.0 ** -7, "fitted_lr": None, "edge": None}
    assert best_rate(rows([4.0, 4.1, 4.2, 4.3, 4.4]))["edge"] == "smallest"
    assert best_rate(rows([None] * 5))["best_lr"] is None


def test_tune_trains_each_rate_once_resumes_and_writes_the_tuned_config(stdlib_data, tmp_path):
    out, written = tmp_path / "tune", tmp_path / "tuned.toml"
    args = ["tune", str(TINY), f"data.path={stdlib_data}", "model.dim=128", "model.n_heads=8", "model.n_kv_heads=4",
            "model.mup_base_dim=64", "train.warmup_steps=1", "train.batch_ramp=[[256, 512]]", "--steps", "3",
            "--lrs", "0.003,0.03,1e38", "--out", str(out), "--write-config", str(written)]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    doc = json.loads((out / "tune.json").read_text())
    by_lr = {row["lr"]: row for row in doc["results"]}
    assert by_lr[1e38]["diverged"] and by_lr[1e38]["val_loss"] is None  # its weights overflowed
    assert doc["best_lr"] == min((0.003, 0.03), key=lambda lr: by_lr[lr]["val_loss"])
    for lr in (0.003, 0.03):  # each proxy a run of width 64 at its rate, whose last evaluation is the loss
        proxy = load_config(out / f"lr_{lr:g}" / "config.toml")
        assert (proxy.model.dim, proxy.model.n_heads, proxy.train.lr, proxy.train.steps) == (64, 4, lr, 3)
        evals = [json.loads(line) for line in (out / f"lr_{lr:g}" / "metrics.jsonl").read_text().splitlines()
                 if '"kind": "eval"' in line]
        assert by_lr[lr]["val_loss"] == evals[-1]["loss"]
    tuned = load_config(written)
    assert (tuned.model.dim, tuned.model.mup_base_dim, tuned.train.lr) == (128, 64, doc["best_lr"])
    # Two rates of one run name would train one proxy and report its loss for both: refused, nothing written.
    alike = run_cli(*args[:args.index("--lrs") + 1], "0.003,0.0030000001", "--out", str(tmp_path / "alike"))
    assert alike.returncode == 2 and "--lrs 0.003 and 0.0030000001 are one run, lr_0.003" in alike.stderr
    assert not (tmp_path / "alike").exists()
    assert tuned.run.name == "tuned"  # (its own run, named after the file, not the tuned config's)
    assert tuned.train.steps == load_config(TINY).train.steps  # the run's length, not the proxies'
    assert tuned.train.batch_ramp == [(256, 512)]
    assert "diverged" in first.stdout and "← best" in first.stdout

    again = run_cli(*args, "--concurrency", "2")  # nothing left to train
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "tune.json").read_text()) == doc
    assert "3/3" in again.stderr and (out / "results.csv").read_text().count("\n") == 4  # (a header, 3 rates)
    wider = run_cli(*[a.replace("0.003,0.03,1e38", "0.003,0.01,0.03,0.1,1e38") for a in args], "--concurrency", "2")
    assert wider.returncode == 0, wider.stderr  # the two new rates, in two worker processes
    widened = json.loads((out / "tune.json").read_text())
    assert [row["lr"] for row in widened["results"]] == [0.003, 0.01, 0.03, 0.1, 1e38]
    assert {row["lr"]: row for row in widened["results"]}[0.03] == by_lr[0.03]  # kept, not trained again
    for lr in (0.01, 0.1):
        assert load_config(out / f"lr_{lr:g}" / "config.toml").train.lr == lr
    other = run_cli(*[a.replace("train.warmup_steps=1", "train.min_lr_ratio=0.5") for a in args])
    assert other.returncode != 0 and "holds a tuning of another config" in other.stderr
    assert "3/3" not in other.stderr  # (refused before its progress bar is drawn)
    shutil.copytree(out, tmp_path / "copied")  # a tuning moved or copied is the same tuning: nothing to train
    copied = run_cli(*[str(tmp_path / "copied") if a == str(out) else a for a in args[:-2]])
    assert copied.returncode == 0 and "3/3" in copied.stderr, copied.stderr
    assert (tmp_path / "copied" / "results.csv").read_text() == (out / "results.csv").read_text()
    refused = run_cli("tune", str(TINY), f"data.path={stdlib_data}", "--out", str(tmp_path / "x"))
    assert refused.returncode != 0 and "set model.mup_base_dim" in refused.stderr
    no_data = run_cli(*[a.replace(f"data.path={stdlib_data}", f"data.path={tmp_path / 'nowhere'}") for a in args[:-4]],
                      "--out", str(tmp_path / "y"))
    assert no_data.returncode == 2 and "does not exist; create it with `scaletrain data prepare`" in no_data.stderr
    assert not (tmp_path / "y").exists()  # (refused before tune.json is written)


def test_a_shorter_proxy_keeps_the_runs_schedule_its_warmup_scaled(stdlib_data, tmp_path):
    """--steps trains a shorter run of the same schedule: its warmup the same share of its steps
    (a proxy as long as the run's warmup would only ever warm up), none where the run has none."""
    from scaletrain.tune import Tune

    for warmup, steps, proxy_warmup in ((8, 5, 2), (8, 40, 16), (1, 3, 1), (0, 5, 0)):
        cfg = load_config(TINY, [f"data.path={stdlib_data}", "model.mup_base_dim=32", f"train.warmup_steps={warmup}"])
        proxy = Tune(cfg, tmp_path / "tune", steps=steps).settings.proxy["train"]
        assert (proxy["steps"], proxy["warmup_steps"]) == (steps, proxy_warmup), (warmup, steps)
    assert not (tmp_path / "tune").exists()  # (nothing written before it trains)
