"""Nothing tied to one machine: the eval and training prompts ship in ``data/`` (gzip, each
file under its own licence, data/README.md), the drafter commands run from a bare clone on
them, no tracked file names a development machine's path, and tests never read the user's
cache (tests/conftest.py ``isolated_cache_dir``)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess

import pytest

from training.data import DATA_DIR, REPO_ROOT, load_train_prompts, read_jsonl
from tests.conftest import require_or_skip

SUMS = dict(reversed(line.split()) for line in (DATA_DIR / "SHA256SUMS").read_text().splitlines() if line.strip())
FETCHED = {"eval/alpaca.jsonl": "python data/fetch_alpaca.py"}  # not redistributable: fetched, never committed
MACHINE_PATH = re.compile(r"(?<![\w.~-])/" + "work/|[.][.]/" + "shared/")  # split: this file must not match


def test_shipped_data_matches_its_checksums_and_is_deterministic_gzip():
    shipped = sorted(str(p.relative_to(DATA_DIR))[: -len(".gz")] for p in DATA_DIR.glob("*/*.jsonl.gz"))
    assert set(shipped) - set(FETCHED) == set(SUMS) - set(FETCHED) and len(shipped) >= 13  # 5 eval + 8 train
    readme = (DATA_DIR / "README.md").read_text()
    for name in SUMS:
        assert name.split("/")[1] in readme  # every file has its provenance / licence row
        if name in FETCHED:
            assert FETCHED[name] in readme
            continue
        blob = (DATA_DIR / f"{name}.gz").read_bytes()
        assert blob[3] & 0x08 == 0 and blob[4:8] == b"\0\0\0\0"  # no file name, mtime 0: re-running keeps the bytes
        assert hashlib.sha256(gzip.decompress(blob)).hexdigest() == SUMS[name]
    assert read_jsonl(DATA_DIR / "eval" / "mt-bench.jsonl.gz")[0]["turns"][0].startswith("Compose an engaging travel")


def test_training_prompts_ship_in_the_repository():
    rows = load_train_prompts()  # default: data/train, relative to the repository
    by_cat = {c: sum(r["category"] == c for r in rows) for c in ("math", "chat", "code", "instruct")}
    assert len(rows) == 30873 and by_cat == {"math": 14832, "chat": 6823, "code": 4465, "instruct": 4753}
    assert json.loads((DATA_DIR / "drafter" / "manifest.json").read_text())["settings"]["train_dir"] == "data/train"


def test_no_tracked_file_names_a_development_machine_path():
    ls = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True)
    require_or_skip(ls.returncode == 0, "a git checkout")
    hits = []  # docs/history/ is a dated log kept unchanged; docs/reports/ (generated) is held to this like any file
    for rel in ls.stdout.decode().split("\0"):
        path = REPO_ROOT / rel
        if not rel or rel.startswith("docs/history/") or not path.is_file() or path.stat().st_size > 4 << 20:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
        hits += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}" for m in MACHINE_PATH.finditer(text)]
    assert hits == []
    for rel in ("data/drafter/manifest.json", *(f"runtime/speculation/checkpoints/{c}/{f}" for c in ("default", "parallel")
                                                for f in ("train_config.json", "calibration.json"))):
        if (REPO_ROOT / rel).exists():
            text = (REPO_ROOT / rel).read_text()
            assert not re.search(r'": "/', text), rel  # committed JSON holds no absolute path


def test_tests_never_read_the_user_cache(isolated_cache_dir):
    from runtime.speculation.sps_profiler import sps_cache_dir
    from runtime.config import cache_dir

    assert cache_dir() != isolated_cache_dir and not sps_cache_dir().resolve().is_relative_to(isolated_cache_dir)
    assert (cache_dir() / "models").resolve() == (isolated_cache_dir / "models").resolve()  # shared: no reconversion


@pytest.mark.model
def test_sparkgate_eval_runs_on_the_shipped_eval_data(tmp_path, capsys):
    from gateway.cli import main

    ck = REPO_ROOT / "runtime" / "speculation" / "checkpoints" / "default"
    rc = main(["eval", "--max-samples", "1", "--tasks", "mt-bench", "--checkpoint", str(ck), "--dtype", "float32",
               "--max-new-tokens", "16", "--temperatures", "0", "--threads", "1", "--no-progress",
               "--report", str(tmp_path / "rep")])  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    res = json.loads((tmp_path / "rep.json").read_text())
    assert {(r["task"], r["method"], r["samples"]) for r in res["rows"]} == {("mt-bench", "dspark", 1),
                                                                             ("mt-bench", "prompt-lookup", 1)}
    assert all(1.0 <= r["tau_t0"] <= 8 and r["rounds_t0"] > 0 for r in res["rows"])
    assert summary["dspark"]["tau_t0_macro"] == next(r["tau_t0"] for r in res["rows"] if r["method"] == "dspark")
    assert (tmp_path / "rep.md").read_text().count("mt-bench") >= 1


@pytest.mark.model
def test_train_drafter_five_steps_on_the_shipped_shards(tmp_path):
    from gateway.cli import main

    out = tmp_path / "ck"
    rc = main(["train-drafter", "--out", str(out), "--steps", "5", "--seqs-per-micro", "1", "--anchors", "4",
               "--accum", "1", "--max-len", "256", "--num-layers", "1", "--markov-rank", "8", "--val-every", "0",
               "--save-every", "0", "--val-seqs", "1", "--teacher-dtype", "float32", "--threads", "1",
               "--no-resume", "--no-progress"])  # fmt: skip
    assert rc == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["slots"] > 0 and r["loss"] > 0 for r in steps)  # real response tokens from data/drafter
    rec = json.loads((out / "train_config.json").read_text())
    assert rec["data_dir"] == "data/drafter" and "out" not in rec  # repository-relative, no machine path
    assert (out / "model.safetensors").exists()
