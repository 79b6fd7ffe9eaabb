"""A whole training step under torch.compile: amp O1/O2/O5 vs torch.autocast (+ GradScaler for fp16).

The step (forward, loss, scaled backward, optimizer step, zero_grad) of a small transformer block
(embedding, LayerNorm, qkv + scaled_dot_product_attention, GELU MLP) is compiled whole. For each
configuration the table gives:

* graphs / breaks: ``torch._dynamo.explain`` of one step (taken after an eager one, as a running
  loop would meet it): the graphs compiled and the graph breaks between them;
* late: graphs compiled after the third of ``--steps`` compiled steps (recompiles: a step that
  keeps compiling never settles);
* same bits: whether the compiled run ends on the same parameters (and fp32 masters) as the same
  steps run eagerly; with ``--backend aot_eager`` a step that compiles the same ops gives the same
  bits (inductor generates its own kernels, which round differently);
* first s: the first compiled step (it compiles);
* ms compiled / eager: the median time of the second half of the steps, compiled and eager, the
  two runs stepping alternately.

Three optimizers: torch's ``AdamW`` (its for-loop form), ``AdamW(fused=True)`` (amp's sync-free
path) and ``amp.optimizers.FusedAdam`` (amp only).

    python benchmarks/compiled_step.py                      # inductor, all optimizers
    python benchmarks/compiled_step.py --backend aot_eager --optimizer fused
"""
import argparse
import collections
import statistics
import time
import warnings

import torch
from torch import nn
from torch.nn import functional as F

import amp

CONFIGS = {  # name -> (amp opt level or "autocast", dtype)
    "amp O1 (fp16)": ("O1", torch.float16),
    "amp O2 (fp16)": ("O2", torch.float16),
    "amp O5 (bf16)": ("O5", torch.bfloat16),
    "autocast fp16 + GradScaler": ("autocast", torch.float16),
    "autocast bf16": ("autocast", torch.bfloat16),
}
OPTIMIZERS = ("adamw", "fused", "amp-fused")


class Block(nn.Module):
    def __init__(self, vocab=256, width=64, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
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


def batch(index, vocab=256, size=(8, 32)):
    tokens = torch.randint(0, vocab, size, generator=torch.Generator().manual_seed(index))
    return tokens, torch.roll(tokens, -1, dims=1)


def build(config, optimizer_name):
    """``(model, optimizer, step)`` for ``config``; ``step(tokens, targets)`` runs one training step."""
    kind, dtype = CONFIGS[config]
    torch.manual_seed(0)
    model = Block()
    if optimizer_name == "amp-fused":
        optimizer = amp.optimizers.FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=optimizer_name == "fused")

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    if kind != "autocast":
        model, optimizer = amp.initialize(model, optimizer, opt_level=kind, verbosity=0)

        def step(tokens, targets):
            loss = loss_fn(model(tokens), targets)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
        return model, optimizer, step

    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def step(tokens, targets):
        with torch.autocast("cpu", dtype=dtype):
            logits = model(tokens)
        loss = loss_fn(logits, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return model, optimizer, step


def trained_weights(model, optimizer):
    """The model's parameters and what the optimizer steps (amp's fp32 masters under O2/O5)."""
    return [p.detach().clone() for p in model.parameters()] + [
        p.detach().clone() for group in optimizer.param_groups for p in group["params"]]


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles per step, then hands them on."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.step = 0
        self.compiled = collections.Counter()

    def __call__(self, graph, example_inputs):
        self.compiled[self.step] += 1
        return self.backend(graph, example_inputs)


def timed(step, index):
    start = time.perf_counter()
    step(*batch(index))
    return time.perf_counter() - start


def measure(config, optimizer_name, args):
    torch._dynamo.reset()
    _, _, step = build(config, optimizer_name)
    step(*batch(0))
    explanation = torch._dynamo.explain(step)(*batch(1))

    torch._dynamo.reset()
    model, optimizer, step = build(config, optimizer_name)
    eager_model, eager_optimizer, eager_step = build(config, optimizer_name)
    backend = CountingBackend(args.backend)
    compiled = torch.compile(step, backend=backend)
    times, eager_times = [], []
    for index in range(args.steps):  # alternating, so that a busy spell of the machine hits both
        backend.step = index
        times.append(timed(compiled, index))
        eager_times.append(timed(eager_step, index))
    same_bits = all(torch.equal(a, b) for a, b in zip(trained_weights(model, optimizer),
                                                      trained_weights(eager_model, eager_optimizer)))
    warm = args.steps // 2
    return {"graphs": explanation.graph_count, "breaks": explanation.graph_break_count,
            "late": sum(n for index, n in backend.compiled.items() if index >= 3),
            "same bits": same_bits, "compiled ms": statistics.median(times[warm:]) * 1e3,
            "eager ms": statistics.median(eager_times[warm:]) * 1e3, "first s": times[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS + ("all",), default="all")
    parser.add_argument("--steps", type=int, default=16, help="steps per configuration (at least 4)")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4: compiles after the third step are counted")
    warnings.filterwarnings("ignore", module="torch._dynamo")
    print(f"torch={torch.__version__} backend={args.backend} threads={torch.get_num_threads()} "
          f"amp_C={amp.multi_tensor_apply.multi_tensor_applier.available}")
    print(f"{'config':28} {'optimizer':10} {'graphs':>6} {'breaks':>6} {'late':>5} {'same bits':>9} "
          f"{'first s':>8} {'ms compiled':>11} {'ms eager':>9}")
    names = OPTIMIZERS if args.optimizer == "all" else (args.optimizer,)
    for optimizer_name in names:
        for config in CONFIGS:
            if optimizer_name == "amp-fused" and CONFIGS[config][0] == "autocast":
                continue
            try:
                row = measure(config, optimizer_name, args)
            except Exception as error:  # a step that cannot be compiled is a result too
                print(f"{config:28} {optimizer_name:10} failed: {type(error).__name__}: {error}", flush=True)
                continue
            print(f"{config:28} {optimizer_name:10} {row['graphs']:6d} {row['breaks']:6d} {row['late']:5d} "
                  f"{str(row['same bits']):>9} {row['first s']:8.2f} {row['compiled ms']:11.2f} "
                  f"{row['eager ms']:9.2f}", flush=True)
    print("graphs, breaks: torch._dynamo.explain of one step; late: graphs compiled after the third "
          "step; same bits: compiled run == eager run; ms: median step after warm-up.")


if __name__ == "__main__":
    main()
