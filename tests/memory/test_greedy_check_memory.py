"""The greedy-generation check of a KV-cache decoder holds one fake-quantized weight at a time (issue 32, Scale).

``compare_greedy`` runs the converted decoder eagerly, step by step. In a ``torch.export``-captured graph every
weight quantizer sits at the top, so a plain forward fake-quantizes *every* weight first and keeps all the float
results alive until their layers run: one extra float copy of the linear weights (w4 GPTQ / RTN compute
``(q - z)·s`` per call), about +1.0x of a 1.1 B decoder's fp32 weights while onnxruntime's session is open too.
The check runs the :func:`~coreai_opt.passes.sink_weight_quantizers.eager_order` view instead, and runs every
eager step before it opens the onnxruntime session. Counted here exactly: at each weight-quantizer call, how many
earlier weight-quantizer outputs are still alive (weak references).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

import coreai_opt as co
from coreai_opt.graph.kv_cache_decoder import DecoderWithCache
from coreai_opt.graph.node_meta import Role, get_meta
from coreai_opt.onnx.verify import generation
from tests.cli.conftest import save_tiny_llama


def _converted_decoder(tmp_path: Path) -> tuple[torch.nn.Module, DecoderWithCache, list[torch.Tensor], Path]:
    hf = co.from_pretrained(save_tiny_llama(tmp_path / "llama"), seq_len=8)
    decoder = DecoderWithCache(hf.model).eval()
    prompts = hf.prompt_ids(["the cat sat on the mat", "a very good movie"])
    example = decoder.example_inputs()
    prepared = co.prepare(decoder, co.QuantizerConfig.presets.w4(algorithm="rtn"), example, capture="export",
                          dynamic_shapes=decoder.capture_dynamic_shapes())
    co.calibrate(prepared, decoder.calibration_batches(prompts, 2), progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, example, tmp_path / "model.onnx", task="text-generation")
    return converted, decoder, prompts, Path(path)


def _count_live_weights(model: torch.fx.GraphModule) -> list[int]:
    """Wrap every weight quantizer; per call, the number of earlier weight results still referenced."""
    alive: list[weakref.ref[torch.Tensor]] = []
    counts: list[int] = []
    for node in model.graph.nodes:
        info = get_meta(node).quantizer
        if node.op != "call_module" or info is None or info.role is not Role.WEIGHT:
            continue
        module = model.get_submodule(node.target)
        inner = module.forward

        def forward(x: torch.Tensor, inner=inner) -> torch.Tensor:  # noqa: ANN001 - bound per module
            counts.append(sum(ref() is not None for ref in alive))
            out = inner(x)
            alive.append(weakref.ref(out))
            return out

        module.forward = forward
    return counts


def test_the_greedy_check_keeps_at_most_one_fake_quantized_weight_alive(tmp_path: Path) -> None:
    converted, decoder, prompts, path = _converted_decoder(tmp_path)
    weights = sum(1 for n in converted.graph.nodes if get_meta(n).quantizer is not None
                  and get_meta(n).quantizer.role is Role.WEIGHT and n.op == "call_module")
    assert weights >= 14  # 2 layers x 7 linears (+ the head)
    counts = _count_live_weights(converted)
    # a plain forward of the converted model: every weight is quantized before the first layer runs
    with torch.no_grad():
        converted(*decoder.example_inputs())
    assert max(counts) == weights - 1
    counts.clear()
    report = generation.compare_greedy(converted, path, prompts, decoder.empty_cache(1), 3)
    assert report.ok and report.total == 6
    assert len(counts) == 2 * 3 * weights and max(counts) <= 1


def test_the_greedy_check_runs_eager_before_opening_the_onnxruntime_session(tmp_path: Path, monkeypatch) -> None:
    converted, decoder, prompts, path = _converted_decoder(tmp_path)
    events: list[str] = []
    session = generation.ort.InferenceSession
    step = generation.eager_step

    def opening(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        events.append("session")
        return session(*args, **kwargs)

    def eager(model):  # noqa: ANN001, ANN202
        inner = step(model)

        def counted(*args):  # noqa: ANN002, ANN202
            events.append("eager")
            return inner(*args)
        return counted

    monkeypatch.setattr(generation.ort, "InferenceSession", opening)
    monkeypatch.setattr(generation, "eager_step", eager)
    report = generation.compare_greedy(converted, path, prompts, decoder.empty_cache(1), 2)
    assert report.total == 4
    assert events == ["eager"] * 4 + ["session"]
