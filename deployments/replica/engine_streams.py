"""The engine streams of one request's choices, merged into one stream of (choice index, output)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

__all__ = ["merge_streams"]


async def merge_streams(streams: list, firsts: list) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, RequestOutput) from every engine stream as they come, after each stream's first output
    (`firsts`, already awaited); closing the merged stream aborts the unfinished requests."""
    for i, out in enumerate(firsts):
        yield i, out
    if len(streams) == 1:  # n = 1, nearly every request: no task and no wait() per token
        try:
            if not firsts[0].finished:
                async for out in streams[0]:
                    yield 0, out
        finally:
            await streams[0].aclose()  # aborts the request if it is unfinished
        return
    nexts = {asyncio.ensure_future(streams[i].__anext__()): i for i, out in enumerate(firsts) if not out.finished}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = nexts.pop(fut)
                out = fut.result()
                if not out.finished:
                    nexts[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for fut in nexts:
            fut.cancel()
        await asyncio.gather(*nexts, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)  # aborts unfinished requests
