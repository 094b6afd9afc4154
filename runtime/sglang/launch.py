"""``sparkgate sglang-launch``: start SGLang 0.5.23 with DSpark and the SLA plugin active.

Stdlib only (runs inside SGLang's image: ``PYTHONPATH=/opt/sparkgate python3 -m
runtime.sglang.launch …``). Steps:

1. install the SLA plugin ``.pth`` into the site-packages of ``--python`` (SGLang's
   interpreter; :mod:`runtime.sglang.plugin.install`), unless ``--no-plugin``;
2. set ``SGLANG_RAGGED_VERIFY_MODE`` (default ``compact``; SGLang's own default
   ``static`` verifies every draft and never calls the budget scheduler the plugin
   weights — ``srt/speculative/ragged_verify.py``, ``srt/environ.py``) unless the
   environment already sets it, plus the plugin's ``SPARKGATE_SLA_*`` knobs;
3. ``exec`` ``<python> -m sglang.launch_server --model-path M --speculative-algorithm
   DSPARK --speculative-draft-model-path D [DSpark flags] <passthrough>``.

Our options map onto SGLang 0.5.23's own flags (``srt/arg_groups/fields/*.py``):

=====================  ==============================================  ======================
option                 SGLang flag                                     source
=====================  ==============================================  ======================
``--model-path``       ``--model-path``                                model.py
``--draft-model-path`` ``--speculative-draft-model-path``              spec.py
``--block-size``       ``--speculative-dspark-block-size`` (γ)         spec.py
``--sps-table``        ``--speculative-dspark-sps-table-path``         spec.py; JSON from
                                                                       ``sglang.benchmark.dspark_sps_profiler``
``--sts-file``         ``--speculative-dspark-confidence-sts-path``    spec.py; JSON from
                                                                       ``sglang.benchmark.dspark_sts_fit``
``--host``/``--port``  ``--host``/``--port``                           serving.py
``--priority``         ``--enable-priority-scheduling``                schedule.py
=====================  ==============================================  ======================

Every other option (and everything after ``--``) is passed to ``sglang.launch_server``
unchanged, e.g. ``--tp-size 2 --context-length 8192 --api-key K``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Mapping, Sequence

RAGGED_MODES = ("static", "cap-accept", "compact")
_RESERVED = ("--speculative-algorithm", "--model-path", "--model", "--speculative-draft-model-path",
             "--speculative-draft-model")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparkgate sglang-launch",
        allow_abbrev=False,  # SGLang's own flags must pass through untouched
        description="Launch SGLang 0.5.23 with --speculative-algorithm DSPARK and the sparkgate SLA "
                    "plugin; unknown options are passed to sglang.launch_server.")
    p.add_argument("--model-path", required=True, help="target model (dir or hub id)")
    p.add_argument("--draft-model-path", required=True,
                   help="DSpark draft checkpoint (with its confidence head)")
    p.add_argument("--block-size", type=int, default=None,
                   help="DSpark block size γ (default: from the draft checkpoint)")
    p.add_argument("--sps-table", default=None,
                   help="SPS cost table JSON from sglang.benchmark.dspark_sps_profiler (per GPU/model)")
    p.add_argument("--sts-file", default=None,
                   help="STS calibration JSON from sglang.benchmark.dspark_sts_fit (per draft/γ)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--priority", action="store_true",
                   help="--enable-priority-scheduling (then set SPARKGATE_SGLANG_SEND_PRIORITY=1 on the gateway)")
    p.add_argument("--python", default=sys.executable,
                   help="SGLang's Python interpreter (the plugin is installed into its site-packages)")
    p.add_argument("--ragged-verify-mode", choices=RAGGED_MODES, default="compact",
                   help="SGLANG_RAGGED_VERIFY_MODE unless already set in the environment")
    p.add_argument("--sla-sharpness", type=float, default=None, help="SPARKGATE_SLA_SHARPNESS")
    p.add_argument("--sla-unknown-weight", type=float, default=None, help="SPARKGATE_SLA_UNKNOWN_WEIGHT")
    p.add_argument("--no-plugin", action="store_true", help="do not install/activate the SLA plugin")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of exec'ing it")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse our options; the rest lands in ``args.passthrough`` (list of str).

    Raises:
        SystemExit: missing required options, a passthrough flag we set ourselves, or a
            table/calibration file that does not exist.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.passthrough = unknown + extra
    for flag in args.passthrough:
        if flag.split("=", 1)[0] in _RESERVED:
            parser.error(f"{flag.split('=', 1)[0]} is set by sglang-launch; use its own option")
    for name in ("sps_table", "sts_file"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            parser.error(f"--{name.replace('_', '-')} {path}: no such file")
    return args


def build_launch_command(args: argparse.Namespace) -> list[str]:
    """The ``sglang.launch_server`` argv for parsed ``args`` (see the module table)."""
    cmd = [args.python, "-m", "sglang.launch_server",
           "--model-path", args.model_path,
           "--speculative-algorithm", "DSPARK",
           "--speculative-draft-model-path", args.draft_model_path]
    if args.block_size is not None:
        cmd += ["--speculative-dspark-block-size", str(args.block_size)]
    if args.sps_table is not None:
        cmd += ["--speculative-dspark-sps-table-path", str(args.sps_table)]
    if args.sts_file is not None:
        cmd += ["--speculative-dspark-confidence-sts-path", str(args.sts_file)]
    cmd += ["--host", args.host, "--port", str(args.port)]
    if args.priority:
        cmd.append("--enable-priority-scheduling")
    return cmd + list(getattr(args, "passthrough", []))


def launch_env(args: argparse.Namespace, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for SGLang: ``base`` (default ``os.environ``) plus
    ``SGLANG_RAGGED_VERIFY_MODE`` (if unset) and the plugin knobs."""
    env = dict(os.environ if base is None else base)
    env.setdefault("SGLANG_RAGGED_VERIFY_MODE", args.ragged_verify_mode)
    if args.no_plugin:
        env["SPARKGATE_SLA_PLUGIN"] = "0"
    if args.sla_sharpness is not None:
        env["SPARKGATE_SLA_SHARPNESS"] = str(args.sla_sharpness)
    if args.sla_unknown_weight is not None:
        env["SPARKGATE_SLA_UNKNOWN_WEIGHT"] = str(args.sla_unknown_weight)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Install the plugin, then exec SGLang (``--dry-run``: print the command, return 0)."""
    args = parse_args(argv)
    cmd = build_launch_command(args)
    env = launch_env(args)
    if not args.no_plugin:
        from runtime.sglang.plugin import install

        site = install.site_packages_of(args.python)
        for path in install.install(site):
            print(f"sglang-launch: wrote {path}", file=sys.stderr)
    if env["SGLANG_RAGGED_VERIFY_MODE"] == "static" or args.sps_table is None:
        print("sglang-launch: warning: without a profiled --sps-table and a non-static ragged verify "
              "mode SGLang verifies every draft, so the SLA plugin has nothing to weight",
              file=sys.stderr)
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(env[k])}" for k in sorted(env)
                       if k.startswith(("SGLANG_", "SPARKGATE_SLA_"))), shlex.join(cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
