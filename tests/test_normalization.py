"""amp.normalization (apex.normalization through the switch): Apex's layers against torch's fp32 ones.

Every reference is plain PyTorch in fp32 (``nn.LayerNorm``'s math, or RMS norm written out) on the
same data; a low-precision layer is held to one rounding of its output, and its gradients to the
fp32 gradients within the rounding of fp16/bf16 inputs.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp
from amp.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from amp.normalization import fused_layer_norm as module
from amp.normalization.fused_layer_norm import (fused_layer_norm, fused_layer_norm_affine, fused_rms_norm,
                                                fused_rms_norm_affine, mixed_dtype_fused_layer_norm_affine,
                                                mixed_dtype_fused_rms_norm_affine)

LOW = [torch.float16, torch.bfloat16]
# One rounding of a normalized value (|y| of a few units) in each dtype.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=4e-3),
             torch.bfloat16: dict(rtol=1.6e-2, atol=3e-2)}
SHAPES = [((6, 16), 16), ((2, 3, 4, 5), (4, 5)), ((5, 7), [7]), ((3, 8), torch.Size([8]))]


def reference_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
    dims = tuple(range(-len(shape), 0))
    mean = x.mean(dims, keepdim=True)
    out = (x - mean) / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
    return out if weight is None else out * weight + bias


def reference_rms_norm(x, shape, weight=None, eps=1e-5):
    dims = tuple(range(-len(shape), 0))
    out = x / torch.sqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return out if weight is None else out * weight


def as_tuple(shape):
    return (shape,) if isinstance(shape, int) else tuple(shape)


def data(size, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, generator=generator) * 3 + 1).to(dtype).requires_grad_()


def random_affine(layer, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return layer


def grads_of(output, *tensors):
    generator = torch.Generator().manual_seed(2)
    upstream = torch.randn(output.shape, generator=generator).to(output.dtype)
    return torch.autograd.grad(output, tensors, upstream)


def fp32_copies(*tensors):
    return [t.detach().float().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("size, shape", SHAPES)
def test_fused_layer_norm_matches_fp32_layer_norm_and_returns_the_input_dtype(size, shape, dtype):
    layer = random_affine(FusedLayerNorm(shape)).to(dtype)
    x = data(size, dtype)
    out = layer(x)
    x32, w32, b32 = fp32_copies(x, layer.weight, layer.bias)
    expected = reference_layer_norm(x32, as_tuple(shape), w32, b32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    for actual, wanted in zip(grads_of(out, x, layer.weight, layer.bias), grads_of(expected, x32, w32, b32)):
        assert actual.dtype == dtype
        torch.testing.assert_close(actual.float(), wanted, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("size, shape", SHAPES)
def test_fused_rms_norm_matches_fp32_rms_norm_and_returns_the_input_dtype(size, shape, dtype):
    layer = random_affine(FusedRMSNorm(shape)).to(dtype)
    x = data(size, dtype)
    out = layer(x)
    x32, w32 = fp32_copies(x, layer.weight)
    expected = reference_rms_norm(x32, as_tuple(shape), w32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    for actual, wanted in zip(grads_of(out, x, layer.weight), grads_of(expected, x32, w32)):
        torch.testing.assert_close(actual.float(), wanted, **TOLERANCE[dtype])


@pytest.mark.parametrize("layer_class, reference", [(FusedLayerNorm, reference_layer_norm),
                                                     (FusedRMSNorm, reference_rms_norm)])
def test_without_elementwise_affine_there_are_no_parameters(layer_class, reference):
    layer = layer_class((4, 5), eps=1e-3, elementwise_affine=False)
    x = data((2, 3, 4, 5))
    assert list(layer.parameters()) == [] and layer.weight is None
    torch.testing.assert_close(layer(x), reference(x, (4, 5), eps=1e-3), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("layer_class", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_layers_keep_fp32_parameters_for_low_precision_inputs_and_return_their_dtype(layer_class, dtype):
    layer = random_affine(layer_class(16))
    x = data((6, 16), dtype)
    out = layer(x)
    params = list(layer.parameters())
    x32, *params32 = fp32_copies(x, *params)
    if layer_class is MixedFusedLayerNorm:
        expected = reference_layer_norm(x32, (16,), *params32)
    else:
        expected = reference_rms_norm(x32, (16,), *params32)
    assert out.dtype == torch.float32 and all(p.dtype == torch.float32 for p in params)
    # The input was rounded to low precision once; nothing else is.
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    actual_grads, wanted_grads = grads_of(out, x, *params), grads_of(expected, x32, *params32)
    assert actual_grads[0].dtype == dtype and all(g.dtype == torch.float32 for g in actual_grads[1:])
    for actual, wanted in zip(actual_grads, wanted_grads):
        torch.testing.assert_close(actual.float(), wanted, **TOLERANCE[dtype])


@pytest.mark.parametrize("layer_class", [FusedLayerNorm, FusedRMSNorm])
def test_fused_layers_take_low_precision_input_with_fp32_parameters_and_return_the_input_dtype(layer_class):
    out = random_affine(layer_class(16))(data((6, 16), torch.float16))
    assert out.dtype == torch.float16


def test_functional_forms_and_apexs_autograd_functions_compute_as_the_layers():
    x = data((4, 8))
    weight, bias = torch.randn(8), torch.randn(8)
    ln = reference_layer_norm(x, (8,), weight, bias, eps=1e-6)
    rms = reference_rms_norm(x, (8,), weight, eps=1e-6)
    close = TOLERANCE[torch.float32]
    torch.testing.assert_close(fused_layer_norm_affine(x, weight, bias, (8,)), ln, **close)
    torch.testing.assert_close(mixed_dtype_fused_layer_norm_affine(x, weight, bias, 8), ln, **close)
    torch.testing.assert_close(fused_layer_norm(x, [8]), reference_layer_norm(x, (8,), eps=1e-6), **close)
    torch.testing.assert_close(fused_rms_norm_affine(x, weight, (8,)), rms, **close)
    torch.testing.assert_close(mixed_dtype_fused_rms_norm_affine(x, weight, 8), rms, **close)
    torch.testing.assert_close(fused_rms_norm(x, (8,)), reference_rms_norm(x, (8,), eps=1e-6), **close)
    torch.testing.assert_close(module.FusedLayerNormAffineFunction.apply(x, weight, bias, (8,), 1e-6), ln, **close)
    torch.testing.assert_close(module.FusedRMSNormAffineFunction.apply(x, weight, (8,), 1e-6), rms, **close)
    assert module.FusedLayerNormAffineMixedDtypesFunction.apply(
        x.half(), weight, bias, (8,), 1e-6).dtype == torch.float32


@pytest.mark.parametrize("rms_norm_of_torch", [True, False], ids=["torch_rms_norm", "own_rms_norm"])
def test_rms_norm_runs_where_torch_has_no_rms_norm(monkeypatch, rms_norm_of_torch):
    if not rms_norm_of_torch:
        monkeypatch.delattr(F, "rms_norm", raising=False)  # torch < 2.4 (CI's 2.3.1)
    layer = random_affine(FusedRMSNorm((3, 4)))
    x = data((5, 3, 4))
    expected = reference_rms_norm(*fp32_copies(x), (3, 4), layer.weight.detach())
    torch.testing.assert_close(layer(x), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(layer(x.half()).float(), expected, **TOLERANCE[torch.float16])


@pytest.mark.parametrize("layer_class", [FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm])
def test_apexs_constructor_and_repr(layer_class):
    layer = layer_class([3, 4], 1e-3, memory_efficient=True)
    assert layer.normalized_shape == torch.Size([3, 4]) and layer.eps == 1e-3 and layer.memory_efficient
    assert layer.weight.shape == (3, 4) and torch.equal(layer.weight, torch.ones(3, 4))
    assert "torch.Size([3, 4]), eps=0.001, elementwise_affine=True" in repr(layer)


@pytest.mark.parametrize("layer_class", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_layers_warn_of_elementwise_affine_and_refuse_false(layer_class):
    with pytest.warns(UserWarning, match="does not take `elementwise_affine`"):
        layer_class(4, elementwise_affine=True)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="elementwise_affine = False"):
        layer_class(4, elementwise_affine=False)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        layer_class(4, elementwise_afine=True)


@pytest.mark.parametrize("bad", [dict(elementwise_affine="yes"), dict(memory_efficient=1)])
def test_flags_that_are_not_bools_are_refused(bad):
    with pytest.raises(TypeError, match="must be True or False"):
        FusedLayerNorm(4, **bad)


@pytest.mark.parametrize("layer_class", [FusedLayerNorm, FusedRMSNorm])
def test_an_input_whose_trailing_shape_differs_is_refused_with_the_shapes(layer_class):
    with pytest.raises(RuntimeError, match=r"normalized_shape=\[4\].*got input of size \[2, 5\]"):
        layer_class(4)(torch.randn(2, 5))


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.fc(x))


@pytest.mark.parametrize("opt_level", ["O1", "O4"])
@pytest.mark.parametrize("norm_class", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_under_o1_and_o4_the_layers_run_in_fp32_as_f_layer_norm_does(norm_class, opt_level):
    torch.manual_seed(0)
    model = amp.initialize(Block(norm_class(16)), opt_level=opt_level, verbosity=0)
    x = torch.randn(4, 16)
    fc_out = model.fc(x)
    assert fc_out.dtype != torch.float32  # the linear runs in low precision
    assert model(x).dtype == torch.float32
    assert F.layer_norm(fc_out, (16,)).dtype == torch.float32  # what the lists say of layer_norm
    reference = reference_layer_norm if norm_class in (FusedLayerNorm, MixedFusedLayerNorm) else reference_rms_norm
    params = [p.detach() for p in model.norm.parameters()]
    torch.testing.assert_close(model(x), reference(fc_out.float(), (16,), *params), **TOLERANCE[torch.float32])


def test_under_o2_the_layer_is_cast_with_the_model_and_returns_fp16():
    model = amp.initialize(Block(FusedLayerNorm(16)), opt_level="O2", verbosity=0, cast_model_outputs=torch.float16)
    assert model.norm.weight.dtype == torch.float16
    assert model(torch.randn(4, 16)).dtype == torch.float16
