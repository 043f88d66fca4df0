import pytest
from pydantic import ValidationError

from deployments.config import DEFAULT_API_KEY, AppConfig, load_config


def test_defaults_need_no_configuration():
    cfg = load_config({}, env={})
    assert cfg.model is None and cfg.num_replicas == 2 and cfg.engine["device"] == "cpu"
    assert cfg.api_keys == {DEFAULT_API_KEY: "default"} and cfg.uses_default_admin_token()


def test_precedence_yaml_env_args(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("num_replicas: 4\nmax_loras: 4\ntenant_rate: {rate: 1, burst: 2}\n")
    env = {"LORASERVE_CONFIG": str(path), "LORASERVE_NUM_REPLICAS": "3",
           "LORASERVE_API_KEYS": '{"sk-acme-000001": "acme"}', "LORASERVE_ADMIN_TOKEN": "s3cret-admin"}
    cfg = load_config({"max_loras": "2"}, env=env)
    assert cfg.num_replicas == 3 and cfg.engine["max_loras"] == 2 and cfg.tenant_rate.burst == 2
    assert cfg.api_keys == {"sk-acme-000001": "acme"} and not cfg.uses_default_admin_token()


@pytest.mark.parametrize(
    "bad",
    [
        {"num_replicas": 0},
        {"typo_field": 1},
        {"num_gpus_per_replica": 1, "device": "cpu"},  # GPUs need device=cuda
        {"max_loras": 8, "max_cpu_loras": 4},
        {"api_keys": {}},
        {"api_keys": {"short": "t"}},
        {"admin_prefix": "/v1"},
        {"admin_token": "x"},
        {"tenant_rate": {"rate": 0, "burst": 1}},
    ],
)
def test_invalid_config_is_refused(bad):
    with pytest.raises(ValidationError):
        AppConfig.model_validate(bad)


def test_a_refused_config_is_one_line_naming_the_field():
    from deployments.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config({"api_keys": {"short": "t"}}, env={})
    assert str(e.value) == "invalid configuration: api_keys: API keys need >= 8 characters and a non-empty tenant"
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no pydantic report chained to it
    with pytest.raises(ConfigError, match="placement: pinned_share and warm_share"):
        load_config({"placement": {"pinned_share": 0.9}}, env={})
    with pytest.raises(ConfigError, match="router.nope"):
        load_config({"router": {"nope": 1}}, env={})


def test_placement_and_router_sections_are_their_config_classes():
    from router.placement import PlacementConfig
    from router.policy import AffinityConfig

    cfg = load_config({"placement": {"half_life_s": 120.0}, "router": {"saturation": 0.5}}, env={})
    assert cfg.placement == PlacementConfig(half_life_s=120.0) and cfg.router == AffinityConfig(saturation=0.5)
    again = AppConfig.model_validate(cfg.model_dump(mode="json"))  # what each deployment receives
    assert again.placement == cfg.placement and again.router == cfg.router


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ValueError):
        load_config({}, env={"LORASERVE_CONFIG": str(path)})


# ------------------------------------------------------------------ the engine section


def test_default_app_decodes_speculatively_with_the_gate():
    cfg = load_config({}, env={})
    assert cfg.engine["speculative"]["num_draft_tokens"] == 4 and cfg.engine["speculative"]["gate"] is True
    assert cfg.engine["device"] == "cpu" and cfg.engine["dtype"] == "float32"


def test_engine_section_holds_every_engine_field_resolved():
    from deployments.engine_settings import engine_fields

    cfg = load_config({}, env={})
    assert set(cfg.engine) == set(engine_fields()) and "model" not in cfg.engine
    again = AppConfig.model_validate(cfg.model_dump(mode="json"))  # what a replica receives
    assert again.engine == cfg.engine


def test_engine_fields_from_yaml_env_and_args_merge_field_by_field(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  max_num_seqs: 32\n  seed: 7\n  kernels: {attn_warps: 8}\nmax_loras: 4\n")
    env = {"LORASERVE_CONFIG": str(path), "LORASERVE_ENGINE": '{"seed": 8, "max_model_len": 512}',
           "LORASERVE_ENGINE_SEED": "9", "LORASERVE_ENGINE_SPECULATIVE": '{"num_draft_tokens": 2}'}
    # serve run deployments.app engine='{"debug_checks": true}' engine.max_graph_tokens=64
    cfg = load_config({"engine": '{"debug_checks": true}', "engine.max_graph_tokens": "64"}, env=env)
    e = cfg.engine
    assert (e["max_num_seqs"], e["seed"], e["max_model_len"], e["max_loras"]) == (32, 9, 512, 4)
    assert e["kernels"]["attn_warps"] == 8 and e["speculative"]["num_draft_tokens"] == 2
    assert e["speculative"]["gate"] is True and e["debug_checks"] is True and e["max_graph_tokens"] == 64
    assert load_config({"engine.speculative": "null"}, env={}).engine["speculative"] is None


def test_engine_config_is_built_from_the_section(tmp_path):
    from deployments.engine_settings import engine_config
    from engine_ext import EngineConfig, SpecConfig

    cfg = load_config({"engine": {"max_model_len": 256, "compile_cache_dir": str(tmp_path), "warmup": False}}, env={})
    ec = engine_config(cfg, str(tmp_path))
    assert isinstance(ec, EngineConfig) and ec.model == str(tmp_path) and ec.max_model_len == 256
    assert ec.compile_cache_dir == str(tmp_path) and ec.warmup is False
    assert ec.speculative == SpecConfig(num_draft_tokens=4, gate=True)


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"typo": 1}, "unknown field(s) ['typo']"),
        ({"model": "/x"}, "top-level `model`"),
        ({"speculative": {"k": 4}}, "engine.speculative: unknown field(s) ['k']"),
        ({"speculative": {"num_draft_tokens": 40}}, "num_draft_tokens must be in 1..16"),
        ({"speculative": {"draft_lead": -1}}, "draft_lead must be in 0..16"),
        ({"lora_backend": "fast"}, "unknown lora_backend 'fast'"),
        ({"cuda_graphs": True}, "cuda_graphs needs a CUDA device"),
        ({"max_loras": "many"}, "engine.max_loras must be int"),
        ({"warmup": "yes"}, "engine.warmup must be bool"),
        ({"kernels": {"attn_warps": 3}}, "attn_warps"),
        ({"dtype": "float8"}, "dtype must be one of"),
        ({"quantization": "int4"}, "unknown quantization 'int4'"),
        ({"quantization": 8}, "engine.quantization must be str | None"),
        ({"max_loras": 8, "max_cpu_loras": 4}, "max_cpu_loras must be >= max_loras"),
    ],
)
def test_bad_engine_field_fails_at_config_load_with_its_name(engine, message):
    with pytest.raises(ValueError) as err:
        load_config({"engine": engine}, env={})
    assert message in str(err.value)


def test_fp8_weights_are_an_engine_setting_off_by_default_in_both_profiles(tmp_path):
    from deployments.engine_settings import engine_config, resolve_engine

    assert resolve_engine({})["quantization"] is None and resolve_engine({}, num_gpus=1)["quantization"] is None
    assert resolve_engine({"quantization": "fp8"}, num_gpus=1)["quantization"] == "fp8"
    cfg = load_config({"engine.quantization": "fp8"}, env={})  # as `serve run deployments.app engine.quantization=fp8`
    assert engine_config(cfg, str(tmp_path)).quantization == "fp8"
    assert load_config({"engine.quantization": "null"}, env={}).engine["quantization"] is None


def test_adapter_slots_start_16_wide_and_null_starts_them_at_max_lora_rank(tmp_path):
    from deployments.engine_settings import engine_config, resolve_engine

    assert resolve_engine({})["lora_slot_rank"] == 16 and resolve_engine({}, num_gpus=1)["lora_slot_rank"] == 16
    cfg = load_config({"engine.lora_slot_rank": "null"}, env={})  # `serve run deployments.app ...=null`
    assert engine_config(cfg, str(tmp_path)).lora_slot_rank is None
    assert engine_config(load_config({"engine.lora_slot_rank": "32"}, env={}), str(tmp_path)).lora_slot_rank == 32


def test_flat_aliases_move_into_the_engine_section_and_may_not_disagree():
    cfg = load_config({"device": "cuda", "dtype": "float16", "num_gpus_per_replica": 1, "max_loras": 16,
                       "max_cpu_loras": 128}, env={})
    assert (cfg.engine["device"], cfg.engine["dtype"], cfg.max_loras, cfg.max_cpu_loras) == ("cuda", "float16", 16, 128)
    with pytest.raises(ValueError, match="set twice"):
        load_config({"max_loras": 4, "engine": {"max_loras": 5}}, env={})


def test_profiles_fast_path_on_cuda_and_speculation_everywhere():
    from deployments.engine_settings import engine_profile, resolve_engine

    cuda, cpu = engine_profile("cuda"), engine_profile("cpu")
    assert {k: cuda[k] for k in ("lora_backend", "attn_backend", "layer_ops", "cuda_graphs", "dtype")} == {
        "lora_backend": "triton", "attn_backend": "triton", "layer_ops": "triton", "cuda_graphs": True,
        "dtype": "bfloat16"}
    assert cuda["speculative"] == cpu["speculative"] == {"num_draft_tokens": 4, "gate": True}
    # prefix caching: on in both profiles (measured on the CPU and on the H200)
    assert cpu["enable_prefix_caching"] is True and cuda["enable_prefix_caching"] is True
    assert resolve_engine({"enable_prefix_caching": False})["enable_prefix_caching"] is False
    assert resolve_engine({"enable_prefix_caching": False}, num_gpus=1)["enable_prefix_caching"] is False
    assert "cuda_graphs" not in cpu and cpu["dtype"] == "float32"
    # A replica with a GPU gets the CUDA profile without naming the device (resolving needs no GPU)
    gpu = resolve_engine({}, num_gpus=1)
    assert gpu["device"] == "cuda" and gpu["cuda_graphs"] and gpu["lora_backend"] == "triton"
    # what the user sets wins, and the profile yields where its defaults depend on it
    mine = resolve_engine({"attn_backend": "torch", "dtype": "float32", "speculative": None}, num_gpus=1)
    assert mine["attn_backend"] == "torch" and mine["cuda_graphs"] is False and mine["layer_ops"] == "triton"
    assert mine["dtype"] == "float32" and mine["speculative"] is None
    assert resolve_engine(gpu, num_gpus=1) == gpu  # resolving resolved settings changes nothing
