"""Re-check everything we recorded about sglang 0.5.23 against the real wheel.

Runs only with ``SPARKGATE_CHECK_SGLANG_SOURCE=1`` (it downloads the 39 MB wheel with
``pip download --no-deps sglang==0.5.23``; set ``SPARKGATE_SGLANG_WHEEL=/path/to.whl`` to
reuse one). Nothing from SGLang is vendored: the wheel is read in a temp dir and only
compared with what the stand-in, the client, the plugin and the launcher assume.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from runtime.sglang.plugin import sla_hook
from tests.support.sglang_standin import ALIASES, CONTRACT

pytestmark = pytest.mark.skipif(os.environ.get("SPARKGATE_CHECK_SGLANG_SOURCE") != "1",
                                reason="set SPARKGATE_CHECK_SGLANG_SOURCE=1 (downloads sglang==0.5.23)")

VERSION = "0.5.23"
PLANNER = "sglang/srt/speculative/dspark_components/dspark_planner.py"
WORKER = "sglang/srt/speculative/dspark_components/dspark_worker_v2.py"
SCHEDULE = "sglang/kernels/ops/speculative/dspark/dspark_schedule.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"

#: the plugin's patch points: (file, class, method) → (def line, positional args, keyword-only args)
PATCH_POINTS = {
    (PLANNER, "DSparkVerifyPlanner", "_schedule_verify_lens"):
        (526, ["self"], ["req_pool_indices", "prefix_lens", "device", "confidence", "budget"]),
    (WORKER, "DSparkWorkerV2", "_forward_decode"):
        (961, ["self", "batch", "on_publish", "grammar_barrier", "coordination_plan"], []),
    (IO_STRUCT, "GenerateReqInput", "normalize_batch_and_arguments"): (406, ["self"], []),
}

#: source lines the client/stand-in/launcher/plugin rely on: file → substrings
SOURCE_FACTS = {
    "sglang/srt/entrypoints/http_server.py": [
        '@app.get("/health")', '@app.get("/health_generate")', '@app.post("/abort_request")',
        '"/generate",', 'yield b"data: " + dumps_json(out) + b"\\n\\n"', 'yield b"data: [DONE]\\n\\n"',
        'content={"error": contract_error}', '"retryable": False', '@app.get("/server_info")',
        '@app.get("/model_info")', '"served_model_name": _global_state.tokenizer_manager.served_model_name,',
        "**build_server_info(server_args, _global_state.scheduler_info),",
    ],
    "sglang/srt/entrypoints/v1_loads.py": ['@router.get("/v1/loads")', '"loads": loads'],
    "sglang/srt/utils/common.py": ["result = server_args.resolved_dict()"],
    "sglang/srt/managers/load_snapshot.py": ["num_running_reqs: int = 0", "num_waiting_reqs: int = 0",
                                             "max_running_requests: int = 0"],
    "sglang/srt/managers/tokenizer_manager.py": [
        'meta_info["spec_verify_ct"] = recv_obj.spec_verify_ct[i]',
        'meta_info["spec_num_correct_drafts"] = num_correct_drafts',
        'meta_info["spec_num_proposed_drafts"] = num_proposed_drafts',
        'meta_info["spec_accept_length"] = (', 'meta_info["spec_cap_length"] = (',
        'meta_info["spec_correct_drafts_histogram"] = (', 'meta_info["spec_cap_lens_histogram"] = recv_obj',
        "obj.normalize_batch_and_arguments()", "labels.update(custom_labels)",  # plugin patch point 3
        '"text": delta_text,', '"text": state.get_text(),', '"completion_tokens": recv_obj.completion_tokens[i],',
    ],
    IO_STRUCT: ["custom_labels: Optional[Dict[str, str]] = None"],
    "sglang/srt/managers/detokenizer_manager.py": ["return output[:end] if no_stop_trim else output[:pos]",
                                                   "incremental_output = output_str[s.sent_offset :]"],
    "sglang/srt/managers/schedule_batch.py": [
        '"type": "stop",  # to match OpenAI API\'s return value', '"type": "length",',
        '"type": "abort",', "self.spec_num_cap_tokens = 0", "reqs: List[Req]",
        "self.spec_correct_drafts_histogram[num_correct_drafts] += 1",
    ],
    "sglang/srt/managers/scheduler.py": ['message = "The request queue is full."',
                                         '"status_code": HTTPStatus.SERVICE_UNAVAILABLE,'],
    "sglang/srt/managers/scheduler_components/batch_result_processor.py": [
        "req.spec_num_cap_tokens += cap_lens[i]"],
    "sglang/srt/sampling/sampling_params.py": ["custom_params: Optional[Dict[str, CustomParamValue]] = None",
                                               "sampling_seed: Optional[int] = None"],
    "sglang/srt/sampling/sampling_batch_info.py": ["if enable_deterministic"],
    "sglang/srt/arg_groups/fields/serving.py": ["incremental_streaming_output: A[", '] = False'],
    "sglang/srt/arg_groups/arg_utils.py": ['return "--" + name.replace("_", "-")'],
    "sglang/srt/environ.py": ['SGLANG_RAGGED_VERIFY_MODE = EnvStr("static")'],
    "sglang/srt/speculative/ragged_verify.py": ['STATIC = "static"', 'CAP_ACCEPT = "cap-accept"',
                                                 'COMPACT = "compact"'],
    "sglang/srt/entrypoints/engine.py": ['mp.set_start_method("spawn", force=True)'],
    SCHEDULE: ["return torch.cumprod(confidence.to(torch.float32), dim=1)", "surv = tl.cumprod(conf, axis=0)",
               "order = order[torch.argsort(-masked_prob[order], stable=True)]"],
    PLANNER: ["verify_lens = ScheduleVerifyLensTopk.execute(", "verify_lens = self._schedule_verify_lens("],
    WORKER: ["layout = self._verify_planner.schedule_layout(", "confidence=confidence,"],
    "sglang/launch_server.py": [],
    "sglang/benchmark/dspark_sps_profiler.py": ['"--base-url",'],
    "sglang/benchmark/dspark_sts_fit.py": ['"--data-glob",'],
}

#: launcher option → field name in srt/arg_groups/fields/<file>.py
LAUNCH_FIELDS = {
    "model.py": ["model_path", "context_length"],
    "spec.py": ["speculative_algorithm", "speculative_draft_model_path", "speculative_dspark_block_size",
                "speculative_dspark_sps_table_path", "speculative_dspark_confidence_sts_path"],
    "serving.py": ["host", "port", "api_key", "incremental_streaming_output"],
    "schedule.py": ["enable_priority_scheduling", "schedule_low_priority_values_first", "max_queued_requests"],
    "exec_.py": ["enable_deterministic_inference"],
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    path = os.environ.get("SPARKGATE_SGLANG_WHEEL")
    if not path:
        out = tmp_path_factory.mktemp("sglang-wheel")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={VERSION}",
                        "-d", str(out)], check=True, timeout=900)
        path = str(next(out.glob(f"sglang-{VERSION}-*.whl")))
    assert f"sglang-{VERSION}-" in Path(path).name
    with zipfile.ZipFile(path) as zf:
        yield zf


def _read(zf: zipfile.ZipFile, name: str) -> str:
    return zf.read(name).decode("utf-8")


def test_contract_matches_api_types(wheel):
    tree = ast.parse(_read(wheel, "sglang/api/v1/api_types.py"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for name, spec in CONTRACT.items():
        node = classes[name]
        fields = {s.target.id: ast.unparse(s.annotation) for s in node.body if isinstance(s, ast.AnnAssign)}
        assert node.lineno == spec["line"], name
        assert f"(unknown keys {spec['unknown']})" in ast.get_docstring(node), name
        assert fields == spec["fields"], name
    aliases = {n.targets[0].id: ast.unparse(n.value) for n in tree.body
               if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    for name, value in ALIASES.items():
        assert aliases[name] == value, name


def _method(tree: ast.Module, cls: str, method: str) -> ast.FunctionDef:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)


def test_plugin_patch_points_exist(wheel):
    for (path, cls, method), (line, positional, kwonly) in PATCH_POINTS.items():
        fn = _method(ast.parse(_read(wheel, path)), cls, method)
        assert fn.lineno == line, (path, method)
        assert [a.arg for a in fn.args.args] == positional, (path, method)
        assert [a.arg for a in fn.args.kwonlyargs] == kwonly, (path, method)
    # and they are the names the plugin patches
    assert {(m.replace(".", "/") + ".py", c, f) for m, c, f in (
        (sla_hook.PLANNER_MODULE, sla_hook.PLANNER_CLASS, sla_hook.PLANNER_METHOD),
        (sla_hook.WORKER_MODULE, sla_hook.WORKER_CLASS, sla_hook.WORKER_METHOD),
        (sla_hook.INPUT_MODULE, sla_hook.INPUT_CLASS, sla_hook.INPUT_METHOD))} == set(PATCH_POINTS)
    assert tuple(PATCH_POINTS[(PLANNER, "DSparkVerifyPlanner", "_schedule_verify_lens")][2]) == sla_hook.PLANNER_KWARGS


def test_source_facts(wheel):
    names = set(wheel.namelist())
    for path, needles in SOURCE_FACTS.items():
        assert path in names, path
        text = _read(wheel, path)
        for needle in needles:
            assert needle in text, (path, needle)
    assert "/get_load" not in _read(wheel, "sglang/srt/entrypoints/http_server.py")


def test_launch_flags_exist(wheel):
    for file, fields in LAUNCH_FIELDS.items():
        tree = ast.parse(_read(wheel, f"sglang/srt/arg_groups/fields/{file}"))
        declared = {s.target.id for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                    for s in n.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        assert set(fields) <= declared, (file, set(fields) - declared)
