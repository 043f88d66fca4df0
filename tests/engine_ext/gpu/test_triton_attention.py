"""The Triton paged attention against the plain-torch reference: decode, verify, prefill, GQA, windows."""

import pytest
import torch

from engine_ext.attention import AttnMetadata, paged_attention

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _case(context_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, gen):
    """Random caches and a flat token list: the last query_lens[i] positions of each sequence."""
    dev = "cuda"
    blocks_per = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=gen, device=dev).tolist()  # scattered physical blocks
    tables, used = [], 0
    for nb in blocks_per:
        tables.append(perm[used : used + nb])
        used += nb
    width = max(blocks_per)
    padded = [t + [0] * (width - len(t)) for t in tables]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, device=dev).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, device=dev).to(dtype)
    pos, seq, qidx = [], [], []
    for i, (n, m) in enumerate(zip(context_lens, query_lens)):
        pos += list(range(n - m, n))
        seq += [i] * m
        qidx += list(range(m))
    t = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    meta = AttnMetadata(positions=t(pos), slot_mapping=t([0] * len(pos)), block_tables=t(padded),
                        token_seq=t(seq), token_qidx=t(qidx), max_query_len=max(query_lens))
    q = torch.randn(len(pos), heads, head_dim, generator=gen, device=dev).to(dtype)
    return q, k_cache, v_cache, meta


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (8, 8, 128), (28, 4, 128), (4, 2, 16)])
@pytest.mark.parametrize("query_len", [1, 3, 5])
@pytest.mark.parametrize("window", [None, 37])
def test_matches_reference(heads, kv_heads, head_dim, query_len, window):
    from engine_ext.kernels.triton_attention import paged_attention_triton

    gen = torch.Generator("cuda").manual_seed(heads * 31 + query_len)
    lens = torch.randint(query_len, 400, (13,), generator=gen, device="cuda").tolist() + [query_len, 64, 65]
    q, kc, vc, meta = _case(lens, [query_len] * len(lens), heads, kv_heads, head_dim, 16, torch.bfloat16, gen)
    scale = head_dim**-0.5
    ref = paged_attention(q.float(), kc.float(), vc.float(), meta, scale, window)
    out = paged_attention_triton(q, kc, vc, meta, scale, window)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2


def test_mixed_query_lengths_and_prefill_through_the_dispatching_reference():
    """Verify passes mix sequences with 1..k+1 query tokens; prefills have many. meta.kernel dispatches."""
    from engine_ext.kernels.triton_attention import paged_attention_triton

    gen = torch.Generator("cuda").manual_seed(11)
    lens, qlens = [5, 90, 200, 33, 17], [5, 1, 4, 2, 17]
    q, kc, vc, meta = _case(lens, qlens, 16, 4, 64, 8, torch.float16, gen)
    ref = paged_attention(q.float(), kc.float(), vc.float(), meta, 0.125)
    meta.kernel = paged_attention_triton
    out = paged_attention(q, kc, vc, meta, 0.125)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("setting", [
    {"attn_block_n": 64, "attn_stages": 0, "attn_rows": 0},
    {"attn_block_n": 128, "attn_stages": 1, "attn_rows": 16},
    {"attn_block_n": 32, "attn_stages": 4, "attn_rows": 64},
    {"attn_block_n": 128, "attn_stages": 2, "attn_rows": 32},  # a 5-token verify run in one tile
    {"attn_block_n": 64, "attn_stages": 2, "attn_rows": 16, "attn_rows_multi": 64},  # 16-token tiles for runs
    {"attn_block_n": 128, "attn_stages": 2, "attn_rows": 16, "attn_rows_multi": 0},  # one tile for every run
])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128)])
def test_every_launch_setting_matches_the_reference(setting, dtype, head_dim):
    """The launch settings (key block, pipeline stages, tile rows) change speed, never results;
    wide heads and float32 caches shrink the key block to fit shared memory."""
    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels.triton_attention import paged_attention_triton

    gen = torch.Generator("cuda").manual_seed(head_dim + setting["attn_block_n"])
    lens, qlens = [300, 5, 129, 64, 17, 400, 40], [1, 5, 5, 1, 3, 1, 17]  # (17: a run past one wide tile)
    q, kc, vc, meta = _case(lens, qlens, 32, 8, head_dim, 16, dtype, gen)
    ref = paged_attention(q.float(), kc.float(), vc.float(), meta, head_dim**-0.5)
    out = paged_attention_triton(q, kc, vc, meta, head_dim**-0.5, settings=KernelSettings(**setting))
    assert _rel(out, ref) < (1e-4 if dtype == torch.float32 else 1e-2)
