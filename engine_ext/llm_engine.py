"""The synchronous engine: `step()` = schedule -> plan -> plain step or speculative cycle -> emit; `generate()`
loops over it."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from .adapter_manager import AdapterManager
from .block_manager import BlockManager, blocks_for
from .config import EngineConfig, SpecConfig
from .errors import PromptTooLongError
from .lora_adapter import AdapterError
from .model_config import load_model_spec
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import RequestOutput, Sequence
from .speculation import DraftCycle, Gate, NoSpeculation, Plan, StepResult
from .stats import EngineStats
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        if config.model is None:
            raise ValueError("EngineConfig.model is None: an engine needs the model's directory")
        self.config = config
        self.device = torch.device(config.device)
        self.spec = load_model_spec(config.model)
        self.tokenizer = load_tokenizer(config.model)
        # Derived once: the context limit, and the drafting room past it (a draft may sit `lookahead` beyond)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        self.lookahead = config.speculative.num_draft_tokens if config.speculative else 0
        self.runner = ModelRunner(config, self.spec, self.device, max_model_len=self.max_model_len,
                                  lookahead=self.lookahead)
        self.counters = EngineStats()
        self.adapters = AdapterManager(self.spec, config.model, config.max_loras, config.max_cpu_loras,
                                       config.max_lora_rank, config.torch_dtype, self.device, self.counters)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, self.adapters, config.max_num_seqs, config.max_num_batched_tokens)
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.seqs: dict[str, Sequence] = {}
        # Set by a serving loop: adds the requests that arrived since it last added any (add_request). A
        # speculative cycle calls it between its passes, and what it admits runs in the cycle's next pass instead
        # of waiting for the next step (DraftCycle.run's `join`).
        self.intake: Callable[[], None] | None = None
        # Set by a serving loop: takes outputs published during a step, before step() returns them (a prompt's
        # first token computed in a cycle's drafting pass). step() then returns only what came after.
        self.publish: Callable[[list[RequestOutput]], None] | None = None
        self._removals_seen = 0
        self._ids = itertools.count()
        self.set_speculation(config.speculative)
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

    def pin_adapter(self, name: str, pinned: bool) -> None:
        """A pinned adapter is never evicted from host memory or from its device slot."""
        self.adapters.set_pinned(name, pinned)

    def host_adapters(self) -> list[str]:
        """The adapters parsed in host memory now, least recently used first (the engine's host cache)."""
        return self.adapters.host_resident

    def set_host_eviction(self, choose: Callable[[list[str]], str | None]) -> None:
        """Which adapter leaves host memory when more than `max_cpu_loras` are parsed: `choose(candidates)`
        (unpinned, least recently used first) -> one of them, or None to keep them all for now."""
        self.adapters.host_eviction = choose

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
            raise PromptTooLongError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                                     f"{self.max_model_len}", len(prompt_token_ids), self.max_model_len)
        if blocks_for(len(prompt_token_ids) + 1 + self.lookahead, self.config.block_size) > self.blocks.num_blocks:
            raise PromptTooLongError(f"prompt needs more KV blocks than the cache has ({self.blocks.num_blocks})",
                                     len(prompt_token_ids), self.blocks.num_blocks * self.config.block_size
                                     - 1 - self.lookahead)
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
        self.counters.usage(adapter_name).requests += 1
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
        batch = self.scheduler.schedule(lookahead=self.gate.lookahead)
        plan = self.gate.plan(batch)
        result = self.cycle.run(plan, self._joiner(batch)) if plan.speculate else self._plain_step(plan)
        self.scheduler.trim(batch)  # drafting room nothing was written to goes back
        self.adapters.slots.flush()  # a copy activated in a step that ran no forward (the runner flushes after one)
        self.counters.steps += 1
        outputs = self._emit(batch.seqs)
        self.gate.observe(plan, result, time.perf_counter() - start)  # priced by the whole step, emitting included
        return outputs

    def _joiner(self, batch: ScheduledBatch) -> Callable[[], list[Sequence]] | None:
        """What a cycle calls between passes to take in arrivals and admit them into its batch (None: nothing
        can arrive during a step)."""
        if self.intake is None:
            return None

        def join() -> list[Sequence]:
            self.intake()
            return self.scheduler.admit(batch) if self.scheduler.waiting else []

        return join

    def _plain_step(self, plan: Plan) -> StepResult:
        """One adapter-on forward over the scheduled sequences; one new token each."""
        seqs = plan.seqs
        if seqs:
            slots = self.adapters.slots
            logits = self.runner.run([s.work(slots.lora_slot(s.adapter)) for s in seqs], slots)
            tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator, seqs)
            for seq, token, row in zip(seqs, tokens.tolist(), logits):
                seq.num_computed = seq.num_tokens
                self._commit(seq, token, row)
        return StepResult()

    def _commit(self, seq: Sequence, token: int, logits: torch.Tensor | None = None, finish: bool = True) -> bool:
        """Append a final token to a sequence; True if it finished. finish=False: a sequence that ends is left
        to the caller to hand back to the scheduler (DraftCycle, once no queued pass writes its blocks)."""
        self.counters.usage(seq.adapter).tokens += 1
        if self.outputs.append(seq, token, logits):
            if finish:
                self.scheduler.finish(seq)
            return True
        return False

    def _publish_early(self, seqs: list[Sequence]) -> None:
        """Hand the new tokens of running sequences to the serving loop mid-step (`publish`)."""
        if self.publish is not None and seqs:
            self.publish([self.outputs.output(s, False) for s in seqs])

    def set_speculation(self, spec: SpecConfig | None) -> None:
        """Switch speculative drafting on (a fresh gate: nothing measured yet) or off (None). Its draft length
        may not exceed the drafting room the engine was built with (`EngineConfig.speculative`)."""
        if spec is not None and spec.num_draft_tokens > self.lookahead:
            raise ValueError(f"num_draft_tokens {spec.num_draft_tokens} exceeds the engine's lookahead "
                             f"{self.lookahead} (set EngineConfig.speculative)")
        self.counters.spec = None
        self.gate = NoSpeculation() if spec is None else Gate(
            spec, max_model_len=self.max_model_len, capturing=self.runner.capturing, stats=self.counters)
        self.cycle = None if spec is None else DraftCycle(
            self.runner, self.adapters.slots, self._commit, self.generator, self.max_model_len, self.counters.spec,
            max_rows=self.config.max_num_seqs, publish=self._publish_early, finish=self.scheduler.finish,
            pass_tokens=self.config.max_graph_tokens if self.config.cuda_graphs else None)

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
        """Outputs of the sequences this step touched and of those that finished (aborts included)."""
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
        """The engine's counters (EngineStats) and its gauges, as plain data."""
        return self.counters.snapshot(self.gate.estimates()) | {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "free_kv_blocks": self.blocks.num_free,
            "total_kv_blocks": self.blocks.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "startup": dict(self.startup),  # seconds: load_s, graph_capture_s, eager_warmup_s, total_s
            "device_adapters": self.adapters.slots.resident,
            "host_adapters": self.adapters.host_resident,
        }
