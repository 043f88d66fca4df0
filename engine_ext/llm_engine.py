"""The synchronous engine: `step()` = schedule -> run -> postprocess; `generate()` loops over it."""

from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from .adapter_manager import AdapterManager
from .batch import SeqWork
from .block_manager import BlockManager, blocks_for
from .config import EngineConfig
from .lora_adapter import AdapterError
from .model_config import load_model_spec
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: str):
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        self.config = config
        self.device = torch.device(config.device)
        self.spec = load_model_spec(config.model)
        self.tokenizer = load_tokenizer(config.model)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        self.lookahead = config.speculative.num_draft_tokens if config.speculative else 0
        self.runner = ModelRunner(config, self.spec, self.device, max_model_len=self.max_model_len,
                                  lookahead=self.lookahead)
        self.adapters = AdapterManager(self.spec, config.model, config.max_loras, config.max_cpu_loras,
                                       config.max_lora_rank, config.torch_dtype, self.device)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, self.adapters, config.max_num_seqs, config.max_num_batched_tokens)
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.base_counters = {"requests": 0, "tokens": 0}
        self.num_steps = 0
        self._removals_seen = 0
        self._ids = itertools.count()
        self.speculator = None
        if config.speculative is not None:
            from .speculative import Speculator

            self.speculator = Speculator(self, config.speculative)  # wraps step(); see speculative.py
        # Ready only once every kernel the steps can launch is compiled and every CUDA graph captured.
        self.startup = {"load_s": time.perf_counter() - start}
        if config.warmup:
            self.startup |= self.runner.warm_up(self.adapters.slots, self.blocks, config.max_num_batched_tokens)
        self.startup["total_s"] = time.perf_counter() - start
        logger.info("engine ready in %.1f s (%s)", self.startup["total_s"],
                    ", ".join(f"{k} {v:.1f}" for k, v in self.startup.items() if k != "total_s"))

    # ---------------------------------------------------------------- adapters
    def add_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Parse, validate and cache an adapter in host memory. Raises AdapterError (a ValueError)."""
        self.adapters.add(name, path, pinned)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter: waiting requests for it end with "abort"; running ones finish on it, and its
        device slot is freed as soon as none uses it (at once when idle)."""
        self.adapters.remove(name)
        self._fail_orphans()

    def has_adapter(self, name: str) -> bool:
        return self.adapters.known(name)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, sampling_params: SamplingParams | None = None,
                    adapter_name: str | None = None, share_prompt_with: str | None = None) -> str:
        """`share_prompt_with`: the id of a request in flight with the same prompt and adapter (another sample of
        one API request): this one reuses its prompt's KV blocks instead of computing them again. Ignored when
        that request is gone or differs."""
        params = sampling_params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None or self.tokenizer is None:
                raise ValueError("give prompt_token_ids, or a text prompt for a model with a tokenizer")
            prompt_token_ids = self.tokenizer(prompt)["input_ids"]
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.spec.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}")
        lookahead = self.speculator.lookahead if self.speculator else 0
        if blocks_for(len(prompt_token_ids) + 1 + lookahead, self.config.block_size) > self.blocks.num_blocks:
            raise ValueError(f"prompt needs more KV blocks than the cache has ({self.blocks.num_blocks})")
        params.check_vocab(self.spec.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer")
        if adapter_name is not None and not self.adapters.known(adapter_name):
            raise AdapterError(adapter_name, "unknown adapter (add it with add_adapter first)")
        seq = Sequence(request_id, prompt_token_ids, params, adapter_name)
        source = self.seqs.get(share_prompt_with) if share_prompt_with is not None else None
        if source is not None and source.prompt_token_ids == prompt_token_ids and source.adapter == adapter_name:
            seq.prompt_source = source
        if params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        if adapter_name is None:
            self.base_counters["requests"] += 1
        else:
            self.adapters.counters[adapter_name].requests += 1
        return request_id

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.scheduler.finished)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self._fail_orphans()
        if self.speculator is not None:
            touched = self.speculator.step()
        else:
            touched = self.run_plain(self.scheduler.schedule().seqs)
        self.adapters.slots.flush()  # a copy activated in a step that ran no forward (the runner flushes after one)
        self.num_steps += 1
        outputs = self._emit(touched)
        if self.speculator is not None:  # the gate prices plain steps and cycles by the whole step
            self.speculator.step_done(time.perf_counter() - start)
        return outputs

    def run_plain(self, seqs: list[Sequence]) -> list[Sequence]:
        """One adapter-on forward over the scheduled sequences; one new token each."""
        if not seqs:
            return []
        logits = self.runner.run([self.work_item(s) for s in seqs], self.adapters.slots)
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator, seqs)
        for seq, token, row in zip(seqs, tokens.tolist(), logits):
            seq.num_computed = seq.num_tokens
            self.commit(seq, token, row)
        return seqs

    def work_item(self, seq: Sequence, extra: list[int] = (), num_logits: int = 1) -> SeqWork:
        """Compute every position not yet in the cache, plus `extra` tokens appended after them."""
        return SeqWork(token_ids=seq.token_ids[seq.num_computed :] + list(extra), start=seq.num_computed,
                       block_table=seq.block_table, lora_slot=self.adapters.slot_of(seq.adapter),
                       num_logits=num_logits)

    def commit(self, seq: Sequence, token: int, logits: torch.Tensor | None = None) -> bool:
        """Append a final token to a sequence; True if it finished."""
        if seq.adapter is None:
            self.base_counters["tokens"] += 1
        else:
            self.adapters.counters[seq.adapter].tokens += 1
        if self.outputs.append(seq, token, logits):
            self.scheduler.finish(seq)
            return True
        return False

    def _fail_orphans(self) -> None:
        """Requests for an adapter removed while they waited end with "abort"; its slot is freed once idle."""
        if self.adapters.removals == self._removals_seen:
            return
        for seq in list(self.scheduler.waiting):
            if seq.adapter is not None and not self.adapters.known(seq.adapter):
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if self.adapters.evict_unknown(self.scheduler.busy_adapters()):
            self._removals_seen = self.adapters.removals

    def _emit(self, touched: list[Sequence]) -> list[RequestOutput]:
        outs, seen = [], set()
        finished, self.scheduler.finished = self.scheduler.finished, []
        for seq in touched + finished:
            if seq.request_id in seen:
                continue
            seen.add(seq.request_id)
            outs.append(self.outputs.output(seq, seq.finished))
            if seq.finished:
                self.seqs.pop(seq.request_id, None)
        return outs

    def generate(self, prompts: list[str] | None = None, prompt_token_ids: list[list[int]] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 adapter_names: list[str | None] | None = None) -> list[RequestOutput]:
        n = len(prompts) if prompts is not None else len(prompt_token_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * n
        adapters = adapter_names or [None] * n
        ids = []
        for i in range(n):
            ids.append(self.add_request(
                prompt=prompts[i] if prompts is not None else None,
                prompt_token_ids=prompt_token_ids[i] if prompt_token_ids is not None else None,
                sampling_params=params[i], adapter_name=adapters[i]))
        final: dict[str, RequestOutput] = {}
        while len(final) < n:
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        adapters = {}
        for name, c in list(self.adapters.counters.items()):
            entry = dict(vars(c))
            if self.speculator is not None:
                entry.update(self.speculator.adapter_stats(name))
            adapters[name] = entry
        out = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "free_kv_blocks": self.blocks.num_free,
            "total_kv_blocks": self.blocks.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "startup": dict(self.startup),  # seconds: load_s, graph_capture_s, eager_warmup_s, total_s
            "device_adapters": self.adapters.slots.resident,
            "host_adapters": self.adapters.host_resident,
            "base": dict(self.base_counters),
            "adapters": adapters,
        }
        if self.speculator is not None:
            out["speculative"] = self.speculator.global_stats()
        return out
