"""One request as its engine's client holds it: the token ids its core sent, turned into RequestOutputs (text, stop
strings, log-probabilities) when the request's consumer reads them, so a consumer behind the core gets every
output it missed as one, and the text is decoded on the consumer's time, never on the core's."""

from __future__ import annotations

import asyncio

import torch

from ..detokenizer import TextState
from ..sampling_params import SamplingParams
from ..sequence import RequestOutput, TokenLogprobs

__all__ = ["RequestStream"]


class RequestStream:
    __slots__ = ("request_id", "prompt_token_ids", "adapter", "loop", "_text", "_want_logprobs", "_pending",
                 "_pending_logprobs", "_output", "_logprobs", "_logits", "reason", "_error", "finished", "_waiter")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                 loop: asyncio.AbstractEventLoop, text: TextState | None):
        self.request_id, self.prompt_token_ids, self.adapter, self.loop = request_id, prompt_token_ids, adapter, loop
        self._text = text  # None: no tokenizer, every text empty
        self._want_logprobs = params.logprobs is not None
        self._pending: list[int] = []  # token ids the core sent, not handed out yet
        self._pending_logprobs: list[tuple[float, list[int], list[float]]] = []
        self._output: list[int] = []  # handed out: RequestOutput.output_token_ids
        self._logprobs: list[TokenLogprobs] = []
        self._logits: torch.Tensor | None = None
        self.reason: str | None = None  # the core's finish reason: the core is done with it
        self._error: BaseException | None = None
        self.finished = False  # its last output was handed out
        self._waiter: asyncio.Future | None = None

    # ------------------------------------------------------------ from the core, on `loop`
    def feed(self, tokens: list[int], reason: str | None, logprobs: list | None, logits: torch.Tensor | None) -> None:
        """A step's news: new token ids, the finish reason if it ended, the tokens' log-probabilities ([logprob],
        [[top ids]], [[top logprobs]]) if asked for, its logits if kept."""
        self._pending += tokens
        if logprobs is not None:
            self._pending_logprobs += zip(*logprobs)
        if reason is not None:
            self.reason, self._logits = reason, logits
        self._wake()

    def fail(self, error: BaseException) -> None:
        """It ended with `error`: raised to its consumer after the outputs that came before it."""
        if self.reason is None and self._error is None:
            self._error = error
            self._wake()

    @property
    def settled(self) -> bool:
        """The core is done with it: it finished there, was refused, or failed."""
        return self.reason is not None or self._error is not None

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------ to the consumer
    async def next(self) -> RequestOutput:
        """Every output waiting, as one; waits for one if none is."""
        while not self._pending and self.reason is None:
            if self._error is not None:
                raise self._error
            self._waiter = self.loop.create_future()
            await self._waiter
        return self._take()

    def _take(self) -> RequestOutput:
        new, self._pending = self._pending, []
        start, out = len(self._output), self._output
        stopped = False
        if self._text is None:
            out += new
        else:
            for token in new:
                out.append(token)
                if self._text.add(out):  # a stop string: the tokens after this one never happened
                    stopped = True
                    break
        new_logprobs = None
        if self._want_logprobs:
            entries, self._pending_logprobs = self._pending_logprobs, []
            new_logprobs = [TokenLogprobs(t, lp, list(zip(ids, vals)))
                            for t, (lp, ids, vals) in zip(out[start:], entries)]
            self._logprobs += new_logprobs
        self.finished = stopped or self.reason is not None
        text, delta = self._text.emit(out, self.finished) if self._text is not None else ("", "")
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, output_token_ids=out,
            num_token_ids=len(out), text=text, new_token_ids=out[start:], delta_text=delta, finished=self.finished,
            finish_reason="stop" if stopped else self.reason, adapter=self.adapter,
            logits=self._logits[: len(out)] if self.finished and self._logits is not None else None,
            new_logprobs=new_logprobs, logprobs=list(self._logprobs) if self.finished and self._want_logprobs else None)
