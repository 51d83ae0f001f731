"""The byte-level LM task of issue 42 (examples/lm, examples/train_lm.py): the corpus and its split,
the model's size and causality, and short runs of every mode on 2 gloo workers."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import math
import os
import re
import shutil
import sys
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

from examples.lm import corpus as C
from examples.lm import loop as L
from examples.lm import model as M
from tests.dist_harness import run_workers, torchrun

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")


@pytest.fixture(scope="module")
def stdlib() -> C.Corpus:
    return C.load_corpus()


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: Any) -> str:
    """A few real files: the standard library's json and email packages (~0.4 MB)."""
    d = tmp_path_factory.mktemp("corpus")
    src = C.stdlib_root()
    for pkg in ("json", "email"):
        shutil.copytree(os.path.join(src, pkg), os.path.join(d, pkg), ignore=shutil.ignore_patterns("__pycache__"))
    return str(d)


# -- corpus -----------------------------------------------------------------------------------------


def test_stdlib_split_is_disjoint_complete_and_by_path_hash(stdlib: C.Corpus) -> None:
    train, val = set(stdlib.train_files), set(stdlib.val_files)
    assert train and val and not train & val
    assert list(stdlib.train_files) == sorted(train) and list(stdlib.val_files) == sorted(val)
    # the reference: the first 8 bytes of SHA-256(path) below 5% of 2**64, nothing else
    for rel in train | val:
        h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
        assert (rel in val) == (h < 0.05 * 2 ** 64), rel
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.07
    assert not any("site-packages" in f or "__pycache__" in f for f in train | val)


def test_stdlib_bytes_are_the_files_bytes(stdlib: C.Corpus) -> None:
    root = C.stdlib_root()
    sizes = {f: os.path.getsize(os.path.join(root, f)) for f in stdlib.train_files + stdlib.val_files}
    assert stdlib.train.dtype == torch.uint8
    assert stdlib.train.numel() == sum(sizes[f] for f in stdlib.train_files)
    assert stdlib.val.numel() == sum(sizes[f] for f in stdlib.val_files)
    with open(os.path.join(root, stdlib.val_files[0]), "rb") as f:
        first = f.read()
    assert bytes(stdlib.val[:len(first)].tolist()) == first
    # a listed file is left out only when it is empty or not UTF-8
    for f in set(C.list_files(root, ".py")) - set(sizes):
        assert f in stdlib.skipped or os.path.getsize(os.path.join(root, f)) == 0, f
    for f in stdlib.skipped:
        with open(os.path.join(root, f), "rb") as fh, pytest.raises(UnicodeDecodeError):
            fh.read().decode("utf-8")


def test_the_split_of_a_file_does_not_depend_on_the_others(stdlib: C.Corpus) -> None:
    files = sorted(stdlib.train_files + stdlib.val_files)
    half = files[::2]
    _, val = C.split_files(half)
    assert set(val) == set(stdlib.val_files) & set(half)


def test_load_is_deterministic_and_the_hash_tells_lists_apart(small_dir: str, tmp_path: Any) -> None:
    a, b = C.load_corpus(small_dir), C.load_corpus(small_dir)
    assert a.list_hash == b.list_hash and torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.val_files, "a directory of several files always holds one out"
    with open(os.path.join(small_dir, "json", "extra.txt"), "w") as f:
        f.write("one more file\n")
    try:
        assert C.load_corpus(small_dir).list_hash != a.list_hash
    finally:
        os.remove(os.path.join(small_dir, "json", "extra.txt"))
    # a file that is not UTF-8 is skipped and named; a single file holds out its last 5%
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "ok.txt").write_bytes(b"hello world\n" * 100)
    (tmp_path / "ok2.txt").write_bytes(b"bye\n" * 100)
    c = C.load_corpus(str(tmp_path))
    assert c.skipped == ("latin1.txt",) and c.n_bytes == 1600
    one = C.load_corpus(str(tmp_path / "ok.txt"))
    assert one.val.numel() == 60 and bytes(one.train.tolist()) + bytes(one.val.tolist()) == b"hello world\n" * 100
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        C.load_corpus(str(tmp_path / "no-such-dir"))


def test_batches_are_fixed_per_seed_rank_world_step_and_stay_in_the_rank_shard() -> None:
    world, shard = 4, 1000
    train = (torch.arange(world * shard) // shard).to(torch.uint8)  # every byte names its shard
    x, y = C.train_batch(train, 7, 2, world, 5, 8, 16, split="shard")
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for r in range(world):
        xr, yr = C.train_batch(train, 7, r, world, 5, 8, 16, split="shard")
        assert (xr == r).all() and (yr == r).all()
    x2, _ = C.train_batch(train, 7, 2, world, 5, 8, 16, split="shard")
    assert torch.equal(x, x2)
    text = torch.randint(0, 256, (world * shard,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    batches = {(s, st): C.train_batch(text, s, 1, world, st, 8, 16, split="shard")[0] for s in (0, 1) for st in (0, 1)}
    assert len({tuple(b.flatten().tolist()) for b in batches.values()}) == 4
    with pytest.raises(ValueError, match="fewer than context"):
        C.train_batch(text[:40], 0, 0, world, 0, 8, 16, split="shard")
    with pytest.raises(ValueError, match="split must be one of"):
        C.train_batch(text, 0, 0, world, 0, 8, 16, split="random")


def test_shuffled_batches_draw_the_global_batch_from_the_whole_text() -> None:
    """The default split, as DistributedSampler: one global batch per step from the whole text, each
    rank its slice -- the same global batch whatever the number of workers, every shard reached by
    every rank."""
    world, shard = 4, 1000
    train = (torch.arange(world * shard) // shard).to(torch.uint8)
    glob = torch.cat([C.train_batch(train, 7, r, world, 5, 8, 16)[0] for r in range(world)])
    two = torch.cat([C.train_batch(train, 7, r, 2, 5, 16, 16)[0] for r in range(2)])
    one = C.train_batch(train, 7, 0, 1, 5, 32, 16)[0]
    assert torch.equal(glob, two) and torch.equal(glob, one)
    seen = {int(v) for r in range(world) for st in range(20) for v in C.train_batch(train, 0, r, world, st, 8, 16)[0][:, 0]}
    assert seen == set(range(world))  # (every rank's windows come from anywhere in the text)
    assert not torch.equal(C.train_batch(train, 7, 0, world, 5, 8, 16)[0], C.train_batch(train, 7, 0, world, 6, 8, 16)[0])


def test_validation_slice_is_fixed_and_spans_the_held_out_bytes() -> None:
    val = torch.arange(1000).to(torch.uint8)
    w = C.val_windows(val, 16, 5)
    assert w.shape == (5, 17)
    assert w[0, 0] == 0 and w[-1, -1] == (999 % 256)
    assert torch.equal(w, C.val_windows(val, 16, 5))


# -- model --------------------------------------------------------------------------------------


def _reference_count(d: int, layers: int, context: int, vocab: int = 256) -> int:
    """By hand: per block LayerNorm 2d, qkv 3d^2+3d, out d^2+d, LayerNorm 2d, MLP 4d^2+4d + 4d^2+d;
    token and position embeddings, the final LayerNorm, an untied head without bias."""
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return layers * block + vocab * d + context * d + 2 * d + vocab * d


@pytest.mark.parametrize("name,low,high", [("small", 0.9e6, 1.2e6), ("wide", 8e6, 10e6)])
def test_parameter_counts_of_the_presets(name: str, low: float, high: float) -> None:
    cfg = M.PRESETS[name]
    n = M.count_parameters(M.ByteTransformer(cfg))
    assert n == _reference_count(cfg.d_model, cfg.n_layers, cfg.context)
    assert low <= n <= high


def test_a_later_byte_never_changes_earlier_logits() -> None:
    torch.manual_seed(0)
    net = M.ByteTransformer(M.preset("small", context=32)).eval()
    x = torch.randint(0, 256, (2, 32))
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = net(x), net(x2)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert (a[:, 20:] - b[:, 20:]).abs().amax() > 1e-4


def test_attention_matches_an_explicitly_masked_softmax() -> None:
    torch.manual_seed(1)
    attn = M.CausalSelfAttention(32, 4)
    x = torch.randn(2, 10, 32)
    q, k, v = attn.qkv(x).split(32, dim=-1)
    heads = lambda t: t.view(2, 10, 4, 8).transpose(1, 2)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.proj((F.softmax(scores, -1) @ heads(v)).transpose(1, 2).reshape(2, 10, 32))
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)


def test_bad_presets_and_specs_name_the_value() -> None:
    with pytest.raises(ValueError, match="'huge'.*small, wide"):
        M.preset("huge")
    with pytest.raises(ValueError, match="multiple of n_heads"):
        M.preset("small", d_model=130)
    with pytest.raises(ValueError, match="'adam'"):
        L.RunSpec(mode="adam").check(2)
    with pytest.raises(ValueError, match="multiple of the number of workers"):
        L.RunSpec(global_batch=6).check(4)
    with pytest.raises(ValueError, match="mode 'ddp' takes neither"):
        L.RunSpec(mode="ddp", compression="int8").check(2)
    with pytest.raises(ValueError, match="local_steps=4 is decentpy's"):
        L.RunSpec(mode="ddp", local_steps=4).check(2)
    L.RunSpec(mode="decentpy", compression="int8", local_steps=4).check(2)  # a compressed gossip outer step
    with pytest.raises(ValueError, match="give local_steps >= 2"):
        L.RunSpec(mode="torchft-diloco").check(2)
    with pytest.raises(ValueError, match="fragments=4 .* stream decentpy's local steps"):
        L.RunSpec(mode="decentpy", fragments=4).check(2)
    with pytest.raises(ValueError, match="state_avg_every must be an int >= 0"):
        L.RunSpec(state_avg_every=-1).check(2)
    with pytest.raises(ValueError, match="give mode 'decentpy'"):
        L.RunSpec(mode="ddp", state_avg_every=4).check(2)
    with pytest.raises(ValueError, match="state_avg must be one of"):
        L.RunSpec(state_avg="exp_avg").check(2)
    with pytest.raises(ValueError, match="outer_rule must be one of 'diloco', 'noloco'"):
        L.RunSpec(mode="decentpy", local_steps=4, outer_rule="sparse").check(2)
    with pytest.raises(ValueError, match="outer_rule='noloco' is decentpy's local steps"):
        L.RunSpec(mode="decentpy", outer_rule="noloco").check(2)
    assert L.outer_settings(L.RunSpec(mode="decentpy", local_steps=4, outer_rule="noloco")) == L.NOLOCO_OUTER


def test_schedule_evaluates_at_least_eight_times_and_spends_the_budget() -> None:
    s = L.schedule(L.RunSpec(preset="small", tokens=1_000_000, evals=8))
    assert s.steps == 1_000_000 // (32 * 128) and s.eval_steps[0] == 0 and s.eval_steps[-1] == s.steps
    assert len(s.eval_steps) == 9 and 1 <= s.warmup < s.steps


@pytest.mark.parametrize("argv,message", [
    (["--mode", "ddp", "--topology", "ring"], "--topology is for --mode decentpy or decent-dp"),
    (["--mode", "decent-dp", "--compression", "int8"], "--mode decent-dp takes neither"),
    (["--tokens", "2x"], "'2x' is not a count"),
    (["--evals", "0"], "--evals must be >= 1, got 0"),
    (["--budget-s", "0"], "--budget-s must be a finite number of seconds > 0, got 0.0"),
])
def test_the_command_line_refuses_what_a_mode_cannot_do(argv: Any, message: str, capsys: Any) -> None:
    import examples.train_lm as T

    with pytest.raises(SystemExit):
        T.parse_args(argv)
    assert message in capsys.readouterr().err
    assert T.parse_args(["--tokens", "2M"]).tokens == 2_000_000 and T.parse_args([]).topology == "ring"


def test_help_says_each_default_once_and_how_to_launch(capsys: Any) -> None:
    import examples.train_lm as T

    with pytest.raises(SystemExit):
        T.parse_args(["--help"])
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    assert "(default: None)" not in text and "launch (after make train" in text
    assert "torchft 0.2.0's own DiLoCo" in flat  # (the mode's help)
    assert ".venv/bin/torchrun --standalone" in text and "--local-steps 32" in text
    for option in ("--topology", "--warmup-steps", "--lr"):  # help that says its default, once
        block = text.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
        assert block.lower().count("default") == 1, block


def test_the_progress_bar_is_for_a_terminal_on_rank_0(monkeypatch: Any) -> None:
    import examples.train_lm as T

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert T._progress_bar(10, 0) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert T._progress_bar(10, 1) is None
    bar = T._progress_bar(10, 0)
    assert bar is not None and bar.total == 10
    bar.close()


def test_tensorboard_missing_is_one_clear_message(monkeypatch: Any) -> None:
    import examples.train_lm as T

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit, match="pip install tensorboard"):
        T._tensorboard_writer("runs/x", 0)
    assert T._tensorboard_writer(None, 0) is None


# -- runs ---------------------------------------------------------------------------------------

TINY = ["--context", "32", "--global-batch", "8", "--val-windows", "16", "--lr", "3e-3"]


def _summary(stdout: str) -> Dict[str, str]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("final ")]
    assert len(lines) == 1, stdout
    return dict(kv.split("=", 1) for kv in lines[0].split()[1:])


def test_train_lm_on_two_workers_lowers_the_held_out_loss(small_dir: str, tmp_path: Any) -> None:
    have_tb = importlib.util.find_spec("tensorboard") is not None
    tb = ["--tensorboard", str(tmp_path / "tb")] if have_tb else []
    proc = torchrun(SCRIPT, 2, {}, timeout=150, args=["--corpus", small_dir, "--tokens", "7680", "--evals", "2",
                                                        "--topology", "ring", *TINY, *tb])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = _summary(proc.stdout)
    assert s["mode"] == "decentpy" and s["topology"] == "ring" and s["workers"] == "2" and s["tokens"] == "7680"
    assert float(s["val_bits_per_byte"]) < float(s["initial"]) - 1.0, proc.stdout
    corpus = C.load_corpus(small_dir)
    assert s["corpus_bytes"] == str(corpus.n_bytes) and s["corpus_hash"] == corpus.list_hash
    assert f"file-list hash {corpus.list_hash}" in proc.stdout
    assert len(re.findall(r"^step +\d+/30 .* val \d", proc.stdout, re.M)) == 3, proc.stdout
    assert int(s["bytes_sent_per_worker"]) > 0
    if tb:
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def _every_mode(rank: int, world: int, small_dir: str) -> Dict[str, Any]:
    from tests.dist_harness import run_example_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the example's CLI in this worker's process group: torch DDP
        cli_rows = run_example_main("train_lm.py", ["--mode", "ddp", "--corpus", small_dir, "--tokens", "7680",
                                                    "--evals", "2", *TINY])
    budget_out = io.StringIO()
    with contextlib.redirect_stdout(budget_out):  # the race from the command line: a probe sizes the tokens
        budget_rows = run_example_main("train_lm.py", ["--mode", "decentpy", "--topology", "complete", "--corpus",
                                                       small_dir, "--budget-s", "2", "--evals", "1",
                                                       "--local-steps", "2", *TINY])
    corpus = C.load_corpus(small_dir)
    runs = []
    for mode, kw in (("ddp-powersgd", {}), ("decentpy", {"compression": "int8", "topology": "complete"}),
                     ("decent-dp", {"topology": "ring"}), ("decentpy", {"topology": "complete", "local_steps": 4})):
        spec = L.RunSpec(mode=mode, tokens=2048, evals=2, val_windows=16, context=32, global_batch=8, lr=3e-3, **kw)
        runs.append(L.run_arm(spec, corpus))
    return {"stdout": out.getvalue(), "cli_rows": cli_rows, "runs": runs, "budget_rows": budget_rows,
            "budget_stdout": budget_out.getvalue()}


def test_every_mode_trains_from_the_same_model_and_reports_its_rows(small_dir: str) -> None:
    ranks = run_workers(_every_mode, 2, small_dir, timeout=180)
    assert ranks[0]["runs"] == ranks[1]["runs"], "every rank returns the same rows"
    s = _summary(ranks[0]["stdout"])
    assert s["mode"] == "ddp" and s["topology"] == "allreduce"
    assert float(s["val_bits_per_byte"]) < float(s["initial"]) - 1.0, ranks[0]["stdout"]
    cli = ranks[0]["cli_rows"]
    assert all(r["consensus_distance"] < 1e-6 for r in cli), "DDP's replicas stay equal"
    runs = ranks[0]["runs"]
    first = [r[0]["val_bits_per_byte"] for r in runs] + [cli[0]["val_bits_per_byte"]]
    assert max(first) - min(first) < 1e-9, first  # same seed, same initial model, same slice
    assert abs(first[0] - 8.0) < 0.2  # N(0, 0.02) weights: close to uniform over 256 bytes
    for rows in runs:
        assert [r["step"] for r in rows] == [0, 4, 8] and rows[-1]["tokens"] == 2048
        assert list(rows[-1]) == list(L.COLUMNS)
        assert rows[-1]["bytes_sent_per_worker"] > 0 and rows[-1]["wall_s"] > 0
        assert rows[-1]["val_bits_per_byte"] < rows[0]["val_bits_per_byte"] - 0.5, rows
    lrs = [[r["lr"] for r in rows[1:]] for rows in runs]  # decent-dp has no optimizer before its 2nd step
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-12) and lrs[0] == pytest.approx(lrs[2], rel=1e-12), lrs
    params = runs[0][0]["params"]
    # decent-dp sends every parameter to its one ring peer in each of its 8 all-reduces (steps 1..8)
    assert runs[2][-1]["bytes_sent_per_worker"] == 8 * params * 4
    # PowerSGD's two plain steps send the gradients, its 6 compressed steps less
    assert 2 * params * 4 < runs[0][-1]["bytes_sent_per_worker"] < 4 * params * 4
    assert runs[1][-1]["compression"] == "int8" and runs[1][-1]["intra_node"] == "gossip"
    # DiLoCo (local_steps=4, complete, 2 workers): 2 outer steps in 8, each sends the pseudo-gradient once
    assert runs[3][-1]["local_steps"] == 4 and runs[0][-1]["local_steps"] == 1 and runs[3][-1]["fragments"] == 1
    assert params * 4 * 2 <= runs[3][-1]["bytes_sent_per_worker"] <= params * 4 * 2 * 1.05, (runs[3][-1], params)
    assert runs[0][-1]["topology"] == "allreduce" and runs[0][-1]["intra_node"] is None
    # --budget-s: the tokens of the probed speed for 2 s, whole steps, recorded with the budget
    budget = ranks[0]["budget_rows"]
    per_step = budget[-1]["tokens"] // budget[-1]["step"]
    assert budget[-1]["budget_s"] == 2.0 and budget[-1]["tokens"] % per_step == 0 and budget[-1]["step"] >= 8
    probed = re.search(r"time budget 2 s: this mode trains ([\d,]+) tokens/s here .* so ([\d,]+) tokens",
                       ranks[0]["budget_stdout"])
    assert probed, ranks[0]["budget_stdout"]
    tps, tokens = (int(g.replace(",", "")) for g in probed.groups())
    assert tokens == budget[-1]["tokens"], (tokens, budget[-1])
    assert tokens == 8 * per_step or -1 <= 2 * tps - tokens < per_step + 1, (tokens, tps, per_step)  # tps is rounded
    # local steps are said in the header and the summary
    assert re.search(r"^mode decentpy topology complete .* local steps H=2 outer rule diloco;", ranks[0]["budget_stdout"],
                     re.M), ranks[0]["budget_stdout"]
    s = _summary(ranks[0]["budget_stdout"])
    assert s["local_steps"] == "2" and s["fragments"] == "1" and s["outer_rule"] == "diloco"


def _torchft_anchor(rank: int, world: int, small_dir: str) -> List[List[Dict[str, Any]]]:
    corpus = C.load_corpus(small_dir)
    out = []
    for mode in ("torchft-diloco", "decentpy"):
        spec = L.RunSpec(mode=mode, topology="complete", local_steps=4, tokens=2048, evals=2, val_windows=16,
                         context=32, global_batch=8, lr=3e-3)
        out.append(L.run_arm(spec, corpus))
    return out


def test_the_torchft_diloco_anchor_is_diloco(small_dir: str) -> None:
    """bench-lm's anchor, torchft 0.2.0's own DiLoCo (a stand-in Manager on the process group), against
    decentpy's DiLoCo at the same H: the same bytes (the pseudo-gradient once per outer step) and the
    same loss to the inner optimizers' rounding (torch's AdamW there, decentpy's fused AdamW here).
    Needs torchft importable (DECENTPY_TORCHFT_PATH, see docs/elastic.md)."""
    path = os.environ.get("DECENTPY_TORCHFT_PATH") or os.environ.get("BENCH_TORCHFT_PATH")
    if not path:
        pytest.skip("torchft 0.2.0 is not installed here (set DECENTPY_TORCHFT_PATH to a --target install)")
    torchft, decentpy_rows = run_workers(_torchft_anchor, 2, small_dir, timeout=180,
                                         env={"DECENTPY_TORCHFT_PATH": path})[0]
    assert torchft[-1]["framework"] == "torchft" and torchft[-1]["local_steps"] == 4
    assert torchft[-1]["bytes_sent_per_worker"] == decentpy_rows[-1]["bytes_sent_per_worker"]
    for a, b in zip(torchft, decentpy_rows):
        assert a["val_bits_per_byte"] == pytest.approx(b["val_bits_per_byte"], abs=2e-3), (a, b)


def _recipe_arms(rank: int, world: int, small_dir: str) -> List[List[Dict[str, Any]]]:
    corpus = C.load_corpus(small_dir)
    common = dict(tokens=3072, evals=1, val_windows=16, context=32, global_batch=8, lr=3e-3, grad_clip=0.05,
                  warmup_steps=3)
    return [L.run_arm(L.RunSpec(mode="ddp", **common), corpus),
            L.run_arm(L.RunSpec(mode="ddp", data_split="shard", **common), corpus),
            L.run_arm(L.RunSpec(mode="decentpy", topology="complete", local_steps=4, outer_lr=1.0, outer_momentum=0.0,
                                **common), corpus),
            # the clip reaches decent-dp's optimizer (it steps inside backward): the same loss as decentpy's
            # same topology, and another one without the clip
            L.run_arm(L.RunSpec(mode="decentpy", topology="ring", **common), corpus),
            L.run_arm(L.RunSpec(mode="decent-dp", topology="ring", **common), corpus),
            L.run_arm(L.RunSpec(mode="decent-dp", topology="ring", **dict(common, grad_clip=0.0)), corpus),
            L.run_arm(L.RunSpec(mode="decentpy", topology="ring", state_avg_every=2, **common), corpus)]


def _recipe_reference(corpus: C.Corpus, split: str, world: int = 2) -> float:
    """The DDP arm's recipe in one process on the global batch, float64: AdamW over decentpy's decay
    groups, the gradient clipped over the model, warm-up then cosine; the held-out bits per byte."""
    from decentpy.optim import lr_scheduler_fn_cosine_with_warmup, split_decay_groups

    spec = L.RunSpec(mode="ddp", tokens=3072, evals=1, val_windows=16, context=32, global_batch=8, lr=3e-3,
                     grad_clip=0.05, warmup_steps=3, data_split=split)
    cfg, sched = spec.model_config(), L.schedule(spec)
    torch.manual_seed(0)
    model = M.ByteTransformer(cfg).double()
    opt = torch.optim.AdamW(split_decay_groups(list(model.named_parameters()), 0.1), lr=cfg.lr, betas=L.BETAS,
                            eps=L.EPS)
    sch = lr_scheduler_fn_cosine_with_warmup(opt, t_max=sched.steps - sched.warmup, t_warmup=sched.warmup,
                                             cosine_eta_min=0.1 * cfg.lr)
    per = cfg.global_batch // world
    for step in range(sched.steps):
        xs = [C.train_batch(corpus.train, 0, r, world, step, per, cfg.context, split) for r in range(world)]
        opt.zero_grad()
        # DDP: the mean over ranks of each rank's mean loss, i.e. the global batch's mean
        loss = sum(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)) for x, y in xs) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        sch.step()
    w = C.val_windows(corpus.val, cfg.context, 16)
    with torch.no_grad():
        nll = F.cross_entropy(model(w[:, :-1]).reshape(-1, 256), w[:, 1:].reshape(-1))
    return float(nll) / math.log(2.0)


def test_the_recipe_is_ddp_on_the_global_batch(small_dir: str) -> None:
    """bench-lm's recipe (issue 53): the shuffled split, gradient clipping and a warm-up in steps, checked
    on the DDP arm against a float64 re-computation on the global batch (both splits), and a local-steps
    arm's outer settings recorded in its rows."""
    ranks = run_workers(_recipe_arms, 2, small_dir, timeout=180)
    shuffled, shard, diloco, ring, decent_dp, decent_dp_unclipped, averaged = ranks[0]
    corpus = C.load_corpus(small_dir)
    for rows, split in ((shuffled, "shuffle"), (shard, "shard")):
        last = rows[-1]
        assert last["data_split"] == split and last["grad_clip"] == 0.05 and last["warmup_steps"] == 3
        assert last["val_bits_per_byte"] == pytest.approx(_recipe_reference(corpus, split), abs=2e-4), split
    assert shuffled[-1]["val_bits_per_byte"] != shard[-1]["val_bits_per_byte"]
    assert diloco[-1]["outer_lr"] == 1.0 and diloco[-1]["outer_momentum"] == 0.0 and diloco[-1]["local_steps"] == 4
    assert shuffled[-1]["outer_lr"] is None and shuffled[-1]["budget_s"] is None
    mine, theirs, unclipped = (r[-1]["val_bits_per_byte"] for r in (ring, decent_dp, decent_dp_unclipped))
    assert abs(mine - theirs) < 2e-3 < abs(theirs - unclipped), (mine, theirs, unclipped)
    assert averaged[-1]["state_averaging"] == "exp_avg_sq/2" and ring[-1]["state_averaging"] is None
    assert averaged[-1]["val_bits_per_byte"] != ring[-1]["val_bits_per_byte"]
