"""A whole training step under torch.compile: no more graph breaks than autocast + GradScaler's,
no compiles after the first steps, eager amp's bits, and the fused path still sync-free.

amp's work in the step (the scale_loss block's entry and exit, the controller's part of step(),
zero_grad under master weights) runs eagerly under torch.compile, as GradScaler's does; the
model's forward and the optimizer's own step are compiled. ``benchmarks/compiled_step.py``
prints the same counts beside GradScaler's, with timings.
"""
import collections

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp
from amp_common import needs_fused
from test_sync_free import count_host_reads

# The level each amp opt level is compared with: autocast in the same dtype, GradScaler for fp16.
AUTOCAST_DTYPE = {"O1": torch.float16, "O2": torch.float16, "O5": torch.bfloat16}
# Compiling takes a second or two per case: O2 runs by default, O1 and O5 with the slow tests.
LEVELS = ["O2", pytest.param("O1", marks=pytest.mark.slow), pytest.param("O5", marks=pytest.mark.slow)]


class Block(nn.Module):
    """A transformer block: embedding, LayerNorm, qkv + scaled_dot_product_attention, GELU MLP."""

    def __init__(self, vocab=16, width=8, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        batch, seq, width = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, width))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def batch(index):
    tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(index))
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_of(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_optimizer(model, kind):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "fused adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return amp.optimizers.FusedAdam(model.parameters(), lr=1e-2)


def amp_step(opt_level, optimizer_kind="adamw"):
    """``(model, optimizer, step)``: ``step(tokens, targets, inject_inf=False)`` is one amp step."""
    torch.manual_seed(0)
    model = Block()
    model, optimizer = amp.initialize(model, make_optimizer(model, optimizer_kind),
                                      opt_level=opt_level, verbosity=0)

    def step(tokens, targets, inject_inf=False):
        loss = loss_of(model(tokens), targets)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if inject_inf:
                model.head.weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return model, optimizer, step


def grad_scaler_step(dtype):
    torch.manual_seed(0)
    model = Block()
    optimizer = make_optimizer(model, "adamw")
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def step(tokens, targets):
        with torch.autocast("cpu", dtype=dtype):
            logits = model(tokens)
        loss = loss_of(logits, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def explain(step):
    """``torch._dynamo.explain`` of a step taken after an eager one, as a training loop meets it."""
    torch._dynamo.reset()
    step(*batch(0))
    return torch._dynamo.explain(step)(*batch(1))


class CountingBackend:
    """Counts the graphs compiled during each step, then runs them eagerly."""

    def __init__(self, backend="eager"):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.step = 0
        self.graphs = collections.Counter()

    def __call__(self, graph, example_inputs):
        self.graphs[self.step] += 1
        return self.backend(graph, example_inputs)


def run_compiled(step, steps, backend="eager", inject_at=()):
    torch._dynamo.reset()
    counting = CountingBackend(backend)
    compiled = torch.compile(step, backend=counting)
    for index in range(steps):
        counting.step = index
        compiled(*batch(index), inject_inf=index in inject_at)
    return counting.graphs


@pytest.mark.parametrize("opt_level", LEVELS)
def test_compiled_step_breaks_no_more_graphs_than_grad_scaler(opt_level):
    reference = explain(grad_scaler_step(AUTOCAST_DTYPE[opt_level]))
    explanation = explain(amp_step(opt_level)[2])
    assert explanation.graph_break_count <= reference.graph_break_count
    assert explanation.graph_count <= reference.graph_count


@pytest.mark.parametrize("optimizer_kind", [
    "adamw", pytest.param("fused adamw", marks=[needs_fused(torch.optim.AdamW), pytest.mark.slow]),
    pytest.param("amp FusedAdam", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opt_level", LEVELS)
def test_compiled_step_compiles_nothing_after_the_third_step(opt_level, optimizer_kind):
    graphs = run_compiled(amp_step(opt_level, optimizer_kind)[2], steps=8, inject_at={5})
    assert graphs[0] > 0
    assert sum(count for index, count in graphs.items() if index >= 3) == 0, dict(graphs)


@pytest.mark.parametrize("optimizer_kind", [
    pytest.param("fused adamw", marks=needs_fused(torch.optim.AdamW)),
    pytest.param("amp FusedAdam", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opt_level", LEVELS)
def test_compiled_step_trains_bit_identically_to_eager_amp(opt_level, optimizer_kind):
    # aot_eager compiles the forward and backward into graphs of the same ops: the bits can only
    # differ where amp's part of the step does. (torch's for-loop AdamW runs other ops compiled.)
    inject_at = {2} if opt_level != "O5" else set()
    model, optimizer, step = amp_step(opt_level, optimizer_kind)
    run_compiled(step, steps=4, backend="aot_eager", inject_at=inject_at)
    eager_model, eager_optimizer, eager_step = amp_step(opt_level, optimizer_kind)
    for index in range(4):
        eager_step(*batch(index), inject_inf=index in inject_at)
    assert amp.skipped_steps(optimizer).item() == amp.skipped_steps(eager_optimizer).item() == len(inject_at)
    for a, b in zip(list(model.parameters()) + list(amp.master_params(optimizer)),
                    list(eager_model.parameters()) + list(amp.master_params(eager_optimizer))):
        assert torch.equal(a, b)


@needs_fused(torch.optim.AdamW)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_compiled_fused_step_reads_no_host_value(opt_level):
    step = amp_step(opt_level, "fused adamw")[2]
    torch._dynamo.reset()
    counting = CountingBackend()
    compiled = torch.compile(step, backend=counting)
    for index in range(3):
        compiled(*batch(index))
    with count_host_reads() as reads:
        for index in range(3, 6):
            compiled(*batch(index), inject_inf=index == 4 and opt_level != "O5")
    assert reads == []
    assert sum(counting.graphs.values()) == counting.graphs[0]


def test_compiled_step_raises_eager_amps_misuse_errors():
    # The checks run eagerly under torch.compile, so they hold there as in eager mode.
    model, optimizer, _ = amp_step("O2")

    def step_inside_the_block(tokens, targets):
        loss = loss_of(model(tokens), targets)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.step()

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="inside its amp.scale_loss block"):
        torch.compile(step_inside_the_block, backend="eager")(*batch(0))


@pytest.mark.cuda
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_cuda_compiled_fused_step_has_no_sync(opt_level):
    torch.manual_seed(0)
    model = Block().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)

    def step(tokens, targets):
        loss = loss_of(model(tokens), targets)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    compiled = torch.compile(step)
    data = [tuple(t.cuda() for t in batch(index)) for index in range(6)]
    for tokens, targets in data[:3]:
        compiled(tokens, targets)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tokens, targets in data[3:]:
            compiled(tokens, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert amp.skipped_steps(optimizer).item() == 0
