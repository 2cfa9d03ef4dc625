"""Benchmark workloads: parameter lists of real models, flat buffers, many small tensors."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

Shape = tuple[int, ...]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# 1/N for N = 8 micro-batches. A power of two, so scale * src is exact and dst stays finite.
SCALE = 1.0 / 8
QUICK_FLAT_NUMEL = 2**16 + 3  # odd: exercises the masked tail paths
REL_TOL = 1e-6  # the design contract: fp32 results within fp32 rounding of the float64 reference
WORKLOADS = ("gpt2", "llama7b", "small", "moe", "flat")
SMALL = (5000, 1024)  # many small tensors: per-tensor overhead dominates
QUICK_SMALL = (1000, 65)
# A mixture-of-experts list: many small per-expert tensors beside a few large dense ones, so that
# per-tensor cost and bandwidth both matter in one call.
MOE_SMALL, MOE_LARGE = (20000, 256), (4, (4096, 1024))
QUICK_MOE_SMALL, QUICK_MOE_LARGE = (2000, 32), (4, (65539,))
LLAMA7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "n_layer": 32}
LLAMA7B_NUMEL = 6_738_415_616  # 291 tensors
QUICK_LLAMA_DIM_DIVISOR = 128


@dataclass(frozen=True)
class Workload:
    name: str  # what --workloads selects: "gpt2" | "llama7b" | "small" | "flat"
    label: str  # what the table shows: "gpt2-124m", "llama7b-8of32layers", "flat-256M", ...
    shapes: tuple[Shape, ...]
    scale: dict | None = field(default=None, compare=False)  # how a model list was shrunk

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def describe(self) -> dict:
        return {"name": self.name, "label": self.label, "n_tensors": len(self.shapes),
                "numel": self.numel, "scale": self.scale}


# --- model parameter lists ----------------------------------------------------------------------

def gpt2_shapes(
    vocab_size: int = 50257, n_embd: int = 768, n_positions: int = 1024, n_layer: int = 12
) -> list[tuple[str, Shape]]:
    """Named parameter shapes of a GPT-2 model, in HF order (Conv1D weights are (in, out))."""
    e = n_embd
    shapes: list[tuple[str, Shape]] = [
        ("wte.weight", (vocab_size, e)), ("wpe.weight", (n_positions, e))]
    for i in range(n_layer):
        shapes += [
            (f"h.{i}.ln_1.weight", (e,)), (f"h.{i}.ln_1.bias", (e,)),
            (f"h.{i}.attn.c_attn.weight", (e, 3 * e)), (f"h.{i}.attn.c_attn.bias", (3 * e,)),
            (f"h.{i}.attn.c_proj.weight", (e, e)), (f"h.{i}.attn.c_proj.bias", (e,)),
            (f"h.{i}.ln_2.weight", (e,)), (f"h.{i}.ln_2.bias", (e,)),
            (f"h.{i}.mlp.c_fc.weight", (e, 4 * e)), (f"h.{i}.mlp.c_fc.bias", (4 * e,)),
            (f"h.{i}.mlp.c_proj.weight", (4 * e, e)), (f"h.{i}.mlp.c_proj.bias", (e,)),
        ]
    return shapes + [("ln_f.weight", (e,)), ("ln_f.bias", (e,))]


def gpt2_124m_shapes() -> list[tuple[str, Shape]]:
    """GPT-2 small (124M, tied lm_head): 148 tensors, 124,439,808 elements."""
    return gpt2_shapes()


def llama_shapes(vocab_size: int = 32000, hidden_size: int = 4096,
                 intermediate_size: int = 11008, n_layer: int = 32) -> list[tuple[str, Shape]]:
    """Named parameter shapes of a Llama model, in HF order (nn.Linear weights are (out, in))."""
    h, f = hidden_size, intermediate_size
    shapes: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab_size, h))]
    for i in range(n_layer):
        pre = f"model.layers.{i}."
        shapes += [(pre + f"self_attn.{x}_proj.weight", (h, h)) for x in "qkvo"]
        shapes += [(pre + "mlp.gate_proj.weight", (f, h)), (pre + "mlp.up_proj.weight", (f, h)),
                   (pre + "mlp.down_proj.weight", (h, f)),
                   (pre + "input_layernorm.weight", (h,)),
                   (pre + "post_attention_layernorm.weight", (h,))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab_size, h))]


def llama7b_shapes() -> list[tuple[str, Shape]]:
    """Llama-7B (untied lm_head): 291 tensors, 6,738,415,616 elements."""
    return llama_shapes(**LLAMA7B)


def llama_workload(layers: int = 32, dim_divisor: int = 1) -> Workload:
    """Llama-7B's list, keeping ``layers`` of its 32 layers and dividing every dimension.

    Fewer layers keep the real tensor sizes (the GPU default: as many as fit in memory);
    a dimension divisor keeps all 291 tensors (the CPU default: the full list would take
    minutes per call there).
    """
    if not 1 <= layers <= LLAMA7B["n_layer"]:
        raise ValueError(f"llama layers must be in 1..32, got {layers}")
    if dim_divisor < 1:
        raise ValueError(f"llama dim divisor must be >= 1, got {dim_divisor}")
    dims = {k: max(1, LLAMA7B[k] // dim_divisor)
            for k in ("vocab_size", "hidden_size", "intermediate_size")}
    shapes = tuple(s for _, s in llama_shapes(**dims, n_layer=layers))
    label = "llama7b"
    if dim_divisor > 1:
        label += f"-dim1of{dim_divisor}"
    if layers < LLAMA7B["n_layer"]:
        label += f"-{layers}of32layers"
    w = Workload("llama7b", label, shapes)
    if layers == LLAMA7B["n_layer"] and dim_divisor == 1:
        return w
    scale = {"layers": layers, "of_layers": LLAMA7B["n_layer"], "dim_divisor": dim_divisor,
             "fraction_of_full": w.numel / LLAMA7B_NUMEL}
    return Workload(w.name, w.label, w.shapes, scale)


def llama_layers_that_fit(budget_bytes: float, bytes_per_element: float) -> int:
    """The most Llama-7B layers (1..32, full dimensions) whose list fits in ``budget_bytes``."""
    fixed = llama_workload(1).numel - _llama_layer_numel()
    room = budget_bytes / bytes_per_element - fixed
    return max(1, min(LLAMA7B["n_layer"], int(room // _llama_layer_numel())))


def _llama_layer_numel() -> int:
    h, f = LLAMA7B["hidden_size"], LLAMA7B["intermediate_size"]
    return 4 * h * h + 3 * f * h + 2 * h


def fit_llama_layers(device: torch.device, src_itemsize: int, n_sets: int = 2,
                     fraction: float = 0.4) -> int:
    """Layers of Llama-7B whose dst + src sets fit in ``fraction`` of the free GPU memory.

    Counts ``n_sets`` rotated (fp32 dst, src) sets plus one fp32 temporary of the largest
    tensor (the upcast that native grad_dtype accumulation allocates).
    """
    free, _ = torch.cuda.mem_get_info(device)
    largest = LLAMA7B["vocab_size"] * LLAMA7B["hidden_size"] * 4
    return llama_layers_that_fit(fraction * free - largest, n_sets * (4 + src_itemsize))


# --- building a workload --------------------------------------------------------------------

def make_workload(name: str, flat_numel: int = QUICK_FLAT_NUMEL, quick: bool = False, *,
                  llama_layers: int = 32, llama_dim_divisor: int | None = None) -> Workload:
    """The parameter list of a named workload; ``quick`` shrinks the lists but keeps them long.

    ``gpt2``: GPT-2-124M (148 tensors); quick: the same 148 tensors at ~0.7M elements.
    ``llama7b``: see :func:`llama_workload`; quick: all 291 tensors, dimensions / 128.
    ``small``: 5,000 tensors of 1,024 elements; quick: 1,000 of 65.
    ``moe``: 20,000 tensors of 256 elements and 4 of 4096 x 1024; quick: 2,000 of 32 and 4 of
    65,539.
    ``flat``: one buffer of ``flat_numel`` elements.
    """
    if name == "gpt2":
        if quick:
            shapes = gpt2_shapes(vocab_size=1000, n_embd=64, n_positions=128)
            return Workload("gpt2", "gpt2-tiny", tuple(s for _, s in shapes))
        return Workload("gpt2", "gpt2-124m", tuple(s for _, s in gpt2_124m_shapes()))
    if name in ("llama7b", "llama"):
        divisor = llama_dim_divisor or (QUICK_LLAMA_DIM_DIVISOR if quick else 1)
        return llama_workload(llama_layers, divisor)
    if name == "small":
        count, numel = QUICK_SMALL if quick else SMALL
        return Workload("small", f"small-{count}x{format_count(numel)}", ((numel,),) * count)
    if name == "moe":
        (count, numel), (big, shape) = ((QUICK_MOE_SMALL, QUICK_MOE_LARGE) if quick
                                        else (MOE_SMALL, MOE_LARGE))
        label = f"moe-{count}x{format_count(numel)}+{big}x{format_count(math.prod(shape))}"
        return Workload("moe", label, ((numel,),) * count + (shape,) * big)
    if name == "flat":
        return Workload("flat", f"flat-{format_count(flat_numel)}", ((flat_numel,),))
    raise ValueError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")


def bytes_per_element(src_dtype: torch.dtype, overwrite: bool = False) -> int:
    """Minimum traffic per element: read src, read dst (unless overwrite), write dst (fp32)."""
    return src_dtype.itemsize + (0 if overwrite else 4) + 4


def parse_count(text: str) -> int:
    """'256M' -> 268435456 (binary K/M/G suffixes), '65539' -> 65539."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"not an element count: {text!r} (e.g. 65539, 16M, 1G)")
    return int(m[1]) << {"": 0, "k": 10, "m": 20, "g": 30}[m[2].lower()]


def format_count(n: int) -> str:
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def mlp_stack(width: int, blocks: int, device: torch.device | str,
              dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """``blocks`` GPT-2 MLP blocks (Linear(w, 4w), GELU, Linear(4w, w)): the model of the
    wrapper and fused-weight-gradient benchmarks."""
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*layers).to(device, dtype)
