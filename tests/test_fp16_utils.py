"""fp16_utils against plain PyTorch references computed beside each test on the same data."""
import copy
import io
import logging
import warnings

import pytest
import torch
import torch.nn as nn

from amp import NonFiniteGradientsError

from fp16_utils import (
    BN_convert_float,
    DeprecatedFeatureWarning,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)

LOW = [torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedFeatureWarning)
        yield


# ---------------------------------------------------------------- models

class DeviceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


class ConvBNNet(nn.Module):
    """The nested conv/BN model of Apex's run_fp16util tests: affine outer BN, non-affine bn1,
    and two blocks each with an affine BN."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(4)
        self.bn1 = nn.BatchNorm2d(4, affine=False)
        self.blocks = nn.Sequential(DeviceBlock(), DeviceBlock())

    def forward(self, x):
        return self.blocks(self.bn1(self.bn0(self.conv0(x))))


class MixedNet(nn.Module):
    """A low-precision weight and an fp32 bias: both of FP16_Optimizer's param kinds."""

    def __init__(self, dtype, device="cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 8, generator=g).to(device, dtype))
        self.unused = nn.Parameter(torch.randn(2, generator=g).to(device, dtype))
        self.b = nn.Parameter(torch.randn(3, generator=g).to(device))

    def forward(self, x):
        return (x.to(self.w.dtype) @ self.w.t()).float() + self.b


def batches(n, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g).to(device), torch.randn(4, 3, generator=g).to(device))
            for _ in range(n)]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def make_fp16_optimizer(model, opt_cls=torch.optim.SGD, **kwargs):
    inner = opt_cls(model.parameters(), **OPT_ARGS[opt_cls])
    return FP16_Optimizer(inner, verbose=False, **kwargs)


OPT_ARGS = {torch.optim.SGD: dict(lr=0.1, momentum=0.9), torch.optim.Adam: dict(lr=1e-2),
            torch.optim.LBFGS: dict(lr=0.5, max_iter=4)}


class Reference:
    """The hand-written loop FP16_Optimizer replaces: a low-precision model, fp32 masters
    stepped by a plain torch optimizer, grads unscaled by a fixed scale."""

    def __init__(self, model, scale, opt_cls=torch.optim.SGD):
        self.model = copy.deepcopy(model)
        self.params = [p for p in self.model.parameters()]
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.opt = opt_cls(self.masters, **OPT_ARGS[opt_cls])
        self.scale = scale

    def backward(self, loss):
        for p in self.params:
            p.grad = None
        (loss.float() * self.scale).backward()
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                g = p.grad.float() * (1.0 / self.scale)
                m.grad = g if m.grad is None else m.grad + g

    def step(self):
        self.opt.step()
        self.copy_masters_to_model()

    def copy_masters_to_model(self):
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self):
        for m in self.masters:
            m.grad = None

    def train(self, data):
        for x, y in data:
            self.zero_grad()
            self.backward(loss_fn(self.model, x, y))
            self.step()


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        opt.step()


def master_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def assert_bit_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


# ---------------------------------------------------------------- fp16util

def test_tofp16_casts_input_to_half():
    x = torch.randn(3, 4)
    out = tofp16()(x)
    assert out.dtype == torch.float16 and torch.equal(out, x.half())


def test_BN_convert_float_keeps_affine_bn_fp32_only():
    net = ConvBNNet().half()
    assert BN_convert_float(net) is net
    for bn in (net.bn0, net.blocks[0].bn, net.blocks[1].bn):
        assert bn.weight.dtype == torch.float32 and bn.running_mean.dtype == torch.float32
    assert net.bn1.running_mean.dtype == torch.float16
    assert net.conv0.weight.dtype == torch.float16


def test_network_to_half_matches_manual_half_network():
    torch.manual_seed(0)
    net = ConvBNNet().eval()
    ref = copy.deepcopy(net).half()
    for bn in (ref.bn0, ref.blocks[0].bn, ref.blocks[1].bn):
        bn.float()
    x = torch.randn(2, 3, 5, 5)
    out = network_to_half(net)(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, ref(x.half()))


@pytest.mark.parametrize("dtype", LOW)
def test_convert_module_converts_its_own_params_grads_and_buffers(dtype):
    bn = nn.BatchNorm1d(3)
    bn.weight.grad = torch.randn(3)
    weight = bn.weight
    expected = bn.weight.detach().to(dtype)
    convert_module(bn, dtype)
    assert bn.weight is weight  # optimizers still hold the same Parameter
    assert torch.equal(bn.weight, expected)
    assert bn.weight.grad.dtype == dtype and bn.running_var.dtype == dtype
    assert bn.num_batches_tracked.dtype == torch.int64


def test_convert_module_does_not_recurse():
    seq = nn.Sequential(nn.Linear(2, 2))
    convert_module(seq, torch.float16)
    assert seq[0].weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW)
def test_convert_network_keeps_affine_bn_and_converts_the_rest(dtype):
    net = convert_network(ConvBNNet(), dtype)
    for name, t in list(net.named_parameters()) + list(net.named_buffers()):
        if name.endswith("num_batches_tracked"):
            assert t.dtype == torch.int64
        elif name.startswith(("bn0", "blocks.0.bn", "blocks.1.bn")):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == dtype, name


def test_convert_network_flattens_rnn_params():
    rnn = convert_network(nn.LSTM(4, 4), torch.float16)
    out, _ = rnn(torch.randn(2, 1, 4, dtype=torch.float16))
    assert out.dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES)
def test_FP16Model_params_and_buffers(device):
    model = FP16Model(ConvBNNet()).to(device)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("num_batches_tracked"):
            continue
        affine_bn = any(name.startswith(p) for p in ("network.bn0", "network.blocks.0.bn", "network.blocks.1.bn"))
        assert t.dtype == (torch.float32 if affine_bn else torch.float16), name


@pytest.mark.parametrize("device", DEVICES)
def test_FP16Model_output_is_half_and_matches_converted_network(device):
    torch.manual_seed(0)
    net = ConvBNNet().to(device).eval()
    ref = convert_network(copy.deepcopy(net), torch.float16)
    x = torch.randn(2, 3, 5, 5, device=device)
    out = FP16Model(net)(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, ref(x.half()))


def test_FP16Model_bfloat16_and_integer_inputs_pass_through():
    emb = nn.Embedding(10, 4)
    ref = emb.weight.detach().bfloat16()
    ids = torch.tensor([1, 2, 7])
    out = FP16Model(emb, dtype=torch.bfloat16)(ids)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref[ids])


@pytest.mark.parametrize("flat", [False, True])
def test_prep_param_lists_gives_fp32_copies_of_trainable_params(flat):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
    model[1].bias.requires_grad_(False)
    model_params, masters = prep_param_lists(model, flat_master=flat)
    expected = [p for p in model.parameters() if p.requires_grad]
    assert model_params == expected
    if flat:
        assert len(masters) == 1 and masters[0].grad is not None
        assert torch.equal(masters[0], torch.cat([p.detach().float().reshape(-1) for p in expected]))
    else:
        assert_bit_equal(masters, [p.detach().float() for p in expected])
        assert all(m.data_ptr() != p.data_ptr() for m, p in zip(masters, expected))
    assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)


@pytest.mark.parametrize("flat", [False, True])
def test_model_grads_to_master_grads_copies_grads_to_fp32(flat):
    model = nn.Linear(4, 3).half()
    model_params, masters = prep_param_lists(model, flat_master=flat)
    model(torch.randn(2, 4).half()).float().sum().backward()
    model_grads_to_master_grads(model_params, masters, flat_master=flat)
    expected = [p.grad.float() for p in model_params]
    if flat:
        assert torch.equal(masters[0].grad, torch.cat([g.reshape(-1) for g in expected]))
    else:
        assert_bit_equal([m.grad for m in masters], expected)


def test_model_grads_to_master_grads_leaves_master_without_grad_when_model_has_none():
    model_params = [nn.Parameter(torch.zeros(2, dtype=torch.float16)) for _ in range(2)]
    masters = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
    model_params[0].grad = torch.ones(2, dtype=torch.float16)
    masters[1].grad = torch.ones(2)
    model_grads_to_master_grads(model_params, masters)
    assert torch.equal(masters[0].grad, torch.ones(2)) and masters[1].grad is None


def test_model_grads_to_master_grads_flat_needs_every_grad():
    model = nn.Linear(4, 3).half()
    model_params, masters = prep_param_lists(model, flat_master=True)
    with pytest.raises(ValueError, match="every model param needs a grad"):
        model_grads_to_master_grads(model_params, masters, flat_master=True)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", LOW)
def test_master_params_to_model_params_rounds_masters_into_model(flat, dtype):
    model = nn.Linear(4, 3).to(dtype)
    model_params, masters = prep_param_lists(model, flat_master=flat)
    with torch.no_grad():
        for m in masters:
            m.add_(torch.randn_like(m) * 1e-2)
    master_params_to_model_params(model_params, masters, flat_master=flat)
    flat_master = masters[0].detach() if flat else torch.cat([m.detach().reshape(-1) for m in masters])
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model_params]), flat_master.to(dtype))


def test_to_python_float_reads_tensors_and_sequences():
    assert to_python_float(torch.tensor(2.5)) == 2.5
    assert to_python_float([1.5]) == 1.5


def test_clip_grad_norm_is_torchs():
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_


@pytest.mark.parametrize("call, error, match", [
    (lambda: prep_param_lists(nn.Linear(2, 2).double()), TypeError, "torch.float64"),
    (lambda: prep_param_lists("model"), TypeError, "torch.nn.Module"),
    (lambda: prep_param_lists(nn.Linear(2, 2), flat_master=1), TypeError, "flat_master"),
    (lambda: prep_param_lists(nn.Linear(2, 2).requires_grad_(False)), ValueError, "no parameters"),
    (lambda: convert_network(nn.Linear(2, 2), torch.int8), TypeError, "floating-point"),
    (lambda: convert_module(nn.Linear(2, 2), "half"), TypeError, "floating-point"),
    (lambda: FP16Model(nn.Linear(2, 2), dtype=torch.float32), TypeError, "float16 or torch.bfloat16"),
    (lambda: FP16Model(nn.Linear(2, 2))([1.0, 2.0]), TypeError, "tensors only"),
    (lambda: master_params_to_model_params([torch.zeros(2)], []), ValueError, "1 model params but 0"),
    (lambda: master_params_to_model_params([torch.zeros(2)], [torch.zeros(3)], True), ValueError, "3 elements"),
])
def test_fp16util_rejects_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- legacy loss scalers

def test_static_LossScaler_scales_grads_and_never_overflows():
    model = nn.Linear(4, 1)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    scaler = LossScaler(128.0)
    scaler.backward(model(x).sum())
    ref(x).sum().backward()
    assert scaler.loss_scale == 128.0
    assert torch.equal(model.weight.grad, ref.weight.grad * 128.0)
    model.weight.grad[0, 0] = float("inf")
    assert scaler.has_overflow(model.parameters()) is False
    scaler.update_scale(True)
    assert scaler.loss_scale == 128.0


def test_scale_gradient_multiplies_grad_in():
    scaler = DynamicLossScaler(init_scale=8.0)
    g = torch.randn(3)
    (out,) = scaler.scale_gradient(None, (g,), None)
    assert torch.equal(out, g * 8.0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_DynamicLossScaler_has_overflow_finds_non_finite_grads(bad):
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    params[1].grad = torch.ones(2)
    scaler = DynamicLossScaler()
    assert not scaler.has_overflow(params)
    params[1].grad[1] = bad
    assert scaler.has_overflow(params)


def test_DynamicLossScaler_large_finite_bf16_grads_are_not_overflow():
    p = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.full((4,), 3e38, dtype=torch.bfloat16)
    assert not DynamicLossScaler().has_overflow([p])


def test_DynamicLossScaler_first_growth_at_scale_window_minus_one():
    scaler = DynamicLossScaler(init_scale=4.0, scale_factor=2.0, scale_window=3)
    scales = []
    for _ in range(6):
        scaler.update_scale(False)
        scales.append(scaler.loss_scale)
    # Apex: growth when (cur_iter - last_overflow_iter) % window == 0 with last_overflow_iter = -1.
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0]


def test_DynamicLossScaler_backs_off_on_overflow_but_not_below_one():
    scaler = DynamicLossScaler(init_scale=4.0, scale_factor=2.0, scale_window=3)
    scales = []
    for overflow in (True, True, True, False, False, False):
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    assert scales == [2.0, 1.0, 1.0, 1.0, 1.0, 2.0]


def test_DynamicLossScaler_backward_scales_grads():
    model = nn.Linear(4, 1)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    DynamicLossScaler(init_scale=2.0**10).backward(model(x).sum())
    ref(x).sum().backward()
    assert torch.equal(model.weight.grad, ref.weight.grad * 2.0**10)


@pytest.mark.parametrize("call, error, match", [
    (lambda: LossScaler(0), ValueError, "scale must be > 0"),
    (lambda: LossScaler("dynamic"), TypeError, "finite real number"),
    (lambda: DynamicLossScaler(scale_factor=1.0), ValueError, "scale_factor must be > 1"),
    (lambda: DynamicLossScaler(scale_window=0), ValueError, "scale_window must be >= 1"),
    (lambda: DynamicLossScaler(scale_window=2.5), TypeError, "scale_window must be an int"),
    (lambda: DynamicLossScaler().backward(1.0), TypeError, "loss tensor"),
])
def test_legacy_scalers_reject_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- deprecation

@pytest.mark.parametrize("make", [
    lambda: LossScaler(),
    lambda: FP16Model(nn.Linear(2, 2)),
    lambda: FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=0.1), verbose=False),
])
def test_deprecated_entry_points_warn(make):
    with pytest.warns(DeprecatedFeatureWarning):
        make()
    assert issubclass(DeprecatedFeatureWarning, FutureWarning)


def test_DynamicLossScaler_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedFeatureWarning)
        DynamicLossScaler()


def overflow_once(opt, model):
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y) * float("inf"))
    opt.step()


@pytest.mark.parametrize("verbose", [False, 0])
def test_FP16_Optimizer_not_verbose_logs_nothing_and_only_warns_deprecation(verbose, caplog, capsys):
    caplog.set_level(logging.DEBUG, logger="fp16_utils")
    model = MixedNet(torch.float16)
    overflow_once(make_fp16_optimizer(model), model)  # amp's one-time notice about amp_C, if any
    capsys.readouterr()
    with pytest.warns(DeprecatedFeatureWarning) as deprecations:
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                             verbose=verbose)
    overflow_once(opt, model)
    assert opt.inspect_master_grad_data() is None
    assert [str(w.message) for w in deprecations if "deprecated and dangerous" in str(w.message)] != []
    assert len(deprecations) == 1
    assert caplog.records == [] and capsys.readouterr() == ("", "")


def test_FP16_Optimizer_verbose_logs_groups_as_info_and_skips_as_warnings(caplog, capsys):
    caplog.set_level(logging.INFO, logger="fp16_utils")
    model = MixedNet(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    overflow_once(opt, model)
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("fp16_utils", logging.INFO, "FP16_Optimizer processing param group 0:") in records
    assert ("fp16_utils", logging.WARNING,
            "Gradient overflow.  Skipping step, reducing loss scale to 32768.0") in records
    assert capsys.readouterr() == ("", "")


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_FP16_Optimizer_skip_messages_are_rate_limited(caplog):
    caplog.set_level(logging.WARNING, logger="fp16_utils")
    model = MixedNet(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         max_consecutive_skips=0)
    for _ in range(250):
        overflow_once(opt, model)
    assert 3 <= len(caplog.records) <= 15
    assert opt.skipped_steps == 250


@pytest.mark.parametrize("verbose", [True, False])
def test_FP16_Optimizer_endless_overflow_raises_naming_the_params_and_changes_nothing(verbose):
    model = MixedNet(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         verbose=verbose, max_consecutive_skips=3)
    before = [p.detach().clone() for p in master_params(opt)]
    for _ in range(3):
        overflow_once(opt, model)
    with pytest.raises(NonFiniteGradientsError, match=r"4 consecutive steps.*param group 0.*"
                                                      r"optimizer\.loss_scale = 2\.\*\*16"):
        overflow_once(opt, model)
    assert_bit_equal(master_params(opt), before)


def test_FP16_Optimizer_a_clean_step_resets_the_consecutive_count():
    model = MixedNet(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         max_consecutive_skips=2)
    x, y = batches(1)[0]
    for overflow in (True, True, False, True, True):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y) * (float("inf") if overflow else 1.0))
        opt.step()
    assert (opt.skipped_steps, opt.consecutive_skips) == (4, 2)


@pytest.mark.parametrize("value", [-1, True, 2.5, "3"])
def test_FP16_Optimizer_rejects_a_bad_max_consecutive_skips(value):
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        FP16_Optimizer(torch.optim.SGD(MixedNet(torch.float16).parameters(), lr=0.1),
                       max_consecutive_skips=value)


# ---------------------------------------------------------------- FP16_Optimizer

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_FP16_Optimizer_trains_like_hand_written_master_weight_loop(device, dtype, opt_cls):
    model = MixedNet(dtype, device)
    ref = Reference(model, 128.0, opt_cls)
    opt = make_fp16_optimizer(model, opt_cls, static_loss_scale=128.0)
    data = batches(5, device)
    train(model, opt, data)
    ref.train(data)
    assert_bit_equal(master_params(opt), ref.masters)
    assert_bit_equal(list(model.parameters()), ref.params)


class TwoDtypeNet(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w16 = nn.Parameter(torch.randn(8, 8, generator=g).half())
        self.wbf = nn.Parameter(torch.randn(3, 8, generator=g).bfloat16())

    def forward(self, x):
        h = (x.half() @ self.w16.t()).float()
        return (h.bfloat16() @ self.wbf.t()).float()


def test_FP16_Optimizer_mixes_fp16_and_bf16_params_across_param_groups():
    model = TwoDtypeNet()
    ref = Reference(model, 16.0)
    inner = torch.optim.SGD([{"params": [model.w16, model.wbf]}, {"params": [], "lr": 0.5}], lr=0.1, momentum=0.9)
    ref.opt = torch.optim.SGD([{"params": ref.masters}, {"params": [], "lr": 0.5}], lr=0.1, momentum=0.9)
    opt = FP16_Optimizer(inner, static_loss_scale=16.0, verbose=False)
    data = batches(3)
    train(model, opt, data)
    ref.train(data)
    assert_bit_equal(master_params(opt), ref.masters)
    assert_bit_equal(list(model.parameters()), ref.params)


def test_FP16_Optimizer_replaces_low_precision_params_with_fp32_masters():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model)
    masters = master_params(opt)
    assert [m.dtype for m in masters] == [torch.float32] * 3
    assert masters[2] is model.b  # fp32 params are their own masters
    assert opt.fp16_groups == [[model.w, model.unused]]
    assert_bit_equal(opt.fp32_from_fp16_groups[0], [model.w.detach().float(), model.unused.detach().float()])


def test_FP16_Optimizer_rekeys_existing_optimizer_state_to_masters():
    model = MixedNet(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inner.state[model.w]["momentum_buffer"] = torch.ones(3, 8, dtype=torch.float16)
    opt = FP16_Optimizer(inner, verbose=False)
    buf = opt.state[opt.fp32_from_fp16_groups[0][0]]["momentum_buffer"]
    assert buf.dtype == torch.float32 and torch.equal(buf, torch.ones(3, 8))


def test_FP16_Optimizer_dynamic_scale_trains_like_reference_when_no_overflow():
    model = MixedNet(torch.float16)
    ref = Reference(model, 2.0**10)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True,
                              dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 1000})
    data = batches(4)
    train(model, opt, data)
    ref.train(data)
    assert opt.loss_scale == 2.0**10
    assert_bit_equal(master_params(opt), ref.masters)


def test_FP16_Optimizer_dynamic_scale_grows_after_scale_window_clean_steps():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True, dynamic_loss_args={
        "init_scale": 2.0**4, "scale_window": 2, "scale_factor": 4.0})
    scales = []
    for x, y in batches(4):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        opt.step()
        scales.append(opt.loss_scale)
    assert scales == [2.0**4, 2.0**6, 2.0**6, 2.0**8]  # amp's scaler honours scale_factor


def snapshot(opt):
    params = [p.detach().clone() for p in master_params(opt)] + [p.detach().clone() for p in opt.all_fp16_params]
    state = copy.deepcopy(opt.optimizer.state_dict()["state"])
    return params, state


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].keys() == b[k].keys()
        for name in a[k]:
            assert torch.equal(torch.as_tensor(a[k][name]), torch.as_tensor(b[k][name])), (k, name)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_overflow_skips_step_bit_identically_and_halves_scale(opt_cls, bad):
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, opt_cls, dynamic_loss_scale=True,
                              dynamic_loss_args={"init_scale": 2.0**8})
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.step()
    before_params, before_state = snapshot(opt)
    opt.zero_grad()
    opt.backward(loss_fn(model, x2, y2), update_master_grads=False)
    model.w.grad[1, 2] = bad  # as a user's bug would
    opt.update_master_grads()
    assert opt.overflow
    assert opt.step() is None
    after_params, after_state = snapshot(opt)
    assert_bit_equal(after_params, before_params)
    assert_same_state(after_state, before_state)
    assert opt.loss_scale == 2.0**7
    assert all(p.grad is None for p in master_params(opt))


def test_overflow_in_fp32_param_grad_is_detected():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y) * 1e-6, update_master_grads=False)
    model.b.grad[0] = float("inf")
    opt.update_master_grads()
    assert opt.overflow


def test_overflow_in_first_of_two_backwards_still_skips():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**8})
    before, _ = snapshot(opt)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    model.b.grad[0] = float("nan")
    opt.update_master_grads()
    opt.backward(loss_fn(model, x2, y2))
    assert opt.overflow
    opt.step()
    assert_bit_equal(snapshot(opt)[0], before)


@pytest.mark.parametrize("dtype", LOW)
def test_backward_twice_accumulates_each_grad_unscaled_once(dtype):
    # Apex's Q9: the second update_master_grads divided the fp32 params' grads by the scale again.
    model = MixedNet(dtype)
    ref = Reference(model, 64.0)
    opt = make_fp16_optimizer(model, static_loss_scale=64.0)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.backward(loss_fn(model, x2, y2))
    ref.backward(loss_fn(ref.model, x, y))
    ref.backward(loss_fn(ref.model, x2, y2))
    assert_bit_equal([p.grad for p in master_params(opt)[:1] + master_params(opt)[2:]],
                     [ref.masters[0].grad, ref.masters[2].grad])
    opt.step()
    ref.step()
    assert_bit_equal(master_params(opt), ref.masters)


def test_deferred_update_accumulates_scaled_model_grads_then_unscales_once():
    # backward(update_master_grads=False) is Apex's accumulation idiom: the scaled model grads
    # add up in the model's dtype and are unscaled once.
    model = MixedNet(torch.float16)
    ref = copy.deepcopy(model)
    opt = make_fp16_optimizer(model, static_loss_scale=64.0)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    opt.backward(loss_fn(model, x2, y2))
    (loss_fn(ref, x, y).float() * 64.0).backward()
    (loss_fn(ref, x2, y2).float() * 64.0).backward()
    masters = master_params(opt)
    assert torch.equal(masters[0].grad, ref.w.grad.float() * (1.0 / 64.0))
    assert torch.equal(masters[2].grad, ref.b.grad * (1.0 / 64.0))


def test_update_master_grads_twice_unscales_once():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, static_loss_scale=64.0)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y))
    grads = [p.grad.clone() for p in master_params(opt) if p.grad is not None]
    opt.update_master_grads()
    assert_bit_equal([p.grad for p in master_params(opt) if p.grad is not None], grads)


def test_step_unscales_grads_left_pending_by_backward():
    model = MixedNet(torch.float16)
    ref = Reference(model, 64.0)
    opt = make_fp16_optimizer(model, static_loss_scale=64.0)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    opt.step()
    ref.backward(loss_fn(ref.model, x, y))
    ref.step()
    assert_bit_equal(master_params(opt), ref.masters)


def test_only_fp32_params_and_unused_params_need_no_fused_call_on_empty_lists():
    model = nn.Linear(8, 3)
    ref = Reference(model, 4.0)
    opt = make_fp16_optimizer(model, static_loss_scale=4.0)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y))
    opt.step()
    ref.backward(loss_fn(ref.model, x, y))
    ref.step()
    assert_bit_equal(master_params(opt), ref.masters)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_clears_master_and_model_grads(set_to_none):
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, static_loss_scale=8.0)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y))
    opt.zero_grad(set_to_none=set_to_none)
    for p in master_params(opt) + opt.all_fp16_params:
        assert p.grad is None if set_to_none else (p.grad is None or not p.grad.any())


def test_clip_master_grads_matches_torch_on_reference_grads():
    model = MixedNet(torch.float16)
    ref = Reference(model, 16.0)
    opt = make_fp16_optimizer(model, static_loss_scale=16.0)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y))
    ref.backward(loss_fn(ref.model, x, y))
    norm = opt.clip_master_grads(0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.masters, 0.1)
    assert torch.equal(norm, ref_norm)
    assert_bit_equal([p.grad for p in master_params(opt) if p.grad is not None],
                     [p.grad for p in ref.masters if p.grad is not None])


def test_clip_master_grads_returns_minus_one_on_overflow():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y) * float("inf"))
    assert opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None


def test_inspect_master_grad_data_returns_master_grads_per_group():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, static_loss_scale=8.0)
    x, y = batches(1)[0]
    opt.backward(loss_fn(model, x, y))
    data = opt.inspect_master_grad_data()
    assert len(data) == 1 and data[0][1] is None
    assert data[0][0].data_ptr() == master_params(opt)[0].grad.data_ptr()


def test_static_scale_closure_step_matches_reference():
    model = MixedNet(torch.float16)
    ref = Reference(model, 32.0)
    opt = make_fp16_optimizer(model, static_loss_scale=32.0)
    for x, y in batches(3):
        def closure():
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            opt.backward(loss)
            return loss
        loss = opt.step(closure)
        ref_loss = loss_fn(ref.model, x, y)
        ref.zero_grad()
        ref.backward(ref_loss)
        ref.step()
        assert torch.equal(loss, ref_loss)
    assert_bit_equal(master_params(opt), ref.masters)


def test_lbfgs_closure_sees_masters_copied_into_model():
    model = MixedNet(torch.float16)
    ref = Reference(model, 32.0, torch.optim.LBFGS)
    opt = make_fp16_optimizer(model, torch.optim.LBFGS, static_loss_scale=32.0)
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        opt.backward(loss)
        return loss

    def ref_closure():
        ref.copy_masters_to_model()
        ref.zero_grad()
        loss = loss_fn(ref.model, x, y)
        ref.backward(loss)
        return loss

    opt.step(closure)
    ref.opt.step(ref_closure)
    ref.copy_masters_to_model()
    assert_bit_equal(master_params(opt), ref.masters)
    assert_bit_equal(list(model.parameters()), ref.params)


def test_dynamic_scale_closure_reruns_after_overflow():
    model = MixedNet(torch.float16)
    ref = Reference(model, 2.0**7)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**8})
    x, y = batches(1)[0]
    calls = []

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        opt.backward(loss * float("inf") if not calls else loss)
        calls.append(opt.overflow)
        return loss

    opt.step(closure)
    ref.backward(loss_fn(ref.model, x, y))
    ref.step()
    assert calls == [True, False]
    assert opt.loss_scale == 2.0**7
    assert_bit_equal(master_params(opt), ref.masters)


def test_closure_that_always_overflows_raises_instead_of_looping():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, dynamic_loss_scale=True, dynamic_loss_args={"min_loss_scale": 1.0})
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y) * float("nan")
        opt.backward(loss)
        return loss

    with pytest.raises(RuntimeError, match="overflowed 65 times in a row"):
        opt.step(closure)
    assert opt.first_closure_call_this_step


def contains_only_tensors_and_numbers(obj):
    if isinstance(obj, dict):
        return all(isinstance(k, (str, int)) and contains_only_tensors_and_numbers(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(contains_only_tensors_and_numbers(v) for v in obj)
    return obj is None or type(obj) in (bool, int, float, str, torch.Tensor)


@pytest.mark.parametrize("dynamic", [False, True])
def test_state_dict_round_trip_resumes_bit_identically(dynamic):
    kwargs = (dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**9, "scale_window": 2})
              if dynamic else dict(static_loss_scale=128.0))
    data = batches(6)
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, torch.optim.Adam, **kwargs)
    train(model, opt, data[:3])
    sd = opt.state_dict()
    assert contains_only_tensors_and_numbers(sd)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": sd}, buf)
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)

    resumed = MixedNet(torch.float16)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the restore, not the construction, must produce the weights
    resumed_opt = make_fp16_optimizer(resumed, torch.optim.Adam, **kwargs)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert resumed_opt.loss_scale == opt.loss_scale

    train(model, opt, data[3:])
    train(resumed, resumed_opt, data[3:])
    assert_bit_equal(master_params(resumed_opt), master_params(opt))
    assert_bit_equal(list(resumed.parameters()), list(model.parameters()))
    assert_same_state(resumed_opt.optimizer.state_dict()["state"], opt.optimizer.state_dict()["state"])
    assert resumed_opt.loss_scale == opt.loss_scale


def test_load_state_dict_rejects_mismatched_checkpoint_without_changing_anything():
    opt = make_fp16_optimizer(MixedNet(torch.float16), static_loss_scale=8.0)
    other = make_fp16_optimizer(nn.Linear(3, 3).half(), static_loss_scale=8.0)
    before, _ = snapshot(opt)
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(other.state_dict())
    dynamic = make_fp16_optimizer(MixedNet(torch.float16), dynamic_loss_scale=True)
    with pytest.raises(ValueError, match="dynamic_loss_scale"):
        opt.load_state_dict(dynamic.state_dict())
    with pytest.raises(KeyError, match="lacks"):
        opt.load_state_dict({"overflow": False})
    assert_bit_equal(snapshot(opt)[0], before)


def test_FP16_Optimizer_bad_param_leaves_optimizer_untouched():
    good, bad = nn.Linear(2, 2).half(), nn.Linear(2, 2).double()
    inner = torch.optim.SGD([{"params": good.parameters()}, {"params": bad.parameters()}], lr=0.1)
    with pytest.raises(TypeError, match=r"param group 1, param 0.*torch.float64"):
        FP16_Optimizer(inner, verbose=False)
    assert inner.param_groups[0]["params"] == list(good.parameters())


def test_FP16_Optimizer_accepts_int_flags_as_apex_did():
    model = MixedNet(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=1, verbose=0)
    assert opt.dynamic_loss_scale is True and opt.verbose is False
    assert opt.loss_scale == 2.0**16


def amp_initialized_sgd(model):
    import amp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model.float(), optimizer, opt_level="O2", verbosity=0)[1]


@pytest.mark.parametrize("make_inner, kwargs, error, match", [
    (None, dict(verbose="False"), TypeError, "verbose must be True or False"),
    (None, dict(verbose=-1), TypeError, "verbose must be True or False"),
    (None, dict(dynamic_loss_scale=True, static_loss_scale="dynamic"), TypeError, "static_loss_scale"),
    (None, dict(dynamic_loss_scale=True, static_loss_scale=float("nan")), ValueError, "static_loss_scale"),
    (None, dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": -1.0}), ValueError, "init_scale"),
    (None, dict(dynamic_loss_scale=True, dynamic_loss_args=[("init_scale", 8.0)]), TypeError, "must be a dict"),
    (None, dict(dynamic_loss_scale=True, dynamic_loss_args={1: 2, "a": 3}), ValueError, r"unknown .*\[1, 'a'\]"),
    (lambda m: FP16_Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), verbose=False).optimizer, {},
     RuntimeError, "already wrapped by an FP16_Optimizer"),
    (amp_initialized_sgd, {}, RuntimeError, "went through amp.initialize"),
])
def test_FP16_Optimizer_rejected_construction_changes_nothing(make_inner, kwargs, error, match):
    model = MixedNet(torch.float16)
    inner = make_inner(model) if make_inner else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = [p for g in inner.param_groups for p in g["params"]]
    values = [p.detach().clone() for p in params]
    state = copy.deepcopy(inner.state_dict())
    attributes = set(vars(inner))
    with pytest.raises(error, match=match):
        FP16_Optimizer(inner, **kwargs)
    assert [p for g in inner.param_groups for p in g["params"]] == params
    assert_bit_equal(params, values)
    assert inner.state_dict() == state and set(vars(inner)) == attributes


def test_FP16_Optimizer_refuses_a_frozen_param_of_a_dtype_it_cannot_unfreeze():
    model = nn.Linear(2, 2).half()
    model.bias.data = model.bias.data.double()
    model.bias.requires_grad_(False)
    with pytest.raises(TypeError, match=r"param 1.*torch.float64"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)


def test_FP16_Optimizer_refuses_pickling():
    import pickle
    opt = make_fp16_optimizer(MixedNet(torch.float16))
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(opt)


def test_loss_scale_and_forwarded_properties():
    model = MixedNet(torch.float16)
    opt = make_fp16_optimizer(model, static_loss_scale=8.0)
    assert opt.loss_scale == 8.0
    opt.loss_scale = 4.0
    assert opt.loss_scale == 4.0
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state


@pytest.mark.parametrize("call, error, match", [
    (lambda m: FP16_Optimizer(m, verbose=False), TypeError, "wraps a torch.optim.Optimizer"),
    (lambda m: FP16_Optimizer(torch.optim.SGD(m.double().parameters(), lr=1.0), verbose=False),
     TypeError, "torch.float64"),
    (lambda m: make_fp16_optimizer(m, static_loss_scale=-1.0), ValueError, "static_loss_scale"),
    (lambda m: make_fp16_optimizer(m, dynamic_loss_scale="yes"), TypeError, "dynamic_loss_scale"),
    (lambda m: make_fp16_optimizer(m, dynamic_loss_scale=True, dynamic_loss_args={"window": 3}),
     ValueError, "unknown dynamic_loss_args"),
    (lambda m: make_fp16_optimizer(m, dynamic_loss_args={"init_scale": 8.0}), ValueError, "only used with"),
    (lambda m: make_fp16_optimizer(m).backward(1.0), TypeError, "loss tensor"),
    (lambda m: make_fp16_optimizer(m).step(closure=3), TypeError, "callable"),
    (lambda m: make_fp16_optimizer(m).zero_grad(set_to_none="yes"), TypeError, "True or False"),
    (lambda m: make_fp16_optimizer(m).load_state_dict([]), TypeError, "expects the dict"),
])
def test_FP16_Optimizer_rejects_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(MixedNet(torch.float16))
