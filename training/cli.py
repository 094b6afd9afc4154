"""Command-line entry points of the drafter pipeline: ``regen``, ``build-features``, ``train``, ``calibrate``, ``eval``.

    python -m training.cli regen     [--num-prompts 5500] [--limit N] ...
    python -m training.cli build-features --out FEATURES_DIR   # teacher features, once (~10 GB)
    python -m training.cli train     --out runtime/speculation/checkpoints/candidate [--feature-cache DIR] ...
    python -m training.cli calibrate --checkpoint DIR
    python -m training.cli eval      --checkpoint DIR [--max-samples 20] ...
    python -m training.cli export    --checkpoint DIR --out runtime/speculation/checkpoints/default
    python -m training.cli draft-vocab --checkpoint DIR [--size 8192]
    python -m training.cli calibrate-ngram [--max-ngram 5]      # the hybrid proposer's n-gram survival

:func:`build_parser` / :func:`main` are what ``sparkgate train-drafter`` etc. hook
into (``main(argv)`` returns an exit code). Long runs belong under ``nice -n 19``.
See docs/drafter.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_regen(sub) -> None:
    from training.data import DEFAULT_OUT, TRAIN_DIR, RegenConfig

    d = RegenConfig()
    p = sub.add_parser("regen", help="regenerate training responses with the target (resumable)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="data dir (shards + manifest)")
    p.add_argument("--train-dir", default=str(TRAIN_DIR), help="training prompts (*.jsonl.gz / *.jsonl)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="length of the balanced prompt order")
    p.add_argument("--limit", type=int, default=None, help="stop after N new prompts (throughput runs)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--dtype", default="auto", choices=["auto", "gguf", "bfloat16", "float32"],
                   help="target dtype; auto: as served (runtime.config.resolve_dtype; recorded per shard)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster than 2 on a contended "
                   "2-core box: no OpenMP spin-waits)")
    p.add_argument("--no-progress", action="store_true")


TARGET_DTYPES = ["auto", "gguf", "bfloat16", "float32"]


def _target_dtype(name: str):
    """A CLI dtype name → what ``load_llama`` takes (``"auto"`` resolved as the server does)."""
    from runtime.config import resolve_dtype
    from runtime.engine.llm_engine import DTYPES

    return DTYPES[resolve_dtype(name)]


def _stop_on_sigterm() -> None:
    """SIGTERM → KeyboardInterrupt, so a background run (where SIGINT is ignored) still
    writes its completed responses / checkpoint before exiting."""
    import signal

    def _raise(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


def _run_regen(a) -> int:
    from runtime.config import resolve_dtype
    from training.data import RegenConfig, regenerate, repo_relative, summarize

    _stop_on_sigterm()

    cfg = RegenConfig(
        num_prompts=a.num_prompts, seed=a.seed, temperature=a.temperature, top_p=a.top_p,
        max_new_tokens=a.max_new_tokens, max_batch_size=a.max_batch_size, dtype=resolve_dtype(a.dtype),
        train_dir=repo_relative(a.train_dir),
    )  # fmt: skip
    st = regenerate(cfg, a.out, shard_size=a.shard_size, limit=a.limit, num_threads=a.threads,
                    progress=not a.no_progress)
    print(json.dumps({
        "new_prompts": st.new_prompts, "new_response_tokens": st.new_tokens, "seconds": round(st.seconds, 1),
        "tokens_per_s": round(st.tokens_per_s, 1),
        "tokens_per_cpu_s": round(st.tokens_per_cpu_s, 1), "prompts_done": st.prompts_done,
        "skipped": st.skipped_long, "failed": st.failed, "summary": summarize(a.out),
    }, indent=2))  # fmt: skip
    return 0


def _add_train(sub) -> None:
    from training.train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train a drafter (online teacher features; resumable)")
    p.add_argument("--data", default=d.data_dir, help="regenerated data dir")
    p.add_argument("--out", default=d.out, help="checkpoint dir (never the served default unless you mean it)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (LR schedule length)")
    p.add_argument("--minutes", type=float, default=None, help="stop and save after this wall time")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--seqs-per-micro", type=int, default=d.seqs_per_micro)
    p.add_argument("--anchors", type=int, default=d.anchors_per_seq, help="random anchors (blocks) per sequence")
    p.add_argument("--accum", type=int, default=d.accum, help="micro-batches per optimizer step")
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--block-size", type=int, default=7, help="γ")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--markov-rank", type=int, default=64, help="0 = parallel-only (rank-0 ablation)")
    p.add_argument("--markov-variant", default="vanilla", choices=["vanilla", "gated"])
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--val-every", type=int, default=d.val_every)
    p.add_argument("--val-seqs", type=int, default=d.val_seqs)
    p.add_argument("--no-resume", action="store_true", help="start fresh even if OUT has a train_state.pt")
    p.add_argument("--init", default=None, help="warm start from this checkpoint (weights + architecture; "
                   "fresh optimizer and schedule; the architecture flags are ignored)")
    p.add_argument("--draft-vocab", default=None, metavar="DIR",
                   help="train over the draft vocabulary in DIR/draft_vocab.json, as the fused drafter serves it")
    p.add_argument("--teacher-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="frozen target dtype: the teacher's (online features) and the drafter's shared "
                        "embedding / LM head's; time a step both ways on a new CPU")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the drafter's matmuls: fp32, or bf16 autocast over fp32 master weights")
    p.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="read the teacher features from a `build-features` cache instead of running the target")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--no-progress", action="store_true")


def _run_train(a) -> int:
    from runtime.speculation.config import DrafterConfig
    from training.train import TrainConfig, train

    dcfg = DrafterConfig(block_size=a.block_size, num_layers=a.num_layers, markov_rank=a.markov_rank,
                         markov_variant=a.markov_variant, init_seed=a.seed)
    cfg = TrainConfig(
        data_dir=a.data, out=a.out, drafter=dcfg.to_dict(), seqs_per_micro=a.seqs_per_micro,
        anchors_per_seq=a.anchors, accum=a.accum, max_len=a.max_len, lr=a.lr, warmup_frac=a.warmup_frac,
        steps=a.steps, max_minutes=a.minutes, save_every=a.save_every, val_every=a.val_every,
        val_seqs=a.val_seqs, threads=a.threads, seed=a.seed, init=a.init, draft_vocab=a.draft_vocab,
        teacher_dtype=a.teacher_dtype, feature_cache=a.feature_cache, compute_dtype=a.compute_dtype,
    )  # fmt: skip
    _stop_on_sigterm()
    r = train(cfg, resume=not a.no_resume, progress=not a.no_progress)
    r.pop("drafter")
    print(json.dumps(r, indent=2))
    return 0


def _add_features(sub) -> None:
    from runtime.speculation.config import DrafterConfig
    from training.train import TrainConfig

    p = sub.add_parser("build-features", help="compute the target's teacher features once into a disk cache "
                       "(resumable; `train --feature-cache DIR` reads it)")
    p.add_argument("--out", required=True, help="cache dir (~10 GB for the committed data)")
    p.add_argument("--data", default=TrainConfig().data_dir, help="regenerated data dir")
    p.add_argument("--tap-layers", default=",".join(map(str, DrafterConfig().target_layer_ids)),
                   help="the drafter's target layer ids (comma-separated)")
    p.add_argument("--max-len", type=int, default=TrainConfig().max_len, help="the training cut")
    p.add_argument("--teacher-dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--workers", type=int, default=2, help="processes of one torch thread each")
    p.add_argument("--seqs-per-batch", type=int, default=4)
    p.add_argument("--limit", type=int, default=None, help="stop after N more sequences")
    p.add_argument("--no-progress", action="store_true")


def _run_features(a) -> int:
    from training.feature_cache import build_feature_cache

    r = build_feature_cache(a.out, a.data, [int(t) for t in a.tap_layers.split(",")], max_len=a.max_len,
                            teacher_dtype=a.teacher_dtype, workers=a.workers, seqs_per_batch=a.seqs_per_batch,
                            limit=a.limit, progress=not a.no_progress)
    print(json.dumps(r, indent=2))
    return 0


def _add_calibrate(sub) -> None:
    from training.data import DEFAULT_OUT

    p = sub.add_parser("calibrate", help="fit STS temperatures on the held-out split into a checkpoint")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", default=str(DEFAULT_OUT))
    p.add_argument("--max-samples", type=int, default=100, help="held-out prompts to use")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto", choices=TARGET_DTYPES, help="target dtype (auto: as served)")
    p.add_argument("--labels", choices=("t0", "t1"), default="t0",
                   help="t0: greedy acceptances (0/1); t1: expected T=1 survival (soft)")
    p.add_argument("--dry-run", action="store_true", help="print, do not write the checkpoint")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-progress", action="store_true")


def _run_calibrate(a) -> int:
    import torch

    from training.evaluate import calibrate_sts

    torch.set_num_threads(a.threads)
    r = calibrate_sts(a.checkpoint, a.data, max_samples=a.max_samples, max_new_tokens=a.max_new_tokens,
                      dtype=_target_dtype(a.dtype), write=not a.dry_run, progress=not a.no_progress,
                      labels=a.labels)
    print(json.dumps(r, indent=2))
    return 0


def _add_eval(sub) -> None:
    from runtime.config import EngineConfig
    from training.data import REPO_ROOT
    from training.evaluate import EVAL_DIR, TASK_CAPS

    p = sub.add_parser("eval", help="τ on the DeepSpec eval sets (T=0 exact, T=1 expected)")
    p.add_argument("--checkpoint", default=None, help="DSpark drafter checkpoint (method 'dspark')")
    p.add_argument("--parallel-checkpoint", default=None, help="rank-0 ablation checkpoint (method 'parallel')")
    p.add_argument("--random-baseline", action="store_true", help="also a randomly initialised drafter")
    p.add_argument("--draft-vocab", action="store_true",
                   help="also method 'dspark-draft-vocab': the DSpark drafter restricted to its checkpoint's "
                        "draft vocabulary, as the fused drafter serves it")
    p.add_argument("--as-served", action="store_true",
                   help="evaluate the drafters only as the fused drafter serves them: restricted to their "
                        "checkpoints' draft vocabularies (no full-vocabulary run)")
    p.add_argument("--previous-checkpoint", default=None,
                   help="a second DSpark drafter (method 'dspark-previous'; restricted with --as-served)")
    p.add_argument("--no-prompt-lookup", action="store_true")
    p.add_argument("--lookup-gamma", type=int, default=EngineConfig().num_speculative_tokens,
                   help="prompt lookup's proposal length (default: the engine's num_speculative_tokens, as served)")
    p.add_argument("--tasks", default=None, help=f"comma-separated, of {','.join(TASK_CAPS)} (default: those "
                   "with a file in --eval-dir)")
    p.add_argument("--eval-dir", default=str(EVAL_DIR), help="<task>.jsonl.gz / <task>.jsonl files")
    p.add_argument("--max-samples", type=int, default=None, help="first N prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--live-t1", type=int, default=0, metavar="N",
                   help="also measure τ by live T=1 speculative decoding on the first N prompts per task")
    p.add_argument("--dtype", default="auto", choices=TARGET_DTYPES, help="target dtype (auto: as served)")
    p.add_argument("--report", default=str(REPO_ROOT / "docs" / "reports" / "drafter-eval"), help="writes REPORT.md, REPORT-tau.png, "
                   "REPORT-position.png, REPORT.json")
    p.add_argument("--title", default="Drafter τ (DeepSpec protocol)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-progress", action="store_true")


def _run_eval(a) -> int:
    import torch

    from runtime.engine.llm_engine import load_tokenizer
    from runtime.models.llama import load_llama
    from runtime.models.loader import ensure_converted
    from runtime.speculation.checkpoint import load_drafter
    from runtime.speculation.config import DrafterConfig
    from runtime.speculation.drafter import DSparkDrafter
    from training.evaluate import (
        DrafterMethod,
        PromptLookupMethod,
        evaluate,
        live_tau,
        load_eval_prompts,
        write_report,
    )

    torch.set_num_threads(a.threads)
    mdir = ensure_converted()
    target, tok = load_llama(mdir, _target_dtype(a.dtype)), load_tokenizer(mdir)
    methods = []

    def vocab_of(ckpt):
        from runtime.speculation.fast_drafter import load_draft_vocab

        vocab = load_draft_vocab(ckpt, target.cfg.vocab_size)
        if vocab is None:
            raise SystemExit(f"{ckpt} has no draft vocabulary (python -m training.cli draft-vocab)")
        return vocab

    if a.checkpoint:
        dr = load_drafter(a.checkpoint, target)
        methods.append(DrafterMethod("dspark", dr, vocab=vocab_of(a.checkpoint) if a.as_served else None))
        if a.draft_vocab and not a.as_served:
            methods.append(DrafterMethod("dspark-draft-vocab", dr, vocab=vocab_of(a.checkpoint)))
    if a.previous_checkpoint:
        methods.append(DrafterMethod("dspark-previous", load_drafter(a.previous_checkpoint, target),
                                     vocab=vocab_of(a.previous_checkpoint) if a.as_served else None))
    if a.parallel_checkpoint:
        methods.append(DrafterMethod("parallel", load_drafter(a.parallel_checkpoint, target),
                                     vocab=vocab_of(a.parallel_checkpoint) if a.as_served else None))
    if a.random_baseline:
        methods.append(DrafterMethod("random-init", DSparkDrafter(target, DrafterConfig())))
    if not a.no_prompt_lookup:
        methods.append(PromptLookupMethod(a.lookup_gamma))
    tasks = a.tasks.split(",") if a.tasks else None
    prompts = load_eval_prompts(a.eval_dir, tasks, max_samples=a.max_samples)
    res = evaluate(target, tok, methods, prompts, max_new_tokens=a.max_new_tokens,
                   temperatures=[float(t) for t in a.temperatures.split(",")], progress=not a.no_progress)
    res["checkpoints"] = {"dspark": a.checkpoint, "parallel": a.parallel_checkpoint,
                          "dspark-previous": a.previous_checkpoint}
    res["as_served"] = bool(a.as_served)
    if a.live_t1:
        live_prompts = load_eval_prompts(a.eval_dir, tasks, max_samples=a.live_t1)
        live = {m.name: live_tau(target, tok, live_prompts, "prompt_lookup" if m.name == "prompt-lookup" else m.name,
                                 res["checkpoints"].get(m.name),
                                 gamma=m.gamma, max_new_tokens=a.max_new_tokens)
                for m in methods if m.name in ("dspark", "parallel", "prompt-lookup")}
        res["live_t1"] = {"prompts_per_task": a.live_t1, "tau": live}
        for row in res["rows"]:
            row["tau_t1_live"] = live.get(row["method"], {}).get(row["task"])
    rep = Path(a.report)
    rep.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{rep}.json").write_text(json.dumps(res, indent=2) + "\n")
    write_report(res, Path(f"{rep}.md"), rep, a.title)
    print(json.dumps(res["summary"], indent=2))
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="copy a checkpoint with its tensors cast (bf16 for serving / git)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


def _run_export(a) -> int:
    from runtime.speculation.checkpoint import export_checkpoint

    print(json.dumps(export_checkpoint(a.checkpoint, a.out, a.dtype)))
    return 0


def _add_draft_vocab(sub) -> None:
    from training.data import DEFAULT_OUT

    p = sub.add_parser("draft-vocab", help="write the checkpoint's draft vocabulary (most frequent response tokens)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--size", type=int, default=8192, help="N tokens (a multiple of 16)")
    p.add_argument("--data", default=str(DEFAULT_OUT))


def _run_draft_vocab(a) -> int:
    from runtime.speculation.fast_drafter import DRAFT_VOCAB_FILE, build_draft_vocab
    from training.data import load_data

    cfg = json.loads((Path(a.checkpoint) / "config.json").read_text())
    vocab_size = int(cfg["target"]["vocab_size"])
    res = build_draft_vocab(load_data(a.data), a.size, vocab_size)
    (Path(a.checkpoint) / DRAFT_VOCAB_FILE).write_text(json.dumps(res))
    print(json.dumps({"size": res["size"], "heldout_coverage": res["heldout_coverage"]}))
    return 0


def _add_calibrate_ngram(sub) -> None:
    from training.data import DEFAULT_OUT

    p = sub.add_parser("calibrate-ngram", help="measure n-gram draft acceptance per match length and position")
    p.add_argument("--data", default=str(DEFAULT_OUT))
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--max-ngram", type=int, default=5)


def _run_calibrate_ngram(a) -> int:
    from training.ngram import calibrate, write

    res = calibrate(a.data, a.gamma, a.max_ngram)
    path = write(res)
    print(json.dumps({"written": str(path), "survival": res["survival"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark", description="DSpark drafter pipeline (docs/drafter.md)")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_regen(sub)
    _add_features(sub)
    _add_train(sub)
    _add_calibrate(sub)
    _add_eval(sub)
    _add_export(sub)
    _add_draft_vocab(sub)
    _add_calibrate_ngram(sub)
    return p


RUNNERS = {"regen": _run_regen, "build-features": _run_features, "train": _run_train, "calibrate": _run_calibrate, "eval": _run_eval,
           "export": _run_export, "draft-vocab": _run_draft_vocab, "calibrate-ngram": _run_calibrate_ngram}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return RUNNERS[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
