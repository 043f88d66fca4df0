"""The batched LoRA op against its definition, one token at a time."""

import torch

from engine_ext.lora_ops import add_lora_reference, get_lora_op


def test_reference_matches_per_token_definition():
    g = torch.Generator().manual_seed(0)
    slots, t, fin, fout, r = 5, 11, 24, 40, 8
    a = torch.randn(slots, fin, r, generator=g)
    b = torch.randn(slots, r, fout, generator=g)
    a[-1].zero_(), b[-1].zero_()  # the zero slot
    scale = torch.rand(slots, generator=g)
    x = torch.randn(t, fin, generator=g)
    idx = torch.randint(0, slots, (t,), generator=g)
    y = torch.randn(t, fout, generator=g)
    expected = y.clone()
    for i in range(t):
        expected[i] += (x[i] @ a[idx[i]]) @ b[idx[i]] * scale[idx[i]]
    add_lora_reference(y, x, a, b, scale, idx)
    assert torch.allclose(y, expected, atol=1e-5)


def test_writes_into_a_column_slice():
    y = torch.zeros(3, 10)
    x = torch.ones(3, 2)
    a = torch.ones(2, 2, 1)
    b = torch.ones(2, 1, 4)
    add_lora_reference(y[:, 3:7], x, a, b, torch.tensor([0.5, 0.0]), torch.tensor([0, 1, 0]))
    assert y[:, 3:7].tolist() == [[1.0] * 4, [0.0] * 4, [1.0] * 4]
    assert y[:, :3].abs().sum() == 0 and y[:, 7:].abs().sum() == 0


def test_unknown_backend_named():
    import pytest

    with pytest.raises(ValueError, match="unknown lora_backend 'nope'"):
        get_lora_op("nope")


def test_dense_backend_equals_reference():
    from engine_ext.lora_ops import add_lora_dense

    g = torch.Generator().manual_seed(1)
    slots, t, fin, fout, r = 9, 37, 32, 48, 16
    a, b = torch.randn(slots, fin, r, generator=g), torch.randn(slots, r, fout, generator=g)
    scale, x = torch.rand(slots, generator=g), torch.randn(t, fin, generator=g)
    idx = torch.randint(0, slots, (t,), generator=g)
    y0 = torch.randn(t, fout, generator=g)
    y1, y2 = y0.clone(), y0.clone()
    add_lora_reference(y1, x, a, b, scale, idx)
    add_lora_dense(y2, x, a, b, scale, idx)
    assert torch.allclose(y1, y2, atol=1e-4)
    assert get_lora_op("torch") is add_lora_dense and get_lora_op("gather") is add_lora_reference
