"""Emitted engine launches: flags are the engines' real argument names, and the GLM-5.3-Flash rules hold."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from flagdeploy.errors import FlagdeployError
from flagdeploy.planner.emit import ENGINES, ENGINES_FILE, EmitError, emit
from flagdeploy.planner.profile import Profile

# Real argument names, read from vllm/engine/arg_utils.py (EngineArgs.add_cli_args) and
# vllm/entrypoints/openai/cli_args.py. An emitted flag outside this set would make `vllm serve` exit.
VLLM_ARGS = {
    "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--data-parallel-rank",
    "--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
    "--data-parallel-backend", "--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts",
    "--distributed-executor-backend", "--block-size", "--gpu-memory-utilization", "--swap-space",
    "--kv-cache-dtype", "--num-gpu-blocks-override", "--enable-prefix-caching", "--cpu-offload-gb",
    "--calculate-kv-scales", "--max-num-batched-tokens", "--max-num-seqs", "--max-num-partial-prefills",
    "--enable-chunked-prefill", "--scheduling-policy", "--async-scheduling", "--speculative-config",
    "--kv-transfer-config", "--compilation-config", "--additional-config", "--reasoning-parser",
    "--max-model-len", "--quantization", "--served-model-name", "--trust-remote-code", "--dtype",
    "--enforce-eager", "--tokenizer", "--seed", "--load-format", "--port", "--host", "--tool-call-parser",
    "--enable-auto-tool-choice", "--chat-template", "--api-key", "--disable-log-stats",
    "--limit-mm-per-prompt", "--allowed-media-domains",  # vllm/config/multimodal.py, vllm/config/model.py
}
# From python/sglang/srt/server_args.py (ServerArgs.add_cli_args).
SGLANG_ARGS = {
    "--model-path", "--tokenizer-path", "--host", "--port", "--tp-size", "--dp-size", "--ep-size", "--pp-size",
    "--nnodes", "--node-rank", "--dist-init-addr", "--enable-dp-attention", "--enable-dp-lm-head",
    "--moe-a2a-backend", "--deepep-mode", "--context-length", "--max-running-requests", "--max-total-tokens",
    "--chunked-prefill-size", "--max-prefill-tokens", "--page-size", "--kv-cache-dtype", "--quantization",
    "--served-model-name", "--reasoning-parser", "--tool-call-parser", "--mem-fraction-static",
    "--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens", "--attention-backend", "--device", "--trust-remote-code",
    "--disable-cuda-graph", "--cuda-graph-max-bs", "--disable-radix-cache", "--enable-eplb",
    "--ep-num-redundant-experts", "--max-mamba-cache-size", "--mamba-full-memory-ratio", "--dtype",
    "--limit-mm-data-per-request",
}
# MindIE Service config.json keys (MindIE docs: "Configuration Parameters (Service-Specific)", MTP page).
MINDIE_KEYS = {
    "Version", "ServerConfig", "BackendConfig", "LogConfig", "ipAddress", "managementIpAddress", "port",
    "httpsEnabled", "backendName", "modelInstanceNumber", "npuDeviceIds", "tokenizerProcessNumber",
    "multiNodesInferEnabled", "ModelDeployConfig", "maxSeqLen", "maxInputTokenLen", "truncation", "ModelConfig",
    "modelInstanceType", "modelName", "modelWeightPath", "worldSize", "cpuMemSize", "npuMemSize", "backendType",
    "trustRemoteCode", "plugin_params", "ScheduleConfig", "templateType", "templateName", "cacheBlockSize",
    "maxPrefillBatchSize", "maxPrefillTokens", "maxBatchSize", "maxIterTimes", "maxPreemptCount",
}
KNOWN = {"vllm": VLLM_ARGS, "vllm-ascend": VLLM_ARGS, "sglang": SGLANG_ARGS}


def glm(**kw) -> Profile:
    base = dict(model="/models/GLM-5.3-Flash", chip="h200", model_type="glm5_next", devices=8, tp=8,
                served_model_name="glm-5.3-flash", max_model_len=131072, max_num_seqs=32, kv_cache_dtype="bf16")
    return Profile(**(base | kw))


def flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# A profile per engine that exercises most mapped fields on a chip that engine runs on.
MEDIA = dict(limit_mm_per_prompt={"image": 2, "video": 0}, allowed_media_domains=["img.example.com", "cdn.example.com"])
RICH = {
    "vllm": glm(chip="h200", tp=4, dp=2, ep=8, pp=1, mtp=False, quantization="fp8", **MEDIA),
    "vllm-ascend": glm(chip="ascend910c", devices=16, tp=16, ep=16, quantization="w8a8", mtp=True),
    "sglang": glm(chip="h20", devices=4, tp=4, ep=4, mtp=True, quantization="fp8", **MEDIA),
    "mindie": glm(chip="ascend910b", quantization="w8a8", mtp=True, kv_cache_dtype="auto"),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_emitted_names_are_the_engines_own(engine):
    launch = emit(RICH[engine], engine)
    if engine == "mindie":
        assert launch.argv[-1].endswith("mindieservice_daemon")
        (content,) = launch.files.values()

        def keys(node):
            if isinstance(node, dict):
                for k, v in node.items():
                    yield k
                    yield from keys(v)
            elif isinstance(node, list):
                for v in node:
                    yield from keys(v)

        doc = json.loads(content)
        assert set(keys(doc)) <= MINDIE_KEYS
        model = doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
        assert model["modelWeightPath"] == "/models/GLM-5.3-Flash" and model["worldSize"] == 8
        assert doc["BackendConfig"]["npuDeviceIds"] == [list(range(8))]
        assert doc["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] == 131072
        assert "plugin_params" not in model  # MTP is not emitted for MindIE; a warning says what to add by hand
        assert any("MTP is not emitted for MindIE" in w and "plugin_params" in w for w in launch.warnings)
    else:
        emitted = set(flags(launch.argv))
        assert emitted <= KNOWN[engine], emitted - KNOWN[engine]
        assert len(emitted) >= 10


def test_vllm_on_ascend950_fp8_block_512_and_no_quantization():
    for engine in ("vllm", "vllm-ascend"):
        argv = emit(glm(chip="ascend950", quantization="fp8", kv_cache_dtype="fp8"), engine).argv
        assert value(argv, "--block-size") == "512"
        assert "--quantization" not in argv
        assert value(argv, "--kv-cache-dtype") == "fp8"  # 950 has an FP8 KV cache


def test_vllm_ascend_910c_w8a8_gets_quantization_ascend():
    launch = emit(glm(chip="ascend910c", devices=16, tp=16, quantization="w8a8"), "vllm-ascend")
    assert value(launch.argv, "--quantization") == "ascend"
    assert launch.argv[:2] == ["vllm", "serve"]
    assert launch.env["HCCL_OP_EXPANSION_MODE"] == "AIV"
    assert launch.env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, range(16)))


def test_fp8_checkpoint_on_910b_is_rejected():
    with pytest.raises(EmitError, match="no FP8 matmul"):
        emit(glm(chip="ascend910b", quantization="fp8"), "vllm-ascend")


def test_hopper_glm5_fp8_kv_becomes_bf16_with_a_warning():
    for engine, expected in (("vllm", "bfloat16"), ("sglang", "bf16")):
        launch = emit(glm(chip="h200", kv_cache_dtype="fp8"), engine)
        assert value(launch.argv, "--kv-cache-dtype") == expected
        assert "fp8" not in value(launch.argv, "--kv-cache-dtype")
        assert any("Hopper" in w and "FP8 KV" in w for w in launch.warnings)


def test_parallel_layout_maps_per_engine():
    vllm = emit(glm(tp=4, dp=2, ep=8), "vllm").argv
    assert value(vllm, "--tensor-parallel-size") == "4" and value(vllm, "--data-parallel-size") == "2"
    assert "--enable-expert-parallel" in vllm and "--ep-size" not in vllm

    sgl = emit(glm(chip="h20", devices=4, tp=4, ep=4), "sglang").argv
    assert value(sgl, "--tp-size") == "4" and value(sgl, "--ep-size") == "4"
    assert "--dp-size" not in sgl and "--enable-expert-parallel" not in sgl

    # DP attention in SGLang: --tp-size counts the whole group, --dp-size splits attention.
    sgl_dpa = emit(glm(tp=4, dp=2, ep=8), "sglang").argv
    assert value(sgl_dpa, "--tp-size") == "8" and value(sgl_dpa, "--dp-size") == "2"
    assert value(sgl_dpa, "--ep-size") == "8" and "--enable-dp-attention" in sgl_dpa

    plain = emit(glm(tp=8, ep=1), "vllm").argv
    assert "--enable-expert-parallel" not in plain and "--data-parallel-size" not in plain


def test_mtp_is_dropped_under_dp_attention_with_a_warning():
    for engine, spec_flag in (("vllm", "--speculative-config"), ("sglang", "--speculative-algorithm")):
        kept = emit(glm(tp=8, ep=8, mtp=True), engine)
        assert spec_flag in kept.argv
        dropped = emit(glm(tp=4, dp=2, ep=8, mtp=True), engine)
        assert spec_flag not in dropped.argv
        assert any("MTP is disabled" in w for w in dropped.warnings)
    cfg = json.loads(value(emit(glm(mtp=True), "vllm").argv, "--speculative-config"))
    assert cfg["method"] == "mtp"


def test_glm5_parsers_per_engine():
    v = emit(glm(), "vllm").argv
    assert value(v, "--reasoning-parser") == "glm47" and value(v, "--tool-call-parser") == "glm47"
    assert "--enable-auto-tool-choice" in v
    s = emit(glm(), "sglang").argv
    assert value(s, "--reasoning-parser") == "glm45" and value(s, "--tool-call-parser") == "glm47"


def test_engine_chip_mismatch_and_bad_values_are_actionable():
    with pytest.raises(EmitError, match="only on Ascend"):
        emit(glm(chip="h200"), "vllm-ascend")
    with pytest.raises(EmitError, match="only on Ascend"):
        emit(glm(chip="h100"), "mindie")
    with pytest.raises(EmitError, match="one of: auto, bf16, fp8"):  # in the profile's own vocabulary
        emit(glm(kv_cache_dtype="int8"), "sglang")
    sgl_npu = emit(glm(chip="ascend910c", quantization="w8a8"), "sglang").argv
    assert value(sgl_npu, "--device") == "npu" and value(sgl_npu, "--quantization") == "modelslim"


def test_unknown_engine_lists_known_ones():
    with pytest.raises(EmitError) as err:
        emit(glm(), "tensorrt-llm")
    assert isinstance(err.value, FlagdeployError)
    for name in ENGINES:
        assert name in str(err.value)


def test_profile_yaml_round_trips(tmp_path):
    profile = glm(tp=4, dp=2, ep=8, mtp=True, quantization="fp8", reasoning_parser="glm47")
    path = tmp_path / "p.yaml"
    path.write_text(profile.to_yaml())
    assert Profile.load(path) == profile


@pytest.mark.parametrize("engine", ENGINES)
def test_shell_reparses_to_the_same_argv(engine):
    launch = emit(RICH[engine], engine)
    script = launch.shell()
    last = shlex.split(script.rstrip("\n").splitlines()[-1])
    env = dict(tok.split("=", 1) for tok in last[: len(launch.env)])
    assert env == launch.env
    assert last[len(launch.env):] == launch.argv
    for path, content in launch.files.items():
        assert f"cat > {shlex.quote(path)} <<'EOF'\n{content}EOF" in script


def test_every_rule_has_a_source():
    rules = yaml.safe_load(ENGINES_FILE.read_text())["rules"]
    assert all(r["source"].strip() for r in rules)


# ---- MTP speculative decoding: each engine's flags carry K (issue 29) -------------------------------------------


def _spec_config(argv: list[str]) -> dict:
    return json.loads(value(argv, "--speculative-config"))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_flags_carry_k_per_engine(k):
    vllm = emit(glm(mtp=True, num_speculative_tokens=k), "vllm")
    assert _spec_config(vllm.argv) == {"method": "mtp", "num_speculative_tokens": k}
    assert not any("num_speculative_tokens" in w for w in vllm.warnings)

    ascend = emit(glm(chip="ascend910c", devices=16, tp=16, quantization="w8a8", mtp=True, num_speculative_tokens=k),
                  "vllm-ascend")
    # the recipe's draft in eager mode (the main model keeps its graphs), one --speculative-config only
    assert _spec_config(ascend.argv) == {"method": "mtp", "num_speculative_tokens": k, "enforce_eager": True}
    assert ascend.argv.count("--speculative-config") == 1
    assert any("not guarantee" in w for w in ascend.warnings) == (k >= 3)

    sgl = emit(glm(chip="h20", devices=4, tp=4, ep=4, mtp=True, num_speculative_tokens=k), "sglang").argv
    assert value(sgl, "--speculative-algorithm") == "EAGLE" and value(sgl, "--speculative-eagle-topk") == "1"
    assert value(sgl, "--speculative-num-steps") == str(k) and value(sgl, "--speculative-num-draft-tokens") == str(k + 1)
    assert "--speculative-draft-model-path" not in sgl

    for engine in ("vllm", "sglang"):  # no MTP, no speculative flags, whatever K says
        argv = emit(glm(num_speculative_tokens=k), engine).argv
        assert not any(a.startswith("--speculative") for a in argv)


def test_vllm_ascend_refuses_more_than_16_verified_tokens():
    ok = emit(glm(chip="ascend910c", devices=16, tp=16, quantization="w8a8", mtp=True, num_speculative_tokens=15),
              "vllm-ascend")
    assert _spec_config(ok.argv)["num_speculative_tokens"] == 15
    for engine in ("vllm-ascend", "vllm"):  # vllm on an NPU is the same plugin
        with pytest.raises(EmitError) as err:
            emit(glm(chip="ascend910c", devices=16, tp=16, quantization="w8a8", mtp=True, num_speculative_tokens=16), engine)
        text = str(err.value)
        assert "(num_speculative_tokens + 1) <= 16" in text and "npu_fused_infer_attention_score" in text
        assert "verifies 17 tokens" in text and "speculative_decoding.md" in text  # the limit's source
    # on a GPU vLLM has no such limit; without MTP K is not checked
    assert _spec_config(emit(glm(mtp=True, num_speculative_tokens=16), "vllm").argv)["num_speculative_tokens"] == 16
    emit(glm(chip="ascend910c", devices=16, tp=16, quantization="w8a8", num_speculative_tokens=16), "vllm-ascend")


def test_mindie_does_not_emit_mtp_and_says_so():
    launch = emit(glm(chip="ascend910b", quantization="w8a8", mtp=True, num_speculative_tokens=2), "mindie")
    (content,) = launch.files.values()
    assert "plugin_params" not in content and "mtp" not in content
    (warning,) = [w for w in launch.warnings if "MTP" in w]
    assert "not emitted" in warning and '"num_speculative_tokens":2' in warning and "mindie-mtp-not-emitted" in warning


def test_profile_round_trips_num_speculative_tokens(tmp_path):
    profile = glm(mtp=True, num_speculative_tokens=2)
    path = tmp_path / "p.yaml"
    profile.save(path)
    assert "num_speculative_tokens: 2" in path.read_text()
    back = Profile.load(path)
    assert back == profile and _spec_config(emit(back, "vllm").argv)["num_speculative_tokens"] == 2
    # a profile written before the field existed still loads, with serve's default K
    path.write_text(path.read_text().replace("  num_speculative_tokens: 2\n", ""))
    assert Profile.load(path).num_speculative_tokens == 3
