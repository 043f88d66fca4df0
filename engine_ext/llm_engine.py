"""The synchronous engine. `step()` queues the next step on the device (schedule -> plan -> launch: a plain step or
a speculative cycle, one executor for both; the scheduler applies what it queued), then reads the step before it
(append its tokens, stops, outputs; the scheduler updates its sequences' progress from it): the host reads a step's
tokens one step late, while the device runs the next one, whose inputs come from those tokens on the device.
`generate()` loops over it."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .adapter_manager import AdapterManager
from .block_manager import BlockManager, blocks_for
from .config import EngineConfig, SpecConfig
from .errors import PromptTooLongError
from .executor import Step, StepExecutor
from .flight import Flight
from .lora_adapter import AdapterError
from .model_config import load_model_spec
from .parallel.ranks import build_ranks
from .output_processor import OutputProcessor
from .prefix_cache import root_hash
from .quantized_checkpoint import check_checkpoint
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import RequestOutput, Sequence
from .speculation import Gate, NoSpeculation, Plan, StepResult
from .speculation.cycle import prompt_row, rows_for
from .stats import EngineStats, PrefixCacheStats
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class StepContext:
    """What a serving loop hands each step: `arrivals` adds the requests that arrived since it last did
    (add_request), called between a cycle's drafting passes so that they join the passes left; `publish` takes
    outputs as soon as they exist (a prompt's first token drawn in a drafting pass), before step() returns the rest.
    Without `publish` those outputs come back from step() with the others."""

    arrivals: Callable[[], None] | None = None
    publish: Callable[[list[RequestOutput]], None] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, *, detokenize: bool = True):
        """detokenize: False for an engine core whose client detokenizes (core/): step() returns TokenDelta's,
        not RequestOutputs, and requests may not carry stop strings (the client applies them)."""
        start = time.perf_counter()
        if config.model is None:
            raise ValueError("EngineConfig.model is None: an engine needs the model's directory")
        self.config = config
        self.device = torch.device(config.device)
        self.spec = load_model_spec(config.model)
        check_checkpoint(config.quantization, config.model)  # a quantized checkpoint: served as stored, or refused
        self.tokenizer = load_tokenizer(config.model)
        # Derived once: the context limit, the drafting room past a sequence's tokens, and the positions past the
        # limit a forward may touch: drafts, from where a step queued and not read yet may have left a sequence.
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        self.lookahead = config.speculative.num_draft_tokens if config.speculative else 0
        # One runner, or rank 0 of config.tensor_parallel_size (its worker ranks started here, stopped by close())
        self.ranks = build_ranks(config, self.spec, self.device, max_model_len=self.max_model_len,
                                 lookahead=2 * self.lookahead + 1)
        self.runner = self.ranks.runner
        self.counters = EngineStats()
        self.adapters = AdapterManager(self.spec, config.model, config.max_loras, config.max_cpu_loras,
                                       config.max_lora_rank, config.torch_dtype, self.device, self.counters,
                                       self.ranks.slots, self.ranks.pack, config.lora_slot_rank)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, self.adapters, config.max_num_seqs, config.max_num_batched_tokens)
        self.set_prefix_caching(config.enable_prefix_caching)
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.tokenizer if detokenize else None, eos, self.max_model_len)
        self._output = self.outputs.output if detokenize else self.outputs.delta
        self._seeds = random.Random(config.seed)  # the noise keys of requests without a seed
        self.seqs: dict[str, Sequence] = {}
        self._flight: Flight | None = None  # the step queued on the device and not read yet
        self._flight_plan: Plan | None = None  # the gate's plan for it
        self._read_s = 0.0  # host seconds spent reading steps, in all (what a step's own host time leaves out)
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
        device slot is freed as soon as none uses it (at once when idle). Its prefix-cache blocks are dropped (a
        name added again later is another version)."""
        version = self.adapters.versions.get(name)
        self.adapters.remove(name)
        if version is not None:
            self.blocks.drop(root_hash(name, version))
        self._fail_orphans()

    def drop_cached_prefixes(self, name: str) -> int:
        """Drop the prefix-cache blocks of the adapter `name` (a version withdrawn from serving: its blocks would only
        wait for eviction). It stays registered, and its later requests cache again. -> blocks dropped."""
        version = self.adapters.versions.get(name)
        return 0 if version is None else self.blocks.drop(root_hash(name, version), retire=False)

    def has_adapter(self, name: str) -> bool:
        return self.adapters.known(name)

    def pin_adapter(self, name: str, pinned: bool) -> None:
        """A pinned adapter is never evicted from host memory or from its device slot."""
        self.adapters.set_pinned(name, pinned)

    def registered_adapters(self) -> list[str]:
        """Every adapter added and not removed."""
        return self.adapters.registered

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
        room = 2 * self.lookahead + 2  # its first token, and what two steps queued at once may write past it
        if blocks_for(len(prompt_token_ids) + room, self.config.block_size) > self.blocks.num_blocks:
            raise PromptTooLongError(f"prompt needs more KV blocks than the cache has ({self.blocks.num_blocks})",
                                     len(prompt_token_ids), self.blocks.num_blocks * self.config.block_size - room)
        params.check_vocab(self.spec.vocab_size)
        if params.stop and self.outputs.detokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer, and an engine that detokenizes")
        if adapter_name is not None and not self.adapters.known(adapter_name):
            raise AdapterError(adapter_name, "unknown adapter (add it with add_adapter first)")
        seq = Sequence(request_id, prompt_token_ids, params, adapter_name)
        source = self.seqs.get(share_prompt_with) if share_prompt_with is not None else None
        if source is not None and source.prompt_token_ids == prompt_token_ids and source.adapter == adapter_name:
            seq.prompt_source = source
        if self.counters.prefix_cache is not None:
            seq.cache_root = root_hash(adapter_name, self.adapters.versions.get(adapter_name, 0))
        seq.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.counters.usage(adapter_name).requests += 1
        return request_id

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def abort_all(self) -> list[str]:
        """End every request with "abort" and drop the step queued on the device unread (after a step failed:
        nothing of it can be trusted); returns their ids."""
        ids = list(self.seqs)
        for request_id in ids:
            self.abort_request(request_id)
        self._flight = self._flight_plan = None
        self.scheduler.drop_queued(self.seqs.values())
        self.seqs.clear()
        self.blocks.clear()  # after a failed step nothing on the device is trusted, cached KV included
        self.scheduler.finished.clear()
        return ids

    @property
    def has_unfinished_requests(self) -> bool:
        """Requests waiting, running, or with outputs not handed out yet. (A queued step whose sequences have all
        finished since is read by the next step().)"""
        return (self.scheduler.has_unfinished or bool(self.scheduler.finished)
                or (self._flight is not None and not all(s.finished for s in self._flight.seqs)))

    # ---------------------------------------------------------------- the loop
    def step(self, ctx: StepContext | None = None) -> list[RequestOutput]:
        """Queue the next step, then read the one queued before it; returns the outputs reading it gave, and those
        of requests that ended otherwise (aborts): RequestOutputs, or TokenDeltas where the engine does not
        detokenize. A step whose tokens are drawn from the host's history
        (penalties) is read before the next one is planned, and so is one whose sequences' room for the most it can
        commit is not free (the scheduler says so)."""
        ctx = ctx or StepContext()
        start, reading = time.perf_counter(), self._read_s
        self._fail_orphans()
        outputs = []
        if self._flight is not None and self._flight.adjusts and any(s.adjusts_logits and not s.ended
                                                                     for s in self._flight.seqs):
            outputs = self._read(None)
        batch = self.scheduler.schedule(lookahead=self.gate.lookahead, max_model_len=self.max_model_len)
        if batch.wait:  # memory is short for the queued step's most: read it first
            outputs += self._read(None)
            batch = self.scheduler.schedule(lookahead=self.gate.lookahead, max_model_len=self.max_model_len)
        flight, plan = self._launch(ctx, batch, start)
        # Issue the adapter copies this scheduling activated: after the forward it queued, so their host time overlaps
        # the device's work; and also when it queued none (an idle engine's first request for an adapter), or the
        # copy would never start and the request would wait for it forever.
        self.adapters.slots.flush()
        if flight is not None:  # the host's time queueing it, less the reads of the step before and the device waits
            flight.host_s = time.perf_counter() - start - (self._read_s - reading) - flight.wait_s
        outputs += self._read(flight)
        self._flight, self._flight_plan = flight, plan
        self.counters.steps += flight is not None
        return outputs + self._emit([])

    def _launch(self, ctx: StepContext, batch: ScheduledBatch, start: float) -> tuple[Flight | None, Plan | None]:
        if batch.empty:
            return None, None
        plan = self.gate.plan(batch)
        # first tokens drawn in a drafting pass are read early only for a loop that takes them (StepContext.publish)
        first = None if ctx.publish is None else lambda seqs, tokens, rows: self._first(ctx, seqs, tokens, rows)
        step = Step(plan.seqs, rows_for(plan, self.max_model_len), plan.passes, join=self._joiner(batch, plan, ctx),
                    first=first)
        flight = self.executor.launch(step, self._flight)
        self.scheduler.on_queued(flight)
        flight.launched = start  # its time runs from its scheduling to the next step's
        return flight, plan

    def _joiner(self, batch: ScheduledBatch, plan: Plan, ctx: StepContext):
        """What a cycle calls between passes to take in arrivals and admit them into its batch (None: nothing can
        arrive during a step)."""
        if ctx.arrivals is None or not plan.speculate:
            return None

        def join() -> tuple[list[Sequence], list]:
            ctx.arrivals()
            admitted = self.scheduler.admit(batch) if self.scheduler.waiting else []
            return admitted, [prompt_row(plan, s, self.max_model_len) for s in admitted]

        return join

    def _first(self, ctx: StepContext, seqs: list[Sequence], tokens: list[int], rows: list) -> None:
        """Prompts' first tokens drawn in a drafting pass, read before the step ends: committed and handed out (a
        request that ends on it is handed back to the scheduler when the step is read: the passes after it still
        write its blocks)."""
        live = []
        for seq, token, row in zip(seqs, tokens, rows):
            if not seq.ended:
                self.counters.usage(seq.adapter).tokens += 1
                if not self.outputs.append(seq, token, row):
                    live.append(seq)
        if live:
            ctx.publish([self._output(s, False) for s in live])

    def _read(self, queued: Flight | None) -> list[RequestOutput]:
        """Read the step queued before `queued` (the one just queued, if any): commit each row's tokens, hand back
        the sequences that ended, feed the gate what the step measured (StepResult); returns the outputs."""
        flight, plan = self._flight, self._flight_plan
        if flight is None:
            return []
        self._flight = self._flight_plan = None
        began = time.perf_counter()
        tokens, counts = flight.read()
        waited = time.perf_counter() - began
        self.counters.device_wait_s += waited
        outputs, verifies = self._commit(flight, tokens.tolist(), counts.tolist())
        # A step's time runs from its scheduling to the next one's (what the loop spends per step), or, for the last
        # before the engine runs dry, to the end of its reading.
        seconds = (queued.launched if queued is not None else time.perf_counter()) - flight.launched
        passes = [(k, t, a, span) for (k, t, a), span in zip(flight.passes, flight.spans())]
        host_s = flight.host_s + time.perf_counter() - began - waited
        self.gate.observe(plan, StepResult(passes, verifies, host_s, flight.period()), seconds)
        self._read_s += time.perf_counter() - began
        return outputs

    def _commit(self, flight: Flight, rows: list[list[int]], counts: list[int]) -> tuple[list[RequestOutput], list]:
        """Append each row's committed tokens (past those handed out early), then let the scheduler update the
        rows' progress from the step; -> the outputs, and the verified drafts as (adapter, drafted, accepted)."""
        touched, verifies = [], []
        for r, seq in enumerate(flight.seqs):
            n, done = counts[r], flight.published[r]
            if flight.drafts is not None and flight.drafts[r] and n:
                verifies.append((seq.adapter, flight.drafts[r], n - flight.lo[r]))
            if seq.finished or not n:
                continue
            if not seq.ended:  # (one that ended on an early first token commits nothing more)
                self._append(seq, rows[r][done:n], flight.logits_rows(r, done, n - done) if flight.kept else None)
            touched.append(seq)
        self.scheduler.update_from_output(flight, counts)
        return self._emit(touched), verifies

    def _append(self, seq: Sequence, tokens: list[int], rows: list | None) -> None:
        """Append a row's tokens in order, up to where the sequence ends. rows: each token's logits row, where kept
        (None: none kept)."""
        append, n = self.outputs.append, 0
        for token in tokens:
            n += 1
            if append(seq, token, None if rows is None else rows[n - 1]):
                break
        self.counters.usage(seq.adapter).tokens += n

    def set_speculation(self, spec: SpecConfig | None) -> None:
        """Switch speculative drafting on (a fresh gate: nothing measured yet) or off (None). Its draft length
        may not exceed the drafting room the engine was built with (`EngineConfig.speculative`)."""
        if spec is not None and spec.num_draft_tokens > self.lookahead:
            raise ValueError(f"num_draft_tokens {spec.num_draft_tokens} exceeds the engine's lookahead "
                             f"{self.lookahead} (set EngineConfig.speculative)")
        self.counters.spec = None
        self.gate = NoSpeculation() if spec is None else Gate(
            spec, max_model_len=self.max_model_len, capturing=self.runner.capturing, stats=self.counters)
        self.executor = StepExecutor(self.runner, self.adapters.slots, self.config.max_num_seqs, self.lookahead,
                                     self.config.max_graph_tokens if self.config.cuda_graphs else None,
                                     self.counters.spec, lead=1 if spec is None else spec.draft_lead)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Prefix caching on (fresh counters) or off for requests added from now on (EngineConfig's setting at start;
        a benchmark compares both on one engine). Either way every cached block is dropped: a run starts cold."""
        self.blocks.clear()
        self.counters.prefix_cache = PrefixCacheStats() if enabled else None
        self.scheduler.use_prefix_cache(self.counters.prefix_cache)

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
        """Outputs of the sequences a read touched and of those that finished (aborts included)."""
        finished, self.scheduler.finished = self.scheduler.finished, []
        if not finished:  # (a touched sequence that ended is among the finished: these are each once, running)
            output = self._output
            return [output(seq, False) for seq in touched]
        outs, seen = [], set()
        for seq in touched + finished:
            if seq.request_id in seen:
                continue
            seen.add(seq.request_id)
            outs.append(self._output(seq, seq.finished))
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

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (also done when the engine is collected or the process
        exits); nothing for one rank."""
        self.ranks.close()

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        """The engine's counters (EngineStats) and its gauges, as plain data."""
        out = self.counters.snapshot(self.gate.estimates())
        if "prefix_cache" in out:
            out["prefix_cache"] |= {"cached_blocks": self.blocks.num_cached, "evictions": self.blocks.evictions}
        return out | {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "free_kv_blocks": self.blocks.num_free,
            "total_kv_blocks": self.blocks.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "startup": dict(self.startup),  # seconds: load_s, graph_capture_s, eager_warmup_s, total_s
            "device_adapters": self.adapters.slots.resident,
            "host_adapters": self.adapters.host_resident,
            "pinned_adapters": sorted(self.adapters.pinned),
        }
