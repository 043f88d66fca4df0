"""The replica's server class on the GPU, built from an app config exactly as the deployment builds it (no Ray):
the engine it runs is the fast path (Triton kernels, CUDA graphs, bf16) with speculation gated, and its decode
throughput on bench/decode.py's engine mix (batch 32, 32 distinct near rank-16 adapters, 64-token prompts, 256
generated tokens, peaked 1B-shape base) is within 10% of the engine figure bench/decode.py measures, in one run.

The GPU machine has no Ray; the deployment's config needs pydantic and pydantic-settings (carry their wheels onto
the device if the image lacks them: `pip download pydantic pydantic-settings -d wheels` here, `pip install
--no-index --find-links wheels pydantic pydantic-settings` there; bench/gpu_run.sh's server step does it)."""

import asyncio
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
pytest.importorskip("pydantic")
pytest.importorskip("pydantic_settings")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from bench.common import build_random_adapter  # noqa: E402
from bench.decode import build_engine, build_model_on_gpu, engine_mode  # noqa: E402
from deployments.bootstrap import bootstrap, make_registry, sha256_of_dir  # noqa: E402
from deployments.config import load_config  # noqa: E402
from deployments.engine_settings import engine_config  # noqa: E402
from deployments.replica.llm_server import LLMServer  # noqa: E402
from deployments.data_plane.protocol import GenerateRequest  # noqa: E402
from engine_ext import AsyncLLMEngine, SpecConfig  # noqa: E402

SHAPE, RANK, BATCH, PROMPT, GEN = "llama-3.2-1b", 16, 32, 64, 256
# A window of 64 generated tokens lasts ~0.1 s on the H200 and swings by 5-10% (a collector pass, a late wake-up,
# the last stream's delivery): the windows are 256 tokens long, and each side is the median of several.
REPEATS = 5


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-fast-path")
    model = build_model_on_gpu(str(root / "model"), SHAPE, residual_scale=0.001)  # bench's --peaked base
    adapters = {f"n{i}": build_random_adapter(str(root / "in" / f"n{i}"), SHAPE, RANK, seed=i, scale=0.1)
                for i in range(BATCH)}
    return root, model, adapters


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(BATCH)  # as bench.decode.engine_mode draws them
    return [torch.randint(10, min(100000, vocab), (PROMPT,), generator=g).tolist() for _ in range(BATCH)]


async def _decode_window(server: LLMServer, keys: list[str], prompts: list[list[int]]) -> float:
    """Tokens per second after every request has its first token, as bench's measure_decode counts them."""
    sampling = {"max_tokens": GEN, "temperature": 0.0, "ignore_eos": True}
    started, counted, window = set(), [0], [None]

    async def one(i: int, key: str, prompt: list[int]) -> None:
        req = GenerateRequest(request_id=f"r{time.monotonic_ns()}-{i}", adapter_key=key, sampling=sampling,
                              prompt_token_ids=prompt)
        async for chunk in server.generate(req):
            assert chunk["type"] != "error", chunk
            if chunk["type"] != "delta":
                continue
            if window[0] is not None:
                counted[0] += chunk["num_tokens"]
            elif i not in started:
                started.add(i)
                if len(started) == len(keys):
                    window[0] = time.perf_counter()

    await asyncio.gather(*(one(i, k, p) for i, (k, p) in enumerate(zip(keys, prompts))))
    return counted[0] / (time.perf_counter() - window[0])


def test_server_runs_the_fast_speculative_path_at_the_engine_figure(workload, tmp_path):
    root, model, adapters = workload
    registry = {"registry_db": str(tmp_path / "r.db"), "blob_dir": str(tmp_path / "blobs"),
                "materialize_dir": str(tmp_path / "mat"), "allowed_local_roots": [str(root / "in")]}
    # What a GPU deployment sets: the model (named as its adapters name it), a GPU per replica, sizes; the
    # engine's profile does the rest.
    cfg = bootstrap(load_config({"model": model, "base_model_name": "random", "registry": registry,
                                 "num_gpus_per_replica": 1, "register_demo_adapters": False,
                                 "engine": {"max_loras": BATCH + 1, "max_lora_rank": RANK, "max_cpu_loras": 64,
                                            "kv_cache_memory_gb": 24, "max_num_seqs": 128,
                                            "max_num_batched_tokens": 8192, "max_model_len": 2048}}, env={}))
    engine_cfg = engine_config(cfg, model)
    assert (engine_cfg.device, engine_cfg.dtype, engine_cfg.cuda_graphs) == ("cuda", "bfloat16", True)
    assert {engine_cfg.lora_backend, engine_cfg.attn_backend, engine_cfg.layer_ops} == {"triton"}
    assert engine_cfg.speculative is not None and engine_cfg.speculative.gate

    reg = make_registry(cfg)
    keys = []
    for name, path in adapters.items():
        rec = reg.register(name, path, sha256_of_dir(Path(path)), cfg.base_model_name, actor="test", activate=True)
        keys.append(f"{name}@{rec.version}")
    # Both engines live side by side and their windows alternate, so drift in the machine's speed over the run
    # (clocks, the allocator, the collector) falls on both alike.
    bench_engine = build_engine(model, adapters, max_loras=BATCH + 1, max_rank=RANK, max_graph_tokens=512)
    engine = AsyncLLMEngine(engine_cfg)
    server = LLMServer(cfg, engine, reg, "gpu-test", None)
    prompts = _prompts(bench_engine.spec.vocab_size)  # the same model's

    async def alternate() -> tuple[list[float], list[float]]:
        await server.start()
        try:
            await _decode_window(server, keys, prompts)  # adapters loaded, the gate warmed, as in bench's warm mode
            served, figures = [], []
            for _ in range(REPEATS):
                served.append(await _decode_window(server, keys, prompts))
                # bench/decode.py's engine mode, on the event loop's thread while the server is idle
                figures.append(engine_mode(bench_engine, SpecConfig(num_draft_tokens=4, gate=True), BATCH,
                                           list(adapters), GEN, PROMPT, warm=True)["tokens_per_s"])
            return served, figures
        finally:
            await server.stop()

    served_runs, figures = asyncio.run(alternate())
    stats = engine.stats()
    engine.shutdown()
    reg.close()
    served, figure = statistics.median(served_runs), statistics.median(figures)
    print(f"server {served:.0f} tok/s, bench/decode.py engine figure {figure:.0f} tok/s ({served / figure - 1:+.1%}); "
          f"medians of {REPEATS} alternating windows: server {[round(t) for t in served_runs]}, "
          f"engine {[round(t) for t in figures]}")
    assert stats["speculative"]["cycles"] > 0  # it drafted
    assert served >= 0.9 * figure, (served, figure)
    shutil.rmtree(tmp_path / "blobs", ignore_errors=True)
