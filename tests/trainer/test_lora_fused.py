"""trainer/lora.py's fused LoRA forward: peft's LoRA Linear with the adapter's add inside its GEMM,
the same outputs and gradients as peft's own forward in every state a layer can be in."""

import contextlib
import copy
import io

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as PeftLinear
from torch.autograd.graph import saved_tensors_hooks

from finetune_contract.planner import activation_bytes_per_token, model_config
from trainer import lora
from trainer.config import TrainConfig, load_config
from trainer.lora import _fusable, adapters_disabled, apply_lora, fuse_adapter_adds
from trainer.model import build_model, materialize_weights

WIDTH, OUT, RANK, TOKENS = 24, 40, 4, 6
BF16_TOLERANCE = 3e-2  # of a tensor's norm: a few bf16 roundings (2**-8) apart


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, OUT, bias=True)
        self.down = torch.nn.Linear(OUT, WIDTH, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def peft_and_fused(dropout: float, alpha: int, dtype: torch.dtype, seed: int = 0, **lora):
    """The same adapted module twice: peft's own forward, and fused; B drawn, not zero.
    `lora`: more LoraConfig options (use_rslora, lora_bias, use_dora)."""
    torch.manual_seed(seed)
    peft = TwoLinears()
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=alpha, lora_dropout=dropout,
                                       target_modules=["up", "down"], **lora), peft)
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    peft.to(dtype)
    fused = copy.deepcopy(peft)
    fuse_adapter_adds(fused)
    return peft, fused


def outputs_and_grads(model, x, seed):
    torch.manual_seed(seed)  # the same dropout draws on both sides
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def test_apply_lora_fuses_every_lora_linear_of_a_model():
    config = load_config(None, {"lora_rank": 8})
    model = build_model(config.model)
    apply_lora(model, config)
    lora_layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert lora_layers
    assert {type(m).__name__ for m in lora_layers} == {"FusedLoraLinear"}


# A layer's states: what peft's forward does differently. "fused": the ones _LoraLinear computes.
STATES = {
    "active": True, "eval": True, "rslora": True,
    "disabled": False, "merged": False, "bias on B": False, "dora": False, "two adapters": False,
    "trained base": False, "fp32 adapters": False,  # in bf16 (mixed dtypes)
    "own base forward": False, "adapter absent": False,
}


class DoubledLinear(torch.nn.Linear):
    """A base whose forward is its own (as float8's or a quantized Linear's is)."""

    def forward(self, x):
        return 2 * super().forward(x)


def _in_state(peft, fused, state: str, dtype: torch.dtype) -> None:
    """Put both copies in `state` (the config-time states were made by peft_and_fused)."""
    for model in (peft, fused):
        torch.manual_seed(7)  # the second adapter's draws alike on both
        for layer in (model.up, model.down):
            if state == "merged":
                layer.merge()
            if state == "two adapters":
                layer.update_layer("second", RANK, lora_alpha=8, init_lora_weights=False,
                                   config=LoraConfig(r=RANK, lora_alpha=8))
                layer.set_adapter(["default", "second"])
                layer.to(dtype)
            if state == "trained base":
                layer.base_layer.weight.requires_grad_(True)
            if state == "fp32 adapters":
                layer.lora_A["default"].float()
                layer.lora_B["default"].float()
            if state == "own base forward":
                layer.base_layer.__class__ = DoubledLinear
            if state == "adapter absent":  # active, but not in this layer: peft skips it
                del layer.lora_A["default"], layer.lora_B["default"]
        if state == "eval":
            model.eval()


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("batch", [(2, 3)])  # 3-D, flattened and back
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("alpha", [4, 32])
def test_the_fused_forward_gives_peft_outputs_and_gradients_in_every_layer_state(
        alpha, dropout, dtype, batch, state, monkeypatch):
    options = {"rslora": {"use_rslora": True}, "bias on B": {"lora_bias": True},
               "dora": {"use_dora": True}}.get(state, {})
    peft, fused = peft_and_fused(dropout, alpha, dtype, **options)
    _in_state(peft, fused, state, dtype)
    calls = []
    apply = lora._LoraLinear.apply
    monkeypatch.setattr(lora._LoraLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    x = torch.randn(*batch, WIDTH, dtype=dtype)
    with _maybe_disabled(peft, state), _maybe_disabled(fused, state):
        expected = outputs_and_grads(peft, x, seed=1)
        actual = outputs_and_grads(fused, x, seed=1)
    # the fused path runs exactly where it computes what peft does, dropout's draws included
    mixed = state == "fp32 adapters" and dtype == torch.bfloat16  # fp32 ones on a bf16 base
    fuses = STATES[state] or state == "fp32 adapters" and not mixed
    assert len(calls) == (2 if fuses else 0), (state, dropout)
    assert actual[2].keys() == expected[2].keys()
    pairs = [(actual[0], expected[0]), (actual[1], expected[1]),
             *((actual[2][n], expected[2][n]) for n in expected[2])]
    for fused_value, peft_value in pairs:
        if dtype == torch.float32:  # equal but for the order of one add
            torch.testing.assert_close(fused_value, peft_value, rtol=1e-5, atol=1e-5)
        else:  # bf16: fused rounds once where peft rounds three times, through two layers
            assert _rel(fused_value, peft_value) < BF16_TOLERANCE


def _rel(value, other):
    return float((value.float() - other.float()).norm() / other.float().norm().clamp_min(1e-12))


def _maybe_disabled(model, state):
    return adapters_disabled(model) if state == "disabled" else contextlib.nullcontext()


def test_the_adapter_is_added_in_place_by_a_gemm_in_forward_and_backward():
    """Not peft's separate passes: each adapted output, and each input gradient, gets the
    adapter's part from one in-place GEMM with the scaling in its alpha; no elementwise op runs
    over a layer-wide tensor (only over the rank-wide ones)."""
    _, fused = peft_and_fused(0.0, 8, torch.float32)
    x = torch.randn(TOKENS, WIDTH, requires_grad=True)
    with torch.profiler.profile(record_shapes=True) as prof:
        fused(x).sum().backward()
    ops = [(e.name, e.input_shapes) for e in prof.events()]
    assert sum(name == "trainer::add_matmul_" for name, _ in ops) == 4  # 2 layers, both ways
    for name, shapes in ops:
        if name in ("aten::add", "aten::add_", "aten::mul", "aten::mul_"):
            assert all(RANK in shape for shape in shapes if shape), (name, shapes)


def test_the_fused_forward_compiles_to_the_same_outputs_and_gradients():
    _, fused = peft_and_fused(0.0, 8, torch.float32)
    compiled = copy.deepcopy(fused)
    compiled.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, WIDTH)
    expected, actual = outputs_and_grads(fused, x, 0), outputs_and_grads(compiled, x, 0)
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])
    for name in expected[2]:
        torch.testing.assert_close(actual[2][name], expected[2][name])


def test_a_copied_or_pickled_fused_model_stays_fused():
    _, fused = peft_and_fused(0.0, 8, torch.float32)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(fused), torch.load(buffer, weights_only=False)):
        assert type(copied.up) is type(fused.up)
        assert type(copied.up).__name__ == "FusedLoraLinear"


@pytest.mark.slow
def test_inductor_runs_the_adapter_add_in_place_on_the_gemms_buffer():
    """What the op is for: inductor runs it on the buffer the base GEMM wrote (and, backward,
    on the input gradient's), with no copy of that buffer first, as it would make of a plain
    `addmm_` (inductor's C++ code on the CPU: 20 s)."""
    from torch._inductor.utils import run_and_get_code

    _, fused = peft_and_fused(0.0, 8, torch.float32)
    fused.compile(backend="inductor")
    x = torch.randn(TOKENS, WIDTH, requires_grad=True)
    _, codes = run_and_get_code(lambda: fused(x).sum().backward())
    calls = [line.strip() for code in codes for line in code.splitlines()
             if line.strip().startswith("torch.ops.trainer.add_matmul_")]
    assert len(calls) == 4, calls  # two layers, forward and backward
    written = {line.split("out=")[1].rstrip(")") for code in codes for line in code.splitlines()
               if "extern_kernels.mm(" in line or "extern_kernels.addmm(" in line}
    for call in calls:  # the op's first argument: a GEMM's own output buffer
        assert call.split("(")[1].split(",")[0] in written, call
    assert not any("clone" in code or ".copy_(" in code for code in codes)


def test_an_nf4_base_is_dequantized_as_peft_does_and_gets_no_gradient():
    """QLoRA's frozen NF4 base (trainer/qlora.py): the fused forward dequantizes it as torchao's
    linear does under peft, forward and backward."""
    from torchao.quantization import to_nf4

    from trainer.qlora import scaler_block_size

    peft, fused = peft_and_fused(0.0, 8, torch.bfloat16)
    for layer in (peft.up, peft.down, fused.up, fused.down):
        weight = layer.base_layer.weight.detach()
        layer.base_layer.weight = torch.nn.Parameter(
            to_nf4(weight, 8, scaler_block_size(weight.numel() // 8)), requires_grad=False)
    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16)
    assert _fusable(fused.up, x) and _fusable(fused.down, x)
    expected, actual = outputs_and_grads(peft, x, 0), outputs_and_grads(fused, x, 0)
    assert actual[2].keys() == expected[2].keys()
    assert all("lora_" in name for name in actual[2])
    for fused_value, peft_value in [(actual[0], expected[0]), (actual[1], expected[1]),
                                    *((actual[2][n], expected[2][n]) for n in expected[2])]:
        assert _rel(fused_value, peft_value) < BF16_TOLERANCE


def _saved_bytes(options: dict) -> tuple[int, TrainConfig]:
    """Bytes a training forward of the built-in model keeps for backward (each storage once)."""
    config = load_config(None, {"lora_rank": 4, "seq_len": 64, "micro_batch": 2,
                                "mixed_precision": "bf16", **options})
    model = build_model(config.model)
    apply_lora(model, config)
    materialize_weights(model, config.model, 0, torch.device("cpu"))
    model.to(torch.bfloat16).train()
    ids = torch.randint(0, 100, (config.micro_batch, config.seq_len))
    storages: dict[int, int] = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(keep, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return sum(storages.values()), config


def test_the_planner_counts_what_lora_dropout_keeps_for_backward():
    """With dropout each adapter keeps its dropped input and the mask: the planner's activations
    grow by that, within the inputs dropout no longer keeps (it counts no sharing)."""
    plain, config = _saved_bytes({"lora_dropout": 0.0})
    dropped, dropout_config = _saved_bytes({"lora_dropout": 0.1})
    shape = model_config(config.model, None)
    planned = [activation_bytes_per_token(c, shape)[0] for c in (config, dropout_config)]
    tokens = config.micro_batch * config.seq_len
    measured, counted = dropped - plain, (planned[1] - planned[0]) * tokens
    assert measured > 0 and shape.num_hidden_layers > 1
    assert measured <= counted <= 1.1 * measured
