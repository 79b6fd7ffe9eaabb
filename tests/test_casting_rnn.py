"""Apex's test_rnn: RNN modules and cells run in low precision; input grads keep their type."""
import functools

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence

import amp.casting
from casting_common import TOLERANCES

T, B, H = 5, 3, 8


def _leaf(t, dtype):
    return t.detach().to(dtype, copy=True).requires_grad_()


@functools.lru_cache(maxsize=None)
def _torch_lstm_fails(dtype, device):
    """Why torch alone cannot run an ``nn.LSTM`` in ``dtype`` on ``device``, or None if it can.
    (Torch 2.3's oneDNN LSTM refuses bf16 on a CPU without AVX-512: "could not create a primitive
    descriptor for an LSTM forward propagation primitive".)"""
    with amp.casting.disable_casts():
        try:
            nn.LSTM(H, H).to(device, dtype)(torch.zeros(T, B, H, device=device, dtype=dtype))
        except RuntimeError as error:
            return f"torch {torch.__version__} runs no {dtype} LSTM on this {device}: {error}"
    return None


def _skip_where_torch_runs_no_lstm(low, device):
    reason = _torch_lstm_fails(low, device)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("cell_type", [nn.RNNCell, nn.GRUCell, nn.LSTMCell])
def test_cell_is_low_precision(handle, low, device, cell_type):
    torch.manual_seed(0)
    cell = cell_type(H, H).to(device)
    xs = torch.randn(T, B, H, device=device)
    for dt in (torch.float32, low):
        x = _leaf(xs, dt)
        hidden = None
        for t in range(T):
            hidden = cell(x[t], hidden)
            outputs = hidden if isinstance(hidden, tuple) else (hidden,)
            assert all(o.dtype == low for o in outputs)
        outputs[0].float().sum().backward()
        assert x.grad.dtype == dt


@pytest.mark.parametrize("rnn_type", [nn.RNN, nn.GRU, nn.LSTM])
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, False), (2, True)],
                         ids=["1-layer", "2-layer", "2-layer-bidir"])
def test_rnn_is_low_precision(handle, low, device, rnn_type, layers, bidirectional):
    if rnn_type is nn.LSTM:
        _skip_where_torch_runs_no_lstm(low, device)
    torch.manual_seed(0)
    rnn = rnn_type(H, H, num_layers=layers, bidirectional=bidirectional).to(device)
    xs = torch.randn(T, B, H, device=device)
    with amp.casting.disable_casts():
        ref_x = _leaf(xs, torch.float32)
        ref_out = rnn(ref_x)[0]
        ref_out.sum().backward()
    for dt in (torch.float32, low):
        x = _leaf(xs, dt)
        out = rnn(x)[0]
        assert out.dtype == low
        out.float().sum().backward()
        assert x.grad.dtype == dt
        torch.testing.assert_close(out.float(), ref_out, **TOLERANCES[low])
        torch.testing.assert_close(x.grad.float(), ref_x.grad, **TOLERANCES[low])


def test_rnn_weight_grads_reach_fp32_weights(handle, low, device):
    _skip_where_torch_runs_no_lstm(low, device)
    rnn = nn.LSTM(H, H, num_layers=2).to(device)
    rnn(torch.randn(T, B, H, device=device))[0].float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in rnn.parameters())


def test_rnn_packed_sequence_is_low_precision(handle, low, device):
    torch.manual_seed(0)
    rnn = nn.RNN(H, H, num_layers=2).to(device)
    lengths = torch.tensor([T, T - 1, 2])  # on the CPU, as pack_padded_sequence wants
    for dt in (torch.float32, low):
        x = _leaf(torch.randn(T, B, H, device=device), dt)
        out = rnn(pack_padded_sequence(x, lengths))[0]
        assert out.data.dtype == low
        out.data.float().sum().backward()
        assert x.grad.dtype == dt
