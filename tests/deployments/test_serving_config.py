import pytest
from pydantic import ValidationError

from deployments.config import DEFAULT_API_KEY, AppConfig, load_config


def test_defaults_need_no_configuration():
    cfg = load_config({}, env={})
    assert cfg.model is None and cfg.num_replicas == 2 and cfg.device == "cpu"
    assert cfg.api_keys == {DEFAULT_API_KEY: "default"} and cfg.uses_default_admin_token()


def test_precedence_yaml_env_args(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("num_replicas: 4\nmax_loras: 4\ntenant_rate: {rate: 1, burst: 2}\n")
    env = {"LORASERVE_CONFIG": str(path), "LORASERVE_NUM_REPLICAS": "3",
           "LORASERVE_API_KEYS": '{"sk-acme-000001": "acme"}', "LORASERVE_ADMIN_TOKEN": "s3cret-admin"}
    cfg = load_config({"max_loras": "2"}, env=env)
    assert cfg.num_replicas == 3 and cfg.max_loras == 2 and cfg.tenant_rate.burst == 2
    assert cfg.api_keys == {"sk-acme-000001": "acme"} and not cfg.uses_default_admin_token()


@pytest.mark.parametrize(
    "bad",
    [
        {"num_replicas": 0},
        {"typo_field": 1},
        {"num_gpus_per_replica": 1},  # needs device=cuda
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


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ValueError):
        load_config({}, env={"LORASERVE_CONFIG": str(path)})
